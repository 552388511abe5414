//! The bound on waiting for the inner service to become ready before a call's first attempt.
//!
//! `poll_ready` is where a generated tonic client and `ServiceExt::ready` wait, before `call`
//! (and so before any deadline of the call's own is known): a `tonic::transport::Channel` is a
//! Buffer that stays full while its worker connects to a host that does not answer, and a
//! `ConcurrencyLimit` stays pending while its permits are held. Unbounded, such a wait would
//! outlive every timeout the caller set. [`ReadyBound`] arms a timer at the first `Pending` and
//! ends the wait with a classified error when it fires.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use reason_code::BoxError;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::error::{DeadlineExceeded, ServiceNotReady};

/// A timer over one wait for readiness: armed at the first `Pending`, cleared once ready.
/// Cloning a service does not clone a wait in progress.
#[derive(Default)]
pub(crate) struct ReadyBound {
    timer: Option<Pin<Box<Sleep>>>,
    /// When the wait began (its first `Pending`), until the call that follows takes it.
    since: Option<Instant>,
}

impl Clone for ReadyBound {
    fn clone(&self) -> Self {
        ReadyBound::default()
    }
}

impl fmt::Debug for ReadyBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadyBound")
            .field("waiting", &self.timer.is_some())
            .finish()
    }
}

impl ReadyBound {
    /// How long the call about to be made waited for readiness (zero if it did not wait):
    /// its deadline from `total_timeout` counts from when its caller began to wait.
    pub(crate) fn take_waited(&mut self) -> Duration {
        self.since.take().map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Polls `inner` for readiness, for at most `total_timeout` (when set: the call's deadline,
    /// answered [`DeadlineExceeded`]) and `head_timeout` (else: [`ServiceNotReady`]).
    pub(crate) fn poll_ready<S, Req>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
        total_timeout: Option<Duration>,
        head_timeout: Duration,
    ) -> Poll<Result<(), BoxError>>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
    {
        match inner.poll_ready(cx) {
            Poll::Ready(r) => {
                self.timer = None;
                Poll::Ready(r.map_err(Into::into))
            }
            Poll::Pending => {
                self.since.get_or_insert_with(Instant::now);
                let bound = total_timeout.map_or(head_timeout, |t| t.min(head_timeout));
                let timer = self
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
                if timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.timer = None;
                self.since = None;
                tracing::debug!(
                    waited_ms = bound.as_millis() as u64,
                    "retry: the inner service did not become ready in time; nothing was sent"
                );
                Poll::Ready(Err(match total_timeout {
                    Some(t) if t <= head_timeout => DeadlineExceeded::new().into(),
                    _ => ServiceNotReady::new(bound).into(),
                }))
            }
        }
    }
}

//! Readiness as tower's contract wants it: `poll_ready` never turns a slow inner service into
//! an error (tower reads an error as "discard this service": a `Buffer` fails every later call,
//! `Balance` drops the endpoint, a generated tonic client answers `UNKNOWN`).
//!
//! [`Readiness`] answers `Ready` at once and remembers whether the inner service said ready
//! too. `call` hands the very service that was polled (with whatever it reserved or is waiting
//! for: a `ConcurrencyLimit` permit, a `Buffer` slot) to the response future, which sends at
//! once if it was ready, and else first waits for it there, bounded by the call's deadline or
//! the head bound and counted from the call. A wait abandoned by its caller (a `ready()` under a
//! timeout) leaves nothing behind, and the next call's deadline starts at that call.

use std::fmt;
use std::task::{Context, Poll};

use reason_code::BoxError;
use tower_service::Service;

/// Whether the inner service said ready at the last `poll_ready`. Cloning a service does not
/// clone it (the clone has reserved nothing).
#[derive(Default)]
pub(crate) struct Readiness {
    ready: bool,
}

impl Clone for Readiness {
    fn clone(&self) -> Self {
        Readiness::default()
    }
}

impl fmt::Debug for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Readiness")
            .field("inner_ready", &self.ready)
            .finish()
    }
}

impl Readiness {
    /// Polls `inner` once: `Ready(Ok)` whether or not it is ready yet (the call waits for it in
    /// its future), and its error, if it fails readiness (a service broken for good).
    pub(crate) fn poll<S, Req>(
        &mut self,
        inner: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), BoxError>>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
    {
        match inner.poll_ready(cx) {
            Poll::Ready(Ok(())) => {
                self.ready = true;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                self.ready = false;
                Poll::Ready(Err(e.into()))
            }
            Poll::Pending => {
                self.ready = false;
                Poll::Ready(Ok(()))
            }
        }
    }

    /// True when the inner service said ready at the last poll (and so the call may send at
    /// once); resets for the next call.
    pub(crate) fn take(&mut self) -> bool {
        std::mem::take(&mut self.ready)
    }
}

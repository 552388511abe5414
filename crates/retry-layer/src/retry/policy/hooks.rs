//! The caller's say in retries: a [`retry_if`](super::RetryPolicyBuilder::retry_if) predicate
//! that may decline a retry the table allows, an [`on_retry`](super::RetryPolicyBuilder::on_retry)
//! callback told of each retry, and the per-request [`NoRetry`] opt-out.
//!
//! None of them can make the layer retry what the table does not: what is safe to retry is the
//! design table's to say (a write without a key is never resent, whatever a predicate answers).
//! A request that provably never left (refused before any byte was written) is still sent again
//! within `max_unsent_retries`, as gRPC's transparent retries are: the server never saw it, so
//! neither the predicate nor the opt-out is asked.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use http::HeaderMap;
use reason_code::{Code, Outcome};

/// A request extension that turns retries off for that request: a [`Retry`](crate::Retry)
/// sends it once (plus the transparent retries of an attempt that provably never left, which
/// the server never saw) and keeps no copy of its body; a [`Hedge`](crate::hedge::Hedge) sends
/// no hedge of it.
///
/// ```
/// use retry_layer::NoRetry;
///
/// let mut req = http::Request::post("http://payments.internal/charges").body(()).unwrap();
/// // This caller runs its own reconciliation: one attempt, whatever the answer.
/// req.extensions_mut().insert(NoRetry);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoRetry;

/// What a [`retry_if`](super::RetryPolicyBuilder::retry_if) predicate is shown: a retry the
/// table allows, before the backoff, the deadline and the budget are asked.
#[derive(Debug)]
#[non_exhaustive]
pub struct RetryCandidate<'a> {
    /// The request as it was last sent (its body is not shown).
    pub request: &'a http::request::Parts,
    /// Attempts sent so far, the one that just ended included.
    pub attempt: u32,
    /// How the attempt ended: [`Outcome::Status`] with the code its response was classified
    /// as, or [`Outcome::Ambiguous`] for a transport error or timeout after the request may
    /// have reached the server.
    pub outcome: Outcome,
    /// The outcome's code ([`Code::Unavailable`] for an ambiguous one).
    pub code: Code,
    /// The response's headers; `None` for a transport error or an attempt timeout.
    pub response: Option<&'a HeaderMap>,
}

/// What an [`on_retry`](super::RetryPolicyBuilder::on_retry) callback is told: a retry the layer
/// is about to wait for and send.
#[derive(Debug)]
#[non_exhaustive]
pub struct RetryEvent<'a> {
    /// The request as it was last sent (its body is not shown).
    pub request: &'a http::request::Parts,
    /// Attempts sent so far, the one that just ended included.
    pub attempt: u32,
    /// How the attempt ended ([`Outcome::Unsent`]: it never left).
    pub outcome: Outcome,
    /// The outcome's code ([`Code::Unavailable`] for a transport error or a timeout).
    pub code: Code,
    /// How long the layer waits before the retry (the server's pushback, or the backoff).
    pub delay: Duration,
    /// The retry is a request the rebuild hook is about to make
    /// ([`rebuild_on_conflict`](super::RetryPolicyBuilder::rebuild_on_conflict)).
    pub rebuild: bool,
}

type Predicate = dyn Fn(&RetryCandidate<'_>) -> bool + Send + Sync;
type Callback = dyn Fn(&RetryEvent<'_>) + Send + Sync;

/// The installed `retry_if` predicate.
#[derive(Clone)]
pub(crate) struct RetryIf(pub(crate) std::sync::Arc<Predicate>);

/// The installed `on_retry` callback.
#[derive(Clone)]
pub(crate) struct OnRetry(pub(crate) std::sync::Arc<Callback>);

impl RetryIf {
    /// Whether the predicate allows the retry. A predicate that panics declines it (the attempt's
    /// answer is returned), and the panic is logged: a bug in a predicate never resends a write.
    pub(crate) fn allows(&self, candidate: &RetryCandidate<'_>) -> bool {
        catch_unwind(AssertUnwindSafe(|| (self.0)(candidate))).unwrap_or_else(|_| {
            tracing::error!(
                code = %candidate.code,
                attempt = candidate.attempt,
                "the retry_if predicate panicked: not retrying"
            );
            false
        })
    }
}

impl OnRetry {
    /// Tells the callback; a panic in it is logged, and the retry goes on.
    pub(crate) fn tell(&self, event: &RetryEvent<'_>) {
        if catch_unwind(AssertUnwindSafe(|| (self.0)(event))).is_err() {
            tracing::error!(
                code = %event.code,
                attempt = event.attempt,
                "the on_retry callback panicked; the retry goes on"
            );
        }
    }
}

impl fmt::Debug for RetryIf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("retry_if predicate")
    }
}

impl fmt::Debug for OnRetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("on_retry callback")
    }
}

//! [`Hop`]: one tier of retries across hops.

use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::time::Instant;

use crate::classify::{classify_head, HeadClass};
use crate::headers::{
    parse_grpc_timeout, GRPC_PREVIOUS_RPC_ATTEMPTS, GRPC_RETRY_PUSHBACK_MS, GRPC_TIMEOUT,
    X_PREVIOUS_ATTEMPTS,
};
use crate::reason::{DO_NOT_RETRY, RETRIES_DEFERRED};
use crate::{Outcome, ReasonCodes, RetryTable, Verdict};

tokio::task_local! {
    static CURRENT: Arc<Hop>;
}

/// What a server hop knows of the inbound request it is serving, shared with the outbound
/// calls its handler makes: one tier of retries across hops.
///
/// The rule is "retry at one layer only". With a retrying client at every hop of
/// `client -> A -> B -> C` and C down, each hop's retries multiply the ones above it (3 attempts
/// at 3 hops is 27 attempts at C; with retry budgets still about 1.1 per hop, compounded). Three
/// signals stop that, with no code in the handlers:
///
/// 1. **No retry can help.** When a hop's outbound call ends on a failure because its own
///    downstream said "do not retry", or the deadline the inbound request carried is spent,
///    the hop answers its caller "do not retry": a negative
///    `grpc-retry-pushback-ms` over gRPC (gRFC A6 already means that by it), the reason code
///    [`DO_NOT_RETRY`] over HTTP. The caller returns the failure as it is, and so does every hop
///    above it.
/// 2. **Retried below.** When the hop has done its share of retrying (its attempts ran out, its
///    retry budget refused, the request it serves is a retry and its outbound call sent
///    once, or it stopped on a choice of its own: its `total_timeout` or `max_pushback`), it
///    answers [`RETRIES_DEFERRED`]: the caller may retry, but only within its own
///    adaptive budget (gRFC A6 throttling, which refuses once more than about one call in ten
///    fails). A backend that fails a few requests is still retried past a hop that ran out; a
///    dead one drains every adaptive budget above the bottom hop within a few calls, so it sees
///    about one hop's retries, not a product of them.
/// 3. **The request is already a retry.** A request that arrived with
///    `grpc-previous-rpc-attempts` or `x-previous-attempts` above zero is a retry of the hop
///    above; its handler's outbound calls send once (by default) instead of retrying again
///    underneath.
///
/// A server layer (`retry_layer::hop::HopLayer`) makes a [`Hop`] per request, runs the handler
/// in [`Hop::scope`] (a tokio task-local, so outbound `RetryLayer`s see it through
/// [`Hop::current`]) and marks the response with [`Hop::mark_response`].
///
/// [`DO_NOT_RETRY`]: crate::DO_NOT_RETRY
/// [`RETRIES_DEFERRED`]: crate::RETRIES_DEFERRED
///
/// ```
/// use std::sync::Arc;
/// use http::{HeaderMap, StatusCode};
/// use reason_code::{Hop, ReasonCodes};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut inbound = HeaderMap::new();
/// inbound.insert("x-previous-attempts", "1".parse().unwrap());
/// let hop = Arc::new(Hop::from_request_headers(&inbound));
/// assert!(hop.arrived_as_retry());
///
/// // The handler's outbound retry layer finds the hop, and gives up on its downstream.
/// hop.clone()
///     .scope(async {
///         let hop = Hop::current().expect("in scope");
///         hop.note_gave_up();
///     })
///     .await;
///
/// // The 503 the handler answers with tells the caller not to retry.
/// let mut headers = HeaderMap::new();
/// let reasons = ReasonCodes::default();
/// assert!(hop.mark_response(false, StatusCode::SERVICE_UNAVAILABLE, &mut headers, &reasons));
/// assert_eq!(headers["x-reason-code"], "DO_NOT_RETRY");
/// assert!(reasons.says_do_not_retry(&headers));
/// # }
/// ```
#[derive(Debug, Default)]
pub struct Hop {
    previous_attempts: u32,
    /// The deadline the inbound request carried (its `grpc-timeout`, or one the server layer
    /// knew of): only a deadline the caller set makes a give-up on it "do not retry".
    inbound_deadline: Option<Instant>,
    /// [`NOTHING`], [`DEFERRED`] or [`GAVE_UP`]: the strongest an outbound call noted.
    outcome: AtomicU8,
}

const NOTHING: u8 = 0;
const DEFERRED: u8 = 1;
const GAVE_UP: u8 = 2;

impl Hop {
    /// A hop serving a request that `previous_attempts` attempts preceded (0: not a retry).
    pub fn new(previous_attempts: u32) -> Self {
        Hop {
            previous_attempts,
            inbound_deadline: None,
            outcome: AtomicU8::new(NOTHING),
        }
    }

    /// The hop of a request with these headers: `grpc-previous-rpc-attempts` (gRPC) or
    /// `x-previous-attempts` (HTTP), and the inbound deadline of its `grpc-timeout`. A
    /// malformed attempt count is read as 0 (not a retry), a malformed `grpc-timeout` as no
    /// deadline: the request is served as usual.
    pub fn from_request_headers(headers: &HeaderMap) -> Self {
        let mut hop = Hop::new(previous_attempts(headers));
        if let Some(Ok(timeout)) = headers.get(GRPC_TIMEOUT).map(parse_grpc_timeout) {
            hop.inbound_deadline = Instant::now().checked_add(timeout);
        }
        hop
    }

    /// This hop with the deadline its caller set (the earlier one wins if it already has
    /// one): a server layer that knows of a deadline beyond `grpc-timeout` adds it here.
    pub fn with_inbound_deadline(mut self, deadline: Instant) -> Self {
        self.inbound_deadline = Some(match self.inbound_deadline {
            Some(d) => d.min(deadline),
            None => deadline,
        });
        self
    }

    /// The deadline the request being served carried, if any.
    pub fn inbound_deadline(&self) -> Option<Instant> {
        self.inbound_deadline
    }

    /// True when the inbound request's deadline leaves less than `needed` from now: the caller
    /// cannot fit another attempt through this hop either. Without an inbound deadline, false:
    /// a deadline of this hop's own is its local choice, which says nothing of its caller's.
    pub fn inbound_deadline_leaves_less_than(&self, needed: std::time::Duration) -> bool {
        self.inbound_deadline
            .is_some_and(|d| d.saturating_duration_since(Instant::now()) < needed)
    }

    /// Attempts of the caller that preceded the request being served.
    pub fn previous_attempts(&self) -> u32 {
        self.previous_attempts
    }

    /// True when the request being served is a retry of the hop above.
    pub fn arrived_as_retry(&self) -> bool {
        self.previous_attempts > 0
    }

    /// Records that an outbound call of this hop ended on a failure no retry can help (a
    /// downstream "do not retry", or the inbound request's deadline spent): the hop's answer
    /// says [`DO_NOT_RETRY`]. A give-up on a choice of the hop's own (its `total_timeout`, its
    /// `max_pushback`) is [`note_deferred`](Self::note_deferred): the caller may still retry.
    pub fn note_gave_up(&self) {
        self.outcome.fetch_max(GAVE_UP, Ordering::Relaxed);
    }

    /// Records that an outbound call of this hop has done its share of retrying (attempts ran
    /// out, budget refused, or it sent once under an inbound retry): unless another call gave
    /// up, the hop's answer says [`RETRIES_DEFERRED`].
    pub fn note_deferred(&self) {
        self.outcome.fetch_max(DEFERRED, Ordering::Relaxed);
    }

    /// True when an outbound call of this hop gave up (see [`note_gave_up`](Self::note_gave_up)).
    pub fn gave_up(&self) -> bool {
        self.outcome.load(Ordering::Relaxed) == GAVE_UP
    }

    /// True when an outbound call deferred and none gave up (see
    /// [`note_deferred`](Self::note_deferred)).
    pub fn deferred(&self) -> bool {
        self.outcome.load(Ordering::Relaxed) == DEFERRED
    }

    /// Runs `future` with this hop as [`Hop::current`]. A handler that makes its outbound calls
    /// from a task of its own (`tokio::spawn`) runs that task in the hop's scope too: task-locals
    /// do not cross `spawn`.
    pub fn scope<F: Future>(
        self: Arc<Self>,
        future: F,
    ) -> tokio::task::futures::TaskLocalFuture<Arc<Hop>, F> {
        CURRENT.scope(self, future)
    }

    /// The hop whose scope the current task runs in, if any.
    pub fn current() -> Option<Arc<Hop>> {
        CURRENT.try_with(Arc::clone).ok()
    }

    /// Marks the head of this hop's response when an outbound call gave up or deferred and the
    /// response is a failure the caller would otherwise retry (the default table's verdict for
    /// an idempotent request). Gave up: `grpc-retry-pushback-ms: -1` for gRPC, the reason code
    /// [`DO_NOT_RETRY`] for HTTP. Deferred: the reason code [`RETRIES_DEFERRED`], for both.
    /// Reason codes go in `reasons`' header. Returns true when it marked.
    ///
    /// A gRPC response whose status comes in trailers is committed and never retried: left as
    /// it is.
    pub fn mark_response(
        &self,
        grpc: bool,
        status: StatusCode,
        headers: &mut HeaderMap,
        reasons: &ReasonCodes,
    ) -> bool {
        let outcome = self.outcome.load(Ordering::Relaxed);
        if outcome == NOTHING {
            return false;
        }
        let code = match classify_head(reasons, grpc, status, headers) {
            HeadClass::Decided(code) => code,
            _ => return false,
        };
        let retried = RetryTable::default().verdict(Outcome::Status(code), true) == Verdict::Retry;
        if !retried {
            return false;
        }
        let reason = if outcome == DEFERRED {
            RETRIES_DEFERRED
        } else if grpc {
            headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("-1"));
            return true;
        } else {
            DO_NOT_RETRY
        };
        headers.insert(
            reasons.header_name().clone(),
            HeaderValue::from_static(reason),
        );
        true
    }
}

/// The attempts a request's caller says preceded it: `grpc-previous-rpc-attempts` (gRPC) or
/// `x-previous-attempts` (HTTP). A missing or malformed count is 0 (not a retry).
pub fn previous_attempts(headers: &HeaderMap) -> u32 {
    [GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS]
        .iter()
        .find_map(|name| headers.get(name))
        .map_or(0, parse_previous_attempts)
}

/// The count one of those headers carries (the first found of `grpc-previous-rpc-attempts`,
/// then `x-previous-attempts`): a malformed count is 0. For a reader that finds the header in
/// a pass of its own.
pub fn parse_previous_attempts(value: &HeaderValue) -> u32 {
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GRPC_STATUS;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn attempt_headers_are_read_and_garbage_is_not_a_retry() {
        for (pairs, previous) in [
            (&[][..], 0),
            (&[("x-previous-attempts", "2")][..], 2),
            (&[("grpc-previous-rpc-attempts", "1")][..], 1),
            (&[("x-previous-attempts", "-1")][..], 0),
            (&[("x-previous-attempts", "lots")][..], 0),
            (&[("x-previous-attempts", "99999999999")][..], 0),
        ] {
            let hop = Hop::from_request_headers(&headers(pairs));
            assert_eq!(hop.previous_attempts(), previous, "{pairs:?}");
            assert_eq!(hop.arrived_as_retry(), previous > 0);
        }
    }

    #[test]
    fn only_retryable_failures_of_a_hop_that_gave_up_are_marked() {
        let reasons = ReasonCodes::default();
        let hop = Hop::new(0);
        let mut h = HeaderMap::new();
        assert!(
            !hop.mark_response(false, StatusCode::SERVICE_UNAVAILABLE, &mut h, &reasons),
            "nothing gave up"
        );
        hop.note_gave_up();
        for (status, marked) in [
            (StatusCode::SERVICE_UNAVAILABLE, true),
            (StatusCode::TOO_MANY_REQUESTS, true),
            (StatusCode::OK, false),
            (StatusCode::CREATED, false),
            (StatusCode::BAD_REQUEST, false),
            (StatusCode::INTERNAL_SERVER_ERROR, false),
        ] {
            let mut h = HeaderMap::new();
            assert_eq!(
                hop.mark_response(false, status, &mut h, &reasons),
                marked,
                "{status}"
            );
            assert_eq!(reasons.says_do_not_retry(&h), marked, "{status}");
        }
        // gRPC, trailers-only UNAVAILABLE: the pushback that gRFC A6 reads as "stop".
        let mut h = headers(&[("content-type", "application/grpc"), ("grpc-status", "14")]);
        assert!(hop.mark_response(true, StatusCode::OK, &mut h, &reasons));
        assert_eq!(h[GRPC_RETRY_PUSHBACK_MS], "-1");
        assert_eq!(h[GRPC_STATUS], "14", "the status is left as it is");
        // A deferral is weaker than a give-up: the give-up wins, whatever the order.
        hop.note_deferred();
        assert!(hop.gave_up() && !hop.deferred());
        // A streaming gRPC response (status in trailers) is committed: never marked.
        let mut h = headers(&[("content-type", "application/grpc")]);
        assert!(!hop.mark_response(true, StatusCode::OK, &mut h, &reasons));
        assert!(h.get(GRPC_RETRY_PUSHBACK_MS).is_none());
    }

    #[test]
    fn a_hop_that_deferred_says_so_over_http_and_grpc() {
        let reasons = ReasonCodes::default();
        let hop = Hop::new(1);
        hop.note_deferred();
        assert!(hop.deferred() && !hop.gave_up());
        let mut h = HeaderMap::new();
        assert!(hop.mark_response(false, StatusCode::SERVICE_UNAVAILABLE, &mut h, &reasons));
        assert!(reasons.says_retries_deferred(&h));
        assert!(!reasons.says_do_not_retry(&h));
        let mut h = headers(&[("content-type", "application/grpc"), ("grpc-status", "14")]);
        assert!(hop.mark_response(true, StatusCode::OK, &mut h, &reasons));
        assert!(reasons.says_retries_deferred(&h));
        assert!(h.get(GRPC_RETRY_PUSHBACK_MS).is_none(), "not a stop");
    }

    #[tokio::test(start_paused = true)]
    async fn the_inbound_deadline_comes_from_grpc_timeout() {
        let hop = Hop::from_request_headers(&headers(&[("grpc-timeout", "100m")]));
        let d = hop.inbound_deadline().expect("a deadline");
        assert_eq!(d, Instant::now() + std::time::Duration::from_millis(100));
        assert!(!hop.inbound_deadline_leaves_less_than(std::time::Duration::from_millis(100)));
        assert!(hop.inbound_deadline_leaves_less_than(std::time::Duration::from_millis(101)));
        let hop = Hop::from_request_headers(&headers(&[("grpc-timeout", "soon")]));
        assert_eq!(hop.inbound_deadline(), None, "malformed: no deadline");
        assert!(!hop.inbound_deadline_leaves_less_than(std::time::Duration::MAX));
        let earlier = Instant::now() + std::time::Duration::from_millis(10);
        let hop = Hop::from_request_headers(&headers(&[("grpc-timeout", "1S")]))
            .with_inbound_deadline(earlier);
        assert_eq!(hop.inbound_deadline(), Some(earlier));
    }

    #[tokio::test]
    async fn the_scope_is_seen_inside_and_not_outside() {
        assert!(Hop::current().is_none());
        let hop = Arc::new(Hop::new(1));
        let seen = hop
            .clone()
            .scope(async { Hop::current().map(|h| h.previous_attempts()) })
            .await;
        assert_eq!(seen, Some(1));
        assert!(Hop::current().is_none());
    }
}

//! Business reason codes: a response header such as `x-reason-code: STOCK_CONFLICT` that names
//! why a call failed in the service's own words, mapped onto a [`Code`].

use std::collections::HashMap;
use std::sync::Arc;

use http::header::{HeaderMap, HeaderName};

use crate::headers::X_REASON_CODE;
use crate::Code;

/// The reason code of `idempotency-layer`'s own "a request with this key is still in flight"
/// answer (409 or ABORTED, with `Retry-After` / `grpc-retry-pushback-ms`).
///
/// It maps onto [`Code::Unavailable`]: nothing ran for that attempt, so the client retries the
/// same request with the same key after the pushback, and by then the first request's record is
/// replayed. Every [`ReasonCodes`] knows it, even [`ReasonCodes::empty`].
pub const IDEMPOTENCY_IN_FLIGHT: &str = "IDEMPOTENCY_IN_FLIGHT";

/// The reason code of `idempotency-layer`'s own "request body too large" answer (413, or
/// RESOURCE_EXHAUSTED for gRPC).
///
/// It maps onto [`Code::InvalidArgument`]: the same request can never fit, so no client retries
/// it, though a bare RESOURCE_EXHAUSTED (a rate limit or quota) is retried. Every
/// [`ReasonCodes`] knows it, even [`ReasonCodes::empty`].
pub const REQUEST_TOO_LARGE: &str = "REQUEST_TOO_LARGE";

/// The reason code of a hop whose downstream failure no retry can help: its own downstream
/// said "do not retry" (this same signal, or a negative `grpc-retry-pushback-ms`) or asked for a
/// longer wait than the hop accepts, or the deadline is spent. The HTTP form of gRPC's negative
/// `grpc-retry-pushback-ms`. See [`Hop`](crate::Hop).
///
/// It maps onto [`Code::Unavailable`] (the server records nothing, the budget counts a failure),
/// and a `retry-layer` client that reads it does not retry. Every [`ReasonCodes`] knows it, even
/// [`ReasonCodes::empty`].
pub const DO_NOT_RETRY: &str = "DO_NOT_RETRY";

/// The reason code of a hop that has done its share of retrying: its retries of the
/// downstream failure ran out (attempts exhausted, budget refused, body not replayable), or the
/// request it served was itself a retry and its outbound call sent once. See
/// [`Hop`](crate::Hop).
///
/// It maps onto [`Code::Unavailable`]. A `retry-layer` client that reads it retries only while
/// its own adaptive budget allows (gRFC A6 throttling: while nearly all of its calls succeed),
/// so that a backend failing a few requests is still retried past a hop that ran out, while a
/// dead one is not retried at every hop. Every [`ReasonCodes`] knows it.
pub const RETRIES_DEFERRED: &str = "RETRIES_DEFERRED";

/// The reasons every table knows: the layers' own answers, which both halves must read the same
/// way whatever the user configured.
const PROTOCOL_REASONS: [(&str, Code); 4] = [
    (IDEMPOTENCY_IN_FLIGHT, Code::Unavailable),
    (REQUEST_TOO_LARGE, Code::InvalidArgument),
    (DO_NOT_RETRY, Code::Unavailable),
    (RETRIES_DEFERRED, Code::Unavailable),
];

/// The user-extensible map from business reason codes to [`Code`]s, and the header they travel in.
///
/// A reason code in a response refines a failure: it takes precedence over a failed HTTP or
/// gRPC status (a 409 that says `UPSTREAM_UNAVAILABLE` is retried like a 503), never over a
/// success (a 201 that carries one is OK; see [`classify_head`](crate::classify_head)). Names match exactly (they are identifiers, not
/// prose). Cloning is cheap (the map is shared).
///
/// ```
/// use http::HeaderMap;
/// use reason_code::{Code, ReasonCodes};
///
/// let reasons = ReasonCodes::default().with("INVENTORY_LOCKED", Code::Unavailable);
/// let mut headers = HeaderMap::new();
/// headers.insert("x-reason-code", "STOCK_CONFLICT".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), Some(Code::Aborted));
/// headers.insert("x-reason-code", "INVENTORY_LOCKED".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), Some(Code::Unavailable));
/// headers.insert("x-reason-code", "SOMETHING_ELSE".parse().unwrap());
/// assert_eq!(reasons.classify(&headers), None);
/// ```
#[derive(Debug, Clone)]
pub struct ReasonCodes {
    header: HeaderName,
    map: Arc<HashMap<Box<str>, Code>>,
}

impl Default for ReasonCodes {
    /// `x-reason-code` with UPSTREAM_UNAVAILABLE -> UNAVAILABLE, RATE_LIMITED ->
    /// RESOURCE_EXHAUSTED, STOCK_CONFLICT -> ABORTED.
    fn default() -> Self {
        ReasonCodes::empty()
            .with("UPSTREAM_UNAVAILABLE", Code::Unavailable)
            .with("RATE_LIMITED", Code::ResourceExhausted)
            .with("STOCK_CONFLICT", Code::Aborted)
    }
}

impl ReasonCodes {
    /// A table with no entries of its own (it still knows [`IDEMPOTENCY_IN_FLIGHT`] and
    /// [`REQUEST_TOO_LARGE`]), read from `x-reason-code`.
    pub fn empty() -> Self {
        ReasonCodes {
            header: X_REASON_CODE,
            map: Arc::default(),
        }
    }

    /// Adds (or replaces) the mapping of `reason` to `code`.
    pub fn with(mut self, reason: impl Into<String>, code: Code) -> Self {
        Arc::make_mut(&mut self.map).insert(reason.into().into_boxed_str(), code);
        self
    }

    /// Reads reason codes from another header.
    pub fn header(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// The header reason codes are read from.
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }

    /// The code a reason maps to, if it is in the table or is one of the idempotency layer's own
    /// reasons.
    pub fn get(&self, reason: &str) -> Option<Code> {
        if let Some(code) = self.map.get(reason) {
            return Some(*code);
        }
        PROTOCOL_REASONS
            .iter()
            .find(|(name, _)| *name == reason)
            .map(|(_, code)| *code)
    }

    /// The code named by the reason-code header of `headers`, if the header is present, single,
    /// and names a known reason. Unknown reasons are ignored: the status decides.
    pub fn classify(&self, headers: &HeaderMap) -> Option<Code> {
        self.get(self.reason(headers)?)
    }

    /// True when `headers` carry [`IDEMPOTENCY_IN_FLIGHT`]: a request with the same key was in
    /// flight at the server, and nothing ran for this one.
    pub fn says_in_flight(&self, headers: &HeaderMap) -> bool {
        self.reason(headers) == Some(IDEMPOTENCY_IN_FLIGHT)
    }

    /// True when `headers` carry [`DO_NOT_RETRY`]: no retry can help, the caller must not
    /// retry.
    pub fn says_do_not_retry(&self, headers: &HeaderMap) -> bool {
        self.reason(headers) == Some(DO_NOT_RETRY)
    }

    /// True when `headers` carry [`RETRIES_DEFERRED`]: the server's hop has done its share of
    /// retrying; the caller retries only within its adaptive budget.
    pub fn says_retries_deferred(&self, headers: &HeaderMap) -> bool {
        self.reason(headers) == Some(RETRIES_DEFERRED)
    }

    /// The reason named by the reason-code header, trimmed.
    fn reason<'h>(&self, headers: &'h HeaderMap) -> Option<&'h str> {
        Some(headers.get(&self.header)?.to_str().ok()?.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_reason(reason: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(X_REASON_CODE, reason.parse().unwrap());
        h
    }

    #[test]
    fn protocol_reasons_are_known_by_every_table() {
        for reasons in [ReasonCodes::default(), ReasonCodes::empty()] {
            assert_eq!(
                reasons.classify(&with_reason(IDEMPOTENCY_IN_FLIGHT)),
                Some(Code::Unavailable)
            );
            assert_eq!(
                reasons.classify(&with_reason(REQUEST_TOO_LARGE)),
                Some(Code::InvalidArgument)
            );
        }
        assert_eq!(
            ReasonCodes::empty().classify(&with_reason("STOCK_CONFLICT")),
            None
        );
    }

    #[test]
    fn a_user_entry_replaces_a_protocol_reason() {
        let reasons = ReasonCodes::empty().with(IDEMPOTENCY_IN_FLIGHT, Code::Aborted);
        assert_eq!(
            reasons.classify(&with_reason(IDEMPOTENCY_IN_FLIGHT)),
            Some(Code::Aborted)
        );
    }
}

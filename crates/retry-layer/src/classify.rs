//! Reducing an attempt's result to an [`Outcome`] and reading server pushback.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response};
use reason_code::{
    classify_head, parse_grpc_pushback, parse_grpc_retry_info, parse_grpc_status,
    parse_retry_after, BoxError, Code, HeadClass, Outcome, Pushback, ReasonCodes,
    GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS, GRPC_STATUS_DETAILS_BIN, IDEMPOTENT_REPLAYED,
};

use crate::error::{
    AttemptTimedOut, DeadlineExceeded, ResponseHeadTimedOut, RetryError, RetryErrorKind,
    ServiceNotReady,
};

/// Classifies a response with the one classifier both layers call
/// ([`reason_code::classify_head`]), plus one rule of the client's own.
///
/// - [`HeadClass::AtEnd`]: a gRPC response that has started streaming is committed (gRFC A6):
///   final, and counted as a success by the budget, whatever its trailers say later.
/// - 421 Misdirected Request (RFC 9110 §15.5.20) and 425 Too Early (RFC 8470 §5.2) were not
///   processed by the server: unsent, retried for any method. The rule applies only where the
///   HTTP status is what decided, that is when the head carries neither a business reason code
///   nor a `grpc-status`: those say more than the status does.
pub(crate) fn response<B>(res: &Response<B>, grpc: bool, reasons: &ReasonCodes) -> Outcome {
    let headers = res.headers();
    let status = res.status();
    let code = match classify_head(reasons, grpc, status, headers) {
        HeadClass::AtEnd => return Outcome::Status(Code::Ok),
        HeadClass::Decided(code) => code,
        // `HeadClass` is non-exhaustive: a class this layer does not know yet is not a success.
        _ => return Outcome::Status(Code::Unknown),
    };
    if matches!(status.as_u16(), 421 | 425) && decided_by_status(res, grpc, reasons) {
        return Outcome::Unsent;
    }
    if code == Code::Unknown && grpc {
        warn_if_malformed_grpc_status(headers);
    }
    Outcome::Status(code)
}

/// True when the response is a replay of a recorded outcome (`idempotent-replayed: true`, as
/// an idempotency layer marks it): final, whatever its status, since every replay of the same
/// key answers the same.
pub(crate) fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"true"))
}

/// True when nothing in the head but its HTTP status spoke: no reason code the table knows, no
/// `grpc-status` on a gRPC call.
fn decided_by_status<B>(res: &Response<B>, grpc: bool, reasons: &ReasonCodes) -> bool {
    let headers = res.headers();
    reasons.classify(headers).is_none() && !(grpc && headers.contains_key(GRPC_STATUS))
}

/// The classifier reads a malformed `grpc-status` as UNKNOWN (never a success); say so, since
/// it usually means a broken proxy.
fn warn_if_malformed_grpc_status(headers: &HeaderMap) {
    if let Some(Err(e)) = headers.get(GRPC_STATUS).map(parse_grpc_status) {
        tracing::warn!(error = %e, "malformed grpc-status: treated as UNKNOWN");
    }
}

/// What the server asked about the next attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushbackHint {
    /// No (usable) pushback: use the computed backoff.
    None,
    /// Wait this long instead.
    After(Duration),
    /// Do not retry.
    Stop,
    /// A hop below did not retry for the other tiers' sake
    /// ([`RETRIES_DEFERRED`](reason_code::RETRIES_DEFERRED)): retry only within the adaptive
    /// budget.
    Deferred,
}

/// Reads, in this order, the reason codes [`DO_NOT_RETRY`](reason_code::DO_NOT_RETRY) and
/// [`RETRIES_DEFERRED`](reason_code::RETRIES_DEFERRED), `grpc-retry-pushback-ms` (gRFC A6), the
/// `google.rpc.RetryInfo` in `grpc-status-details-bin` (AIP-194), and `Retry-After` (HTTP).
///
/// As gRFC A6 says, a negative or malformed `grpc-retry-pushback-ms` stops retries, and so does
/// `DO_NOT_RETRY` (a hop below gave up: see [`hop`](crate::hop)). Malformed details and a
/// malformed `Retry-After` are ignored with a warning: they are advisory.
pub(crate) fn pushback(headers: &HeaderMap, reasons: &ReasonCodes) -> PushbackHint {
    if reasons.says_do_not_retry(headers) {
        return PushbackHint::Stop;
    }
    if reasons.says_retries_deferred(headers) {
        return PushbackHint::Deferred;
    }
    if let Some(v) = headers.get(GRPC_RETRY_PUSHBACK_MS) {
        return match parse_grpc_pushback(v) {
            Ok(Pushback::After(d)) => PushbackHint::After(d),
            // Stop, and any pushback a later reason-code may add that this client does not know:
            // the safe reading of a server's pushback is "do not retry".
            Ok(_) => PushbackHint::Stop,
            Err(e) => {
                tracing::warn!(error = %e, "malformed grpc-retry-pushback-ms: not retrying");
                PushbackHint::Stop
            }
        };
    }
    if let Some(v) = headers.get(GRPC_STATUS_DETAILS_BIN) {
        match parse_grpc_retry_info(v) {
            Ok(Some(d)) => return PushbackHint::After(d),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "ignoring malformed grpc-status-details-bin"),
        }
    }
    if let Some(v) = headers.get(http::header::RETRY_AFTER) {
        match parse_retry_after(v, SystemTime::now()) {
            Ok(d) => return PushbackHint::After(d),
            Err(e) => tracing::warn!(error = %e, "ignoring malformed Retry-After"),
        }
    }
    PushbackHint::None
}

/// Classifies a transport error from its source chain: provably unsent (connect refused, DNS,
/// TLS, a connect timeout, h2 `REFUSED_STREAM`, a GOAWAY beyond the stream) or ambiguous (anything that may have happened after the request left).
/// How an error the layer answers with ended the call, for [`RetryError::kind`].
pub(crate) fn error_kind(err: &BoxError) -> RetryErrorKind {
    let e = err.as_ref();
    if e.is::<DeadlineExceeded>() {
        return RetryErrorKind::DeadlineExceeded;
    }
    if e.is::<ServiceNotReady>() {
        return RetryErrorKind::NotReady;
    }
    if e.is::<AttemptTimedOut>() || e.is::<ResponseHeadTimedOut>() {
        return RetryErrorKind::TimedOut;
    }
    match error(err) {
        Outcome::Unsent => RetryErrorKind::NotSent,
        _ => RetryErrorKind::Ambiguous,
    }
}

pub(crate) fn error(err: &BoxError) -> Outcome {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err.as_ref());
    let mut sent_below = false;
    while let Some(e) = cur {
        if e.is::<AttemptTimedOut>() || e.is::<ResponseHeadTimedOut>() {
            return Outcome::Ambiguous;
        }
        // A layer below (a hedge, another retry) whose service never became ready for its
        // first attempt sent nothing.
        if let Some(r) = e.downcast_ref::<RetryError>() {
            sent_below |= r.attempts() > 0;
        }
        if e.is::<ServiceNotReady>() && !sent_below {
            return Outcome::Unsent;
        }
        #[cfg(feature = "hyper-util")]
        if let Some(outcome) = hyper_error(e) {
            return outcome;
        }
        #[cfg(feature = "reqwest")]
        if reqwest_connect_error(e) {
            return Outcome::Unsent;
        }
        // A tonic `Channel` that could not connect (refused, DNS, TLS, connect timeout): the
        // request never left, as hyper-util's `is_connect` says.
        #[cfg(feature = "tonic")]
        if e.is::<tonic::ConnectError>() {
            return Outcome::Unsent;
        }
        if let Some(e) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(e.kind(), ConnectionRefused | AddrNotAvailable) {
                return Outcome::Unsent;
            }
        }
        cur = e.source();
    }
    Outcome::Ambiguous
}

/// A hyper-util client or h2 error that proves the request was never sent.
#[cfg(feature = "hyper-util")]
fn hyper_error(e: &(dyn StdError + 'static)) -> Option<Outcome> {
    if let Some(e) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
        if e.is_connect() {
            return Some(Outcome::Unsent);
        }
    }
    if let Some(e) = e.downcast_ref::<h2::Error>() {
        if e.reason() == Some(h2::Reason::REFUSED_STREAM) {
            return Some(Outcome::Unsent);
        }
        // The server's GOAWAY is delivered as an error only to streams beyond its
        // last-stream-id, which it promises it did not process, whatever its error code; the
        // streams it covers end with the connection (an I/O error: ambiguous).
        if e.is_go_away() && e.is_remote() {
            return Some(Outcome::Unsent);
        }
    }
    None
}

/// A reqwest error that failed to connect: the request never left (reqwest's transport
/// errors hide their source chain behind `reqwest_middleware::Error`'s transparent variant).
#[cfg(feature = "reqwest")]
fn reqwest_connect_error(e: &(dyn StdError + 'static)) -> bool {
    let e = match e.downcast_ref::<reqwest_middleware::Error>() {
        Some(reqwest_middleware::Error::Reqwest(e)) => e,
        Some(_) => return false,
        None => match e.downcast_ref::<reqwest::Error>() {
            Some(e) => e,
            None => return false,
        },
    };
    e.is_connect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(status: u16, headers: &[(&'static str, &'static str)]) -> Response<()> {
        let mut r = Response::builder().status(status);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(()).unwrap()
    }

    #[test]
    fn reason_code_wins_over_status() {
        let r = res(409, &[("x-reason-code", "UPSTREAM_UNAVAILABLE")]);
        assert_eq!(
            response(&r, false, &ReasonCodes::default()),
            Outcome::Status(Code::Unavailable)
        );
        let r = res(409, &[("x-reason-code", "SOMETHING_NEW")]);
        assert_eq!(
            response(&r, false, &ReasonCodes::default()),
            Outcome::Status(Code::Aborted)
        );
    }

    #[test]
    fn grpc_committed_and_trailers_only() {
        let reasons = ReasonCodes::default();
        let r = res(200, &[("content-type", "application/grpc")]);
        assert_eq!(response(&r, true, &reasons), Outcome::Status(Code::Ok));
        let r = res(200, &[("grpc-status", "14")]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::Unavailable)
        );
        let r = res(200, &[("grpc-status", "garbage")]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::Unknown),
            "malformed = UNKNOWN, never OK"
        );
        let r = res(503, &[]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::Unavailable)
        );
    }

    /// The gRPC spec's HTTP-to-gRPC mapping for responses without `grpc-status`.
    #[test]
    fn grpc_non_200_statuses() {
        let reasons = ReasonCodes::default();
        for (status, code) in [
            (400, Code::Internal),
            (401, Code::Unauthenticated),
            (403, Code::PermissionDenied),
            (404, Code::Unimplemented),
            (429, Code::Unavailable),
            (502, Code::Unavailable),
            (503, Code::Unavailable),
            (504, Code::Unavailable),
            (500, Code::Unknown),
            (409, Code::Unknown),
        ] {
            let r = res(status, &[("content-type", "application/grpc")]);
            assert_eq!(
                response(&r, true, &reasons),
                Outcome::Status(code),
                "{status}"
            );
        }
        // grpc-status wins over the HTTP status.
        let r = res(503, &[("grpc-status", "5")]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::NotFound)
        );
    }

    #[test]
    fn a_reason_code_never_overrides_a_committed_grpc_response() {
        let reasons = ReasonCodes::default();
        let r = res(
            200,
            &[
                ("content-type", "application/grpc"),
                ("x-reason-code", "UPSTREAM_UNAVAILABLE"),
            ],
        );
        assert_eq!(response(&r, true, &reasons), Outcome::Status(Code::Ok));
        // Trailers-only: not committed, the reason code wins.
        let r = res(
            200,
            &[
                ("grpc-status", "10"),
                ("x-reason-code", "IDEMPOTENCY_IN_FLIGHT"),
            ],
        );
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::Unavailable)
        );
    }

    #[test]
    fn misdirected_and_too_early_were_not_processed() {
        let reasons = ReasonCodes::default();
        assert_eq!(response(&res(421, &[]), false, &reasons), Outcome::Unsent);
        assert_eq!(response(&res(425, &[]), false, &reasons), Outcome::Unsent);
        assert_eq!(response(&res(421, &[]), true, &reasons), Outcome::Unsent);
        // A reason code or a grpc-status says more than the status.
        let r = res(421, &[("x-reason-code", "STOCK_CONFLICT")]);
        assert_eq!(
            response(&r, false, &reasons),
            Outcome::Status(Code::Aborted)
        );
        let r = res(425, &[("grpc-status", "5")]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::NotFound)
        );
        // On an HTTP call a grpc-status is just a header.
        assert_eq!(response(&r, false, &reasons), Outcome::Unsent);
    }

    #[test]
    fn pushback_rules() {
        let h = |k: &'static str, v: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(k, v.parse().unwrap());
            m
        };
        let pushback = |h: &HeaderMap| pushback(h, &ReasonCodes::default());
        assert_eq!(
            pushback(&h("x-reason-code", "DO_NOT_RETRY")),
            PushbackHint::Stop,
            "a hop below gave up"
        );
        assert_eq!(
            pushback(&h("x-reason-code", "RETRIES_DEFERRED")),
            PushbackHint::Deferred
        );
        assert_eq!(
            pushback(&h("x-reason-code", "UPSTREAM_UNAVAILABLE")),
            PushbackHint::None
        );
        assert_eq!(
            pushback(&h("retry-after", "2")),
            PushbackHint::After(Duration::from_secs(2))
        );
        assert_eq!(pushback(&h("retry-after", "soon")), PushbackHint::None);
        assert_eq!(
            pushback(&h("grpc-retry-pushback-ms", "10")),
            PushbackHint::After(Duration::from_millis(10))
        );
        assert_eq!(
            pushback(&h("grpc-retry-pushback-ms", "-1")),
            PushbackHint::Stop
        );
        assert_eq!(
            pushback(&h("grpc-retry-pushback-ms", "x")),
            PushbackHint::Stop
        );
        assert_eq!(pushback(&HeaderMap::new()), PushbackHint::None);
    }

    #[test]
    fn transport_errors() {
        let refused: BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(error(&refused), Outcome::Unsent);
        let reset: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(error(&reset), Outcome::Ambiguous);
        let refused_stream: BoxError = Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM));
        assert_eq!(error(&refused_stream), Outcome::Unsent);
        let timeout: BoxError = Box::new(AttemptTimedOut::new());
        assert_eq!(error(&timeout), Outcome::Ambiguous);
        let other: BoxError = "something".into();
        assert_eq!(error(&other), Outcome::Ambiguous);
    }
}

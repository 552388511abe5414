//! Reducing an attempt's result to an [`Outcome`] and reading server pushback.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, Response, StatusCode};
use reason_code::{
    parse_grpc_pushback, parse_grpc_status, parse_retry_after, Code, Outcome, Pushback,
    ReasonCodes, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS,
};

use crate::error::AttemptTimedOut;
use crate::BoxError;

/// Classifies a response. A business reason code wins over the status. A gRPC response whose
/// headers carry no `grpc-status` has started streaming: it is committed (gRFC A6) and final.
pub(crate) fn response<B>(res: &Response<B>, grpc: bool, reasons: &ReasonCodes) -> Outcome {
    let headers = res.headers();
    if let Some(code) = reasons.classify(headers) {
        return Outcome::Status(code);
    }
    if grpc {
        if let Some(v) = headers.get(GRPC_STATUS) {
            match parse_grpc_status(v) {
                Ok(code) => return Outcome::Status(code),
                Err(e) => tracing::warn!(error = %e, "ignoring malformed grpc-status"),
            }
        }
        if res.status() == StatusCode::OK {
            return Outcome::Status(Code::Ok);
        }
    }
    Outcome::Status(Code::from_http_status(res.status()))
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
}

/// Reads `grpc-retry-pushback-ms` (gRPC) or `Retry-After` (HTTP).
///
/// As gRFC A6 says, a negative or malformed `grpc-retry-pushback-ms` stops retries. A malformed
/// `Retry-After` is ignored with a warning: HTTP gives it no such meaning.
pub(crate) fn pushback(headers: &HeaderMap) -> PushbackHint {
    if let Some(v) = headers.get(GRPC_RETRY_PUSHBACK_MS) {
        return match parse_grpc_pushback(v) {
            Ok(Pushback::After(d)) => PushbackHint::After(d),
            Ok(Pushback::Stop) => PushbackHint::Stop,
            Err(e) => {
                tracing::warn!(error = %e, "malformed grpc-retry-pushback-ms: not retrying");
                PushbackHint::Stop
            }
        };
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
/// h2 `REFUSED_STREAM`) or ambiguous (anything that may have happened after the request left).
pub(crate) fn error(err: &BoxError) -> Outcome {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err.as_ref());
    while let Some(e) = cur {
        if e.is::<AttemptTimedOut>() {
            return Outcome::Ambiguous;
        }
        if let Some(e) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            if e.is_connect() {
                return Outcome::Unsent;
            }
        }
        if let Some(e) = e.downcast_ref::<h2::Error>() {
            if e.reason() == Some(h2::Reason::REFUSED_STREAM) {
                return Outcome::Unsent;
            }
            // A graceful GOAWAY is delivered as an error only to streams beyond its
            // last-stream-id, which the server promises it did not process.
            if e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR) {
                return Outcome::Unsent;
            }
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

/// Safe and idempotent HTTP methods (RFC 9110 §9.2).
pub(crate) fn is_idempotent_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
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
            Outcome::Status(Code::Ok),
            "malformed = absent"
        );
        let r = res(503, &[]);
        assert_eq!(
            response(&r, true, &reasons),
            Outcome::Status(Code::Unavailable)
        );
    }

    #[test]
    fn pushback_rules() {
        let h = |k: &'static str, v: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(k, v.parse().unwrap());
            m
        };
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

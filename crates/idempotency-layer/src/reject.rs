//! Rejections: the responses the layer answers itself, as HTTP problem details or gRPC
//! trailers-only responses.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Response, StatusCode};
use reason_code::{
    encode_grpc_message, Code, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS,
    IDEMPOTENCY_IN_FLIGHT, REQUEST_TOO_LARGE,
};

use crate::body::IdempotencyBody;
use crate::protocol::Protocol;

/// Why a request was answered by the layer instead of the handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// A write without an idempotency key (400 / INVALID_ARGUMENT).
    MissingKey,
    /// A key that breaks a rule (400 / INVALID_ARGUMENT).
    InvalidKey,
    /// No tenant where one is required (401 / UNAUTHENTICATED).
    NoTenant,
    /// The key was used with another request (422 / FAILED_PRECONDITION).
    Mismatch,
    /// The request body is larger than `max_request_bytes` (413 / RESOURCE_EXHAUSTED).
    TooLarge,
    /// The request body could not be read (400 / INVALID_ARGUMENT).
    BadBody,
    /// The request body did not arrive within `request_body_timeout` (408 / DEADLINE_EXCEEDED):
    /// nothing was claimed, nothing ran.
    BodyTimeout,
    /// A duplicate is in flight and the layer rejects, or the wait ran out (409 / ABORTED).
    InFlight,
    /// The request in flight that a duplicate waited for failed with no answer to share (its
    /// handler returned an error, or its response broke off), and nothing was recorded
    /// (503 / UNAVAILABLE): the key is free again, the client's retry runs it.
    InFlightFailed,
    /// The store failed and the layer fails closed (503 / UNAVAILABLE).
    StoreUnavailable,
    /// The store has no room for a new claim (503 / UNAVAILABLE): nothing ran, even with
    /// `fail_open` (a full store is not a store that is down).
    StoreFull,
    /// The layer is draining ([`IdempotencyLayer::drain`](crate::IdempotencyLayer::drain):
    /// the server is shutting down) and takes no new write (503 / UNAVAILABLE): nothing ran; a
    /// retry reaches another instance, or this one once it is back.
    ShuttingDown,
    /// The service under the layer did not become ready within
    /// [`max_wait`](crate::IdempotencyLayer::max_wait) (or the request's `grpc-timeout`) after
    /// the write's request body arrived (503 / UNAVAILABLE): nothing was claimed, nothing ran. A
    /// body that is not at hand holds none of the service's capacity (a `ConcurrencyLimit`
    /// permit) while it comes; the service is readied again once the body is read.
    Overloaded,
    /// The handler panicked or its task was lost (500 / INTERNAL).
    Internal,
}

impl RejectReason {
    /// Every reason, in declaration order.
    pub const ALL: [RejectReason; 14] = [
        RejectReason::MissingKey,
        RejectReason::InvalidKey,
        RejectReason::NoTenant,
        RejectReason::Mismatch,
        RejectReason::TooLarge,
        RejectReason::BadBody,
        RejectReason::BodyTimeout,
        RejectReason::InFlight,
        RejectReason::InFlightFailed,
        RejectReason::StoreUnavailable,
        RejectReason::StoreFull,
        RejectReason::ShuttingDown,
        RejectReason::Overloaded,
        RejectReason::Internal,
    ];

    /// A short snake_case name for metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::MissingKey => "missing_key",
            RejectReason::InvalidKey => "invalid_key",
            RejectReason::NoTenant => "no_tenant",
            RejectReason::Mismatch => "mismatch",
            RejectReason::TooLarge => "too_large",
            RejectReason::BadBody => "bad_body",
            RejectReason::BodyTimeout => "body_timeout",
            RejectReason::InFlight => "in_flight",
            RejectReason::InFlightFailed => "in_flight_failed",
            RejectReason::StoreUnavailable => "store_unavailable",
            RejectReason::StoreFull => "store_full",
            RejectReason::ShuttingDown => "shutting_down",
            RejectReason::Overloaded => "overloaded",
            RejectReason::Internal => "internal",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl RejectReason {
    /// The HTTP status and gRPC code this rejection is answered with.
    pub const fn status(self) -> (StatusCode, Code) {
        match self {
            RejectReason::MissingKey | RejectReason::InvalidKey | RejectReason::BadBody => {
                (StatusCode::BAD_REQUEST, Code::InvalidArgument)
            }
            RejectReason::NoTenant => (StatusCode::UNAUTHORIZED, Code::Unauthenticated),
            RejectReason::Mismatch => (StatusCode::UNPROCESSABLE_ENTITY, Code::FailedPrecondition),
            RejectReason::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, Code::ResourceExhausted),
            RejectReason::BodyTimeout => (StatusCode::REQUEST_TIMEOUT, Code::DeadlineExceeded),
            RejectReason::InFlight => (StatusCode::CONFLICT, Code::Aborted),
            RejectReason::InFlightFailed
            | RejectReason::StoreUnavailable
            | RejectReason::StoreFull
            | RejectReason::ShuttingDown
            | RejectReason::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable),
            RejectReason::Internal => (StatusCode::INTERNAL_SERVER_ERROR, Code::Internal),
        }
    }

    const fn title(self) -> &'static str {
        match self {
            RejectReason::MissingKey => "Idempotency key required",
            RejectReason::InvalidKey => "Invalid idempotency key",
            RejectReason::NoTenant => "No authenticated tenant",
            RejectReason::Mismatch => "Idempotency key reused with another request",
            RejectReason::TooLarge => "Request body too large",
            RejectReason::BadBody => "Request body could not be read",
            RejectReason::BodyTimeout => "Request body not received in time",
            RejectReason::InFlight => "Request with this key is in flight",
            RejectReason::InFlightFailed => "Request with this key failed",
            RejectReason::StoreUnavailable => "Idempotency store unavailable",
            RejectReason::StoreFull => "Idempotency store full",
            RejectReason::ShuttingDown => "Server shutting down",
            RejectReason::Overloaded => "Server has no capacity now",
            RejectReason::Internal => "Internal error",
        }
    }

    /// The reason code that tells a client how to read this answer where its status alone is
    /// ambiguous: a 409 / ABORTED in flight is not a business conflict, and a 413 /
    /// RESOURCE_EXHAUSTED too large is not a rate limit.
    pub const fn reason_code(self) -> Option<&'static str> {
        match self {
            RejectReason::InFlight => Some(IDEMPOTENCY_IN_FLIGHT),
            RejectReason::TooLarge => Some(REQUEST_TOO_LARGE),
            _ => None,
        }
    }

    const fn retry_after(self) -> bool {
        matches!(
            self,
            RejectReason::BodyTimeout
                | RejectReason::InFlight
                | RejectReason::InFlightFailed
                | RejectReason::StoreUnavailable
                | RejectReason::StoreFull
                | RejectReason::ShuttingDown
                | RejectReason::Overloaded
        )
    }
}

/// A rejection about to be answered over HTTP: what a
/// [`rejection_body`](crate::IdempotencyLayer::rejection_body) hook shapes a body from.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Rejection<'a> {
    /// Why.
    pub reason: RejectReason,
    /// The status it is answered with (the hook cannot change it: clients read it).
    pub status: StatusCode,
    /// The code of that status, as the one table names it.
    pub code: Code,
    /// A short title (`Idempotency key required`).
    pub title: &'static str,
    /// What happened and what to do, for a person.
    pub detail: &'a str,
}

/// A hook that shapes the body of the layer's HTTP rejections: their content type and bytes.
pub(crate) type RejectionBodyFn =
    std::sync::Arc<dyn Fn(&Rejection<'_>) -> (HeaderValue, Bytes) + Send + Sync>;

/// The default body of an HTTP rejection: an RFC 9457 problem document with the code.
fn problem_json(r: &Rejection<'_>) -> (HeaderValue, Bytes) {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": r.title,
        "status": r.status.as_u16(),
        "detail": r.detail,
        "code": r.code.as_str(),
    });
    (
        HeaderValue::from_static("application/problem+json"),
        Bytes::from(body.to_string()),
    )
}

/// Builds the response for a rejection, in the request's protocol, with its reason code (if it
/// has one) in `reason_header`; its body is the whole of it (empty for gRPC).
pub(crate) fn render(
    reason: RejectReason,
    detail: &str,
    protocol: &Protocol,
    reason_header: &HeaderName,
    body: Option<&RejectionBodyFn>,
) -> Response<Bytes> {
    let (status, code) = reason.status();
    tracing::debug!(reason = reason.as_str(), detail, "idempotency: rejected");
    let mut res = if protocol.is_grpc() {
        let mut res = Response::new(Bytes::new());
        let h = res.headers_mut();
        let content_type = match protocol {
            Protocol::GrpcWeb(ct) => ct.clone(),
            _ => HeaderValue::from_static("application/grpc"),
        };
        h.insert(CONTENT_TYPE, content_type);
        h.insert(GRPC_STATUS, HeaderValue::from_static(code.as_header_str()));
        h.insert(GRPC_MESSAGE, encode_grpc_message(detail));
        if reason.retry_after() {
            h.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("1000"));
        }
        res
    } else {
        let rejection = Rejection {
            reason,
            status,
            code,
            title: reason.title(),
            detail,
        };
        let (content_type, body) = match body {
            Some(shape) => shape(&rejection),
            None => problem_json(&rejection),
        };
        let mut res = Response::new(body);
        *res.status_mut() = status;
        res.headers_mut().insert(CONTENT_TYPE, content_type);
        res
    };
    if reason.retry_after() {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if let Some(code) = reason.reason_code() {
        res.headers_mut()
            .insert(reason_header.clone(), HeaderValue::from_static(code));
    }
    res
}

/// A rejection as the layer's response: [`render`]ed with the layer's reason-code header and
/// its rejection body, if it has one.
pub(crate) fn respond<B>(
    reason: RejectReason,
    detail: &str,
    protocol: &Protocol,
    reason_header: &HeaderName,
    body: Option<&RejectionBodyFn>,
) -> Response<IdempotencyBody<B>> {
    render(reason, detail, protocol, reason_header, body).map(IdempotencyBody::full)
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use reason_code::{
        parse_grpc_status, Outcome, ReasonCodes, RetryTable, Verdict, X_REASON_CODE,
    };

    use super::*;

    /// The client's reading of a response head, as `retry-layer` classifies it: reason code,
    /// then `grpc-status` of a trailers-only response, then the HTTP status.
    fn client_code(headers: &HeaderMap, status: StatusCode, grpc: bool) -> Code {
        if let Some(code) = ReasonCodes::empty().classify(headers) {
            return code;
        }
        if grpc {
            return parse_grpc_status(&headers[GRPC_STATUS]).unwrap();
        }
        Code::from_http_status(status)
    }

    /// Every answer the layer makes itself, in every protocol, read by the client's table for a
    /// keyed write: retried exactly when nothing ran and a later attempt can succeed.
    #[test]
    fn every_rejection_gets_the_client_verdict_it_needs() {
        let protocols = [
            Protocol::Http,
            Protocol::Grpc,
            Protocol::GrpcWeb(HeaderValue::from_static("application/grpc-web+proto")),
        ];
        for reason in RejectReason::ALL {
            let retry = matches!(
                reason,
                RejectReason::BodyTimeout
                    | RejectReason::InFlight
                    | RejectReason::InFlightFailed
                    | RejectReason::StoreUnavailable
                    | RejectReason::StoreFull
                    | RejectReason::ShuttingDown
                    | RejectReason::Overloaded
            );
            for protocol in &protocols {
                let res = render(reason, "detail", protocol, &X_REASON_CODE, None);
                let code = client_code(res.headers(), res.status(), protocol.is_grpc());
                let verdict = RetryTable::default().verdict(Outcome::Status(code), true);
                let expected = if retry {
                    Verdict::Retry
                } else {
                    Verdict::Final
                };
                assert_eq!(
                    verdict, expected,
                    "{reason:?} over {protocol:?} read as {code}"
                );
                assert_eq!(
                    res.headers().contains_key(RETRY_AFTER),
                    retry,
                    "{reason:?}: a retryable answer says when"
                );
            }
        }
    }
}

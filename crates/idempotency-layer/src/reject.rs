//! Rejections: the responses the layer answers itself, as HTTP problem details or gRPC
//! trailers-only responses.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use reason_code::{encode_grpc_message, Code, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS};

use crate::body::IdempotencyBody;
use crate::metrics::RejectReason;

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
            RejectReason::InFlight => (StatusCode::CONFLICT, Code::Aborted),
            RejectReason::StoreUnavailable => (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable),
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
            RejectReason::InFlight => "Request with this key is in flight",
            RejectReason::StoreUnavailable => "Idempotency store unavailable",
            RejectReason::Internal => "Internal error",
        }
    }

    const fn retry_after(self) -> bool {
        matches!(
            self,
            RejectReason::InFlight | RejectReason::StoreUnavailable
        )
    }
}

/// Builds the response for a rejection, in the request's protocol.
pub(crate) fn reject<B>(
    reason: RejectReason,
    detail: &str,
    grpc: bool,
) -> Response<IdempotencyBody<B>> {
    let (status, code) = reason.status();
    tracing::debug!(reason = reason.as_str(), detail, "idempotency: rejected");
    let mut res = if grpc {
        let mut res = Response::new(IdempotencyBody::empty());
        let h = res.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS, HeaderValue::from_static(code.as_header_str()));
        h.insert(GRPC_MESSAGE, encode_grpc_message(detail));
        if reason.retry_after() {
            h.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("1000"));
        }
        res
    } else {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": reason.title(),
            "status": status.as_u16(),
            "detail": detail,
            "code": code.as_str(),
        });
        let mut res = Response::new(IdempotencyBody::full(Bytes::from(body.to_string())));
        *res.status_mut() = status;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        res
    };
    if reason.retry_after() {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    }
    res
}

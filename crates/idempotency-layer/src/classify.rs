//! The code of a handler's response, in two steps: from its head when the head decides it, else
//! at the end of its body.
//!
//! The order is the one both layers follow: a business reason code first, then `grpc-status`
//! (headers of a trailers-only response, then trailers, or a gRPC-Web body's trailers frame),
//! then the HTTP status.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, StatusCode};
use reason_code::{parse_grpc_status, Code, ReasonCodes, GRPC_STATUS};

use crate::protocol::{grpc_web_status, is_grpc_web, Protocol};

/// The code of a response when its head decides it: a reason code, a trailers-only gRPC
/// response, or any plain HTTP response. `None` for a gRPC or gRPC-Web response whose status
/// comes at the end of its body.
pub(crate) fn at_head(
    reasons: &ReasonCodes,
    status: StatusCode,
    headers: &HeaderMap,
) -> Option<Code> {
    if let Some(code) = reasons.classify(headers) {
        return Some(code);
    }
    let grpc = headers
        .get(CONTENT_TYPE)
        .is_some_and(Protocol::is_grpc_content_type);
    if grpc {
        return headers
            .get(GRPC_STATUS)
            .map(|v| parse_grpc_status(v).unwrap_or(Code::Unknown));
    }
    Some(Code::from_http_status(status))
}

/// The code of a finished response whose head did not decide it ([`at_head`] returned `None`).
/// `body` is what was kept of it (all of it, or the last data frame when it was too large to
/// record), read only for a gRPC-Web status.
pub(crate) fn at_end(headers: &HeaderMap, trailers: Option<&HeaderMap>, body: &[u8]) -> Code {
    if let Some(v) = trailers.and_then(|t| t.get(GRPC_STATUS)) {
        return parse_grpc_status(v).unwrap_or(Code::Unknown);
    }
    if is_grpc_web(headers) {
        if let Some(code) = grpc_web_status(headers, body) {
            return code;
        }
    }
    // A gRPC response without a readable status is not a success.
    Code::Unknown
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn h(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn head_then_end() {
        let r = ReasonCodes::default();
        let ok = StatusCode::OK;
        assert_eq!(at_head(&r, StatusCode::SEE_OTHER, &h(&[])), Some(Code::Ok));
        assert_eq!(
            at_head(
                &r,
                StatusCode::CONFLICT,
                &h(&[("x-reason-code", "UPSTREAM_UNAVAILABLE")])
            ),
            Some(Code::Unavailable)
        );
        let grpc = h(&[("content-type", "application/grpc")]);
        assert_eq!(at_head(&r, ok, &grpc), None);
        let trailers = h(&[("grpc-status", "5")]);
        assert_eq!(at_end(&grpc, Some(&trailers), b""), Code::NotFound);
        assert_eq!(at_end(&grpc, None, b""), Code::Unknown);
        let web = h(&[("content-type", "application/grpc-web+proto")]);
        assert_eq!(at_head(&r, ok, &web), None);
        let body = b"\x80\x00\x00\x00\x0egrpc-status:3\r\n";
        assert_eq!(at_end(&web, None, body), Code::InvalidArgument);
        assert_eq!(at_end(&web, None, b""), Code::Unknown);
        let trailers_only_web = h(&[
            ("content-type", "application/grpc-web"),
            ("grpc-status", "0"),
        ]);
        assert_eq!(at_head(&r, ok, &trailers_only_web), Some(Code::Ok));
    }
}

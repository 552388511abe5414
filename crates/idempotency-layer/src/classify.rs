//! The code of a handler's response: `reason_code`'s one two-step classifier (the same one the
//! client calls), plus what only a server sees at the end of a gRPC-Web body.

use http::{HeaderMap, StatusCode};
use reason_code::{classify_end, classify_head, Code, HeadClass, ReasonCodes, GRPC_STATUS};

use crate::protocol::{grpc_web_status, is_grpc_web};

/// The code of a response when its head decides it; `None` for a gRPC or gRPC-Web response
/// that has started streaming, whose status comes at the end. `grpc`: the request's protocol.
pub(crate) fn at_head(
    reasons: &ReasonCodes,
    grpc: bool,
    status: StatusCode,
    headers: &HeaderMap,
) -> Option<Code> {
    match classify_head(reasons, grpc, status, headers) {
        HeadClass::Decided(code) => Some(code),
        _ => None,
    }
}

/// The code of a finished response whose head did not decide it ([`at_head`] returned `None`):
/// the `grpc-status` of its trailers or, for gRPC-Web, of the trailers frame at the end of its
/// body. `body` is what was kept of it (all of it, or the last data frame when it was too large
/// to record). No readable status: UNKNOWN, never a success.
pub(crate) fn at_end(headers: &HeaderMap, trailers: Option<&HeaderMap>, body: &[u8]) -> Code {
    let in_trailers = trailers.is_some_and(|t| t.contains_key(GRPC_STATUS));
    if !in_trailers && is_grpc_web(headers) {
        if let Some(code) = grpc_web_status(headers, body) {
            return code;
        }
    }
    classify_end(trailers)
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
        assert_eq!(
            at_head(&r, false, StatusCode::SEE_OTHER, &h(&[])),
            Some(Code::Ok)
        );
        let grpc = h(&[("content-type", "application/grpc")]);
        assert_eq!(at_head(&r, true, ok, &grpc), None);
        let trailers = h(&[("grpc-status", "5")]);
        assert_eq!(at_end(&grpc, Some(&trailers), b""), Code::NotFound);
        assert_eq!(at_end(&grpc, None, b""), Code::Unknown);
        let web = h(&[("content-type", "application/grpc-web+proto")]);
        assert_eq!(at_head(&r, true, ok, &web), None);
        let body = b"\x80\x00\x00\x00\x0egrpc-status:3\r\n";
        assert_eq!(at_end(&web, None, body), Code::InvalidArgument);
        assert_eq!(at_end(&web, None, b""), Code::Unknown);
        let trailers_only_web = h(&[
            ("content-type", "application/grpc-web"),
            ("grpc-status", "0"),
        ]);
        assert_eq!(at_head(&r, true, ok, &trailers_only_web), Some(Code::Ok));
    }
}

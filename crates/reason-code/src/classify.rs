//! The one response classifier both layers call, in two steps like tower-http's `classify`: the
//! head of a response, then (for a gRPC response that has started streaming) its end.

use http::{HeaderMap, StatusCode};

use crate::headers::GRPC_STATUS;
use crate::{parse_grpc_status, Code, ReasonCodes};

/// What the head of a response says about its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeadClass {
    /// The head decides: a reason code, a trailers-only gRPC status, or an HTTP status.
    Decided(Code),
    /// A gRPC response that has started streaming (HTTP 200, headers without `grpc-status`): it
    /// is committed (gRFC A6), so a client never retries it, and its status comes at the end
    /// ([`classify_end`]).
    AtEnd,
}

/// Step one: classifies a response head.
///
/// `grpc` says whether the call is gRPC (the request's protocol: an error page from a proxy in
/// front of a gRPC server has no gRPC content type). In order:
///
/// 1. A gRPC response with HTTP 200 and no `grpc-status` in its headers has started streaming:
///    [`HeadClass::AtEnd`], whatever a reason-code header says.
/// 2. The status: gRPC `grpc-status` (a malformed one is UNKNOWN, never a success), else the
///    HTTP status as the gRPC spec maps it ([`Code::from_grpc_http_status`]); HTTP
///    [`Code::from_http_status`].
/// 3. A success (2xx, 3xx, gRPC OK) is OK, whatever a reason-code header says: a reason code
///    only refines a failure. A 201 that carries `x-reason-code: RATE_LIMITED` was executed,
///    so the server records it and the client does not retry it.
/// 4. A failure with a business reason code ([`ReasonCodes::classify`]) takes the reason code's
///    code: a 409 with `UPSTREAM_UNAVAILABLE` is UNAVAILABLE.
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use reason_code::{classify_end, classify_head, Code, HeadClass, ReasonCodes};
///
/// let reasons = ReasonCodes::default();
/// let mut h = HeaderMap::new();
/// assert_eq!(
///     classify_head(&reasons, false, StatusCode::SEE_OTHER, &h),
///     HeadClass::Decided(Code::Ok)
/// );
/// // A streaming gRPC response: decided by its trailers.
/// assert_eq!(classify_head(&reasons, true, StatusCode::OK, &h), HeadClass::AtEnd);
/// h.insert("grpc-status", "5".parse().unwrap());
/// assert_eq!(classify_end(Some(&h)), Code::NotFound);
/// assert_eq!(classify_end(None), Code::Unknown);
/// ```
pub fn classify_head(
    reasons: &ReasonCodes,
    grpc: bool,
    status: StatusCode,
    headers: &HeaderMap,
) -> HeadClass {
    let grpc_status = if grpc { headers.get(GRPC_STATUS) } else { None };
    if grpc && grpc_status.is_none() && status == StatusCode::OK {
        return HeadClass::AtEnd;
    }
    let code = match grpc_status {
        Some(v) => parse_grpc_status(v).unwrap_or(Code::Unknown),
        None if grpc => Code::from_grpc_http_status(status),
        None => Code::from_http_status(status),
    };
    if code == Code::Ok {
        return HeadClass::Decided(code);
    }
    HeadClass::Decided(reasons.classify(headers).unwrap_or(code))
}

/// Step two: the code of a gRPC response whose head said [`HeadClass::AtEnd`], from the
/// `grpc-status` of its trailers. No trailers, no status, or a malformed one: UNKNOWN, never a
/// success.
pub fn classify_end(trailers: Option<&HeaderMap>) -> Code {
    trailers
        .and_then(|t| t.get(GRPC_STATUS))
        .map_or(Code::Unknown, |v| {
            parse_grpc_status(v).unwrap_or(Code::Unknown)
        })
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

    use HeadClass::*;

    /// (grpc, status, headers, expected)
    type Case = (
        bool,
        u16,
        &'static [(&'static str, &'static str)],
        HeadClass,
    );

    const CASES: &[Case] = &[
        (false, 201, &[], Decided(Code::Ok)),
        (false, 303, &[], Decided(Code::Ok)),
        (false, 503, &[], Decided(Code::Unavailable)),
        (
            false,
            409,
            &[("x-reason-code", "UPSTREAM_UNAVAILABLE")],
            Decided(Code::Unavailable),
        ),
        (
            false,
            409,
            &[("x-reason-code", "IDEMPOTENCY_IN_FLIGHT")],
            Decided(Code::Unavailable),
        ),
        (
            false,
            409,
            &[("x-reason-code", "SOMETHING_NEW")],
            Decided(Code::Aborted),
        ),
        (false, 200, &[("grpc-status", "14")], Decided(Code::Ok)),
        // A reason code refines a failure, never a success.
        (
            false,
            201,
            &[("x-reason-code", "RATE_LIMITED")],
            Decided(Code::Ok),
        ),
        (
            false,
            303,
            &[("x-reason-code", "UPSTREAM_UNAVAILABLE")],
            Decided(Code::Ok),
        ),
        (
            false,
            429,
            &[("x-reason-code", "RATE_LIMITED")],
            Decided(Code::ResourceExhausted),
        ),
        (
            true,
            200,
            &[("grpc-status", "0"), ("x-reason-code", "RATE_LIMITED")],
            Decided(Code::Ok),
        ),
        (
            true,
            503,
            &[("x-reason-code", "STOCK_CONFLICT")],
            Decided(Code::Aborted),
        ),
        (true, 200, &[], AtEnd),
        (
            true,
            200,
            &[("x-reason-code", "UPSTREAM_UNAVAILABLE")],
            AtEnd,
        ),
        (
            true,
            200,
            &[("grpc-status", "14")],
            Decided(Code::Unavailable),
        ),
        (
            true,
            200,
            &[("grpc-status", "garbage")],
            Decided(Code::Unknown),
        ),
        (
            true,
            200,
            &[
                ("grpc-status", "10"),
                ("x-reason-code", "IDEMPOTENCY_IN_FLIGHT"),
            ],
            Decided(Code::Unavailable),
        ),
        (
            true,
            200,
            &[("grpc-status", "8"), ("x-reason-code", "REQUEST_TOO_LARGE")],
            Decided(Code::InvalidArgument),
        ),
        (true, 503, &[], Decided(Code::Unavailable)),
        (true, 429, &[], Decided(Code::Unavailable)),
        (true, 404, &[], Decided(Code::Unimplemented)),
        (true, 400, &[], Decided(Code::Internal)),
    ];

    #[test]
    fn the_head_table() {
        let reasons = ReasonCodes::default();
        for &(grpc, status, headers, expected) in CASES {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(
                classify_head(&reasons, grpc, status, &h(headers)),
                expected,
                "grpc={grpc} {status} {headers:?}"
            );
        }
    }

    #[test]
    fn the_end() {
        assert_eq!(classify_end(Some(&h(&[("grpc-status", "0")]))), Code::Ok);
        assert_eq!(
            classify_end(Some(&h(&[("grpc-status", "x")]))),
            Code::Unknown
        );
        assert_eq!(classify_end(Some(&h(&[]))), Code::Unknown);
        assert_eq!(classify_end(None), Code::Unknown);
    }
}

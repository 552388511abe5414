//! HTTP status <-> [`Code`] mapping.

use crate::Code;
use http::StatusCode;

impl Code {
    /// Classifies an HTTP response status.
    ///
    /// The mapping follows the design table (and Google's HTTP <-> gRPC mapping where the table is
    /// silent): 2xx and 3xx are OK (a redirect is a completed outcome), 502 and 503 are UNAVAILABLE, 504 and 408 are DEADLINE_EXCEEDED, 429 is
    /// RESOURCE_EXHAUSTED, 409 is ABORTED, 412 and 422 are FAILED_PRECONDITION, 500 is INTERNAL,
    /// 501 is UNIMPLEMENTED. 421 Misdirected Request (RFC 9110) and 425 Too Early (RFC 8470)
    /// say the server did not process the request: UNAVAILABLE, so that a server never records
    /// them (a client retries them as never sent). Other 4xx are FAILED_PRECONDITION (a
    /// permanent client-side problem, never retried); other statuses are UNKNOWN.
    ///
    /// ```
    /// use http::StatusCode;
    /// use reason_code::Code;
    ///
    /// assert_eq!(Code::from_http_status(StatusCode::CREATED), Code::Ok);
    /// assert_eq!(Code::from_http_status(StatusCode::SEE_OTHER), Code::Ok);
    /// assert_eq!(Code::from_http_status(StatusCode::SERVICE_UNAVAILABLE), Code::Unavailable);
    /// assert_eq!(Code::from_http_status(StatusCode::TOO_MANY_REQUESTS), Code::ResourceExhausted);
    /// ```
    pub fn from_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            // A 3xx is a completed outcome: a 303 See Other after a POST is a completed create
            // (post-redirect-get), and a client that follows it must not run the POST again.
            200..=399 => Code::Ok,
            400 | 413 | 414 | 415 | 431 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 | 410 => Code::NotFound,
            408 | 504 => Code::DeadlineExceeded,
            409 => Code::Aborted,
            412 | 422 => Code::FailedPrecondition,
            416 => Code::OutOfRange,
            429 => Code::ResourceExhausted,
            499 => Code::Cancelled,
            500 => Code::Internal,
            501 => Code::Unimplemented,
            // Not processed: nothing ran, so nothing to record, and the request may go again.
            421 | 425 | 502 | 503 => Code::Unavailable,
            405..=499 => Code::FailedPrecondition,
            _ => Code::Unknown,
        }
    }

    /// Classifies the HTTP status of a gRPC response that carries no `grpc-status`, as the gRPC
    /// spec maps it (`doc/http-grpc-status-mapping.md`): 400 is INTERNAL, 401 UNAUTHENTICATED,
    /// 403 PERMISSION_DENIED, 404 UNIMPLEMENTED, 429, 502, 503 and 504 UNAVAILABLE, any other
    /// status UNKNOWN. A 200 is OK (its status then comes from `grpc-status`).
    ///
    /// This differs from [`Code::from_http_status`] on purpose: a gRPC client that gets an HTTP
    /// error did not reach a gRPC handler (a proxy, a load balancer or the wrong server answered).
    ///
    /// ```
    /// use http::StatusCode;
    /// use reason_code::Code;
    ///
    /// assert_eq!(Code::from_grpc_http_status(StatusCode::NOT_FOUND), Code::Unimplemented);
    /// assert_eq!(Code::from_grpc_http_status(StatusCode::TOO_MANY_REQUESTS), Code::Unavailable);
    /// assert_eq!(Code::from_grpc_http_status(StatusCode::CONFLICT), Code::Unknown);
    /// ```
    pub fn from_grpc_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            200 => Code::Ok,
            400 => Code::Internal,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::Unimplemented,
            429 | 502 | 503 | 504 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }

    /// The HTTP status a server renders for this code when it answers plain HTTP.
    ///
    /// ```
    /// use http::StatusCode;
    /// use reason_code::Code;
    ///
    /// assert_eq!(Code::Unavailable.http_status(), StatusCode::SERVICE_UNAVAILABLE);
    /// assert_eq!(Code::InvalidArgument.http_status(), StatusCode::BAD_REQUEST);
    /// ```
    pub const fn http_status(self) -> StatusCode {
        match self {
            Code::Ok => StatusCode::OK,
            Code::Cancelled => match StatusCode::from_u16(499) {
                Ok(s) => s,
                Err(_) => StatusCode::BAD_REQUEST,
            },
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    macro_rules! http_rows {
        ($($name:ident: $status:expr => $code:expr,)*) => {$(
            #[test]
            fn $name() {
                assert_eq!(Code::from_http_status(StatusCode::from_u16($status).unwrap()), $code);
            }
        )*};
    }

    http_rows! {
        ok_200: 200 => Code::Ok,
        created_201: 201 => Code::Ok,
        no_content_204: 204 => Code::Ok,
        bad_request_400: 400 => Code::InvalidArgument,
        unauthorized_401: 401 => Code::Unauthenticated,
        forbidden_403: 403 => Code::PermissionDenied,
        not_found_404: 404 => Code::NotFound,
        conflict_409: 409 => Code::Aborted,
        precondition_412: 412 => Code::FailedPrecondition,
        too_large_413: 413 => Code::InvalidArgument,
        unprocessable_422: 422 => Code::FailedPrecondition,
        too_many_429: 429 => Code::ResourceExhausted,
        internal_500: 500 => Code::Internal,
        not_implemented_501: 501 => Code::Unimplemented,
        bad_gateway_502: 502 => Code::Unavailable,
        unavailable_503: 503 => Code::Unavailable,
        gateway_timeout_504: 504 => Code::DeadlineExceeded,
        other_5xx_599: 599 => Code::Unknown,
        redirect_302: 302 => Code::Ok,
        see_other_303: 303 => Code::Ok,
        misdirected_421: 421 => Code::Unavailable,
        too_early_425: 425 => Code::Unavailable,
        other_4xx_418: 418 => Code::FailedPrecondition,
    }

    /// 421 and 425 mean "not processed" on both halves: the client retries them as never sent,
    /// and a server never records them, even one that records permanent failures.
    #[test]
    fn misdirected_and_too_early_are_never_recorded() {
        let table = crate::RetryTable::default().record_permanent_failures(true);
        for status in [421, 425] {
            let code = Code::from_http_status(StatusCode::from_u16(status).unwrap());
            assert!(!table.may_record(code), "{status} ({code})");
        }
        // A permanent 4xx is recorded when opted in: the rule is not "no 4xx".
        assert!(table.may_record(Code::from_http_status(StatusCode::IM_A_TEAPOT)));
    }

    macro_rules! grpc_http_rows {
        ($($name:ident: $status:expr => $code:expr,)*) => {$(
            #[test]
            fn $name() {
                assert_eq!(
                    Code::from_grpc_http_status(StatusCode::from_u16($status).unwrap()),
                    $code
                );
            }
        )*};
    }

    grpc_http_rows! {
        grpc_ok_200: 200 => Code::Ok,
        grpc_bad_request_400: 400 => Code::Internal,
        grpc_unauthorized_401: 401 => Code::Unauthenticated,
        grpc_forbidden_403: 403 => Code::PermissionDenied,
        grpc_not_found_404: 404 => Code::Unimplemented,
        grpc_too_many_429: 429 => Code::Unavailable,
        grpc_bad_gateway_502: 502 => Code::Unavailable,
        grpc_unavailable_503: 503 => Code::Unavailable,
        grpc_gateway_timeout_504: 504 => Code::Unavailable,
        grpc_internal_500: 500 => Code::Unknown,
        grpc_conflict_409: 409 => Code::Unknown,
        grpc_created_201: 201 => Code::Unknown,
        grpc_redirect_302: 302 => Code::Unknown,
    }

    #[test]
    fn rendering_round_trips_for_the_codes_the_table_names() {
        for code in [
            Code::Ok,
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::NotFound,
            Code::Aborted,
            Code::FailedPrecondition,
            Code::ResourceExhausted,
            Code::Internal,
            Code::Unimplemented,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Cancelled,
        ] {
            assert_eq!(Code::from_http_status(code.http_status()), code, "{code}");
        }
    }
}

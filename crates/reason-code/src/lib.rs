//! The shared vocabulary of `retry-layer` (clients) and `idempotency-layer` (servers).
//!
//! Both halves of effectively-once calls classify every outcome the same way, so that what the
//! client retries is exactly what the server does not record. This crate holds that one
//! classification:
//!
//! - [`Code`]: the 17 gRPC status codes, with the HTTP status mapping both ways
//!   ([`Code::from_http_status`], [`Code::http_status`]).
//! - Parsers that never panic, for `grpc-status`, `grpc-message`, `grpc-timeout`,
//!   `grpc-retry-pushback-ms`, `Retry-After` and the `google.rpc.RetryInfo` in
//!   `grpc-status-details-bin`, returning a typed [`HeaderError`].
//! - [`ReasonCodes`]: business reason codes (`x-reason-code: STOCK_CONFLICT`) mapped onto codes.
//! - [`RetryTable`]: the retryability table, with the client's view ([`RetryTable::verdict`]) and
//!   the server's view ([`RetryTable::may_record`]).
//! - [`classify_head`] and [`classify_end`]: the one response classifier both layers call
//!   (`grpc-status` or the HTTP status, a failure refined by its reason code; a streaming gRPC
//!   response at its end).
//! - [`GrpcMethods`] and [`KeyHeaders`]: the settings both layers take, as one type
//!   each, so the same string means the same thing on both sides.
//! - [`Hop`]: what a server hop knows of the request it serves (was it a retry? did the hop give
//!   up on its own downstream?), shared with the outbound calls its handler makes, so that
//!   retries happen at one tier only.
//!
//! # Example
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use reason_code::{Code, Outcome, ReasonCodes, RetryTable, Verdict};
//!
//! // A 409 whose reason code says the upstream was unavailable is retried like a 503.
//! let mut headers = HeaderMap::new();
//! headers.insert("x-reason-code", "UPSTREAM_UNAVAILABLE".parse().unwrap());
//! let code = ReasonCodes::default()
//!     .classify(&headers)
//!     .unwrap_or(Code::from_http_status(StatusCode::CONFLICT));
//! assert_eq!(code, Code::Unavailable);
//!
//! let table = RetryTable::default();
//! assert_eq!(table.verdict(Outcome::Status(code), /* idempotent */ true), Verdict::Retry);
//! assert!(!table.may_record(code)); // the server releases the key: a retry executes again
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(rust_2018_idioms, warnings))))]

mod classify;
mod code;
mod headers;
mod hop;
mod http_status;
mod inbound_write;
mod reason;
mod status_details;
mod table;
mod vocabulary;

pub use classify::{classify_end, classify_head, HeadClass};
pub use code::{Code, UnknownCodeName};
pub use headers::{
    decode_grpc_message, encode_grpc_message, encode_grpc_timeout, is_grpc, is_grpc_content_type,
    parse_grpc_pushback, parse_grpc_status, parse_grpc_timeout, parse_retry_after,
    says_seen_in_flight, single, HeaderError, Pushback, GRPC_MESSAGE, GRPC_PREVIOUS_RPC_ATTEMPTS,
    GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS, GRPC_TIMEOUT, IDEMPOTENCY_KEY, IDEMPOTENCY_SEEN_IN_FLIGHT,
    IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED, X_IDEMPOTENCY_KEY, X_PREVIOUS_ATTEMPTS,
    X_REASON_CODE,
};
pub use hop::{parse_previous_attempts, previous_attempts, Hop};
pub use inbound_write::{InboundWrite, ScopeSource};
pub use reason::{
    ReasonCodes, DO_NOT_RETRY, IDEMPOTENCY_IN_FLIGHT, REQUEST_TOO_LARGE, RETRIES_DEFERRED,
};
pub use status_details::{parse_grpc_retry_info, GRPC_STATUS_DETAILS_BIN};
pub use table::{ClientRule, Outcome, RecordRule, RetryTable, Verdict};
pub use vocabulary::{GrpcMethods, InvalidGrpcMethod, KeyHeaders, NoKeyHeader};

/// The boxed error both layers use: a client's transport and retry errors, a store's backend
/// errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The crate's README, whose code blocks are compiled (and run, unless marked `no_run`) as
/// doctests: what a user copies from crates.io builds.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

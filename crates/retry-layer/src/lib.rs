//! Client-side retries that are safe for writes: a tower middleware for any HTTP or gRPC client.
//!
//! `RetryLayer` retries exactly what the shared [`reason_code::RetryTable`] says is retryable,
//! with async exponential backoff and jitter, a deadline budget, a retry budget shared by all
//! clones, server pushback, replayable request bodies of any [`http_body::Body`] type, and
//! idempotency keys so that retried writes execute once on servers running
//! `idempotency-layer`.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//!
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use bytes::Bytes;
//! use retry_layer::{RetryLayer, RetryPolicy};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // A backend that is unavailable twice, then answers.
//! let calls = Arc::new(AtomicU32::new(0));
//! let backend = {
//!     let calls = calls.clone();
//!     tower::service_fn(move |_req: Request<_>| {
//!         let n = calls.fetch_add(1, Ordering::SeqCst);
//!         async move {
//!             let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!             Ok::<_, Infallible>(Response::builder().status(status).body(()).unwrap())
//!         }
//!     })
//! };
//!
//! let layer = RetryLayer::new(RetryPolicy::builder().ensure_idempotency_key().build().unwrap());
//! let mut client = ServiceBuilder::new().layer(layer.clone()).service(backend);
//!
//! // A POST is not idempotent, but ensure_idempotency_key() gives it a key, so it is retried.
//! let req = Request::post("http://orders/orders").body(Full::new(Bytes::from("{}"))).unwrap();
//! let res = client.ready().await.unwrap().call(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::CREATED);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! assert_eq!(layer.stats().retries, 2);
//! # }
//! ```
//!
//! # What is retried
//!
//! Every attempt's outcome is classified once (a business reason code in `x-reason-code` wins,
//! then `grpc-status` in the headers of a trailers-only gRPC response, then the HTTP status; a
//! transport error is *unsent* or *ambiguous*), and the [`RetryTable`](reason_code::RetryTable)
//! decides. By default:
//!
//! - a request that never left the client (connect refused, h2 `REFUSED_STREAM`) is retried,
//!   whatever its method;
//! - 502/503/UNAVAILABLE, 504/DEADLINE_EXCEEDED, a connection lost after sending and an attempt
//!   timeout are retried only for **idempotent** requests: GET, HEAD, OPTIONS, TRACE, PUT,
//!   DELETE, gRPC methods declared with
//!   [`idempotent_grpc_method`](RetryPolicyBuilder::idempotent_grpc_method), or any request that
//!   carries an idempotency key (`x-idempotency-key` or `idempotency-key`);
//! - 429/RESOURCE_EXHAUSTED is retried for any request, after the server's pushback;
//! - 409/ABORTED is returned, unless a [`rebuild_on_conflict`](RetryPolicyBuilder::rebuild_on_conflict)
//!   hook rebuilds the request;
//! - everything else is returned as it is. A gRPC response that has sent headers without a
//!   status is committed (gRFC A6) and never retried.
//!
//! Before each retry three checks must all pass: the outcome is retryable, an attempt is left,
//! and the deadline leaves at least the delay plus `min_attempt_budget`. Then the retry budget
//! must grant it.
//!
//! # Why a deadline budget
//!
//! A retry that cannot finish before the caller gives up only adds load. The deadline comes from
//! a [`Deadline`] request extension, else `grpc-timeout`, else the policy's `total_timeout`; each
//! gRPC attempt's `grpc-timeout` is rewritten to the time really left, so the server stops
//! working when the caller has stopped waiting.
//!
//! # Why a retry budget
//!
//! See [`budget`]: `max_attempts` bounds one request, the budget bounds a fleet.
//!
//! # Request bodies
//!
//! The inner service receives [`ReplayBody<B>`]. The first attempt streams the body while up to
//! `max_replay_bytes` (64 KiB) are kept; a larger body is sent once and its outcome returned.
//!
//! With a hyper-util client the body type is inferred. A tonic `Channel` takes
//! `tonic::body::Body`; convert with `map_request`:
//!
//! ```
//! # fn channel() -> tonic::transport::Channel {
//! #     tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy()
//! # }
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
//! use tower::ServiceBuilder;
//!
//! let policy = RetryPolicy::builder()
//!     .idempotent_grpc_method("/plume.linkd.v3.Library/GetBook")
//!     .ensure_idempotency_key()
//!     .build()
//!     .unwrap();
//! let svc = ServiceBuilder::new()
//!     .layer(RetryLayer::new(policy))
//!     .map_request(|req: http::Request<ReplayBody<tonic::body::Body>>| {
//!         req.map(tonic::body::Body::new)
//!     })
//!     .service(channel());
//! // let client = LibraryClient::new(svc);
//! # let _ = svc;
//! # }
//! ```
//!
//! # Differences from `tower::retry` and gRFC A6
//!
//! - `tower::retry` asks every user to write the policy, clone the request (so bodies must be
//!   `Clone`, which streaming bodies and tonic's are not) and bring a backoff; it has no
//!   `Retry-After`, no deadline and no body replay. Here the policy is data, the table is shared
//!   with the server, and any body type is replayed up to a limit.
//! - gRFC A6 defines the committed rule, pushback, `grpc-previous-rpc-attempts` and throttling;
//!   tonic implements none of it. All of it is here, with A6's `retryPolicy` and
//!   `retryThrottling` loadable from a service config, plus the same rules for plain HTTP.
//! - Neither knows about idempotency keys: a POST is either never retried (safe, but the write is
//!   lost on a dropped connection) or retried blindly (the write runs twice). With
//!   [`ensure_idempotency_key`](RetryPolicyBuilder::ensure_idempotency_key) and
//!   `idempotency-layer` on the server, it is retried and runs once.
//!
//! # Observability
//!
//! Each retry is a `DEBUG` tracing event, each give-up an `INFO` event, each budget refusal a
//! `WARN` event, all with the attempt number and code. [`RetryLayer::stats`] returns counters.
#![doc(test(attr(deny(rust_2018_idioms, warnings))))]

pub mod backoff;
mod body;
pub mod budget;
mod classify;
mod error;
mod future;
mod layer;
mod policy;
mod service;
mod stats;

pub use body::{BodyNotReplayable, ReplayBody};
pub use error::{AttemptTimedOut, Deadline, DeadlineExceeded, RetryError, RetryInfo};
pub use future::ResponseFuture;
pub use layer::RetryLayer;
pub use policy::{
    Conflict, GrpcRetryPolicy, GrpcRetryThrottling, InvalidPolicy, Rebuild, RebuildFuture,
    RetryPolicy, RetryPolicyBuilder, StatusCodeName, MAX_DURATION, MAX_UNSENT_RETRIES,
};
pub use service::Retry;
pub use stats::{RetryStats, StatsSnapshot};

/// The boxed error type the layer returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

//! Hedged requests for idempotent reads (gRFC A6 `hedgingPolicy`).
//!
//! A retry waits for a failure; a hedge does not wait for anything but time. [`HedgeLayer`]
//! sends an idempotent request, and if no answer has come after `hedging_delay`, sends it again
//! (up to `max_attempts` in flight), keeping every attempt running: the first answer that is
//! not a *non-fatal* failure wins, and the others are cancelled (their futures dropped: hyper
//! and h2 abandon the request). A non-fatal failure (a code in `non_fatal_codes`, or a
//! transport error) sends the next hedge at once; when no other attempt is in flight and the
//! service is not ready for that hedge, the failure in hand is the answer (held while the call
//! waited, its unread body could be what keeps one HTTP/1.1 connection busy; a retry layer
//! above drains it and retries after its backoff). This cuts tail latency when one replica or
//! one connection is slow: the p99 becomes about `hedging_delay` plus a fast answer.
//!
//! As in gRFC A6:
//! - only reads are hedged by default (GET, HEAD, OPTIONS, TRACE, gRPC methods declared
//!   idempotent); idempotent and keyed writes (PUT, DELETE, a request with an idempotency key)
//!   only with [`hedge_writes`](HedgePolicyBuilder::hedge_writes); a write without a key never;
//! - every hedge after the first draws on the retry budget, and is not sent when it refuses
//!   ([`RetryLayer::hedge_layer`](crate::RetryLayer::hedge_layer) shares a retry layer's);
//! - server pushback stops further hedges (a negative `grpc-retry-pushback-ms`, `DO_NOT_RETRY`,
//!   a pushback longer than `max_pushback` or than the deadline leaves) or delays the next one
//!   (a positive pushback, `Retry-After`, `google.rpc.RetryInfo`);
//! - every wait has a bound: the call ends at its deadline (a [`Deadline`](crate::Deadline)
//!   extension or `grpc-timeout`, the earlier) with the last failure or
//!   [`DeadlineExceeded`](crate::DeadlineExceeded), and each attempt waits at most
//!   `response_head_timeout` (60 s) for its head;
//! - each hedge carries `grpc-previous-rpc-attempts` / `x-previous-attempts` (the attempts
//!   before it, but those that provably never left the client), and its `grpc-timeout` is
//!   what is left of the call's deadline;
//! - the policy loads from a service config's `hedgingPolicy`
//!   ([`HedgePolicy::from_grpc_service_config`]).
//!
//! ```
//! use std::time::Duration;
//! use retry_layer::hedge::{HedgeLayer, HedgePolicy};
//! use retry_layer::{RetryLayer, RetryPolicy};
//!
//! let retries = RetryLayer::new(RetryPolicy::default());
//! let hedging = HedgePolicy::builder()
//!     .max_attempts(2)
//!     .hedging_delay(Duration::from_millis(20))
//!     .build()?;
//! // Reads hedged, drawing on the retry layer's budget.
//! let reads: HedgeLayer = retries.hedge_layer(hedging);
//! # let _ = reads;
//! # Ok::<(), retry_layer::InvalidPolicy>(())
//! ```
//!
//! # When not to
//!
//! - Writes: not hedged unless asked ([`hedge_writes`](HedgePolicyBuilder::hedge_writes)), and
//!   a write without a key never: a hedged write runs twice unless it is idempotent or keyed
//!   and the server has `IdempotencyLayer`, and even then the duplicate waits for the first or
//!   replays it, taking the server's time for nothing unless the first attempt was lost.
//! - A backend whose slowness is load: hedging adds load (up to `max_attempts` times for the
//!   slow share) exactly when the backend is slow. Keep `hedging_delay` near the p95 so that
//!   only the slowest few percent are hedged, and keep the retry budget on.
//! - Requests with large or streaming bodies: a hedge needs the whole body in memory
//!   (`max_replay_bytes`); a request whose body is not complete when a hedge is due is not
//!   hedged. Request trailers are not sent with hedges.
//! - Do not put `HedgeLayer` and `RetryLayer` on the same requests: hedging already resends.

mod builder;
mod future;
mod layer;
mod policy;
mod service;
#[cfg(feature = "service-config")]
mod service_config;
mod shared;
mod stats;

pub use builder::HedgePolicyBuilder;
pub use future::ResponseFuture;
pub use layer::HedgeLayer;
pub use policy::{HedgePolicy, MAX_HEDGED_ATTEMPTS};
pub use service::Hedge;
#[cfg(feature = "service-config")]
pub use service_config::GrpcHedgingPolicy;
pub use stats::HedgeStats;

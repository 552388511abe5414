//! Retries at one tier only, across any number of hops: the server half.
//!
//! A service that calls others with [`RetryLayer`](crate::RetryLayer) is a hop. Without
//! coordination, retries multiply down a chain `client -> A -> B -> C`: with C down, every hop
//! retries what the hop below already retried (27 attempts at C for one request with 3 attempts
//! per hop; with the default retry budget at every hop still 1.1x per hop, compounded). The
//! rule is "retry at one layer only"; [`HopLayer`] on each hop's server makes that
//! automatic, with no code in the handlers:
//!
//! - **A hop says how its outbound call ended.** When the handler's outbound `RetryLayer`
//!   stops on a failure it would otherwise retry, the hop's own retryable failure answer is
//!   marked:
//!   - **retried below** ([`RETRIES_DEFERRED`](reason_code::RETRIES_DEFERRED)) when the call
//!     has done its share: attempts ran out, budget refused, or it sent once under an inbound
//!     retry. The caller retries only within its own adaptive budget (gRFC A6 throttling,
//!     20 tokens, 0.1 per success: retries stop once more than about one call in ten fails).
//!     A dead backend drains it within a few calls, so only the hop next to the failure keeps
//!     retrying; a backend that fails a few requests is still retried past a hop that ran out.
//!   - **do not retry** (a negative `grpc-retry-pushback-ms` over gRPC, as gRFC A6 defines it,
//!     [`DO_NOT_RETRY`](reason_code::DO_NOT_RETRY) over HTTP) when no retry can help: the hop
//!     below said stop, or the deadline the inbound request carried (its `grpc-timeout`, or a
//!     [`Deadline`](crate::Deadline) extension a layer in front of `HopLayer` set) is spent. A stop on a choice
//!     of the hop's own (a `total_timeout` or `max_pushback` of its outbound policy) is
//!     "retried below": it says nothing of what the caller can afford. The caller's
//!     `RetryLayer` returns it as it is (counted in `pushback_stops`), and so does every hop
//!     above.
//! - **A retry is not retried again underneath.** A request that arrives as a retry
//!   (`grpc-previous-rpc-attempts` or `x-previous-attempts` above zero) runs its handler with
//!   that knowledge: the handler's outbound calls send once by default
//!   ([`InboundRetry`](crate::InboundRetry) configures it: send once, retry as usual, or a
//!   smaller budget of their own).
//!
//! The hop reaches the handler's outbound calls through a tokio task-local
//! ([`Hop::scope`]): outbound calls made in the handler's own task need nothing. A handler that
//! calls out from a task it spawns runs that task in the hop's scope: the [`Hop`] is in the
//! request's extensions.
//!
//! ```
//! use axum::{routing::post, Router};
//! use retry_layer::hop::HopLayer;
//!
//! async fn create_order() -> &'static str {
//!     // Calls inventory through a client with `RetryLayer`: if those retries run out, this
//!     // hop's 503 tells its caller that it retried below; if this request is itself a retry,
//!     // the call to inventory is sent once.
//!     "created"
//! }
//!
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .layer(HopLayer::new());
//! # let _ = app;
//! ```
//!
//! When not to: a hop whose outbound calls go to a dependency that fails independently of the
//! hop above (a cache in front of a database, say) may want its own retries under an inbound
//! retry: set [`InboundRetry::RetryAsUsual`](crate::InboundRetry::RetryAsUsual) or a budget on
//! that client. A caller that is not a `RetryLayer` sees an ordinary 503 / UNAVAILABLE with a
//! reason code (or pushback) it may ignore.

mod future;
mod layer;
mod service;

pub use reason_code::Hop;

pub use self::future::ResponseFuture;
pub use self::layer::HopLayer;
pub use self::service::HopScope;

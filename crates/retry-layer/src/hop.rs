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
//!     [`Deadline`] extension a layer in front of `HopLayer` set) is spent. A stop on a choice
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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use reason_code::{ReasonCodes, GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS};
use tokio::task::futures::TaskLocalFuture;
use tower_layer::Layer;
use tower_service::Service;

use crate::deadline::Deadline;

pub use reason_code::Hop;

/// The server half of one-tier retries: see the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct HopLayer {
    reasons: ReasonCodes,
}

impl HopLayer {
    /// Marks HTTP answers in `x-reason-code` ([`ReasonCodes::default`]).
    pub fn new() -> Self {
        HopLayer::default()
    }

    /// The reason codes (and their header) the hop's HTTP answers are classified and marked
    /// with: the same as its callers' `RetryPolicy` reads.
    pub fn reason_codes(mut self, reasons: ReasonCodes) -> Self {
        self.reasons = reasons;
        self
    }
}

impl<S> Layer<S> for HopLayer {
    type Service = HopScope<S>;

    fn layer(&self, inner: S) -> HopScope<S> {
        HopScope {
            inner,
            reasons: self.reasons.clone(),
        }
    }
}

/// The service [`HopLayer`] makes: runs each request's handler in the scope of a [`Hop`] (the
/// per-request state, made from the request's headers), and marks the handler's answer when an
/// outbound call stopped retrying.
#[derive(Debug, Clone)]
pub struct HopScope<S> {
    inner: S,
    reasons: ReasonCodes,
}

impl<S> HopScope<S> {
    define_inner_service_accessors!();
}

impl<S, B, R> Service<Request<B>> for HopScope<S>
where
    S: Service<Request<B>, Response = Response<R>>,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let headers = req.headers();
        let mut hop = Hop::from_request_headers(headers);
        if let Some(Deadline(d)) = req.extensions().get::<Deadline>() {
            hop = hop.with_inbound_deadline(*d);
        }
        let hop = Arc::new(hop);
        let headers = req.headers();
        if hop.previous_attempts() == 0 {
            warn_if_malformed(headers);
        }
        let grpc = reason_code::is_grpc(headers);
        req.extensions_mut().insert(hop.clone());
        let future = hop.clone().scope(self.inner.call(req));
        ResponseFuture {
            future,
            hop,
            grpc,
            reasons: self.reasons.clone(),
        }
    }
}

/// An attempt header that is present but not a count is read as "not a retry".
fn warn_if_malformed(headers: &http::HeaderMap) {
    for name in [GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS] {
        if let Some(v) = headers.get(&name) {
            if v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
                .is_none()
            {
                tracing::warn!(header = %name, value = ?v, "malformed attempt header: the request is served as a first attempt");
            }
        }
    }
}

pin_project! {
    /// The response future of [`HopScope`]: the handler runs in the hop's scope, and its
    /// answer is marked if an outbound call retried below or gave up.
    pub struct ResponseFuture<F> where F: Future {
        #[pin]
        future: TaskLocalFuture<Arc<Hop>, F>,
        hop: Arc<Hop>,
        grpc: bool,
        reasons: ReasonCodes,
    }
}

impl<F: Future> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("hop", &self.hop)
            .finish_non_exhaustive()
    }
}

impl<F, R, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<R>, E>>,
{
    type Output = Result<Response<R>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut res = match this.future.poll(cx) {
            Poll::Ready(Ok(res)) => res,
            other => return other,
        };
        let status = res.status();
        if this
            .hop
            .mark_response(*this.grpc, status, res.headers_mut(), this.reasons)
        {
            tracing::debug!(status = %status, "an outbound call stopped retrying: the answer says so");
        }
        Poll::Ready(Ok(res))
    }
}

//! The same retries for [`reqwest`](https://docs.rs/reqwest) clients (cargo feature `reqwest`).
//!
//! reqwest is not a tower service, so [`RetryLayer`] cannot wrap it. [`RetryMiddleware`] is a
//! [`reqwest-middleware`](https://docs.rs/reqwest-middleware) middleware that runs the layer's
//! own machinery around the rest of the middleware chain: the same [`RetryPolicy`], the same
//! reason-code table, the same retry budget, the same idempotency keys (checked, generated and
//! kept across attempts), the same deadline and pushback handling, the same counters, metrics
//! and spans. Nothing of the policy is re-implemented here; only the request and response
//! types are converted.
//!
//! ```
//! use reqwest_middleware::ClientBuilder;
//! use retry_layer::reqwest::RetryMiddleware;
//! use retry_layer::RetryPolicy;
//!
//! let policy = RetryPolicy::builder().ensure_idempotency_key().build()?;
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(RetryMiddleware::new(policy))
//!     .build();
//! // `client.post(url).body(..).send().await`: a 503 is retried with the same body and the same
//! // idempotency key (`x-idempotency-key` by default: see `RetryPolicyBuilder::key_headers`),
//! // within the deadline and the budget.
//! # let _ = client;
//! # Ok::<(), retry_layer::InvalidPolicy>(())
//! ```
//!
//! # What differs from the tower layer
//!
//! - **Errors.** Every error the middleware returns is a
//!   [`reqwest_middleware::Error::Middleware`] holding a [`RetryError`] (attempts taken, the
//!   generated key), whose inner error is the last attempt's `reqwest_middleware::Error` or
//!   [`DeadlineExceeded`](crate::DeadlineExceeded). [`reqwest_error`] finds the transport error
//!   in it, for `is_connect()` or `is_timeout()`.
//! - **What a response carries.** A response that took retries or got a generated key carries
//!   [`RetryInfo`] in `Response::extensions()`.
//! - **Timeouts.** A timeout set with `RequestBuilder::timeout` bounds each attempt, as it does
//!   without the middleware; the policy's `total_timeout` bounds the whole call.
//! - **Redirects.** A whole request body (what `RequestBuilder::body` takes: a string, bytes,
//!   JSON) reaches reqwest as bytes, so it follows a 307 or 308 with the body as it does without
//!   the middleware; a streaming body does not follow them, as without it.
//! - **Middleware extensions.** Each attempt runs the rest of the chain with a copy of the
//!   `Extensions` the middleware was given; what inner middleware write there is not seen by the
//!   middleware before this one.
//!
//! Put the middleware first (outermost) so that each attempt runs the middleware after it
//! (authentication, tracing) afresh.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::reqwest::{Body, Request, Response, ResponseBuilderExt};
use http::Extensions;
use reason_code::BoxError;
use reqwest_middleware::{Error, Middleware, Next};
use tower_service::Service;

use crate::body::ReplayBody;
use crate::error::RetryError;
#[cfg(doc)]
use crate::error::RetryInfo;
use crate::retry::future::ResponseFuture;
use crate::retry::layer::RetryLayer;
use crate::retry::policy::RetryPolicy;
use crate::retry::shared::Shared;
use crate::retry::stats::RetryStats;

/// A `reqwest-middleware` middleware that retries what is safe to retry, as [`RetryLayer`]
/// does. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    shared: Arc<Shared>,
}

impl RetryMiddleware {
    /// A middleware with its own retry budget and counters.
    pub fn new(policy: RetryPolicy) -> Self {
        RetryMiddleware {
            shared: Arc::new(Shared::new(policy)),
        }
    }

    /// Counters since the middleware was made (shared with the layer it was made from, if any).
    pub fn stats(&self) -> RetryStats {
        self.shared.snapshot()
    }

    /// The policy the middleware applies.
    pub fn policy(&self) -> &RetryPolicy {
        &self.shared.policy
    }
}

/// The middleware shares the layer's budget and counters: a process whose tower clients and
/// reqwest clients call the same backend keeps one retry budget for it.
impl From<&RetryLayer> for RetryMiddleware {
    fn from(layer: &RetryLayer) -> Self {
        RetryMiddleware {
            shared: layer.shared().clone(),
        }
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        // The per-request timeout is not part of `http::Request`: keep it for every attempt.
        let timeout = req.timeout().copied();
        let req = http::Request::<Body>::try_from(req)?;
        let chain = Chain {
            next,
            extensions: extensions.clone(),
            timeout,
        };
        match ResponseFuture::new(chain, self.shared.clone(), req, true).await {
            Ok(res) => Ok(Response::from(res)),
            Err(e) => Err(Error::middleware(into_retry_error(e))),
        }
    }
}

/// The `reqwest::Error` behind an error of a client with [`RetryMiddleware`]: the last
/// attempt's transport error, wherever the middleware put it. `None` when the call failed for
/// another reason (the deadline, an attempt timeout of the policy, another middleware).
pub fn reqwest_error(err: &Error) -> Option<&::reqwest::Error> {
    let last = match err {
        Error::Reqwest(e) => return Some(e),
        Error::Middleware(e) => e.downcast_ref::<RetryError>()?,
    };
    match last.downcast_ref::<Error>()? {
        Error::Reqwest(e) => Some(e),
        Error::Middleware(_) => None,
    }
}

/// Every error of the response future is a `RetryError`; anything else is wrapped as one.
fn into_retry_error(e: BoxError) -> RetryError {
    match e.downcast::<RetryError>() {
        Ok(e) => *e,
        Err(other) => {
            let kind = crate::classify::error_kind(&other);
            RetryError::new(other, 0, None).classified(kind)
        }
    }
}

/// The rest of the middleware chain as the service each attempt is sent on.
#[derive(Clone)]
struct Chain<'a> {
    next: Next<'a>,
    extensions: Extensions,
    timeout: Option<Duration>,
}

type ChainFuture<'a> =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Error>> + Send + 'a>>;

impl<'a> Service<http::Request<ReplayBody<Body>>> for Chain<'a> {
    type Response = http::Response<Body>;
    type Error = Error;
    type Future = ChainFuture<'a>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Error>> {
        // A reqwest client has no readiness: its pool queues.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<ReplayBody<Body>>) -> ChainFuture<'a> {
        let next = self.next.clone();
        let mut extensions = self.extensions.clone();
        let timeout = self.timeout;
        // A whole body goes to reqwest as bytes, which it can send again to follow a 307 or
        // 308 redirect; a streaming one as a stream, which it cannot.
        let req = req.map(|body| match body.into_whole() {
            Ok(bytes) => Body::from(bytes),
            Err(streaming) => Body::wrap(streaming),
        });
        Box::pin(async move {
            let mut req = Request::try_from(req)?;
            *req.timeout_mut() = timeout;
            let res = next.run(req, &mut extensions).await?;
            Ok(into_http(res))
        })
    }
}

/// The attempt's response as an `http::Response`, keeping the URL that `reqwest::Response::url`
/// reports once it is converted back.
fn into_http(res: Response) -> http::Response<Body> {
    let url = res.url().clone();
    let mut res = http::Response::from(res);
    if let Ok(with_url) = http::Response::builder().url(url).body(()) {
        res.extensions_mut()
            .extend(with_url.into_parts().0.extensions);
    }
    res
}

impl std::fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

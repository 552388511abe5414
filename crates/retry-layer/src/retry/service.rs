//! [`Retry`]: the service; `call` hands the request to a [`ResponseFuture`].

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use reason_code::BoxError;
use tower_service::Service;

use crate::body::ReplayBody;
use crate::error::RetryError;
use crate::ready::Readiness;
use crate::retry::future::ResponseFuture;
use crate::retry::policy::RetryPolicy;
use crate::retry::shared::Shared;
use crate::retry::stats::RetryStats;

/// Retries what is safe to retry. See the [crate docs](crate) for what that is.
///
/// The inner service receives [`ReplayBody<B>`] request bodies; a hyper-util client infers that
/// type, and a tonic `Channel` takes it through `tonic::body::Body::new` (see the crate docs).
#[derive(Debug, Clone)]
pub struct Retry<S> {
    inner: S,
    shared: Arc<Shared>,
    ready: Readiness,
}

impl<S> Retry<S> {
    /// Wraps `inner` with a layer of its own (its own budget and counters).
    pub fn new(inner: S, policy: RetryPolicy) -> Self {
        Retry::from_shared(inner, Arc::new(Shared::new(policy)))
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<Shared>) -> Self {
        Retry {
            inner,
            shared,
            ready: Readiness::default(),
        }
    }

    /// The counters shared with the layer and its other services.
    pub fn stats(&self) -> RetryStats {
        self.shared.snapshot()
    }

    define_inner_service_accessors!();
}

impl<S, B, R> Service<Request<B>> for Retry<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body + Send + 'static,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    /// Ready at once: slowness of the inner service is never an error here (tower's contract
    /// reads an error as "discard this service"). When the inner service is not ready yet, the
    /// call that follows waits for it in its response future, bounded by the call's deadline
    /// (`total_timeout`, a [`Deadline`](crate::Deadline), `grpc-timeout`) or else by
    /// `response_head_timeout`, counted from the call; past that bound the call ends with
    /// [`DeadlineExceeded`](crate::DeadlineExceeded) or
    /// [`ServiceNotReady`](crate::ServiceNotReady), nothing sent. Only an error of the inner
    /// service's own `poll_ready` (a service that is broken for good) is returned here.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.ready
            .poll(&mut self.inner, cx)
            .map_err(|e| Box::new(RetryError::new(e, 0, None)) as BoxError)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was driven to readiness is the one that must be called; the clone
        // stays here for the next call and may not be ready yet (tower-service docs, "Be careful
        // when cloning inner services").
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let ready = self.ready.take();
        ResponseFuture::new(service, self.shared.clone(), req, ready)
    }
}

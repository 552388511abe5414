//! The response future of [`HopScope`](super::HopScope): marks the handler's answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use reason_code::{Hop, ReasonCodes};
use tokio::task::futures::TaskLocalFuture;

pin_project! {
    /// The response future of [`HopScope`](super::HopScope): the handler runs in the hop's scope, and its
    /// answer is marked if an outbound call retried below or gave up.
    pub struct ResponseFuture<F> where F: Future {
        #[pin]
        future: TaskLocalFuture<Arc<Hop>, F>,
        hop: Arc<Hop>,
        grpc: bool,
        reasons: ReasonCodes,
    }
}

impl<F: Future> ResponseFuture<F> {
    pub(super) fn new(
        future: TaskLocalFuture<Arc<Hop>, F>,
        hop: Arc<Hop>,
        grpc: bool,
        reasons: ReasonCodes,
    ) -> Self {
        ResponseFuture {
            future,
            hop,
            grpc,
            reasons,
        }
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

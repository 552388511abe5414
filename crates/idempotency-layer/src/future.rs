//! The response future of [`Idempotency`](crate::Idempotency).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::IdempotencyBody;

type Managed<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<IdempotencyBody<B>>, E>> + Send + 'static>>;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// Reads and other pass-through requests poll the inner future directly, without boxing.
    /// Writes run the store protocol in one boxed future: they make store round trips anyway,
    /// and the boxed `async` flow is what keeps the claim, wait and replay logic readable.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] fut: F },
        Ready { res: Option<Response<IdempotencyBody<B>>> },
        Managed { fut: Managed<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(fut: F) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { fut },
        }
    }

    pub(crate) fn ready(res: Response<IdempotencyBody<B>>) -> Self {
        ResponseFuture {
            kind: Kind::Ready { res: Some(res) },
        }
    }

    pub(crate) fn managed(fut: Managed<B, E>) -> Self {
        ResponseFuture {
            kind: Kind::Managed { fut },
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Ready { .. } => "Ready",
            Kind::Managed { .. } => "Managed",
        };
        f.debug_tuple("ResponseFuture").field(&kind).finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<IdempotencyBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { fut } => fut
                .poll(cx)
                .map(|r| r.map(|res| res.map(IdempotencyBody::inner))),
            KindProj::Ready { res } => match res.take() {
                Some(res) => Poll::Ready(Ok(res)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Managed { fut } => fut.as_mut().poll(cx),
        }
    }
}

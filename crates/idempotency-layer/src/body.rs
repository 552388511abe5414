//! The request body the inner service sees and the response body the layer returns.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::write::pipe::PipeReader;
use reason_code::BoxError;

pin_project! {
    /// The request body handed to the inner service: the original body for requests the layer
    /// passes through, or the buffered bytes of a write it fingerprinted.
    pub struct RequestBody<B> {
        #[pin]
        kind: ReqKind<B>,
    }
}

pin_project! {
    #[project = ReqKindProj]
    enum ReqKind<B> {
        Streaming { #[pin] body: B },
        Buffered { data: Option<Bytes> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn streaming(body: B) -> Self {
        RequestBody {
            kind: ReqKind::Streaming { body },
        }
    }

    pub(crate) fn buffered(data: Bytes) -> Self {
        RequestBody {
            kind: ReqKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ReqKind::Streaming { .. } => f.write_str("RequestBody::Streaming"),
            ReqKind::Buffered { data } => f
                .debug_struct("RequestBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ReqKindProj::Streaming { body } => body.poll_frame(cx),
            ReqKindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ReqKind::Streaming { body } => body.is_end_stream(),
            ReqKind::Buffered { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ReqKind::Streaming { body } => body.size_hint(),
            ReqKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

pin_project! {
    /// The response body of [`Idempotency`](crate::Idempotency): the handler's body passed
    /// through, the handler's body as it is recorded (read to its end by the layer, whatever the
    /// client's pace, and handed to the client as it comes), a replayed record, or a rejection;
    /// also the whole body of a response a handler recorded in its own transaction
    /// (`TxCompletion::complete_in`, feature `postgres`).
    ///
    /// Its data is [`Bytes`] and its error a boxed error, so axum and tonic both accept it.
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    // The trailers are boxed: a response is moved through every layer of the stack on its way
    // out, and inline they would make every response the layer answers, a replay's too, a
    // `HeaderMap` larger to move.
    enum Kind<B> {
        Inner { #[pin] body: B },
        Recorded { reader: PipeReader },
        Full { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
        /// A body that failed before its first frame: the error, then the end.
        Failed { error: Option<BoxError> },
    }
}

impl<B> fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "Inner",
            Kind::Recorded { .. } => "Recorded",
            Kind::Full { .. } => "Full",
            Kind::Failed { .. } => "Failed",
        };
        f.debug_tuple("IdempotencyBody").field(&kind).finish()
    }
}

impl<B> IdempotencyBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        IdempotencyBody {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn empty() -> Self {
        IdempotencyBody {
            kind: Kind::Full {
                data: None,
                trailers: None,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        IdempotencyBody::replay(data, None)
    }

    pub(crate) fn replay(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        IdempotencyBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers: trailers.map(Box::new),
            },
        }
    }

    /// The handler's body as the layer reads and records it ([`recorder`](crate::write::recorder)).
    pub(crate) fn recorded(reader: PipeReader) -> Self {
        IdempotencyBody {
            kind: Kind::Recorded { reader },
        }
    }

    /// A body that fails at once with `error`: its length unknown, so an HTTP/1.1 server sends
    /// it chunked and breaks the connection off at the error (a `Content-Length: 0` would tell
    /// the client that an empty body was the whole answer).
    pub(crate) fn failed(error: BoxError) -> Self {
        IdempotencyBody {
            kind: Kind::Failed { error: Some(error) },
        }
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Recorded { reader } => reader.poll_frame(cx),
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
            KindProj::Failed { error } => Poll::Ready(error.take().map(Err)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Recorded { reader } => reader.is_end_stream(),
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Failed { error } => error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Recorded { reader } => reader.size_hint(),
            Kind::Full { data, trailers } => {
                let len = data.as_ref().map_or(0, |d| d.len() as u64);
                if trailers.is_some() {
                    // An exact size would make an HTTP/1 server send a Content-Length, and with
                    // it no trailers: leave the length open so the replay is chunked, like the
                    // response it replays.
                    let mut hint = SizeHint::new();
                    hint.set_lower(len);
                    hint
                } else {
                    SizeHint::with_exact(len)
                }
            }
            Kind::Failed { error: Some(_) } => SizeHint::new(),
            Kind::Failed { error: None } => SizeHint::with_exact(0),
        }
    }
}

//! The request body the inner service sees and the response body the layer returns.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use reason_code::Code;

use crate::claim::{spawn_detached, BoxFuture, Claim};
use crate::config::{Config, OnDisconnect};
use crate::recording::RecordBuilder;
use crate::store::{BoxError, Fingerprint};

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
    /// through, the handler's body recorded as it streams to the client, a replayed record, or a
    /// rejection; also the whole body of a response a handler recorded in its own transaction
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
    // The recorder and the trailers are boxed: a response is moved through every layer of the
    // stack on its way out, and inline they would make every response the layer answers, a
    // replay's too, some hundreds of bytes larger to move.
    enum Kind<B> {
        Inner { #[pin] body: B },
        Recording { rec: Box<Recorder<B>> },
        Full { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
    }
}

impl<B> fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "Inner",
            Kind::Recording { .. } => "Recording",
            Kind::Full { .. } => "Full",
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

    pub(crate) fn recording(rec: Box<Recorder<B>>) -> Self {
        IdempotencyBody {
            kind: Kind::Recording { rec },
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
            KindProj::Recording { rec } => rec.poll_frame(cx),
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Recording { rec } => rec.is_end_stream(),
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Recording { rec } => rec.size_hint(),
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
        }
    }
}

/// Tees a handler's response body into a record while it streams to the client.
///
/// The record is stored (or the claim released) when the body's final frame is produced, before
/// that frame is handed to the server: the last data frame of a body that says it has ended or
/// that reaches its known length, the trailers frame, or the end of the body. Servers stop
/// polling a body once they have written its Content-Length or its trailers (hyper does), so
/// waiting for the body to return `None`, or for it to be dropped, would record too late or
/// never; and a client that has the whole response and retries must find the record.
pub(crate) struct Recorder<B> {
    st: Option<RecState<B>>,
    finishing: Option<Finishing>,
    /// What [`Recording::start`] read, handed out before anything else.
    first: Option<Result<Frame<Bytes>, BoxError>>,
}

/// The record being stored, and what to hand out once it is: the final frame, or the end.
struct Finishing {
    store: BoxFuture,
    then: Option<Frame<Bytes>>,
}

struct RecState<B> {
    body: Pin<Box<B>>,
    claim: Claim,
    config: Arc<Config>,
    record: RecordBuilder,
    /// The body's length when the server will stop at it (HTTP/1 with an exact size or a
    /// Content-Length): the frame that reaches it is the last, whether or not the body says so.
    stops_at: Option<u64>,
    seen: u64,
    drain_on_drop: fn(RecState<B>),
}

/// A handler's response about to be recorded ([`start`](Self::start)): its body not yet
/// polled, the claim, and the record's head.
pub(crate) struct Recording<B>(RecState<B>);

/// How a recording started: the response's body, and the record's store operation when the
/// handler's body was already whole.
pub(crate) struct Started<B> {
    /// The body to answer with.
    pub(crate) body: IdempotencyBody<B>,
    /// The record's store operation (or the claim's release), to be awaited before the head is
    /// handed to the server; `None` while the body streams (it is then recorded as it streams).
    pub(crate) store: Option<BoxFuture>,
}

impl<B> Recording<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    /// `http1`: the response goes out over HTTP/1, where the server stops at the body's length.
    /// `head_code`: what [`recording::at_head`](crate::recording::at_head) decided.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        body: B,
        claim: Claim,
        config: Arc<Config>,
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: HeaderMap,
        http1: bool,
        head_code: Option<Code>,
    ) -> Self {
        let stops_at = http1
            .then(|| {
                body.size_hint().exact().or_else(|| {
                    headers
                        .get(CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                })
            })
            .flatten();
        let record = RecordBuilder::new(
            fingerprint,
            status,
            headers,
            head_code,
            config.max_record_bytes,
        );
        Recording(RecState {
            body: Box::pin(body),
            claim,
            config,
            record,
            stops_at,
            seen: 0,
            drain_on_drop: drain_on_drop::<B>,
        })
    }

    /// Polls the handler's body once, before the response head goes out (with `cx`, whose
    /// waker may be a no-op: the server polls the body again with its own). When that produces
    /// the final frame, or the end (an empty body, which a server never polls), the record is
    /// built and its store operation returned, and a final data frame is answered as a whole
    /// body, with no recorder left. Otherwise the frame (if any) is kept, handed out first, and
    /// the body is recorded as it streams.
    pub(crate) fn start(self, cx: &mut Context<'_>) -> Started<B> {
        let mut st = self.0;
        if st.body.is_end_stream() || st.stops_at == Some(0) {
            return Started {
                body: IdempotencyBody::empty(),
                store: Some(st.finish()),
            };
        }
        let (st, first, store) = match st.body.as_mut().poll_frame(cx) {
            Poll::Pending => (Some(st), None, None),
            Poll::Ready(None) => {
                return Started {
                    body: IdempotencyBody::empty(),
                    store: Some(st.finish()),
                }
            }
            Poll::Ready(Some(Ok(frame))) => {
                st.observe(&frame);
                if !st.is_last(&frame) {
                    (Some(st), Some(Ok(frame)), None)
                } else {
                    let store = st.finish();
                    match frame.into_data() {
                        Ok(data) => {
                            return Started {
                                body: IdempotencyBody::full(data),
                                store: Some(store),
                            }
                        }
                        // The trailers: handed out by a recorder, as the handler's body would.
                        Err(trailers) => (None, Some(Ok(trailers)), Some(store)),
                    }
                }
            }
            Poll::Ready(Some(Err(e))) => {
                spawn_detached(st.claim.release());
                (None, Some(Err(e.into())), None)
            }
        };
        Started {
            body: IdempotencyBody::recording(Box::new(Recorder {
                st,
                finishing: None,
                first,
            })),
            store,
        }
    }
}

impl<B> Recorder<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(first));
        }
        loop {
            if let Some(finishing) = self.finishing.as_mut() {
                ready!(finishing.store.as_mut().poll(cx));
                let then = self.finishing.take().and_then(|f| f.then);
                return Poll::Ready(then.map(Ok));
            }
            let Some(st) = self.st.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(st.body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    st.observe(&frame);
                    if !st.is_last(&frame) {
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    if let Some(st) = self.st.take() {
                        self.finishing = Some(Finishing {
                            store: st.finish(),
                            then: Some(frame),
                        });
                    }
                }
                Some(Err(e)) => {
                    if let Some(st) = self.st.take() {
                        spawn_detached(st.claim.release());
                    }
                    return Poll::Ready(Some(Err(e.into())));
                }
                None => {
                    if let Some(st) = self.st.take() {
                        self.finishing = Some(Finishing {
                            store: st.finish(),
                            then: None,
                        });
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.st.is_none() && self.finishing.is_none() && self.first.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let first = match &self.first {
            Some(Ok(f)) => f.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        match (&self.st, &self.finishing) {
            (Some(st), _) => {
                let rest = st.body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + first);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + first);
                }
                hint
            }
            (None, None) if self.first.is_some() => SizeHint::with_exact(first),
            (None, Some(Finishing { then: Some(f), .. })) => {
                SizeHint::with_exact(f.data_ref().map_or(0, |d| d.len() as u64))
            }
            (None, _) => SizeHint::with_exact(0),
        }
    }
}

impl<B> RecState<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn observe(&mut self, frame: &Frame<Bytes>) {
        if let Some(d) = frame.data_ref() {
            self.seen += d.len() as u64;
        }
        self.record.observe(frame);
    }

    /// Is `frame` (just observed) the last one the server will take?
    fn is_last(&self, frame: &Frame<Bytes>) -> bool {
        frame.is_trailers()
            || self.body.is_end_stream()
            || self.stops_at.is_some_and(|len| self.seen >= len)
    }

    /// The body ended: record it if the table allows, else release. The record is built here,
    /// synchronously, so the returned store operation holds only the record and the claim.
    fn finish(self) -> BoxFuture {
        match self.record.finish(&self.config) {
            Ok(record) => self.claim.complete(record),
            Err(code) => {
                tracing::debug!(%code, "idempotency: outcome not recordable; releasing");
                self.claim.release()
            }
        }
    }

    /// The client went away: read the rest of the body, then finish.
    async fn drain(mut self) {
        loop {
            // Map the error away before the await point: it need not be `Send`.
            let next = std::future::poll_fn(|cx| {
                self.body
                    .as_mut()
                    .poll_frame(cx)
                    .map(|f| f.map(|r| r.map_err(drop)))
            })
            .await;
            match next {
                Some(Ok(frame)) => self.observe(&frame),
                Some(Err(())) => return self.claim.release().await,
                None => return self.finish().await,
            }
        }
    }
}

impl<B> Drop for Recorder<B> {
    fn drop(&mut self) {
        // Dropped while storing the record: let the store operation finish.
        if let Some(finishing) = self.finishing.take() {
            spawn_detached(finishing.store);
        }
        // Dropped before the final frame: the client went away mid-body. Either drain the rest
        // and record it, or drop the claim (which releases it).
        if let Some(st) = self.st.take() {
            if st.config.on_disconnect == OnDisconnect::Complete {
                let drain = st.drain_on_drop;
                drain(st);
            }
        }
    }
}

/// Spawns the drain of an abandoned body. A plain function pointer, so `Drop` (which cannot
/// carry the body bounds) can call it.
fn drain_on_drop<B>(st: RecState<B>)
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    tracing::debug!("idempotency: client went away mid-body; finishing the record in a task");
    spawn_detached(st.drain());
}

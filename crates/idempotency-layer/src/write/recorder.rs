//! ResponseRecorder a leader's response: its body is read to its end by the layer, independently of
//! the client, and the record stored before the final frame is handed over.
//!
//! When the record is stored matters. Servers stop polling a body once they have written its
//! Content-Length or its trailers (hyper does), so waiting for the body to return `None` or to
//! be dropped would record too late or never, and a client that has the whole response and
//! retries must find the record: the record is stored before the body's final frame (the last
//! data frame of a body that says it has ended or that reaches its known length, the trailers
//! frame, or the end) is handed to the server.
//!
//! Who drives the body matters too. If the server's polls drove it, a client that reads slowly
//! (or stopped reading: a full flow-control window, a half-open connection) would keep the key
//! in flight as long as its connection lived, and every retry would wait for it. So a body that
//! is not whole at once is read by a task of its own ([`Pump`]), as fast as the handler makes
//! it, into a bounded [`Pipe`] the client reads from: the record (at most `max_record_bytes`,
//! which the record holds anyway) is stored when the handler's body ends. A larger body, whose
//! record keeps no body, is read at the client's pace; the claim's lifetime bounds it.
//!
//! A body that breaks off after a head whose outcome is recorded (a 2xx) is recorded without its
//! body: the handler's side effect happened, and a retry must get "executed once", not run it
//! again. A body that is not recorded ends its claim in the background, after the client has
//! its answer, and hands that answer to the duplicates that were waiting for it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use reason_code::Code;
use tokio::time::Instant;

use crate::body::IdempotencyBody;
use crate::config::Config;
use crate::reject::RejectReason;
use crate::store::{Fingerprint, FOREVER};
use crate::write::claim::Claim;
use crate::write::detached::{self, DetachedPermit, StoreOp};
use crate::write::pipe::{Pipe, PipeReader, Room};
use crate::write::record_rules::{Finished, RecordBuilder};
use crate::write::waiters::SharedFailure;
use reason_code::BoxError;

/// A handler's response about to be recorded ([`start`](Self::start)): its body not yet
/// polled, the claim, and the record's head.
pub(crate) struct ResponseRecorder<B> {
    body: Guarded<B>,
    claim: Claim,
    config: Arc<Config>,
    record: RecordBuilder,
    /// The body's length when the server will stop at it (HTTP/1 with an exact size or a
    /// Content-Length): the frame that reaches it is the last, whether or not the body says so.
    stops_at: Option<u64>,
    seen: u64,
}

/// The handler's response body, every call into it guarded: a panic in `poll_frame`,
/// `is_end_stream` or `size_hint` is the body's failure like any other (an error frame, not
/// the layer's), and the body is never called again. The recording then settles the claim as for
/// a body that broke off there, and the client gets the error.
struct Guarded<B> {
    body: Pin<Box<B>>,
    panicked: bool,
}

impl<B> Guarded<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    fn panicked(&mut self, method: &'static str) {
        self.panicked = true;
        tracing::error!(method, "idempotency: the handler's response body panicked");
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.panicked {
            return Poll::Ready(Some(Err(body_panicked())));
        }
        let body = self.body.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| body.poll_frame(cx))) {
            Ok(frame) => frame.map(|f| f.map(|r| r.map_err(Into::into))),
            Err(_) => {
                self.panicked("poll_frame");
                Poll::Ready(Some(Err(body_panicked())))
            }
        }
    }

    /// `false` once the body panicked (its next poll is its error).
    fn is_end_stream(&mut self) -> bool {
        if self.panicked {
            return false;
        }
        let body = &self.body;
        std::panic::catch_unwind(AssertUnwindSafe(|| body.is_end_stream())).unwrap_or_else(|_| {
            self.panicked("is_end_stream");
            false
        })
    }

    /// Unknown once the body panicked.
    fn size_hint(&mut self) -> SizeHint {
        if self.panicked {
            return SizeHint::new();
        }
        let body = &self.body;
        std::panic::catch_unwind(AssertUnwindSafe(|| body.size_hint())).unwrap_or_else(|_| {
            self.panicked("size_hint");
            SizeHint::new()
        })
    }
}

/// How a recording started: the response's body, and the record's store operation when the
/// handler's body was already whole.
pub(crate) struct Started<B> {
    /// The body to answer with.
    pub(crate) body: IdempotencyBody<B>,
    /// The record's store operation, to be awaited before the head is handed to the server (it
    /// completes even if dropped); `None` when nothing must be stored first (the body streams
    /// and is recorded as it ends, or the outcome is not recorded).
    pub(crate) store: Option<StoreOp>,
}

impl<B> ResponseRecorder<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    /// `http1`: the response goes out over HTTP/1, where the server stops at the body's length.
    /// `head_code`: the code the head decided (`None` when it comes at the end: gRPC trailers).
    /// A code the table does not record is recorded all the same, never stored: it is what the
    /// duplicates waiting for this claim get.
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
        let mut body = Guarded {
            body: Box::pin(body),
            panicked: false,
        };
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
        ResponseRecorder {
            body,
            claim,
            config,
            record,
            stops_at,
            seen: 0,
        }
    }

    /// Polls the handler's body once, before the response head goes out (with `cx`, whose
    /// waker may be a no-op). When that produces the final frame, or the end (an empty body,
    /// which a server never polls), the record is built and its store operation returned, and
    /// the body is answered whole. A body that fails at once is recorded without its body (if
    /// its head is recorded) and answered with its error. Otherwise the rest of the body is
    /// read by a task of its own, and the client reads what it read.
    pub(crate) fn start(mut self, cx: &mut Context<'_>) -> Started<B> {
        if self.body.is_end_stream() || self.stops_at == Some(0) {
            return Started {
                body: IdempotencyBody::empty(),
                store: self.ended(),
            };
        }
        let first = match self.poll_body(cx) {
            Poll::Pending => return self.pump(Vec::new()),
            Poll::Ready(None) => {
                return Started {
                    body: IdempotencyBody::empty(),
                    store: self.ended(),
                }
            }
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => {
                return Started {
                    store: self.broken("the response body failed at its first frame"),
                    body: IdempotencyBody::failed(e),
                }
            }
        };
        self.observe(&first);
        if self.is_last(&first) {
            // The common case (a whole body): answered as it is, nothing gathered.
            let store = self.ended();
            let body = match first.into_data() {
                Ok(data) => IdempotencyBody::full(data),
                Err(frame) => IdempotencyBody::replay(Bytes::new(), frame.into_trailers().ok()),
            };
            return Started { body, store };
        }
        // More frames at hand (a gRPC message, then its trailers): a body that ends within a
        // few polls is answered whole too, with no task of its own.
        let mut read = vec![first];
        for _ in 0..AT_HAND_POLLS {
            match self.poll_body(cx) {
                Poll::Pending => break,
                Poll::Ready(None) => return self.whole(read),
                Poll::Ready(Some(Ok(frame))) => {
                    self.observe(&frame);
                    let last = self.is_last(&frame);
                    read.push(frame);
                    if last {
                        return self.whole(read);
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    // What was read goes out, then the error.
                    let declared = self.declared(&read);
                    let store = self.broken("the response body failed");
                    let pipe = Pipe::new(declared, read, 0, None);
                    pipe.fail(e);
                    let body = IdempotencyBody::recorded(PipeReader::new(pipe, None));
                    return Started { body, store };
                }
            }
        }
        self.pump(read)
    }

    /// Polls the handler's body for its next frame (guarded: see [`Guarded`]).
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.body.poll_frame(cx)
    }

    /// The body ended with the frames `read`: recorded now, answered as one data frame (the
    /// frames' bytes, copied only if there are several) and its trailers.
    fn whole(self, read: Vec<Frame<Bytes>>) -> Started<B> {
        let store = self.ended();
        let (mut data, mut more, mut trailers) = (Bytes::new(), None::<BytesMut>, None);
        for frame in read {
            match frame.into_data() {
                Ok(d) => match &mut more {
                    Some(buf) => buf.extend_from_slice(&d),
                    None if data.is_empty() => data = d,
                    None => {
                        let mut buf = BytesMut::with_capacity(data.len() + d.len());
                        buf.extend_from_slice(&data);
                        buf.extend_from_slice(&d);
                        more = Some(buf);
                    }
                },
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        let data = more.map_or(data, BytesMut::freeze);
        Started {
            body: IdempotencyBody::replay(data, trailers),
            store,
        }
    }

    /// The body's size hint, with the frames `read` already taken from it.
    fn declared(&mut self, read: &[Frame<Bytes>]) -> SizeHint {
        let taken = read
            .iter()
            .filter_map(Frame::data_ref)
            .map(|d| d.len() as u64)
            .sum();
        add(self.body.size_hint(), taken)
    }

    fn observe(&mut self, frame: &Frame<Bytes>) {
        if let Some(d) = frame.data_ref() {
            self.seen += d.len() as u64;
        }
        self.record.observe(frame);
    }

    /// Is `frame` (just observed) the last one the server will take?
    fn is_last(&mut self, frame: &Frame<Bytes>) -> bool {
        frame.is_trailers()
            || self.body.is_end_stream()
            || self.stops_at.is_some_and(|len| self.seen >= len)
    }

    /// The body ended: its record's store operation, to await before the final frame goes out;
    /// or, for an outcome the table does not record, its answer handed to the duplicates
    /// waiting for it and the claim released in the background (`None`), or, with no place free
    /// for that, the release to await before the final frame.
    fn ended(self) -> Option<StoreOp> {
        let ResponseRecorder {
            claim,
            config,
            record,
            ..
        } = self;
        match record.finish(&config) {
            Finished::Recorded(record) => Some(store(claim, record)),
            Finished::NotRecorded(code, answer) => {
                tracing::debug!(%code, "idempotency: outcome not recordable; releasing");
                claim.share_failure(|| SharedFailure::Answer(Arc::new(answer)));
                claim
                    .release()
                    .map(|release| detached::store_op(release, None))
            }
        }
    }

    /// The body broke off before its end (`why`, for the log): recorded without its body if its
    /// head decided an outcome the table records (the store operation is returned); else the
    /// claim is released in the background (or its release returned, as in
    /// [`ended`](Self::ended)), and the duplicates waiting for it are told.
    fn broken(self, why: &'static str) -> Option<StoreOp> {
        let ResponseRecorder {
            claim,
            config,
            record,
            ..
        } = self;
        match record.broken(&config) {
            Some(record) => {
                tracing::warn!(
                    why,
                    "idempotency: the response broke off after a head whose outcome is \
                     recorded; recorded without its body"
                );
                Some(store(claim, record))
            }
            None => {
                tracing::debug!(why, "idempotency: the response broke off; releasing");
                claim.share_failure(|| SharedFailure::Reject(RejectReason::InFlightFailed));
                claim
                    .release()
                    .map(|release| detached::store_op(release, None))
            }
        }
    }

    /// Reads the rest of the body in a task of its own; the client reads from the pipe, first
    /// the frames already `read`.
    fn pump(mut self, read: Vec<Frame<Bytes>>) -> Started<B> {
        let declared = self.declared(&read);
        let budget = self.claim.held_bytes();
        let pipe = Pipe::new(declared, read, self.config.max_record_bytes, budget);
        let pump = Box::pin(
            Pump {
                recording: self,
                pipe: pipe.clone(),
                permit: None,
                _open: OpenUntilEnded(pipe.clone()),
            }
            .run(),
        );
        let driver = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(pump);
                None
            }
            // No runtime to run it on: the client's polls drive it.
            Err(_) => Some(pump as crate::write::pipe::Driver),
        };
        Started {
            body: IdempotencyBody::recorded(PipeReader::new(pipe, driver)),
            store: None,
        }
    }
}

/// How many more times a body whose first frame was not its last is polled before its head goes
/// out, while frames are at hand: one that ends within them needs no task of its own.
const AT_HAND_POLLS: usize = 16;

/// Stores `record` in place of `claim`: an operation that completes even if dropped.
fn store(claim: Claim, record: crate::store::Record) -> StoreOp {
    let to = claim.detach_to("store a record");
    detached::store_op(claim.complete(record), to)
}

/// `hint` plus `n` bytes already read.
fn add(hint: SizeHint, n: u64) -> SizeHint {
    match hint.exact() {
        Some(exact) => SizeHint::with_exact(exact + n),
        None => {
            let mut sum = SizeHint::new();
            if let Some(upper) = hint.upper() {
                sum.set_upper(upper + n);
            }
            sum.set_lower(hint.lower() + n);
            sum
        }
    }
}

/// Reads a handler's body to its end into a [`Pipe`] and records it.
struct Pump<B> {
    recording: ResponseRecorder<B>,
    pipe: Arc<Pipe>,
    /// Held once the client has gone: this reading is then detached work.
    permit: Option<DetachedPermit>,
    _open: OpenUntilEnded,
}

/// Fails the pipe if the pump is dropped before it ended it (its task was cancelled, or its
/// runtime shut down): the client then gets an error, never a body that waits forever.
struct OpenUntilEnded(Arc<Pipe>);

impl Drop for OpenUntilEnded {
    fn drop(&mut self) {
        self.0
            .abandon(|| "the idempotency layer stopped reading the response body".into());
    }
}

/// What the pump does next.
enum Step {
    Frame(Option<Result<Frame<Bytes>, BoxError>>),
    /// The client went away: the rest is detached work.
    ReaderGone,
    /// The claim's lifetime ended.
    Expired,
}

impl<B> Pump<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    async fn run(mut self) {
        let until = self
            .recording
            .claim
            .until()
            .unwrap_or_else(|| Instant::now() + FOREVER);
        let mut expiry = std::pin::pin!(tokio::time::sleep_until(until));
        loop {
            let step = std::future::poll_fn(|cx| {
                if expiry.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Step::Expired);
                }
                match self.pipe.room(cx) {
                    Room::Full => return Poll::Pending,
                    Room::ReaderGone if self.permit.is_none() => {
                        return Poll::Ready(Step::ReaderGone)
                    }
                    Room::Free | Room::ReaderGone => {}
                }
                self.recording.poll_body(cx).map(Step::Frame)
            })
            .await;
            match step {
                Step::ReaderGone => {
                    tracing::debug!(
                        "idempotency: client went away mid-body; reading the rest to record it"
                    );
                    let to = self
                        .recording
                        .claim
                        .detach_to("read a response body to its end");
                    self.permit =
                        to.and_then(|to| detached::permit(&to.shared, to.max, to.kind, to.what));
                    if self.permit.is_none() {
                        let store = self.recording.broken("no room for detached work");
                        return finish(store, || self.pipe.fail(gone())).await;
                    }
                }
                Step::Expired => {
                    self.recording.claim.lifetime_ended();
                    let store = self.recording.broken("max_claim_lifetime");
                    let pipe = self.pipe;
                    return finish(store, || pipe.fail(lifetime_ended())).await;
                }
                Step::Frame(None) => {
                    let store = self.recording.ended();
                    let pipe = self.pipe;
                    return finish(store, || pipe.end(None)).await;
                }
                Step::Frame(Some(Ok(frame))) => {
                    self.recording.observe(&frame);
                    if !self.recording.is_last(&frame) {
                        self.pipe.push(frame);
                        continue;
                    }
                    let store = self.recording.ended();
                    let pipe = self.pipe;
                    return finish(store, || pipe.end(Some(frame))).await;
                }
                Step::Frame(Some(Err(e))) => {
                    let store = self.recording.broken("the response body failed");
                    let pipe = self.pipe;
                    return finish(store, || pipe.fail(e)).await;
                }
            }
        }
    }
}

/// Stores the record (if any), then hands the client the body's end.
async fn finish(store: Option<StoreOp>, then: impl FnOnce()) {
    if let Some(store) = store {
        store.await;
    }
    then();
}

fn body_panicked() -> BoxError {
    "the handler's response body panicked".into()
}

fn gone() -> BoxError {
    "the client went away and the layer has no room left to finish reading the response".into()
}

fn lifetime_ended() -> BoxError {
    "the response body did not end within the idempotency layer's max_claim_lifetime".into()
}

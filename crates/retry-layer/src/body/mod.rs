//! Replayable request bodies.
//!
//! [`ReplayBody`] wraps any [`http_body::Body`]. The first attempt streams the original body as
//! it arrives (nothing waits for the whole body) while a copy of each chunk is kept, up to
//! `max_replay_bytes`. A retry replays the kept chunks (and the trailers), then continues reading
//! the original body where the earlier attempt stopped. A body that grows past the limit stops
//! being kept and makes the request non-retryable: it is never truncated and never buffered
//! without bound. What the body has at hand when it is wrapped (polled without waiting) is read
//! right then: a body that is whole at that point (a `Full<Bytes>`, a tonic unary request) is
//! sent and replayed from those bytes, with no shared state, and ends with its last data frame.
//!
//! Real transports stop polling a body early: hyper stops once `is_end_stream()` is true after
//! the last data frame, once a Content-Length is written, or after the trailers frame. So the
//! copy is marked complete when the last frame is *produced*, not when the original returns
//! `None`. And a transport may keep reading an attempt's body after its response arrived (h2
//! streams on, HTTP/1 keeps writing after an early answer): each new attempt therefore cuts the
//! readers of earlier attempts off, so that only the live attempt reads the original body (and
//! is woken by it), and a stale reader can never change what the live one replays.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::BoxError;

mod memory;
mod wake;

use memory::Charge;
pub(crate) use memory::ReplayMemory;
use wake::{read_with_slot, WakeSlot};

/// A request body that every attempt of a retried request reads from the start.
///
/// Retries of a request whose body was larger than `max_replay_bytes` are refused before they
/// are sent. A reader of an earlier attempt that is still polled after a newer attempt started
/// gets an error (the transport then abandons that stale attempt).
pub struct ReplayBody<B> {
    inner: Inner<B>,
}

enum Inner<B> {
    /// The original body had ended before it was wrapped.
    Empty,
    /// Bytes a rebuild hook supplied, or the whole body read at wrap time.
    Fixed(Option<Bytes>),
    /// A retry of a body that was not kept (never sent: the layer checks first).
    NotReplayable,
    /// One attempt's view of the shared original.
    Shared {
        shared: Arc<Mutex<Kept<B>>>,
        /// The attempt this reader belongs to; only the newest may read.
        generation: u64,
        /// The index of the next kept chunk this attempt reads.
        next: usize,
        trailers_sent: bool,
    },
}

/// What is kept of the original body: shared by the readers of every attempt and the layer's
/// handle.
struct Kept<B> {
    /// The original, until it has produced its last frame.
    body: Option<Pin<Box<B>>>,
    /// Every chunk read so far, while the total stays within `max`.
    chunks: Vec<Bytes>,
    /// How many chunks were read from the original (kept or not).
    read: usize,
    /// How many bytes were read from the original.
    read_bytes: u64,
    /// The length the body declared (exact size hint or Content-Length): a transport stops
    /// polling once that many bytes are written.
    declared_len: Option<u64>,
    kept_bytes: usize,
    max: usize,
    /// More than `max` bytes were read: nothing is kept any longer.
    capped: bool,
    /// The original body failed; its error went to the attempt that read it.
    failed: bool,
    /// The error of an original that failed while it was wrapped, for the first attempt.
    first_error: Option<BoxError>,
    /// The original produced its last frame (or said it had none left).
    ended: bool,
    trailers: Option<HeaderMap>,
    /// The newest attempt's generation; readers of older ones are cut off.
    generation: u64,
    /// How far the newest attempt's reader got in `chunks` (`usize::MAX` once it is dropped).
    live_next: usize,
    /// `chunks` before this index were freed (after the handle went).
    freed: usize,
    /// The layer's handle is gone (the call has its answer): no attempt will replay the body
    /// any more, so nothing more is kept and what the newest reader has read is freed.
    released: bool,
    /// The share of the layer's `max_replay_bytes_total` that `chunks` hold; `None` once
    /// nothing is kept (over a limit, or nothing to keep).
    charge: Option<Charge>,
    /// The waker the wrapping read polled with, if the original kept it: told each reader's
    /// waker, so that the original's wake-ups reach the reader that polls it now.
    early: Option<Arc<WakeSlot>>,
    /// The waker of the reader that last found the original not ready: woken when that reader
    /// is cut off, so that its transport learns at once that its attempt is abandoned.
    parked: Option<Waker>,
}

impl<B> Kept<B> {
    fn finish(&mut self) {
        self.body = None;
        self.ended = true;
    }

    /// Keeps a chunk just read, if it fits both limits; past either, nothing is kept any
    /// longer and the body is not replayable.
    fn keep(&mut self, chunk: &Bytes) {
        if self.capped || self.released {
            return;
        }
        let fits = self.kept_bytes + chunk.len() <= self.max
            && self.charge.as_mut().is_some_and(|c| c.take(chunk.len()));
        if fits {
            self.kept_bytes += chunk.len();
            self.chunks.push(chunk.clone());
        } else {
            self.cap();
        }
    }

    /// Nothing is kept from now on; what is kept goes (its share of the layer's memory too).
    fn cap(&mut self) {
        self.capped = true;
        self.chunks = Vec::new();
        self.charge = None;
    }

    /// After the handle is gone: frees the chunks the newest reader has read.
    fn free_read(&mut self) {
        if !self.released {
            return;
        }
        let upto = self.live_next.min(self.chunks.len());
        let mut freed = 0;
        for chunk in self.chunks.get_mut(self.freed..upto).into_iter().flatten() {
            freed += chunk.len();
            *chunk = Bytes::new();
        }
        self.freed = self.freed.max(upto);
        if let Some(charge) = self.charge.as_mut() {
            charge.give_back(freed);
        }
    }

    /// True when every data byte of the original has been read and kept.
    fn data_complete(&self) -> bool {
        !self.capped && !self.failed && (self.ended || self.declared_len == Some(self.read_bytes))
    }
}

/// A retry attempt read past what could be kept of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyNotReplayable;

impl fmt::Display for BodyNotReplayable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the request body was not kept for replay: it exceeded max_replay_bytes, or the \
             layer's max_replay_bytes_total was in use by other calls; raise \
             RetryPolicyBuilder::max_replay_bytes (or max_replay_bytes_total) to retry such \
             requests",
        )
    }
}

impl std::error::Error for BodyNotReplayable {}

/// The error a stale attempt's body gets once a newer attempt of the same request started. Only
/// transports see it (the stale attempt's response was already handled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Superseded;

impl fmt::Display for Superseded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a newer attempt of this request is sending its body; this attempt is abandoned",
        )
    }
}

impl std::error::Error for Superseded {}

impl<B> Drop for ReplayBody<B> {
    /// The newest attempt's reader is done: once the handle is gone too, nothing it kept is
    /// needed.
    fn drop(&mut self) {
        if let Inner::Shared {
            shared, generation, ..
        } = &self.inner
        {
            let mut s = lock(shared);
            if *generation == s.generation {
                s.live_next = usize::MAX;
                s.free_read();
            }
        }
    }
}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.inner {
            Inner::Empty => "empty",
            Inner::Fixed(_) => "fixed",
            Inner::NotReplayable => "not replayable",
            Inner::Shared { .. } => "shared",
        };
        f.debug_struct("ReplayBody").field("kind", &kind).finish()
    }
}

/// The retry layer's handle on a wrapped body: makes the next attempt's body and says whether a
/// retry can still carry it.
pub(crate) struct BodyHandle<B> {
    kind: Handle<B>,
}

enum Handle<B> {
    /// No bytes: every attempt's body is empty.
    Empty,
    /// The whole body, read when it was wrapped: every attempt gets these bytes (no lock, no
    /// shared state, nothing to cut off), and their share of the layer's memory.
    Whole {
        bytes: Bytes,
        /// Held for its drop: the share is given back when the call ends.
        _charge: Charge,
    },
    /// The original, read by the attempts as it streams.
    Shared(Arc<Mutex<Kept<B>>>),
    /// The whole body was read when it was wrapped, but the layer's `max_replay_bytes_total`
    /// could not hold a copy: sent once.
    Spent,
}

impl<B> Drop for BodyHandle<B> {
    /// The call has its answer: no attempt will replay the body. A transport may go on
    /// reading it (a client stream, h2 after an early answer); from now on nothing more is
    /// kept, and what its reader has read is freed.
    fn drop(&mut self) {
        if let Handle::Shared(shared) = &self.kind {
            let mut s = lock(shared);
            s.released = true;
            s.free_read();
        }
    }
}

/// `chunks` (`len` bytes in all) in one `Bytes`.
fn concat<'a>(chunks: impl IntoIterator<Item = &'a Bytes>, len: usize) -> Bytes {
    let mut all = bytes::BytesMut::with_capacity(len);
    for c in chunks {
        all.extend_from_slice(c);
    }
    all.freeze()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<B: Body> ReplayBody<B>
where
    B::Error: Into<BoxError>,
{
    /// Wraps `body`, keeping up to `max` bytes for replay (0: nothing is kept, and the body is
    /// replayable only until its first byte is read, that is while the request is unsent).
    /// `content_length` is the request's Content-Length header, if any. Returns the first
    /// attempt's body and the handle the layer keeps, or the body's error when it failed
    /// before any byte of it was read: then nothing must be sent.
    ///
    /// A body that may fit within `max` is polled right here, while it has frames ready and up
    /// to `max` bytes ([`EARLY_POLLS`] polls at most): a body that has all its bytes at hand
    /// (`Full<Bytes>`, a buffered body, a tonic unary request's encoded message) hands them
    /// over and ends, and is then replayed from those bytes by every attempt with no shared
    /// state. What these polls read of any other body is planted into what is kept, and the
    /// rest streams as it arrives. The polls' waker leads to the waker of whichever reader
    /// polls the body later (see [`wake`]).
    pub(crate) fn new(
        body: B,
        max: usize,
        content_length: Option<u64>,
        memory: &Arc<ReplayMemory>,
    ) -> Result<(ReplayBody<B>, BodyHandle<B>), BoxError> {
        if body.is_end_stream() {
            return Ok(Self::empty());
        }
        let hint = body.size_hint();
        let mut body = Box::pin(body);
        // Made on the first frame that is not a whole body at once: most bodies never need one.
        let mut seed: Option<Seed> = None;
        let mut early = None;
        // Nothing kept: the body must stay unread until it is sent (see above).
        if max > 0 && hint.lower() <= max as u64 {
            // The waker of a slot that each reader later points at its own (see `wake`).
            let (whole, slot) = read_with_slot(|cx| {
                let mut read = 0;
                for _ in 0..EARLY_POLLS {
                    if read > max {
                        break;
                    }
                    match body.as_mut().poll_frame(cx) {
                        Poll::Pending => break,
                        Poll::Ready(None) => {
                            seed.get_or_insert_default().ended = true;
                            break;
                        }
                        Poll::Ready(Some(Err(e))) => {
                            seed.get_or_insert_default().error = Some(e.into());
                            break;
                        }
                        Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                            Ok(mut data) => {
                                let chunk = data.copy_to_bytes(data.remaining());
                                let last = body.is_end_stream();
                                // The common case, a whole body in one frame, at once.
                                if last
                                    && seed.is_none()
                                    && chunk.len() <= max
                                    && hint.exact().is_none_or(|n| n == chunk.len() as u64)
                                {
                                    return Some(Self::whole(chunk, memory));
                                }
                                read += chunk.len();
                                let seed = seed.get_or_insert_default();
                                seed.push(chunk);
                                if last {
                                    seed.ended = true;
                                    break;
                                }
                            }
                            Err(frame) => {
                                // Trailers end a body; an unknown frame kind is skipped, as the
                                // readers skip it.
                                let seed = seed.get_or_insert_default();
                                seed.trailers = frame.into_trailers().ok();
                                seed.ended = seed.trailers.is_some();
                                break;
                            }
                        },
                    }
                }
                None
            });
            if let Some(whole) = whole {
                return Ok(whole);
            }
            early = slot;
            if let Some(whole) = seed.as_mut().and_then(|s| s.whole(hint.exact(), max)) {
                return Ok(whole.map_or_else(Self::empty, |b| Self::whole(b, memory)));
            }
            // Failed before a byte was read: nothing must be sent.
            if let Some(s) = seed.as_mut().filter(|s| s.first.is_none()) {
                if let Some(e) = s.error.take() {
                    return Err(e);
                }
            }
        }
        // A body known to exceed the limit is never kept (unless nothing is kept at all: then
        // it is replayable while unread, like any other).
        let capped = max > 0 && hint.lower() > max as u64;
        let mut kept = Kept {
            body: Some(body),
            chunks: Vec::new(),
            read: 0,
            read_bytes: 0,
            declared_len: hint.exact().or(content_length),
            kept_bytes: 0,
            max,
            capped,
            failed: false,
            first_error: None,
            ended: false,
            trailers: None,
            generation: 0,
            live_next: 0,
            freed: 0,
            released: false,
            charge: (max > 0 && !capped)
                .then(|| Charge::of(memory, 0))
                .flatten(),
            early,
            parked: None,
        };
        if let Some(seed) = seed {
            seed.plant(&mut kept);
        }
        let shared = Arc::new(Mutex::new(kept));
        let first = ReplayBody {
            inner: Inner::Shared {
                shared: shared.clone(),
                generation: 0,
                next: 0,
                trailers_sent: false,
            },
        };
        Ok((
            first,
            BodyHandle {
                kind: Handle::Shared(shared),
            },
        ))
    }

    fn empty() -> (ReplayBody<B>, BodyHandle<B>) {
        (
            ReplayBody {
                inner: Inner::Empty,
            },
            BodyHandle {
                kind: Handle::Empty,
            },
        )
    }

    /// A body read whole at wrap time: every attempt sends `bytes`, if the layer's memory
    /// holds a copy; else it is sent once.
    #[inline]
    fn whole(bytes: Bytes, memory: &Arc<ReplayMemory>) -> (ReplayBody<B>, BodyHandle<B>) {
        let kind = match Charge::of(memory, bytes.len()) {
            Some(charge) => Handle::Whole {
                bytes: bytes.clone(),
                _charge: charge,
            },
            None => Handle::Spent,
        };
        (
            ReplayBody {
                inner: Inner::Fixed(Some(bytes)),
            },
            BodyHandle { kind },
        )
    }

    /// The whole body, when it is at hand (empty, or read whole when it was wrapped); else the
    /// body itself, which streams.
    #[cfg(feature = "reqwest")]
    pub(crate) fn into_whole(mut self) -> Result<Bytes, Self> {
        match std::mem::replace(&mut self.inner, Inner::Empty) {
            Inner::Empty => Ok(Bytes::new()),
            Inner::Fixed(Some(bytes)) => Ok(bytes),
            inner => {
                self.inner = inner;
                Err(self)
            }
        }
    }

    /// A body of fixed bytes (from a rebuild hook).
    pub(crate) fn fixed(bytes: Bytes) -> Self {
        ReplayBody {
            inner: Inner::Fixed(Some(bytes)),
        }
    }
}

/// How many times [`ReplayBody::new`] polls a body for frames it has at hand.
const EARLY_POLLS: usize = 16;

/// What the polls of a body read while it was wrapped: planted into what is kept as if the
/// first attempt had read it.
#[derive(Default)]
struct Seed {
    /// The first data frame read (most bodies at hand have one: no allocation for them).
    first: Option<Bytes>,
    /// The data frames read after the first, in order.
    more: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<BoxError>,
    /// The body said it had nothing left (its last frame was read, or it returned `None`).
    ended: bool,
}

impl Seed {
    fn push(&mut self, chunk: Bytes) {
        if self.first.is_none() {
            self.first = Some(chunk);
        } else {
            self.more.push(chunk);
        }
    }

    /// The whole body, if the polls read all of it, without trailers or an error, within
    /// `max` and as long as its exact size hint said: `Some(None)` for no bytes at all.
    fn whole(&mut self, exact: Option<u64>, max: usize) -> Option<Option<Bytes>> {
        if !self.ended || self.trailers.is_some() || self.error.is_some() {
            return None;
        }
        let first = self.first.as_ref().map_or(0, Bytes::len);
        let len = first + self.more.iter().map(Bytes::len).sum::<usize>();
        if len > max || exact.is_some_and(|n| n != len as u64) {
            return None;
        }
        if self.more.is_empty() {
            return Some(self.first.take());
        }
        Some(Some(concat(self.first.iter().chain(&self.more), len)))
    }

    fn plant<B: Body>(self, s: &mut Kept<B>) {
        for chunk in self.first.into_iter().chain(self.more) {
            // The first attempt reads these from what is kept, so they are kept even past
            // `max` or the layer's memory; past either, the body is not replayable (and holds
            // no share of the memory), and the first attempt's reader drops them once it has
            // read them.
            s.read += 1;
            s.read_bytes += chunk.len() as u64;
            s.kept_bytes += chunk.len();
            let charged = !s.capped
                && s.kept_bytes <= s.max
                && s.charge.as_mut().is_some_and(|c| c.take(chunk.len()));
            s.chunks.push(chunk);
            if !charged {
                s.capped = true;
                s.charge = None;
            }
        }
        if let Some(trailers) = self.trailers {
            s.trailers = Some(trailers);
        }
        if let Some(e) = self.error {
            s.body = None;
            s.failed = true;
            s.first_error = Some(e);
        } else if self.ended {
            s.finish();
        }
    }
}

impl<B> BodyHandle<B> {
    /// The handle of a call that sends no body at all.
    pub(crate) fn empty() -> Self {
        BodyHandle {
            kind: Handle::Empty,
        }
    }

    /// True when another attempt can carry the whole body: every byte read from the original
    /// so far is still kept. A body over the limit qualifies while nothing of it was read (or
    /// what the wrapping read is still there): a request that was never sent can be retried
    /// whatever its size.
    pub(crate) fn is_replayable(&self) -> bool {
        match &self.kind {
            Handle::Empty | Handle::Whole { .. } => true,
            Handle::Spent => false,
            Handle::Shared(shared) => {
                let s = lock(shared);
                !s.failed && (!s.capped || s.chunks.len() == s.read)
            }
        }
    }

    /// Cuts off the readers of every attempt made so far: from now on they get an error instead
    /// of reading (or keeping) anything of the original body.
    pub(crate) fn cut_off(&self) {
        if let Handle::Shared(shared) = &self.kind {
            let parked = {
                let mut s = lock(shared);
                s.generation += 1;
                s.parked.take()
            };
            // The reader that waits for the original is now cut off: its transport must poll
            // it again to learn so (and abandon its attempt).
            if let Some(w) = parked {
                w.wake();
            }
        }
    }

    /// The body of the next attempt, reading from the first byte. Earlier attempts' readers are
    /// cut off.
    pub(crate) fn replay(&self) -> ReplayBody<B> {
        match &self.kind {
            Handle::Empty => ReplayBody {
                inner: Inner::Empty,
            },
            Handle::Whole { bytes, .. } => ReplayBody {
                inner: Inner::Fixed(Some(bytes.clone())),
            },
            Handle::Spent => ReplayBody {
                inner: Inner::NotReplayable,
            },
            Handle::Shared(shared) => {
                let (generation, parked) = {
                    let mut s = lock(shared);
                    s.generation += 1;
                    s.live_next = 0;
                    (s.generation, s.parked.take())
                };
                if let Some(w) = parked {
                    w.wake();
                }
                ReplayBody {
                    inner: Inner::Shared {
                        shared: shared.clone(),
                        generation,
                        next: 0,
                        trailers_sent: false,
                    },
                }
            }
        }
    }

    /// The whole body, when every byte of it has been read and kept (for a rebuild hook).
    pub(crate) fn complete_bytes(&self) -> Option<Bytes> {
        let shared = match &self.kind {
            Handle::Empty => return Some(Bytes::new()),
            Handle::Whole { bytes, .. } => return Some(bytes.clone()),
            Handle::Spent => return None,
            Handle::Shared(shared) => shared,
        };
        let s = lock(shared);
        if !s.data_complete() {
            return None;
        }
        if let [one] = s.chunks.as_slice() {
            return Some(one.clone());
        }
        Some(concat(&s.chunks, s.kept_bytes))
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // ReplayBody is Unpin: the original body is pinned in its own box.
        let this = self.get_mut();
        let (shared, generation, next, trailers_sent) = match &mut this.inner {
            Inner::Empty => return Poll::Ready(None),
            Inner::Fixed(bytes) => return Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Inner::NotReplayable => return Poll::Ready(Some(Err(BodyNotReplayable.into()))),
            Inner::Shared {
                shared,
                generation,
                next,
                trailers_sent,
            } => (shared, *generation, next, trailers_sent),
        };
        let mut s = lock(shared);
        // A newer attempt owns the body now: this reader must neither read the original (and
        // take its wake-up) nor change what is kept.
        if generation != s.generation {
            return Poll::Ready(Some(Err(Superseded.into())));
        }
        // Replay what an earlier attempt (or the wrapping) read. Past the limit, nothing is
        // kept, except what the wrapping read, for the first attempt only.
        if *next < s.read {
            let Some(chunk) = s.chunks.get(*next).cloned() else {
                return Poll::Ready(Some(Err(BodyNotReplayable.into())));
            };
            *next += 1;
            s.live_next = *next;
            if s.capped && *next == s.chunks.len() {
                s.chunks = Vec::new();
            } else {
                s.free_read();
            }
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        // At the head: read on from the original, or replay its end.
        let Some(body) = s.body.as_mut() else {
            if s.failed {
                let e = s.first_error.take();
                return Poll::Ready(Some(Err(e.unwrap_or_else(|| BodyNotReplayable.into()))));
            }
            if !*trailers_sent {
                *trailers_sent = true;
                if let Some(t) = s.trailers.clone() {
                    return Poll::Ready(Some(Ok(Frame::trailers(t))));
                }
            }
            return Poll::Ready(None);
        };
        match body.as_mut().poll_frame(cx) {
            Poll::Pending => {
                // The original's wake-ups must reach this reader, and a newer attempt must be
                // able to wake it to cut it off.
                if let Some(slot) = &s.early {
                    slot.forward_to(cx.waker());
                }
                if !s.parked.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.parked = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Poll::Ready(None) => {
                s.finish();
                *trailers_sent = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                s.body = None;
                s.failed = true;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(mut data) => {
                    let chunk = data.copy_to_bytes(data.remaining());
                    // The transport may stop polling after this frame: the copy must be
                    // complete before the frame is handed out.
                    let last = body.is_end_stream();
                    s.read += 1;
                    s.read_bytes += chunk.len() as u64;
                    *next += 1;
                    s.keep(&chunk);
                    s.live_next = *next;
                    if last {
                        s.finish();
                        *trailers_sent = true;
                    }
                    Poll::Ready(Some(Ok(Frame::data(chunk))))
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        // Trailers are the last frame of a body.
                        s.trailers = Some(trailers.clone());
                        s.finish();
                        *trailers_sent = true;
                        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                    }
                    // An unknown frame kind: passing it on is impossible without its data
                    // type; skip it and ask to be polled again.
                    Err(_) => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                },
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Empty => true,
            Inner::Fixed(b) => b.is_none(),
            Inner::NotReplayable => false,
            Inner::Shared {
                shared,
                generation,
                next,
                trailers_sent,
            } => {
                let mut s = lock(shared);
                if *generation != s.generation || *next < s.read || s.failed {
                    return false;
                }
                if let Some(body) = &s.body {
                    if !body.is_end_stream() {
                        return false;
                    }
                    // The original has nothing left: mark the copy complete now, since the
                    // transport will not poll again.
                    s.finish();
                }
                *trailers_sent || s.trailers.is_none()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Fixed(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::NotReplayable => SizeHint::new(),
            Inner::Shared {
                shared,
                next,
                trailers_sent,
                ..
            } => {
                let s = lock(shared);
                // Past the limit, `chunks` holds only what the wrapping read and the first
                // attempt has yet to send.
                let kept: u64 = s
                    .chunks
                    .get(*next..)
                    .map_or(0, |c| c.iter().map(|c| c.len() as u64).sum());
                match &s.body {
                    // Trailers still to replay: not an exact size, or an HTTP/1 client would
                    // send a Content-Length, which cannot carry trailers.
                    None if s.trailers.is_some() && !*trailers_sent => {
                        let mut hint = SizeHint::new();
                        hint.set_lower(kept);
                        hint
                    }
                    None => SizeHint::with_exact(kept),
                    Some(body) => {
                        let rest = body.size_hint();
                        let mut hint = SizeHint::new();
                        hint.set_lower(kept + rest.lower());
                        if let Some(upper) = rest.upper() {
                            hint.set_upper(kept + upper);
                        }
                        hint
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    /// A layer's memory with room for every test.
    fn memory() -> Arc<ReplayMemory> {
        Arc::new(ReplayMemory::new(1 << 20))
    }

    /// Wraps a body that does not fail at wrap time.
    fn wrap<B>(body: B, max: usize, content_length: Option<u64>) -> (ReplayBody<B>, BodyHandle<B>)
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        match ReplayBody::new(body, max, content_length, &memory()) {
            Ok(wrapped) => wrapped,
            Err(e) => panic!("the body failed at wrap time: {e}"),
        }
    }

    fn chunks(
        parts: &'static [&'static str],
    ) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>>> {
        StreamBody::new(futures_util::stream::iter(
            parts
                .iter()
                .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes())))),
        ))
    }

    async fn collect<B>(b: ReplayBody<B>) -> Result<Bytes, BoxError>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Ok(b.collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn replays_a_streaming_body_byte_for_byte() {
        let (first, handle) = wrap(chunks(&["hello ", "streaming ", "world"]), 1024, None);
        assert_eq!(collect(first).await.unwrap(), "hello streaming world");
        assert!(handle.is_replayable());
        assert_eq!(
            collect(handle.replay()).await.unwrap(),
            "hello streaming world"
        );
        assert_eq!(
            collect(handle.replay()).await.unwrap(),
            "hello streaming world"
        );
        assert_eq!(handle.complete_bytes().unwrap(), "hello streaming world");
    }

    #[tokio::test]
    async fn a_retry_continues_where_the_first_attempt_stopped() {
        let (mut first, handle) = wrap(Known::paused(&[Ok("a"), Ok("b"), Ok("c")]), 1024, None);
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "a");
        drop(first);
        assert!(handle.complete_bytes().is_none());
        assert_eq!(collect(handle.replay()).await.unwrap(), "abc");
    }

    #[tokio::test]
    async fn over_the_limit_is_streamed_whole_and_not_replayable() {
        let (first, handle) = wrap(chunks(&["12345", "67890", "x"]), 8, None);
        assert_eq!(collect(first).await.unwrap(), "1234567890x");
        assert!(!handle.is_replayable());
        let err = collect(handle.replay()).await.unwrap_err();
        assert!(err.is::<BodyNotReplayable>());
    }

    #[tokio::test]
    async fn empty_and_known_large_bodies() {
        let (first, handle) = wrap(http_body_util::Empty::<Bytes>::new(), 8, None);
        assert!(first.is_end_stream());
        assert!(handle.is_replayable());
        let (first, handle) = wrap(http_body_util::Full::new(Bytes::from(vec![0; 9])), 8, None);
        assert_eq!(first.size_hint().exact(), Some(9));
        assert!(
            handle.is_replayable(),
            "known too large, but unread: an unsent attempt can be retried"
        );
        assert_eq!(collect(first).await.unwrap().len(), 9);
        assert!(!handle.is_replayable(), "read and not kept");
    }

    /// A body of known size whose frames arrive one poll at a time: the first poll is
    /// `Pending` if `late`; with `pause`, so is the poll after each frame.
    struct Known {
        parts: std::collections::VecDeque<Result<Bytes, &'static str>>,
        len: u64,
        late: bool,
        pause: bool,
    }

    impl Known {
        fn new(parts: &[Result<&'static str, &'static str>], late: bool) -> Known {
            let len = parts.iter().flatten().map(|p| p.len() as u64).sum();
            Known {
                parts: parts
                    .iter()
                    .map(|p| p.map(|s| Bytes::from_static(s.as_bytes())))
                    .collect(),
                len,
                late,
                pause: false,
            }
        }

        /// Each frame after the first arrives one poll after `Pending`.
        fn paused(parts: &[Result<&'static str, &'static str>]) -> Known {
            Known {
                pause: true,
                ..Known::new(parts, false)
            }
        }
    }

    impl Body for Known {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            if std::mem::take(&mut self.late) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.late = self.pause;
            Poll::Ready(self.parts.pop_front().map(|p| match p {
                Ok(b) => Ok(Frame::data(b)),
                Err(e) => Err(e.into()),
            }))
        }
        fn is_end_stream(&self) -> bool {
            self.parts.is_empty()
        }
        fn size_hint(&self) -> SizeHint {
            let left: u64 = self.parts.iter().flatten().map(|p| p.len() as u64).sum();
            SizeHint::with_exact(left.min(self.len))
        }
    }

    #[tokio::test]
    async fn a_whole_body_at_hand_is_taken_once_and_shared_by_nothing() {
        let (first, handle) = wrap(
            http_body_util::Full::new(Bytes::from_static(b"order")),
            8,
            None,
        );
        assert!(matches!(handle.kind, Handle::Whole { .. }));
        assert!(matches!(first.inner, Inner::Fixed(Some(_))));
        assert_eq!(first.size_hint().exact(), Some(5));
        assert!(handle.is_replayable());
        assert_eq!(collect(first).await.unwrap(), "order");
        handle.cut_off();
        let replay = handle.replay();
        assert_eq!(replay.size_hint().exact(), Some(5));
        assert_eq!(collect(replay).await.unwrap(), "order");
        assert_eq!(handle.complete_bytes().unwrap(), "order");
    }

    /// A tonic unary request: one encoded message, no size hint, and `is_end_stream()` false
    /// until a second poll says `None`; or several frames, all at hand.
    #[tokio::test]
    async fn a_whole_body_at_hand_without_a_size_hint_is_taken_whole() {
        for parts in [
            &["order"][..],
            &["or", "der"][..],
            &["o", "r", "d", "e", "r"][..],
        ] {
            let (mut first, handle) = wrap(chunks(parts), 8, None);
            assert!(matches!(handle.kind, Handle::Whole { .. }), "{parts:?}");
            assert_eq!(first.size_hint().exact(), Some(5));
            let frame = first.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), "order");
            // What hyper's h2 client reads after a data frame to set END_STREAM on it: the
            // request goes out as one DATA frame, not a second, empty one.
            assert!(first.is_end_stream());
            assert_eq!(collect(handle.replay()).await.unwrap(), "order");
        }
        // The first frame is read at wrap time, the others stream.
        let (first, handle) = wrap(Known::paused(&[Ok("o"), Ok("r"), Ok("der")]), 8, None);
        assert!(matches!(handle.kind, Handle::Shared(_)));
        assert_eq!(collect(first).await.unwrap(), "order");
        assert_eq!(handle.complete_bytes().unwrap(), "order");
        assert_eq!(collect(handle.replay()).await.unwrap(), "order");
    }

    /// What the wrapping read past the limit still goes to the first attempt, whole, and the
    /// body is not replayable once that attempt has read it (before, an attempt that never
    /// sent it may still hand it to the next one).
    #[tokio::test]
    async fn a_body_read_past_the_limit_at_wrap_time_is_sent_once_whole() {
        let (first, handle) = wrap(chunks(&["123456789"]), 8, None);
        assert!(matches!(handle.kind, Handle::Shared(_)));
        assert!(handle.is_replayable(), "what the wrapping read is all kept");
        assert_eq!(first.size_hint().lower(), 9);
        assert!(!first.is_end_stream());
        assert_eq!(collect(first).await.unwrap(), "123456789");
        assert!(!handle.is_replayable());
        assert!(handle.complete_bytes().is_none());
        let err = collect(handle.replay()).await.unwrap_err();
        assert!(err.is::<BodyNotReplayable>());
        match &handle.kind {
            Handle::Shared(s) => assert!(lock(s).chunks.is_empty(), "dropped once sent"),
            _ => unreachable!(),
        }
        // Two frames read at wrap time, the second past the limit, the third streams.
        let (first, handle) = wrap(chunks(&["12345", "67890", "x"]), 8, None);
        assert!(handle.is_replayable());
        assert_eq!(collect(first).await.unwrap(), "1234567890x");
        assert!(!handle.is_replayable());
    }

    /// Issue 31 item 8: an attempt that never read a body over the limit hands it whole to the
    /// next one, what the wrapping read included.
    #[tokio::test]
    async fn an_unread_body_over_the_limit_goes_whole_to_the_next_attempt() {
        let (first, handle) = wrap(chunks(&["12345", "67890", "x"]), 8, None);
        drop(first);
        assert!(handle.is_replayable());
        assert_eq!(collect(handle.replay()).await.unwrap(), "1234567890x");
        assert!(!handle.is_replayable());
        let (first, handle) = wrap(Known::new(&[Ok("12345"), Ok("6789")], true), 8, None);
        drop(first);
        assert!(handle.is_replayable(), "known too large and unread");
        assert_eq!(collect(handle.replay()).await.unwrap(), "123456789");
    }

    #[tokio::test]
    async fn a_known_size_body_not_at_hand_streams_as_before() {
        let (first, handle) = wrap(Known::new(&[Ok("ab"), Ok("cd")], true), 8, None);
        assert!(matches!(handle.kind, Handle::Shared(_)));
        assert_eq!(collect(first).await.unwrap(), "abcd");
        assert_eq!(collect(handle.replay()).await.unwrap(), "abcd");
    }

    #[tokio::test]
    async fn a_first_frame_read_at_wrap_time_is_the_first_attempts_first_frame() {
        let (first, handle) = wrap(Known::paused(&[Ok("ab"), Ok("cd")]), 8, None);
        assert!(matches!(handle.kind, Handle::Shared(_)));
        assert_eq!(first.size_hint().exact(), Some(4));
        assert!(handle.complete_bytes().is_none(), "half of it read");
        assert_eq!(collect(first).await.unwrap(), "abcd");
        assert_eq!(handle.complete_bytes().unwrap(), "abcd");
        assert_eq!(collect(handle.replay()).await.unwrap(), "abcd");
    }

    #[tokio::test]
    async fn a_body_that_fails_at_wrap_time_is_not_sent() {
        let err = ReplayBody::new(Known::new(&[Err("disk gone")], false), 8, None, &memory())
            .err()
            .expect("failed before its first byte: nothing to send");
        assert_eq!(err.to_string(), "disk gone");
        // After a first chunk, the error goes to the first attempt, which has started sending.
        let (first, handle) = wrap(Known::new(&[Ok("ab"), Err("disk gone")], false), 8, None);
        assert!(!handle.is_replayable());
        let err = collect(first).await.unwrap_err();
        assert_eq!(err.to_string(), "disk gone");
        let err = collect(handle.replay()).await.unwrap_err();
        assert!(err.is::<BodyNotReplayable>());
    }

    /// Issue 31 item 16: a reader waiting for the original is woken when a newer attempt cuts
    /// it off, so that its transport abandons the attempt now rather than at the original's
    /// next frame (which may never come).
    #[tokio::test]
    async fn a_reader_cut_off_while_waiting_is_woken() {
        for cut in ["cut_off", "replay"] {
            let (_tx, body) = channel_body();
            let (mut stale, handle) = wrap(body, 64, None);
            let (stale_flag, stale_waker) = flag();
            assert!(poll(&mut stale, &stale_waker).is_pending());
            assert!(!woken(&stale_flag));
            let _live = match cut {
                "cut_off" => {
                    handle.cut_off();
                    None
                }
                _ => Some(handle.replay()),
            };
            assert!(woken(&stale_flag), "{cut}");
            assert!(matches!(
                poll(&mut stale, &stale_waker),
                Poll::Ready(Some(Err(_)))
            ));
        }
    }

    #[tokio::test]
    async fn keeping_nothing_is_replayable_only_until_the_first_byte_is_read() {
        let (first, handle) = wrap(
            http_body_util::Full::new(Bytes::from_static(b"order")),
            0,
            None,
        );
        assert!(matches!(handle.kind, Handle::Shared(_)), "not polled early");
        assert!(handle.is_replayable(), "unsent: replayable");
        drop(first);
        // An unsent attempt's retry reads the original from the start.
        let mut second = handle.replay();
        assert!(handle.is_replayable());
        let frame = second.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "order");
        assert!(!handle.is_replayable(), "read and not kept");
        match &handle.kind {
            Handle::Shared(s) => assert!(lock(s).chunks.is_empty()),
            _ => unreachable!(),
        }
    }

    #[tokio::test]
    async fn exact_size_hint_on_replay() {
        let (first, handle) = wrap(
            http_body_util::Full::new(Bytes::from_static(b"abcd")),
            8,
            None,
        );
        assert_eq!(first.size_hint().exact(), Some(4));
        collect(first).await.unwrap();
        let replay = handle.replay();
        assert_eq!(replay.size_hint().exact(), Some(4));
        assert!(!replay.is_end_stream());
    }

    fn trailers() -> HeaderMap {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "abc".parse().unwrap());
        t
    }

    type FrameSender = tokio::sync::mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>;

    /// A body fed through a channel, as a slow client would stream it.
    fn channel_body() -> (
        FrameSender,
        StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>>>,
    ) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        (tx, StreamBody::new(stream))
    }

    struct Flag(std::sync::atomic::AtomicBool);
    impl std::task::Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    fn flag() -> (Arc<Flag>, std::task::Waker) {
        let f = Arc::new(Flag(std::sync::atomic::AtomicBool::new(false)));
        (f.clone(), std::task::Waker::from(f))
    }
    fn woken(f: &Flag) -> bool {
        f.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn poll<B>(
        b: &mut ReplayBody<B>,
        w: &std::task::Waker,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: Body,
        B::Error: Into<BoxError>,
    {
        Pin::new(b).poll_frame(&mut Context::from_waker(w))
    }

    #[tokio::test]
    async fn complete_as_soon_as_the_last_data_frame_is_produced() {
        // hyper stops after a frame once is_end_stream() is true: None is never polled.
        let (mut first, handle) = wrap(
            http_body_util::Full::new(Bytes::from_static(b"{}")),
            64,
            None,
        );
        assert_eq!(
            first.frame().await.unwrap().unwrap().into_data().unwrap(),
            "{}"
        );
        assert!(first.is_end_stream());
        assert_eq!(handle.complete_bytes().unwrap(), "{}");
    }

    #[tokio::test]
    async fn complete_once_the_declared_length_is_read() {
        // A streaming body sent with Content-Length: hyper stops after that many bytes.
        let (mut first, handle) = wrap(Known::paused(&[Ok("ab"), Ok("cd")]), 64, Some(4));
        first.frame().await.unwrap().unwrap();
        assert!(handle.complete_bytes().is_none(), "2 of 4 bytes");
        first.frame().await.unwrap().unwrap();
        assert_eq!(handle.complete_bytes().unwrap(), "abcd");
    }

    #[tokio::test]
    async fn trailers_are_the_last_frame_and_are_replayed() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"chunk-1 "))),
            Ok(Frame::data(Bytes::from_static(b"chunk-2"))),
            Ok(Frame::trailers(trailers())),
        ];
        let (mut first, handle) = wrap(
            StreamBody::new(futures_util::stream::iter(frames)),
            64,
            None,
        );
        first.frame().await.unwrap().unwrap();
        first.frame().await.unwrap().unwrap();
        assert!(!first.is_end_stream(), "the trailers are still to come");
        let t = first.frame().await.unwrap().unwrap();
        assert_eq!(t.into_trailers().unwrap(), trailers());
        // The transport stops here: the original was never polled to None.
        assert!(first.is_end_stream());
        assert_eq!(handle.complete_bytes().unwrap(), "chunk-1 chunk-2");

        let mut replay = handle.replay();
        let mut data = Vec::new();
        let mut got_trailers = None;
        while !replay.is_end_stream() {
            let frame = replay.frame().await.unwrap().unwrap();
            match frame.into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => got_trailers = f.into_trailers().ok(),
            }
        }
        assert_eq!(data, b"chunk-1 chunk-2");
        assert_eq!(got_trailers, Some(trailers()), "trailers replayed");
    }

    #[tokio::test]
    async fn a_stale_reader_cannot_steal_the_live_readers_wake_up() {
        let (tx, body) = channel_body();
        let (mut stale, handle) = wrap(body, 64, None);
        let (_, w0) = flag();
        tx.send(Ok(Frame::data(Bytes::from_static(b"a")))).unwrap();
        assert!(matches!(poll(&mut stale, &w0), Poll::Ready(Some(Ok(_)))));
        assert!(poll(&mut stale, &w0).is_pending());

        let mut live = handle.replay();
        let (live_flag, live_waker) = flag();
        assert!(matches!(
            poll(&mut live, &live_waker),
            Poll::Ready(Some(Ok(_)))
        ));
        assert!(poll(&mut live, &live_waker).is_pending());
        // The stale attempt is polled last (its transport still runs): it is cut off, and does
        // not replace the live reader's waker.
        let (_, stale_waker) = flag();
        assert!(matches!(
            poll(&mut stale, &stale_waker),
            Poll::Ready(Some(Err(_)))
        ));
        tx.send(Ok(Frame::data(Bytes::from_static(b"b")))).unwrap();
        assert!(woken(&live_flag), "the live reader is woken by new data");
        match poll(&mut live, &live_waker) {
            Poll::Ready(Some(Ok(f))) => assert_eq!(f.into_data().unwrap(), "b"),
            other => panic!(
                "expected the next chunk, got {:?}",
                other.map(|o| o.map(|r| r.is_ok()))
            ),
        }
    }

    #[tokio::test]
    async fn a_stale_reader_crossing_the_limit_does_not_spoil_the_replay() {
        let (tx, body) = channel_body();
        let (mut stale, handle) = wrap(body, 4, None);
        let (_, w) = flag();
        tx.send(Ok(Frame::data(Bytes::from_static(b"ab")))).unwrap();
        assert!(matches!(poll(&mut stale, &w), Poll::Ready(Some(Ok(_)))));
        let live = handle.replay();
        tx.send(Ok(Frame::data(Bytes::from_static(b"cdefgh"))))
            .unwrap();
        drop(tx);
        // The stale reader gets there first: before, it read "cdefgh", crossed the limit and
        // dropped the kept "ab" that the live reader had yet to replay.
        assert!(matches!(poll(&mut stale, &w), Poll::Ready(Some(Err(_)))));
        assert_eq!(collect(live).await.unwrap(), "abcdefgh");
        assert!(
            !handle.is_replayable(),
            "over the limit now: no further retry"
        );
    }
}

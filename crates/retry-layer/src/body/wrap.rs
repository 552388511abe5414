//! Wrapping a request body: what it has at hand is read right away, so that a body that is
//! whole at once is replayed from its bytes with no shared state.

use std::sync::{Arc, Mutex};
use std::task::Poll;

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::Body;
use reason_code::BoxError;

use super::handle::{BodyHandle, Handle};
use super::kept::{concat, Kept};
use super::memory::{Charge, ReplayMemory};
use super::replay::{Inner, ReplayBody};
use super::wake::read_with_slot;

impl<B: Body> ReplayBody<B>
where
    B::Error: Into<BoxError>,
{
    /// Wraps `body`, keeping up to `max` bytes for replay (0: nothing is kept, and the body is
    /// replayable only until its first byte is read, that is while the request is unsent).
    /// `content_length` is the request's Content-Length header, if any. Returns the first
    /// attempt's body and the handle the layer keeps, or the body's error when it failed
    /// while it was wrapped (before any byte of it was sent): then nothing must be sent.
    ///
    /// A body that may fit within `max` is polled right here, while it has frames ready and up
    /// to `max` bytes ([`EARLY_POLLS`] polls at most): a body that has all its bytes at hand
    /// (`Full<Bytes>`, a buffered body, a tonic unary request's encoded message) hands them
    /// over and ends, and is then replayed from those bytes by every attempt with no shared
    /// state. What these polls read of any other body is planted into what is kept, and the
    /// rest streams as it arrives. The polls' waker leads to the waker of whichever reader
    /// polls the body later (see [`wake`](super::wake)).
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
            // Failed before the request was sent (before any byte, or after the first bytes it
            // had at hand): it can never be sent whole, so nothing must be sent. Sending the
            // bytes read would put a truncated body on the wire, which an HTTP/1.1 request
            // with the `Content-Length` of those bytes delivers as if it were whole.
            if let Some(e) = seed.as_mut().and_then(|s| s.error.take()) {
                return Err(e);
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
            ended: false,
            trailers: None,
            generation: 0,
            live_next: 0,
            freed: 0,
            released: false,
            charge: (max > 0 && !capped)
                .then(|| Charge::of(memory, 0))
                .flatten(),
            whole: None,
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
    /// holds a copy; else the first attempt sends them without replay (the handle keeps
    /// nothing, and no retry carries the body).
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
        // An error met here was returned by `new` (nothing is sent): only an end remains.
        if self.ended {
            s.finish();
        }
    }
}

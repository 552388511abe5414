//! [`ReplayBody`]: the body each attempt sends, and how it reads what is kept and the original.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use reason_code::BoxError;

use super::error::{BodyNotReplayable, Superseded};
use super::kept::{lock, Kept};

/// A request body that every attempt of a retried request reads from the start.
///
/// Retries of a request whose body was larger than `max_replay_bytes` are refused before they
/// are sent. A reader of an earlier attempt that is still polled after a newer attempt started
/// gets an error (the transport then abandons that stale attempt).
pub struct ReplayBody<B> {
    pub(super) inner: Inner<B>,
}

/// What an attempt's body reads from.
pub(super) enum Inner<B> {
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

impl<B> ReplayBody<B> {
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
                // The original's error went to the attempt that read it.
                return Poll::Ready(Some(Err(BodyNotReplayable.into())));
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
                    // The original failed: what is kept is not the whole body, and an exact
                    // size would let HTTP/1.1 send it as a whole request (with its
                    // `Content-Length`). The reader gets the error after the bytes kept.
                    None if s.failed => {
                        let mut hint = SizeHint::new();
                        hint.set_lower(kept);
                        hint
                    }
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

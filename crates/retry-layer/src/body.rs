//! Replayable request bodies.
//!
//! [`ReplayBody`] wraps any [`http_body::Body`]. The first attempt streams the original body as
//! it arrives (nothing waits for the whole body) while a copy of each chunk is kept, up to
//! `max_replay_bytes`. A retry replays the kept chunks, then continues reading the original body
//! where the earlier attempt stopped. A body that grows past the limit stops being kept and makes
//! the request non-retryable: it is never truncated and never buffered without bound.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::BoxError;

/// A request body that every attempt of a retried request reads from the start.
///
/// Retries of a request whose body was larger than `max_replay_bytes` are refused before they
/// are sent; a stale attempt that still reads after that gets a [`BodyNotReplayable`] error.
pub struct ReplayBody<B> {
    inner: Inner<B>,
}

enum Inner<B> {
    /// The original body had ended before it was wrapped.
    Empty,
    /// Bytes a rebuild hook supplied.
    Fixed(Option<Bytes>),
    /// One attempt's view of the shared original.
    Shared {
        shared: Arc<Mutex<Shared<B>>>,
        /// The index of the next kept chunk this attempt reads.
        next: usize,
        trailers_sent: bool,
    },
}

struct Shared<B> {
    body: Option<Pin<Box<B>>>,
    /// Every chunk read so far, while the total stays within `max`.
    chunks: Vec<Bytes>,
    /// How many chunks were read from the original (kept or not).
    read: usize,
    kept_bytes: usize,
    max: usize,
    /// More than `max` bytes were read: nothing is kept any longer.
    capped: bool,
    /// The original body failed; its error went to the attempt that read it.
    failed: bool,
    trailers: Option<HeaderMap>,
}

/// A retry attempt read past what could be kept of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyNotReplayable;

impl fmt::Display for BodyNotReplayable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "request body exceeded max_replay_bytes and cannot be replayed; \
             raise RetryPolicyBuilder::max_replay_bytes to retry such requests",
        )
    }
}

impl std::error::Error for BodyNotReplayable {}

impl<B> fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.inner {
            Inner::Empty => "empty",
            Inner::Fixed(_) => "fixed",
            Inner::Shared { .. } => "shared",
        };
        f.debug_struct("ReplayBody").field("kind", &kind).finish()
    }
}

/// The retry layer's handle on a wrapped body: makes the next attempt's body and says whether a
/// retry can still carry it.
pub(crate) struct BodyHandle<B> {
    shared: Option<Arc<Mutex<Shared<B>>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<B: Body> ReplayBody<B> {
    /// Wraps `body`, keeping up to `max` bytes for replay. Returns the first attempt's body and
    /// the handle the layer keeps.
    pub(crate) fn new(body: B, max: usize) -> (ReplayBody<B>, BodyHandle<B>) {
        if body.is_end_stream() {
            return (
                ReplayBody {
                    inner: Inner::Empty,
                },
                BodyHandle { shared: None },
            );
        }
        // A body known to exceed the limit is never kept.
        let capped = body.size_hint().lower() > max as u64;
        let shared = Arc::new(Mutex::new(Shared {
            body: Some(Box::pin(body)),
            chunks: Vec::new(),
            read: 0,
            kept_bytes: 0,
            max,
            capped,
            failed: false,
            trailers: None,
        }));
        let first = ReplayBody {
            inner: Inner::Shared {
                shared: shared.clone(),
                next: 0,
                trailers_sent: false,
            },
        };
        (
            first,
            BodyHandle {
                shared: Some(shared),
            },
        )
    }

    /// A body of fixed bytes (from a rebuild hook).
    pub(crate) fn fixed(bytes: Bytes) -> Self {
        ReplayBody {
            inner: Inner::Fixed(Some(bytes)),
        }
    }
}

impl<B> BodyHandle<B> {
    /// True when another attempt can carry the whole body.
    pub(crate) fn is_replayable(&self) -> bool {
        match &self.shared {
            None => true,
            Some(shared) => {
                let s = lock(shared);
                !s.capped && !s.failed
            }
        }
    }

    /// The body of the next attempt, reading from the first byte.
    pub(crate) fn replay(&self) -> ReplayBody<B> {
        match &self.shared {
            None => ReplayBody {
                inner: Inner::Empty,
            },
            Some(shared) => ReplayBody {
                inner: Inner::Shared {
                    shared: shared.clone(),
                    next: 0,
                    trailers_sent: false,
                },
            },
        }
    }

    /// The whole body, when it has been read to the end and kept (for a rebuild hook).
    pub(crate) fn complete_bytes(&self) -> Option<Bytes> {
        let Some(shared) = &self.shared else {
            return Some(Bytes::new());
        };
        let s = lock(shared);
        if s.body.is_some() || s.capped || s.failed {
            return None;
        }
        let mut all = bytes::BytesMut::with_capacity(s.kept_bytes);
        for c in &s.chunks {
            all.extend_from_slice(c);
        }
        Some(all.freeze())
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
        let (shared, next, trailers_sent) = match &mut this.inner {
            Inner::Empty => return Poll::Ready(None),
            Inner::Fixed(bytes) => return Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Inner::Shared {
                shared,
                next,
                trailers_sent,
            } => (shared, next, trailers_sent),
        };
        let mut s = lock(shared);
        // Replay what an earlier attempt read.
        if *next < s.read {
            if s.capped {
                return Poll::Ready(Some(Err(BodyNotReplayable.into())));
            }
            let chunk = s.chunks[*next].clone();
            *next += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        // At the head: read on from the original.
        let Some(body) = s.body.as_mut() else {
            if s.failed {
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
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                s.body = None;
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
                    s.read += 1;
                    *next += 1;
                    if !s.capped && s.kept_bytes + chunk.len() <= s.max {
                        s.kept_bytes += chunk.len();
                        s.chunks.push(chunk.clone());
                    } else if !s.capped {
                        s.capped = true;
                        s.chunks = Vec::new();
                    }
                    Poll::Ready(Some(Ok(Frame::data(chunk))))
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        s.trailers = Some(trailers.clone());
                        *trailers_sent = true;
                        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
                    }
                    // An unknown frame kind: pass it on is impossible without its data type;
                    // skip it and ask to be polled again.
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
            Inner::Shared {
                shared,
                next,
                trailers_sent,
            } => {
                let s = lock(shared);
                *next >= s.read
                    && !s.failed
                    && match &s.body {
                        Some(b) => b.is_end_stream(),
                        None => *trailers_sent || s.trailers.is_none(),
                    }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Empty => SizeHint::with_exact(0),
            Inner::Fixed(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::Shared { shared, next, .. } => {
                let s = lock(shared);
                let kept: u64 = if s.capped {
                    0
                } else {
                    s.chunks
                        .get(*next..)
                        .map_or(0, |c| c.iter().map(|c| c.len() as u64).sum())
                };
                match &s.body {
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
        let (first, handle) = ReplayBody::new(chunks(&["hello ", "streaming ", "world"]), 1024);
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
        let (mut first, handle) = ReplayBody::new(chunks(&["a", "b", "c"]), 1024);
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "a");
        drop(first);
        assert!(handle.complete_bytes().is_none());
        assert_eq!(collect(handle.replay()).await.unwrap(), "abc");
    }

    #[tokio::test]
    async fn over_the_limit_is_streamed_whole_and_not_replayable() {
        let (first, handle) = ReplayBody::new(chunks(&["12345", "67890", "x"]), 8);
        assert_eq!(collect(first).await.unwrap(), "1234567890x");
        assert!(!handle.is_replayable());
        let err = collect(handle.replay()).await.unwrap_err();
        assert!(err.is::<BodyNotReplayable>());
    }

    #[tokio::test]
    async fn empty_and_known_large_bodies() {
        let (first, handle) = ReplayBody::new(http_body_util::Empty::<Bytes>::new(), 8);
        assert!(first.is_end_stream());
        assert!(handle.is_replayable());
        let (first, handle) =
            ReplayBody::new(http_body_util::Full::new(Bytes::from(vec![0; 9])), 8);
        assert_eq!(first.size_hint().exact(), Some(9));
        assert!(
            !handle.is_replayable(),
            "known too large before the first byte"
        );
        assert_eq!(collect(first).await.unwrap().len(), 9);
    }

    #[tokio::test]
    async fn exact_size_hint_on_replay() {
        let (first, handle) =
            ReplayBody::new(http_body_util::Full::new(Bytes::from_static(b"abcd")), 8);
        assert_eq!(first.size_hint().exact(), Some(4));
        collect(first).await.unwrap();
        let replay = handle.replay();
        assert_eq!(replay.size_hint().exact(), Some(4));
        assert!(!replay.is_end_stream());
    }
}

//! Replayable bodies read the ways transports read them: streamed, cut off, dropped early,
//! polled past their end, and wrapped while their frames are (or are not) at hand.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, StreamBody};
use reason_code::BoxError;

use super::handle::{BodyHandle, Handle};
use super::kept::lock;
use super::memory::ReplayMemory;
use super::replay::{Inner, ReplayBody};
use super::BodyNotReplayable;

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
/// body is not replayable: those bytes are held, uncounted, for the first attempt only (a
/// retry of an attempt that never sent them would keep them through its backoff).
#[tokio::test]
async fn a_body_read_past_the_limit_at_wrap_time_is_sent_once_whole() {
    let (first, handle) = wrap(chunks(&["123456789"]), 8, None);
    assert!(matches!(handle.kind, Handle::Shared(_)));
    assert!(!handle.is_replayable(), "held for the first attempt only");
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
    assert!(!handle.is_replayable());
    assert_eq!(collect(first).await.unwrap(), "1234567890x");
    assert!(!handle.is_replayable());
}

/// An attempt that never read a body over the limit hands it whole to the next one while
/// nothing of it was read; what the wrapping read past the limit goes to the first attempt
/// only, so such a body has no retry even when that attempt never sent it.
#[tokio::test]
async fn an_unread_body_over_the_limit_goes_whole_to_the_next_attempt_unless_read_at_wrap_time() {
    let (first, handle) = wrap(chunks(&["12345", "67890", "x"]), 8, None);
    drop(first);
    assert!(!handle.is_replayable(), "the wrapping read past the limit");
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
    // After a first chunk, still at wrap time: nothing was sent, and the bytes read are not
    // the body (sent alone, with their exact size, they would be a whole, truncated request).
    let err = ReplayBody::new(
        Known::new(&[Ok("ab"), Err("disk gone")], false),
        8,
        None,
        &memory(),
    )
    .err()
    .expect("failed before it was sent: nothing to send");
    assert_eq!(err.to_string(), "disk gone");
}

/// A body that fails after the first attempt started reading it: the error goes to that
/// attempt, the body is no longer replayable, and no size hint calls the bytes kept whole.
#[tokio::test]
async fn a_body_that_fails_while_sent_is_not_replayed_nor_called_whole() {
    let (tx, body) = channel_body();
    let (mut first, handle) = wrap(body, 64, None);
    let (_flag, waker) = flag();
    assert!(poll(&mut first, &waker).is_pending());
    tx.send(Ok(Frame::data(Bytes::from_static(b"ab")))).unwrap();
    tx.send(Err("disk gone".into())).unwrap();
    let err = collect(first).await.unwrap_err();
    assert_eq!(err.to_string(), "disk gone");
    assert!(!handle.is_replayable());
    let replay = handle.replay();
    assert_eq!(replay.size_hint().exact(), None);
    let err = collect(replay).await.unwrap_err();
    assert!(err.is::<BodyNotReplayable>());
}

/// A reader waiting for the original is woken when a newer attempt cuts
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

//! The hand-over between the layer's reading of a handler's response body and its client.
//!
//! The layer reads a recorded response's body itself ([`recorder`](crate::write::recorder)), as fast
//! as the handler makes it, so that the record is stored when the body ends, not when a slow
//! or stalled client gets around to reading its last frame. The frames it has read wait here
//! for the client. Their bytes are bounded twice. Per response: up to the layer's
//! `max_record_bytes` (the record holds as much anyway) the reading does not wait for the
//! client; past it (a response too large to record) it waits for the client to make room.
//! Across the layer: beyond the first [`MIN_PIPE_BYTES`] of each response, the bytes waiting
//! for clients are charged to one [`HeldBytes`] budget (`max_response_buffer_bytes`); when it
//! is spent, each reading waits for its own client (flow control to the handler), so clients
//! that do not read cannot grow the server's memory without bound.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Frame, SizeHint};

use reason_code::BoxError;

/// The fewest bytes that may wait for a client, whatever `max_record_bytes` is: a body too large
/// to record is handed over in pieces of at least this much.
pub(crate) const MIN_PIPE_BYTES: usize = 64 * 1024;

/// The layer-wide budget of response bytes waiting for clients (beyond each response's first
/// [`MIN_PIPE_BYTES`]).
#[derive(Debug, Default)]
pub(crate) struct HeldBytes {
    used: AtomicUsize,
}

impl HeldBytes {
    /// The bytes charged now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// A pipe's share of the layer's [`HeldBytes`]: the budget, its bound, and what this pipe holds
/// of it.
struct Charge {
    budget: Arc<HeldBytes>,
    max: usize,
}

/// The frames read from a handler's body that its client has not taken yet.
pub(crate) struct Pipe {
    state: Mutex<PipeState>,
    /// How many bytes may wait for the client before the reading waits for it.
    room: usize,
    charge: Option<Charge>,
}

struct PipeState {
    frames: VecDeque<Frame<Bytes>>,
    /// Data bytes in `frames`.
    queued: usize,
    end: End,
    /// The body's size hint when the reading started (what was read before included).
    declared: SizeHint,
    /// Data bytes the client has taken.
    taken: u64,
    /// The client's task, waiting for a frame.
    reader: Option<Waker>,
    /// Bytes of `queued` charged to the layer's budget.
    charged: usize,
    /// The reading's task, waiting for room.
    writer: Option<Waker>,
    /// The client is gone (the server dropped the body): frames are read and recorded, and
    /// dropped instead of kept.
    reader_gone: bool,
}

enum End {
    Open,
    /// The body ended (its record was stored first).
    Ended,
    /// The body broke off: this error goes to the client, once.
    Failed(Option<BoxError>),
}

/// Whether the reading may read another frame now.
pub(crate) enum Room {
    Free,
    /// The client has not taken enough yet; the task is woken when it has.
    Full,
    /// The client is gone.
    ReaderGone,
}

impl Pipe {
    /// A pipe for a body with `declared` size hint, the frames `read` already read, letting up
    /// to `max_record_bytes` wait for the client.
    /// `budget`: the layer's budget of bytes waiting for clients and its bound (`None`: only
    /// the per-response bound).
    pub(crate) fn new(
        declared: SizeHint,
        read: Vec<Frame<Bytes>>,
        max_record_bytes: usize,
        budget: Option<(Arc<HeldBytes>, usize)>,
    ) -> Arc<Pipe> {
        let pipe = Pipe {
            state: Mutex::new(PipeState {
                frames: VecDeque::new(),
                queued: 0,
                end: End::Open,
                declared,
                taken: 0,
                reader: None,
                charged: 0,
                writer: None,
                reader_gone: false,
            }),
            room: max_record_bytes.max(MIN_PIPE_BYTES),
            charge: budget.map(|(budget, max)| Charge { budget, max }),
        };
        {
            let mut st = pipe.lock();
            for frame in read {
                st.push(frame);
            }
            pipe.settle_charge(&mut st);
        }
        Arc::new(pipe)
    }

    /// Charges the layer's budget for the bytes queued beyond [`MIN_PIPE_BYTES`] (or gives back
    /// what is no longer queued).
    fn settle_charge(&self, st: &mut PipeState) {
        let Some(charge) = &self.charge else { return };
        let over = st.queued.saturating_sub(MIN_PIPE_BYTES);
        if over > st.charged {
            charge
                .budget
                .used
                .fetch_add(over - st.charged, Ordering::Relaxed);
        } else if over < st.charged {
            charge
                .budget
                .used
                .fetch_sub(st.charged - over, Ordering::Relaxed);
        }
        st.charged = over;
    }

    /// May more bytes wait for the client beyond the first [`MIN_PIPE_BYTES`]?
    fn budget_left(&self) -> bool {
        self.charge
            .as_ref()
            .is_none_or(|c| c.budget.used.load(Ordering::Relaxed) < c.max)
    }

    fn lock(&self) -> MutexGuard<'_, PipeState> {
        // Every critical section leaves the state consistent: a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// May the reading read another frame? Registers `cx` to be woken when there is room.
    pub(crate) fn room(&self, cx: &mut Context<'_>) -> Room {
        let mut st = self.lock();
        if st.reader_gone {
            Room::ReaderGone
        } else if st.queued >= self.room || (st.queued >= MIN_PIPE_BYTES && !self.budget_left()) {
            // Woken when its own client takes a frame.
            st.writer = Some(cx.waker().clone());
            Room::Full
        } else {
            Room::Free
        }
    }

    /// Hands a frame to the client.
    pub(crate) fn push(&self, frame: Frame<Bytes>) {
        let reader = {
            let mut st = self.lock();
            st.push(frame);
            self.settle_charge(&mut st);
            st.reader.take()
        };
        wake(reader);
    }

    /// The body ended: hands its final frame (if any) to the client, then the end.
    pub(crate) fn end(&self, last: Option<Frame<Bytes>>) {
        let reader = {
            let mut st = self.lock();
            if let Some(frame) = last {
                st.push(frame);
                self.settle_charge(&mut st);
            }
            st.end = End::Ended;
            st.reader.take()
        };
        wake(reader);
    }

    /// The body's reader was dropped before it ended it (its task cancelled, its runtime shut
    /// down): the client gets `error` instead of waiting for an end that will never come. Once
    /// the body has ended or failed, this does nothing.
    pub(crate) fn abandon(&self, error: impl FnOnce() -> BoxError) {
        let reader = {
            let mut st = self.lock();
            if !matches!(st.end, End::Open) {
                return;
            }
            st.end = End::Failed(Some(error()));
            st.reader.take()
        };
        wake(reader);
    }

    /// The body broke off: the client gets `error` after the frames it has not taken.
    pub(crate) fn fail(&self, error: BoxError) {
        let reader = {
            let mut st = self.lock();
            st.end = End::Failed(Some(error));
            st.reader.take()
        };
        wake(reader);
    }
}

impl Drop for Pipe {
    /// Whatever this response still holds of the layer's budget goes back to it.
    fn drop(&mut self) {
        if let Some(charge) = &self.charge {
            let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
            charge.budget.used.fetch_sub(st.charged, Ordering::Relaxed);
            st.charged = 0;
        }
    }
}

impl PipeState {
    fn push(&mut self, frame: Frame<Bytes>) {
        if self.reader_gone {
            return;
        }
        if let Some(d) = frame.data_ref() {
            self.queued += d.len();
        }
        self.frames.push_back(frame);
    }
}

fn wake(waker: Option<Waker>) {
    if let Some(w) = waker {
        w.wake();
    }
}

/// The reading, when no tokio runtime could run it as a task of its own: driven by the
/// client's polls instead.
pub(crate) type Driver = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The client's end of a [`Pipe`]: the body the layer answers with.
pub(crate) struct PipeReader {
    pipe: Arc<Pipe>,
    driver: Option<Driver>,
}

impl fmt::Debug for PipeReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PipeReader")
            .field("driven", &self.driver.is_some())
            .finish_non_exhaustive()
    }
}

impl PipeReader {
    /// The client's end of `pipe`; `driver` when the reading must be driven by the client.
    pub(crate) fn new(pipe: Arc<Pipe>, driver: Option<Driver>) -> Self {
        PipeReader { pipe, driver }
    }

    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(driver) = self.driver.as_mut() {
            if driver.as_mut().poll(cx).is_ready() {
                self.driver = None;
            }
        }
        let mut st = self.pipe.lock();
        if let Some(frame) = st.frames.pop_front() {
            if let Some(d) = frame.data_ref() {
                st.queued -= d.len();
                st.taken += d.len() as u64;
            }
            self.pipe.settle_charge(&mut st);
            let writer = st.writer.take();
            drop(st);
            wake(writer);
            return Poll::Ready(Some(Ok(frame)));
        }
        match &mut st.end {
            End::Open => {
                st.reader = Some(cx.waker().clone());
                Poll::Pending
            }
            End::Ended => Poll::Ready(None),
            End::Failed(error) => Poll::Ready(error.take().map(Err)),
        }
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        let st = self.pipe.lock();
        st.frames.is_empty() && matches!(st.end, End::Ended)
    }

    /// The body's declared size, less what the client has taken.
    pub(crate) fn size_hint(&self) -> SizeHint {
        let st = self.pipe.lock();
        if st.frames.is_empty() && matches!(st.end, End::Ended) {
            return SizeHint::with_exact(0);
        }
        let left = |n: u64| n.saturating_sub(st.taken);
        match st.declared.exact() {
            Some(n) => SizeHint::with_exact(left(n)),
            None => {
                let mut hint = SizeHint::new();
                if let Some(upper) = st.declared.upper() {
                    hint.set_upper(left(upper));
                }
                hint.set_lower(left(st.declared.lower()));
                hint
            }
        }
    }
}

impl Drop for PipeReader {
    /// The client went away: what waits for it is dropped, and the reading (which goes on, to
    /// record the body) is told.
    fn drop(&mut self) {
        let writer = {
            let mut st = self.pipe.lock();
            st.reader_gone = true;
            st.frames.clear();
            st.queued = 0;
            self.pipe.settle_charge(&mut st);
            st.writer.take()
        };
        wake(writer);
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;

    fn cx() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    fn data(s: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(s.as_bytes()))
    }

    #[test]
    fn frames_reach_the_reader_in_order_then_the_end() {
        let pipe = Pipe::new(SizeHint::with_exact(5), vec![data("ab")], 1024, None);
        let mut reader = PipeReader::new(pipe.clone(), None);
        assert_eq!(reader.size_hint().exact(), Some(5));
        pipe.push(data("cd"));
        let next = |r: &mut PipeReader| match r.poll_frame(&mut cx()) {
            Poll::Ready(Some(Ok(f))) => Some(f.into_data().unwrap()),
            Poll::Ready(None) => None,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(next(&mut reader).unwrap(), "ab");
        assert_eq!(reader.size_hint().exact(), Some(3));
        assert_eq!(next(&mut reader).unwrap(), "cd");
        assert!(reader.poll_frame(&mut cx()).is_pending());
        assert!(!reader.is_end_stream());
        pipe.end(Some(data("e")));
        assert!(!reader.is_end_stream(), "the final frame is still to take");
        assert_eq!(next(&mut reader).unwrap(), "e");
        assert!(
            reader.is_end_stream(),
            "ended right after its final frame (an h2 server sets END_STREAM on it)"
        );
        assert_eq!(reader.size_hint().exact(), Some(0));
        assert!(next(&mut reader).is_none());
    }

    #[test]
    fn an_error_reaches_the_reader_after_the_frames_before_it() {
        let pipe = Pipe::new(SizeHint::new(), Vec::new(), 1024, None);
        let mut reader = PipeReader::new(pipe.clone(), None);
        pipe.push(data("ab"));
        pipe.fail("broken".into());
        assert!(matches!(
            reader.poll_frame(&mut cx()),
            Poll::Ready(Some(Ok(_)))
        ));
        match reader.poll_frame(&mut cx()) {
            Poll::Ready(Some(Err(e))) => assert_eq!(e.to_string(), "broken"),
            other => panic!("expected the error, got {other:?}"),
        }
        assert!(matches!(reader.poll_frame(&mut cx()), Poll::Ready(None)));
        assert!(!reader.is_end_stream(), "a broken body never says it ended");
    }

    #[test]
    fn room_is_bounded_and_the_reader_leaving_is_seen() {
        let pipe = Pipe::new(SizeHint::new(), Vec::new(), 0, None);
        let mut reader = PipeReader::new(pipe.clone(), None);
        assert!(matches!(pipe.room(&mut cx()), Room::Free));
        pipe.push(Frame::data(Bytes::from(vec![0; MIN_PIPE_BYTES])));
        assert!(matches!(pipe.room(&mut cx()), Room::Full));
        assert!(matches!(
            reader.poll_frame(&mut cx()),
            Poll::Ready(Some(Ok(_)))
        ));
        assert!(matches!(pipe.room(&mut cx()), Room::Free));
        pipe.push(data("x"));
        drop(reader);
        assert!(matches!(pipe.room(&mut cx()), Room::ReaderGone));
        assert_eq!(
            pipe.lock().queued,
            0,
            "what waited for the client is dropped"
        );
    }
}

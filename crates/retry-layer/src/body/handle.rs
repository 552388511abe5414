//! [`BodyHandle`]: the layer's side of a wrapped body, which makes each next attempt's body.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::kept::{concat, lock, Kept};
use super::memory::Charge;
use super::replay::{Inner, ReplayBody};

/// The retry layer's handle on a wrapped body: makes the next attempt's body and says whether a
/// retry can still carry it.
pub(crate) struct BodyHandle<B> {
    pub(super) kind: Handle<B>,
}

/// What the handle holds of the body.
pub(super) enum Handle<B> {
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
    /// A body read whole that the layer's memory could not hold a copy of: sent without
    /// replay, and no retry carries it.
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
            s.whole = None;
            s.free_read();
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
    /// so far is still kept, within the layer's memory. A body over a limit qualifies while
    /// nothing of it was read (a request that was never sent can be retried whatever its
    /// size), but not once the wrapping read some of it: those bytes are held, uncounted, for
    /// the first attempt only, and no retry may keep them.
    pub(crate) fn is_replayable(&self) -> bool {
        match &self.kind {
            Handle::Empty | Handle::Whole { .. } => true,
            Handle::Spent => false,
            Handle::Shared(shared) => {
                let s = lock(shared);
                !s.failed && (!s.capped || s.read == 0)
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

    /// The whole body, when every byte of it has been read and kept within the layer's memory
    /// (for a rebuild hook, or a hedge). A body kept in several chunks is put in one piece
    /// once, counted against the layer's memory too; `None` when that copy does not fit.
    pub(crate) fn complete_bytes(&self) -> Option<Bytes> {
        let shared = match &self.kind {
            Handle::Empty => return Some(Bytes::new()),
            Handle::Whole { bytes, .. } => return Some(bytes.clone()),
            Handle::Spent => return None,
            Handle::Shared(shared) => shared,
        };
        let mut s = lock(shared);
        if !s.data_complete() {
            return None;
        }
        if let [one] = s.chunks.as_slice() {
            return Some(one.clone());
        }
        if let Some((whole, _)) = &s.whole {
            return Some(whole.clone());
        }
        let Some(charge) = s.charge.as_ref().and_then(|c| c.another(s.kept_bytes)) else {
            tracing::debug!(
                bytes = s.kept_bytes,
                "the layer's replay memory cannot hold the body in one piece"
            );
            return None;
        };
        let whole = concat(&s.chunks, s.kept_bytes);
        s.whole = Some((whole.clone(), charge));
        Some(whole)
    }
}

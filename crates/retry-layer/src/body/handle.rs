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
    /// The whole body was read when it was wrapped, but the layer's `max_replay_bytes_total`
    /// could not hold a copy: kept (the same bytes the attempt sends, not counted against the
    /// layer's memory) only until the attempt's outcome is known, for a retry of an attempt
    /// that was never sent. See [`BodyHandle::outcome_known`].
    Uncharged(Bytes),
    /// A body the layer's memory could not hold, after an attempt that may have been sent: no
    /// retry carries it.
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

impl<B> BodyHandle<B> {
    /// The handle of a call that sends no body at all.
    pub(crate) fn empty() -> Self {
        BodyHandle {
            kind: Handle::Empty,
        }
    }

    /// An attempt ended: `unsent` when it provably never left the client. A body the layer's
    /// memory could not hold is kept for a retry of an attempt that was never sent, and
    /// dropped after any other outcome (no retry may carry it then).
    pub(crate) fn outcome_known(&mut self, unsent: bool) {
        if !unsent && matches!(self.kind, Handle::Uncharged(_)) {
            self.kind = Handle::Spent;
        }
    }

    /// True when another attempt can carry the whole body: every byte read from the original
    /// so far is still kept. A body over the limit qualifies while nothing of it was read (or
    /// what the wrapping read is still there), and so does a body read whole that the layer's
    /// memory could not hold, until an attempt's outcome says it may have been sent: a request
    /// that was never sent can be retried whatever its size.
    pub(crate) fn is_replayable(&self) -> bool {
        match &self.kind {
            Handle::Empty | Handle::Whole { .. } | Handle::Uncharged(_) => true,
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
            Handle::Whole { bytes, .. } | Handle::Uncharged(bytes) => ReplayBody {
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
    /// (for a rebuild hook, or a hedge).
    pub(crate) fn complete_bytes(&self) -> Option<Bytes> {
        let shared = match &self.kind {
            Handle::Empty => return Some(Bytes::new()),
            Handle::Whole { bytes, .. } => return Some(bytes.clone()),
            Handle::Uncharged(_) | Handle::Spent => return None,
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

//! What is kept of a request body for replay, shared by the readers of every attempt and the
//! layer's handle, and the limits it is kept within.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use bytes::Bytes;
use http::HeaderMap;

use super::memory::Charge;
use super::wake::WakeSlot;

/// What is kept of the original body: shared by the readers of every attempt and the layer's
/// handle.
pub(super) struct Kept<B> {
    /// The original, until it has produced its last frame.
    pub(super) body: Option<Pin<Box<B>>>,
    /// Every chunk read so far, while the total stays within `max`.
    pub(super) chunks: Vec<Bytes>,
    /// How many chunks were read from the original (kept or not).
    pub(super) read: usize,
    /// How many bytes were read from the original.
    pub(super) read_bytes: u64,
    /// The length the body declared (exact size hint or Content-Length): a transport stops
    /// polling once that many bytes are written.
    pub(super) declared_len: Option<u64>,
    pub(super) kept_bytes: usize,
    pub(super) max: usize,
    /// More than `max` bytes were read: nothing is kept any longer.
    pub(super) capped: bool,
    /// The original body failed; its error went to the attempt that read it.
    pub(super) failed: bool,
    /// The original produced its last frame (or said it had none left).
    pub(super) ended: bool,
    pub(super) trailers: Option<HeaderMap>,
    /// The newest attempt's generation; readers of older ones are cut off.
    pub(super) generation: u64,
    /// How far the newest attempt's reader got in `chunks` (`usize::MAX` once it is dropped).
    pub(super) live_next: usize,
    /// `chunks` before this index were freed (after the handle went).
    pub(super) freed: usize,
    /// The layer's handle is gone (the call has its answer): no attempt will replay the body
    /// any more, so nothing more is kept and what the newest reader has read is freed.
    pub(super) released: bool,
    /// The share of the layer's `max_replay_bytes_total` that `chunks` hold; `None` once
    /// nothing is kept (over a limit, or nothing to keep).
    pub(super) charge: Option<Charge>,
    /// The whole body in one piece, made once for the hedges or the rebuild hook when it was
    /// kept in several chunks, with its own share of the layer's memory; dropped with the
    /// handle.
    pub(super) whole: Option<(Bytes, Charge)>,
    /// The waker the wrapping read polled with, if the original kept it: told each reader's
    /// waker, so that the original's wake-ups reach the reader that polls it now.
    pub(super) early: Option<Arc<WakeSlot>>,
    /// The waker of the reader that last found the original not ready: woken when that reader
    /// is cut off, so that its transport learns at once that its attempt is abandoned.
    pub(super) parked: Option<Waker>,
}

impl<B> Kept<B> {
    pub(super) fn finish(&mut self) {
        self.body = None;
        self.ended = true;
    }

    /// Keeps a chunk just read, if it fits both limits; past either, nothing is kept any
    /// longer and the body is not replayable.
    pub(super) fn keep(&mut self, chunk: &Bytes) {
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
    pub(super) fn cap(&mut self) {
        self.capped = true;
        self.chunks = Vec::new();
        self.charge = None;
    }

    /// After the handle is gone: frees the chunks the newest reader has read.
    pub(super) fn free_read(&mut self) {
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
    pub(super) fn data_complete(&self) -> bool {
        !self.capped && !self.failed && (self.ended || self.declared_len == Some(self.read_bytes))
    }
}

/// `chunks` (`len` bytes in all) in one `Bytes`.
pub(super) fn concat<'a>(chunks: impl IntoIterator<Item = &'a Bytes>, len: usize) -> Bytes {
    let mut all = bytes::BytesMut::with_capacity(len);
    for c in chunks {
        all.extend_from_slice(c);
    }
    all.freeze()
}

/// Locks `m`, even when a holder that panicked poisoned it.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

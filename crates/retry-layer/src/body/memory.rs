//! How many request-body bytes all calls of a layer keep for replay at once
//! ([`max_replay_bytes_total`](crate::RetryPolicyBuilder::max_replay_bytes_total)), and the
//! share one body holds.
//!
//! `max_replay_bytes` bounds one request; a client with thousands of calls in flight (or
//! long-lived client streams) could still pin thousands of copies. gRFC A6 bounds the retry
//! buffer per channel for the same reason. Every byte the layer keeps is counted here (and
//! shown in `stats().replay_bytes`): the copies of bodies kept for retries, and the one copy of
//! a body in several chunks that hedges and the rebuild hook send. A body whose copy does not
//! fit is sent without replay: its retries are refused as for a body over `max_replay_bytes`
//! (even the retry of an attempt that was never sent: nothing is held uncounted for it).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The bytes kept for replay by every call of one layer, within `limit`.
#[derive(Debug)]
pub(crate) struct ReplayMemory {
    limit: usize,
    used: AtomicUsize,
}

impl ReplayMemory {
    pub(crate) fn new(limit: usize) -> Self {
        ReplayMemory {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// Bytes kept right now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes of the bound; false (and nothing taken) when they do not fit.
    fn try_take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// The bytes of a [`ReplayMemory`] one body holds; given back as it frees them, and on drop.
#[derive(Debug)]
pub(crate) struct Charge {
    memory: Arc<ReplayMemory>,
    bytes: usize,
}

impl Charge {
    /// A charge of `n` bytes, if they fit.
    pub(crate) fn of(memory: &Arc<ReplayMemory>, n: usize) -> Option<Charge> {
        memory.try_take(n).then(|| Charge {
            memory: memory.clone(),
            bytes: n,
        })
    }

    /// `n` more bytes; false (and nothing taken) when they do not fit.
    pub(crate) fn take(&mut self, n: usize) -> bool {
        let fits = self.memory.try_take(n);
        if fits {
            self.bytes += n;
        }
        fits
    }

    /// A charge of `n` bytes of the same memory, if they fit.
    pub(crate) fn another(&self, n: usize) -> Option<Charge> {
        Charge::of(&self.memory, n)
    }

    /// Gives `n` of the bytes held back.
    pub(crate) fn give_back(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        self.memory.give_back(n);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.memory.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_stay_within_the_limit_and_are_given_back() {
        let memory = Arc::new(ReplayMemory::new(10));
        let mut a = Charge::of(&memory, 6).unwrap();
        assert!(Charge::of(&memory, 5).is_none());
        assert!(a.take(4));
        assert!(!a.take(1));
        assert_eq!(memory.used(), 10);
        a.give_back(3);
        assert_eq!(memory.used(), 7);
        drop(a);
        assert_eq!(memory.used(), 0);
    }
}

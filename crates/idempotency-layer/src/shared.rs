//! What every clone of a layer shares: counters, the waiters of each key, lease renewals, and
//! the detached work running.
//!
//! Made once in [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) and never copied by a
//! setter, so two layers configured from one base (say with different leases) share their
//! counters but never mix their settings.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::stats::{Counters, Gauges, IdempotencyStats};
use crate::write::asking::BeginsInFlight;
use crate::write::pipe::HeldBytes;
use crate::write::renewal::Renewals;
use crate::write::waiters::Waiters;

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) counters: Arc<Counters>,
    pub(crate) waiters: Arc<Waiters>,
    /// The claims this layer holds, renewed by one task through the layer's one store.
    pub(crate) renewals: Arc<Renewals>,
    /// The `begin`s this layer sent to its store and has not yet acted on (kept when it fails
    /// open).
    pub(crate) begins: Arc<BeginsInFlight>,
    pub(crate) detached: Arc<Detached>,
    /// Response bytes waiting for clients, beyond each response's first part
    /// (`max_response_buffer_bytes`).
    pub(crate) held_bytes: Arc<HeldBytes>,
    /// Set by [`IdempotencyLayer::drain`](crate::IdempotencyLayer::drain): new writes are
    /// refused, and the claims held are let finish.
    pub(crate) draining: Arc<Drain>,
}

/// A layer's drain: on once it started; woken each time the last claim held ends.
#[derive(Debug, Default)]
pub(crate) struct Drain {
    pub(crate) on: AtomicBool,
    pub(crate) idle: Notify,
}

impl Drain {
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts the drain. Fenced against [`refuses_a_claim_made`](Self::refuses_a_claim_made):
    /// after it, a drain that counts the claims held sees every claim that write will keep.
    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// A claim was just made (and counted held): must it be given up because the drain began?
    /// A write checked the drain when it arrived, but it may claim much later (after reading its
    /// body, or woken from a wait): a claim made after the drain began would run a handler the
    /// drain does not wait for. The fence pairs with [`start`](Self::start)'s: either the drain
    /// counts this claim, or this sees the drain.
    pub(crate) fn refuses_a_claim_made(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.on.load(Ordering::Relaxed)
    }
}

impl Default for Shared {
    fn default() -> Self {
        let counters = Arc::<Counters>::default();
        Shared {
            renewals: Arc::new(Renewals::new(counters.clone())),
            begins: Arc::default(),
            counters,
            waiters: Arc::default(),
            detached: Arc::default(),
            held_bytes: Arc::default(),
            draining: Arc::default(),
        }
    }
}

impl Shared {
    /// The same counters, waiters and detached work, with renewals (and begins in flight) of
    /// its own: for a layer over another store (a renewal task renews through one store, and
    /// another store's claims never meet this one's).
    pub(crate) fn for_another_store(&self) -> Shared {
        Shared {
            counters: self.counters.clone(),
            waiters: self.waiters.clone(),
            renewals: Arc::new(Renewals::new(self.counters.clone())),
            begins: Arc::default(),
            detached: self.detached.clone(),
            held_bytes: self.held_bytes.clone(),
            draining: self.draining.clone(),
        }
    }

    /// A claim ends: counted, and a drain waiting for the last one is woken.
    pub(crate) fn claim_ended(&self) {
        if self.counters.claim_ended() == 0 {
            self.draining.idle.notify_waiters();
        }
    }

    /// The counters, and the gauges: detached work running now, bytes held for clients and by
    /// waiters.
    pub(crate) fn stats(&self) -> IdempotencyStats {
        self.counters.snapshot(Gauges {
            detached: self.detached.running() as u64,
            response_buffer_bytes: self.held_bytes.used() as u64,
            waiting_bytes: self.waiters.held() as u64,
        })
    }
}

/// How much detached work runs now, layer-wide, of each kind (`crate::write::detached::Kind`: handlers
/// and bodies, store operations).
#[derive(Debug, Default)]
pub(crate) struct Detached {
    pub(crate) running: [std::sync::atomic::AtomicUsize; 2],
}

//! What every clone of a layer shares: counters, the waiters of each key, lease renewals, and
//! the detached work running.
//!
//! Made once in [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) and never copied by a
//! setter, so two layers configured from one base (say with different leases) share their
//! counters but never mix their settings.

use std::sync::Arc;

use crate::detached::Detached;
use crate::renewal::Renewals;
use crate::stats::{Counters, IdempotencyStats};
use crate::waiters::Waiters;

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) counters: Arc<Counters>,
    pub(crate) waiters: Arc<Waiters>,
    /// The claims this layer holds, renewed by one task through the layer's one store.
    pub(crate) renewals: Arc<Renewals>,
    pub(crate) detached: Arc<Detached>,
}

impl Default for Shared {
    fn default() -> Self {
        let counters = Arc::<Counters>::default();
        Shared {
            renewals: Arc::new(Renewals::new(counters.clone())),
            counters,
            waiters: Arc::default(),
            detached: Arc::default(),
        }
    }
}

impl Shared {
    /// The same counters, waiters and detached work, with renewals of its own: for a layer over
    /// another store (a renewal task renews through one store).
    pub(crate) fn for_another_store(&self) -> Shared {
        Shared {
            counters: self.counters.clone(),
            waiters: self.waiters.clone(),
            renewals: Arc::new(Renewals::new(self.counters.clone())),
            detached: self.detached.clone(),
        }
    }

    /// The counters, and the detached work running now.
    pub(crate) fn stats(&self) -> IdempotencyStats {
        self.counters.snapshot(self.detached.running() as u64)
    }
}

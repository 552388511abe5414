//! What every clone of a layer shares: counters, the bound on waiters, lease renewals.
//!
//! Made once in [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) and never copied by a
//! setter, so two layers configured from one base (say with different leases) share their
//! counters but never mix their settings.

use std::sync::Arc;

use crate::renewal::Renewals;
use crate::stats::Counters;
use crate::wait_limit::WaitLimit;

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) counters: Arc<Counters>,
    pub(crate) wait_limit: Arc<WaitLimit>,
    /// The claims this layer holds, renewed by one task through the layer's one store.
    pub(crate) renewals: Arc<Renewals>,
}

impl Shared {
    /// The same counters and waiters, with renewals of its own: for a layer over another store
    /// (a renewal task renews through one store).
    pub(crate) fn for_another_store(&self) -> Shared {
        Shared {
            counters: self.counters.clone(),
            wait_limit: self.wait_limit.clone(),
            renewals: Arc::default(),
        }
    }
}

//! What a [`HedgeLayer`](super::HedgeLayer) did: the counters its services add to, and the
//! copy a caller reads.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a [`HedgeLayer`](super::HedgeLayer) did, for every service it made: a point-in-time copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HedgeStats {
    /// Calls.
    pub requests: u64,
    /// Hedges sent (attempts after the first).
    pub hedges: u64,
    /// Calls answered by a hedge rather than the first attempt.
    pub won_by_hedge: u64,
    /// Hedges the budget refused.
    pub budget_refusals: u64,
    /// Request-body bytes kept for hedges right now, by every call in flight: the layer's
    /// replay memory (a layer made by
    /// [`RetryLayer::hedge_layer`](crate::RetryLayer::hedge_layer) shares the retry layer's,
    /// and shows the same figure as its [`RetryStats::replay_bytes`](crate::RetryStats)).
    pub replay_bytes: u64,
}

/// The counters every clone of a hedge layer and of its services adds to.
#[derive(Debug, Default)]
pub(super) struct HedgeCounters {
    pub(super) requests: AtomicU64,
    pub(super) hedges: AtomicU64,
    pub(super) won_by_hedge: AtomicU64,
    pub(super) budget_refusals: AtomicU64,
}

impl HedgeCounters {
    /// The current values (the replay memory's use is filled in by the caller).
    pub(super) fn snapshot(&self) -> HedgeStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HedgeStats {
            requests: get(&self.requests),
            hedges: get(&self.hedges),
            won_by_hedge: get(&self.won_by_hedge),
            budget_refusals: get(&self.budget_refusals),
            replay_bytes: 0,
        }
    }
}

/// Adds one to `c`.
pub(super) fn incr(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

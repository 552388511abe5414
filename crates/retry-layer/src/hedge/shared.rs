//! What every clone of a hedge layer and of its services shares, made once per layer.

use std::sync::Arc;

use super::policy::HedgePolicy;
use super::stats::HedgeCounters;
use crate::body::ReplayMemory;
use crate::budget::Budget;

/// The policy, the budget hedges draw on, the counters and the replay memory. A
/// [`HedgeLayer`](super::HedgeLayer) makes one; cloning the layer or a service shares it.
#[derive(Debug)]
pub(super) struct HedgeShared {
    pub(super) policy: HedgePolicy,
    pub(super) budget: Arc<dyn Budget>,
    pub(super) stats: HedgeCounters,
    /// Request-body bytes kept for hedges (a retry layer's, shared by `hedge_layer`).
    pub(super) replay_memory: Arc<ReplayMemory>,
}

impl HedgeShared {
    /// The shared state of a new layer: `budget` for its hedges, `replay_memory` for the bodies
    /// they keep, counters at zero.
    pub(super) fn new(
        policy: HedgePolicy,
        budget: Arc<dyn Budget>,
        replay_memory: Arc<ReplayMemory>,
    ) -> Self {
        HedgeShared {
            policy,
            budget,
            stats: HedgeCounters::default(),
            replay_memory,
        }
    }
}

//! [`HedgeLayer`]: makes the shared state once and hands it to every service it makes.

use std::sync::Arc;

use tower_layer::Layer;

use super::policy::HedgePolicy;
use super::service::Hedge;
use super::shared::HedgeShared;
use super::stats::HedgeStats;
use crate::body::ReplayMemory;
use crate::retry::layer::RetryLayer;
use crate::retry::policy::DEFAULT_MAX_REPLAY_BYTES_TOTAL;

/// Hedges idempotent requests: see the [module docs](super).
#[derive(Debug, Clone)]
pub struct HedgeLayer {
    shared: Arc<HedgeShared>,
}

impl HedgeLayer {
    /// A layer with its own budget (the policy's).
    pub fn new(policy: HedgePolicy) -> Self {
        let budget = policy.budget.make();
        let memory = Arc::new(ReplayMemory::new(DEFAULT_MAX_REPLAY_BYTES_TOTAL));
        HedgeLayer {
            shared: Arc::new(HedgeShared::new(policy, budget, memory)),
        }
    }

    /// What the layer did so far.
    pub fn stats(&self) -> HedgeStats {
        HedgeStats {
            replay_bytes: self.shared.replay_memory.used() as u64,
            ..self.shared.stats.snapshot()
        }
    }
}

impl RetryLayer {
    /// A [`HedgeLayer`] whose hedges draw on this layer's retry budget, so that retries and
    /// hedges to one backend share one bound.
    pub fn hedge_layer(&self, policy: HedgePolicy) -> HedgeLayer {
        let retries = self.shared();
        HedgeLayer {
            shared: Arc::new(HedgeShared::new(
                policy,
                retries.budget.clone(),
                retries.replay_memory.clone(),
            )),
        }
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = Hedge<S>;

    fn layer(&self, inner: S) -> Hedge<S> {
        Hedge::from_shared(inner, self.shared.clone())
    }
}

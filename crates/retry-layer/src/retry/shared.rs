//! What every clone of a layer and of its services shares, made once per layer.

use std::sync::Arc;

use crate::body::ReplayMemory;
use crate::budget::{AuthorityBudgets, Budget, TokenBucket, TpsBudget};
use crate::retry::observe::WarnSummary;
use crate::retry::policy::{InboundRetry, RetryPolicy, MAX_AUTHORITY_BUDGETS};
use crate::retry::stats::{Counters, RetryStats};

/// The policy (plain settings, never changed after the layer is made), the retry budget and the
/// counters. A [`RetryLayer`](crate::RetryLayer) makes one in `new()`; cloning the layer or a
/// service shares it, so all of them draw on one budget and add to one set of counters.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: Arc<dyn Budget>,
    /// A budget per authority, with `budget_per_authority`.
    pub(crate) authority_budgets: Option<AuthorityBudgets>,
    /// The adaptive budget (gRFC A6 throttling: 20 tokens, 0.1 per success) of retries that a
    /// hop below deferred to this layer (`RETRIES_DEFERRED`).
    pub(crate) deferred_budget: TokenBucket,
    /// The budget of calls made under an inbound retry, with [`InboundRetry::Budget`].
    pub(crate) inbound_retry_budget: Option<Arc<dyn Budget>>,
    pub(crate) stats: Counters,
    /// The request-body bytes kept for replay by every call, within `max_replay_bytes_total`.
    pub(crate) replay_memory: Arc<ReplayMemory>,
    /// The layer's rate-limited WARN summary of give-ups and budget refusals.
    pub(crate) warnings: WarnSummary,
}

impl Shared {
    /// The budget of a request for `uri`: its authority's with `budget_per_authority`, else
    /// `None` (the layer's).
    pub(crate) fn budget_for(&self, uri: &http::Uri) -> Option<Arc<dyn Budget>> {
        self.authority_budgets.as_ref()?.of(uri.authority()?)
    }

    /// The counters, and the bytes kept for replay now.
    pub(crate) fn snapshot(&self) -> RetryStats {
        let mut stats = self.stats.snapshot();
        stats.replay_bytes = self.replay_memory.used() as u64;
        stats
    }

    /// The shared state of a new layer: the budget the policy describes, counters at zero.
    pub(crate) fn new(policy: RetryPolicy) -> Self {
        Shared {
            budget: policy.budget.make(),
            authority_budgets: policy
                .budget_per_authority
                .then(|| AuthorityBudgets::new(policy.budget.clone(), MAX_AUTHORITY_BUDGETS)),
            deferred_budget: TokenBucket::new(20, 0.1).expect("valid parameters"),
            inbound_retry_budget: match policy.inbound_retry {
                InboundRetry::Budget {
                    window,
                    min_per_sec,
                    ratio,
                } => Some(Arc::new(
                    TpsBudget::new(window, min_per_sec, ratio).expect("validated by the builder"),
                )),
                _ => None,
            },
            replay_memory: Arc::new(ReplayMemory::new(policy.max_replay_bytes_total)),
            policy,
            stats: Counters::default(),
            warnings: WarnSummary::default(),
        }
    }
}

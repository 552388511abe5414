//! Retry budgets: how many retries all clones of a layer may send, in proportion to requests.
//!
//! # Why budgets and not only max attempts?
//!
//! `max_attempts = 3` bounds one request, not a fleet: when a backend is down every request is
//! tried three times, and the dead backend sees 3x its load exactly when it can least take it.
//! Three layers of services that each retry twice amplify one user click into 27 attempts at the
//! bottom. A budget bounds the *ratio*: retries may be at most, say, 10 % of requests over the
//! last ten seconds (plus a small floor per second so that a quiet client can still retry), so a
//! dead backend sees about 1.1x its normal load instead of 3x.
//!
//! Two budgets are provided: [`TpsBudget`] (the default, a sliding window like Finagle's and
//! tower's) and [`TokenBucket`] (gRFC A6 `retryThrottling`). Both are lock-free.
//!
//! A budget is chosen with [`RetryPolicyBuilder::budget`](crate::RetryPolicyBuilder::budget),
//! given a [`RetryBudget`]; every clone of a layer shares the one it makes,
//! or with `budget_per_authority` one per host it calls (a dead host then drains only its own).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

mod per_authority;
mod token_bucket;
mod tps;

pub(crate) use per_authority::AuthorityBudgets;

pub use token_bucket::TokenBucket;
pub use tps::TpsBudget;

/// A budget shared by every clone of a [`RetryLayer`](crate::RetryLayer).
pub trait Budget: Send + Sync + fmt::Debug + 'static {
    /// A new logical request started (called once, before its first attempt).
    fn deposit(&self);
    /// An attempt ended, successfully or not (`failed` is true for a retryable failure).
    fn record(&self, failed: bool);
    /// Asks to send one retry; `false` means the budget refuses it.
    fn withdraw(&self) -> bool;
    /// Gives back a retry that [`withdraw`](Self::withdraw) granted and that was not sent after
    /// all (a hedge whose service did not become ready in time, a call that ended first). The
    /// default does nothing, for a budget whose `withdraw` takes nothing.
    fn refund(&self) {}
}

/// A budget's parameters were out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry budget: {0}")]
pub struct InvalidBudget(pub(crate) &'static str);

/// No budget: every retry the other checks allow is sent. Use only where another layer bounds
/// amplification.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unlimited;

impl Budget for Unlimited {
    fn deposit(&self) {}
    fn record(&self, _failed: bool) {}
    fn withdraw(&self) -> bool {
        true
    }
}

/// Which budget a policy describes; each layer made from the policy makes its own from it (a
/// custom budget is shared as given).
#[derive(Clone)]
pub(crate) enum BudgetChoice {
    Tps {
        window: Duration,
        min_per_sec: u32,
        ratio: f64,
    },
    TokenBucket {
        max_tokens: u32,
        token_ratio: f64,
    },
    Unlimited,
    Custom(Arc<dyn Budget>),
}

/// The retry budget of a policy ([`RetryPolicyBuilder::budget`](crate::RetryPolicyBuilder::budget)):
/// how many retries each layer made from the policy may send beside its first attempts. Each
/// layer gets its own, made from these numbers (but a [`custom`](Self::custom) one, shared as
/// given). Invalid numbers are reported by
/// [`RetryPolicyBuilder::build`](crate::RetryPolicyBuilder::build).
///
/// ```
/// use std::time::Duration;
/// use retry_layer::budget::RetryBudget;
/// use retry_layer::RetryPolicy;
///
/// // 20 % of requests over 30 s, plus 5 retries a second.
/// let policy = RetryPolicy::builder()
///     .budget(RetryBudget::sliding_window(Duration::from_secs(30), 5, 0.2))
///     .build()
///     .unwrap();
/// # let _ = policy;
/// assert!(RetryPolicy::builder().budget(RetryBudget::token_bucket(0, 0.1)).build().is_err());
/// ```
#[derive(Clone)]
pub struct RetryBudget(pub(crate) Result<BudgetChoice, InvalidBudget>);

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Ok(BudgetChoice::Tps {
                window,
                min_per_sec,
                ratio,
            }) => write!(
                f,
                "RetryBudget::sliding_window({window:?}, {min_per_sec}, {ratio})"
            ),
            Ok(BudgetChoice::TokenBucket {
                max_tokens,
                token_ratio,
            }) => write!(f, "RetryBudget::token_bucket({max_tokens}, {token_ratio})"),
            Ok(BudgetChoice::Unlimited) => f.write_str("RetryBudget::unlimited()"),
            Ok(BudgetChoice::Custom(b)) => write!(f, "RetryBudget::custom({b:?})"),
            Err(e) => write!(f, "RetryBudget(invalid: {e})"),
        }
    }
}

impl Default for RetryBudget {
    /// 10 % of requests over 10 s, plus 10 retries per second.
    fn default() -> Self {
        RetryBudget(Ok(BudgetChoice::default()))
    }
}

impl RetryBudget {
    /// The default shape ([`TpsBudget`], as `tower::retry::budget::TpsBudget`): `ratio`
    /// retries per request over the last `window`, plus `min_per_sec` retries a second. The
    /// default policy's is 10 s, 10 per second, 0.1.
    pub fn sliding_window(window: Duration, min_per_sec: u32, ratio: f64) -> Self {
        RetryBudget(BudgetChoice::tps(window, min_per_sec, ratio))
    }

    /// gRFC A6 retry throttling ([`TokenBucket`]) instead of the sliding window.
    pub fn token_bucket(max_tokens: u32, token_ratio: f64) -> Self {
        RetryBudget(
            TokenBucket::new(max_tokens, token_ratio).map(|_| BudgetChoice::TokenBucket {
                max_tokens,
                token_ratio,
            }),
        )
    }

    /// No budget. Only where another layer bounds retry amplification.
    pub fn unlimited() -> Self {
        RetryBudget(Ok(BudgetChoice::Unlimited))
    }

    /// A budget of your own, shared as given (across layers too).
    pub fn custom(budget: Arc<dyn Budget>) -> Self {
        RetryBudget(Ok(BudgetChoice::Custom(budget)))
    }
}

impl Default for BudgetChoice {
    /// 10 % of requests over 10 s, plus 10 retries per second.
    fn default() -> Self {
        BudgetChoice::Tps {
            window: Duration::from_secs(10),
            min_per_sec: 10,
            ratio: 0.1,
        }
    }
}

impl BudgetChoice {
    /// The sliding-window budget of these parameters, validated.
    pub(crate) fn tps(
        window: Duration,
        min_per_sec: u32,
        ratio: f64,
    ) -> Result<Self, InvalidBudget> {
        TpsBudget::new(window, min_per_sec, ratio)?;
        Ok(BudgetChoice::Tps {
            window,
            min_per_sec,
            ratio,
        })
    }

    /// The budget itself (the parameters were validated when the choice was made).
    pub(crate) fn make(&self) -> Arc<dyn Budget> {
        match self {
            BudgetChoice::Tps {
                window,
                min_per_sec,
                ratio,
            } => Arc::new(
                TpsBudget::new(*window, *min_per_sec, *ratio).expect("validated by the builder"),
            ),
            BudgetChoice::TokenBucket {
                max_tokens,
                token_ratio,
            } => Arc::new(
                TokenBucket::new(*max_tokens, *token_ratio).expect("validated by the builder"),
            ),
            BudgetChoice::Unlimited => Arc::new(Unlimited),
            BudgetChoice::Custom(b) => b.clone(),
        }
    }
}

impl fmt::Debug for BudgetChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetChoice::Tps {
                window,
                min_per_sec,
                ratio,
            } => f
                .debug_struct("Tps")
                .field("window", window)
                .field("min_per_sec", min_per_sec)
                .field("ratio", ratio)
                .finish(),
            BudgetChoice::TokenBucket {
                max_tokens,
                token_ratio,
            } => f
                .debug_struct("TokenBucket")
                .field("max_tokens", max_tokens)
                .field("token_ratio", token_ratio)
                .finish(),
            BudgetChoice::Unlimited => f.write_str("Unlimited"),
            BudgetChoice::Custom(b) => f.debug_tuple("Custom").field(b).finish(),
        }
    }
}

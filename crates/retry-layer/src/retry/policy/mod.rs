//! [`RetryPolicy`]: what is retried, how often, how long to wait, and within which budgets.
//!
//! The policy lives here; beside it, its builder ([`builder`]), the per-method rules a gRPC
//! service config gives ([`method_configs`], loaded by [`service_config`]) and the hook that
//! rebuilds a request after a conflict ([`rebuild`]).

use std::sync::Arc;
use std::time::Duration;

use reason_code::{GrpcMethods, KeyHeaders, ReasonCodes, RetryTable};

use crate::backoff::{Backoff, JitterRng};
use crate::budget::BudgetChoice;

mod builder;
mod hooks;
mod method_configs;
mod rebuild;
#[cfg(feature = "service-config")]
pub(crate) mod service_config;

pub use builder::{InvalidPolicy, InvalidPolicyKind, RetryPolicyBuilder};
pub use hooks::{NoRetry, RetryCandidate, RetryEvent};
pub(crate) use hooks::{OnRetry, RetryIf};
pub(crate) use method_configs::MethodConfigs;
pub use rebuild::{Conflict, Rebuild, RebuildFuture};
#[cfg(feature = "service-config")]
pub use service_config::{GrpcRetryPolicy, GrpcRetryThrottling, StatusCodeName};

/// The retry policy of a [`RetryLayer`](crate::RetryLayer).
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (total, first included) | 3 |
/// | `base_delay`, `multiplier`, `max_delay` | 20 ms, x2, 1 s |
/// | `jitter` | +-20 % ([`Jitter::Proportional`](crate::backoff::Jitter::Proportional)`(0.2)`) |
/// | `min_attempt_time` | 50 ms |
/// | `response_head_timeout` (each attempt's wait for the response head; not sent to the server) | 60 s |
/// | `total_timeout`, `attempt_timeout` | none (the deadline is the earliest of a `Deadline` extension, `grpc-timeout` and `total_timeout`) |
/// | `max_pushback` | 30 s |
/// | `max_replay_bytes` (per request) | 64 KiB |
/// | `max_replay_bytes_total` (all calls of a layer at once) | 16 MiB |
/// | `max_unsent_retries` | 2 |
/// | budget | 10 % of requests over 10 s, plus 10 retries/s, one per layer (or per authority: `budget_per_authority`) |
/// | under a retry of the hop above ([`InboundRetry`]) | send once |
/// | table | [`RetryTable::default`] (the design table) |
/// | reason codes | [`ReasonCodes::default`] (`x-reason-code`) |
///
/// ```
/// use std::time::Duration;
/// use retry_layer::{GrpcMethods, RetryPolicy};
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(4)
///     .base_delay(Duration::from_millis(50))
///     .total_timeout(Duration::from_secs(2))
///     .idempotent_grpc_methods(GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"]).unwrap())
///     .ensure_idempotency_key()
///     .build()
///     .expect("a valid policy");
/// assert_eq!(policy.max_attempts(), 4);
/// ```
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Attempts, backoff and table of requests no gRPC method config matches.
    pub(crate) rules: Rules,
    /// Per-method rules from a gRPC service config (`methodConfig`).
    pub(crate) methods: Option<Arc<MethodConfigs>>,
    pub(crate) min_attempt_time: Duration,
    pub(crate) total_timeout: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) response_head_timeout: Duration,
    pub(crate) max_pushback: Duration,
    pub(crate) max_replay_bytes: usize,
    pub(crate) max_replay_bytes_total: usize,
    pub(crate) max_unsent_retries: u32,
    pub(crate) reason_codes: ReasonCodes,
    pub(crate) idempotent_grpc: GrpcMethods,
    pub(crate) key_headers: KeyHeaders,
    pub(crate) ensure_key: bool,
    pub(crate) derived_keys: Option<crate::derived_key::DerivedKeys>,
    pub(crate) budget: BudgetChoice,
    pub(crate) budget_per_authority: bool,
    pub(crate) inbound_retry: InboundRetry,
    pub(crate) rng: JitterRng,
    pub(crate) rebuild: Option<Arc<dyn Rebuild>>,
    pub(crate) retry_if: Option<RetryIf>,
    pub(crate) on_retry: Option<OnRetry>,
}

/// What may differ per gRPC method: attempts, backoff and the retryable codes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rules {
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) table: RetryTable,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            max_attempts: 3,
            backoff: Backoff::default(),
            table: RetryTable::default(),
        }
    }
}

/// The longest duration any setting takes: a day. Longer values are rejected so that no deadline
/// or timer computed from them can overflow the clock.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(86_400);

/// The default [`RetryPolicyBuilder::response_head_timeout`]: 60 s, longer than any answer the
/// server layer makes itself (its duplicates wait for their leader 30 s at most).
pub(crate) const DEFAULT_RESPONSE_HEAD_TIMEOUT: Duration = Duration::from_secs(60);

/// The default [`RetryPolicyBuilder::max_replay_bytes_total`]: 16 MiB, gRPC Java's default
/// retry buffer per channel.
pub(crate) const DEFAULT_MAX_REPLAY_BYTES_TOTAL: usize = 16 * 1024 * 1024;

/// The most authorities that get a budget of their own with
/// [`RetryPolicyBuilder::budget_per_authority`]; further ones share the layer's.
pub(crate) const MAX_AUTHORITY_BUDGETS: usize = 1024;

/// The most transparent retries ([`RetryPolicyBuilder::max_unsent_retries`]).
pub(crate) const MAX_UNSENT_RETRIES: u32 = 10;

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            rules: Rules::default(),
            methods: None,
            min_attempt_time: Duration::from_millis(50),
            total_timeout: None,
            attempt_timeout: None,
            response_head_timeout: DEFAULT_RESPONSE_HEAD_TIMEOUT,
            max_pushback: Duration::from_secs(30),
            max_replay_bytes: 64 * 1024,
            max_replay_bytes_total: DEFAULT_MAX_REPLAY_BYTES_TOTAL,
            max_unsent_retries: 2,
            reason_codes: ReasonCodes::default(),
            idempotent_grpc: GrpcMethods::default(),
            key_headers: KeyHeaders::default(),
            ensure_key: false,
            derived_keys: None,
            budget: BudgetChoice::default(),
            budget_per_authority: false,
            inbound_retry: InboundRetry::SendOnce,
            rng: JitterRng::default(),
            rebuild: None,
            retry_if: None,
            on_retry: None,
        }
    }
}

impl RetryPolicy {
    /// The longest duration any setting takes: a day. Longer values are rejected so that no
    /// deadline or timer computed from them can overflow the clock.
    pub const MAX_DURATION: Duration = MAX_DURATION;

    /// The default [`RetryPolicyBuilder::response_head_timeout`]: 60 s, longer than any answer
    /// the server layer makes itself (its duplicates wait for their leader 30 s at most).
    pub const DEFAULT_RESPONSE_HEAD_TIMEOUT: Duration = DEFAULT_RESPONSE_HEAD_TIMEOUT;

    /// The default [`RetryPolicyBuilder::max_replay_bytes_total`]: 16 MiB, gRPC Java's default
    /// retry buffer per channel.
    pub const DEFAULT_MAX_REPLAY_BYTES_TOTAL: usize = DEFAULT_MAX_REPLAY_BYTES_TOTAL;

    /// The most authorities that get a budget of their own with
    /// [`RetryPolicyBuilder::budget_per_authority`]; further ones share the layer's.
    pub const MAX_AUTHORITY_BUDGETS: usize = MAX_AUTHORITY_BUDGETS;

    /// The most transparent retries ([`RetryPolicyBuilder::max_unsent_retries`]).
    pub const MAX_UNSENT_RETRIES: u32 = MAX_UNSENT_RETRIES;

    /// Total attempts a gRPC request for `path` (`/package.Service/Method`) may take: the
    /// matching method config's, else the policy's.
    pub fn max_attempts_of_grpc(&self, path: &str) -> u32 {
        self.rules(self.grpc_method(path)).max_attempts
    }

    /// Total attempts, the first included (of requests no gRPC method config matches).
    pub fn max_attempts(&self) -> u32 {
        self.rules.max_attempts
    }

    /// The backoff schedule (of requests no gRPC method config matches).
    pub fn backoff(&self) -> &Backoff {
        &self.rules.backoff
    }

    /// The retryability table (of requests no gRPC method config matches).
    pub fn table(&self) -> &RetryTable {
        &self.rules.table
    }

    /// How long each attempt waits for its response head (see
    /// [`RetryPolicyBuilder::response_head_timeout`]).
    pub fn response_head_timeout(&self) -> Duration {
        self.response_head_timeout
    }

    /// The gRPC methods declared idempotent.
    pub fn idempotent_grpc(&self) -> &GrpcMethods {
        &self.idempotent_grpc
    }

    /// The headers an idempotency key travels in.
    pub fn key_headers(&self) -> &KeyHeaders {
        &self.key_headers
    }

    /// What a call made under a retry of the hop above does.
    pub fn inbound_retry(&self) -> &InboundRetry {
        &self.inbound_retry
    }

    /// The method config that applies to a gRPC request for `path`, if the policy has any.
    pub(crate) fn grpc_method(&self, path: &str) -> Option<usize> {
        self.methods.as_ref().and_then(|m| m.find(path))
    }

    /// The rules of a method config, or the policy's own.
    pub(crate) fn rules(&self, method: Option<usize>) -> &Rules {
        match (method, &self.methods) {
            (Some(i), Some(m)) => &m.rules[i],
            _ => &self.rules,
        }
    }
}

/// What a call does when the request its handler is serving is itself a retry of the hop above
/// (it arrived with `grpc-previous-rpc-attempts` or `x-previous-attempts` above zero, as a
/// [`Hop`](crate::reason_code::Hop) in scope says; see [`hop`](crate::hop)).
///
/// Retrying underneath a retry multiplies attempts: the hop above already retries this
/// request, so each of its attempts would bring up to `max_attempts` here.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum InboundRetry {
    /// Send once (requests that provably never left are still retried transparently). The
    /// default: the hop above is retrying.
    #[default]
    SendOnce,
    /// Retry as if the inbound request were new: retries at this hop and the one above
    /// multiply. Only for a hop whose downstream fails independently of what failed above.
    RetryAsUsual,
    /// Retry within a second, smaller budget kept for calls made under an inbound retry (the
    /// layer's own budget is left to first requests).
    Budget {
        /// The budget's window (1 to 60 s).
        window: Duration,
        /// Retries per second always allowed.
        min_per_sec: u32,
        /// Retries allowed per call made under an inbound retry.
        ratio: f64,
    },
}

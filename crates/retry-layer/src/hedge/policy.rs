//! [`HedgePolicy`]: how many attempts, how long between them, and which requests are hedged.

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use reason_code::{Code, GrpcMethods, KeyHeaders, ReasonCodes};

use crate::budget::BudgetChoice;
use crate::request::{is_idempotent_method, is_safe_method};
use crate::retry::policy::{MethodConfigs, DEFAULT_RESPONSE_HEAD_TIMEOUT};

/// Attempts, delay and non-fatal codes: what may differ per gRPC method.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct HedgeRules {
    pub(super) max_attempts: u32,
    pub(super) delay: Duration,
    /// By code number.
    pub(super) non_fatal: [bool; 17],
}

impl Default for HedgeRules {
    fn default() -> Self {
        let mut non_fatal = [false; 17];
        non_fatal[Code::Unavailable.as_i32() as usize] = true;
        HedgeRules {
            max_attempts: 2,
            delay: Duration::from_millis(50),
            non_fatal,
        }
    }
}

/// The most attempts a hedged request may take (gRFC A6 caps `maxAttempts` at 5).
pub const MAX_HEDGED_ATTEMPTS: u32 = 5;

/// The hedging policy of a [`HedgeLayer`](super::HedgeLayer): see the [module docs](super).
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (first included, at most 5) | 2 |
/// | `hedging_delay` | 50 ms |
/// | `non_fatal_codes` | UNAVAILABLE (and transport errors) |
/// | `max_pushback` (a longer one stops hedging) | 30 s |
/// | `response_head_timeout` (each attempt) | 60 s |
/// | writes (PUT, DELETE, keyed) | not hedged ([`hedge_writes`](super::HedgePolicyBuilder::hedge_writes)) |
/// | `max_replay_bytes` | 64 KiB |
/// | budget | 10 % of requests over 10 s, plus 10 hedges/s |
#[derive(Debug, Clone)]
pub struct HedgePolicy {
    pub(super) rules: HedgeRules,
    pub(super) methods: Option<Arc<MethodConfigs<HedgeRules>>>,
    pub(super) max_replay_bytes: usize,
    pub(super) max_pushback: Duration,
    pub(super) response_head_timeout: Duration,
    pub(super) hedge_writes: bool,
    pub(super) reason_codes: ReasonCodes,
    pub(super) idempotent_grpc: GrpcMethods,
    pub(super) key_headers: KeyHeaders,
    pub(super) budget: BudgetChoice,
}

impl Default for HedgePolicy {
    fn default() -> Self {
        HedgePolicy {
            rules: HedgeRules::default(),
            methods: None,
            max_replay_bytes: 64 * 1024,
            max_pushback: Duration::from_secs(30),
            response_head_timeout: DEFAULT_RESPONSE_HEAD_TIMEOUT,
            hedge_writes: false,
            reason_codes: ReasonCodes::default(),
            idempotent_grpc: GrpcMethods::default(),
            key_headers: KeyHeaders::default(),
            budget: BudgetChoice::default(),
        }
    }
}

impl HedgePolicy {
    /// Total attempts of requests no gRPC method config matches.
    pub fn max_attempts(&self) -> u32 {
        self.rules.max_attempts
    }

    /// The delay before each hedge of requests no gRPC method config matches.
    pub fn hedging_delay(&self) -> Duration {
        self.rules.delay
    }

    pub(super) fn rules_for(&self, parts: &Parts, grpc: bool) -> &HedgeRules {
        if !grpc {
            return &self.rules;
        }
        match &self.methods {
            Some(m) => match m.find(parts.uri.path()) {
                Some(i) => &m.rules[i],
                None => &NO_HEDGING,
            },
            None => &self.rules,
        }
    }

    /// A read (a safe method, a gRPC method declared idempotent); with `hedge_writes`, also an
    /// idempotent or keyed write.
    pub(super) fn may_hedge(&self, parts: &Parts, grpc: bool) -> bool {
        if parts.extensions.get::<crate::NoRetry>().is_some() {
            return false;
        }
        let read = if grpc {
            self.idempotent_grpc.contains(parts.uri.path())
        } else {
            is_safe_method(&parts.method)
        };
        read || (self.hedge_writes
            && (self.key_headers.is_keyed(&parts.headers)
                || (!grpc && is_idempotent_method(&parts.method))))
    }
}

/// The rules of a gRPC method a service config gives no `hedgingPolicy`: sent once.
static NO_HEDGING: HedgeRules = HedgeRules {
    max_attempts: 1,
    delay: Duration::ZERO,
    non_fatal: [false; 17],
};

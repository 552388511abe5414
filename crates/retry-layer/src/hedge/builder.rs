//! [`HedgePolicyBuilder`]: the hedging settings, each checked as it is set.

use std::time::Duration;

use reason_code::{Code, GrpcMethods, KeyHeaders, ReasonCodes};

use super::policy::{HedgePolicy, MAX_HEDGED_ATTEMPTS};
use crate::budget::RetryBudget;
use crate::retry::policy::{InvalidPolicy, InvalidPolicyKind, MAX_DURATION};

impl HedgePolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> HedgePolicyBuilder {
        HedgePolicyBuilder {
            policy: HedgePolicy::default(),
            error: None,
        }
    }

    /// A builder starting from this policy.
    pub fn to_builder(&self) -> HedgePolicyBuilder {
        HedgePolicyBuilder {
            policy: self.clone(),
            error: None,
        }
    }
}

/// Builds a [`HedgePolicy`]; [`build`](Self::build) says which setting is out of range.
#[derive(Debug)]
pub struct HedgePolicyBuilder {
    policy: HedgePolicy,
    error: Option<InvalidPolicy>,
}

impl HedgePolicyBuilder {
    /// Keeps the first refused setting (`build` returns it): out of range.
    fn fail(self, message: String) -> Self {
        self.fail_with(InvalidPolicyKind::OutOfRange, message)
    }

    /// Keeps the first refused setting, of `kind`.
    fn fail_with(mut self, kind: InvalidPolicyKind, message: String) -> Self {
        self.error.get_or_insert(InvalidPolicy::new(kind, message));
        self
    }

    /// Total attempts in flight at most, the first included (1 to [`MAX_HEDGED_ATTEMPTS`]).
    pub fn max_attempts(mut self, n: u32) -> Self {
        if !(1..=MAX_HEDGED_ATTEMPTS).contains(&n) {
            return self.fail(format!(
                "hedging max_attempts must be between 1 and {MAX_HEDGED_ATTEMPTS}, got {n}"
            ));
        }
        self.policy.rules.max_attempts = n;
        self
    }

    /// How long to wait for an answer before sending the next hedge (at most a day). Set it
    /// near the backend's p95 latency.
    pub fn hedging_delay(mut self, d: Duration) -> Self {
        if d > MAX_DURATION {
            return self.fail(format!("hedging_delay must be at most one day, got {d:?}"));
        }
        self.policy.rules.delay = d;
        self
    }

    /// The codes after which the next hedge is sent at once instead of answering (UNAVAILABLE
    /// by default). OK is never one.
    pub fn non_fatal_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        let mut non_fatal = [false; 17];
        for c in codes {
            if c != Code::Ok {
                non_fatal[c.as_i32() as usize] = true;
            }
        }
        self.policy.rules.non_fatal = non_fatal;
        self
    }

    /// The gRPC methods that may be hedged (the same type the server and `RetryPolicy` take).
    pub fn idempotent_grpc_methods(mut self, methods: GrpcMethods) -> Self {
        self.policy.idempotent_grpc = methods;
        self
    }

    /// The headers an idempotency key travels in (a keyed request may be hedged).
    pub fn key_headers(mut self, headers: KeyHeaders) -> Self {
        self.policy.key_headers = headers;
        self
    }

    /// The reason codes responses are classified with.
    pub fn reason_codes(mut self, reasons: ReasonCodes) -> Self {
        self.policy.reason_codes = reasons;
        self
    }

    /// Also hedges idempotent writes (PUT, DELETE) and writes that carry an idempotency key. A
    /// write without a key is never hedged. Only for a server that runs `IdempotencyLayer` (or
    /// whose writes are idempotent by design): the hedge is a concurrent duplicate, which the
    /// server waits out or replays, at the cost of its time.
    pub fn hedge_writes(mut self) -> Self {
        self.policy.hedge_writes = true;
        self
    }

    /// The longest server pushback (`Retry-After`, `grpc-retry-pushback-ms`,
    /// `google.rpc.RetryInfo`) a next hedge waits for (at most a day; default 30 s); a longer
    /// one stops hedging.
    pub fn max_pushback(mut self, d: Duration) -> Self {
        if d > MAX_DURATION {
            return self.fail(format!("max_pushback must be at most one day, got {d:?}"));
        }
        self.policy.max_pushback = d;
        self
    }

    /// How long each attempt waits for its response head (greater than zero, at most a day;
    /// default 60 s), as [`RetryPolicyBuilder::response_head_timeout`](crate::RetryPolicyBuilder::response_head_timeout):
    /// an attempt past it counts as a transport failure, and the call ends once no attempt is
    /// left.
    pub fn response_head_timeout(mut self, d: Duration) -> Self {
        if d.is_zero() || d > MAX_DURATION {
            return self.fail(format!(
                "response_head_timeout must be greater than zero and at most one day, got {d:?}"
            ));
        }
        self.policy.response_head_timeout = d;
        self
    }

    /// The largest request body kept for hedges; larger requests are sent once.
    pub fn max_replay_bytes(mut self, n: usize) -> Self {
        self.policy.max_replay_bytes = n;
        self
    }

    /// The budget of the hedges (a [`RetryBudget`], as [`RetryPolicyBuilder::budget`](crate::RetryPolicyBuilder::budget) takes),
    /// for hedges (ignored by [`RetryLayer::hedge_layer`](crate::RetryLayer::hedge_layer), which shares the retry budget).
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        match budget.0 {
            Ok(choice) => self.policy.budget = choice,
            Err(e) => return self.fail_with(InvalidPolicyKind::Budget, e.to_string()),
        }
        self
    }

    /// Validates and returns the policy.
    pub fn build(self) -> Result<HedgePolicy, InvalidPolicy> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.policy),
        }
    }
}

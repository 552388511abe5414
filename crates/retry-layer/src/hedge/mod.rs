//! Hedged requests for idempotent reads (gRFC A6 `hedgingPolicy`).
//!
//! A retry waits for a failure; a hedge does not wait for anything but time. [`HedgeLayer`]
//! sends an idempotent request, and if no answer has come after `hedging_delay`, sends it again
//! (up to `max_attempts` in flight), keeping every attempt running: the first answer that is
//! not a *non-fatal* failure wins, and the others are cancelled (their futures dropped: hyper
//! and h2 abandon the request). A non-fatal failure (a code in `non_fatal_codes`, or a
//! transport error) sends the next hedge at once. This cuts tail latency when one replica or
//! one connection is slow: the p99 becomes about `hedging_delay` plus a fast answer.
//!
//! As in gRFC A6:
//! - only reads are hedged by default (GET, HEAD, OPTIONS, TRACE, gRPC methods declared
//!   idempotent); idempotent and keyed writes (PUT, DELETE, a request with an idempotency key)
//!   only with [`hedge_writes`](HedgePolicyBuilder::hedge_writes); a write without a key never;
//! - every hedge after the first draws on the retry budget, and is not sent when it refuses
//!   ([`RetryLayer::hedge_layer`](crate::RetryLayer::hedge_layer) shares a retry layer's);
//! - server pushback stops further hedges (a negative `grpc-retry-pushback-ms`, `DO_NOT_RETRY`,
//!   a pushback longer than `max_pushback` or than the deadline leaves) or delays the next one
//!   (a positive pushback, `Retry-After`, `google.rpc.RetryInfo`);
//! - every wait has a bound: the call ends at its deadline (a [`Deadline`](crate::Deadline)
//!   extension or `grpc-timeout`, the earlier) with the last failure or
//!   [`DeadlineExceeded`](crate::DeadlineExceeded), and each attempt waits at most
//!   `response_head_timeout` (60 s) for its head;
//! - each hedge carries `grpc-previous-rpc-attempts` / `x-previous-attempts`, and its
//!   `grpc-timeout` is what is left of the call's deadline;
//! - the policy loads from a service config's `hedgingPolicy`
//!   ([`HedgePolicy::from_grpc_service_config`]).
//!
//! ```
//! use std::time::Duration;
//! use retry_layer::hedge::{HedgeLayer, HedgePolicy};
//! use retry_layer::{RetryLayer, RetryPolicy};
//!
//! let retries = RetryLayer::new(RetryPolicy::default());
//! let hedging = HedgePolicy::builder()
//!     .max_attempts(2)
//!     .hedging_delay(Duration::from_millis(20))
//!     .build()?;
//! // Reads hedged, drawing on the retry layer's budget.
//! let reads: HedgeLayer = retries.hedge_layer(hedging);
//! # let _ = reads;
//! # Ok::<(), retry_layer::InvalidPolicy>(())
//! ```
//!
//! # When not to
//!
//! - Writes: not hedged unless asked ([`hedge_writes`](HedgePolicyBuilder::hedge_writes)), and
//!   a write without a key never: a hedged write runs twice unless it is idempotent or keyed
//!   and the server has `IdempotencyLayer`, and even then the duplicate waits for the first or
//!   replays it, taking the server's time for nothing unless the first attempt was lost.
//! - A backend whose slowness is load: hedging adds load (up to `max_attempts` times for the
//!   slow share) exactly when the backend is slow. Keep `hedging_delay` near the p95 so that
//!   only the slowest few percent are hedged, and keep the retry budget on.
//! - Requests with large or streaming bodies: a hedge needs the whole body in memory
//!   (`max_replay_bytes`); a request whose body is not complete when a hedge is due is not
//!   hedged. Request trailers are not sent with hedges.
//! - Do not put `HedgeLayer` and `RetryLayer` on the same requests: hedging already resends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use reason_code::{Code, IdempotentGrpcMethods, KeyHeaders, ReasonCodes};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{ReplayBody, ReplayMemory};
use crate::budget::{Budget, BudgetChoice};
use crate::deadline::{deadline_of, rewrite_grpc_timeout};
use crate::policy::{
    GrpcMethods, InvalidPolicy, DEFAULT_MAX_REPLAY_BYTES_TOTAL, DEFAULT_RESPONSE_HEAD_TIMEOUT,
    MAX_DURATION,
};
use crate::request::{clone_parts, is_idempotent_method, is_safe_method, remove_attempt_headers};
use crate::{BoxError, RetryLayer};

mod future;

pub use future::HedgeFuture;
use future::Plan;

/// Attempts, delay and non-fatal codes: what may differ per gRPC method.
#[derive(Debug, Clone, PartialEq)]
struct HedgeRules {
    max_attempts: u32,
    delay: Duration,
    /// By code number.
    non_fatal: [bool; 17],
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

/// The hedging policy of a [`HedgeLayer`]: see the [module docs](self).
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (first included, at most 5) | 2 |
/// | `hedging_delay` | 50 ms |
/// | `non_fatal_codes` | UNAVAILABLE (and transport errors) |
/// | `max_pushback` (a longer one stops hedging) | 30 s |
/// | `response_head_timeout` (each attempt) | 60 s |
/// | writes (PUT, DELETE, keyed) | not hedged ([`hedge_writes`](HedgePolicyBuilder::hedge_writes)) |
/// | `max_replay_bytes` | 64 KiB |
/// | budget | 10 % of requests over 10 s, plus 10 hedges/s |
#[derive(Debug, Clone)]
pub struct HedgePolicy {
    rules: HedgeRules,
    methods: Option<Arc<GrpcMethods<HedgeRules>>>,
    max_replay_bytes: usize,
    max_pushback: Duration,
    response_head_timeout: Duration,
    hedge_writes: bool,
    reason_codes: ReasonCodes,
    idempotent_grpc: IdempotentGrpcMethods,
    key_headers: KeyHeaders,
    budget: BudgetChoice,
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
            idempotent_grpc: IdempotentGrpcMethods::default(),
            key_headers: KeyHeaders::default(),
            budget: BudgetChoice::default(),
        }
    }
}

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

    /// Total attempts of requests no gRPC method config matches.
    pub fn max_attempts(&self) -> u32 {
        self.rules.max_attempts
    }

    /// The delay before each hedge of requests no gRPC method config matches.
    pub fn hedging_delay(&self) -> Duration {
        self.rules.delay
    }

    fn rules_for(&self, parts: &Parts, grpc: bool) -> &HedgeRules {
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
    fn may_hedge(&self, parts: &Parts, grpc: bool) -> bool {
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

/// Builds a [`HedgePolicy`]; [`build`](Self::build) says which setting is out of range.
#[derive(Debug)]
pub struct HedgePolicyBuilder {
    policy: HedgePolicy,
    error: Option<InvalidPolicy>,
}

impl HedgePolicyBuilder {
    fn fail(mut self, message: String) -> Self {
        self.error.get_or_insert(InvalidPolicy::new(message));
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
    pub fn idempotent_grpc_methods(mut self, methods: IdempotentGrpcMethods) -> Self {
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

    /// The budget shape of [`RetryPolicyBuilder::budget`](crate::RetryPolicyBuilder::budget),
    /// for hedges (ignored by [`RetryLayer::hedge_layer`], which shares the retry budget).
    pub fn budget(mut self, window: Duration, min_per_sec: u32, ratio: f64) -> Self {
        match BudgetChoice::tps(window, min_per_sec, ratio) {
            Ok(budget) => self.policy.budget = budget,
            Err(e) => return self.fail(e.to_string()),
        }
        self
    }

    /// No budget: hedge whenever the delay passes. Only where another layer bounds the load.
    pub fn no_budget(mut self) -> Self {
        self.policy.budget = BudgetChoice::Unlimited;
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

#[cfg(feature = "service-config")]
mod service_config {
    use serde::Deserialize;

    use super::*;
    use crate::budget::TokenBucket;
    use crate::policy::service_config::{
        method_config_names, parse_proto_duration, MethodName, StatusCodeName,
    };

    /// The `hedgingPolicy` object of a gRPC service config (gRFC A6).
    #[derive(Debug, Clone, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[non_exhaustive]
    pub struct GrpcHedgingPolicy {
        /// Total attempts (2 to 5; more is treated as 5).
        pub max_attempts: u32,
        /// The delay before each hedge, as a proto3 JSON duration (`"0.05s"`; default 0).
        #[serde(default)]
        pub hedging_delay: Option<String>,
        /// Codes after which the next hedge is sent at once.
        #[serde(default)]
        pub non_fatal_status_codes: Vec<StatusCodeName>,
    }

    fn rules_from_grpc(p: &GrpcHedgingPolicy) -> Result<HedgeRules, String> {
        if p.max_attempts < 2 {
            return Err(format!(
                "maxAttempts must be at least 2, got {}",
                p.max_attempts
            ));
        }
        let delay = match &p.hedging_delay {
            Some(d) => parse_proto_duration(d)?,
            None => Duration::ZERO,
        };
        let mut non_fatal = [false; 17];
        for c in &p.non_fatal_status_codes {
            if c.0 != Code::Ok {
                non_fatal[c.0.as_i32() as usize] = true;
            }
        }
        Ok(HedgeRules {
            max_attempts: p.max_attempts.min(MAX_HEDGED_ATTEMPTS),
            delay,
            non_fatal,
        })
    }

    impl HedgePolicy {
        /// A policy from a gRPC service config (gRFC A6): `methodConfig[]` entries with a
        /// `hedgingPolicy`, chosen per request by its gRPC path as
        /// [`RetryPolicy::from_grpc_service_config`](crate::RetryPolicy::from_grpc_service_config)
        /// chooses retry policies. A gRPC request no entry with a `hedgingPolicy` matches is
        /// sent once; HTTP requests use the builder's defaults. `retryThrottling` becomes the
        /// budget (a token bucket).
        ///
        /// ```
        /// use retry_layer::hedge::HedgePolicy;
        ///
        /// let policy = HedgePolicy::from_grpc_service_config(r#"{
        ///     "methodConfig": [{
        ///         "name": [{"service": "plume.linkd.v3.Library", "method": "GetBook"}],
        ///         "hedgingPolicy": {
        ///             "maxAttempts": 3,
        ///             "hedgingDelay": "0.02s",
        ///             "nonFatalStatusCodes": ["UNAVAILABLE"]
        ///         }
        ///     }]
        /// }"#).unwrap();
        /// # let _ = policy;
        /// ```
        pub fn from_grpc_service_config(json: &str) -> Result<HedgePolicy, InvalidPolicy> {
            #[derive(Deserialize)]
            #[serde(rename_all = "camelCase")]
            struct ServiceConfig {
                #[serde(default)]
                method_config: Vec<MethodConfig>,
                retry_throttling: Option<crate::GrpcRetryThrottling>,
            }
            #[derive(Deserialize)]
            #[serde(rename_all = "camelCase")]
            struct MethodConfig {
                #[serde(default)]
                name: Vec<MethodName>,
                hedging_policy: Option<GrpcHedgingPolicy>,
            }
            let config: ServiceConfig = serde_json::from_str(json)
                .map_err(|e| InvalidPolicy::new(format!("service config: {e}")))?;
            let mut methods = GrpcMethods::default();
            for (i, mc) in config.method_config.iter().enumerate() {
                let Some(p) = &mc.hedging_policy else {
                    continue;
                };
                let rules = rules_from_grpc(p).map_err(|e| {
                    InvalidPolicy::new(format!("methodConfig[{i}].hedgingPolicy: {e}"))
                })?;
                for name in method_config_names(i, &mc.name)? {
                    methods
                        .insert(name, rules.clone())
                        .map_err(|e| InvalidPolicy::new(format!("service config: {e}")))?;
                }
            }
            let mut policy = HedgePolicy {
                methods: Some(Arc::new(methods)),
                ..HedgePolicy::default()
            };
            if let Some(t) = config.retry_throttling {
                TokenBucket::new(t.max_tokens, t.token_ratio)
                    .map_err(|e| InvalidPolicy::new(format!("retryThrottling: {e}")))?;
                policy.budget = BudgetChoice::TokenBucket {
                    max_tokens: t.max_tokens,
                    token_ratio: t.token_ratio,
                };
            }
            Ok(policy)
        }
    }
}

#[cfg(feature = "service-config")]
pub use service_config::GrpcHedgingPolicy;

/// What a [`HedgeLayer`] did, for every service it made: a point-in-time copy.
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
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    hedges: AtomicU64,
    won_by_hedge: AtomicU64,
    budget_refusals: AtomicU64,
}

fn incr(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct Shared {
    policy: HedgePolicy,
    budget: Arc<dyn Budget>,
    stats: Counters,
    /// Request-body bytes kept for hedges (a retry layer's, shared by `hedge_layer`).
    replay_memory: Arc<ReplayMemory>,
}

/// Hedges idempotent requests: see the [module docs](self).
#[derive(Debug, Clone)]
pub struct HedgeLayer {
    shared: Arc<Shared>,
}

impl HedgeLayer {
    /// A layer with its own budget (the policy's).
    pub fn new(policy: HedgePolicy) -> Self {
        let budget = policy.budget.make();
        HedgeLayer {
            shared: Arc::new(Shared {
                policy,
                budget,
                stats: Counters::default(),
                replay_memory: Arc::new(ReplayMemory::new(DEFAULT_MAX_REPLAY_BYTES_TOTAL)),
            }),
        }
    }

    /// What the layer did so far.
    pub fn stats(&self) -> HedgeStats {
        let s = &self.shared.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HedgeStats {
            requests: get(&s.requests),
            hedges: get(&s.hedges),
            won_by_hedge: get(&s.won_by_hedge),
            budget_refusals: get(&s.budget_refusals),
        }
    }
}

impl RetryLayer {
    /// A [`HedgeLayer`] whose hedges draw on this layer's retry budget, so that retries and
    /// hedges to one backend share one bound.
    pub fn hedge_layer(&self, policy: HedgePolicy) -> HedgeLayer {
        HedgeLayer {
            shared: Arc::new(Shared {
                policy,
                budget: self.shared().budget.clone(),
                stats: Counters::default(),
                replay_memory: self.shared().replay_memory.clone(),
            }),
        }
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = Hedge<S>;

    fn layer(&self, inner: S) -> Hedge<S> {
        Hedge {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`HedgeLayer`] makes. Its inner service takes [`ReplayBody`] requests, as
/// [`Retry`](crate::Retry)'s does.
#[derive(Debug, Clone)]
pub struct Hedge<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S, B, R> Service<Request<B>> for Hedge<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = HedgeFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was driven to readiness is the one that must be called (tower-service
        // docs, "Be careful when cloning inner services").
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let (mut parts, body) = req.into_parts();
        // The hedge owns the attempt headers: a forwarded one is not this call's count.
        remove_attempt_headers(&mut parts);
        let grpc = reason_code::is_grpc(&parts.headers);
        let rules = policy.rules_for(&parts, grpc);
        let hedged = rules.max_attempts > 1 && policy.may_hedge(&parts, grpc);
        let max = if hedged { policy.max_replay_bytes } else { 0 };
        let deadline = deadline_of(&parts, grpc, None);
        if grpc {
            rewrite_grpc_timeout(&mut parts, deadline, None);
        }
        incr(&shared.stats.requests);
        let plan = Plan {
            max_attempts: if hedged { rules.max_attempts } else { 1 },
            delay: rules.delay,
            non_fatal: rules.non_fatal,
            grpc,
            deadline,
        };
        let wrapped = if deadline.is_some_and(|d| Instant::now() >= d) {
            Err(crate::DeadlineExceeded::new().into())
        } else {
            ReplayBody::new(body, max, None, &shared.replay_memory)
        };
        match wrapped {
            Ok((first_body, body)) => {
                shared.budget.deposit();
                let kept = hedged.then(|| clone_parts(&parts));
                HedgeFuture::start(
                    service,
                    shared,
                    plan,
                    Request::from_parts(parts, first_body),
                    kept,
                    body,
                )
            }
            // Nothing is sent: the deadline had passed, or the body failed before its first
            // byte. That is the answer.
            Err(e) => HedgeFuture::not_sent(service, shared, plan, e),
        }
    }
}

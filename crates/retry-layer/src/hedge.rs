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
//! - only idempotent requests are hedged (GET, HEAD, OPTIONS, TRACE, PUT, DELETE, declared gRPC
//!   methods, keyed requests); the others are sent once;
//! - every hedge after the first draws on the retry budget, and is not sent when it refuses
//!   ([`RetryLayer::hedge_layer`](crate::RetryLayer::hedge_layer) shares a retry layer's);
//! - server pushback stops further hedges (a negative `grpc-retry-pushback-ms`, `DO_NOT_RETRY`)
//!   or delays the next one (a positive pushback, `Retry-After`);
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
//! - Writes: never hedged (a hedged write runs twice unless it is keyed and the server has
//!   `IdempotencyLayer`; even then both attempts take the server's time).
//! - A backend whose slowness is load: hedging adds load (up to `max_attempts` times for the
//!   slow share) exactly when the backend is slow. Keep `hedging_delay` near the p95 so that
//!   only the slowest few percent are hedged, and keep the retry budget on.
//! - Requests with large or streaming bodies: a hedge needs the whole body in memory
//!   (`max_replay_bytes`); a request whose body is not complete when a hedge is due is not
//!   hedged. Request trailers are not sent with hedges.
//! - Do not put `HedgeLayer` and `RetryLayer` on the same requests: hedging already resends.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use reason_code::{Code, IdempotentGrpcMethods, KeyHeaders, Outcome, ReasonCodes};
use tokio::time::{Instant, Sleep};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BodyHandle, ReplayBody, ReplayMemory};
use crate::budget::{Budget, BudgetChoice};
use crate::classify::{self, PushbackHint};
use crate::deadline::{deadline_of, rewrite_grpc_timeout};
use crate::policy::{GrpcMethods, InvalidPolicy, DEFAULT_MAX_REPLAY_BYTES_TOTAL, MAX_DURATION};
use crate::request::{
    clone_parts, is_idempotent_method, remove_attempt_headers, write_previous_attempts,
};
use crate::{BoxError, RetryLayer};

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
/// | `max_replay_bytes` | 64 KiB |
/// | budget | 10 % of requests over 10 s, plus 10 hedges/s |
#[derive(Debug, Clone)]
pub struct HedgePolicy {
    rules: HedgeRules,
    methods: Option<Arc<GrpcMethods<HedgeRules>>>,
    max_replay_bytes: usize,
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

    fn is_idempotent(&self, parts: &Parts, grpc: bool) -> bool {
        if self.key_headers.is_keyed(&parts.headers) {
            return true;
        }
        if grpc {
            self.idempotent_grpc.contains(parts.uri.path())
        } else {
            is_idempotent_method(&parts.method)
        }
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
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let (mut parts, body) = req.into_parts();
        // The hedge owns the attempt headers: a forwarded one is not this call's count.
        remove_attempt_headers(&mut parts);
        let grpc = reason_code::is_grpc(&parts.headers);
        let rules = policy.rules_for(&parts, grpc);
        let hedged = rules.max_attempts > 1 && policy.is_idempotent(&parts, grpc);
        let max = if hedged { policy.max_replay_bytes } else { 0 };
        let deadline = deadline_of(&parts, grpc, None);
        if grpc {
            rewrite_grpc_timeout(&mut parts, deadline, None);
        }
        let (max_attempts, delay, non_fatal) = (rules.max_attempts, rules.delay, rules.non_fatal);
        incr(&shared.stats.requests);
        let wrapped = ReplayBody::new(body, max, None, &shared.replay_memory);
        let mut future = HedgeFuture {
            service,
            shared,
            parts: None,
            body: BodyHandle::empty(),
            grpc,
            deadline,
            attempts: Vec::new(),
            sent: 0,
            max_attempts: if hedged { max_attempts } else { 1 },
            delay,
            non_fatal,
            timer: None,
            last: None,
        };
        match wrapped {
            Ok((first_body, body)) => {
                future.shared.budget.deposit();
                future.parts = hedged.then(|| clone_parts(&parts));
                future.body = body;
                let first = future.service.call(Request::from_parts(parts, first_body));
                future.attempts.push((0, Box::pin(first)));
                future.sent = 1;
                future.timer = hedged.then(|| Box::pin(tokio::time::sleep(delay)));
            }
            // The body failed before its first byte: nothing is sent, its error is the answer.
            Err(e) => future.last = Some(Err(e)),
        }
        future
    }
}

/// The response future of [`Hedge`].
pub struct HedgeFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    service: S,
    shared: Arc<Shared>,
    /// The head hedges are sent with; `None` when the request is not hedged.
    parts: Option<Parts>,
    body: BodyHandle<B>,
    grpc: bool,
    deadline: Option<Instant>,
    /// Attempts in flight, with their number (0 for the first).
    attempts: Vec<(u32, Pin<Box<S::Future>>)>,
    sent: u32,
    max_attempts: u32,
    delay: Duration,
    non_fatal: [bool; 17],
    /// When the next hedge is due; `None` when no more will be sent.
    timer: Option<Pin<Box<Sleep>>>,
    /// The last non-fatal result, the answer if nothing better comes.
    last: Option<Result<S::Response, BoxError>>,
}

impl<S, B> std::fmt::Debug for HedgeFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HedgeFuture")
            .field("sent", &self.sent)
            .field("in_flight", &self.attempts.len())
            .finish_non_exhaustive()
    }
}

// Every field is either `Unpin` or pinned in a box.
impl<S, B> Unpin for HedgeFuture<S, B> where S: Service<Request<ReplayBody<B>>> {}

impl<S, B, R> HedgeFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    /// Reads one finished attempt: `Some` is the answer; `None` means it failed non-fatally
    /// (kept as the fallback answer) and the next hedge is due now or after the pushback.
    fn settle(
        &mut self,
        n: u32,
        result: Result<Response<R>, BoxError>,
    ) -> Option<Result<Response<R>, BoxError>> {
        let shared = &self.shared;
        let outcome = match &result {
            Ok(res) => classify::response(res, self.grpc, &shared.policy.reason_codes),
            Err(e) => classify::error(e),
        };
        let non_fatal = match outcome {
            Outcome::Status(code) => self.non_fatal[code.as_i32() as usize],
            // A transport error of an idempotent request: try another attempt.
            _ => self.parts.is_some(),
        };
        if !non_fatal {
            if outcome == Outcome::Status(Code::Ok) {
                shared.budget.record(false);
            }
            if n > 0 {
                incr(&shared.stats.won_by_hedge);
            }
            return Some(result);
        }
        shared.budget.record(true);
        let pushback = match &result {
            Ok(res) => classify::pushback(res.headers(), &shared.policy.reason_codes),
            Err(_) => PushbackHint::None,
        };
        match pushback {
            PushbackHint::Stop => self.timer = None,
            PushbackHint::After(d) => {
                if let Some(t) = &mut self.timer {
                    t.as_mut().reset(Instant::now() + d.min(MAX_DURATION));
                }
            }
            PushbackHint::None | PushbackHint::Deferred => {
                if let Some(t) = &mut self.timer {
                    t.as_mut().reset(Instant::now());
                }
            }
        }
        self.last = Some(result);
        None
    }

    /// Sends the next hedge if the body, the budget and the service allow it. `Pending` when
    /// the service is not ready yet.
    fn send_hedge(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(bytes) = self.body.complete_bytes() else {
            tracing::debug!("not hedging: the request body is not complete yet");
            self.timer = None;
            return Poll::Ready(());
        };
        match self.service.poll_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => {
                let e: BoxError = e.into();
                tracing::debug!(error = %e, "not hedging: the service failed readiness");
                self.timer = None;
                return Poll::Ready(());
            }
            Poll::Ready(Ok(())) => {}
        }
        if !self.shared.budget.withdraw() {
            incr(&self.shared.stats.budget_refusals);
            tracing::debug!("not hedging: the retry budget refused");
            self.timer = None;
            return Poll::Ready(());
        }
        let mut parts = clone_parts(self.parts.as_ref().expect("hedged requests keep the head"));
        write_previous_attempts(&mut parts, self.grpc, self.sent);
        if self.grpc {
            rewrite_grpc_timeout(&mut parts, self.deadline, None);
        }
        let n = self.sent;
        let future = self
            .service
            .call(Request::from_parts(parts, ReplayBody::fixed(bytes)));
        self.attempts.push((n, Box::pin(future)));
        self.sent += 1;
        incr(&self.shared.stats.hedges);
        match &mut self.timer {
            Some(t) if self.sent < self.max_attempts => {
                t.as_mut().reset(Instant::now() + self.delay)
            }
            _ => self.timer = None,
        }
        Poll::Ready(())
    }
}

impl<S, B, R> Future for HedgeFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            let mut i = 0;
            while i < this.attempts.len() {
                let (n, future) = &mut this.attempts[i];
                let n = *n;
                match future.as_mut().poll(cx) {
                    Poll::Pending => i += 1,
                    Poll::Ready(result) => {
                        drop(this.attempts.swap_remove(i));
                        if let Some(answer) = this.settle(n, result.map_err(Into::into)) {
                            // The others are cancelled as they drop with the future.
                            this.attempts.clear();
                            return Poll::Ready(answer);
                        }
                    }
                }
            }
            if this.sent >= this.max_attempts {
                this.timer = None;
            }
            let due = match &mut this.timer {
                Some(t) => t.as_mut().poll(cx).is_ready(),
                None => false,
            };
            if due {
                if this.send_hedge(cx).is_pending() {
                    return Poll::Pending;
                }
                continue;
            }
            if this.attempts.is_empty() && this.timer.is_none() {
                return Poll::Ready(
                    this.last
                        .take()
                        .expect("an attempt ended before the last one was settled"),
                );
            }
            return Poll::Pending;
        }
    }
}

//! [`RetryPolicy`]: what is retried, how often, how long to wait, and within which budgets.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reason_code::{ClientRule, Code, IdempotentGrpcMethods, KeyHeaders, ReasonCodes, RetryTable};
use serde::Deserialize;

use crate::backoff::{Backoff, Jitter, JitterRng};
use crate::budget::{Budget, InvalidBudget, TokenBucket, TpsBudget, Unlimited};

/// The future a [`Rebuild`] hook returns.
pub type RebuildFuture = Pin<Box<dyn Future<Output = Option<http::Request<Bytes>>> + Send>>;

/// What a [`Rebuild`] hook receives after an ABORTED outcome (409, `STOCK_CONFLICT`, ...).
#[derive(Debug)]
#[non_exhaustive]
pub struct Conflict {
    /// The request as it was last sent, with its whole body.
    pub request: http::Request<Bytes>,
    /// The code the response was classified as.
    pub code: Code,
    /// The status and headers of the response (its body was not read).
    pub response: http::response::Parts,
}

/// A hook that rebuilds a request after a conflict, for example by re-reading the current state
/// and recomputing the write. Returning `None` gives the conflict response back to the caller.
///
/// Implemented for every `Fn(Conflict) -> impl Future<Output = Option<http::Request<Bytes>>>`.
pub trait Rebuild: Send + Sync + 'static {
    /// Builds the next attempt's request, or `None` to stop.
    fn rebuild(&self, conflict: Conflict) -> RebuildFuture;
}

impl<F, Fut> Rebuild for F
where
    F: Fn(Conflict) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<http::Request<Bytes>>> + Send + 'static,
{
    fn rebuild(&self, conflict: Conflict) -> RebuildFuture {
        Box::pin(self(conflict))
    }
}

/// Which retry budget the layer shares among its clones.
#[derive(Clone)]
enum BudgetConfig {
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

impl fmt::Debug for BudgetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetConfig::Tps {
                window,
                min_per_sec,
                ratio,
            } => f
                .debug_struct("Tps")
                .field("window", window)
                .field("min_per_sec", min_per_sec)
                .field("ratio", ratio)
                .finish(),
            BudgetConfig::TokenBucket {
                max_tokens,
                token_ratio,
            } => f
                .debug_struct("TokenBucket")
                .field("max_tokens", max_tokens)
                .field("token_ratio", token_ratio)
                .finish(),
            BudgetConfig::Unlimited => f.write_str("Unlimited"),
            BudgetConfig::Custom(b) => f.debug_tuple("Custom").field(b).finish(),
        }
    }
}

/// The retry policy of a [`RetryLayer`](crate::RetryLayer).
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` (total, first included) | 3 |
/// | `base_delay`, `multiplier`, `max_delay` | 20 ms, x2, 1 s |
/// | `jitter` | +-20 % ([`Jitter::Proportional`]`(0.2)`) |
/// | `min_attempt_budget` | 50 ms |
/// | `total_timeout`, `attempt_timeout` | none |
/// | `max_pushback` | 30 s |
/// | `max_replay_bytes` | 64 KiB |
/// | `max_unsent_retries` | 2 |
/// | budget | 10 % of requests over 10 s, plus 10 retries/s |
/// | table | [`RetryTable::default`] (the design table) |
/// | reason codes | [`ReasonCodes::default`] (`x-reason-code`) |
///
/// ```
/// use std::time::Duration;
/// use retry_layer::RetryPolicy;
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(4)
///     .base_delay(Duration::from_millis(50))
///     .total_timeout(Duration::from_secs(2))
///     .idempotent_grpc_method("/plume.linkd.v3.Library/GetBook")
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
    pub(crate) methods: Option<Arc<GrpcMethods>>,
    pub(crate) min_attempt_budget: Duration,
    pub(crate) total_timeout: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) max_pushback: Duration,
    pub(crate) max_replay_bytes: usize,
    pub(crate) max_unsent_retries: u32,
    pub(crate) reason_codes: ReasonCodes,
    pub(crate) idempotent_grpc: IdempotentGrpcMethods,
    pub(crate) key_headers: KeyHeaders,
    pub(crate) ensure_key: bool,
    budget: BudgetConfig,
    pub(crate) rng: JitterRng,
    pub(crate) rebuild: Option<Arc<dyn Rebuild>>,
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

/// Why a duration setting is out of range: over [`MAX_DURATION`], or zero where zero makes no
/// sense.
fn duration_error(name: &str, d: Duration, zero_ok: bool) -> Option<String> {
    if d > MAX_DURATION {
        return Some(format!(
            "{name} must be at most {} s (one day), got {d:?}",
            MAX_DURATION.as_secs()
        ));
    }
    if !zero_ok && d.is_zero() {
        return Some(format!("{name} must be greater than zero"));
    }
    None
}

/// The rules of a gRPC service config's `methodConfig` entries, by method path.
#[derive(Debug, Clone, Default)]
pub(crate) struct GrpcMethods {
    rules: Vec<Rules>,
    /// `/package.Service/Method` or `/package.Service/` to an index in `rules`.
    by_name: HashMap<String, usize>,
    /// The entry with an empty name (`{}`): every method no other entry names.
    default: Option<usize>,
}

impl GrpcMethods {
    fn find(&self, path: &str) -> Option<usize> {
        if let Some(i) = self.by_name.get(path) {
            return Some(*i);
        }
        let service = match path.rfind('/') {
            Some(i) if i > 0 => self.by_name.get(&path[..=i]).copied(),
            _ => None,
        };
        service.or(self.default)
    }

    fn insert(&mut self, name: Option<String>, rules: Rules) -> Result<(), String> {
        let i = self.rules.len();
        match name {
            None if self.default.is_some() => {
                return Err("two methodConfig entries have an empty name".into())
            }
            None => self.default = Some(i),
            Some(n) if self.by_name.contains_key(&n) => {
                return Err(format!("{n:?} is named by two methodConfig entries"))
            }
            Some(n) => {
                self.by_name.insert(n, i);
            }
        }
        self.rules.push(rules);
        Ok(())
    }
}

/// The longest duration any setting takes: a day. Longer values are rejected so that no deadline
/// or timer computed from them can overflow the clock.
pub const MAX_DURATION: Duration = Duration::from_secs(86_400);

/// The most transparent retries ([`RetryPolicyBuilder::max_unsent_retries`]).
pub const MAX_UNSENT_RETRIES: u32 = 10;

impl fmt::Debug for dyn Rebuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rebuild hook")
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            rules: Rules::default(),
            methods: None,
            min_attempt_budget: Duration::from_millis(50),
            total_timeout: None,
            attempt_timeout: None,
            max_pushback: Duration::from_secs(30),
            max_replay_bytes: 64 * 1024,
            max_unsent_retries: 2,
            reason_codes: ReasonCodes::default(),
            idempotent_grpc: IdempotentGrpcMethods::default(),
            key_headers: KeyHeaders::default(),
            ensure_key: false,
            budget: BudgetConfig::Tps {
                window: Duration::from_secs(10),
                min_per_sec: 10,
                ratio: 0.1,
            },
            rng: JitterRng::default(),
            rebuild: None,
        }
    }
}

impl RetryPolicy {
    /// A builder starting from the defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            policy: RetryPolicy::default(),
            error: None,
        }
    }

    /// A builder starting from this policy.
    pub fn to_builder(&self) -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            policy: self.clone(),
            error: None,
        }
    }

    /// A policy from a gRPC service config (gRFC A6): its `methodConfig[]` entries, each with
    /// `name[]` (`{"service": "pkg.Svc", "method": "M"}`, a whole service without `method`, or
    /// `{}` for every method) and an optional `retryPolicy`, plus `retryThrottling`.
    ///
    /// Each request's policy is chosen by its gRPC path (`/pkg.Svc/M`), as gRPC does: the exact
    /// method, else its service, else the empty name. As in gRPC, a request no entry matches (and
    /// an entry without `retryPolicy`) is not retried, except transparently when it was never
    /// sent; `retryThrottling` becomes the layer's budget (a token bucket). Keys other than
    /// these (`timeout`, `waitForReady`, load balancing ...) are not read.
    ///
    /// A bare `retryPolicy` object, or `{"retryPolicy": .., "retryThrottling": ..}`, is accepted
    /// too and applies to every request.
    ///
    /// As A6 specifies, `maxAttempts` above 5 is treated as 5 and the delay is full-jittered.
    /// Listed codes are retried under the table's rule for idempotent requests: declare the gRPC
    /// method idempotent, or use [`RetryPolicyBuilder::ensure_idempotency_key`], for writes.
    ///
    /// ```
    /// use retry_layer::RetryPolicy;
    ///
    /// let policy = RetryPolicy::from_grpc_service_config(r#"{
    ///     "methodConfig": [{
    ///         "name": [{"service": "plume.linkd.v3.Library", "method": "GetBook"}],
    ///         "retryPolicy": {
    ///             "maxAttempts": 4,
    ///             "initialBackoff": "0.02s",
    ///             "maxBackoff": "1s",
    ///             "backoffMultiplier": 2,
    ///             "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]
    ///         }
    ///     }],
    ///     "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
    /// }"#).unwrap();
    /// assert_eq!(policy.max_attempts_of_grpc("/plume.linkd.v3.Library/GetBook"), 4);
    /// assert_eq!(policy.max_attempts_of_grpc("/plume.linkd.v3.Library/ListBooks"), 1);
    /// ```
    pub fn from_grpc_service_config(json: &str) -> Result<RetryPolicy, InvalidPolicy> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct ServiceConfig {
            #[serde(default)]
            method_config: Vec<MethodConfig>,
            retry_policy: Option<GrpcRetryPolicy>,
            retry_throttling: Option<GrpcRetryThrottling>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct MethodConfig {
            #[serde(default)]
            name: Vec<MethodName>,
            retry_policy: Option<GrpcRetryPolicy>,
        }
        #[derive(Deserialize)]
        struct MethodName {
            #[serde(default)]
            service: String,
            #[serde(default)]
            method: String,
        }

        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| InvalidPolicy::new(format!("service config is not JSON: {e}")))?;
        let is_bare_policy = value.get("maxAttempts").is_some();
        if is_bare_policy {
            let p: GrpcRetryPolicy = serde_json::from_value(value)
                .map_err(|e| InvalidPolicy::new(format!("retryPolicy: {e}")))?;
            return RetryPolicy::builder().grpc_retry_policy(&p).build();
        }
        let config: ServiceConfig = serde_json::from_value(value)
            .map_err(|e| InvalidPolicy::new(format!("service config: {e}")))?;
        let mut builder = RetryPolicy::builder();
        match (&config.retry_policy, config.method_config.is_empty()) {
            (Some(p), true) => builder = builder.grpc_retry_policy(p),
            (Some(_), false) => {
                return Err(InvalidPolicy::new(
                    "service config: a top-level retryPolicy and methodConfig together; \
                     move the retryPolicy into a methodConfig entry",
                ))
            }
            (None, true) if config.retry_throttling.is_none() => {
                return Err(InvalidPolicy::new(
                    "service config: no methodConfig, retryPolicy or retryThrottling to load",
                ))
            }
            // gRPC: a request no method config matches is not retried.
            (None, _) => builder = builder.max_attempts(1),
        }
        for (i, mc) in config.method_config.iter().enumerate() {
            let rules = match &mc.retry_policy {
                Some(p) => rules_from_grpc(p).map_err(|e| {
                    InvalidPolicy::new(format!("methodConfig[{i}].retryPolicy: {e}"))
                })?,
                None => Rules {
                    max_attempts: 1,
                    ..Rules::default()
                },
            };
            if mc.name.is_empty() {
                return Err(InvalidPolicy::new(format!(
                    "methodConfig[{i}] has no name; use [{{}}] to match every method"
                )));
            }
            for n in &mc.name {
                let name = match (n.service.as_str(), n.method.as_str()) {
                    ("", "") => None,
                    ("", m) => {
                        return Err(InvalidPolicy::new(format!(
                            "methodConfig[{i}]: method {m:?} names no service"
                        )))
                    }
                    (s, "") => Some(format!("/{s}/")),
                    (s, m) => Some(format!("/{s}/{m}")),
                };
                if name.as_ref().is_some_and(|n| n.matches('/').count() != 2) {
                    return Err(InvalidPolicy::new(format!(
                        "methodConfig[{i}]: {:?}/{:?} must not contain '/'",
                        n.service, n.method
                    )));
                }
                builder = builder.grpc_method_rules(name, rules.clone());
            }
        }
        if let Some(t) = config.retry_throttling {
            builder = builder.grpc_retry_throttling(&t);
        }
        builder.build()
    }

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

    /// The gRPC methods declared idempotent.
    pub fn idempotent_grpc(&self) -> &IdempotentGrpcMethods {
        &self.idempotent_grpc
    }

    /// The headers an idempotency key travels in.
    pub fn key_headers(&self) -> &KeyHeaders {
        &self.key_headers
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

    pub(crate) fn make_budget(&self) -> Arc<dyn Budget> {
        match &self.budget {
            BudgetConfig::Tps {
                window,
                min_per_sec,
                ratio,
            } => Arc::new(
                TpsBudget::new(*window, *min_per_sec, *ratio).expect("validated by build()"),
            ),
            BudgetConfig::TokenBucket {
                max_tokens,
                token_ratio,
            } => {
                Arc::new(TokenBucket::new(*max_tokens, *token_ratio).expect("validated by build()"))
            }
            BudgetConfig::Unlimited => Arc::new(Unlimited),
            BudgetConfig::Custom(b) => b.clone(),
        }
    }
}

/// A [`RetryPolicy`] setting was out of range; the message says which and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {message}")]
pub struct InvalidPolicy {
    message: String,
}

impl InvalidPolicy {
    fn new(message: impl Into<String>) -> Self {
        InvalidPolicy {
            message: message.into(),
        }
    }
}

impl From<InvalidBudget> for InvalidPolicy {
    fn from(e: InvalidBudget) -> Self {
        InvalidPolicy::new(e.to_string())
    }
}

/// Builds a validated [`RetryPolicy`]. Setters consume and return the builder; [`build`]
/// reports the first invalid setting.
///
/// [`build`]: RetryPolicyBuilder::build
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    policy: RetryPolicy,
    error: Option<InvalidPolicy>,
}

impl RetryPolicyBuilder {
    fn fail(mut self, message: impl Into<String>) -> Self {
        if self.error.is_none() {
            self.error = Some(InvalidPolicy::new(message));
        }
        self
    }

    /// Total attempts, the first included (1 disables retries; at most 100).
    pub fn max_attempts(mut self, n: u32) -> Self {
        if !(1..=100).contains(&n) {
            return self.fail(format!("max_attempts must be between 1 and 100, got {n}"));
        }
        self.policy.rules.max_attempts = n;
        self
    }

    /// The delay after the first failed attempt (at most [`MAX_DURATION`]).
    pub fn base_delay(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("base_delay", d, true) {
            return self.fail(e);
        }
        self.policy.rules.backoff.base = d;
        self
    }

    /// The factor the delay grows by per attempt (finite, at least 1.0).
    pub fn multiplier(mut self, m: f64) -> Self {
        if !m.is_finite() || m < 1.0 {
            return self.fail(format!(
                "multiplier must be a finite number >= 1.0, got {m}"
            ));
        }
        self.policy.rules.backoff.multiplier = m;
        self
    }

    /// The largest computed delay (before jitter; at most [`MAX_DURATION`]).
    pub fn max_delay(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("max_delay", d, true) {
            return self.fail(e);
        }
        self.policy.rules.backoff.max_delay = d;
        self
    }

    /// How delays are randomized.
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        if let Jitter::Proportional(r) = jitter {
            if !(0.0..=1.0).contains(&r) {
                return self.fail(format!("proportional jitter must be in [0, 1], got {r}"));
            }
        }
        self.policy.rules.backoff.jitter = jitter;
        self
    }

    /// Seeds the jitter generator shared by all clones of the layer (deterministic delays, for
    /// tests and simulations).
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.policy.rng = JitterRng::seeded(seed);
        self
    }

    /// The least time an attempt must have left before the deadline for a retry to be sent (at
    /// most [`MAX_DURATION`]).
    pub fn min_attempt_budget(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("min_attempt_budget", d, true) {
            return self.fail(e);
        }
        self.policy.min_attempt_budget = d;
        self
    }

    /// A deadline for the whole call, retries included, used when the request carries neither a
    /// [`Deadline`](crate::Deadline) extension nor `grpc-timeout` (greater than zero, at most
    /// [`MAX_DURATION`]).
    pub fn total_timeout(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("total_timeout", d, false) {
            return self.fail(e);
        }
        self.policy.total_timeout = Some(d);
        self
    }

    /// A timeout for each attempt (greater than zero, at most [`MAX_DURATION`]); an attempt that
    /// times out is an ambiguous failure (it may have executed), retried only when the request
    /// is idempotent or keyed. A gRPC attempt's `grpc-timeout` is capped at it, so the server
    /// stops working on an attempt the client abandons.
    pub fn attempt_timeout(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("attempt_timeout", d, false) {
            return self.fail(e);
        }
        self.policy.attempt_timeout = Some(d);
        self
    }

    /// The longest server pushback (`Retry-After`, `grpc-retry-pushback-ms`) honoured (at most
    /// [`MAX_DURATION`]); a longer one ends retrying.
    pub fn max_pushback(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("max_pushback", d, true) {
            return self.fail(e);
        }
        self.policy.max_pushback = d;
        self
    }

    /// The most request-body bytes kept for replay; larger bodies are sent once.
    pub fn max_replay_bytes(mut self, n: usize) -> Self {
        self.policy.max_replay_bytes = n;
        self
    }

    /// How many extra attempts a request that provably never left the client may get beyond
    /// `max_attempts` (gRFC A6 transparent retries), still bounded by deadline and budget (at
    /// most [`MAX_UNSENT_RETRIES`]).
    pub fn max_unsent_retries(mut self, n: u32) -> Self {
        if n > MAX_UNSENT_RETRIES {
            return self.fail(format!(
                "max_unsent_retries must be at most {MAX_UNSENT_RETRIES}, got {n}"
            ));
        }
        self.policy.max_unsent_retries = n;
        self
    }

    /// Replaces the retryability table (to opt in to retrying INTERNAL, for instance).
    pub fn table(mut self, table: RetryTable) -> Self {
        self.policy.rules.table = table;
        self
    }

    /// Replaces the business reason-code table.
    pub fn reason_codes(mut self, reasons: ReasonCodes) -> Self {
        self.policy.reason_codes = reasons;
        self
    }

    /// Declares gRPC methods idempotent, replacing any declared before: their failures are
    /// retried like a PUT's. `idempotency-layer`'s `IdempotencyLayer::idempotent_grpc_methods`
    /// takes the same type, so one list declares the same methods on both sides.
    ///
    /// ```
    /// use retry_layer::{IdempotentGrpcMethods, RetryPolicy};
    ///
    /// let reads = IdempotentGrpcMethods::new([
    ///     "/plume.linkd.v3.Library/GetBook",
    ///     "/grpc.health.v1.Health/",
    /// ])
    /// .unwrap();
    /// let policy = RetryPolicy::builder().idempotent_grpc_methods(reads).build().unwrap();
    /// assert!(policy.idempotent_grpc().contains("/grpc.health.v1.Health/Check"));
    /// ```
    pub fn idempotent_grpc_methods(mut self, methods: IdempotentGrpcMethods) -> Self {
        self.policy.idempotent_grpc = methods;
        self
    }

    /// Declares one more gRPC method idempotent (`/package.Service/Method`), or a whole service
    /// (`/package.Service/`). A path of another shape makes [`build`](Self::build) fail.
    pub fn idempotent_grpc_method(mut self, path: impl AsRef<str>) -> Self {
        // Taken, not cloned, so that the sets are not copied; after an error `build` fails anyway.
        let declared = std::mem::take(&mut self.policy.idempotent_grpc);
        match declared.with(path.as_ref()) {
            Ok(methods) => {
                self.policy.idempotent_grpc = methods;
                self
            }
            Err(e) => self.fail(e.to_string()),
        }
    }

    /// The headers an idempotency key travels in (default `x-idempotency-key`, then
    /// `idempotency-key`): a request carrying any of them is keyed, and
    /// [`ensure_idempotency_key`](Self::ensure_idempotency_key) writes the first.
    /// `idempotency-layer`'s `IdempotencyLayer::key_headers` takes the same type.
    ///
    /// ```
    /// use http::HeaderName;
    /// use retry_layer::{KeyHeaders, RetryPolicy};
    ///
    /// let headers = KeyHeaders::new([HeaderName::from_static("idempotency-key")]).unwrap();
    /// let policy = RetryPolicy::builder().key_headers(headers).build().unwrap();
    /// assert_eq!(policy.key_headers().first().as_str(), "idempotency-key");
    /// ```
    pub fn key_headers(mut self, headers: KeyHeaders) -> Self {
        self.policy.key_headers = headers;
        self
    }

    /// Gives a non-idempotent request that has no idempotency key a fresh UUID key before its
    /// first attempt, so that every retry carries the same key and the server executes it once.
    /// A key the caller set is never changed.
    pub fn ensure_idempotency_key(mut self) -> Self {
        self.policy.ensure_key = true;
        self
    }

    /// The default budget shape with other numbers: `ratio` retries per request over `window`,
    /// plus `min_per_sec`.
    pub fn budget(mut self, window: Duration, min_per_sec: u32, ratio: f64) -> Self {
        if let Err(e) = TpsBudget::new(window, min_per_sec, ratio) {
            return self.fail(e.to_string());
        }
        self.policy.budget = BudgetConfig::Tps {
            window,
            min_per_sec,
            ratio,
        };
        self
    }

    /// gRFC A6 retry throttling instead of the sliding window.
    pub fn token_bucket(mut self, max_tokens: u32, token_ratio: f64) -> Self {
        if let Err(e) = TokenBucket::new(max_tokens, token_ratio) {
            return self.fail(e.to_string());
        }
        self.policy.budget = BudgetConfig::TokenBucket {
            max_tokens,
            token_ratio,
        };
        self
    }

    /// Disables the retry budget. Only do this where another layer bounds retry amplification.
    pub fn no_budget(mut self) -> Self {
        self.policy.budget = BudgetConfig::Unlimited;
        self
    }

    /// Uses a budget of your own, shared as given (it may be shared across layers too).
    pub fn custom_budget(mut self, budget: Arc<dyn Budget>) -> Self {
        self.policy.budget = BudgetConfig::Custom(budget);
        self
    }

    /// Installs the hook that may rebuild a request after an ABORTED outcome (409,
    /// `STOCK_CONFLICT`). Without it such outcomes are returned as they are.
    pub fn rebuild_on_conflict(mut self, hook: impl Rebuild) -> Self {
        self.policy.rebuild = Some(Arc::new(hook));
        self
    }

    /// Applies a gRPC service config `retryPolicy` (gRFC A6) to every request.
    pub fn grpc_retry_policy(mut self, p: &GrpcRetryPolicy) -> Self {
        match rules_from_grpc(p) {
            Ok(rules) => {
                self.policy.rules = rules;
                self
            }
            Err(e) => self.fail(e),
        }
    }

    /// Applies a gRPC service config `retryPolicy` (gRFC A6) to one method
    /// (`/package.Service/Method`) or every method of a service (`/package.Service/`); other
    /// requests keep the policy's own attempts, backoff and table.
    pub fn grpc_method_retry_policy(self, path: impl Into<String>, p: &GrpcRetryPolicy) -> Self {
        let path = path.into();
        if !path.starts_with('/') || path.matches('/').count() != 2 {
            return self.fail(format!(
                "gRPC method {path:?} must look like /package.Service/Method or /package.Service/"
            ));
        }
        match rules_from_grpc(p) {
            Ok(rules) => self.grpc_method_rules(Some(path), rules),
            Err(e) => self.fail(e),
        }
    }

    fn grpc_method_rules(mut self, name: Option<String>, rules: Rules) -> Self {
        let methods = Arc::make_mut(self.policy.methods.get_or_insert_with(Arc::default));
        match methods.insert(name, rules) {
            Ok(()) => self,
            Err(e) => self.fail(e),
        }
    }

    /// Applies a gRPC service config `retryThrottling` (gRFC A6): a token bucket budget.
    pub fn grpc_retry_throttling(self, t: &GrpcRetryThrottling) -> Self {
        self.token_bucket(t.max_tokens, t.token_ratio)
    }

    /// Validates and returns the policy.
    pub fn build(self) -> Result<RetryPolicy, InvalidPolicy> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.policy),
        }
    }
}

/// The attempts, backoff and table a gRPC `retryPolicy` describes.
fn rules_from_grpc(p: &GrpcRetryPolicy) -> Result<Rules, String> {
    let initial = parse_proto_duration(&p.initial_backoff)?;
    let max = parse_proto_duration(&p.max_backoff)?;
    if initial.is_zero() || max.is_zero() {
        return Err("initialBackoff and maxBackoff must be greater than zero".into());
    }
    if initial > MAX_DURATION || max > MAX_DURATION {
        return Err(format!(
            "initialBackoff and maxBackoff must be at most {}s",
            MAX_DURATION.as_secs()
        ));
    }
    if p.max_attempts < 2 {
        return Err(format!(
            "maxAttempts must be at least 2, got {}",
            p.max_attempts
        ));
    }
    if !p.backoff_multiplier.is_finite() || p.backoff_multiplier <= 0.0 {
        return Err(format!(
            "backoffMultiplier must be a number greater than zero, got {}",
            p.backoff_multiplier
        ));
    }
    if p.retryable_status_codes.is_empty() {
        return Err("retryableStatusCodes must name at least one code".into());
    }
    let mut table = RetryTable::no_status_retries();
    for code in &p.retryable_status_codes {
        table = table.with_client_rule(code.0, ClientRule::IfIdempotent);
    }
    Ok(Rules {
        max_attempts: p.max_attempts.min(5),
        backoff: Backoff {
            base: initial,
            // A multiplier below 1 shrinks the delay in gRPC; this backoff only grows, so it is
            // treated as 1.
            multiplier: p.backoff_multiplier.max(1.0),
            max_delay: max,
            jitter: Jitter::Full,
        },
        table,
    })
}

/// The `retryPolicy` object of a gRPC service config (gRFC A6), deserializable with serde.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct GrpcRetryPolicy {
    /// Total attempts (2 to 5; more is treated as 5).
    pub max_attempts: u32,
    /// The first delay, as a proto3 JSON duration (`"0.1s"`).
    pub initial_backoff: String,
    /// The largest delay (`"1s"`).
    pub max_backoff: String,
    /// The growth factor per attempt.
    pub backoff_multiplier: f64,
    /// The codes that may be retried, by name (`"UNAVAILABLE"`) or number.
    pub retryable_status_codes: Vec<StatusCodeName>,
}

/// The `retryThrottling` object of a gRPC service config (gRFC A6).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct GrpcRetryThrottling {
    /// The bucket size (1 to 1000).
    pub max_tokens: u32,
    /// Tokens added per success.
    pub token_ratio: f64,
}

/// A status code in a service config: a canonical name or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusCodeName(pub Code);

impl<'de> Deserialize<'de> for StatusCodeName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Name(String),
            Number(i32),
        }
        match Raw::deserialize(d)? {
            Raw::Name(s) => s
                .parse()
                .map(StatusCodeName)
                .map_err(serde::de::Error::custom),
            Raw::Number(n) if (0..=16).contains(&n) => Ok(StatusCodeName(Code::from_i32(n))),
            Raw::Number(n) => Err(serde::de::Error::custom(format!(
                "status code {n} is not between 0 and 16"
            ))),
        }
    }
}

/// Parses a proto3 JSON duration: decimal seconds with an `s` suffix, up to 9 fractional digits.
fn parse_proto_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration such as \"0.1s\"");
    let num = s.strip_suffix('s').ok_or_else(bad)?;
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if whole.is_empty() && frac.is_empty()
        || frac.len() > 9
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let secs: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().map_err(|_| bad())?
    };
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reason_code::{Outcome, Verdict};

    #[test]
    fn defaults_are_the_documented_ones() {
        let p = RetryPolicy::default();
        assert_eq!(p.rules.max_attempts, 3);
        assert_eq!(p.rules.backoff.base, Duration::from_millis(20));
        assert_eq!(p.rules.backoff.multiplier, 2.0);
        assert_eq!(p.rules.backoff.max_delay, Duration::from_secs(1));
        assert_eq!(p.rules.backoff.jitter, Jitter::Proportional(0.2));
        assert_eq!(p.min_attempt_budget, Duration::from_millis(50));
        assert_eq!(p.max_replay_bytes, 65_536);
    }

    #[test]
    fn invalid_settings_are_reported() {
        let err = RetryPolicy::builder().max_attempts(0).build().unwrap_err();
        assert!(err.to_string().contains("max_attempts"), "{err}");
        assert!(RetryPolicy::builder().multiplier(0.5).build().is_err());
        assert!(RetryPolicy::builder()
            .multiplier(f64::INFINITY)
            .build()
            .is_err());
        assert!(RetryPolicy::builder()
            .jitter(Jitter::Proportional(1.5))
            .build()
            .is_err());
        assert!(RetryPolicy::builder()
            .budget(Duration::ZERO, 1, 0.1)
            .build()
            .is_err());
        assert!(RetryPolicy::builder()
            .idempotent_grpc_method("GetBook")
            .build()
            .is_err());
    }

    #[test]
    fn service_config_shapes() {
        let p = RetryPolicy::from_grpc_service_config(
            r#"{"retryPolicy": {"maxAttempts": 9, "initialBackoff": ".5s", "maxBackoff": "2.25s",
                "backoffMultiplier": 1.5, "retryableStatusCodes": ["UNAVAILABLE", 4]},
                "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}"#,
        )
        .unwrap();
        assert_eq!(p.rules.max_attempts, 5);
        assert_eq!(p.rules.backoff.base, Duration::from_millis(500));
        assert_eq!(p.rules.backoff.max_delay, Duration::from_millis(2250));
        assert_eq!(p.rules.backoff.jitter, Jitter::Full);
        assert_eq!(
            p.rules
                .table
                .verdict(Outcome::Status(Code::Unavailable), true),
            Verdict::Retry
        );
        assert_eq!(
            p.rules
                .table
                .verdict(Outcome::Status(Code::DeadlineExceeded), true),
            Verdict::Retry
        );
        assert_eq!(
            p.rules
                .table
                .verdict(Outcome::Status(Code::ResourceExhausted), true),
            Verdict::Final
        );
        assert!(matches!(
            p.budget,
            BudgetConfig::TokenBucket { max_tokens: 10, .. }
        ));

        for bad in [
            r#"{"maxAttempts": 3, "initialBackoff": "1", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}"#,
            r#"{"maxAttempts": 3, "initialBackoff": "0s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}"#,
            r#"{"maxAttempts": 3, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["NOPE"]}"#,
            r#"{"maxAttempts": 3, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": []}"#,
            r#"{"maxAttempts": 1, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}"#,
            r#"{"maxAttempts": 3}"#,
            "not json",
        ] {
            assert!(RetryPolicy::from_grpc_service_config(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn method_config_names_choose_the_rules() {
        let policy = |name: &str, extra: &str| {
            format!(
                r#"{{"methodConfig": [{{"name": [{name}], "retryPolicy": {{"maxAttempts": 4,
                "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}}}}{extra}]}}"#
            )
        };
        // Exact method, then the service, then the empty name.
        let p = RetryPolicy::from_grpc_service_config(&policy(
            r#"{"service": "a.S", "method": "M"}"#,
            r#", {"name": [{"service": "a.S"}], "retryPolicy": {"maxAttempts": 3,
               "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
               "retryableStatusCodes": [14]}},
               {"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.1s",
               "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}"#,
        ))
        .unwrap();
        assert_eq!(p.max_attempts_of_grpc("/a.S/M"), 4);
        assert_eq!(p.max_attempts_of_grpc("/a.S/N"), 3);
        assert_eq!(p.max_attempts_of_grpc("/b.T/M"), 2);
        assert_eq!(
            p.max_attempts(),
            1,
            "a request no entry matches: not retried"
        );

        // No default entry: unmatched methods are not retried; an entry without retryPolicy
        // neither.
        let p = RetryPolicy::from_grpc_service_config(&policy(
            r#"{"service": "a.S", "method": "M"}"#,
            r#", {"name": [{"service": "a.S", "method": "N"}], "timeout": "1s"}"#,
        ))
        .unwrap();
        assert_eq!(p.max_attempts_of_grpc("/a.S/N"), 1);
        assert_eq!(p.max_attempts_of_grpc("/a.S/O"), 1);

        for bad in [
            policy(r#"{"method": "M"}"#, ""),
            policy(
                r#"{"service": "a.S", "method": "M"}, {"service": "a.S", "method": "M"}"#,
                "",
            ),
            policy(r#"{"service": "a/S", "method": "M"}"#, ""),
            policy(r#"{}"#, r#", {"name": [{}]}"#),
            r#"{"methodConfig": [{"retryPolicy": {}}]}"#.to_owned(),
            r#"{"methodConfig": [{"name": [{}]}], "retryPolicy": {"maxAttempts": 2,
               "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
               "retryableStatusCodes": [14]}}"#
                .to_owned(),
            r#"{"loadBalancingConfig": []}"#.to_owned(),
        ] {
            let err = RetryPolicy::from_grpc_service_config(&bad).unwrap_err();
            assert!(!err.to_string().is_empty(), "{bad}");
        }

        // retryThrottling alongside methodConfig.
        let p = RetryPolicy::from_grpc_service_config(
            r#"{"methodConfig": [], "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}"#,
        )
        .unwrap();
        assert!(matches!(
            p.budget,
            BudgetConfig::TokenBucket { max_tokens: 10, .. }
        ));
    }

    #[test]
    fn proto_durations() {
        assert_eq!(parse_proto_duration("0.02s"), Ok(Duration::from_millis(20)));
        assert_eq!(parse_proto_duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(
            parse_proto_duration("0.000000001s"),
            Ok(Duration::from_nanos(1))
        );
        for bad in ["", "s", ".s", "1", "-1s", "1.0000000001s", "1e3s", "1.5ms"] {
            assert!(parse_proto_duration(bad).is_err(), "{bad}");
        }
    }
}

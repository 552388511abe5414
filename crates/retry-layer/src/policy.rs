//! [`RetryPolicy`]: what is retried, how often, how long to wait, and within which budgets.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderName;
use reason_code::{ClientRule, Code, ReasonCodes, RetryTable, X_IDEMPOTENCY_KEY};
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
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) min_attempt_budget: Duration,
    pub(crate) total_timeout: Option<Duration>,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) max_pushback: Duration,
    pub(crate) max_replay_bytes: usize,
    pub(crate) max_unsent_retries: u32,
    pub(crate) table: RetryTable,
    pub(crate) reason_codes: ReasonCodes,
    pub(crate) idempotent_grpc: Arc<HashSet<String>>,
    pub(crate) key_headers: Arc<[HeaderName]>,
    pub(crate) ensure_key: bool,
    budget: BudgetConfig,
    pub(crate) rng: JitterRng,
    pub(crate) rebuild: Option<Arc<dyn Rebuild>>,
}

impl fmt::Debug for dyn Rebuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rebuild hook")
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            backoff: Backoff::default(),
            min_attempt_budget: Duration::from_millis(50),
            total_timeout: None,
            attempt_timeout: None,
            max_pushback: Duration::from_secs(30),
            max_replay_bytes: 64 * 1024,
            max_unsent_retries: 2,
            table: RetryTable::default(),
            reason_codes: ReasonCodes::default(),
            idempotent_grpc: Arc::default(),
            key_headers: Arc::new([X_IDEMPOTENCY_KEY, reason_code::IDEMPOTENCY_KEY]),
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

    /// A policy from a gRPC service config `retryPolicy` object (gRFC A6), for example
    /// `{"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
    /// "retryableStatusCodes": ["UNAVAILABLE"]}`. The object may also be wrapped as
    /// `{"retryPolicy": {..}, "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}`.
    ///
    /// As A6 specifies, `maxAttempts` above 5 is treated as 5 and the delay is full-jittered.
    /// Listed codes are retried under the table's rule for idempotent requests: declare the gRPC
    /// method idempotent, or use [`RetryPolicyBuilder::ensure_idempotency_key`], for writes.
    ///
    /// ```
    /// use retry_layer::RetryPolicy;
    ///
    /// let policy = RetryPolicy::from_grpc_service_config(r#"{
    ///     "maxAttempts": 4,
    ///     "initialBackoff": "0.02s",
    ///     "maxBackoff": "1s",
    ///     "backoffMultiplier": 2,
    ///     "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]
    /// }"#).unwrap();
    /// assert_eq!(policy.max_attempts(), 4);
    /// ```
    pub fn from_grpc_service_config(json: &str) -> Result<RetryPolicy, InvalidPolicy> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Wrapped {
            retry_policy: GrpcRetryPolicy,
            retry_throttling: Option<GrpcRetryThrottling>,
        }
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| InvalidPolicy::new(format!("service config is not JSON: {e}")))?;
        let (policy, throttling) = if value.get("retryPolicy").is_some() {
            let w: Wrapped = serde_json::from_value(value)
                .map_err(|e| InvalidPolicy::new(format!("service config: {e}")))?;
            (w.retry_policy, w.retry_throttling)
        } else {
            let p: GrpcRetryPolicy = serde_json::from_value(value)
                .map_err(|e| InvalidPolicy::new(format!("retryPolicy: {e}")))?;
            (p, None)
        };
        let mut builder = RetryPolicy::builder().grpc_retry_policy(&policy);
        if let Some(t) = throttling {
            builder = builder.grpc_retry_throttling(&t);
        }
        builder.build()
    }

    /// Total attempts, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff schedule.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// The retryability table.
    pub fn table(&self) -> &RetryTable {
        &self.table
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
        self.policy.max_attempts = n;
        self
    }

    /// The delay after the first failed attempt.
    pub fn base_delay(mut self, d: Duration) -> Self {
        self.policy.backoff.base = d;
        self
    }

    /// The factor the delay grows by per attempt (finite, at least 1.0).
    pub fn multiplier(mut self, m: f64) -> Self {
        if !m.is_finite() || m < 1.0 {
            return self.fail(format!(
                "multiplier must be a finite number >= 1.0, got {m}"
            ));
        }
        self.policy.backoff.multiplier = m;
        self
    }

    /// The largest computed delay (before jitter).
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.policy.backoff.max_delay = d;
        self
    }

    /// How delays are randomized.
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        if let Jitter::Proportional(r) = jitter {
            if !(0.0..=1.0).contains(&r) {
                return self.fail(format!("proportional jitter must be in [0, 1], got {r}"));
            }
        }
        self.policy.backoff.jitter = jitter;
        self
    }

    /// Seeds the jitter generator shared by all clones of the layer (deterministic delays, for
    /// tests and simulations).
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.policy.rng = JitterRng::seeded(seed);
        self
    }

    /// The least time an attempt must have left before the deadline for a retry to be sent.
    pub fn min_attempt_budget(mut self, d: Duration) -> Self {
        self.policy.min_attempt_budget = d;
        self
    }

    /// A deadline for the whole call, retries included, used when the request carries neither a
    /// [`Deadline`](crate::Deadline) extension nor `grpc-timeout`.
    pub fn total_timeout(mut self, d: Duration) -> Self {
        self.policy.total_timeout = Some(d);
        self
    }

    /// A timeout for each attempt; an attempt that times out is an ambiguous failure (it may have
    /// executed), retried only when the request is idempotent or keyed.
    pub fn attempt_timeout(mut self, d: Duration) -> Self {
        self.policy.attempt_timeout = Some(d);
        self
    }

    /// The longest server pushback (`Retry-After`, `grpc-retry-pushback-ms`) honoured; a longer
    /// one ends retrying.
    pub fn max_pushback(mut self, d: Duration) -> Self {
        self.policy.max_pushback = d;
        self
    }

    /// The most request-body bytes kept for replay; larger bodies are sent once.
    pub fn max_replay_bytes(mut self, n: usize) -> Self {
        self.policy.max_replay_bytes = n;
        self
    }

    /// How many extra attempts a request that provably never left the client may get beyond
    /// `max_attempts` (gRFC A6 transparent retries), still bounded by deadline and budget.
    pub fn max_unsent_retries(mut self, n: u32) -> Self {
        self.policy.max_unsent_retries = n;
        self
    }

    /// Replaces the retryability table (to opt in to retrying INTERNAL, for instance).
    pub fn table(mut self, table: RetryTable) -> Self {
        self.policy.table = table;
        self
    }

    /// Replaces the business reason-code table.
    pub fn reason_codes(mut self, reasons: ReasonCodes) -> Self {
        self.policy.reason_codes = reasons;
        self
    }

    /// Declares a gRPC method idempotent (`/package.Service/Method`), or a whole service
    /// (`/package.Service/`): its failures are retried like a PUT's.
    pub fn idempotent_grpc_method(mut self, path: impl Into<String>) -> Self {
        let path = path.into();
        if !path.starts_with('/') || path.matches('/').count() != 2 {
            return self.fail(format!(
                "gRPC method {path:?} must look like /package.Service/Method or /package.Service/"
            ));
        }
        Arc::make_mut(&mut self.policy.idempotent_grpc).insert(path);
        self
    }

    /// The header that carries idempotency keys (default `x-idempotency-key`; `idempotency-key`
    /// is always recognized too). [`ensure_idempotency_key`](Self::ensure_idempotency_key)
    /// writes this one.
    pub fn idempotency_key_header(mut self, name: HeaderName) -> Self {
        let others = [X_IDEMPOTENCY_KEY, reason_code::IDEMPOTENCY_KEY]
            .into_iter()
            .filter(|n| *n != name);
        let names: Vec<HeaderName> = std::iter::once(name.clone()).chain(others).collect();
        self.policy.key_headers = names.into();
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

    /// Applies a gRPC service config `retryPolicy` (gRFC A6).
    pub fn grpc_retry_policy(self, p: &GrpcRetryPolicy) -> Self {
        let (initial, max) = match (
            parse_proto_duration(&p.initial_backoff),
            parse_proto_duration(&p.max_backoff),
        ) {
            (Ok(i), Ok(m)) => (i, m),
            (Err(e), _) | (_, Err(e)) => return self.fail(e),
        };
        if initial.is_zero() || max.is_zero() {
            return self.fail("initialBackoff and maxBackoff must be greater than zero");
        }
        if p.max_attempts < 2 {
            return self.fail(format!(
                "maxAttempts must be at least 2, got {}",
                p.max_attempts
            ));
        }
        if p.retryable_status_codes.is_empty() {
            return self.fail("retryableStatusCodes must name at least one code");
        }
        let mut table = RetryTable::no_status_retries();
        for code in &p.retryable_status_codes {
            table = table.with_client_rule(code.0, ClientRule::IfIdempotent);
        }
        self.max_attempts(p.max_attempts.min(5))
            .base_delay(initial)
            .max_delay(max)
            .multiplier(p.backoff_multiplier)
            .jitter(Jitter::Full)
            .table(table)
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
        assert_eq!(p.max_attempts, 3);
        assert_eq!(p.backoff.base, Duration::from_millis(20));
        assert_eq!(p.backoff.multiplier, 2.0);
        assert_eq!(p.backoff.max_delay, Duration::from_secs(1));
        assert_eq!(p.backoff.jitter, Jitter::Proportional(0.2));
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
        assert_eq!(p.max_attempts, 5);
        assert_eq!(p.backoff.base, Duration::from_millis(500));
        assert_eq!(p.backoff.max_delay, Duration::from_millis(2250));
        assert_eq!(p.backoff.jitter, Jitter::Full);
        assert_eq!(
            p.table.verdict(Outcome::Status(Code::Unavailable), true),
            Verdict::Retry
        );
        assert_eq!(
            p.table
                .verdict(Outcome::Status(Code::DeadlineExceeded), true),
            Verdict::Retry
        );
        assert_eq!(
            p.table
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

//! [`RetryPolicyBuilder`]: every setting of a [`RetryPolicy`], each checked as it is set, and
//! [`InvalidPolicy`], the error that names the first one out of range.

use std::sync::Arc;
use std::time::Duration;

use reason_code::{GrpcMethods, KeyHeaders, ReasonCodes, RetryTable};

use super::hooks::{OnRetry, RetryCandidate, RetryEvent, RetryIf};
use super::rebuild::Rebuild;
use super::{InboundRetry, RetryPolicy, MAX_DURATION, MAX_UNSENT_RETRIES};
use crate::backoff::{Jitter, JitterRng};
use crate::budget::{BudgetChoice, InvalidBudget, RetryBudget};
use crate::derived_key::DerivedKeys;

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
}

/// A [`RetryPolicy`] or [`HedgePolicy`](crate::hedge::HedgePolicy) setting the builder refused:
/// [`kind`](Self::kind) says which sort of mistake, the message which setting and what is
/// allowed.
///
/// ```
/// use retry_layer::{InvalidPolicyKind, RetryPolicy};
///
/// let err = RetryPolicy::builder().max_attempts(0).build().unwrap_err();
/// assert_eq!(err.kind(), InvalidPolicyKind::OutOfRange);
/// assert!(err.to_string().contains("max_attempts"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {message}")]
pub struct InvalidPolicy {
    kind: InvalidPolicyKind,
    message: String,
}

/// The sort of mistake an [`InvalidPolicy`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InvalidPolicyKind {
    /// A number or a duration outside its range (the message names the setting and the range).
    OutOfRange,
    /// A gRPC method path of the wrong shape (not `/package.Service/Method` or
    /// `/package.Service/`).
    GrpcMethod,
    /// A retry budget's parameters.
    Budget,
    /// A gRPC service config (its JSON, a `retryPolicy`, `hedgingPolicy` or `retryThrottling`)
    /// that gRFC A6 rejects.
    ServiceConfig,
    /// Settings that cannot go together.
    Conflict,
}

impl InvalidPolicy {
    pub(crate) fn new(kind: InvalidPolicyKind, message: impl Into<String>) -> Self {
        InvalidPolicy {
            kind,
            message: message.into(),
        }
    }

    /// The sort of mistake.
    pub fn kind(&self) -> InvalidPolicyKind {
        self.kind
    }

    /// What was wrong and what is allowed (the error's message without its prefix).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<InvalidBudget> for InvalidPolicy {
    fn from(e: InvalidBudget) -> Self {
        InvalidPolicy::new(InvalidPolicyKind::Budget, e.to_string())
    }
}

/// Why a duration setting is out of range: over [`RetryPolicy::MAX_DURATION`], or zero where zero makes no
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

/// Builds a validated [`RetryPolicy`]. Setters consume and return the builder; [`build`]
/// reports the first invalid setting.
///
/// [`build`]: RetryPolicyBuilder::build
#[derive(Debug, Clone)]
pub struct RetryPolicyBuilder {
    pub(super) policy: RetryPolicy,
    error: Option<InvalidPolicy>,
}

impl RetryPolicyBuilder {
    /// Keeps the first refused setting (`build` returns it): out of range.
    pub(super) fn fail(self, message: impl Into<String>) -> Self {
        self.fail_with(InvalidPolicyKind::OutOfRange, message)
    }

    /// Keeps the first refused setting, of `kind`.
    pub(super) fn fail_with(mut self, kind: InvalidPolicyKind, message: impl Into<String>) -> Self {
        if self.error.is_none() {
            self.error = Some(InvalidPolicy::new(kind, message));
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

    /// The delay after the first failed attempt (at most [`RetryPolicy::MAX_DURATION`]).
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

    /// The largest computed delay (before jitter; at most [`RetryPolicy::MAX_DURATION`]).
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
    /// most [`RetryPolicy::MAX_DURATION`]).
    pub fn min_attempt_time(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("min_attempt_time", d, true) {
            return self.fail(e);
        }
        self.policy.min_attempt_time = d;
        self
    }

    /// A deadline for the whole call, retries included, used when the request carries neither a
    /// [`Deadline`](crate::Deadline) extension nor `grpc-timeout` (greater than zero, at most
    /// [`RetryPolicy::MAX_DURATION`]).
    pub fn total_timeout(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("total_timeout", d, false) {
            return self.fail(e);
        }
        self.policy.total_timeout = Some(d);
        self
    }

    /// A timeout for each attempt (greater than zero, at most [`RetryPolicy::MAX_DURATION`]); an attempt that
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

    /// How long each attempt waits for its response head (greater than zero, at most
    /// [`RetryPolicy::MAX_DURATION`]; default [`RetryPolicy::DEFAULT_RESPONSE_HEAD_TIMEOUT`], 60 s). It is always on, so
    /// that a call to a server that never answers ends even when nothing else bounds it: the
    /// attempt ends in [`ResponseHeadTimedOut`](crate::ResponseHeadTimedOut), an ambiguous
    /// failure (it may have executed), retried only when the request is idempotent or keyed.
    ///
    /// Unlike [`attempt_timeout`](Self::attempt_timeout) it is the client's own bound, never
    /// sent as `grpc-timeout`, and it ends with the head: a response that started in time
    /// streams for as long as it takes (a watch, a download). Raise it for endpoints that take
    /// longer to start answering.
    pub fn response_head_timeout(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("response_head_timeout", d, false) {
            return self.fail(e);
        }
        self.policy.response_head_timeout = d;
        self
    }

    /// The longest server pushback (`Retry-After`, `grpc-retry-pushback-ms`) honoured (at most
    /// [`RetryPolicy::MAX_DURATION`]); a longer one ends retrying.
    pub fn max_pushback(mut self, d: Duration) -> Self {
        if let Some(e) = duration_error("max_pushback", d, true) {
            return self.fail(e);
        }
        self.policy.max_pushback = d;
        self
    }

    /// The most request-body bytes kept for replay per request; larger bodies are sent once.
    pub fn max_replay_bytes(mut self, n: usize) -> Self {
        self.policy.max_replay_bytes = n;
        self
    }

    /// The most request-body bytes all calls of a layer (and its clones) keep for replay at
    /// once (default [`RetryPolicy::DEFAULT_MAX_REPLAY_BYTES_TOTAL`], 16 MiB; gRFC A6 bounds a channel's
    /// retry buffer the same way). A body whose copy does not fit is sent without one: its
    /// retries are refused as for a body over `max_replay_bytes`, even the retry of an attempt
    /// that was never sent once the layer has read any of the body (a streamed body none of
    /// which was read yet is still retried then). Every byte the layer keeps is counted here,
    /// none outside it. A copy is freed as soon as the call has its answer, even while the
    /// transport still streams the body (a client stream).
    /// [`RetryLayer::stats`](crate::RetryLayer::stats) reports the bytes kept now.
    pub fn max_replay_bytes_total(mut self, n: usize) -> Self {
        self.policy.max_replay_bytes_total = n;
        self
    }

    /// How many extra attempts a request that provably never left the client may get beyond
    /// `max_attempts` (gRFC A6 transparent retries), still bounded by deadline and budget (at
    /// most [`RetryPolicy::MAX_UNSENT_RETRIES`]).
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
    /// use retry_layer::{GrpcMethods, RetryPolicy};
    ///
    /// let reads = GrpcMethods::new([
    ///     "/plume.linkd.v3.Library/GetBook",
    ///     "/grpc.health.v1.Health/",
    /// ])
    /// .unwrap();
    /// let policy = RetryPolicy::builder().idempotent_grpc_methods(reads).build().unwrap();
    /// assert!(policy.idempotent_grpc().contains("/grpc.health.v1.Health/Check"));
    /// ```
    pub fn idempotent_grpc_methods(mut self, methods: GrpcMethods) -> Self {
        self.policy.idempotent_grpc = methods;
        self
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

    /// Gives a non-idempotent request without a key, made by a handler that `idempotency-layer`
    /// is executing, a key derived from that inbound write: a keyed hash (BLAKE3, keyed by
    /// `secret`) of the inbound write's scope (tenant, method, key) and the call's place in the
    /// handler (its [`KeyLabel`](crate::KeyLabel) if the caller gave one, else its method,
    /// authority and path and how many calls to that target the handler made before it).
    ///
    /// Each hop is effectively-once on its own; a chain is not: when a handler runs a second
    /// time (its leader crashed and another instance took its claim over, its claim lapsed, a
    /// failure released it), fresh keys would make the downstream service execute its writes
    /// again. With derived keys the second run sends the same keys in the same order, and the
    /// downstream replays. The parent key never leaves the service (only the hash does), and
    /// `secret` must be the same on every instance that can run the handler, or a takeover on
    /// another instance derives other keys.
    ///
    /// The one caveat: a handler whose outbound calls depend on timing or randomness (raced,
    /// picked at random, made only on a cache miss) must label them with
    /// [`KeyLabel`](crate::KeyLabel), or a second run may number them differently. Outside a
    /// handler (and for requests that carry a key) nothing changes; with
    /// [`ensure_idempotency_key`](Self::ensure_idempotency_key) too, writes outside a handler
    /// get a fresh key.
    ///
    /// ```
    /// use retry_layer::RetryPolicy;
    ///
    /// let secret = std::env::var("DERIVED_KEYS_SECRET").unwrap_or_else(|_| "dev only".into());
    /// let policy = RetryPolicy::builder()
    ///     .ensure_idempotency_key()
    ///     .derive_idempotency_keys(secret)
    ///     .build()
    ///     .unwrap();
    /// # let _ = policy;
    /// ```
    pub fn derive_idempotency_keys(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.policy.derived_keys = Some(DerivedKeys::new(secret.as_ref()));
        self
    }

    /// The retry budget each layer made from the policy gets (default
    /// [`RetryBudget::default`]: 10 % of requests over 10 s, plus 10 retries a second):
    /// [`RetryBudget::sliding_window`], [`RetryBudget::token_bucket`] (gRFC A6 throttling),
    /// [`RetryBudget::unlimited`] or [`RetryBudget::custom`].
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        match budget.0 {
            Ok(choice) => self.policy.budget = choice,
            Err(e) => return self.fail_with(InvalidPolicyKind::Budget, e.to_string()),
        }
        self
    }

    /// Keeps a budget per authority (`host:port` of the request's URI) instead of one for the
    /// whole layer: on a client shared by several hosts (a hyper-util `Client`, a reqwest
    /// `Client`), a dead host then drains only its own budget, and the healthy ones keep
    /// retrying. gRFC A6 throttles per channel, which is one authority. Each budget has the
    /// shape set by [`budget`](Self::budget); requests
    /// without an authority (a tonic `Channel` adds its own below the layer: one channel, one
    /// host) share the layer's. At most [`RetryPolicy::MAX_AUTHORITY_BUDGETS`] authorities get a budget of
    /// their own; the others share the layer's. Not with
    /// [`RetryBudget::custom`], which is shared as given.
    pub fn budget_per_authority(mut self) -> Self {
        self.policy.budget_per_authority = true;
        self
    }

    /// What a call made while serving a retry of the hop above does (default
    /// [`InboundRetry::SendOnce`]). It needs the server's hop in scope: [`hop::HopLayer`](crate::hop::HopLayer)
    /// on the server that makes the call.
    pub fn inbound_retry(mut self, inbound: InboundRetry) -> Self {
        if let InboundRetry::Budget {
            window,
            min_per_sec,
            ratio,
        } = inbound
        {
            if let Err(e) = BudgetChoice::tps(window, min_per_sec, ratio) {
                return self.fail_with(
                    InvalidPolicyKind::Budget,
                    format!("inbound_retry budget: {e}"),
                );
            }
        }
        self.policy.inbound_retry = inbound;
        self
    }

    /// Installs the hook that may rebuild a request after an ABORTED outcome (409,
    /// `STOCK_CONFLICT`). Without it such outcomes are returned as they are.
    pub fn rebuild_on_conflict(mut self, hook: impl Rebuild) -> Self {
        self.policy.rebuild = Some(Arc::new(hook));
        self
    }

    /// Asks `predicate` before each retry the table allows (a rebuild after a conflict
    /// included): `false` returns the attempt's answer instead. It can only decline: what is
    /// safe to retry stays the table's to say, so a write without a key is never resent whatever
    /// it answers. An attempt that provably never left is sent again without asking (the server
    /// never saw it). A predicate that panics declines; the panic is logged.
    ///
    /// Declined retries are counted in [`RetryStats::declined`](crate::RetryStats::declined).
    ///
    /// ```
    /// use retry_layer::reason_code::Code;
    /// use retry_layer::RetryPolicy;
    ///
    /// // This API answers 503 while it deploys: retry that, but not its quota errors.
    /// let policy = RetryPolicy::builder()
    ///     .retry_if(|c| c.code != Code::ResourceExhausted)
    ///     .build()
    ///     .unwrap();
    /// # let _ = policy;
    /// ```
    pub fn retry_if(
        mut self,
        predicate: impl Fn(&RetryCandidate<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.policy.retry_if = Some(RetryIf(Arc::new(predicate)));
        self
    }

    /// Calls `callback` before the layer waits for each retry (a transparent retry of an unsent
    /// attempt and a rebuild included), with the attempt that ended, its code and the delay: for
    /// logs or metrics of your own. It runs on the caller's task; keep it short. A callback that
    /// panics is logged and the retry goes on.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use retry_layer::RetryPolicy;
    ///
    /// let retries = Arc::new(AtomicU64::new(0));
    /// let seen = retries.clone();
    /// let policy = RetryPolicy::builder()
    ///     .on_retry(move |e| {
    ///         seen.fetch_add(1, Ordering::Relaxed);
    ///         tracing::info!(path = e.request.uri.path(), code = %e.code, delay = ?e.delay, "retrying");
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = policy;
    /// ```
    pub fn on_retry(mut self, callback: impl Fn(&RetryEvent<'_>) + Send + Sync + 'static) -> Self {
        self.policy.on_retry = Some(OnRetry(Arc::new(callback)));
        self
    }

    /// Validates and returns the policy.
    pub fn build(self) -> Result<RetryPolicy, InvalidPolicy> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.policy.budget_per_authority && matches!(self.policy.budget, BudgetChoice::Custom(_))
        {
            return Err(InvalidPolicy::new(
                InvalidPolicyKind::Conflict,
                "budget_per_authority needs a budget the layer makes (RetryBudget::sliding_window or \
                 token_bucket); \
                 a custom budget is shared as given",
            ));
        }
        Ok(self.policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let p = RetryPolicy::default();
        assert_eq!(p.rules.max_attempts, 3);
        assert_eq!(p.rules.backoff.base, Duration::from_millis(20));
        assert_eq!(p.rules.backoff.multiplier, 2.0);
        assert_eq!(p.rules.backoff.max_delay, Duration::from_secs(1));
        assert_eq!(p.rules.backoff.jitter, Jitter::Proportional(0.2));
        assert_eq!(p.min_attempt_time, Duration::from_millis(50));
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
            .budget(RetryBudget::sliding_window(Duration::ZERO, 1, 0.1))
            .build()
            .is_err());
        assert!(GrpcMethods::new(["GetBook"]).is_err());
    }

    /// Each refusal says its sort, for a caller that matches on it.
    #[test]
    fn a_refusal_says_its_kind() {
        let kind = |b: RetryPolicyBuilder| b.build().unwrap_err().kind();
        assert_eq!(
            kind(RetryPolicy::builder().max_attempts(0)),
            InvalidPolicyKind::OutOfRange
        );
        assert_eq!(
            kind(RetryPolicy::builder().max_delay(Duration::from_secs(86_401))),
            InvalidPolicyKind::OutOfRange
        );
        assert_eq!(
            kind(RetryPolicy::builder().budget(RetryBudget::sliding_window(
                Duration::ZERO,
                1,
                0.1
            ))),
            InvalidPolicyKind::Budget
        );
        #[derive(Debug)]
        struct Always;
        impl crate::budget::Budget for Always {
            fn deposit(&self) {}
            fn record(&self, _failed: bool) {}
            fn withdraw(&self) -> bool {
                true
            }
        }
        assert_eq!(
            kind(
                RetryPolicy::builder()
                    .budget(RetryBudget::custom(Arc::new(Always)))
                    .budget_per_authority()
            ),
            InvalidPolicyKind::Conflict
        );
        // The first refusal is the one reported.
        let err = RetryPolicy::builder()
            .max_attempts(0)
            .budget(RetryBudget::sliding_window(Duration::ZERO, 1, 0.1))
            .build()
            .unwrap_err();
        assert_eq!(err.kind(), InvalidPolicyKind::OutOfRange);
        assert!(err.message().contains("max_attempts"), "{err}");
    }
}

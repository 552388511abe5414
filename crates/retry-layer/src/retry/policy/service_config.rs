//! gRPC service config (gRFC A6): `methodConfig[].retryPolicy` and `retryThrottling`, loaded
//! into a [`RetryPolicy`].

use std::sync::Arc;
use std::time::Duration;

use reason_code::{ClientRule, Code, RetryTable};
use serde::Deserialize;

use super::{
    InvalidPolicy, InvalidPolicyKind, RetryPolicy, RetryPolicyBuilder, Rules, MAX_DURATION,
};
use crate::backoff::{Backoff, Jitter};

impl RetryPolicy {
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
        let value: serde_json::Value = serde_json::from_str(json).map_err(|e| {
            InvalidPolicy::new(
                InvalidPolicyKind::ServiceConfig,
                format!("service config is not JSON: {e}"),
            )
        })?;
        let is_bare_policy = value.get("maxAttempts").is_some();
        if is_bare_policy {
            let p: GrpcRetryPolicy = serde_json::from_value(value).map_err(|e| {
                InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    format!("retryPolicy: {e}"),
                )
            })?;
            return RetryPolicy::builder().grpc_retry_policy(&p).build();
        }
        let config: ServiceConfig = serde_json::from_value(value).map_err(|e| {
            InvalidPolicy::new(
                InvalidPolicyKind::ServiceConfig,
                format!("service config: {e}"),
            )
        })?;
        let mut builder = RetryPolicy::builder();
        match (&config.retry_policy, config.method_config.is_empty()) {
            (Some(p), true) => builder = builder.grpc_retry_policy(p),
            (Some(_), false) => {
                return Err(InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    "service config: a top-level retryPolicy and methodConfig together; \
                     move the retryPolicy into a methodConfig entry",
                ))
            }
            (None, true) if config.retry_throttling.is_none() => {
                return Err(InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    "service config: no methodConfig, retryPolicy or retryThrottling to load",
                ))
            }
            // gRPC: a request no method config matches is not retried.
            (None, _) => builder = builder.max_attempts(1),
        }
        for (i, mc) in config.method_config.iter().enumerate() {
            let rules = match &mc.retry_policy {
                Some(p) => rules_from_grpc(p).map_err(|e| {
                    InvalidPolicy::new(
                        InvalidPolicyKind::ServiceConfig,
                        format!("methodConfig[{i}].retryPolicy: {e}"),
                    )
                })?,
                None => Rules {
                    max_attempts: 1,
                    ..Rules::default()
                },
            };
            for name in method_config_names(i, &mc.name)? {
                builder = builder.grpc_method_rules(name, rules.clone());
            }
        }
        if let Some(t) = config.retry_throttling {
            builder = builder.grpc_retry_throttling(&t);
        }
        builder.build()
    }
}

/// One `name` entry of a gRPC service config's `methodConfig`.
#[derive(Deserialize)]
pub(crate) struct MethodName {
    #[serde(default)]
    service: String,
    #[serde(default)]
    method: String,
}

/// The method paths `methodConfig[i].name` matches: `/service/method`, `/service/` for a whole
/// service, `None` for every method (`{}`).
pub(crate) fn method_config_names(
    i: usize,
    names: &[MethodName],
) -> Result<Vec<Option<String>>, InvalidPolicy> {
    if names.is_empty() {
        return Err(InvalidPolicy::new(
            InvalidPolicyKind::ServiceConfig,
            format!("methodConfig[{i}] has no name; use [{{}}] to match every method"),
        ));
    }
    names
        .iter()
        .map(|n| {
            let name = match (n.service.as_str(), n.method.as_str()) {
                ("", "") => None,
                ("", m) => {
                    return Err(InvalidPolicy::new(
                        InvalidPolicyKind::ServiceConfig,
                        format!("methodConfig[{i}]: method {m:?} names no service"),
                    ))
                }
                (s, "") => Some(format!("/{s}/")),
                (s, m) => Some(format!("/{s}/{m}")),
            };
            if name.as_ref().is_some_and(|n| n.matches('/').count() != 2) {
                return Err(InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    format!(
                        "methodConfig[{i}]: {:?}/{:?} must not contain '/'",
                        n.service, n.method
                    ),
                ));
            }
            Ok(name)
        })
        .collect()
}

impl RetryPolicyBuilder {
    /// Applies a gRPC service config `retryPolicy` (gRFC A6) to every request.
    pub fn grpc_retry_policy(mut self, p: &GrpcRetryPolicy) -> Self {
        match rules_from_grpc(p) {
            Ok(rules) => {
                self.policy.rules = rules;
                self
            }
            Err(e) => self.fail_with(InvalidPolicyKind::ServiceConfig, e),
        }
    }

    /// Applies a gRPC service config `retryPolicy` (gRFC A6) to one method
    /// (`/package.Service/Method`) or every method of a service (`/package.Service/`); other
    /// requests keep the policy's own attempts, backoff and table.
    pub fn grpc_method_retry_policy(self, path: impl Into<String>, p: &GrpcRetryPolicy) -> Self {
        let path = path.into();
        if !path.starts_with('/') || path.matches('/').count() != 2 {
            return self.fail_with(
                InvalidPolicyKind::GrpcMethod,
                format!(
                "gRPC method {path:?} must look like /package.Service/Method or /package.Service/"
            ),
            );
        }
        match rules_from_grpc(p) {
            Ok(rules) => self.grpc_method_rules(Some(path), rules),
            Err(e) => self.fail_with(InvalidPolicyKind::ServiceConfig, e),
        }
    }

    fn grpc_method_rules(mut self, name: Option<String>, rules: Rules) -> Self {
        let methods = Arc::make_mut(self.policy.methods.get_or_insert_with(Arc::default));
        match methods.insert(name, rules) {
            Ok(()) => self,
            Err(e) => self.fail_with(InvalidPolicyKind::ServiceConfig, e),
        }
    }

    /// Applies a gRPC service config `retryThrottling` (gRFC A6): a token bucket budget.
    pub fn grpc_retry_throttling(self, t: &GrpcRetryThrottling) -> Self {
        self.budget(crate::budget::RetryBudget::token_bucket(
            t.max_tokens,
            t.token_ratio,
        ))
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
pub(crate) fn parse_proto_duration(s: &str) -> Result<Duration, String> {
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
    use crate::budget::BudgetChoice;
    use reason_code::{Outcome, Verdict};

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
            BudgetChoice::TokenBucket { max_tokens: 10, .. }
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

        // (config, what the message must say)
        for (bad, says) in [
            (policy(r#"{"method": "M"}"#, ""), "names no service"),
            (
                policy(
                    r#"{"service": "a.S", "method": "M"}, {"service": "a.S", "method": "M"}"#,
                    "",
                ),
                "named by two methodConfig entries",
            ),
            (
                policy(r#"{"service": "a/S", "method": "M"}"#, ""),
                "must not contain '/'",
            ),
            (
                policy(r#"{}"#, r#", {"name": [{}]}"#),
                "two methodConfig entries have an empty name",
            ),
            (
                r#"{"methodConfig": [{"retryPolicy": {}}]}"#.to_owned(),
                "service config:",
            ),
            (
                r#"{"methodConfig": [{"name": [{}]}], "retryPolicy": {"maxAttempts": 2,
               "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
               "retryableStatusCodes": [14]}}"#
                    .to_owned(),
                "move the retryPolicy into a methodConfig entry",
            ),
            (
                r#"{"loadBalancingConfig": []}"#.to_owned(),
                "no methodConfig, retryPolicy or retryThrottling",
            ),
        ] {
            let err = RetryPolicy::from_grpc_service_config(&bad).unwrap_err();
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }

        // retryThrottling alongside methodConfig.
        let p = RetryPolicy::from_grpc_service_config(
            r#"{"methodConfig": [], "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}}"#,
        )
        .unwrap();
        assert!(matches!(
            p.budget,
            BudgetChoice::TokenBucket { max_tokens: 10, .. }
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

//! The `hedgingPolicy` of a gRPC service config (gRFC A6), loaded into a [`HedgePolicy`].

use std::sync::Arc;
use std::time::Duration;

use reason_code::Code;
use serde::Deserialize;

use super::policy::{HedgePolicy, HedgeRules, MAX_HEDGED_ATTEMPTS};
use crate::budget::{BudgetChoice, TokenBucket};
use crate::retry::policy::service_config::{
    method_config_names, parse_proto_duration, MethodName, StatusCodeName,
};
use crate::retry::policy::{GrpcRetryThrottling, InvalidPolicy, InvalidPolicyKind, MethodConfigs};

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
            retry_throttling: Option<GrpcRetryThrottling>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct MethodConfig {
            #[serde(default)]
            name: Vec<MethodName>,
            hedging_policy: Option<GrpcHedgingPolicy>,
        }
        let config: ServiceConfig = serde_json::from_str(json).map_err(|e| {
            InvalidPolicy::new(
                InvalidPolicyKind::ServiceConfig,
                format!("service config: {e}"),
            )
        })?;
        let mut methods = MethodConfigs::default();
        for (i, mc) in config.method_config.iter().enumerate() {
            let Some(p) = &mc.hedging_policy else {
                continue;
            };
            let rules = rules_from_grpc(p).map_err(|e| {
                InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    format!("methodConfig[{i}].hedgingPolicy: {e}"),
                )
            })?;
            for name in method_config_names(i, &mc.name)? {
                methods.insert(name, rules.clone()).map_err(|e| {
                    InvalidPolicy::new(
                        InvalidPolicyKind::ServiceConfig,
                        format!("service config: {e}"),
                    )
                })?;
            }
        }
        let mut policy = HedgePolicy {
            methods: Some(Arc::new(methods)),
            ..HedgePolicy::default()
        };
        if let Some(t) = config.retry_throttling {
            TokenBucket::new(t.max_tokens, t.token_ratio).map_err(|e| {
                InvalidPolicy::new(
                    InvalidPolicyKind::ServiceConfig,
                    format!("retryThrottling: {e}"),
                )
            })?;
            policy.budget = BudgetChoice::TokenBucket {
                max_tokens: t.max_tokens,
                token_ratio: t.token_ratio,
            };
        }
        Ok(policy)
    }
}

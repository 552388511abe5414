//! The orders client: CreateOrder through `RetryLayer` with a stable idempotency key.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use retry_layer::{BoxError, ReplayBody, Retry, RetryInfo, RetryLayer, RetryPolicy};
use serde::Serialize;
use tower::ServiceExt;

/// The deadline of every call of [`OrdersClient::new`], retries included.
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);

/// How often an idle HTTP/2 connection is pinged, and how long a PING may go unanswered.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// One line of the client's output.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct OrderLine {
    /// The final HTTP status.
    pub status: u16,
    /// The order id the server returned (empty when it returned none).
    pub order_id: String,
    /// Attempts the request took.
    pub attempts: u32,
    /// The idempotency key every attempt carried.
    pub key: String,
}

/// The retrying HTTP client of the orders service.
#[derive(Debug, Clone)]
pub struct OrdersClient {
    svc: Retry<Client<HttpConnector, ReplayBody<Full<Bytes>>>>,
    layer: RetryLayer,
    base: String,
    tenant: String,
}

impl OrdersClient {
    /// A client of the service at `base` (`http://127.0.0.1:3000`) for `tenant`, with the
    /// default retry policy, `ensure_idempotency_key()`, and a deadline of
    /// [`CALL_DEADLINE`] for every call, retries included: a caller should always say how long
    /// it waits.
    pub fn new(base: impl Into<String>, tenant: impl Into<String>) -> Self {
        let policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .total_timeout(CALL_DEADLINE)
            .build()
            .expect("the default policy is valid");
        Self::with_policy(base, tenant, policy)
    }

    /// A client with another retry policy.
    pub fn with_policy(
        base: impl Into<String>,
        tenant: impl Into<String>,
        policy: RetryPolicy,
    ) -> Self {
        Self::build(base, tenant, policy, true)
    }

    /// A client that opens a new connection for every attempt (no keep-alive pool): for tests
    /// whose faults act per connection.
    pub fn without_keep_alive(
        base: impl Into<String>,
        tenant: impl Into<String>,
        policy: RetryPolicy,
    ) -> Self {
        Self::build(base, tenant, policy, false)
    }

    fn build(
        base: impl Into<String>,
        tenant: impl Into<String>,
        policy: RetryPolicy,
        keep_alive: bool,
    ) -> Self {
        let layer = RetryLayer::new(policy);
        let mut builder = Client::builder(TokioExecutor::new());
        // HTTP/2 keep-alive (for a server that speaks it): a connection whose peer went away
        // without a word is found by its missed PING and closed, and its calls fail (and are
        // retried) instead of waiting on it. RELIABILITY.md, F7.
        builder
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(Some(KEEP_ALIVE_INTERVAL))
            .http2_keep_alive_timeout(KEEP_ALIVE_TIMEOUT);
        if !keep_alive {
            builder.pool_max_idle_per_host(0);
        }
        let client = builder.build_http();
        OrdersClient {
            svc: tower::Layer::layer(&layer, client),
            layer,
            base: base.into().trim_end_matches('/').to_owned(),
            tenant: tenant.into(),
        }
    }

    /// The retry layer (for its counters).
    pub fn layer(&self) -> &RetryLayer {
        &self.layer
    }

    /// POST /orders. `key` fixes the idempotency key (to demonstrate duplicates); otherwise the
    /// retry layer generates one per call.
    pub async fn create_order(
        &self,
        book_id: &str,
        quantity: i64,
        key: Option<&str>,
    ) -> Result<OrderLine, BoxError> {
        let body = serde_json::json!({"book_id": book_id, "quantity": quantity}).to_string();
        let mut req = Request::post(format!("{}/orders", self.base))
            .header("content-type", "application/json")
            .header(crate::auth::TENANT_HEADER, &self.tenant);
        if let Some(key) = key {
            req = req.header("x-idempotency-key", key);
        }
        let req = req.body(Full::new(Bytes::from(body)))?;
        let res = self.svc.clone().oneshot(req).await?;
        let status = res.status();
        let attempts = RetryInfo::attempts_of(&res);
        let key = match (
            key,
            RetryInfo::of(&res).and_then(|i| i.idempotency_key.clone()),
        ) {
            (Some(k), _) => k.to_owned(),
            (None, Some(k)) => k.to_str().unwrap_or_default().to_owned(),
            (None, None) => String::new(),
        };
        let body = res.into_body().collect().await?.to_bytes();
        let order_id = if status == StatusCode::CREATED {
            serde_json::from_slice::<serde_json::Value>(&body)?
                .get("order_id")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned()
        } else {
            String::new()
        };
        Ok(OrderLine {
            status: status.as_u16(),
            order_id,
            attempts,
            key,
        })
    }

    /// GET /stats: how many times each side effect really executed.
    pub async fn stats(&self) -> Result<crate::inventory::Stats, BoxError> {
        let req = Request::get(format!("{}/stats", self.base)).body(Full::new(Bytes::new()))?;
        let res = self.svc.clone().oneshot(req).await?;
        let body = res.into_body().collect().await?.to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body)?;
        Ok(crate::inventory::Stats {
            orders_created: v["orders_created"].as_i64().unwrap_or(-1),
            deductions: v["deductions"].as_i64().unwrap_or(-1),
        })
    }
}

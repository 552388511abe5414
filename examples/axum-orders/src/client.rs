//! The orders client: CreateOrder through `RetryLayer` with a stable idempotency key.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use reason_code::BoxError;
use retry_layer::{Conflict, Rebuild, ReplayBody, Retry, RetryInfo, RetryLayer, RetryPolicy};
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

/// One line of the client's output for a deduction.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DeductLine {
    /// The final HTTP status.
    pub status: u16,
    /// Copies left after the deduction (-1 when it failed).
    pub remaining: i64,
    /// The book's version after the deduction (0 when it failed).
    pub version: u64,
    /// Attempts the request took (a rebuild after `STOCK_CONFLICT` is one).
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
    /// default retry policy, `ensure_idempotency_key()`, a deadline of [`CALL_DEADLINE`] for
    /// every call, retries included (a caller should always say how long it waits), and
    /// [`rebuild_deduction`] as its rebuild hook.
    pub fn new(base: impl Into<String>, tenant: impl Into<String>) -> Self {
        let policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .total_timeout(CALL_DEADLINE)
            .rebuild_on_conflict(rebuild_deduction())
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
        // retried) instead of waiting on it. (A request hyper strands on a connection that
        // ends as it is sent, RELIABILITY.md "A request hyper's client strands", is ended by the call's deadline instead.)
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
        let key = call_key(key, RetryInfo::of(&res));
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

    /// POST /books/{book}/deduct, computed from `expected_version` (the version of the book the
    /// caller read; `None` reads it first). The deduction names that version, so a book that
    /// changed meanwhile answers 409 `STOCK_CONFLICT`; the policy's [`rebuild_deduction`] hook
    /// then re-reads the book and sends the deduction again from its current version, under
    /// the same key. `key` fixes the idempotency key; otherwise the retry layer generates one.
    pub async fn deduct(
        &self,
        book_id: &str,
        quantity: i64,
        expected_version: Option<u64>,
        key: Option<&str>,
    ) -> Result<DeductLine, BoxError> {
        let expected_version = match expected_version {
            Some(v) => v,
            None => self.book(book_id).await?.version,
        };
        let body = serde_json::json!({"quantity": quantity, "expected_version": expected_version});
        let mut req = Request::post(format!("{}/books/{book_id}/deduct", self.base))
            .header("content-type", "application/json")
            .header(crate::auth::TENANT_HEADER, &self.tenant);
        if let Some(key) = key {
            req = req.header("x-idempotency-key", key);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string())))?;
        let res = self.svc.clone().oneshot(req).await?;
        let status = res.status();
        let attempts = RetryInfo::attempts_of(&res);
        let key = call_key(key, RetryInfo::of(&res));
        let body = res.into_body().collect().await?.to_bytes();
        let (remaining, version) = if status.is_success() {
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            (
                v["remaining"].as_i64().unwrap_or(-1),
                v["version"].as_u64().unwrap_or(0),
            )
        } else {
            (-1, 0)
        };
        Ok(DeductLine {
            status: status.as_u16(),
            remaining,
            version,
            attempts,
            key,
        })
    }

    /// GET /books/{book}, through the retry layer (a read retries on its own).
    pub async fn book(&self, book_id: &str) -> Result<crate::inventory::Book, BoxError> {
        let req = Request::get(format!("{}/books/{book_id}", self.base))
            .header(crate::auth::TENANT_HEADER, &self.tenant)
            .body(Full::new(Bytes::new()))?;
        let res = self.svc.clone().oneshot(req).await?;
        let status = res.status();
        let body = res.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            return Err(format!("GET /books/{book_id}: {status}").into());
        }
        Ok(serde_json::from_slice(&body)?)
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

/// The key a call carried: the one given, else the one the retry layer generated.
fn call_key(given: Option<&str>, info: Option<&RetryInfo>) -> String {
    match (given, info.and_then(|i| i.idempotency_key.as_ref())) {
        (Some(k), _) => k.to_owned(),
        (None, Some(k)) => k.to_str().unwrap_or_default().to_owned(),
        (None, None) => String::new(),
    }
}

/// The orders client's rebuild hook, the rule for `STOCK_CONFLICT`: never send the
/// conflicting write as it was; re-read what changed, rebuild the write from it, and send that.
///
/// For a deduction (`POST /books/{id}/deduct`) refused because the book changed since the
/// version it names, the hook reads the book again (one plain GET, not retried: if it fails,
/// the conflict is the answer) and rebuilds the deduction with the book's current version, the
/// same quantity, headers and idempotency key (a conflict is not recorded, so the key is free).
/// It declines (the caller gets the 409) for any other request, or when the book no longer has
/// the stock: that is a decision for the caller, not for a retry.
pub fn rebuild_deduction() -> impl Rebuild {
    let reader: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    move |conflict: Conflict| {
        let reader = reader.clone();
        async move {
            let (parts, body) = conflict.request.into_parts();
            let book_id = parts
                .uri
                .path()
                .strip_prefix("/books/")?
                .strip_suffix("/deduct")?
                .to_owned();
            let mut write: serde_json::Value = serde_json::from_slice(&body).ok()?;
            let quantity = write["quantity"].as_i64()?;
            let mut read = Request::get(format!(
                "{}://{}/books/{book_id}",
                parts.uri.scheme_str()?,
                parts.uri.authority()?
            ));
            if let Some(tenant) = parts.headers.get(crate::auth::TENANT_HEADER) {
                read = read.header(crate::auth::TENANT_HEADER, tenant);
            }
            let res = reader
                .request(read.body(Full::default()).ok()?)
                .await
                .ok()?;
            if !res.status().is_success() {
                return None;
            }
            let book: crate::inventory::Book =
                serde_json::from_slice(&res.into_body().collect().await.ok()?.to_bytes()).ok()?;
            if book.stock < quantity {
                tracing::info!(book = %book_id, stock = book.stock, quantity, "not rebuilding the deduction: not enough stock left");
                return None;
            }
            tracing::info!(book = %book_id, version = book.version, "STOCK_CONFLICT: rebuilding the deduction from the book's current version");
            write["expected_version"] = book.version.into();
            let body = Bytes::from(write.to_string());
            let mut rebuilt = Request::from_parts(parts, body);
            rebuilt.headers_mut().remove(http::header::CONTENT_LENGTH);
            Some(rebuilt)
        }
    }
}

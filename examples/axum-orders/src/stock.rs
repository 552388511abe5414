//! Where an order's stock is taken from: this server's own [`Inventory`], or the inventory of
//! another `orders-server` over HTTP (`orders-server --inventory-url`), which makes the two a
//! chain: `client -> orders -> inventory`.
//!
//! # Effectively-once across the chain
//!
//! The order handler runs under `IdempotencyLayer`, and so does the inventory's
//! `POST /books/{id}/deduct`. Each hop is effectively-once on its own; the chain is not, unless
//! a second run of the order handler (its server crashed after the deduction and another
//! instance took the claim over, or the order failed after it and was retried) sends its
//! deduction under the same key as the first run. [`InventoryClient`] calls the inventory
//! through a `RetryLayer` whose policy derives the key of each deduction from the order being
//! executed ([`RetryPolicyBuilder::derive_idempotency_keys`]): the second run's deduction is
//! answered with the recorded one, and the stock is taken once per order. With fresh keys
//! (`--no-derived-keys`) every run deducts again.
//!
//! The secret (`--derived-keys-secret`, or `DERIVED_KEYS_SECRET`) must be the same on every
//! instance of the orders service, or a takeover on another instance derives other keys. The
//! deduction is labelled ([`KeyLabel`]) `deduct-stock`, so its key does not depend on the
//! inventory's URL either: instances that reach the inventory through different addresses
//! derive the same keys. The order handler makes its one deduction the same way on every run;
//! a handler whose outbound calls depend on timing or randomness would label each of them.
//!
//! ```text
//! orders-server --listen 127.0.0.1:3001                                   # the inventory
//! DERIVED_KEYS_SECRET=s3cret orders-server --inventory-url http://127.0.0.1:3001
//! ```
//!
//! [`RetryPolicyBuilder::derive_idempotency_keys`]: retry_layer::RetryPolicyBuilder::derive_idempotency_keys

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use retry_layer::{KeyLabel, ReplayBody, Retry, RetryLayer, RetryPolicy};
use serde_json::json;
use tower::ServiceExt;

use crate::auth::TENANT_HEADER;
use crate::inventory::{Deducted, Inventory, InventoryError, Order};

/// The deadline of one deduction on the inventory service, retries included.
pub const DEDUCT_DEADLINE: Duration = Duration::from_secs(5);

/// The [`KeyLabel`] of the order handler's deduction: its derived key names the call by this
/// label, not by the inventory's URL.
pub const DEDUCT_LABEL: &str = "deduct-stock";

/// Where an order's stock is taken from.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum Stock {
    /// This server's own [`Inventory`].
    #[default]
    Local,
    /// Another orders-server's inventory (`--inventory-url`).
    Remote(Box<InventoryClient>),
}

impl Stock {
    /// Takes `quantity` copies of `book_id` for an order of `tenant` made by a request with
    /// idempotency key `order_key`, and makes the order (not yet counted as created: the caller
    /// [`confirm`](Inventory::confirm)s it once stored, or [`cancel`](Self::cancel)s it).
    pub async fn reserve(
        &self,
        inventory: &Inventory,
        tenant: &str,
        order_key: Option<&str>,
        book_id: &str,
        quantity: i64,
    ) -> Result<Order, InventoryError> {
        match self {
            Stock::Local => inventory.reserve(book_id, quantity).await,
            Stock::Remote(client) => {
                client.deduct(tenant, order_key, book_id, quantity).await?;
                Ok(Order {
                    order_id: uuid::Uuid::new_v4().to_string(),
                    book_id: book_id.to_owned(),
                    quantity: quantity as i32,
                })
            }
        }
    }

    /// Undoes a [`reserve`](Self::reserve) whose order was not stored. Local stock is put
    /// back. A remote deduction stays: the order was not recorded, so its client retries it, and
    /// with derived keys the retry's deduction is answered with this one (nothing is taken
    /// twice); with fresh keys the retry deducts again.
    pub fn cancel(&self, inventory: &Inventory, order: &Order) {
        match self {
            Stock::Local => inventory.cancel(order),
            Stock::Remote(_) => {}
        }
    }
}

/// A client of another orders-server's inventory: `POST /books/{id}/deduct` through a
/// `RetryLayer` with `ensure_idempotency_key()` and, unless built without a secret, derived keys
/// (see the [module docs](self)). Cheap to clone.
#[derive(Debug, Clone)]
pub struct InventoryClient {
    svc: Retry<Client<HttpConnector, ReplayBody<Full<Bytes>>>>,
    base: String,
}

impl InventoryClient {
    /// A client of the inventory at `base` (`http://127.0.0.1:3001`). With a `secret`, each
    /// deduction made by a handler that `IdempotencyLayer` is executing gets a key derived
    /// from that handler's request; without one (`--no-derived-keys`), a fresh key per call.
    pub fn new(base: impl Into<String>, secret: Option<&str>) -> Self {
        let mut policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .total_timeout(DEDUCT_DEADLINE);
        if let Some(secret) = secret {
            policy = policy.derive_idempotency_keys(secret);
        }
        let policy = policy.build().expect("the policy is valid");
        let client = Client::builder(TokioExecutor::new()).build_http();
        InventoryClient {
            svc: tower::Layer::layer(&RetryLayer::new(policy), client),
            base: base.into().trim_end_matches('/').to_owned(),
        }
    }

    /// Deducts `quantity` copies of `book_id` for `tenant` (forwarded as `x-tenant-id`: the
    /// inventory scopes the key per tenant too). `order_ref`, the key of the order the deduction
    /// is for, goes in the body (`order_ref`) and is kept with the inventory's record of the
    /// deduction. A refusal (no such book, not enough stock, a bad quantity) is passed on;
    /// anything else the inventory or the network did is [`InventoryError::Unavailable`].
    pub async fn deduct(
        &self,
        tenant: &str,
        order_ref: Option<&str>,
        book_id: &str,
        quantity: i64,
    ) -> Result<Deducted, InventoryError> {
        let body = json!({"quantity": quantity, "order_ref": order_ref}).to_string();
        let mut req = Request::post(format!("{}/books/{book_id}/deduct", self.base))
            .header("content-type", "application/json")
            .header(TENANT_HEADER, tenant)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| InventoryError::Unavailable(e.to_string()))?;
        req.extensions_mut().insert(KeyLabel::new(DEDUCT_LABEL));
        let unavailable = |e: &dyn std::fmt::Display| {
            InventoryError::Unavailable(format!("the inventory service at {}: {e}", self.base))
        };
        let res = self
            .svc
            .clone()
            .oneshot(req)
            .await
            .map_err(|e| unavailable(&e))?;
        let status = res.status();
        let body = match res.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => return Err(unavailable(&e)),
        };
        let answer: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let detail = || answer["detail"].as_str().unwrap_or_default().to_owned();
        match status {
            StatusCode::OK => Ok(Deducted {
                remaining: answer["remaining"].as_i64().unwrap_or(-1),
                version: answer["version"].as_u64().unwrap_or(0),
            }),
            StatusCode::NOT_FOUND => Err(InventoryError::NoSuchBook(book_id.to_owned())),
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => {
                Err(InventoryError::Refused {
                    status: status.as_u16(),
                    detail: detail(),
                })
            }
            other => Err(unavailable(&format!("HTTP {other} {}", detail()))),
        }
    }
}

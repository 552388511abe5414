//! A reqwest client with `RetryMiddleware`, through the fault proxy, against the orders example
//! with `IdempotencyLayer`: every order runs exactly once, as it does with the tower layer
//! (`http.rs`), though responses are dropped and attempts answered 503.

use std::collections::HashSet;
use std::time::Duration;

use axum_orders::auth::TENANT_HEADER;
use axum_orders::inventory::Inventory;
use e2e::scenario::fault_tolerant_policy;
use e2e::servers::start_orders;
use futures_util::stream::{self, StreamExt};
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retry_layer::reqwest::RetryMiddleware;
use retry_layer::RetryInfo;
use test_support::faults::Unavailable;
use test_support::proxy::{drop_with_probability, Protocol, Proxy};

const ORDERS: usize = 100;

/// What became of one order: status, order id, attempts, the key and the body it went out with.
type Placed = (u16, String, u32, String, String);

async fn place(client: &ClientWithMiddleware, base: &str, i: usize) -> Placed {
    let body = serde_json::json!({"book_id": format!("b{}", i % 5 + 1), "quantity": 1});
    let res = client
        .post(format!("{base}/orders"))
        .header(TENANT_HEADER, "tenant-r")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("order {i} did not get through: {e}"));
    let status = res.status().as_u16();
    let info = res.extensions().get::<RetryInfo>().cloned();
    let attempts = info.as_ref().map_or(1, |i| i.attempts);
    let key = info
        .and_then(|i| i.idempotency_key)
        .map(|k| k.to_str().unwrap().to_owned())
        .expect("every write got a generated key");
    let json: serde_json::Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    let order_id = json["order_id"].as_str().unwrap_or_default().to_owned();
    (status, order_id, attempts, key, body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_from_reqwest_executes_exactly_once_through_drops_and_503s() {
    let inventory = Inventory::seeded(Duration::ZERO);
    let faults = Unavailable::first_attempts(0.10, 5);
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let server = start_orders(inventory.clone(), Some(layer), faults.clone()).await;
    let proxy = Proxy::start(vec![server], Protocol::Http1, drop_with_probability(0.2, 3)).await;
    let middleware = RetryMiddleware::new(fault_tolerant_policy());
    let client = ClientBuilder::new(
        // A fresh connection per request, so that a dropped connection costs one request.
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap(),
    )
    .with(middleware.clone())
    .build();
    let base = format!("http://{}", proxy.addr);

    let placed: Vec<_> = stream::iter(0..ORDERS)
        .map(|i| {
            let (client, base) = (client.clone(), base.clone());
            async move { place(&client, &base, i).await }
        })
        .buffer_unordered(16)
        .collect()
        .await;

    assert!(placed.iter().all(|p| p.0 == 201), "every order succeeds");
    assert_eq!(
        inventory.stats().orders_created,
        ORDERS as i64,
        "exactly one execution per order"
    );
    let ids: HashSet<_> = placed.iter().map(|p| p.1.clone()).collect();
    assert_eq!(ids.len(), ORDERS, "one distinct order id per key");
    assert!(proxy.dropped() >= 5, "{} drops", proxy.dropped());
    assert!(faults.injected() >= 3, "{} 503s", faults.injected());
    assert!(placed.iter().any(|p| p.2 > 1), "some orders took retries");
    assert!(middleware.stats().retries >= 8, "{:?}", middleware.stats());

    // Each key still answers with the order id its client saw.
    let direct = ClientBuilder::new(reqwest::Client::new()).build();
    for (_, order_id, _, key, body) in placed.iter().take(20) {
        let res = direct
            .post(format!("http://{server}/orders"))
            .header(TENANT_HEADER, "tenant-r")
            .header("content-type", "application/json")
            .header("x-idempotency-key", key)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let json: serde_json::Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(json["order_id"].as_str().unwrap(), order_id, "key {key}");
    }
    assert_eq!(inventory.stats().orders_created, ORDERS as i64);
}

//! gRPC end to end: a tonic Channel through RetryLayer -> fault proxy (HTTP/2, drops responses
//! after the server executed) -> the Library service with IdempotencyLayer.

use std::collections::HashSet;
use std::time::Duration;

use axum_orders::inventory::Inventory;
use e2e::servers::start_library;
use futures_util::stream::{self, StreamExt};
use idempotency_layer::MemoryStore;
use retry_layer::{RetryInfo, RetryPolicy};
use test_support::faults::Unavailable;
use test_support::proxy::{drop_with_probability, Protocol, Proxy};
use tonic_library::client::connect_lazy;
use tonic_library::{idempotency, pb, IDEMPOTENT_METHODS};

const ORDERS: usize = 200;

fn policy() -> RetryPolicy {
    let mut b = RetryPolicy::builder()
        .ensure_idempotency_key()
        .max_attempts(10)
        .base_delay(Duration::from_millis(2))
        .max_delay(Duration::from_millis(50))
        .budget(retry_layer::budget::RetryBudget::sliding_window(
            Duration::from_secs(10),
            1_000,
            1.0,
        ));
    b = b.idempotent_grpc_methods(retry_layer::GrpcMethods::new(IDEMPOTENT_METHODS).unwrap());
    b.build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_grpc_order_executes_exactly_once_through_dropped_responses_and_unavailable() {
    let inventory = Inventory::seeded(Duration::ZERO);
    let faults = Unavailable::first_attempts(0.10, 3);
    let server = start_library(
        inventory.clone(),
        idempotency(MemoryStore::new()),
        faults.clone(),
    )
    .await;
    let proxy = Proxy::start(
        vec![server],
        Protocol::Http2,
        drop_with_probability(0.05, 5),
    )
    .await;
    let (client, layer) = connect_lazy(&format!("http://{}", proxy.addr), policy()).unwrap();

    let results: Vec<(String, String, u32)> = stream::iter(0..ORDERS)
        .map(|i| {
            let mut client = client.clone();
            async move {
                let msg = pb::CreateOrderRequest {
                    book_id: format!("b{}", i % 5 + 1),
                    quantity: 1,
                };
                let res = client
                    .create_order(msg)
                    .await
                    .expect("the order gets through");
                let info = res
                    .extensions()
                    .get::<RetryInfo>()
                    .cloned()
                    .expect("a generated key");
                let key = info.idempotency_key.unwrap().to_str().unwrap().to_owned();
                (key, res.into_inner().order_id, info.attempts)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;

    assert_eq!(
        inventory.stats().orders_created,
        ORDERS as i64,
        "exactly one execution per order"
    );
    let ids: HashSet<_> = results.iter().map(|(_, id, _)| id.clone()).collect();
    assert_eq!(ids.len(), ORDERS, "one distinct order id per key");
    let keys: HashSet<_> = results.iter().map(|(k, _, _)| k.clone()).collect();
    assert_eq!(keys.len(), ORDERS);
    assert!(
        proxy.dropped() >= 3,
        "connections were dropped: {}",
        proxy.dropped()
    );
    assert!(
        faults.injected() >= 5,
        "UNAVAILABLE was injected: {}",
        faults.injected()
    );
    assert!(results.iter().any(|(_, _, attempts)| *attempts > 1));
    assert!(layer.stats().retries > 0);

    // GetStats is a declared-idempotent read: it passes the idempotency layer without a key.
    let stats = client
        .clone()
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.orders_created, ORDERS as i64);
}

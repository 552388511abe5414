//! HTTP end to end: RetryLayer -> fault proxy -> orders service with IdempotencyLayer.

use std::collections::HashSet;
use std::time::Duration;

use axum_orders::client::{OrderLine, OrdersClient};
use axum_orders::inventory::Inventory;
use e2e::scenario::{fault_tolerant_policy as policy, place_orders};
use e2e::servers::start_orders;
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use test_support::faults::Unavailable;
use test_support::proxy::{drop_with_probability, Protocol, Proxy};

const ORDERS: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_executes_exactly_once_through_dropped_responses_and_503s() {
    let inventory = Inventory::seeded(Duration::ZERO);
    let faults = Unavailable::first_attempts(0.10, 7);
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let server = start_orders(inventory.clone(), Some(layer), faults.clone()).await;
    let proxy = Proxy::start(
        vec![server],
        Protocol::Http1,
        drop_with_probability(0.2, 11),
    )
    .await;
    let client =
        OrdersClient::without_keep_alive(format!("http://{}", proxy.addr), "tenant-a", policy());

    let placed = place_orders(&client, ORDERS).await;
    let lines: Vec<&OrderLine> = placed.iter().map(|(_, l)| l).collect();

    assert!(
        lines.iter().all(|l| l.status == 201),
        "every order succeeds at the client"
    );
    assert_eq!(
        inventory.stats().orders_created,
        ORDERS as i64,
        "exactly one execution per order"
    );
    let ids: HashSet<_> = lines.iter().map(|l| l.order_id.clone()).collect();
    assert_eq!(ids.len(), ORDERS, "one distinct order id per key");
    assert!(
        proxy.dropped() >= 10,
        "faults were injected: {} drops",
        proxy.dropped()
    );
    assert!(
        faults.injected() >= 5,
        "faults were injected: {} 503s",
        faults.injected()
    );
    assert!(lines.iter().any(|l| l.attempts > 1));

    // Each key still answers with the order id its client saw: one order id per key.
    let direct = OrdersClient::new(format!("http://{server}"), "tenant-a");
    for (book, line) in placed.iter().take(50) {
        let again = direct.create_order(book, 1, Some(&line.key)).await.unwrap();
        assert_eq!(again.status, 201);
        assert_eq!(again.order_id, line.order_id, "key {}", line.key);
    }
    assert_eq!(inventory.stats().orders_created, ORDERS as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_idempotency_layer_the_same_faults_create_duplicates() {
    let inventory = Inventory::seeded(Duration::ZERO);
    let faults = Unavailable::first_attempts(0.10, 7);
    let server = start_orders::<MemoryStore>(inventory.clone(), None, faults).await;
    let proxy = Proxy::start(
        vec![server],
        Protocol::Http1,
        drop_with_probability(0.2, 11),
    )
    .await;
    let client =
        OrdersClient::without_keep_alive(format!("http://{}", proxy.addr), "tenant-a", policy());

    let placed = place_orders(&client, ORDERS).await;

    assert!(placed.iter().all(|(_, l)| l.status == 201));
    let executed = inventory.stats().orders_created;
    assert!(
        executed > ORDERS as i64,
        "the test detects duplicates: {executed} executions for {ORDERS} orders ({} drops)",
        proxy.dropped()
    );
}

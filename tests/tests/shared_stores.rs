//! HTTP end to end against the shared stores: two server instances (separate listeners and
//! store clients) behind the fault proxy, round-robin, sharing one Redis or one PostgreSQL.
//! Skipped (with a message) when `REDIS_URL` / `DATABASE_URL` is unset; a failure when set and
//! unreachable.

use std::collections::HashSet;
use std::time::Duration;

use axum_orders::client::OrdersClient;
use axum_orders::inventory::Inventory;
use e2e::scenario::{env_url, fault_tolerant_policy, place_orders};
use e2e::servers::start_orders;
use idempotency_layer::{IdempotencyLayer, IdempotencyStore, PostgresStore, RedisStore};
use test_support::faults::Unavailable;
use test_support::proxy::{drop_with_probability, Protocol, Proxy};

const ORDERS: usize = 200;

/// Generous: a shared 2-core CI box under load can be slow without anything being wrong, and
/// these tests are about exactly-once, not latency.
const STORE_TIMEOUT: Duration = Duration::from_secs(10);

async fn two_instances<St: IdempotencyStore>(a: St, b: St) {
    let inventory = Inventory::seeded(Duration::ZERO);
    let faults = Unavailable::first_attempts(0.10, 21);
    let one = start_orders(
        inventory.clone(),
        Some(IdempotencyLayer::new(a)),
        faults.clone(),
    )
    .await;
    let two = start_orders(
        inventory.clone(),
        Some(IdempotencyLayer::new(b)),
        faults.clone(),
    )
    .await;
    let proxy = Proxy::start(
        vec![one, two],
        Protocol::Http1,
        drop_with_probability(0.2, 23),
    )
    .await;
    let client = OrdersClient::without_keep_alive(
        format!("http://{}", proxy.addr),
        "tenant-a",
        fault_tolerant_policy(),
    );

    let placed = place_orders(&client, ORDERS).await;

    assert!(placed.iter().all(|(_, l)| l.status == 201));
    assert_eq!(
        inventory.stats().orders_created,
        ORDERS as i64,
        "exactly one execution per order"
    );
    let ids: HashSet<_> = placed.iter().map(|(_, l)| l.order_id.clone()).collect();
    assert_eq!(ids.len(), ORDERS);
    assert!(proxy.dropped() >= 10, "{} drops", proxy.dropped());
    assert!(faults.injected() >= 5, "{} injected", faults.injected());

    // Each instance answers every key with the same order id: the record is shared.
    for (i, (book, line)) in placed.iter().take(40).enumerate() {
        let direct = if i % 2 == 0 { one } else { two };
        let again = OrdersClient::new(format!("http://{direct}"), "tenant-a")
            .create_order(book, 1, Some(&line.key))
            .await
            .unwrap();
        assert_eq!(again.order_id, line.order_id);
    }
    assert_eq!(inventory.stats().orders_created, ORDERS as i64);
}

/// A name no other test run uses, so tests can run in parallel on one server.
fn unique(prefix: &str) -> String {
    format!("{prefix}{:016x}", fastrand::u64(..))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_instances_execute_each_order_once() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let prefix = unique("e2e:");
    let connect = || async {
        RedisStore::builder(url.clone())
            .prefix(prefix.clone())
            .timeout(STORE_TIMEOUT)
            .connect()
            .await
            .expect("REDIS_URL is set: the Redis server must be reachable")
    };
    let (a, b) = (connect().await, connect().await);
    two_instances(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_instances_execute_each_order_once() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let table = unique("e2e_");
    let connect = || async {
        let store = PostgresStore::builder(url.clone())
            .table(table.clone())
            .timeout(STORE_TIMEOUT)
            .connect()
            .await
            .expect("DATABASE_URL is set: the PostgreSQL server must be reachable");
        store.migrate().await.expect("migrate");
        store
    };
    let (a, b) = (connect().await, connect().await);
    two_instances(a, b).await;
}

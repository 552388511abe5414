//! `PostgresStore` against a real PostgreSQL (`DATABASE_URL`, e.g.
//! postgres://postgres@127.0.0.1:5432/test): the store conformance suite, two instances
//! sharing one database, lease takeover, an outage through a proxy, a corrupt row, and the
//! batched cleanup of expired rows. Each test works in a schema of its own. Unset
//! `DATABASE_URL`: each test says so and passes; set but unreachable: each test fails.

mod shared_stores;

use std::time::Duration;

use idempotency_layer::store::{Begin, Fingerprint};
use idempotency_layer::{conformance, IdempotencyStore, PostgresStore, PostgresStoreBuilder};
use shared_stores::*;

/// A builder on `url` in a schema of its own (returned, to drop it at the end).
fn builder(url: &str) -> (PostgresStoreBuilder, String) {
    let schema = unique("idem_test_");
    (PostgresStore::builder(url).schema(&schema), schema)
}

async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("raw connection to DATABASE_URL");
    tokio::spawn(conn);
    client
}

async fn drop_schema(url: &str, schema: &str) {
    raw(url)
        .await
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

async fn connect(b: PostgresStoreBuilder) -> PostgresStore {
    let store = b
        .connect()
        .await
        .expect("DATABASE_URL is set, so PostgreSQL must be reachable");
    store.migrate().await.expect("migrate");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b).await;
    // Migrating twice is harmless.
    store.migrate().await.unwrap();
    // Every check uses scopes of its own, so one table serves them all.
    conformance::run_all(|| store.clone()).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_execute_each_key_once() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    // Separate store clients (separate pools) sharing one table. A generous timeout: 2 000
    // concurrent requests on a shared 2-core CI box can exceed the 2 s default without
    // anything being wrong; this test is about exactly-once, not latency.
    let b = b.timeout(Duration::from_secs(10));
    let a = connect(b.clone().pool_size(8)).await;
    let b = connect(b.pool_size(8)).await;
    multi_instance(a, b).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_leader_is_taken_over_and_fenced() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let a = connect(b.clone()).await;
    let b = connect(b).await;
    lease_takeover(a, b).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_fails_closed_and_recovers_without_restart() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let proxy = Proxy::start(authority(&url)).await;
    let schema = unique("idem_test_");
    let store = connect(PostgresStore::builder(via(&url, proxy.addr())).schema(&schema)).await;
    outage(store, &proxy).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_row_is_a_clear_error() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b).await;
    let table = store.table();
    // A record that does not decode.
    let (u, t) = (url.clone(), table.clone());
    corrupt_entry(store.clone(), move |scope| {
        let (url, table) = (u.clone(), t.clone());
        async move {
            let n = raw(&url)
                .await
                .execute(
                    &format!(
                        "UPDATE {table} SET record = '\\xff00deadbeef'::bytea WHERE scope = $1"
                    ),
                    &[&&scope.0[..]],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
    })
    .await;
    // An in-flight row whose fingerprint is not 32 bytes.
    corrupt_entry(store.clone(), move |scope| {
        let (url, table) = (url.clone(), table.clone());
        async move {
            let n = raw(&url)
                .await
                .execute(
                    &format!(
                        "UPDATE {table} SET state = 'in_flight', record = NULL, \
                         fingerprint = 'short'::bytea, expires_at = now() + interval '1 hour' \
                         WHERE scope = $1"
                    ),
                    &[&&scope.0[..]],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
    })
    .await;
    drop_schema(&env_url("DATABASE_URL").unwrap(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_ignored_then_removed_in_batches() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b.cleanup_batch(7).cleanup_interval(Duration::ZERO)).await;
    let fp = Fingerprint([3; 32]);
    let short = Duration::from_millis(50);
    for i in 0..20 {
        let scope = order_scope(&format!("expire-{i}"));
        let Ok(Begin::New(t)) = store.begin(scope, fp, Duration::from_secs(60)).await else {
            panic!("fresh scope");
        };
        store
            .complete(scope, t, conformance::sample_record(fp), short)
            .await
            .unwrap();
    }
    // Five claims whose lease lapses, and one that stays.
    for i in 0..5 {
        let scope = order_scope(&format!("lapse-{i}"));
        assert!(matches!(
            store.begin(scope, fp, short).await,
            Ok(Begin::New(_))
        ));
    }
    let live = order_scope("live");
    assert!(matches!(
        store.begin(live, fp, Duration::from_secs(60)).await,
        Ok(Begin::New(_))
    ));
    tokio::time::sleep(short * 4).await;
    // Ignored before removal: an expired record's scope is free again.
    assert!(matches!(
        store
            .begin(order_scope("expire-0"), fp, Duration::from_secs(60))
            .await,
        Ok(Begin::New(_))
    ));
    let removed = store.remove_expired().await.unwrap();
    assert_eq!(removed, 19 + 5, "every expired row, in batches of 7");
    let left: i64 = raw(&url)
        .await
        .query_one(&format!("SELECT count(*) FROM {}", store.table()), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 2, "the live claim and the re-claimed scope stay");
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_notify_not_by_polling() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    // Polling so slow that only the notification can wake the waiter within the bound.
    let slow = Duration::from_secs(60);
    let (b, schema) = builder(&url);
    let store = connect(b.poll_interval(slow, slow)).await;
    let scope = order_scope(&unique("notify-"));
    let fp = Fingerprint([1; 32]);
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, token).await })
    };
    // Let the waiter's listener connect and LISTEN (if it is late, the waiter's first check
    // still sees the claim ended).
    tokio::time::sleep(Duration::from_millis(200)).await;
    store
        .complete(
            scope,
            token,
            conformance::sample_record(fp),
            conformance::LONG,
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the notification wakes the waiter")
        .unwrap()
        .unwrap();
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_notification_does_not_hang_a_waiter() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b).await;
    let scope = order_scope(&unique("lost-"));
    let Ok(Begin::New(token)) = store
        .begin(scope, Fingerprint([1; 32]), conformance::LONG)
        .await
    else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, token).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The claim ends without a notification (as if it were lost): polling notices.
    raw(&url)
        .await
        .execute(
            &format!("DELETE FROM {} WHERE scope = $1", store.table()),
            &[&&scope.0[..]],
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("polling wakes the waiter")
        .unwrap()
        .unwrap();
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_begin_reply_was_lost_is_released() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let slow = SlowReplies::start(authority(&url), Duration::from_millis(800)).await;
    let schema = unique("idem_test_");
    let direct = connect(PostgresStore::builder(&url).schema(&schema)).await;
    let via_slow = connect(
        PostgresStore::builder(via(&url, slow.addr))
            .schema(&schema)
            .pool_size(1)
            .timeout(Duration::from_millis(300)),
    )
    .await;
    lost_begin_reply(via_slow, direct, &slow).await;
    drop_schema(&url, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_begin_was_dropped_in_flight_is_released() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let slow = SlowReplies::start(authority(&url), Duration::from_millis(800)).await;
    let schema = unique("idem_test_");
    let direct = connect(PostgresStore::builder(&url).schema(&schema)).await;
    let via_slow = connect(
        PostgresStore::builder(via(&url, slow.addr))
            .schema(&schema)
            .pool_size(1)
            .timeout(Duration::from_secs(10)),
    )
    .await;
    dropped_begin(via_slow, direct, &slow).await;
    drop_schema(&url, &schema).await;
}

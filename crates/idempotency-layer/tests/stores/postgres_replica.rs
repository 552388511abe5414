//! `PostgresStore` on a primary with a streaming standby (`PG_REPLICA_URL`, both hosts with
//! `target_session_attrs=read-write`, as `.ci/postgres-replica.sh` prints): what the store
//! answers when a commit waits for a synchronous standby that does not confirm. The failover
//! figures (records acknowledged and then lost on promotion) come from the `pg-failover` chaos
//! binary; see RELIABILITY.md.
//!
//! The tests change the primary's `synchronous_standby_names` (with `ALTER SYSTEM`, reset at the
//! end): they take a lock so that they run one at a time.

use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint, Record};
use idempotency_layer::{IdempotencyStore, PostgresStore, Scope};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A connection to the current primary.
async fn primary(url: &str) -> tokio_postgres::Client {
    crate::postgres::raw(url).await
}

/// Names the standbys a commit waits for on the primary (`''`: none, asynchronous).
async fn synchronous_standbys(url: &str, names: &str) {
    let c = primary(url).await;
    // Two statements: ALTER SYSTEM refuses to run in the implicit transaction of a batch.
    c.batch_execute(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    ))
    .await
    .unwrap();
    c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    // The reload reaches the backends at their next command; a new session sees it at once.
    wait::until_async(Duration::from_secs(10), "the setting is live", || async {
        primary(url)
            .await
            .query_one("SHOW synchronous_standby_names", &[])
            .await
            .map(|r| r.get::<_, String>(0) == names)
            .unwrap_or(false)
    })
    .await;
}

fn record() -> std::sync::Arc<Record> {
    std::sync::Arc::new(Record::new(
        Fingerprint([3; 32]),
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        bytes::Bytes::from_static(b"{}"),
    ))
}

/// A commit whose wait for a synchronous standby is cancelled (here: the store's timeout ends
/// the statement and cancels it) is committed on the primary: PostgreSQL only warns that the
/// standby may not have it. The store answers an error then, and a resent complete (the layer
/// resends through an outage) must not answer `Ok` either until the standby has the record:
/// the record would be acknowledged, then lost by a failover to that standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_is_acknowledged_only_once_the_synchronous_standby_has_it() {
    let Some(url) = env_url("PG_REPLICA_URL") else {
        return;
    };
    let _one = ONE_AT_A_TIME.lock().await;
    synchronous_standbys(&url, "").await;
    // Run in a task of its own, so that the setting is reset even when it fails.
    let outcome = tokio::spawn(resent_complete(url.clone())).await;
    synchronous_standbys(&url, "").await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn resent_complete(url: String) {
    let schema = unique("idem_replica_");
    let store = PostgresStore::builder(&url)
        .schema(schema.clone())
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let scope = Scope::new("replica", "POST /orders", &unique("k")).key();
    let lease = Duration::from_secs(30);
    let ttl = Duration::from_secs(600);
    let Begin::New(token) = store
        .begin(scope, Fingerprint([3; 32]), lease)
        .await
        .expect("begin")
    else {
        panic!("a fresh scope is new")
    };

    // A standby name nobody has: every commit waits for it.
    synchronous_standbys(&url, "nobody").await;
    let first = store.complete(scope, token, record(), ttl).await;
    assert!(
        first.is_err(),
        "a complete no standby confirmed was acknowledged: {first:?}"
    );
    // It is committed on the primary nonetheless.
    let table = store.table();
    let local: i64 = primary(&url)
        .await
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE state = 'completed'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(local, 1, "the cancelled commit is committed locally");
    // Resent: still not confirmed by a standby, so still not acknowledged.
    let resent = store.complete(scope, token, record(), ttl).await;
    assert!(
        resent.is_err(),
        "a resent complete acknowledged a record no standby confirmed: {resent:?}"
    );

    // Once the standby confirms (here: the primary waits for none), the resend is acknowledged.
    synchronous_standbys(&url, "").await;
    store
        .complete(scope, token, record(), ttl)
        .await
        .expect("acknowledged once the standby has it");
    crate::postgres::drop_schema(&url, &schema).await;
}

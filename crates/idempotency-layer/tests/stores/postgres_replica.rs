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

/// How many completed records `store`'s table holds on the primary (a plain read: it sees a
/// commit whose wait for the standby was cancelled).
async fn completed_on_primary(url: &str, store: &PostgresStore) -> i64 {
    primary(url)
        .await
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE state = 'completed'",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Completes `token`'s claim while no standby confirms, until the record is committed on the
/// primary: every try must fail (nothing confirmed it). A try can end before its commit began
/// (the store's timeout also covers the statement's own work, on a loaded machine), which
/// leaves nothing behind; the next try writes again, as the layer's resend does.
async fn complete_committed_only_on_primary(
    url: &str,
    store: &PostgresStore,
    scope: idempotency_layer::store::ScopeKey,
    token: idempotency_layer::store::Token,
) {
    for _ in 0..20 {
        let outcome = store
            .complete(scope, token, record(), Duration::from_secs(600))
            .await;
        assert!(
            outcome.is_err(),
            "a complete no standby confirmed was acknowledged: {outcome:?}"
        );
        if completed_on_primary(url, store).await == 1 {
            return;
        }
    }
    panic!("no complete reached its commit in 20 tries");
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
    with_standby_reset(resent_complete).await;
}

/// Runs `scenario` with the primary's URL, alone among this file's tests, and resets
/// `synchronous_standby_names` after it (in a task of its own, so even when it fails).
async fn with_standby_reset<F: std::future::Future<Output = ()> + Send + 'static>(
    scenario: impl FnOnce(String) -> F,
) {
    let Some(url) = env_url("PG_REPLICA_URL") else {
        return;
    };
    let _one = ONE_AT_A_TIME.lock().await;
    synchronous_standbys(&url, "").await;
    let outcome = tokio::spawn(scenario(url.clone())).await;
    synchronous_standbys(&url, "").await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A store on `url` in a schema of its own, with the store timeout `timeout`.
async fn store_in(url: &str, schema: &str, timeout: Duration) -> PostgresStore {
    let store = PostgresStore::builder(url)
        .schema(schema)
        .timeout(timeout)
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    store
}

/// The same commit, cancelled while it waits for the standby, seen by a duplicate: the record
/// is visible on the primary at once, so a duplicate that only read it would be answered with a
/// replay the standby may lack (a failover then, and the next duplicate runs the write again,
/// after a client already had its answer). With a synchronous standby configured, a replay is
/// served only once the standby confirms: while it does not, the duplicate fails closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_is_not_replayed_a_record_the_synchronous_standby_lacks() {
    with_standby_reset(replay_of_an_unconfirmed_record).await;
}

async fn replay_of_an_unconfirmed_record(url: String) {
    let schema = unique("idem_replica_");
    let leader = store_in(&url, &schema, Duration::from_millis(500)).await;
    // Another instance, with a near cache: it must not keep what it may not serve either.
    let duplicate = PostgresStore::builder(&url)
        .schema(schema.clone())
        .timeout(Duration::from_millis(500))
        .near_cache(idempotency_layer::store::NearCache::new(1 << 20))
        .connect()
        .await
        .expect("connect");
    let scope = Scope::new("replica", "POST /orders", &unique("k")).key();
    let lease = Duration::from_secs(30);
    let Begin::New(token) = leader
        .begin(scope, Fingerprint([3; 32]), lease)
        .await
        .expect("begin")
    else {
        panic!("a fresh scope is new")
    };

    synchronous_standbys(&url, "nobody").await;
    // Committed on the primary (the cancel ended only the wait), so a plain read sees it.
    complete_committed_only_on_primary(&url, &leader, scope, token).await;
    for store in [&leader, &duplicate] {
        let replay = store.begin(scope, Fingerprint([3; 32]), lease).await;
        assert!(
            replay.is_err(),
            "a duplicate was answered from a record no standby confirmed: {:?}",
            replay.map(|b| matches!(b, Begin::Completed(_)))
        );
    }

    // Once the standby confirms (here: the primary waits for none), the record is replayed.
    synchronous_standbys(&url, "").await;
    for store in [&leader, &duplicate] {
        let replay = store
            .begin(scope, Fingerprint([3; 32]), lease)
            .await
            .expect("begin once the standby confirms");
        assert!(matches!(replay, Begin::Completed(_)), "a replay");
    }
    crate::postgres::drop_schema(&url, &schema).await;
}

async fn resent_complete(url: String) {
    let schema = unique("idem_replica_");
    let store = store_in(&url, &schema, Duration::from_millis(500)).await;
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
    // It is committed on the primary nonetheless.
    complete_committed_only_on_primary(&url, &store, scope, token).await;
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

/// While the synchronous standby is away, every claim's commit waits for it, and the store
/// gives up on each at its timeout. A commit waiting for a standby ends only on a cancel (a
/// closed connection leaves its backend waiting, with its locks and its connection slot, for as
/// long as the standby stays away): so every statement the store abandons is cancelled, not
/// only the first few at once, and no backend of the store is left waiting. Once the standby is
/// back, no key stays blocked past one lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_abandoned_while_the_standby_is_away_leave_no_backend_waiting() {
    with_standby_reset(abandoned_commits).await;
}

async fn abandoned_commits(url: String) {
    // The store's sessions carry a name of their own, to find their backends.
    let app = unique("idem_sync_");
    let schema = unique("idem_replica_");
    let store = store_in(
        &format!("{url}&application_name={app}"),
        &schema,
        Duration::from_millis(500),
    )
    .await;
    let lease = Duration::from_secs(3);
    let scopes: Vec<_> = (0..12)
        .map(|i| Scope::new("replica", "POST /orders", &format!("{app}-{i}")).key())
        .collect();

    synchronous_standbys(&url, "nobody").await;
    // More claims at once than the store sends cancels at once (four).
    let begins = futures_util::future::join_all(
        scopes
            .iter()
            .map(|&scope| store.begin(scope, Fingerprint([3; 32]), lease)),
    )
    .await;
    for begin in &begins {
        assert!(begin.is_err(), "no standby confirmed: {begin:?}");
    }
    let waiting = || async {
        primary(&url)
            .await
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event = 'SyncRep'",
                &[&app],
            )
            .await
            .map(|r| r.get::<_, i64>(0))
            .unwrap_or(-1)
    };
    wait::until_async(
        Duration::from_secs(20),
        "no backend of the store still waits for the standby",
        || async { waiting().await == 0 },
    )
    .await;

    // The standby is back: every key is free again within one lease (its claim was released
    // by its token, or lapsed).
    synchronous_standbys(&url, "").await;
    for scope in scopes {
        wait::until_async(
            lease + Duration::from_secs(5),
            "the key is free within one lease",
            || async {
                matches!(
                    store.begin(scope, Fingerprint([3; 32]), lease).await,
                    Ok(Begin::New(_))
                )
            },
        )
        .await;
    }
    crate::postgres::drop_schema(&url, &schema).await;
}

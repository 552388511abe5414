//! `PostgresStore` against a real PostgreSQL (`DATABASE_URL`, e.g.
//! postgres://postgres@127.0.0.1:5432/test): the store conformance suite, two instances
//! sharing one database, lease takeover, an outage through a proxy, a corrupt row, and the
//! batched cleanup of expired rows; transactional completion in `tx_completion`. Each test works
//! in a schema of its own. Unset `DATABASE_URL`: each test says so and passes; set but
//! unreachable: each test fails.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint, ScopeKey};
use idempotency_layer::{conformance, IdempotencyStore, PostgresStore, PostgresStoreBuilder};

mod tx_completion;

/// A builder on `url` in a schema of its own (returned, to drop it at the end).
fn builder(url: &str) -> (PostgresStoreBuilder, String) {
    let schema = unique("idem_test_");
    (PostgresStore::builder(url).schema(&schema), schema)
}

/// A plain connection to `url`, beside the store (shared with the PgBouncer and replica tests).
pub(crate) async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("a plain connection to {url}: {e}"));
    tokio::spawn(conn);
    client
}

pub(crate) async fn drop_schema(url: &str, schema: &str) {
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

/// Whether `store`'s table holds a claim in flight for `scope`, read on a plain connection to
/// `url` (the server itself).
pub(crate) async fn holds_claim(store: &PostgresStore, url: &str, scope: ScopeKey) -> bool {
    let table = store.table();
    let row = raw(url)
        .await
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE scope = $1 AND state = 'in_flight'"),
            &[&&scope.0[..]],
        )
        .await
        .unwrap();
    row.get::<_, i64>(0) == 1
}

/// The shared store suite on PostgreSQL: a schema per test, dropped at its end.
struct Postgres;

impl Backend for Postgres {
    type Store = PostgresStore;
    const URL_VAR: &'static str = "DATABASE_URL";

    fn namespace() -> String {
        unique("idem_test_")
    }

    async fn connect(url: String, namespace: String, tuning: Tuning) -> PostgresStore {
        let mut b = PostgresStore::builder(&url).schema(namespace);
        if let Some(t) = tuning.timeout {
            b = b.timeout(t);
        }
        if tuning.single_connection {
            b = b.pool_size(1);
        }
        if tuning.near_cache {
            b = b.near_cache(idempotency_layer::store::NearCache::new(16 << 20));
        }
        if tuning.slow_polling {
            b = b.poll_interval(SLOW_POLL, SLOW_POLL);
        }
        connect(b).await
    }

    async fn drop_namespace(url: String, namespace: String) {
        drop_schema(&url, &namespace).await;
    }

    fn near_stats(store: &PostgresStore) -> Option<idempotency_layer::store::NearCacheStats> {
        store.near_cache_stats()
    }

    async fn holds(store: &PostgresStore, url: &str, scope: ScopeKey) -> bool {
        holds_claim(store, url, scope).await
    }
}

shared_store_suite!(Postgres, idempotency_layer::store::AnyStore::Postgres);

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
            .complete(scope, t, conformance::sample_record(fp).into(), short)
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
    assert_eq!(removed, 19, "every expired record, in batches of 7");
    let admin = raw(&url).await;
    let count = || async {
        let n: i64 = admin
            .query_one(&format!("SELECT count(*) FROM {}", store.table()), &[])
            .await
            .unwrap()
            .get(0);
        n
    };
    assert_eq!(
        count().await,
        2 + 5,
        "the live claim, the re-claimed scope and the lapsed claims (within their grace) stay"
    );
    // Lapsed for longer than the grace (an hour): removed.
    admin
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '61 minutes' \
                 WHERE state = 'in_flight' AND expires_at <= now()",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(store.remove_expired().await.unwrap(), 5);
    assert_eq!(
        count().await,
        2,
        "the live claim and the re-claimed scope stay"
    );
    drop_schema(&url, &schema).await;
}

/// On a table hash-partitioned by `scope` (which `migrate` accepts as it finds it), the cleanup
/// removes the expired rows and nothing else. A `ctid` is unique only within one partition: a
/// cleanup by `ctid` deleted, with each expired row, the rows at the same position in every
/// other partition, live claims and records alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_of_a_partitioned_table_removes_only_expired_rows() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let admin = raw(&url).await;
    // The table as an operator would partition it, before the store first migrates.
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".idempotency_records (
                 scope bytea NOT NULL, state text NOT NULL, token uuid NOT NULL,
                 fingerprint bytea NOT NULL, expires_at timestamptz NOT NULL, record bytea,
                 watched boolean NOT NULL DEFAULT false, PRIMARY KEY (scope)
             ) PARTITION BY HASH (scope);
             CREATE TABLE \"{schema}\".p0 PARTITION OF \"{schema}\".idempotency_records
                 FOR VALUES WITH (MODULUS 4, REMAINDER 0);
             CREATE TABLE \"{schema}\".p1 PARTITION OF \"{schema}\".idempotency_records
                 FOR VALUES WITH (MODULUS 4, REMAINDER 1);
             CREATE TABLE \"{schema}\".p2 PARTITION OF \"{schema}\".idempotency_records
                 FOR VALUES WITH (MODULUS 4, REMAINDER 2);
             CREATE TABLE \"{schema}\".p3 PARTITION OF \"{schema}\".idempotency_records
                 FOR VALUES WITH (MODULUS 4, REMAINDER 3);"
        ))
        .await
        .unwrap();
    let store = connect(b.cleanup_interval(Duration::ZERO)).await;
    let fp = Fingerprint([9; 32]);
    // Expired records first, written directly so that each sits at the first position of its
    // partition, then live claims, the first of each other partition at that same position.
    for i in 0..2 {
        admin
            .execute(
                &format!(
                    "INSERT INTO {} (scope, state, token, fingerprint, expires_at, record) \
                     VALUES ($1, 'completed', gen_random_uuid(), $2, \
                       now() - interval '1 minute', '\\x00')",
                    store.table()
                ),
                &[
                    &order_scope(&format!("expired-{i}")).0.to_vec(),
                    &fp.0.to_vec(),
                ],
            )
            .await
            .unwrap();
    }
    for i in 0..64 {
        let scope = order_scope(&format!("live-{i}"));
        let Ok(Begin::New(_)) = store.begin(scope, fp, conformance::LONG).await else {
            panic!("fresh scope");
        };
    }
    let partitions: i64 = admin
        .query_one(
            &format!(
                "SELECT count(DISTINCT tableoid) FROM {} WHERE expires_at > now()",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(partitions, 4, "live rows in every partition");
    assert_eq!(store.remove_expired().await.unwrap(), 2, "the expired rows");
    let live: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {}", store.table()), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(live, 64, "every live claim stays");
    for i in 0..64 {
        let scope = order_scope(&format!("live-{i}"));
        match store.begin(scope, fp, conformance::LONG).await {
            Ok(Begin::InFlight { .. }) => {}
            other => panic!("live-{i} must still be held: {other:?}"),
        }
    }
    drop_schema(&url, &schema).await;
}

/// A leader whose lease lapsed and whom nobody took over (its renewals failed, it paused) still
/// completes after a cleanup ran, and its record is replayed: the cleanup spares a lapsed claim
/// for an hour, as Redis keeps its key. (It used to delete the claim, so the late leader's
/// record was refused as fenced and the next retry executed the write again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_spares_a_late_leader_never_taken_over() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b.cleanup_interval(Duration::ZERO)).await;
    let fp = Fingerprint([4; 32]);
    let scope = order_scope("late-leader");
    let Ok(Begin::New(token)) = store.begin(scope, fp, Duration::from_secs(60)).await else {
        panic!("fresh scope");
    };
    // Its lease lapsed a minute ago (set on the server's clock, no sleep).
    raw(&url)
        .await
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '1 minute'",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        store.remove_expired().await.unwrap(),
        0,
        "the claim is spared"
    );
    store
        .complete(
            scope,
            token,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .expect("the late leader completes its claim");
    match store.begin(scope, fp, Duration::from_secs(60)).await {
        Ok(Begin::Completed(_)) => {}
        other => panic!("the retry must replay the late leader's record, got {other:?}"),
    }
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
    // Wait (bounded) until the store's listener session has run LISTEN: from then on only a
    // NOTIFY can wake the waiter within the bound below (its polling is once a minute).
    let observer = raw(&url).await;
    let listen = format!("LISTEN \"{}\"", store.channel());
    let listening = async {
        loop {
            let row = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND query = $1",
                    &[&listen],
                )
                .await
                .unwrap();
            if row.get::<_, i64>(0) > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), listening)
        .await
        .expect("the store's listener runs LISTEN");
    store
        .complete(
            scope,
            token,
            conformance::sample_record(fp).into(),
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

/// `url` with its user replaced by `user` (`postgres://user@host...`).
fn with_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{rest}")
}

/// A connection whose notifications on `channel` arrive on the returned receiver.
async fn listen(
    url: &str,
    channel: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use futures_util::StreamExt;
    let (client, mut conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("listening connection");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = m {
                let _ = tx.send(n.payload().to_owned());
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await
        .unwrap();
    (client, rx)
}

/// The next notification on the channel, past the store listener's heartbeats (which it sends
/// itself every few seconds, to prove it hears).
async fn next_notification(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    loop {
        let note = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a notification within 10 s")
            .expect("the listening connection is open");
        if !note.starts_with("heartbeat:") {
            return note;
        }
    }
}

/// A completion or release nobody waits for sends no NOTIFY (whose commit would take the
/// server-wide notify lock); one a waiter watches does, and so does the forget of a record (for
/// the near caches). Notifications arrive in commit
/// order, so a marker sent afterwards shows what came before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_only_when_a_waiter_watches() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b).await;
    let (listener, mut notes) = listen(&url, store.channel()).await;
    let fp = Fingerprint([5; 32]);
    let lease = conformance::LONG;
    let record = || conformance::sample_record(fp);
    let claim = |name: &str| {
        let (store, scope) = (store.clone(), order_scope(&unique(name)));
        async move {
            match store.begin(scope, fp, lease).await {
                Ok(Begin::New(t)) => (scope, t),
                other => panic!("fresh scope: {other:?}"),
            }
        }
    };
    // Nobody waits: complete, release, forget notify nothing.
    let (s1, t1) = claim("quiet-complete-").await;
    store
        .complete(s1, t1, record().into(), lease)
        .await
        .unwrap();
    let (s2, t2) = claim("quiet-release-").await;
    store.release(s2, t2).await.unwrap();
    assert!(store.forget(s1).await.unwrap());
    listener
        .execute("SELECT pg_notify($1, 'marker-1')", &[&store.channel()])
        .await
        .unwrap();
    // A forgotten record is announced for the instances' near caches (forget is rare: the
    // notify lock costs nothing that matters there); nothing else was notified.
    assert_eq!(
        next_notification(&mut notes).await,
        format!("forget:{}", s1.to_hex()),
        "a forgotten record is announced"
    );
    assert_eq!(
        next_notification(&mut notes).await,
        "marker-1",
        "nothing was notified for claims nobody waited for"
    );

    // A waiter watches: its claim's end is notified.
    let (s3, t3) = claim("watched-").await;
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(s3, t3).await })
    };
    let table = store.table();
    wait::until_async(
        wait::LIMIT,
        "the waiter marks the claim watched",
        || async {
            listener
                .query_one(
                    &format!("SELECT watched FROM {table} WHERE scope = $1"),
                    &[&&s3.0[..]],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        },
    )
    .await;
    store
        .complete(s3, t3, record().into(), lease)
        .await
        .unwrap();
    assert_eq!(next_notification(&mut notes).await, s3.to_hex());
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter wakes")
        .unwrap()
        .unwrap();
    // A new claim of the scope (after forget) starts unwatched again.
    assert!(store.forget(s3).await.unwrap());
    let mut two = [
        next_notification(&mut notes).await,
        next_notification(&mut notes).await,
    ];
    two.sort();
    let mut expected = [format!("forget:{}", s3.to_hex()), s3.to_hex()];
    expected.sort();
    assert_eq!(
        two, expected,
        "forgetting a watched record notifies its waiters and the near caches"
    );
    let Ok(Begin::New(t4)) = store.begin(s3, fp, lease).await else {
        panic!("free after forget");
    };
    store.release(s3, t4).await.unwrap();
    listener
        .execute("SELECT pg_notify($1, 'marker-2')", &[&store.channel()])
        .await
        .unwrap();
    assert_eq!(next_notification(&mut notes).await, "marker-2");
    drop_schema(&url, &schema).await;
}

/// A role with no CREATE on the database migrates once the schema exists (creating the
/// table in it), and a role with only USAGE and table privileges migrates once the table
/// exists; a role that may create nothing is told what to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_works_for_a_least_privilege_role() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let admin = raw(&url).await;
    let role = unique("idem_app_");
    let (schema_a, schema_b, schema_c) = (
        unique("idem_test_"),
        unique("idem_test_"),
        unique("idem_test_"),
    );
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN;\n\
             CREATE SCHEMA \"{schema_a}\"; GRANT USAGE, CREATE ON SCHEMA \"{schema_a}\" TO \"{role}\";\n\
             CREATE SCHEMA \"{schema_b}\"; GRANT USAGE ON SCHEMA \"{schema_b}\" TO \"{role}\";\n\
             CREATE SCHEMA \"{schema_c}\"; GRANT USAGE ON SCHEMA \"{schema_c}\" TO \"{role}\";"
        ))
        .await
        .unwrap();
    let can_create_in_db: bool = admin
        .query_one(
            "SELECT has_database_privilege($1, current_database(), 'CREATE')",
            &[&role],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !can_create_in_db,
        "the role must not have CREATE on the database"
    );
    // The owner creates the table in schema B and grants the role what the store needs.
    let owner = connect(PostgresStore::builder(&url).schema(&schema_b)).await;
    admin
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO \"{role}\"",
            owner.table()
        ))
        .await
        .unwrap();
    let app_url = with_user(&url, &role);

    // A: the schema exists, the role may create in it: migrate creates the table.
    let a = PostgresStore::builder(&app_url)
        .schema(&schema_a)
        .connect()
        .await
        .expect("the role connects");
    a.migrate()
        .await
        .expect("migrate with CREATE on the schema only");
    a.migrate().await.expect("and again");
    conformance::run_all(|| a.clone()).await;

    // B: the table exists, the role has DML only: migrate changes nothing and succeeds.
    let b = PostgresStore::builder(&app_url)
        .schema(&schema_b)
        .connect()
        .await
        .unwrap();
    b.migrate()
        .await
        .expect("migrate with USAGE and table privileges only");
    conformance::run_all(|| b.clone()).await;

    // C: nothing exists and the role may create nothing: a clear error.
    let c = PostgresStore::builder(&app_url)
        .schema(&schema_c)
        .connect()
        .await
        .unwrap();
    let e = c
        .migrate()
        .await
        .expect_err("the role cannot create the table");
    let msg = e.to_string();
    eprintln!("{msg}");
    assert!(
        msg.contains("migration_sql") && msg.contains("CREATE TABLE"),
        "{msg}"
    );

    drop((a, b, c, owner));
    for s in [&schema_a, &schema_b, &schema_c] {
        drop_schema(&url, s).await;
    }
    admin
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .unwrap();
}

/// Eight replicas migrate one new schema at the same moment: every one succeeds, and the
/// table works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_works_for_replicas_starting_at_once() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    for round in 0..3 {
        let schema = unique("idem_test_");
        let mut replicas = Vec::new();
        for _ in 0..8 {
            replicas.push(
                PostgresStore::builder(&url)
                    .schema(&schema)
                    .pool_size(1)
                    .connect()
                    .await
                    .unwrap(),
            );
        }
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(replicas.len()));
        let tasks: Vec<_> = replicas
            .iter()
            .cloned()
            .map(|r| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    r.migrate().await
                })
            })
            .collect();
        for t in tasks {
            t.await
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}: a replica's migrate failed: {e}"));
        }
        let scope = order_scope(&unique("replicas-"));
        assert!(matches!(
            replicas[3]
                .begin(scope, Fingerprint([1; 32]), conformance::LONG)
                .await,
            Ok(Begin::New(_))
        ));
        drop(replicas);
        drop_schema(&url, &schema).await;
    }
}

/// A table made by an earlier version (no `watched` column) is brought up to date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_adds_the_watched_column_to_an_older_table() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let schema = unique("idem_test_");
    raw(&url)
        .await
        .batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\";\n\
             CREATE TABLE \"{schema}\".\"idempotency_records\" (\n\
                 scope bytea PRIMARY KEY,\n\
                 state text NOT NULL CHECK (state IN ('in_flight', 'completed')),\n\
                 token uuid NOT NULL, fingerprint bytea NOT NULL, expires_at timestamptz NOT NULL,\n\
                 record bytea, CHECK ((state = 'completed') = (record IS NOT NULL)));"
        ))
        .await
        .unwrap();
    let store = connect(PostgresStore::builder(&url).schema(&schema)).await;
    conformance::run_all(|| store.clone()).await;
    drop_schema(&url, &schema).await;
}

/// One cleanup run removes every expired row, however many piled up (the old cleanup removed
/// at most 100 000 a run, so above ~1 700 writes/s expired rows grew without bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_keeps_up_with_any_backlog() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b.cleanup_interval(Duration::ZERO)).await;
    let admin = raw(&url).await;
    let expired: i64 = 150_000;
    admin
        .execute(
            &format!(
                "INSERT INTO {} (scope, state, token, fingerprint, expires_at, record) \
                 SELECT decode(md5(i::text) || md5((-i)::text), 'hex'), 'completed', \
                        gen_random_uuid(), '\\x00'::bytea, now() - interval '1 second', '\\x00'::bytea \
                 FROM generate_series(1, $1::bigint) i",
                store.table()
            ),
            &[&expired],
        )
        .await
        .unwrap();
    let live = order_scope(&unique("live-"));
    assert!(matches!(
        store
            .begin(live, Fingerprint([1; 32]), conformance::LONG)
            .await,
        Ok(Begin::New(_))
    ));
    let started = std::time::Instant::now();
    let removed = store.remove_expired().await.expect("cleanup");
    let took = started.elapsed();
    eprintln!(
        "removed {removed} expired rows in {took:?} ({:.0} rows/s)",
        removed as f64 / took.as_secs_f64()
    );
    assert_eq!(removed, expired as u64, "one run removes the whole backlog");
    let left: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {}", store.table()), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1, "only the live claim stays");

    // The background task does the same on its own.
    drop(store);
    let store = connect(
        PostgresStore::builder(&url)
            .schema(&schema)
            .cleanup_interval(Duration::from_millis(200)),
    )
    .await;
    admin
        .execute(
            &format!(
                "INSERT INTO {} (scope, state, token, fingerprint, expires_at, record) \
                 SELECT decode(md5(i::text) || md5((-i)::text), 'hex'), 'completed', \
                        gen_random_uuid(), '\\x00'::bytea, now() - interval '1 second', '\\x00'::bytea \
                 FROM generate_series(1, 20000) i",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap();
    wait::until_async(
        Duration::from_secs(60),
        "the background cleanup removed the expired rows",
        || async {
            let left: i64 = admin
                .query_one(&format!("SELECT count(*) FROM {}", store.table()), &[])
                .await
                .unwrap()
                .get(0);
            left == 1
        },
    )
    .await;
    drop_schema(&url, &schema).await;
}

/// A proxy that relays the first connection to `upstream` and holds every later one open
/// without a byte (a listener that cannot get through).
struct FirstOnly {
    addr: std::net::SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for FirstOnly {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl FirstOnly {
    async fn start(upstream: &str) -> FirstOnly {
        let upstream = tokio::net::lookup_host(upstream)
            .await
            .unwrap()
            .next()
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let mut held = Vec::new();
            let mut first = true;
            while let Ok((mut client, _)) = listener.accept().await {
                if std::mem::replace(&mut first, false) {
                    tokio::spawn(async move {
                        if let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                } else {
                    held.push(client);
                }
            }
        });
        FirstOnly { addr, accept }
    }
}

/// While the listener cannot connect, a waiter still checks at once (an ended claim returns
/// without waiting for the listener) and polling wakes it when a held claim ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_does_not_block_for_the_listener() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let proxy = FirstOnly::start(authority(&url)).await;
    let schema = unique("idem_test_");
    let direct = connect(PostgresStore::builder(&url).schema(&schema)).await;
    // The one pooled connection gets through; the listener's hangs. A timeout far longer than
    // the bounds below: the old wait blocked this long for the listener first.
    let store = PostgresStore::builder(via(&url, proxy.addr))
        .schema(&schema)
        .pool_size(1)
        .timeout(Duration::from_secs(60))
        .connect()
        .await
        .unwrap();
    let fp = Fingerprint([2; 32]);
    let scope = order_scope(&unique("ended-"));
    let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    store
        .complete(
            scope,
            t,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), store.wait(scope, t))
        .await
        .expect("a wait on an ended claim returns without waiting for the listener")
        .unwrap();

    let scope = order_scope(&unique("held-"));
    let Ok(Begin::New(t)) = direct.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, t).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    direct
        .complete(
            scope,
            t,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("polling wakes the waiter while the listener is down")
        .unwrap()
        .unwrap();
    drop(store);
    drop_schema(&url, &schema).await;
}

/// A store chosen at run time from its URL (migrated on open).
/// `url` with `params` added to its query.
#[cfg(feature = "postgres-tls")]
fn with_params(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// `sslmode=require` connects over TLS (this PostgreSQL has `ssl = on`): every connection of
/// the store, the listener's too, is encrypted; with root certificates that did not sign the
/// server's, the connection is refused.
#[cfg(feature = "postgres-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_connects_over_tls() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let app = unique("idem_tls_");
    let tls_url = with_params(&url, &format!("sslmode=require&application_name={app}"));
    let schema = unique("idem_test_");
    let store = connect(PostgresStore::builder(&tls_url).schema(&schema)).await;
    conformance::run_all(|| store.clone()).await;
    // A waiter makes the listener connect too.
    let scope = order_scope(&unique("tls-wait-"));
    let fp = Fingerprint([4; 32]);
    let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, t).await })
    };
    // The server's view of the store's connections, once the listener's `LISTEN` has run:
    // (listening over TLS, others over TLS, any plain).
    let connections = || async {
        let row = raw(&url)
            .await
            .query_one(
                "SELECT count(*) FILTER (WHERE s.ssl AND a.query LIKE 'LISTEN%'), \
                        count(*) FILTER (WHERE s.ssl AND a.query NOT LIKE 'LISTEN%'), \
                        count(*) FILTER (WHERE NOT s.ssl) \
                 FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = $1",
                &[&app],
            )
            .await
            .unwrap();
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
        )
    };
    // Until the listener listens over TLS, or any connection is plain (then the check fails).
    test_support::wait::until_async(
        test_support::wait::LIMIT,
        "the store's listener runs LISTEN over TLS",
        || async {
            let (listener, _, plain) = connections().await;
            listener >= 1 || plain > 0
        },
    )
    .await;
    let (listener, pooled, plain) = connections().await;
    eprintln!("TLS: {listener} listening, {pooled} pooled; {plain} plain");
    assert_eq!(plain, 0, "every connection of the store is TLS");
    assert!(listener >= 1, "the listening connection is TLS");
    assert!(pooled >= 1, "the pooled connections are TLS");
    store
        .complete(
            scope,
            t,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // Roots of a CA that did not sign the server's certificate: refused.
    let dir = std::env::temp_dir().join(unique("idem-ca-"));
    std::fs::create_dir_all(&dir).unwrap();
    let status = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=unrelated test CA"])
        .arg("-keyout")
        .arg(dir.join("ca.key"))
        .arg("-out")
        .arg(dir.join("ca.pem"))
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl makes a CA");
    assert!(status.success());
    let pem = std::fs::read(dir.join("ca.pem")).unwrap();
    let refused = PostgresStore::builder(&tls_url)
        .schema(&schema)
        .tls_root_certificates(pem)
        .connect()
        .await;
    // Refused for its certificate (not for anything else: the same URL connects with the CA
    // above): the cause, down the error's sources, is the certificate check.
    let refused = refused.expect_err("an unverifiable certificate is refused");
    let mut causes = vec![refused.to_string()];
    let mut source = std::error::Error::source(&refused);
    while let Some(e) = source {
        causes.push(e.to_string());
        source = e.source();
    }
    let causes = causes.join(" / ");
    assert!(
        causes.contains("certificate") || causes.contains("UnknownIssuer"),
        "refused for its certificate: {causes}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    drop_schema(&url, &schema).await;
}

/// A store on the application's own pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_your_own_pool() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let config: tokio_postgres::Config = url.parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .build()
        .unwrap();
    let schema = unique("idem_test_");
    let store = connect(PostgresStore::builder_from_pool(pool.clone(), &url).schema(&schema)).await;
    conformance::run_all(|| store.clone()).await;
    // The pool is the application's: it serves its own queries alongside.
    let n: i32 = pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    drop_schema(&url, &schema).await;
}

/// Holds the row of `scope` locked (`SELECT ... FOR UPDATE` in an open transaction) until
/// [`Locked::release`]: the store's statements on that row wait behind it, as behind an open
/// `TxCompletion` transaction.
struct Locked {
    client: tokio_postgres::Client,
}

impl Locked {
    async fn row(url: &str, table: &str, scope: &idempotency_layer::store::ScopeKey) -> Locked {
        let client = raw(url).await;
        client.batch_execute("BEGIN").await.unwrap();
        let n = client
            .execute(
                &format!("SELECT 1 FROM {table} WHERE scope = $1 FOR UPDATE"),
                &[&&scope.0[..]],
            )
            .await
            .unwrap();
        assert_eq!(n, 1, "the row to lock exists");
        Locked { client }
    }

    async fn release(self) {
        self.client.batch_execute("ROLLBACK").await.unwrap();
    }
}

/// A claim whose row another transaction holds locked (an open `TxCompletion` transaction, a
/// commit waiting for a standby) is skipped by the batched renewal, not waited for: the other
/// claims of the batch are renewed, and the locked one is answered a transient error (tried
/// again shortly), not "fenced". (Before, the batch waited for the lock until `lock_timeout`
/// and failed whole, every tick.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_row_does_not_fail_the_renewals_of_the_others() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(b.cleanup_interval(Duration::ZERO)).await;
    let fp = Fingerprint([2; 32]);
    let (locked, free) = (order_scope("renew-locked"), order_scope("renew-free"));
    let Ok(Begin::New(tl)) = store.begin(locked, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let Ok(Begin::New(tf)) = store.begin(free, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let lock = Locked::row(&url, &store.table(), &locked).await;
    let results = store
        .renew_many(&[
            (locked, tl, conformance::LONG),
            (free, tf, conformance::LONG),
        ])
        .await;
    assert!(
        matches!(results[0], Err(idempotency_layer::StoreError::Backend(_))),
        "the locked claim is skipped, as a transient failure: {:?}",
        results[0]
    );
    assert!(
        results[1].is_ok(),
        "the free claim is renewed: {:?}",
        results[1]
    );
    lock.release().await;
    assert!(store.renew(locked, tl, conformance::LONG).await.is_ok());
    drop_schema(&url, &schema).await;
}

/// Renewals have connections of their own: with every connection of the store's pool taken
/// (handlers' long `TxCompletion` transactions, a burst of claims), live claims are still
/// renewed. (Before, they waited for a pooled connection and failed at the pool's timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_do_not_wait_for_the_pool() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(
        b.pool_size(1)
            .timeout(Duration::from_millis(500))
            .cleanup_interval(Duration::ZERO),
    )
    .await;
    let fp = Fingerprint([3; 32]);
    let scope = order_scope("renew-pool-taken");
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let taken = store.pool().get().await.unwrap();
    assert!(
        store
            .begin(order_scope("other"), fp, conformance::LONG)
            .await
            .is_err(),
        "the pool is taken"
    );
    store
        .renew(scope, token, conformance::LONG)
        .await
        .expect("the renewal runs on a connection of its own");
    let results = store.renew_many(&[(scope, token, conformance::LONG)]).await;
    assert!(results[0].is_ok(), "{:?}", results[0]);
    drop(taken);
    drop_schema(&url, &schema).await;
}

/// A claim stuck behind a lock past the store's timeout (the takeover of a lapsed claim whose
/// row another transaction locked) is cancelled, and its connection is
/// not handed to the next statement: on a pool of one connection, the next `begin` (another
/// key) succeeds while the lock is still held. (Before, the timed-out statement ran on, the
/// connection went back to the pool, and every later statement queued behind it until the
/// lock holder ended.) The store's sessions carry the timeout as `statement_timeout` and
/// `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_statement_is_cancelled_and_its_connection_not_reused() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let timeout = Duration::from_millis(500);
    let store = connect(
        b.pool_size(1)
            .timeout(timeout)
            .cleanup_interval(Duration::ZERO),
    )
    .await;
    let fp = Fingerprint([6; 32]);
    let (held, other) = (order_scope("locked"), order_scope("other"));
    let Ok(Begin::New(_)) = store.begin(held, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let lock = Locked::row(&url, &store.table(), &held).await;
    // A begin on the live claim only reads its row: it answers at once, lock or not.
    match store.begin(held, fp, conformance::LONG).await {
        Ok(Begin::InFlight { .. }) => {}
        other => panic!("a live claim is read past the lock: {other:?}"),
    }
    lock.release().await;
    // Lapsed, the claim is taken over by a write, which waits for the lock.
    raw(&url)
        .await
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '1 minute'",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap();
    let lock = Locked::row(&url, &store.table(), &held).await;
    assert!(
        store.begin(held, fp, conformance::LONG).await.is_err(),
        "a claim behind the lock times out"
    );
    match store.begin(other, fp, conformance::LONG).await {
        Ok(Begin::New(_)) => {}
        other => panic!("the next statement must not wait behind the abandoned one: {other:?}"),
    }
    lock.release().await;

    let session = store.pool().get().await.unwrap();
    for setting in ["statement_timeout", "lock_timeout"] {
        let shown: String = session
            .query_one(&format!("SHOW {setting}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            shown, "500ms",
            "the store's sessions have {setting} = its timeout"
        );
    }
    drop(session);
    drop_schema(&url, &schema).await;
}

/// A claim abandoned at the store's timeout never lands later as an orphan. The key's previous
/// claim lapsed, so the abandoned claim would take it over if it ran; it waits behind a lock
/// past the timeout, its orphan release finds nothing to release (the claim is not there yet),
/// then the lock ends. Before, the statement then ran and wrote a claim nobody held, for the
/// whole 10-minute lease, and every retry of the key waited on it; now the statement is
/// cancelled (and `statement_timeout` ends it anyway), and a second, delayed orphan release
/// removes a claim that landed regardless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_claim_does_not_land_as_an_orphan() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let (b, schema) = builder(&url);
    let store = connect(
        b.pool_size(4)
            .timeout(Duration::from_millis(500))
            .cleanup_interval(Duration::ZERO),
    )
    .await;
    let fp = Fingerprint([7; 32]);
    let scope = order_scope("abandoned");
    let Ok(Begin::New(_)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let admin = raw(&url).await;
    admin
        .execute(
            &format!(
                "UPDATE {} SET expires_at = now() - interval '1 minute'",
                store.table()
            ),
            &[],
        )
        .await
        .unwrap();
    // Four idle connections, so that the orphan release runs on another one than the claim's
    // (it finds nothing there and ends at once, before the claim could land).
    let warm: Vec<_> = futures_util::future::join_all((0..4).map(|_| store.pool().get())).await;
    drop(warm);
    let lock = Locked::row(&url, &store.table(), &scope).await;
    assert!(
        store.begin(scope, fp, conformance::LONG).await.is_err(),
        "the claim behind the lock times out"
    );
    // The lock ends only once no statement waits for it any more, on the server's own view
    // (`pg_stat_activity`): the abandoned claim was cancelled (or, without the fix, never is:
    // then after 5 s), and the orphan release, sent when the claim was given up, has run.
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%{}%' AND pid <> pg_backend_pid()",
        schema
    );
    for _ in 0..100 {
        let n: i64 = admin.query_one(&waiting, &[]).await.unwrap().get(0);
        if n == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    lock.release().await;
    // The lapsed claim is free: another request claims it, unless an orphan holds it. An orphan
    // would hold it for the whole lease (600 s); the cancel, the statement timeout and the
    // second release each end it within a few timeouts.
    wait::until_async(
        Duration::from_secs(10),
        "the key is claimed again (an orphaned claim would hold it for its whole lease)",
        || async {
            match store.begin(scope, fp, conformance::LONG).await {
                Ok(Begin::New(_)) => true,
                Ok(Begin::InFlight { .. }) => false,
                other => panic!("unexpected {other:?}"),
            }
        },
    )
    .await;
    drop_schema(&url, &schema).await;
}

/// After a failover, the pool's connections still go to the old primary, now read-only: each
/// statement fails with SQLSTATE 25006. The first such error drops the pool's idle connections
/// and its own, so the next statements get connections to the current primary. Here the
/// failover is played by a pool whose first four connections are read-only sessions (as a
/// standby's are) and whose later ones are not. (Before, `RecyclingMethod::Fast` kept handing
/// out the read-only connections: one failed request per stale connection, on every pass
/// through the pool, for as long as they lived.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_to_a_read_only_server_are_dropped_after_the_first_error() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    use std::sync::atomic::{AtomicUsize, Ordering};
    let created = std::sync::Arc::new(AtomicUsize::new(0));
    let config: tokio_postgres::Config = url.parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let counter = created.clone();
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
            let old_primary = counter.fetch_add(1, Ordering::SeqCst) < 4;
            Box::pin(async move {
                if old_primary {
                    client
                        .batch_execute("SET default_transaction_read_only = on")
                        .await
                        .map_err(deadpool_postgres::HookError::Backend)?;
                }
                Ok(())
            })
        }))
        .build()
        .unwrap();
    let schema = unique("idem_test_");
    // Migrate on a writable connection of its own (the pool's first ones are "the standby").
    let writer = connect(PostgresStore::builder(&url).schema(&schema)).await;
    drop(writer);
    let store = PostgresStore::builder_from_pool(pool.clone(), &url)
        .schema(&schema)
        .cleanup_interval(Duration::ZERO)
        .connect()
        .await
        .expect("connect");
    // Four pooled connections to "the old primary".
    let warm: Vec<_> = futures_util::future::join_all((0..4).map(|_| pool.get())).await;
    drop(warm);
    assert_eq!(pool.status().size, 4);
    let fp = Fingerprint([8; 32]);
    let first = store
        .begin(order_scope("ro-0"), fp, conformance::LONG)
        .await;
    let message = format!(
        "{:?}",
        first.expect_err("a read-only connection refuses the claim")
    );
    assert!(message.contains("read-only"), "{message}");
    for i in 1..=8 {
        match store
            .begin(order_scope(&format!("ro-{i}")), fp, conformance::LONG)
            .await
        {
            Ok(Begin::New(_)) => {}
            other => panic!("claim {i} after the first error must reach the primary: {other:?}"),
        }
    }
    drop_schema(&url, &schema).await;
}

/// A proxy to `upstream` that relays every connection except cancel requests: those it holds
/// open without an answer (a server too busy to take them), counting how many it holds at
/// once.
struct HoldsCancels {
    addr: std::net::SocketAddr,
    held: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    seen: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for HoldsCancels {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The first 8 bytes of a `CancelRequest`: its length (16) and its code (80877102).
const CANCEL_REQUEST: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];

impl HoldsCancels {
    async fn start(upstream: std::net::SocketAddr) -> HoldsCancels {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (held, most, seen) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let counters = (held.clone(), most.clone(), seen.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (held, most, seen) = counters.clone();
                tokio::spawn(async move {
                    let mut head = [0u8; 8];
                    if client.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    if head == CANCEL_REQUEST {
                        seen.fetch_add(1, Ordering::SeqCst);
                        let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        // Until the sender gives up and closes it.
                        let mut rest = Vec::new();
                        let _ = client.read_to_end(&mut rest).await;
                        held.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    if server.write_all(&head).await.is_ok() {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        HoldsCancels {
            addr,
            held,
            most,
            seen,
            accept,
        }
    }
}

/// When many statements time out at once (here 16, all waiting for locked rows), the store
/// cancels at most four at a time: each cancel is a connection of its own, held for up to the
/// store's timeout when the server is slow to take it, and one per abandoned statement would
/// double the connections the store holds open to a server already in trouble. (Before, each
/// abandoned statement spawned its cancel at once, without a limit.) The store runs as behind a
/// transaction pooler here (no session `statement_timeout`), so that only its own timeout ends
/// the statements and each ends in a cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_four_cancels_are_in_flight_at_once() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let config: tokio_postgres::Config = url.parse().unwrap();
    let upstream = match (&config.get_hosts()[0], config.get_ports().first()) {
        (tokio_postgres::config::Host::Tcp(host), port) => {
            tokio::net::lookup_host((host.as_str(), port.copied().unwrap_or(5432)))
                .await
                .unwrap()
                .next()
                .unwrap()
        }
        #[allow(unreachable_patterns)]
        _ => panic!("DATABASE_URL names a TCP host"),
    };
    let proxy = HoldsCancels::start(upstream).await;
    let via_proxy = format!(
        "postgres://{}@{}/{}?pooling=transaction",
        config.get_user().unwrap_or("postgres"),
        proxy.addr,
        config.get_dbname().unwrap_or("postgres"),
    );
    let (b, schema) = builder(&via_proxy);
    let timeout = Duration::from_millis(500);
    let store = connect(
        b.pool_size(16)
            .timeout(timeout)
            .cleanup_interval(Duration::ZERO),
    )
    .await;
    let fp = Fingerprint([8; 32]);
    let scopes: Vec<ScopeKey> = (0..16).map(|i| order_scope(&format!("c{i}"))).collect();
    for &s in &scopes {
        let Ok(Begin::New(_)) = store.begin(s, fp, conformance::LONG).await else {
            panic!("fresh scope");
        };
    }
    // Lapsed and locked: a begin takes each over with a write, which waits for the lock.
    let locker = raw(&url).await;
    let table = store.table();
    locker
        .batch_execute(&format!(
            "UPDATE {table} SET expires_at = now() - interval '1 minute'"
        ))
        .await
        .unwrap();
    locker
        .batch_execute(&format!("BEGIN; SELECT 1 FROM {table} FOR UPDATE"))
        .await
        .unwrap();
    let begins: Vec<_> = scopes
        .iter()
        .map(|&s| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(s, fp, conformance::LONG).await })
        })
        .collect();
    for b in begins {
        let answer = b.await.unwrap();
        assert!(
            answer.is_err(),
            "a begin behind the lock times out: {answer:?}"
        );
    }
    // Every cancel the store sends, it sends as its statement is abandoned; each held one ends
    // at the store's timeout.
    wait::until_within(Duration::from_secs(10), "some cancels were sent", || {
        proxy.seen.load(Ordering::SeqCst) >= 1
    })
    .await;
    wait::until_within(Duration::from_secs(10), "the cancels gave up", || {
        proxy.held.load(Ordering::SeqCst) == 0
    })
    .await;
    let most = proxy.most.load(Ordering::SeqCst);
    assert!(
        most <= 4,
        "{most} cancel connections were open at once for 16 abandoned statements"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();
    drop(store);
    drop_schema(&url, &schema).await;
}

/// Until a waiter has marked `scope`'s claim watched (read on the server at `url`): the
/// waiter is registered, and the claim's end will be notified to it.
pub(crate) async fn until_watched(store: &PostgresStore, url: &str, scope: ScopeKey) {
    let server = raw(url).await;
    let sql = format!("SELECT watched FROM {} WHERE scope = $1", store.table());
    wait::until_async(wait::LIMIT, "the waiter marks the claim watched", || {
        let (server, sql) = (&server, &sql);
        async move {
            server
                .query_opt(sql, &[&&scope.0[..]])
                .await
                .unwrap()
                .is_some_and(|r| r.get::<_, bool>(0))
        }
    })
    .await;
}

/// Starts `store`'s listener (a wait does) and waits until its first heartbeat proves it
/// hears; the claim waited on is released.
async fn start_hearing(store: &PostgresStore, fp: Fingerprint) {
    let scope = order_scope(&unique("hearing-"));
    let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, t).await })
    };
    until_listener_hears(store, true, "the listener hears its first heartbeat").await;
    store.release(scope, t).await.unwrap();
    waiter.await.unwrap().unwrap();
}

/// Whether `store`'s listener says `hears`, within [`wait::LIMIT`].
async fn until_listener_hears(store: &PostgresStore, hears: bool, what: &str) {
    wait::until_async(wait::LIMIT, what, || {
        let store = store.clone();
        async move { store.listener_hears() == Some(hears) }
    })
    .await;
}

/// A listening connection gone half-open (its packets dropped, no reset ever coming, as behind a
/// dead NAT entry) misses its heartbeat: the listener is found deaf, reconnects, and hears again,
/// and a waiter is then woken by a notification (polling is set far too slow to wake it in
/// time). (Before, it was marked deaf and kept the dead connection until TCP keepalive, hours
/// by default: no notification, no near cache, meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_gone_half_open_reconnects_and_hears_again() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let proxy = Proxy::start(authority(&url)).await;
    let (b, schema) = builder(&url);
    let store = connect(
        b.listen_url(via(&url, proxy.addr()))
            .timeout(Duration::from_millis(500))
            .poll_interval(Duration::from_secs(60), Duration::from_secs(60)),
    )
    .await;
    let fp = Fingerprint([8; 32]);
    start_hearing(&store, fp).await;
    proxy.half_open();
    until_listener_hears(&store, false, "the missed heartbeat is noticed").await;
    until_listener_hears(&store, true, "the listener reconnected and hears again").await;
    let scope = order_scope(&unique("half-open-"));
    let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, t).await })
    };
    until_watched(&store, &url, scope).await;
    store.release(scope, t).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the notification wakes the waiter (polling is a minute away)")
        .unwrap()
        .unwrap();
    drop(store);
    drop_schema(&url, &schema).await;
}

/// A heartbeat the store cannot send (its own connections to the server are cut) leaves
/// nothing relying on the listener: it says it does not know it hears, until a heartbeat is
/// heard again once the store reaches the server. (Before, the last "hears" stood while the
/// store could prove nothing, and the near cache stayed on.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_that_cannot_be_sent_leaves_nothing_relying_on_the_listener() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let proxy = Proxy::start(authority(&url)).await;
    let (b, schema) = builder(&via(&url, proxy.addr()));
    let store = connect(
        b.listen_url(url.clone())
            .timeout(Duration::from_millis(500))
            .near_cache(idempotency_layer::store::NearCache::new(1 << 20)),
    )
    .await;
    start_hearing(&store, Fingerprint([9; 32])).await;
    proxy.cut();
    until_listener_hears(
        &store,
        false,
        "an unsent heartbeat leaves the listener unproven",
    )
    .await;
    proxy.restore();
    until_listener_hears(
        &store,
        true,
        "heard again once the store reaches the server",
    )
    .await;
    drop(store);
    drop_schema(&url, &schema).await;
}

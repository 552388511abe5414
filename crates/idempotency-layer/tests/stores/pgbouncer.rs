//! `PostgresStore` behind PgBouncer in transaction pooling mode (`PGBOUNCER_URL`, e.g.
//! postgres://postgres@127.0.0.1:6432/test?pooling=transaction, with `DATABASE_URL` naming the
//! server behind it): the shared store suite through the pooler, with the listener on a direct
//! connection; then what a transaction pooler breaks when the store does not know it is behind
//! one, and what the store does when its listener cannot hear. `.ci/pgbouncer.sh` starts one.

use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint, NearCache, ScopeKey};
use idempotency_layer::{conformance, IdempotencyStore, PostgresStore};

/// `url` without the store's own `pooling=transaction` parameter (tokio-postgres refuses it).
fn plain(url: &str) -> String {
    url.replace("?pooling=transaction", "")
        .replace("&pooling=transaction", "")
}

/// A plain connection to `url` (the store's own `pooling` parameter taken out).
async fn raw(url: &str) -> tokio_postgres::Client {
    crate::postgres::raw(&plain(url)).await
}

/// The server behind the pooler.
fn direct() -> String {
    std::env::var("DATABASE_URL").expect("PGBOUNCER_URL needs DATABASE_URL, the server behind it")
}

/// The first column of every row `sql` returns, run as a simple query (as a pooler in
/// transaction mode needs).
async fn first_column(client: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    client
        .simple_query(sql)
        .await
        .unwrap()
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

async fn drop_schema(schema: &str) {
    crate::postgres::drop_schema(&direct(), schema).await;
}

/// The shared store suite through PgBouncer: statements through the pooler (its URL says
/// `pooling=transaction`), the listener on the server itself.
struct PgBouncer;

impl Backend for PgBouncer {
    type Store = PostgresStore;
    const URL_VAR: &'static str = "PGBOUNCER_URL";
    const LISTENER_FOLLOWS_URL: bool = false;

    fn namespace() -> String {
        unique("idem_bouncer_")
    }

    async fn connect(url: String, namespace: String, tuning: Tuning) -> PostgresStore {
        let mut b = PostgresStore::builder(&url)
            .schema(namespace)
            .listen_url(direct());
        if let Some(t) = tuning.timeout {
            b = b.timeout(t);
        }
        if tuning.single_connection {
            b = b.pool_size(1);
        }
        if tuning.near_cache {
            b = b.near_cache(NearCache::new(16 << 20));
        }
        if tuning.slow_polling {
            b = b.poll_interval(SLOW_POLL, SLOW_POLL);
        }
        let store = b
            .connect()
            .await
            .expect("PGBOUNCER_URL is set, so PgBouncer must be reachable");
        store.migrate().await.expect("migrate through the pooler");
        store
    }

    async fn drop_namespace(_url: String, namespace: String) {
        drop_schema(&namespace).await;
    }

    fn near_stats(store: &PostgresStore) -> Option<idempotency_layer::store::NearCacheStats> {
        store.near_cache_stats()
    }

    async fn holds(store: &PostgresStore, _url: &str, scope: ScopeKey) -> bool {
        crate::postgres::holds_claim(store, &direct(), scope).await
    }
}

shared_store_suite!(PgBouncer, idempotency_layer::store::AnyStore::Postgres);

/// Without being told, the store's prepared statements fail through a transaction pooler (a
/// statement prepared in one transaction is not there in the next): the reason the mode exists.
/// Told by the URL (`pooling=transaction`), every operation works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_work_through_the_pooler_only_when_the_store_knows_it_is_there() {
    let Some(url) = env_url("PGBOUNCER_URL") else {
        return;
    };
    let schema = unique("idem_bouncer_");
    let unaware = PostgresStore::builder(plain(&url))
        .schema(&schema)
        .connect()
        .await
        .unwrap();
    unaware.migrate().await.unwrap();
    let fp = Fingerprint([4; 32]);
    // Concurrent, so that the pooler hands the store's connections to other server sessions
    // than the ones their statements were prepared on.
    let begins = (0..64).map(|i| {
        let unaware = unaware.clone();
        async move {
            unaware
                .begin(
                    order_scope(&unique(&format!("unaware-{i}-"))),
                    fp,
                    conformance::LONG,
                )
                .await
        }
    });
    let failed = futures_util::future::join_all(begins)
        .await
        .iter()
        .filter(|r| r.is_err())
        .count();
    assert!(
        failed > 0,
        "prepared statements through a transaction pooler fail (if this passes, the pooler \
         runs in session mode)"
    );
    {
        let store = PostgresStore::builder(&url)
            .schema(&schema)
            .connect()
            .await
            .unwrap();
        for i in 0..20 {
            let scope = order_scope(&unique(&format!("aware-{i}-")));
            let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
                panic!("a fresh scope is claimed through the pooler");
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
            assert!(matches!(
                store.begin(scope, fp, conformance::LONG).await,
                Ok(Begin::Completed(_))
            ));
        }
        assert!(store.remove_expired().await.is_ok());
    }
    drop_schema(&schema).await;
}

/// The store sets nothing on the pooler's sessions: a `SET statement_timeout` made once per
/// session would stay on the server session, for every other client the pooler hands it to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_leaks_no_session_setting_to_the_poolers_other_clients() {
    let Some(url) = env_url("PGBOUNCER_URL") else {
        return;
    };
    let schema = unique("idem_bouncer_");
    let store = PostgresStore::builder(&url)
        .schema(&schema)
        .timeout(Duration::from_millis(1234))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let fp = Fingerprint([5; 32]);
    for i in 0..40 {
        let _ = store
            .begin(
                order_scope(&unique(&format!("leak-{i}-"))),
                fp,
                conformance::LONG,
            )
            .await
            .unwrap();
    }
    // Another client of the pooler, on whichever server sessions it gets.
    let other = raw(&url).await;
    for _ in 0..40 {
        let value = first_column(&other, "SHOW statement_timeout").await;
        assert_ne!(
            value.first().map(String::as_str),
            Some("1234ms"),
            "the store's setting leaked to another client of the pooler"
        );
    }
    drop_schema(&schema).await;
}

/// A store told it is behind the transaction pooler, with no listen URL, does not listen (a
/// `LISTEN` there hears nothing): it says so, keeps its near cache off (a record forgotten
/// elsewhere is not replayed from it), and its waiters end by polling. Given a direct listen
/// URL, the listener hears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_cannot_hear_is_found_deaf_and_nothing_relies_on_it() {
    let Some(url) = env_url("PGBOUNCER_URL") else {
        return;
    };
    let schema = unique("idem_bouncer_");
    let deaf = PostgresStore::builder(&url)
        .schema(&schema)
        .near_cache(NearCache::new(1 << 20))
        .poll_interval(Duration::from_millis(20), Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    deaf.migrate().await.unwrap();
    let hearing = PostgresStore::builder(&url)
        .schema(&schema)
        .listen_url(direct())
        .connect()
        .await
        .unwrap();
    let fp = Fingerprint([6; 32]);
    let scope = order_scope(&unique("deaf-"));
    let Ok(Begin::New(t)) = hearing.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    // A wait starts a store's listener.
    let started = {
        let hearing = hearing.clone();
        tokio::spawn(async move { hearing.wait(scope, t).await })
    };
    // Starts both listeners; the deaf one's waiter still sees the claim end, by polling.
    let waiter = {
        let deaf = deaf.clone();
        tokio::spawn(async move { deaf.wait(scope, t).await })
    };
    wait::until_async(
        wait::LIMIT,
        "the direct listener hears its heartbeat",
        || {
            let hearing = hearing.clone();
            async move { hearing.listener_hears() == Some(true) }
        },
    )
    .await;
    hearing
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
        .expect("a deaf listener's waiter ends by polling")
        .unwrap()
        .unwrap();
    started.await.unwrap().unwrap();
    // Its first heartbeat must arrive within twice the store's timeout; the listener behind
    // the pooler never hears it, and says so.
    wait::until_async(
        wait::LIMIT,
        "the listener behind the pooler is found deaf",
        || {
            let deaf = deaf.clone();
            async move { deaf.listener_hears() == Some(false) }
        },
    )
    .await;
    assert_eq!(hearing.listener_hears(), Some(true));
    // Its near cache stays off: a record forgotten on another instance is not replayed.
    for _ in 0..3 {
        assert!(matches!(
            deaf.begin(scope, fp, conformance::LONG).await,
            Ok(Begin::Completed(_))
        ));
    }
    assert_eq!(
        deaf.near_cache_stats().unwrap().hits,
        0,
        "the near cache is off"
    );
    assert!(hearing.forget(scope).await.unwrap());
    assert!(
        matches!(
            deaf.begin(scope, fp, conformance::LONG).await,
            Ok(Begin::New(_))
        ),
        "the forgotten record is not replayed"
    );
    drop_schema(&schema).await;
}

/// A store told it is behind the transaction pooler, with no listen URL, sends no `LISTEN`
/// through it: a `LISTEN` stays on the server session it ran on, which the pooler then hands to
/// its other clients (their sessions hear the store's channel). Another client of the pooler
/// finds no channel listened to on any session it gets. (Before, the listener sent its
/// `LISTEN` through the pooler, and was found deaf only by its heartbeat.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_behind_the_pooler_without_a_listen_url_sends_no_listen_through_it() {
    let Some(url) = env_url("PGBOUNCER_URL") else {
        return;
    };
    let schema = unique("idem_bouncer_");
    let store = PostgresStore::builder(&url)
        .schema(&schema)
        .poll_interval(Duration::from_millis(20), Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        store.listener_hears(),
        Some(false),
        "known deaf from the start"
    );
    let fp = Fingerprint([7; 32]);
    let scope = order_scope(&unique("no-listen-"));
    let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    // A wait (which starts a listener, where there is one) ends by polling.
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, t).await })
    };
    // The waiter is registered: a listener, were there one, has been started.
    crate::postgres::until_watched(&store, &direct(), scope).await;
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
        .expect("the waiter ends by polling")
        .unwrap()
        .unwrap();
    let other = raw(&url).await;
    for _ in 0..40 {
        let channels = first_column(&other, "SELECT pg_listening_channels()").await;
        assert!(
            !channels.iter().any(|c| c.starts_with("idem_")),
            "a session the pooler gave another client listens to {channels:?}"
        );
    }
    assert_eq!(store.listener_hears(), Some(false));
    drop_schema(&schema).await;
}

/// Statements abandoned at the store's timeout through the pooler are each cancelled, and
/// PgBouncer keeps running. The completes block on a row a direct transaction holds locked, so
/// every cancel is forwarded to a busy server session. (Before, the store sent its cancels as
/// `tokio-postgres` does, closing its side at once: Debian 12's PgBouncer 1.18 freed the
/// cancel client while it was still forwarding the cancel (pgbouncer#801) and exited with a
/// fatal "bad client state: 0", which the store tests hit once the fault-proxy tests added
/// many more cancels.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_of_abandoned_statements_leave_the_pooler_running() {
    let Some(url) = env_url("PGBOUNCER_URL") else {
        return;
    };
    let schema = unique("idem_bouncer_");
    let store = PostgresStore::builder(&url)
        .schema(&schema)
        .listen_url(direct())
        .timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let fp = Fingerprint([6; 32]);
    let scope = order_scope(&unique("cancelled-"));
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    // The claim's row, locked by a transaction of its own on the server.
    let holder = crate::postgres::raw(&direct()).await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .execute(
            &format!(
                "SELECT 1 FROM {} WHERE scope = $1 FOR UPDATE",
                store.table()
            ),
            &[&&scope.0[..]],
        )
        .await
        .unwrap();
    let pooler_answers = || async {
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            let (client, conn) =
                tokio_postgres::connect(&plain(&url), tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            client.simple_query("SELECT 1").await
        })
        .await
        .expect("the pooler answers within 10 s");
        answered.map(|_| ())
    };
    // Each round's cancels are forwarded while the next round runs (a timeout later): the
    // pooler must answer after every round.
    for round in 0..6 {
        let blocked = (0..8).map(|_| {
            let store = store.clone();
            async move {
                store
                    .complete(
                        scope,
                        token,
                        conformance::sample_record(fp).into(),
                        conformance::LONG,
                    )
                    .await
            }
        });
        for r in futures_util::future::join_all(blocked).await {
            assert!(
                r.is_err(),
                "round {round}: a complete behind the lock times out"
            );
        }
        let after = pooler_answers().await;
        assert!(
            after.is_ok(),
            "round {round}: PgBouncer is still running: {after:?}"
        );
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
    drop_schema(&schema).await;
}

//! A replay on `PostgresStore` is a read: it takes no transaction id and leaves the record's row
//! untouched (no row lock, no new version, so no WAL and no commit flush).
//!
//! A binary of its own, so that no other test consumes transaction ids while this one counts
//! them (cargo runs test binaries one after another). Against the real PostgreSQL named by
//! `DATABASE_URL`; unset, the test says so and passes, except in CI, where it fails.

#![cfg(all(feature = "postgres", feature = "conformance"))]

use idempotency_layer::store::{Begin, Fingerprint};
use idempotency_layer::{conformance, IdempotencyStore, PostgresStore, Scope};
use test_support::env::env_url;

const REPLAYS: i64 = 1_000;

async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("raw connection to DATABASE_URL");
    tokio::spawn(conn);
    client
}

/// `xmin` and `xmax` of the scope's row: a new version changes `xmin`, a row lock (`FOR
/// UPDATE`, or `ON CONFLICT DO UPDATE` whose `WHERE` is false) sets `xmax`.
async fn row_versions(db: &tokio_postgres::Client, schema: &str, scope: &[u8]) -> (i64, i64) {
    let row = db
        .query_one(
            &format!(
                "SELECT xmin::text::bigint, xmax::text::bigint \
                 FROM \"{schema}\".idempotency_records WHERE scope = $1"
            ),
            &[&scope],
        )
        .await
        .expect("the record's row");
    (row.get(0), row.get(1))
}

/// The next transaction id to be assigned (reading it assigns one).
async fn next_txid(db: &tokio_postgres::Client) -> i64 {
    db.query_one("SELECT txid_current()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_replays_take_no_transaction_id_and_write_nothing() {
    let Some(url) = env_url("DATABASE_URL") else {
        return;
    };
    let schema = format!(
        "idem_replays_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let store = PostgresStore::builder(&url)
        .schema(&schema)
        .connect()
        .await
        .expect("DATABASE_URL is set, so PostgreSQL must be reachable");
    store.migrate().await.expect("migrate");
    let db = raw(&url).await;

    let method = Scope::http_operation(&http::Method::POST, "/orders");
    let scope = Scope::new("shop", &method, "replayed-key").key();
    let fp = Fingerprint([1; 32]);
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("a fresh scope is claimed");
    };
    let record = conformance::sample_record(fp);
    store
        .complete(scope, token, record.clone().into(), conformance::LONG)
        .await
        .expect("complete");

    let versions_before = row_versions(&db, &schema, &scope.0).await;
    let wal_before: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let txid_before = next_txid(&db).await;
    for _ in 0..REPLAYS {
        match store.begin(scope, fp, conformance::LONG).await {
            Ok(Begin::Completed(r)) => assert_eq!(*r, record),
            other => panic!("a replay answers the record, got {other:?}"),
        }
    }
    let txid_after = next_txid(&db).await;
    let wal = db
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint",
            &[&wal_before],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    let versions_after = row_versions(&db, &schema, &scope.0).await;

    // Nothing else runs in this binary, so the ids taken between the two reads are the second
    // read's own and whatever the server's background work took (a handful at most); each
    // replay that locked or wrote the row took one of its own.
    let taken = txid_after - txid_before - 1;
    eprintln!("{REPLAYS} replays: {taken} transaction ids, {wal} bytes of WAL (server-wide)");
    assert!(
        taken < 10,
        "{REPLAYS} replays took {taken} transaction ids: a replay must be a read"
    );
    assert_eq!(
        versions_after, versions_before,
        "a replay must neither lock (xmax) nor rewrite (xmin) the record's row"
    );
    assert_eq!(versions_after.1, 0, "the record's row is not locked");

    db.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

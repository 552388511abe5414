//! Transactional completion (`TxCompletion`) against a real PostgreSQL, over real sockets
//! (axum::serve, hyper-util clients over HTTP/1.1 and h2c): the order row and the record commit
//! in one transaction; a rollback releases the claim and the retry runs once; a claim taken over
//! mid-transaction is fenced and the handler rolls back; duplicates at once make one row; and
//! the record is the one the layer would have written itself, byte for byte.
//!
//! Each test runs twice, once per client a handler's transaction can be on (`for_each_kind!`):
//! tokio-postgres on the store's own pool (`complete_in`), and, with the feature `sqlx`, a sqlx
//! `PgPool` of the same database (`complete_in_sqlx`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::{post, MethodRouter};
use axum::{Extension, Router};
use bytes::Bytes;
use futures_util::stream;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body::Frame;
use http_body_util::{Full, StreamBody};
use idempotency_layer::conformance::{FaultStore, Op};
use idempotency_layer::store::{decode_record, AnyStore, Backend, ScopeKey};
use idempotency_layer::{
    IdempotencyLayer, IdempotencyStore, MemoryStore, PostgresStore, Scope, TxCompletion,
    TxCompletionError,
};
use test_support::net::{client_h2, collect, Collected};
use tokio::sync::{mpsc, Notify};

use super::{drop_schema, raw};
use crate::support::{client, env_url, order_scope, serve, unique, wait, HttpClient};

/// Runs each named test (an `async fn(Kind)`) once per [`Kind`], as `on_tokio_postgres::NAME`
/// and `on_sqlx::NAME`.
macro_rules! for_each_kind {
    ($($test:ident),* $(,)?) => {
        /// The handlers' transactions on tokio-postgres: the store's own pool, `complete_in`.
        mod on_tokio_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Kind::TokioPostgres).await
                }
            )*
        }

        /// The handlers' transactions on sqlx: a `PgPool` of the store's database,
        /// `complete_in_sqlx`.
        #[cfg(feature = "sqlx")]
        mod on_sqlx {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Kind::Sqlx).await
                }
            )*
        }
    };
}

for_each_kind!(
    the_order_and_its_record_commit_in_one_transaction_and_duplicates_replay_it,
    a_rollback_releases_the_claim_and_the_retry_runs_once,
    a_transaction_retried_inside_the_handler_counts_its_last_write_only,
    a_response_other_than_the_recorded_one_is_replaced_by_the_record,
    a_claim_taken_over_mid_transaction_is_fenced_and_the_handler_rolls_back,
    a_transaction_on_another_database_is_refused_and_the_claim_released,
    duplicates_at_once_make_one_order,
    the_record_written_in_the_transaction_is_the_layers_byte_for_byte,
    a_wrapper_store_keeps_transactional_completion,
);

/// The client a handler's transactions are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// tokio-postgres, through a deadpool pool (the store's own, on its database).
    TokioPostgres,
    /// sqlx, through a `PgPool` of its own.
    #[cfg(feature = "sqlx")]
    Sqlx,
}

/// Where a handler opens its transactions.
#[derive(Clone)]
enum Pool {
    TokioPostgres(deadpool_postgres::Pool),
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::PgPool),
}

impl Pool {
    /// A pool of `kind` on the database of `url` (not the store's: for the store's database,
    /// [`Db::pool`]).
    async fn on(kind: Kind, url: &str) -> Pool {
        match kind {
            Kind::TokioPostgres => {
                let config = url.parse().expect("a PostgreSQL URL");
                let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
                Pool::TokioPostgres(
                    deadpool_postgres::Pool::builder(manager)
                        .max_size(4)
                        .build()
                        .unwrap(),
                )
            }
            #[cfg(feature = "sqlx")]
            Kind::Sqlx => Pool::Sqlx(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect(url)
                    .await
                    .expect("DATABASE_URL is set, so PostgreSQL must be reachable (sqlx)"),
            ),
        }
    }

    async fn conn(&self) -> Conn {
        match self {
            Pool::TokioPostgres(pool) => {
                Conn::TokioPostgres(pool.get().await.expect("a pooled connection"))
            }
            #[cfg(feature = "sqlx")]
            Pool::Sqlx(pool) => Conn::Sqlx(pool.acquire().await.expect("a pooled connection")),
        }
    }
}

enum Conn {
    TokioPostgres(deadpool_postgres::Object),
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::pool::PoolConnection<sqlx::Postgres>),
}

impl Conn {
    async fn begin(&mut self) -> Tx<'_> {
        match self {
            Conn::TokioPostgres(conn) => {
                Tx::TokioPostgres(conn.transaction().await.expect("BEGIN"))
            }
            #[cfg(feature = "sqlx")]
            Conn::Sqlx(conn) => {
                Tx::Sqlx(sqlx::Connection::begin(&mut **conn).await.expect("BEGIN"))
            }
        }
    }
}

/// A handler's transaction; dropped: rolled back.
enum Tx<'c> {
    TokioPostgres(deadpool_postgres::Transaction<'c>),
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::Transaction<'c, sqlx::Postgres>),
}

impl Tx<'_> {
    /// Inserts `key`'s order row; its id.
    async fn insert_order(&mut self, schema: &str, key: &str, item: &[u8]) -> i64 {
        let sql =
            format!("INSERT INTO \"{schema}\".orders (key, item) VALUES ($1, $2) RETURNING id");
        let item = String::from_utf8_lossy(item).into_owned();
        match self {
            Tx::TokioPostgres(tx) => tx
                .query_one(&sql, &[&key, &item])
                .await
                .expect("insert the order")
                .get(0),
            #[cfg(feature = "sqlx")]
            Tx::Sqlx(tx) => sqlx::query_scalar(&sql)
                .bind(key)
                .bind(item)
                .fetch_one(&mut **tx)
                .await
                .expect("insert the order"),
        }
    }

    /// `complete_in` or `complete_in_sqlx`.
    async fn complete(
        &mut self,
        completion: &TxCompletion,
        response: Response,
    ) -> Result<Response, TxCompletionError> {
        let response = match self {
            Tx::TokioPostgres(tx) => completion.complete_in(tx, response).await?,
            #[cfg(feature = "sqlx")]
            Tx::Sqlx(tx) => completion.complete_in_sqlx(tx, response).await?,
        };
        Ok(response.into_response())
    }

    async fn commit(self) {
        match self {
            Tx::TokioPostgres(tx) => tx.commit().await.expect("COMMIT"),
            #[cfg(feature = "sqlx")]
            Tx::Sqlx(tx) => tx.commit().await.expect("COMMIT"),
        }
    }

    async fn rollback(self) {
        match self {
            Tx::TokioPostgres(tx) => tx.rollback().await.expect("ROLLBACK"),
            #[cfg(feature = "sqlx")]
            Tx::Sqlx(tx) => tx.rollback().await.expect("ROLLBACK"),
        }
    }
}

/// A schema of the test's own: the store's table, and an `orders` table beside it.
struct Db {
    url: String,
    schema: String,
    store: PostgresStore,
    sql: tokio_postgres::Client,
}

impl Db {
    async fn open() -> Option<Db> {
        let url = env_url("DATABASE_URL")?;
        let schema = unique("idem_tx_");
        let store = PostgresStore::builder(&url)
            .schema(&schema)
            .connect()
            .await
            .expect("DATABASE_URL is set, so PostgreSQL must be reachable");
        store.migrate().await.expect("migrate");
        let sql = raw(&url).await;
        sql.batch_execute(&format!(
            "CREATE TABLE \"{schema}\".orders (id bigserial PRIMARY KEY, key text NOT NULL, \
             item text NOT NULL)"
        ))
        .await
        .unwrap();
        Some(Db {
            url,
            schema,
            store,
            sql,
        })
    }

    /// Where handlers of `kind` open their transactions on the store's database: the store's
    /// own pool, or a sqlx pool of the same URL.
    async fn pool(&self, kind: Kind) -> Pool {
        match kind {
            Kind::TokioPostgres => Pool::TokioPostgres(self.store.pool().clone()),
            #[cfg(feature = "sqlx")]
            Kind::Sqlx => Pool::on(kind, &self.url).await,
        }
    }

    /// How many order rows `key` has.
    async fn orders(&self, key: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM \"{}\".orders WHERE key = $1",
            self.schema
        );
        self.sql.query_one(&sql, &[&key]).await.unwrap().get(0)
    }

    /// The state and the encoded record of `scope`'s row in the store's table, if it has one.
    async fn entry(&self, scope: ScopeKey) -> Option<(String, Option<Vec<u8>>)> {
        let sql = format!(
            "SELECT state, record FROM {} WHERE scope = $1",
            self.store.table()
        );
        let rows = self.sql.query(&sql, &[&&scope.0[..]]).await.unwrap();
        rows.first().map(|r| (r.get(0), r.get(1)))
    }

    /// Did one transaction write both `key`'s order row and `scope`'s record (the same `xmin`)?
    async fn written_together(&self, key: &str, scope: ScopeKey) -> bool {
        let sql = format!(
            "SELECT (SELECT xmin FROM \"{}\".orders WHERE key = $1) = \
                    (SELECT xmin FROM {} WHERE scope = $2)",
            self.schema,
            self.store.table()
        );
        self.sql
            .query_one(&sql, &[&key, &&scope.0[..]])
            .await
            .unwrap()
            .get(0)
    }

    async fn drop(self) {
        drop_schema(&self.url, &self.schema).await;
    }
}

fn key_of(headers: &HeaderMap) -> String {
    headers["x-idempotency-key"].to_str().unwrap().to_owned()
}

fn created(id: i64) -> Response {
    (
        StatusCode::CREATED,
        [("x-order-id", id.to_string())],
        format!("order {id}"),
    )
        .into_response()
}

/// `route` at `POST /orders` behind `layer` (tenant `shop`, as [`order_scope`] has it).
fn app<St: IdempotencyStore>(layer: &IdempotencyLayer<St>, route: MethodRouter) -> Router {
    Router::new().route("/orders", route).layer(
        layer
            .clone()
            .tenant(idempotency_layer::TenantSource::fixed("shop")),
    )
}

fn order(addr: std::net::SocketAddr, key: &str, item: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/orders"))
        .header("x-idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::copy_from_slice(item.as_bytes())))
        .unwrap()
}

async fn send(client: &HttpClient, req: Request<Full<Bytes>>) -> Collected {
    let res = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("the server answers within 30 s")
        .expect("HTTP request");
    collect(res).await
}

/// The handler the issue describes: the order row and the record in one transaction.
fn create_order_in_one_transaction(
    pool: Pool,
    schema: String,
    executions: Arc<AtomicUsize>,
) -> MethodRouter {
    post(
        move |Extension(completion): Extension<TxCompletion>, headers: HeaderMap, item: Bytes| async move {
            executions.fetch_add(1, Ordering::SeqCst);
            let mut conn = pool.conn().await;
            let mut tx = conn.begin().await;
            let id = tx.insert_order(&schema, &key_of(&headers), &item).await;
            let response = tx
                .complete(&completion, created(id))
                .await
                .expect("recorded in the transaction");
            tx.commit().await;
            response
        },
    )
}

async fn the_order_and_its_record_commit_in_one_transaction_and_duplicates_replay_it(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(db.store.clone());
    let addr = serve(app(
        &layer,
        create_order_in_one_transaction(db.pool(kind).await, db.schema.clone(), executions.clone()),
    ))
    .await;
    for (n, client) in [client(), client_h2()].into_iter().enumerate() {
        let key = unique("order-");
        let first = send(&client, order(addr, &key, "a book")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        assert!(
            db.written_together(&key, order_scope(&key)).await,
            "the order row and the record were written by one transaction"
        );
        let (state, _) = db.entry(order_scope(&key)).await.expect("a row");
        assert_eq!(state, "completed");

        let retry = send(&client, order(addr, &key, "a book")).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.headers["x-order-id"], first.headers["x-order-id"]);
        assert_eq!(db.orders(&key).await, 1, "one order row");
        assert_eq!(executions.load(Ordering::SeqCst), n + 1, "ran once per key");
    }
    let stats = layer.stats();
    assert_eq!((stats.executed, stats.recorded, stats.replayed), (2, 2, 2));
    assert_eq!(
        stats.released, 0,
        "nothing released: the claims were completed"
    );
    assert_eq!(stats.store_errors, 0);
    db.drop().await;
}

/// A store that wraps a `PostgresStore` (here the conformance module's `FaultStore`, as a
/// metrics or tracing wrapper would) keeps every capability: its handlers get `TxCompletion`
/// (the handler's extractor fails with 500 without it), the record commits with the order, and
/// the layer leaves the claim as the commit left it.
async fn a_wrapper_store_keeps_transactional_completion(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let executions = Arc::new(AtomicUsize::new(0));
    let wrapper = FaultStore::new(db.store.clone());
    assert_eq!(wrapper.backend(), Backend::Postgres);
    let layer = IdempotencyLayer::new(wrapper.clone());
    let addr = serve(app(
        &layer,
        create_order_in_one_transaction(db.pool(kind).await, db.schema.clone(), executions.clone()),
    ))
    .await;
    let client = client();
    let key = unique("order-");
    let first = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(
        db.written_together(&key, order_scope(&key)).await,
        "the order row and the record were written by one transaction"
    );
    let retry = send(&client, order(addr, &key, "a book")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(db.orders(&key).await, 1, "one order row");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(
        wrapper.calls(Op::Begin).reached,
        2,
        "the claims went through the wrapper"
    );
    let stats = layer.stats();
    assert_eq!((stats.recorded, stats.released), (1, 0), "{stats:?}");
    db.drop().await;
}

async fn a_rollback_releases_the_claim_and_the_retry_runs_once(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(db.store.clone());
    let (pool, schema, runs) = (db.pool(kind).await, db.schema.clone(), executions.clone());
    let handler = post(
        move |Extension(completion): Extension<TxCompletion>, headers: HeaderMap, item: Bytes| async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let mut conn = pool.conn().await;
            let mut tx = conn.begin().await;
            let id = tx.insert_order(&schema, &key_of(&headers), &item).await;
            let response = tx.complete(&completion, created(id)).await.unwrap();
            if run == 1 {
                // Something after the record failed: roll back, answer retryably.
                tx.rollback().await;
                return (StatusCode::SERVICE_UNAVAILABLE, "rolled back").into_response();
            }
            tx.commit().await;
            response
        },
    );
    let addr = serve(app(&layer, handler)).await;
    let client = client();
    let key = unique("order-");

    let first = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert_eq!(
        db.orders(&key).await,
        0,
        "the order rolled back with the record"
    );
    assert_eq!(
        db.entry(order_scope(&key)).await,
        None,
        "the claim is released by the time the response arrives (not left to lapse)"
    );
    assert_eq!(layer.stats().released, 1);

    let retry = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "the retry ran the handler");
    let again = send(&client, order(addr, &key, "a book")).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(
        executions.load(Ordering::SeqCst),
        2,
        "once more after the rollback, no more"
    );
    assert_eq!(db.orders(&key).await, 1, "one order row");
    db.drop().await;
}

async fn a_transaction_retried_inside_the_handler_counts_its_last_write_only(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let layer = IdempotencyLayer::new(db.store.clone());
    let (pool, schema) = (db.pool(kind).await, db.schema.clone());
    // Returns the response of the transaction that committed (`stale`: of the one that rolled
    // back, which the layer must not take for the record).
    let handler = |stale: bool| {
        let (pool, schema) = (pool.clone(), schema.clone());
        post(
            move |Extension(completion): Extension<TxCompletion>,
                  headers: HeaderMap,
                  item: Bytes| async move {
                let mut conn = pool.conn().await;
                let key = key_of(&headers);
                let mut tx = conn.begin().await;
                let id = tx.insert_order(&schema, &key, &item).await;
                let rolled_back = tx.complete(&completion, created(id)).await.unwrap();
                tx.rollback().await; // say, a serialization failure at COMMIT
                let mut tx = conn.begin().await;
                let id = tx.insert_order(&schema, &key, &item).await;
                let committed = tx.complete(&completion, created(id)).await.unwrap();
                tx.commit().await;
                if stale {
                    rolled_back
                } else {
                    committed
                }
            },
        )
    };
    let fresh = serve(app(&layer, handler(false))).await;
    let stale = serve(app(&layer, handler(true))).await;
    let client = client();
    for addr in [fresh, stale] {
        let key = unique("order-");
        let first = send(&client, order(addr, &key, "a book")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let retry = send(&client, order(addr, &key, "a book")).await;
        assert!(retry.replayed());
        assert_eq!(
            first.body, retry.body,
            "the client got the committed transaction's response, like every duplicate"
        );
        assert_eq!(db.orders(&key).await, 1);
        assert!(db.written_together(&key, order_scope(&key)).await);
    }
    let stats = layer.stats();
    assert_eq!(stats.released, 0);
    assert_eq!(stats.recorded, 2);
    db.drop().await;
}

async fn a_response_other_than_the_recorded_one_is_replaced_by_the_record(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let layer = IdempotencyLayer::new(db.store.clone());
    let (pool, schema) = (db.pool(kind).await, db.schema.clone());
    let handler = post(
        move |Extension(completion): Extension<TxCompletion>, headers: HeaderMap, item: Bytes| async move {
            let mut conn = pool.conn().await;
            let mut tx = conn.begin().await;
            let id = tx.insert_order(&schema, &key_of(&headers), &item).await;
            let _recorded = tx.complete(&completion, created(id)).await.unwrap();
            tx.commit().await;
            (StatusCode::OK, "something else").into_response()
        },
    );
    let addr = serve(app(&layer, handler)).await;
    let client = client();
    let key = unique("order-");
    let first = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(first.body.starts_with(b"order "), "{first:?}");
    let retry = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(
        (retry.status, &retry.body),
        (first.status, &first.body),
        "the client and every duplicate see the same response: the recorded one"
    );
    assert_eq!(db.orders(&key).await, 1);
    db.drop().await;
}

async fn a_claim_taken_over_mid_transaction_is_fenced_and_the_handler_rolls_back(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let layer = IdempotencyLayer::new(db.store.clone());
    let (in_tx, proceed) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (errors, mut error) = mpsc::unbounded_channel::<TxCompletionError>();
    let runs = Arc::new(AtomicUsize::new(0));
    let (pool, schema) = (db.pool(kind).await, db.schema.clone());
    let handler = {
        let (in_tx, proceed) = (in_tx.clone(), proceed.clone());
        post(
            move |Extension(completion): Extension<TxCompletion>,
                  headers: HeaderMap,
                  item: Bytes| async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let mut conn = pool.conn().await;
                let mut tx = conn.begin().await;
                let id = tx.insert_order(&schema, &key_of(&headers), &item).await;
                if run == 1 {
                    // The first run stalls inside its transaction while the key is taken over.
                    in_tx.notify_one();
                    proceed.notified().await;
                }
                match tx.complete(&completion, created(id)).await {
                    Ok(response) => {
                        tx.commit().await;
                        response
                    }
                    Err(e) => {
                        let answer = (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
                        errors.send(e).unwrap();
                        drop(tx); // rolled back
                        answer.into_response()
                    }
                }
            },
        )
    };
    let addr = serve(app(&layer, handler)).await;
    let client = client();
    let key = unique("order-");

    let first = tokio::spawn({
        let (client, key) = (client.clone(), key.clone());
        async move { send(&client, order(addr, &key, "a book")).await }
    });
    in_tx.notified().await;
    // An operator forgets the key, and a retry claims it and runs to completion meanwhile.
    let method = Scope::http_operation(&Method::POST, "/orders");
    assert!(layer
        .forget(Scope::new("shop", &method, &key))
        .await
        .unwrap());
    let second = send(&client, order(addr, &key, "a book")).await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed(), "the second request ran the handler");
    proceed.notify_one();

    let e = error.recv().await.expect("the first run's error");
    assert!(matches!(e, TxCompletionError::Fenced), "{e:?}");
    assert!(e.to_string().contains("roll the transaction back"), "{e}");
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, &first.body),
        (second.status, &second.body),
        "the fenced request's client gets the outcome of the request that owns the key"
    );
    assert_eq!(db.orders(&key).await, 1, "the fenced order rolled back");
    assert!(db.written_together(&key, order_scope(&key)).await);
    let retry = send(&client, order(addr, &key, "a book")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, second.body);
    db.drop().await;
}

async fn a_transaction_on_another_database_is_refused_and_the_claim_released(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    // The server's maintenance database: the store's table is not there.
    let (server, _) = db
        .url
        .split_once('?')
        .map_or(db.url.as_str(), |(u, _)| u)
        .rsplit_once('/')
        .unwrap();
    let elsewhere = format!("{server}/postgres");
    let other = Pool::on(kind, &elsewhere).await;
    let layer = IdempotencyLayer::new(db.store.clone());
    let (errors, mut error) = mpsc::unbounded_channel::<TxCompletionError>();
    let handler = post(
        move |Extension(completion): Extension<TxCompletion>| async move {
            let mut conn = other.conn().await;
            let mut tx = conn.begin().await;
            match tx.complete(&completion, created(1)).await {
                Ok(_) => panic!("recorded in another database"),
                Err(e) => {
                    let answer = (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
                    errors.send(e).unwrap();
                    answer.into_response()
                }
            }
        },
    );
    let addr = serve(app(&layer, handler)).await;
    let key = unique("order-");
    let answer = send(&client(), order(addr, &key, "a book")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    let e = error.recv().await.unwrap();
    assert!(matches!(e, TxCompletionError::OtherDatabase), "{e:?}");
    assert!(e.to_string().contains("PostgresStore::pool"), "{e}");
    assert_eq!(
        db.entry(order_scope(&key)).await,
        None,
        "the claim is released"
    );
    db.drop().await;
}

async fn duplicates_at_once_make_one_order(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    const DUPLICATES: usize = 16;
    let layer = IdempotencyLayer::new(db.store.clone());
    let gate = Arc::new(Notify::new());
    let executions = Arc::new(AtomicUsize::new(0));
    let (pool, schema) = (db.pool(kind).await, db.schema.clone());
    let handler = {
        let (gate, executions) = (gate.clone(), executions.clone());
        post(
            move |Extension(completion): Extension<TxCompletion>,
                  headers: HeaderMap,
                  item: Bytes| async move {
                executions.fetch_add(1, Ordering::SeqCst);
                let mut conn = pool.conn().await;
                let mut tx = conn.begin().await;
                let id = tx.insert_order(&schema, &key_of(&headers), &item).await;
                // Held until every duplicate waits: they are woken by the commit.
                gate.notified().await;
                let response = tx.complete(&completion, created(id)).await.unwrap();
                tx.commit().await;
                response
            },
        )
    };
    let addr = serve(app(&layer, handler)).await;
    let key = unique("order-");
    let (h1, h2) = (client(), client_h2());
    let requests: Vec<_> = (0..DUPLICATES)
        .map(|i| {
            let client = if i % 2 == 0 { h1.clone() } else { h2.clone() };
            let key = key.clone();
            tokio::spawn(async move { send(&client, order(addr, &key, "a book")).await })
        })
        .collect();
    let stats = layer.clone();
    wait::until("every duplicate waits for the first", || {
        stats.stats().waited == DUPLICATES as u64 - 1
    })
    .await;
    gate.notify_one();
    let mut answers = Vec::new();
    for r in requests {
        answers.push(r.await.unwrap());
    }
    for a in &answers {
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
        assert_eq!(
            a.body, answers[0].body,
            "every duplicate gets the same order"
        );
    }
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(db.orders(&key).await, 1, "one order row");
    db.drop().await;
}

/// The responses the byte-for-byte test records both ways: each as the handler makes it.
fn case_response(case: &str) -> Response {
    let frames = |frames: Vec<Frame<Bytes>>| {
        Body::new(StreamBody::new(stream::iter(
            frames.into_iter().map(Ok::<_, std::convert::Infallible>),
        )))
    };
    let data = |s: &'static str| Frame::data(Bytes::from_static(s.as_bytes()));
    match case {
        "json" => Response::builder()
            .status(StatusCode::CREATED)
            .header("content-type", "application/json")
            .header("x-repeated", "1")
            .header("x-repeated", "2")
            .body(Body::from(r#"{"order":"o-1"}"#))
            .unwrap(),
        "streamed" => Response::builder()
            .header("content-type", "text/plain")
            .body(frames(vec![data("one, "), data("two, "), data("three")]))
            .unwrap(),
        "trailers" => {
            let mut trailers = HeaderMap::new();
            trailers.insert("x-checksum", HeaderValue::from_static("c0ffee"));
            Response::builder()
                .body(frames(vec![data("body"), Frame::trailers(trailers)]))
                .unwrap()
        }
        "large" => Response::builder()
            .body(frames(
                (0..4)
                    .map(|_| Frame::data(Bytes::from(vec![b'x'; 1000])))
                    .collect(),
            ))
            .unwrap(),
        "not recordable" => (StatusCode::BAD_REQUEST, "no such book").into_response(),
        other => panic!("unknown case {other}"),
    }
}

async fn the_record_written_in_the_transaction_is_the_layers_byte_for_byte(kind: Kind) {
    let Some(db) = Db::open().await else { return };
    let layer = IdempotencyLayer::new(db.store.clone()).max_record_bytes(2048);
    let pool = db.pool(kind).await;
    // `x-case` names the response; `x-by: tx` records it in a transaction, else the layer does.
    let handler = post(
        move |Extension(completion): Extension<TxCompletion>, headers: HeaderMap| async move {
            let response = case_response(headers["x-case"].to_str().unwrap());
            if headers["x-by"] != "tx" {
                return response;
            }
            let mut conn = pool.conn().await;
            let mut tx = conn.begin().await;
            let response = tx.complete(&completion, response).await.unwrap();
            tx.commit().await;
            response
        },
    );
    let addr = serve(app(&layer, handler)).await;
    let client = client_h2(); // trailers reach the client over HTTP/2
    let request = |key: &str, case: &str, by: &str| {
        let mut req = order(addr, key, "the same request");
        let h = req.headers_mut();
        h.insert("x-case", HeaderValue::from_str(case).unwrap());
        h.insert("x-by", HeaderValue::from_str(by).unwrap());
        req
    };
    for case in ["json", "streamed", "trailers", "large", "not recordable"] {
        let (by_tx, by_layer) = (unique("tx-"), unique("layer-"));
        let sent_tx = send(&client, request(&by_tx, case, "tx")).await;
        let sent_layer = send(&client, request(&by_layer, case, "layer")).await;
        assert_eq!(
            (sent_tx.status, &sent_tx.body, &sent_tx.trailers),
            (sent_layer.status, &sent_layer.body, &sent_layer.trailers),
            "{case}: the first client gets the same response either way"
        );
        if case == "not recordable" {
            // The layer releases the claim of an outcome it does not record in the background,
            // once the response has ended: wait for both releases (the only ones here).
            wait::until("both claims released", || layer.stats().released == 2).await;
        }
        let (entry_tx, entry_layer) = (
            db.entry(order_scope(&by_tx)).await,
            db.entry(order_scope(&by_layer)).await,
        );
        if case == "not recordable" {
            assert_eq!(
                entry_tx, None,
                "{case}: nothing recorded, the claim released"
            );
            assert_eq!(entry_layer, None, "{case}");
            continue;
        }
        let (state, record_tx) = entry_tx.expect("a row");
        assert_eq!(state, "completed", "{case}");
        let record_layer = entry_layer.expect("a row").1;
        assert_eq!(
            record_tx, record_layer,
            "{case}: the same record, byte for byte"
        );
        let record = decode_record(&record_tx.unwrap()).unwrap();
        assert_eq!(record.body_omitted(), case == "large", "{case}");
        assert_eq!(record.trailers().is_some(), case == "trailers", "{case}");

        let (replay_tx, replay_layer) = (
            send(&client, request(&by_tx, case, "tx")).await,
            send(&client, request(&by_layer, case, "layer")).await,
        );
        assert!(replay_tx.replayed() && replay_layer.replayed(), "{case}");
        let mut headers = replay_layer.headers.clone();
        headers.insert("date", replay_tx.headers["date"].clone());
        assert_eq!(
            (&replay_tx.headers, &replay_tx.body, &replay_tx.trailers),
            (&headers, &replay_layer.body, &replay_layer.trailers),
            "{case}: the same replay"
        );
    }
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_is_offered_to_a_leader_on_a_postgres_store_only() {
    let Some(db) = Db::open().await else { return };
    let seen = Arc::new(Mutex::new(Vec::new()));
    let route = || {
        let seen = seen.clone();
        post(
            move |completion: Option<Extension<TxCompletion>>| async move {
                seen.lock().unwrap().push(completion.is_some());
                StatusCode::CREATED
            },
        )
        .get(|completion: Option<Extension<TxCompletion>>| async move {
            format!("{}", completion.is_some())
        })
    };
    let on_postgres = IdempotencyLayer::new(AnyStore::Postgres(db.store.clone()));
    let on_memory = IdempotencyLayer::new(MemoryStore::new());
    let pg = serve(app(&on_postgres, route())).await;
    let memory = serve(app(&on_memory, route())).await;
    let client = client();
    let key = unique("order-");
    for addr in [pg, memory] {
        assert_eq!(send(&client, order(addr, &key, "x")).await.status, 201);
        assert!(send(&client, order(addr, &key, "x")).await.replayed());
        let read = Request::get(format!("http://{addr}/orders"))
            .body(Full::default())
            .unwrap();
        assert_eq!(
            send(&client, read).await.body,
            "false",
            "reads are not offered it"
        );
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [true, false],
        "offered through an AnyStore holding a PostgresStore, not on a MemoryStore"
    );
    db.drop().await;
}

/// `complete_in_sqlx` through PgBouncer in transaction mode (`PGBOUNCER_URL`), on a sqlx pool
/// set up for it (no statement cache) whose handler's own statements are unnamed: each
/// connection's transaction lands on whichever server session the pooler has free, and no
/// statement of the layer's is left behind on one. Orders on two connections at once, then one
/// after the other, all commit. (Before, `complete_in_sqlx` prepared a named statement, which
/// stayed on the server session: the next sqlx connection the pooler gave that session failed
/// with "prepared statement \"sqlx_s_1\" already exists", and the order rolled back.)
#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_sqlx_through_a_transaction_pooler_leaves_no_statement_behind() {
    use sqlx::ConnectOptions as _;
    use std::str::FromStr as _;

    let (Some(bouncer), Some(direct)) = (env_url("PGBOUNCER_URL"), env_url("DATABASE_URL")) else {
        return;
    };
    let plain = bouncer
        .replace("?pooling=transaction", "")
        .replace("&pooling=transaction", "");
    let schema = unique("idem_tx_bouncer_");
    let store = PostgresStore::builder(&bouncer)
        .schema(&schema)
        .listen_url(direct.clone())
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    raw(&direct)
        .await
        .batch_execute(&format!(
            "CREATE TABLE \"{schema}\".orders (id bigserial PRIMARY KEY, key text NOT NULL, \
             item text NOT NULL)"
        ))
        .await
        .unwrap();
    let options = sqlx::postgres::PgConnectOptions::from_str(&plain)
        .unwrap()
        .statement_cache_capacity(0)
        // PgBouncer refuses the startup parameter sqlx sends by default.
        .extra_float_digits(None)
        .disable_statement_logging();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("PGBOUNCER_URL is set, so PgBouncer must be reachable (sqlx)");
    let executions = Arc::new(AtomicUsize::new(0));
    let route = {
        let (schema, executions) = (schema.clone(), executions.clone());
        post(
            move |Extension(completion): Extension<TxCompletion>,
                  headers: HeaderMap,
                  item: Bytes| {
                let (pool, schema, executions) = (pool.clone(), schema.clone(), executions.clone());
                async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    let mut tx = pool.begin().await.expect("BEGIN");
                    // The handler's own statement, unnamed as a pooler in transaction mode needs.
                    let id: i64 = sqlx::query_scalar(&format!(
                        "INSERT INTO \"{schema}\".orders (key, item) VALUES ($1, $2) RETURNING id"
                    ))
                    .bind(key_of(&headers))
                    .bind(String::from_utf8_lossy(&item).into_owned())
                    .persistent(false)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("insert the order");
                    match completion.complete_in_sqlx(&mut tx, created(id)).await {
                        Ok(response) => {
                            tx.commit().await.expect("COMMIT");
                            response.into_response()
                        }
                        Err(e) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
                        }
                    }
                }
            },
        )
    };
    let layer = IdempotencyLayer::new(store.clone());
    let addr = serve(app(&layer, route)).await;
    let client = client();
    let keys: Vec<String> = (0..8).map(|_| unique("order-")).collect();
    // Two at a time (two connections of the sqlx pool, on the pooler's sessions), then one by one.
    for pair in keys[..4].chunks(2) {
        let (a, b) = tokio::join!(
            send(&client, order(addr, &pair[0], "a book")),
            send(&client, order(addr, &pair[1], "a pen"))
        );
        for r in [a, b] {
            assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        }
    }
    for key in &keys[4..] {
        let r = send(&client, order(addr, key, "a lamp")).await;
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        assert!(send(&client, order(addr, key, "a lamp")).await.replayed());
    }
    assert_eq!(executions.load(Ordering::SeqCst), 8, "each order ran once");
    drop_schema(&direct, &schema).await;
}

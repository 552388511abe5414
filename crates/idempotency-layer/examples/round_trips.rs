//! Round trips per request to Redis and to PostgreSQL, for a first execution and for a replay,
//! counted by the servers themselves.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo run -p idempotency-layer --all-features --example round_trips
//! ```
//!
//! - Redis: deltas of `INFO commandstats`. Every store operation is one `EVALSHA` (or `EVAL`
//!   when the script is not loaded); the commands a script runs inside Redis (`HMGET`, `HSET`,
//!   `PEXPIRE`, `PUBLISH` ...) are counted by Redis too, and listed, but are not round trips.
//!   Run it while nothing else uses the server.
//! - PostgreSQL: deltas of `pg_stat_database.xact_commit` of a private database made for the
//!   run (`pg_stat_statements` is not needed). Every store statement is one implicit
//!   transaction and one round trip (Bind/Execute/Sync of a statement prepared once per
//!   pooled connection). Statistics reach `pg_stat_database` when a backend has been idle for
//!   a while, so the run pauses about 11 s before each reading.
//!
//! Requests go through the layer on an axum router (no sockets), one at a time, so no lease
//! renewal and no waiter is involved.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use idempotency_layer::{IdempotencyLayer, IdempotencyStore, PostgresStore, RedisStore};
use tower::ServiceExt;

const N: usize = 200;

fn app<S: IdempotencyStore>(store: S) -> Router {
    Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::CREATED, "order created") }),
        )
        .layer(IdempotencyLayer::new(store).default_tenant("shop"))
}

async fn send(app: &Router, key: &str) {
    let req = Request::post("/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Body::from(r#"{"sku":"b1"}"#))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    // Reading the body to its end is what records the response.
    axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
}

/// Sends `n` first executions (keys `{tag}-{i}`), then the same `n` again (replays).
async fn first_then_replay(app: &Router, tag: &str, n: usize, phase: impl AsyncFnMut(&str)) {
    let mut phase = phase;
    phase("start").await;
    for i in 0..n {
        send(app, &format!("{tag}-{i:05}")).await;
    }
    phase("first").await;
    for i in 0..n {
        send(app, &format!("{tag}-{i:05}")).await;
    }
    phase("replay").await;
}

fn per_request(delta: u64) -> f64 {
    delta as f64 / N as f64
}

// ---------- Redis ----------

async fn commandstats(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0 && k != "info").then(|| (k.clone(), d))
        })
        .collect()
}

async fn redis(url: &str) {
    let prefix = format!("round-trips:{}:", std::process::id());
    let store = RedisStore::builder(url)
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let app = app(store);
    // Warm up: loads the scripts (EVALSHA answered NOSCRIPT, then EVAL).
    first_then_replay(&app, "warm", 5, async |_| {}).await;

    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut snapshots = Vec::new();
    first_then_replay(&app, "measure", N, async |_| {
        snapshots.push(commandstats(&mut conn).await)
    })
    .await;
    for (name, (a, b)) in ["first execution", "replay"]
        .into_iter()
        .zip([(0, 1), (1, 2)])
    {
        let d = delta(&snapshots[a], &snapshots[b]);
        let trips = d.get("evalsha").copied().unwrap_or(0) + d.get("eval").copied().unwrap_or(0);
        let inside: Vec<String> = d
            .iter()
            .filter(|(k, _)| *k != "evalsha" && *k != "eval")
            .map(|(k, v)| format!("{k} {:.2}", per_request(*v)))
            .collect();
        println!(
            "redis    {name:<16} {:.2} round trips/request (EVALSHA+EVAL; inside the scripts: {})",
            per_request(trips),
            inside.join(", ")
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

// ---------- PostgreSQL ----------

/// `url` with its database replaced by `db`.
fn with_database(url: &str, db: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let (base, query) = rest.split_once('?').map_or((rest, ""), |(b, q)| (b, q));
    let authority = base.split('/').next().unwrap_or(base);
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    format!("{scheme}://{authority}/{db}{query}")
}

async fn pg_admin(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

async fn xact_commit(admin: &tokio_postgres::Client, db: &str) -> i64 {
    // Backends report their statistics when idle, at the latest ~10 s after their last report.
    tokio::time::sleep(Duration::from_secs(11)).await;
    admin
        .query_one(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
            &[&db],
        )
        .await
        .unwrap()
        .get(0)
}

async fn postgres(url: &str) {
    let db = format!("idem_round_trips_{}", std::process::id());
    let admin = pg_admin(url).await;
    for sql in [
        format!("DROP DATABASE IF EXISTS {db}"),
        format!("CREATE DATABASE {db}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    {
        let store = PostgresStore::builder(with_database(url, &db))
            .pool_size(1)
            .cleanup_interval(Duration::ZERO)
            .connect()
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let app = app(store);
        // Warm up: prepares the statements on the one pooled connection.
        first_then_replay(&app, "warm", 5, async |_| {}).await;
        let mut readings = Vec::new();
        first_then_replay(&app, "measure", N, async |_| {
            readings.push(xact_commit(&admin, &db).await)
        })
        .await;
        for (name, (a, b)) in ["first execution", "replay"]
            .into_iter()
            .zip([(0, 1), (1, 2)])
        {
            println!(
                "postgres {name:<16} {:.2} round trips/request (statements = transactions committed)",
                per_request((readings[b] - readings[a]) as u64)
            );
        }
    }
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .unwrap();
}

#[tokio::main]
async fn main() {
    println!("{N} requests per phase, one at a time");
    match std::env::var("REDIS_URL") {
        Ok(url) => redis(&url).await,
        Err(_) => println!("redis    skipped: REDIS_URL is not set"),
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) => postgres(&url).await,
        Err(_) => println!("postgres skipped: DATABASE_URL is not set"),
    }
}

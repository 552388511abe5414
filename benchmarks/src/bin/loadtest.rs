//! Load benchmark: an axum server on 127.0.0.1 and a hyper client with C connections for T
//! seconds per scenario, printing requests/s, p50 and p99 per scenario and the ratio to the
//! baseline scenario (no layers) of the same run. Then, for Redis and PostgreSQL, the round
//! trips per request read from the servers' own statistics, and first of all the resident
//! memory a record of a 200-byte response costs in `MemoryStore`.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//! REDIS_CLUSTER_URLS=$(.ci/redis-cluster.sh) \
//!     cargo run --release -p benchmarks --bin loadtest -- --connections 16 --rounds 3 --seconds 1.5
//! ```
//!
//! See `BENCHMARKS.md` for what each number means.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use benchmarks::{keys, resident_bytes, RESPONSE_200};
use bytes::Bytes;
use clap::Parser;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{
    IdempotencyLayer, IdempotencyStore, MemoryStore, PostgresStore, RedisStore,
};
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{Layer, Service, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
#[command(about = "Load benchmark of retry-layer and idempotency-layer over real sockets")]
struct Args {
    /// Concurrent connections (one request in flight on each).
    #[arg(long, short = 'c', default_value_t = 16)]
    connections: usize,
    /// Measured seconds per scenario and round.
    #[arg(long, short = 't', default_value_t = 1.5)]
    seconds: f64,
    /// Unmeasured warm-up seconds before each scenario and round.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Rounds: every scenario runs once per round, the scenarios interleaved, and the medians
    /// over the rounds are printed (so a burst of noise from elsewhere hits one round of every
    /// scenario rather than all of one).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Records to fill MemoryStore with for the memory cost (0: skip).
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// Only these scenarios (comma separated names as printed); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Redis URL (default: the REDIS_URL environment variable; unset: skipped).
    #[arg(long, env = "REDIS_URL")]
    redis: Option<String>,
    /// Redis Cluster node URLs, comma separated (default: the REDIS_CLUSTER_URLS environment
    /// variable, as `.ci/redis-cluster.sh` prints; unset: skipped): the Redis scenarios again,
    /// as `redis-cluster/...`, on the cluster.
    #[arg(long, env = "REDIS_CLUSTER_URLS", value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// PostgreSQL URL (default: the DATABASE_URL environment variable; unset: skipped).
    #[arg(long, env = "DATABASE_URL")]
    postgres: Option<String>,
}

/// One scenario's result.
struct Run {
    name: String,
    requests: u64,
    errors: u64,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
}

/// One scenario over its rounds: medians of requests/s, p50 and p99.
fn merge(rounds: Vec<Run>) -> Run {
    let med =
        |f: fn(&Run) -> f64| benchmarks::median(&mut rounds.iter().map(f).collect::<Vec<_>>());
    Run {
        name: rounds[0].name.clone(),
        requests: rounds.iter().map(|r| r.requests).sum(),
        errors: rounds.iter().map(|r| r.errors).sum(),
        rps: med(|r| r.rps),
        p50_us: med(|r| r.p50_us),
        p99_us: med(|r| r.p99_us),
    }
}

fn handler_app() -> Router {
    Router::new().route(
        "/orders",
        post(|| async {
            (
                StatusCode::CREATED,
                [("content-type", "application/json")],
                RESPONSE_200,
            )
        }),
    )
}

fn idempotent_app<St: IdempotencyStore>(store: St) -> Router {
    handler_app().layer(IdempotencyLayer::new(store).default_tenant("bench"))
}

/// Serves `app` on 127.0.0.1 until the returned handle is aborted.
async fn serve(app: Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // TCP_NODELAY as production servers set it: a response whose head is flushed before its
    // body (the layer records the body before its last frame leaves, and a shared store takes
    // a round trip there) otherwise waits ~40 ms for the client's delayed ACK (Nagle).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    (addr, task)
}

fn client<B>() -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(http)
}

/// How each connection picks its idempotency key for request `i`.
#[derive(Clone, Copy)]
enum Keys {
    /// A new key for every request: first executions.
    Unique,
    /// One key per connection, recorded before the run: replays.
    PerConnection,
}

fn key_of(prefix: &str, keys: Keys, conn: usize, i: u64) -> String {
    match keys {
        Keys::Unique => format!("{prefix}-{conn:03}-{i:010}"),
        Keys::PerConnection => format!("{prefix}-replay-{conn:03}"),
    }
}

fn request(addr: SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::from_static(benchmarks::ORDER)))
        .expect("valid request")
}

/// Sends one request per connection key so that `Keys::PerConnection` runs only replay.
async fn record_replay_keys(addr: SocketAddr, prefix: &str, connections: usize) {
    let c = client::<Full<Bytes>>();
    for conn in 0..connections {
        let req = request(addr, &key_of(prefix, Keys::PerConnection, conn, 0));
        let res = c.request(req).await.expect("pre-record");
        assert_eq!(res.status(), StatusCode::CREATED);
        res.into_body().collect().await.expect("body");
    }
}

/// Runs `connections` loops against `svc` for warm-up + measured seconds.
async fn load<S, B>(
    name: &str,
    svc: S,
    addr: SocketAddr,
    keys: Keys,
    prefix: &str,
    args: &Args,
) -> Run
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.seconds);
    let tasks: Vec<_> = (0..args.connections)
        .map(|conn| {
            let mut svc = svc.clone();
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(1 << 16);
                let mut errors = 0u64;
                let mut i = 0u64;
                loop {
                    let t0 = Instant::now();
                    if t0 >= end {
                        break;
                    }
                    i += 1;
                    let req = request(addr, &key_of(&prefix, keys, conn, i));
                    let ok = match svc.ready().await {
                        Ok(s) => match s.call(req).await {
                            Ok(res) => {
                                let good = res.status() == StatusCode::CREATED;
                                good && res.into_body().collect().await.is_ok()
                            }
                            Err(_) => false,
                        },
                        Err(_) => false,
                    };
                    if t0 >= measure_from {
                        if ok {
                            lat.push(t0.elapsed().as_secs_f64() * 1e6);
                        } else {
                            errors += 1;
                        }
                    }
                }
                (lat, errors, i)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (lat, e, _) = t.await.expect("load task");
        all.extend(lat);
        errors += e;
    }
    all.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        if all.is_empty() {
            0.0
        } else {
            all[((all.len() as f64 * p) as usize).min(all.len() - 1)]
        }
    };
    Run {
        name: name.to_owned(),
        requests: all.len() as u64,
        errors,
        rps: all.len() as f64 / args.seconds,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    }
}

/// Total requests a scenario sent (warm-up included), for round trips per request.
async fn load_counted<S, B>(
    name: &str,
    svc: S,
    addr: SocketAddr,
    keys: Keys,
    prefix: &str,
    args: &Args,
) -> (Run, u64)
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let counted = CountingService {
        inner: svc,
        sent: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)),
    };
    let sent = counted.sent.clone();
    let run = load(name, counted, addr, keys, prefix, args).await;
    (run, sent.load(std::sync::atomic::Ordering::Relaxed))
}

#[derive(Clone)]
struct CountingService<S> {
    inner: S,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<S: Service<R>, R> Service<R> for CountingService<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.call(req)
    }
}

fn print_runs(runs: &[Run]) {
    let base = runs.first().map_or(1.0, |r| r.rps.max(1e-9));
    println!(
        "\n{:<26} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7}",
        "scenario", "requests", "req/s", "p50 us", "p99 us", "ratio", "errors"
    );
    for r in runs {
        println!(
            "{:<26} {:>10} {:>9.0} {:>9.0} {:>9.0} {:>7.3}x {:>7}",
            r.name,
            r.requests,
            r.rps,
            r.p50_us,
            r.p99_us,
            r.rps / base,
            r.errors
        );
    }
}

/// Resident bytes per record: fills a `MemoryStore` through the layer (trivial handler answering
/// 200 bytes) with `n` first executions and reads VmRSS before and after.
async fn record_memory(n: usize) {
    // Room for every record: the default byte bound (128 MiB, half of it per tenant) would
    // refuse claims before `n` records of this size.
    let store = MemoryStore::builder()
        .max_entries(2 * n)
        .max_bytes(2 * n * 4096)
        .tenant_share_percent(100)
        .build();
    let svc = IdempotencyLayer::new(store.clone())
        .default_tenant("bench")
        .layer(tower::service_fn(
            benchmarks::created::<idempotency_layer::RequestBody<Full<Bytes>>>,
        ));
    let keys = keys("memory", n);
    // Warm the allocator and the runtime with a few records, not counted.
    for k in keys.iter().take(100) {
        let res = svc
            .clone()
            .oneshot(benchmarks::order_request(&format!("{k}-warm")))
            .await
            .expect("ok");
        res.into_body().collect().await.expect("body");
    }
    let before = resident_bytes();
    for k in &keys {
        let res = svc
            .clone()
            .oneshot(benchmarks::order_request(k))
            .await
            .expect("ok");
        res.into_body().collect().await.expect("body");
    }
    let after = resident_bytes();
    assert_eq!(store.len(), n + 100, "every record kept");
    match (before, after) {
        (Some(b), Some(a)) => {
            let per = a.saturating_sub(b) as f64 / n as f64;
            let payload = RESPONSE_200.len() as f64;
            println!(
                "memory: {n} records of a {}-byte response: {:.1} MiB resident, {per:.0} bytes/record \
                 ({:.0} bytes over the payload; target <= 2 x payload + 256 = {:.0} bytes)",
                RESPONSE_200.len(),
                a.saturating_sub(b) as f64 / (1 << 20) as f64,
                per - payload,
                2.0 * payload + 256.0
            );
        }
        _ => println!("memory: /proc/self/status unreadable; skipped"),
    }
    drop(svc);
    drop(store);
}

// ---------- Redis round trips (INFO commandstats) ----------

async fn commandstats(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Round trips (EVALSHA + EVAL) per request between two readings, and the commands the scripts
/// ran inside Redis (not round trips).
fn redis_trips(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, sent: u64) -> String {
    let d: BTreeMap<&str, u64> = after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0 && k != "info").then_some((k.as_str(), d))
        })
        .collect();
    let trips = d.get("evalsha").copied().unwrap_or(0) + d.get("eval").copied().unwrap_or(0);
    let other: Vec<String> = d
        .iter()
        .filter(|(k, _)| !matches!(**k, "evalsha" | "eval"))
        .map(|(k, v)| format!("{k} {:.2}", *v as f64 / sent as f64))
        .collect();
    format!(
        "{:.3} round trips/request (EVALSHA+EVAL over {sent} requests; run inside the scripts or by other clients: {})",
        trips as f64 / sent as f64,
        if other.is_empty() { "none".to_owned() } else { other.join(", ") }
    )
}

/// Command counts summed over every node (one for a standalone server, each master of a
/// cluster).
async fn commandstats_all(
    conns: &mut [redis::aio::MultiplexedConnection],
) -> BTreeMap<String, u64> {
    let mut all = BTreeMap::new();
    for conn in conns {
        for (k, v) in commandstats(conn).await {
            *all.entry(k).or_insert(0) += v;
        }
    }
    all
}

/// The Redis scenarios on one server (`urls` = its URL) or on a cluster (`cluster`: `urls`
/// are its masters).
async fn redis_scenarios(
    urls: &[String],
    cluster: bool,
    args: &Args,
    runs: &mut Vec<Run>,
    notes: &mut Vec<String>,
) {
    let label = if cluster { "redis-cluster" } else { "redis" };
    let prefix = format!("loadtest:{}:", std::process::id());
    let builder = if cluster {
        RedisStore::builder_cluster(urls.iter().cloned())
    } else {
        RedisStore::builder(&urls[0])
    };
    let store = match builder.prefix(&prefix).connect().await {
        Ok(s) => s,
        Err(e) => {
            notes.push(format!("{label}: skipped, cannot connect to {urls:?}: {e}"));
            return;
        }
    };
    let mut conns = Vec::new();
    for url in urls {
        conns.push(
            redis::Client::open(url.as_str())
                .expect("redis url")
                .get_multiplexed_async_connection()
                .await
                .expect("redis connection"),
        );
    }
    let (addr, server) = serve(idempotent_app(store)).await;
    let tag = format!("r{}", std::process::id());
    // Loads the scripts (EVALSHA answered NOSCRIPT, then EVAL) and records the replay keys.
    record_replay_keys(addr, &tag, args.connections).await;
    let (first, replay) = if cluster {
        ("redis-cluster/first", "redis-cluster/replay")
    } else {
        ("redis/first", "redis/replay")
    };
    let scenarios = [(first, Keys::Unique), (replay, Keys::PerConnection)];
    let mut rounds: Vec<Vec<Run>> = scenarios.iter().map(|_| Vec::new()).collect();
    let mut trips = vec![(BTreeMap::new(), 0u64); scenarios.len()];
    for round in 0..args.rounds {
        for (i, (name, keys)) in scenarios.into_iter().enumerate() {
            if !selected(args, name) {
                continue;
            }
            let before = commandstats_all(&mut conns).await;
            let prefix = match keys {
                Keys::Unique => format!("{tag}x{round}"),
                Keys::PerConnection => tag.clone(),
            };
            let (run, sent) = load_counted(name, client(), addr, keys, &prefix, args).await;
            let after = commandstats_all(&mut conns).await;
            for (k, v) in &after {
                let d = v - before.get(k).copied().unwrap_or(0);
                *trips[i].0.entry(k.clone()).or_insert(0) += d;
            }
            trips[i].1 += sent;
            rounds[i].push(run);
        }
    }
    for (i, (name, _)) in scenarios.into_iter().enumerate() {
        if rounds[i].is_empty() {
            continue;
        }
        let (deltas, sent) = &trips[i];
        notes.push(format!(
            "{name:<16} {}",
            redis_trips(&BTreeMap::new(), deltas, *sent)
        ));
        runs.push(merge(std::mem::take(&mut rounds[i])));
    }
    server.abort();
    for conn in &mut conns {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(conn)
            .await
            .unwrap_or_default();
        // One key per DEL: a cluster node refuses a DEL of keys in several slots.
        let step = if cluster { 1 } else { 1000 };
        for chunk in keys.chunks(step) {
            let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(conn).await;
        }
    }
}

// ---------- PostgreSQL round trips (pg_stat_database.xact_commit) ----------

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

/// Transactions committed in `db`, once every backend connected to it has gone (a backend
/// reports its statistics when it exits, so the reading is complete).
async fn xact_commit(admin: &tokio_postgres::Client, db: &str) -> i64 {
    for _ in 0..100 {
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
                &[&db],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if n == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A backend flushes its counters as it exits, a little after it leaves pg_stat_activity:
    // read until two readings 300 ms apart agree.
    let read = || async {
        let n: i64 = admin
            .query_one(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
                &[&db],
            )
            .await
            .expect("pg_stat_database")
            .get(0);
        n
    };
    let mut last = read().await;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = read().await;
        if now == last {
            break;
        }
        last = now;
    }
    last
}

async fn pg_store(url: &str) -> PostgresStore {
    PostgresStore::builder(url)
        .cleanup_interval(Duration::ZERO)
        .connect()
        .await
        .expect("postgres store")
}

async fn postgres_scenarios(url: &str, args: &Args, runs: &mut Vec<Run>, notes: &mut Vec<String>) {
    let (admin, conn) = match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => {
            notes.push(format!("postgres: skipped, cannot connect to {url}: {e}"));
            return;
        }
    };
    tokio::spawn(conn);
    // A private database: its xact_commit counts only this run's statements.
    let db = format!("idem_loadtest_{}", std::process::id());
    for sql in [
        format!("DROP DATABASE IF EXISTS {db}"),
        format!("CREATE DATABASE {db}"),
    ] {
        admin.batch_execute(&sql).await.expect("create database");
    }
    let db_url = with_database(url, &db);
    let tag = format!("p{}", std::process::id());
    {
        let store = pg_store(&db_url).await;
        store.migrate().await.expect("migrate");
        let (addr, server) = serve(idempotent_app(store)).await;
        record_replay_keys(addr, &tag, args.connections).await;
        server.abort();
        let _ = server.await;
    }
    let scenarios = [
        ("postgres/first", Keys::Unique),
        ("postgres/replay", Keys::PerConnection),
    ];
    let mut rounds: Vec<Vec<Run>> = scenarios.iter().map(|_| Vec::new()).collect();
    let mut trips = vec![(0i64, 0u64); scenarios.len()];
    for round in 0..args.rounds {
        for (i, (name, keys)) in scenarios.into_iter().enumerate() {
            if !selected(args, name) {
                continue;
            }
            let before = xact_commit(&admin, &db).await;
            let store = pg_store(&db_url).await;
            let (addr, server) = serve(idempotent_app(store)).await;
            let prefix = match keys {
                Keys::Unique => format!("{tag}x{round}"),
                Keys::PerConnection => tag.clone(),
            };
            let (run, sent) = load_counted(name, client(), addr, keys, &prefix, args).await;
            server.abort();
            let _ = server.await;
            let after = xact_commit(&admin, &db).await;
            trips[i].0 += after - before;
            trips[i].1 += sent;
            rounds[i].push(run);
        }
    }
    for (i, (name, _)) in scenarios.into_iter().enumerate() {
        if rounds[i].is_empty() {
            continue;
        }
        let (commits, sent) = trips[i];
        notes.push(format!(
            "{name:<16} {:.3} statements/request (transactions committed in {db} over {sent} requests; \
             includes the one-time Parse of each statement on each new pooled connection)",
            commits as f64 / sent as f64
        ));
        runs.push(merge(std::mem::take(&mut rounds[i])));
    }
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
}

fn selected(args: &Args, name: &str) -> bool {
    args.only.is_empty()
        || args
            .only
            .iter()
            .any(|o| name == o || name.starts_with(&format!("{o}/")))
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    println!(
        "loadtest: {} connections, {} rounds of {} s warm-up + {} s measured per scenario, {} cores",
        args.connections,
        args.rounds,
        args.warmup,
        args.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if args.records > 0 {
        record_memory(args.records).await;
    }
    let mut runs = Vec::new();
    let mut notes = Vec::new();
    let tag = format!("m{}", std::process::id());

    let (plain, plain_task) = serve(handler_app()).await;
    // Sized for every first execution of the run: the defaults (100 000 entries, 128 MiB, half
    // per tenant) would start refusing claims (503) after about 100 000 of them.
    let memory_store = MemoryStore::builder()
        .max_entries(8_000_000)
        .max_bytes(8 << 30)
        .tenant_share_percent(100)
        .build();
    let (memory, memory_task) = serve(idempotent_app(memory_store)).await;
    record_replay_keys(memory, &tag, args.connections).await;
    let names = ["no_layers", "client_retry", "memory/first", "memory/replay"];
    let mut rounds: Vec<Vec<Run>> = names.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        let unique = format!("{tag}x{round}");
        for (i, name) in names.into_iter().enumerate() {
            if !selected(&args, name) {
                continue;
            }
            let run = match name {
                "no_layers" => load(name, client(), plain, Keys::Unique, &unique, &args).await,
                "client_retry" => {
                    let svc = RetryLayer::new(RetryPolicy::default()).layer(client());
                    load(name, svc, plain, Keys::Unique, &unique, &args).await
                }
                "memory/first" => load(name, client(), memory, Keys::Unique, &unique, &args).await,
                _ => load(name, client(), memory, Keys::PerConnection, &tag, &args).await,
            };
            rounds[i].push(run);
        }
    }
    for r in rounds.into_iter().filter(|r| !r.is_empty()) {
        runs.push(merge(r));
    }
    plain_task.abort();
    memory_task.abort();

    match &args.redis {
        Some(url) => {
            redis_scenarios(
                std::slice::from_ref(url),
                false,
                &args,
                &mut runs,
                &mut notes,
            )
            .await
        }
        None => notes.push("redis: skipped (REDIS_URL unset)".to_owned()),
    }
    if args.redis_cluster.is_empty() {
        notes.push("redis-cluster: skipped (REDIS_CLUSTER_URLS unset)".to_owned());
    } else {
        let urls = args.redis_cluster.clone();
        redis_scenarios(&urls, true, &args, &mut runs, &mut notes).await;
    }
    match &args.postgres {
        Some(url) => postgres_scenarios(url, &args, &mut runs, &mut notes).await,
        None => notes.push("postgres: skipped (DATABASE_URL unset)".to_owned()),
    }

    print_runs(&runs);
    if !notes.is_empty() {
        println!();
        for n in &notes {
            println!("{n}");
        }
    }
}

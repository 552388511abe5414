//! The chaos soak: many clients with `RetryLayer` -> the e2e fault proxy (drops after the
//! request, delays, resets) -> one or two server instances with `IdempotencyLayer` sharing a
//! store, whose connection is cut for a while at a fixed period. The handler writes a side-effect
//! ledger keyed by idempotency key. At the end, [`Report::problems`] checks that every succeeded
//! operation's effect happened exactly once, no key ran twice, and no claim was left in flight.
//!
//! `cargo run --release -p chaos -- --minutes 5 --store redis` runs it; a short run of each
//! store is part of the test suite (`chaos/tests/short.rs`). [`kill`] is the soak whose servers
//! are processes that get killed (`--bin kill`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use e2e::cut::{authority, via, CutProxy};
use e2e::faults::Unavailable;
use e2e::proxy::{Chooser, Mode, Protocol, Proxy};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::store::{Begin, Fingerprint};
use idempotency_layer::{
    IdempotencyLayer, IdempotencyStore, MemoryStore, PostgresStore, RedisStore, Scope,
};
use retry_layer::{ReplayBody, Retry, RetryInfo, RetryLayer, RetryPolicy};
use tower::ServiceExt;

/// The tenant every chaos client writes as.
const TENANT: &str = "chaos";
/// How long records are kept: past the end of any run (Redis keys expire by themselves; the
/// PostgreSQL tables are dropped at the end).
const RECORD_TTL: Duration = Duration::from_secs(600);
/// How long the end of a run waits for detached completions and releases before checking that
/// no claim is left in flight (much less than a lease: nothing may be left to lapse).
const SETTLE: Duration = Duration::from_secs(4);
/// The memory store's capacity: more than a long run writes within the record TTL.
const MEMORY_CAPACITY: usize = 8_000_000;
/// The one write endpoint.
const PATH: &str = "/ops";

/// Which store the server instances share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// One instance with an in-process `MemoryStore` (no store connection to cut).
    Memory,
    /// Two instances sharing Redis (`REDIS_URL`), each through the cuttable proxy.
    Redis,
    /// Two instances sharing PostgreSQL (`DATABASE_URL`), each through the cuttable proxy.
    Postgres,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The store.
    pub store: StoreKind,
    /// The store URL (Redis or PostgreSQL); unused for memory.
    pub url: Option<String>,
    /// How long clients start new operations.
    pub duration: Duration,
    /// Concurrent clients, each doing one logical operation at a time.
    pub clients: usize,
    /// The store connection is cut every `cut_every` ...
    pub cut_every: Duration,
    /// ... for `cut_for`.
    pub cut_for: Duration,
    /// Share of connections dropped after the request reached the server.
    pub drop_p: f64,
    /// Share of connections reset before anything was relayed.
    pub reset_p: f64,
    /// Share of connections whose answer is delayed by 20 to 200 ms.
    pub delay_p: f64,
    /// Share of first attempts answered 503 inside the layer (not executed).
    pub unavailable_p: f64,
    /// The seed of every random choice.
    pub seed: u64,
    /// The claims' lease (the layer's default is 30 s).
    pub lease: Duration,
}

impl Options {
    /// The defaults of the long run: 32 clients, store cut for 2 s every 20 s, 10 % drops after
    /// the request, 5 % resets, 5 % delays, 5 % injected 503s.
    pub fn new(store: StoreKind, url: Option<String>, duration: Duration) -> Self {
        Options {
            store,
            url,
            duration,
            clients: 32,
            cut_every: Duration::from_secs(20),
            cut_for: Duration::from_secs(2),
            drop_p: 0.10,
            reset_p: 0.05,
            delay_p: 0.05,
            unavailable_p: 0.05,
            seed: 7,
            lease: Duration::from_secs(30),
        }
    }
}

/// The side-effect ledger the handler writes: executions per idempotency key.
#[derive(Clone)]
enum Ledger {
    Memory(Arc<Mutex<HashMap<String, u64>>>),
    Redis(redis::aio::MultiplexedConnection, String),
    Postgres(Arc<tokio_postgres::Client>, String),
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ledger::Memory(_) => f.write_str("Ledger::Memory"),
            Ledger::Redis(_, hash) => write!(f, "Ledger::Redis({hash})"),
            Ledger::Postgres(_, table) => write!(f, "Ledger::Postgres({table})"),
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Ledger {
    /// Records one execution for `key`; returns the count after it.
    async fn add(&self, key: &str) -> Result<u64, BoxError> {
        match self {
            Ledger::Memory(m) => {
                let mut m = m.lock().unwrap();
                let n = m.entry(key.to_owned()).or_insert(0);
                *n += 1;
                Ok(*n)
            }
            Ledger::Redis(c, hash) => {
                let mut c = c.clone();
                let n: u64 = redis::cmd("HINCRBY")
                    .arg(hash)
                    .arg(key)
                    .arg(1)
                    .query_async(&mut c)
                    .await?;
                Ok(n)
            }
            Ledger::Postgres(c, table) => {
                let row = c
                    .query_one(
                        &format!(
                            "INSERT INTO {table} (key, n) VALUES ($1, 1) \
                             ON CONFLICT (key) DO UPDATE SET n = {table}.n + 1 RETURNING n"
                        ),
                        &[&key],
                    )
                    .await?;
                Ok(row.get::<_, i64>(0) as u64)
            }
        }
    }

    /// Every key and its executions.
    async fn all(&self) -> Result<HashMap<String, u64>, BoxError> {
        match self {
            Ledger::Memory(m) => Ok(m.lock().unwrap().clone()),
            Ledger::Redis(c, hash) => {
                // HSCAN in batches: one HGETALL of a long run's hash outlasts the response
                // timeout.
                let mut c = c.clone();
                let mut all = HashMap::new();
                let mut cursor = 0u64;
                loop {
                    let (next, batch): (u64, Vec<(String, u64)>) = redis::cmd("HSCAN")
                        .arg(hash)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(2_000)
                        .query_async(&mut c)
                        .await?;
                    all.extend(batch);
                    if next == 0 {
                        return Ok(all);
                    }
                    cursor = next;
                }
            }
            Ledger::Postgres(c, table) => Ok(c
                .query(&format!("SELECT key, n FROM {table}"), &[])
                .await?
                .into_iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
                .collect()),
        }
    }

    /// Removes what this run wrote.
    async fn drop_all(&self) {
        match self {
            Ledger::Memory(_) => {}
            Ledger::Redis(c, hash) => {
                let mut c = c.clone();
                let _: Result<i64, _> = redis::cmd("DEL").arg(hash).query_async(&mut c).await;
            }
            Ledger::Postgres(c, table) => {
                let _ = c
                    .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
                    .await;
            }
        }
    }
}

/// The handler: one side effect per execution, answered with the key and its count.
async fn handle(State(ledger): State<Ledger>, headers: HeaderMap) -> (StatusCode, String) {
    let Some(key) = headers
        .get("x-idempotency-key")
        .and_then(|v| v.to_str().ok())
    else {
        return (StatusCode::BAD_REQUEST, "no key".into());
    };
    match ledger.add(key).await {
        Ok(n) => (StatusCode::CREATED, format!("{key} {n}")),
        // The effect did not happen: a 503 is not recorded and the client retries.
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("ledger: {e}")),
    }
}

/// Serves one instance on 127.0.0.1:0.
async fn start_instance<St: IdempotencyStore>(
    layer: IdempotencyLayer<St>,
    faults: Unavailable,
    ledger: Ledger,
) -> SocketAddr {
    let app = Router::new()
        .route(PATH, post(handle))
        .with_state(ledger)
        .layer(faults)
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// Picks each connection's fault from a seeded generator: dropped after the request with
/// probability `drop_p`, reset with `reset_p`, delayed by 20 to 200 ms with `delay_p`.
fn chooser(seed: u64, drop_p: f64, reset_p: f64, delay_p: f64) -> Chooser {
    let mut rng = fastrand::Rng::with_seed(seed);
    Box::new(move || {
        let x = rng.f64();
        if x < drop_p {
            Mode::DropAfterRequest
        } else if x < drop_p + reset_p {
            Mode::Reset
        } else if x < drop_p + reset_p + delay_p {
            Mode::Delay(Duration::from_millis(rng.u64(20..200)))
        } else {
            Mode::Forward
        }
    })
}

/// The client policy: every operation carries its own key; retries back off up to 1 s and
/// honour `Retry-After`, within 20 s per operation; the budget is sized for the injected faults
/// (about 20 % of attempts fail, more while the store is cut).
fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(12)
        .base_delay(Duration::from_millis(10))
        .max_delay(Duration::from_secs(1))
        .total_timeout(Duration::from_secs(20))
        .budget(Duration::from_secs(10), 1_000, 1.0)
        .build()
        .expect("a valid policy")
}

type HttpClient = Retry<Client<HttpConnector, ReplayBody<Full<Bytes>>>>;

/// The clients' HTTP client: [`policy`] over a hyper client that opens a connection per attempt,
/// so that the fault proxy can fault every attempt.
fn retrying_client() -> HttpClient {
    let layer = RetryLayer::new(policy());
    let mut builder = Client::builder(TokioExecutor::new());
    builder.pool_max_idle_per_host(0);
    tower::Layer::layer(&layer, builder.build_http())
}

/// How one logical operation ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Succeeded,
    Failed(String),
}

/// One logical operation: a fresh key, retried by the layer until it succeeds or gives up.
async fn operation(client: &HttpClient, base: &str, key: &str) -> (Outcome, u32) {
    let req = Request::post(format!("{base}{PATH}"))
        .header("x-idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(format!("op {key}"))))
        .expect("a request");
    let res = match client.clone().oneshot(req).await {
        Ok(res) => res,
        Err(e) => return (Outcome::Failed(error_kind(&*e)), 0),
    };
    let status = res.status();
    let attempts = RetryInfo::attempts_of(&res);
    let body = match res.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return (Outcome::Failed("body cut".into()), attempts),
    };
    let expected = format!("{key} ");
    if status == StatusCode::CREATED && body.starts_with(expected.as_bytes()) {
        (Outcome::Succeeded, attempts)
    } else {
        (
            Outcome::Failed(format!("HTTP {}", status.as_u16())),
            attempts,
        )
    }
}

/// A short name for a client error: its outermost message, without variable parts.
fn error_kind(e: &(dyn std::error::Error + 'static)) -> String {
    let s = e.to_string();
    let s = s.split(':').next().unwrap_or(&s);
    s.chars().take(60).collect()
}

/// The resident set size of this process, in KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    /// The store.
    pub store: String,
    /// Wall time of the run (including the drain at the end).
    pub elapsed: Duration,
    /// Server instances.
    pub instances: usize,
    /// The claims' lease.
    pub lease: Duration,
    /// Logical operations started.
    pub attempted: usize,
    /// Operations whose client got the handler's 201.
    pub succeeded: usize,
    /// Operations whose client gave up, by reason.
    pub failed: BTreeMap<String, usize>,
    /// HTTP attempts the clients made (from `RetryInfo`).
    pub http_attempts: u64,
    /// Connections dropped after the request reached the server.
    pub dropped: usize,
    /// Connections reset before anything was relayed.
    pub reset: usize,
    /// Connections delayed.
    pub delayed: usize,
    /// 503s injected inside the layer.
    pub unavailable: usize,
    /// Store cuts.
    pub cuts: usize,
    /// Executions in the ledger.
    pub executions: u64,
    /// Keys executed more than once (must be empty).
    pub duplicates: Vec<(String, u64)>,
    /// Succeeded operations missing from the ledger (must be empty).
    pub lost: Vec<String>,
    /// Failed operations whose effect happened once anyway (allowed: the client gave up on an
    /// ambiguous outcome; a retry with the same key would get the replay).
    pub failed_but_executed: usize,
    /// Keys in the ledger that no client used (must be 0).
    pub unknown_keys: usize,
    /// Claims still in flight after the drain (must be 0).
    pub in_flight_left: usize,
    /// Succeeded operations whose key holds no record (must be empty: a retry would run again).
    pub unrecorded: Vec<String>,
    /// Layer counters summed over instances: executed, replayed, waited, recorded, released,
    /// store errors.
    pub layer: [u64; 6],
    /// RSS in KiB at start, middle and end.
    pub rss_kib: [u64; 3],
}

impl Report {
    /// What went wrong; empty when every check passed.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.attempted == 0 {
            p.push("no operation was attempted".into());
        }
        if !self.duplicates.is_empty() {
            p.push(format!(
                "{} keys executed more than once: {:?}",
                self.duplicates.len(),
                &self.duplicates[..self.duplicates.len().min(5)]
            ));
        }
        if !self.lost.is_empty() {
            p.push(format!(
                "{} succeeded operations missing from the ledger: {:?}",
                self.lost.len(),
                &self.lost[..self.lost.len().min(5)]
            ));
        }
        if self.unknown_keys > 0 {
            p.push(format!("{} unknown keys in the ledger", self.unknown_keys));
        }
        if !self.unrecorded.is_empty() {
            p.push(format!(
                "{} succeeded operations have no record: {:?}",
                self.unrecorded.len(),
                &self.unrecorded[..self.unrecorded.len().min(5)]
            ));
        }
        if self.in_flight_left > 0 {
            p.push(format!("{} claims left in flight", self.in_flight_left));
        }
        p
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed: usize = self.failed.values().sum();
        writeln!(
            f,
            "chaos soak: store {}, {} instance(s), lease {:?}, {:.1} s",
            self.store,
            self.instances,
            self.lease,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(f, "  operations attempted   {}", self.attempted)?;
        writeln!(f, "  succeeded              {}", self.succeeded)?;
        writeln!(f, "  failed                 {failed}")?;
        for (why, n) in &self.failed {
            writeln!(f, "    {why}: {n}")?;
        }
        writeln!(f, "  HTTP attempts          {}", self.http_attempts)?;
        writeln!(
            f,
            "  faults injected        {} dropped after request, {} reset, {} delayed, {} 503 in-layer, {} store cuts",
            self.dropped, self.reset, self.delayed, self.unavailable, self.cuts
        )?;
        let [executed, replayed, waited, recorded, released, store_errors] = self.layer;
        writeln!(
            f,
            "  layer                  {executed} executed, {replayed} replayed, {waited} waited, {recorded} recorded, {released} released, {store_errors} store errors"
        )?;
        writeln!(f, "  ledger executions      {}", self.executions)?;
        writeln!(f, "  duplicates (key > 1)   {}", self.duplicates.len())?;
        writeln!(f, "  lost (succeeded, 0)    {}", self.lost.len())?;
        writeln!(f, "  failed but executed    {}", self.failed_but_executed)?;
        writeln!(f, "  unknown ledger keys    {}", self.unknown_keys)?;
        writeln!(f, "  in-flight claims left  {}", self.in_flight_left)?;
        writeln!(f, "  succeeded, no record   {}", self.unrecorded.len())?;
        writeln!(
            f,
            "  RSS start/middle/end   {} / {} / {} KiB",
            self.rss_kib[0], self.rss_kib[1], self.rss_kib[2]
        )?;
        match self.problems().as_slice() {
            [] => write!(f, "  checks                 PASS"),
            problems => write!(f, "  checks                 FAIL: {}", problems.join("; ")),
        }
    }
}

/// Looks up `keys` in `store`: how many are claimed in flight, and which hold no record (free).
/// A scope found free is claimed and released again at once (the check must not leave
/// anything behind).
async fn in_flight<St: IdempotencyStore>(store: &St, keys: &[String]) -> (usize, Vec<String>) {
    /// Lookups at once (a long run checks hundreds of thousands of keys).
    const CONCURRENCY: usize = 32;
    let mut n = 0;
    let mut free = Vec::new();
    let mut set = tokio::task::JoinSet::new();
    let mut tally = |r: Result<(bool, Option<String>), tokio::task::JoinError>| {
        let (held, freed) = r.expect("a lookup task");
        n += usize::from(held);
        free.extend(freed);
    };
    for key in keys {
        if set.len() >= CONCURRENCY {
            if let Some(r) = set.join_next().await {
                tally(r);
            }
        }
        let (store, key) = (store.clone(), key.clone());
        set.spawn(async move {
            let method = Scope::http(&http::Method::POST, PATH);
            let scope = Scope::new(TENANT, &method, &key).key();
            match store
                .begin(scope, Fingerprint([0; 32]), Duration::from_secs(5))
                .await
            {
                Ok(Begin::InFlight { .. }) => (true, None),
                Ok(Begin::New(token)) => {
                    let _ = store.release(scope, token).await;
                    (false, Some(key))
                }
                Ok(Begin::Completed(_)) => (false, None),
                Ok(other) => panic!("checking claims: unexpected {other:?}"),
                Err(e) => panic!("checking claims: {e}"),
            }
        });
    }
    while let Some(r) = set.join_next().await {
        tally(r);
    }
    (n, free)
}

/// Runs the soak with `opts` and reports. Panics if a store cannot be reached.
pub async fn run(opts: Options) -> Report {
    let started = Instant::now();
    let rss_start = rss_kib();
    let run_id = format!("{:012x}", fastrand::u64(..) & 0xffff_ffff_ffff);
    let unavailable = Unavailable::first_attempts(opts.unavailable_p, opts.seed ^ 0x5eed);
    let url = || opts.url.clone().expect("a store URL for this store");
    // The instances and the handles the end-of-run checks need.
    let (addrs, ledger, cut, checker): (Vec<SocketAddr>, Ledger, Option<Arc<CutProxy>>, Checker) =
        match opts.store {
            StoreKind::Memory => {
                // Sized for the run (peak writes x TTL), as the store's docs ask: the default
                // capacity (100 000) would evict records of a long run before their TTL.
                let store = MemoryStore::with_capacity(MEMORY_CAPACITY);
                let ledger = Ledger::Memory(Arc::default());
                let layer = IdempotencyLayer::new(store.clone())
                    .default_tenant(TENANT)
                    .ttl(RECORD_TTL)
                    .lease(opts.lease);
                let addr = start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await;
                (
                    vec![addr],
                    ledger,
                    None,
                    Checker::Memory(store, vec![layer]),
                )
            }
            StoreKind::Redis => {
                let url = url();
                let proxy = Arc::new(CutProxy::start(authority(&url)).await);
                let prefix = format!("chaos:{run_id}:");
                let connect = || async {
                    RedisStore::builder(via(&url, proxy.addr()))
                        .prefix(prefix.clone())
                        .connect()
                        .await
                        .expect("REDIS_URL must be reachable")
                };
                let client = redis::Client::open(url.as_str()).expect("a Redis URL");
                let conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("REDIS_URL must be reachable");
                let ledger = Ledger::Redis(conn, format!("chaos:{run_id}:ledger"));
                let mut addrs = Vec::new();
                let mut layers = Vec::new();
                for _ in 0..2 {
                    let layer = IdempotencyLayer::new(connect().await)
                        .default_tenant(TENANT)
                        .ttl(RECORD_TTL)
                        .lease(opts.lease);
                    addrs.push(
                        start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await,
                    );
                    layers.push(layer);
                }
                let direct = RedisStore::builder(url.clone())
                    .prefix(prefix.clone())
                    .connect()
                    .await
                    .expect("REDIS_URL must be reachable");
                (addrs, ledger, Some(proxy), Checker::Redis(direct, layers))
            }
            StoreKind::Postgres => {
                let url = url();
                let proxy = Arc::new(CutProxy::start(authority(&url)).await);
                let table = format!("chaos_{run_id}");
                let connect = |url: String| {
                    let table = table.clone();
                    async move {
                        let store = PostgresStore::builder(url)
                            .table(table)
                            .connect()
                            .await
                            .expect("DATABASE_URL must be reachable");
                        store.migrate().await.expect("migrate");
                        store
                    }
                };
                let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .expect("DATABASE_URL must be reachable");
                tokio::spawn(conn);
                let ledger_table = format!("chaos_ledger_{run_id}");
                client
                    .batch_execute(&format!(
                        "CREATE TABLE {ledger_table} (key text PRIMARY KEY, n bigint NOT NULL)"
                    ))
                    .await
                    .expect("create the ledger table");
                let ledger = Ledger::Postgres(Arc::new(client), ledger_table);
                let mut addrs = Vec::new();
                let mut layers = Vec::new();
                for _ in 0..2 {
                    let layer = IdempotencyLayer::new(connect(via(&url, proxy.addr())).await)
                        .default_tenant(TENANT)
                        .ttl(RECORD_TTL)
                        .lease(opts.lease);
                    addrs.push(
                        start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await,
                    );
                    layers.push(layer);
                }
                let direct = connect(url.clone()).await;
                (
                    addrs,
                    ledger,
                    Some(proxy),
                    Checker::Postgres(direct, layers),
                )
            }
        };
    let faults = chooser(opts.seed, opts.drop_p, opts.reset_p, opts.delay_p);
    let proxy = Proxy::start(addrs.clone(), Protocol::Http1, faults).await;
    let base = format!("http://{}", proxy.addr);

    // The store outage: cut for `cut_for` every `cut_every`.
    let cutter = cut.clone().map(|cut| {
        let (every, for_) = (opts.cut_every, opts.cut_for);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every.saturating_sub(for_)).await;
                cut.cut();
                tokio::time::sleep(for_).await;
                cut.restore();
            }
        })
    });

    // The clients.
    let client = retrying_client();
    let stop_at = Instant::now() + opts.duration;
    let results: Arc<Mutex<Vec<(String, Outcome)>>> = Arc::default();
    let attempts = Arc::new(AtomicUsize::new(0));
    let rss_middle = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let rss_middle = rss_middle.clone();
        let half = opts.duration / 2;
        tokio::spawn(async move {
            tokio::time::sleep(half).await;
            rss_middle.store(rss_kib() as usize, Ordering::SeqCst);
        })
    };
    let mut workers = Vec::new();
    for w in 0..opts.clients {
        let (client, base, results, attempts) = (
            client.clone(),
            base.clone(),
            results.clone(),
            attempts.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < stop_at {
                let key = format!("op-{w:03}-{i:08}-{:08x}", fastrand::u32(..));
                i += 1;
                let (outcome, n) = operation(&client, &base, &key).await;
                attempts.fetch_add(n as usize, Ordering::Relaxed);
                results.lock().unwrap().push((key, outcome));
            }
        }));
    }
    for w in workers {
        w.await.expect("a client task");
    }
    if let Some(c) = cutter {
        c.abort();
    }
    let _ = sampler.await;
    if let Some(cut) = &cut {
        cut.restore();
    }
    // Let detached completions and releases land.
    tokio::time::sleep(SETTLE).await;

    let results = std::mem::take(&mut *results.lock().unwrap());
    let keys: Vec<String> = results.iter().map(|(k, _)| k.clone()).collect();
    let succeeded_keys: std::collections::HashSet<&str> = results
        .iter()
        .filter(|(_, o)| *o == Outcome::Succeeded)
        .map(|(k, _)| k.as_str())
        .collect();
    let ledger_all = ledger.all().await.expect("read the ledger");
    let ((in_flight_left, free), layers) = match &checker {
        Checker::Memory(s, l) => (in_flight(s, &keys).await, sum(l)),
        Checker::Redis(s, l) => (in_flight(s, &keys).await, sum(l)),
        Checker::Postgres(s, l) => (in_flight(s, &keys).await, sum(l)),
    };
    let mut report = Report {
        store: format!("{:?}", opts.store).to_lowercase(),
        instances: addrs.len(),
        lease: opts.lease,
        attempted: results.len(),
        http_attempts: attempts.load(Ordering::Relaxed) as u64,
        dropped: proxy.stats.dropped.load(Ordering::SeqCst),
        reset: proxy.stats.reset.load(Ordering::SeqCst),
        delayed: proxy.stats.delayed.load(Ordering::SeqCst),
        unavailable: unavailable.injected(),
        cuts: cut.as_ref().map_or(0, |c| c.cuts()),
        executions: ledger_all.values().sum(),
        in_flight_left,
        layer: layers,
        unrecorded: free
            .into_iter()
            .filter(|k| succeeded_keys.contains(k.as_str()))
            .collect(),
        ..Report::default()
    };
    let used: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
    report.unknown_keys = ledger_all
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .count();
    for (key, outcome) in &results {
        let n = ledger_all.get(key).copied().unwrap_or(0);
        if n > 1 {
            report.duplicates.push((key.clone(), n));
        }
        match outcome {
            Outcome::Succeeded => {
                report.succeeded += 1;
                if n == 0 {
                    report.lost.push(key.clone());
                }
            }
            Outcome::Failed(why) => {
                *report.failed.entry(why.clone()).or_default() += 1;
                if n == 1 {
                    report.failed_but_executed += 1;
                }
            }
        }
    }
    ledger.drop_all().await;
    if let (Ledger::Postgres(c, _), Checker::Postgres(store, _)) = (&ledger, &checker) {
        let _ = c
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", store.table()))
            .await;
    }
    report.rss_kib = [
        rss_start,
        rss_middle.load(Ordering::SeqCst) as u64,
        rss_kib(),
    ];
    report.elapsed = started.elapsed();
    report
}

/// The store (reached directly, not through the cut) and layers the end-of-run checks read.
enum Checker {
    Memory(MemoryStore, Vec<IdempotencyLayer<MemoryStore>>),
    Redis(RedisStore, Vec<IdempotencyLayer<RedisStore>>),
    Postgres(PostgresStore, Vec<IdempotencyLayer<PostgresStore>>),
}

fn sum<St>(layers: &[IdempotencyLayer<St>]) -> [u64; 6] {
    let mut out = [0; 6];
    for l in layers {
        let m = l.stats();
        for (o, v) in out.iter_mut().zip([
            m.executed,
            m.replayed,
            m.waited,
            m.recorded,
            m.released,
            m.store_errors,
        ]) {
            *o += v;
        }
    }
    out
}

pub mod kill;
pub mod storm;

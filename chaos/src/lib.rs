//! The chaos soak: many clients with `RetryLayer` -> the e2e fault proxy (drops after the
//! request, delays, resets) -> one or two server instances with `IdempotencyLayer` sharing a
//! store, reached through a TCP fault proxy that inflicts each fault of a link in turn at a fixed
//! period (latency, replies held after the request ran, a slow reader, a reset, connections
//! left half-open, a cut). The handler writes a side-effect
//! ledger keyed by idempotency key. At the end, [`Report::problems`] checks that every succeeded
//! operation's effect happened exactly once, no key ran twice, and no claim was left in flight.
//!
//! The clients come in [`Group`]s: each [`Wire`] (HTTP/1.1, HTTP/2, gRPC through tonic) with
//! each [`Policy`] (one tuned for the faults, and `RetryPolicy::default()`), each group with a
//! layer of its own. The report gives every group's failures at the caller by cause, and the
//! layer's reasons for giving up.
//!
//! `cargo run --release -p chaos -- --minutes 5 --store redis` runs it; a short run of each
//! store is `chaos/tests/short.rs`, which `.ci/run` runs alone after the test suite. [`kill`] is the soak whose servers
//! are processes that get killed (`--bin kill`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use idempotency_layer::store::{Begin, Fingerprint, StoreError};
use idempotency_layer::{
    IdempotencyLayer, IdempotencyStore, MemoryStore, PostgresStore, RedisStore, Scope,
};
use retry_layer::{ReplayBody, Retry, RetryLayer, RetryStats};
use test_support::fault_proxy::{authority, via, LinkFault};

use crate::links::FaultedLinks;
use test_support::faults::Unavailable;
use test_support::proxy::{Chooser, Mode, Protocol, Proxy};
use tokio_stream::wrappers::TcpListenerStream;

mod attempts;
mod conn_trace;
mod links;
mod trace_ring;

pub use wire::{Group, Policy, Wire};
use wire::{OpsServer, WireClient};

/// The tenant every chaos client writes as.
const TENANT: &str = "chaos";
/// How long records outlive the run's last operation, so that the end-of-run check finds the
/// record of every succeeded operation, the first one too (Redis keys expire by themselves;
/// the PostgreSQL tables are dropped at the end).
const RECORD_TTL_PAST_RUN: Duration = Duration::from_secs(600);
/// How long the end of a run waits for detached completions and releases before checking that
/// no claim is left in flight (much less than a lease: nothing may be left to lapse).
const SETTLE: Duration = Duration::from_secs(4);
/// The memory store's capacity in entries: more than a 30-minute run writes (every record is
/// kept to the end). Its bytes are bounded by [`MEMORY_MAX_BYTES`] only.
const MEMORY_CAPACITY: usize = 8_000_000;
/// The memory store's byte bound: the entries' bound times the cost of a chaos record, with
/// room to spare (the default, 128 MiB, holds about 500 000 records).
const MEMORY_MAX_BYTES: usize = MEMORY_CAPACITY * 1024;
/// An operation with no answer after this long is hung: given up on (so the run ends), counted
/// and reported as a failed check. It is past every bound of both policies: the tuned one's
/// deadline is 20 s; the default one has none, and its 3 attempts end within 3 x 60 s
/// (`response_head_timeout`) plus two backoffs of at most 1.2 s.
const HUNG_AFTER: Duration = Duration::from_secs(200);
/// An HTTP attempt pending this long is reported with what the proxies saw (a stranded request): far longer
/// than any answer of the servers takes (their waits end within 30 s).
const STUCK_AFTER: Duration = Duration::from_secs(40);
/// An HTTP attempt still pending this long after hyper dropped the connection it was handed
/// is reported at once (a stranded request): when a connection goes, every request on it fails within
/// milliseconds.
const SUSPECT_AFTER: Duration = Duration::from_secs(1);
/// At most this many trace files are written per run.
const TRACE_DUMPS: usize = 20;
/// The failure cause of a hung operation.
const HUNG: &str = "hung: no answer within 200 s";
/// The one write endpoint.
const PATH: &str = "/ops";

/// Which store the server instances share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// One instance with an in-process `MemoryStore` (no store link to fault).
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
    /// PostgreSQL: where the ledger lives (the store URL unless given): the server's own URL
    /// when the store goes through a transaction pooler (`pooling=transaction`), whose
    /// sessions cannot hold the ledger's prepared statements.
    pub ledger_url: Option<String>,
    /// How long clients start new operations.
    pub duration: Duration,
    /// Concurrent clients, each doing one logical operation at a time, spread over the groups
    /// (every wire with every policy).
    pub clients: usize,
    /// The wires clients speak.
    pub wires: Vec<Wire>,
    /// The retry policies clients run.
    pub policies: Vec<Policy>,
    /// Every `store_fault_every`, the store's link suffers the next fault of
    /// [`LinkFault::ALL`] in turn ...
    pub store_fault_every: Duration,
    /// ... for `store_fault_for` (a reset or a half-open acts at once).
    pub store_fault_for: Duration,
    /// Share of connections dropped after the request reached the server.
    pub drop_p: f64,
    /// Share of connections reset before anything was relayed (HTTP/1.1 only: an HTTP/2
    /// connection is shared by many calls).
    pub reset_p: f64,
    /// Share of connections whose answer is delayed by 20 to 200 ms.
    pub delay_p: f64,
    /// Share of first attempts answered 503 inside the layer (not executed).
    pub unavailable_p: f64,
    /// The seed of every random choice.
    pub seed: u64,
    /// The claims' lease (the layer's default is 30 s).
    pub lease: Duration,
    /// HTTP/2 keep-alive on the HTTP/2 and gRPC clients (PING every 10 s, 5 s to answer).
    pub h2_keep_alive: bool,
    /// With the memory store: `MemoryStore::new()` as it ships (100 000 records, 128 MiB, a
    /// 50 % share per tenant while others are present), instead of a store sized for the run.
    pub memory_defaults: bool,
}

impl Options {
    /// The defaults of the long run: 36 clients over every wire and policy (6 groups of 6),
    /// a store link fault for 2 s every 20 s, 10 % drops after the request, 5 % resets, 5 % delays, 5 %
    /// injected 503s.
    pub fn new(store: StoreKind, url: Option<String>, duration: Duration) -> Self {
        Options {
            store,
            url,
            ledger_url: None,
            duration,
            clients: 36,
            wires: Wire::ALL.to_vec(),
            policies: Policy::ALL.to_vec(),
            store_fault_every: Duration::from_secs(20),
            store_fault_for: Duration::from_secs(2),
            drop_p: 0.10,
            reset_p: 0.05,
            delay_p: 0.05,
            unavailable_p: 0.05,
            seed: 7,
            lease: Duration::from_secs(30),
            h2_keep_alive: true,
            memory_defaults: false,
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

/// Ledger writes that failed, in this process (the report shows a run's share).
static LEDGER_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Ledger writes whose reply took longer than redis-rs's default response timeout (500 ms):
/// each would have been an error, its write applied, with that default (the soak's own retry counted twice).
static LEDGER_SLOW: AtomicU64 = AtomicU64::new(0);

impl Ledger {
    /// Records one execution for `key`; returns the count after it. An error is ambiguous (the
    /// write may have been applied and only its reply lost): the handlers answer it with a
    /// failure no client retries, never with one that says nothing ran.
    pub(crate) async fn add(&self, key: &str) -> Result<u64, BoxError> {
        let started = Instant::now();
        let added = self.try_add(key).await;
        if added.is_err() {
            LEDGER_ERRORS.fetch_add(1, Ordering::Relaxed);
        }
        if started.elapsed() > Duration::from_millis(500) {
            LEDGER_SLOW.fetch_add(1, Ordering::Relaxed);
        }
        added
    }

    async fn try_add(&self, key: &str) -> Result<u64, BoxError> {
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
        // The effect may have happened (a lost reply): a 500 is not recorded and not retried.
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("ledger: {e}")),
    }
}

/// One server instance: its HTTP listener (HTTP/1.1 and h2c) and its gRPC listener.
#[derive(Debug, Clone, Copy)]
struct Instance {
    http: SocketAddr,
    grpc: SocketAddr,
}

/// Serves one instance on 127.0.0.1:0: axum for HTTP/1.1 and h2c, tonic for gRPC, both behind
/// `layer` with `faults` inside it.
async fn start_instance<St: IdempotencyStore>(
    layer: IdempotencyLayer<St>,
    faults: Unavailable,
    ledger: Ledger,
) -> Instance {
    let bind = || async {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
    };
    let app = Router::new()
        .route(PATH, post(handle))
        .with_state(ledger.clone())
        .layer(faults.clone())
        .layer(layer.clone());
    let listener = bind().await;
    let http = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let listener = bind().await;
    let grpc = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .layer(layer)
            .layer(faults)
            .add_service(OpsServer::new(ledger))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
    });
    Instance { http, grpc }
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

/// The hyper client the HTTP wires and kill chaos share, through `layer`.
pub(crate) type HttpClient = Retry<
    attempts::Attempts<
        Client<conn_trace::TracedConnector, attempts::TracedBody<ReplayBody<Full<Bytes>>>>,
    >,
>;

/// How one logical operation ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Succeeded,
    Failed(String),
}

/// Runs `clients` loops until `stop_at`, each starting one operation after the other: client
/// `w`'s `i`-th operation is `op(w, i)`. Returns every operation's result.
pub(crate) async fn drive<T, F, Fut>(clients: usize, stop_at: Instant, op: F) -> Vec<T>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    drive_while(clients, move || Instant::now() < stop_at, op).await
}

/// [`drive`] while `go_on` says so (checked before each new operation).
pub(crate) async fn drive_while<T, G, F, Fut>(clients: usize, go_on: G, op: F) -> Vec<T>
where
    G: Fn() -> bool + Clone + Send + 'static,
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    let workers: Vec<_> = (0..clients)
        .map(|w| {
            let (op, go_on) = (op.clone(), go_on.clone());
            tokio::spawn(async move {
                let mut done = Vec::new();
                let mut i = 0;
                while go_on() {
                    done.push(op(w, i).await);
                    i += 1;
                }
                done
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.expect("a client task"));
    }
    all
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
    /// The store link's faults, by kind, in the order of [`LinkFault::ALL`].
    pub store_faults: Vec<(LinkFault, usize)>,
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
    /// Claims still in flight after the drain (must be 0): looked up again every second for
    /// up to half a lease.
    pub in_flight_left: usize,
    /// Claims in flight 4 s after the drain that ended within half a lease (completions
    /// retrying through a store link fault at the end of the run).
    pub claims_settled_late: usize,
    /// Succeeded operations whose key holds no record (must be empty: a retry would run again).
    pub unrecorded: Vec<String>,
    /// Operations that got no answer within 200 s, by group and key (must be empty).
    pub hung: Vec<(Group, String)>,
    /// Layer counters summed over instances: executed, replayed, waited, recorded, released,
    /// store errors, lapsed claims, detached work refused.
    pub layer: [u64; 8],
    /// Ledger writes that failed (answered 500 / INTERNAL, never retried: they may have run).
    pub ledger_errors: u64,
    /// Ledger writes whose reply took longer than 500 ms.
    pub ledger_slow: u64,
    /// The memory store's claims refused because it was full, and records it evicted.
    pub memory_store: Option<(u64, u64)>,
    /// RSS in KiB at start, middle and end.
    pub rss_kib: [u64; 3],
    /// Each client group's operations and its layer's counters.
    pub groups: BTreeMap<Group, GroupReport>,
    /// Each wire's proxy faults: dropped after the request, reset, delayed.
    pub wire_faults: BTreeMap<Wire, [usize; 3]>,
}

/// What one client group (a wire and a policy) saw.
#[derive(Debug, Default, Clone)]
pub struct GroupReport {
    /// Concurrent clients in the group.
    pub clients: usize,
    /// Logical operations started.
    pub attempted: usize,
    /// Operations whose client got the handler's answer.
    pub succeeded: usize,
    /// Operations that ended in failure at the caller, by cause (the final status, or the
    /// error).
    pub failed: BTreeMap<String, usize>,
    /// The group's retry layer counters: why it stopped retrying.
    pub retry: RetryStats,
}

impl GroupReport {
    /// Operations that failed at the caller.
    pub fn failures(&self) -> usize {
        self.failed.values().sum()
    }

    /// Failed operations per 10 000 attempted.
    pub fn failure_rate(&self) -> f64 {
        self.failures() as f64 * 10_000.0 / self.attempted.max(1) as f64
    }
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
        if !self.hung.is_empty() {
            p.push(format!(
                "{} operations got no answer within {HUNG_AFTER:?}: {:?}",
                self.hung.len(),
                &self.hung[..self.hung.len().min(5)]
            ));
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
            "  faults injected        {} dropped after request, {} reset, {} delayed, {} 503 in-layer",
            self.dropped, self.reset, self.delayed, self.unavailable
        )?;
        if !self.store_faults.is_empty() {
            writeln!(
                f,
                "  store link faults      {}",
                links::describe(&self.store_faults)
            )?;
        }
        for (wire, [dropped, reset, delayed]) in &self.wire_faults {
            writeln!(
                f,
                "    {:<6}               {dropped} dropped, {reset} reset, {delayed} delayed",
                wire.name()
            )?;
        }
        writeln!(
            f,
            "  by group               clients  attempted  succeeded  failed (per 10 000)  retries  budget-refused  exhausted  deadline  pushback"
        )?;
        for (group, g) in &self.groups {
            let r = &g.retry;
            writeln!(
                f,
                "    {:<20} {:>7}  {:>9}  {:>9}  {:>6} ({:>7.1})  {:>7}  {:>14}  {:>9}  {:>8}  {:>8}",
                group.to_string(),
                g.clients,
                g.attempted,
                g.succeeded,
                g.failures(),
                g.failure_rate(),
                r.retries,
                r.budget_refusals,
                r.exhausted,
                r.deadline_stops,
                r.pushback_stops
            )?;
            for (why, n) in &g.failed {
                writeln!(f, "      {why}: {n}")?;
            }
        }
        let [executed, replayed, waited, recorded, released, store_errors, lapsed, detached_refused] =
            self.layer;
        writeln!(
            f,
            "  layer                  {executed} executed, {replayed} replayed, {waited} waited, {recorded} recorded, {released} released, {store_errors} store errors, {lapsed} lapsed, {detached_refused} detached refused"
        )?;
        writeln!(
            f,
            "  ledger errors          {} ({} replies over 500 ms)",
            self.ledger_errors, self.ledger_slow
        )?;
        writeln!(f, "  ledger executions      {}", self.executions)?;
        if let Some((refused, evicted)) = self.memory_store {
            writeln!(
                f,
                "  memory store           {refused} claims refused as full, {evicted} records evicted"
            )?;
        }
        writeln!(f, "  duplicates (key > 1)   {}", self.duplicates.len())?;
        writeln!(f, "  lost (succeeded, 0)    {}", self.lost.len())?;
        writeln!(f, "  failed but executed    {}", self.failed_but_executed)?;
        writeln!(f, "  unknown ledger keys    {}", self.unknown_keys)?;
        writeln!(
            f,
            "  in-flight claims left  {} ({} more ended late)",
            self.in_flight_left, self.claims_settled_late
        )?;
        writeln!(f, "  succeeded, no record   {}", self.unrecorded.len())?;
        writeln!(f, "  hung (no answer)       {}", self.hung.len())?;
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

/// The claims a run left, as [`settle_claims`] found them.
#[derive(Debug, Default)]
pub(crate) struct Claims {
    /// Claims in flight at the first look that ended (completed or released) later.
    pub(crate) late: usize,
    /// Claims still in flight at the last look.
    pub(crate) left: usize,
    /// Keys that hold no record.
    pub(crate) free: Vec<String>,
}

/// Looks up `scopes` in `store` (see [`in_flight`]); claims still in flight are looked up again
/// every second for up to `patience`: a completion retrying through a store outage may end a
/// few seconds after the run. `patience` must stay well under a lease, so that a claim left to
/// lapse is still seen in flight.
pub(crate) async fn settle_claims<St: IdempotencyStore>(
    store: &St,
    scopes: &[(String, String)],
    patience: Duration,
) -> Claims {
    let until = Instant::now() + patience;
    let (mut held, mut free) = in_flight(store, scopes).await;
    let first = held.len();
    while !held.is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (still, freed) = in_flight(store, &held).await;
        free.extend(freed);
        held = still;
    }
    Claims {
        late: first - held.len(),
        left: held.len(),
        free,
    }
}

/// Looks up `scopes` (each a method and a key of the tenant `chaos`) in `store`: which are
/// claimed in flight, and which keys hold no record (free). A scope found free is claimed and
/// released again at once (the check must not leave anything behind).
async fn in_flight<St: IdempotencyStore>(
    store: &St,
    scopes: &[(String, String)],
) -> (Vec<(String, String)>, Vec<String>) {
    /// Lookups at once (a long run checks hundreds of thousands of keys).
    const CONCURRENCY: usize = 32;
    let mut held = Vec::new();
    let mut free = Vec::new();
    let mut set = tokio::task::JoinSet::new();
    type Look = ((String, String), Lookup);
    let mut tally = |r: Result<Look, tokio::task::JoinError>| match r.expect("a lookup task") {
        (scope, Lookup::Held) => held.push(scope),
        ((_, key), Lookup::Free) => free.push(key),
        (_, Lookup::Recorded) => {}
    };
    for (method, key) in scopes {
        if set.len() >= CONCURRENCY {
            if let Some(r) = set.join_next().await {
                tally(r);
            }
        }
        let (store, method, key) = (store.clone(), method.clone(), key.clone());
        set.spawn(async move {
            let scope = Scope::new(TENANT, &method, &key).key_in(&store);
            let look = match store
                .begin(scope, Fingerprint([0; 32]), Duration::from_secs(5))
                .await
            {
                Ok(Begin::InFlight { .. }) => Lookup::Held,
                Ok(Begin::New(token)) => {
                    let _ = store.release(scope, token).await;
                    Lookup::Free
                }
                Ok(Begin::Completed(_)) => Lookup::Recorded,
                // A full store refuses only a claim it has no entry for: the scope is free.
                Err(StoreError::Full) => Lookup::Free,
                Ok(other) => panic!("checking claims: unexpected {other:?}"),
                Err(e) => panic!("checking claims: {e}"),
            };
            ((method, key), look)
        });
    }
    while let Some(r) = set.join_next().await {
        tally(r);
    }
    (held, free)
}

/// Reports attempts pending after their connection is gone: what became of each, the fault
/// proxy's view of the connection, and with `CHAOS_TRACE` the client's events from the first
/// one's start to a little after the connection's drop, written to a file in `CHAOS_TRACE_DIR`
/// (default: the current directory).
fn report_suspects(
    suspects: &[attempts::Suspect],
    stats: &[(Wire, Arc<test_support::proxy::ProxyStats>)],
    dumps: &mut usize,
) {
    let mut by_conn: BTreeMap<u64, Vec<&attempts::Suspect>> = BTreeMap::new();
    for s in suspects {
        by_conn.entry(s.conn.id).or_default().push(s);
    }
    for (id, group) in by_conn {
        let first = group.iter().map(|s| s.started).min().expect("a group");
        let dropped = group[0].conn_dropped;
        let port = group[0].conn.port;
        let mut out = format!(
            "{} attempt(s) pending {:?} after connection {id} (port {port}) was dropped by hyper:\n",
            group.len(),
            dropped.elapsed()
        );
        for s in &group {
            out.push_str(&format!("  {}\n", s.describe()));
        }
        for (wire, st) in stats {
            out.push_str(&format!(
                "  the {} proxy's view of port {port}: {}\n",
                wire.name(),
                st.h2_connection_from(port)
            ));
        }
        if trace_ring::enabled() && *dumps < TRACE_DUMPS {
            *dumps += 1;
            let dir = std::env::var("CHAOS_TRACE_DIR").unwrap_or_else(|_| ".".into());
            let path = format!("{dir}/f7-conn-{id}.trace");
            let from = first.min(dropped) - Duration::from_millis(50);
            let events = trace_ring::between(first, from, dropped + Duration::from_millis(50));
            let header = format!("{out}events from 50 ms before the first attempt's start to 50 ms after the connection's drop, times from the first attempt's start:\n");
            match std::fs::write(&path, header + &events) {
                Ok(()) => out.push_str(&format!("  client trace written to {path}\n")),
                Err(e) => out.push_str(&format!("  client trace not written to {path}: {e}\n")),
            }
        }
        eprint!("{out}");
    }
}

/// What a scope holds.
enum Lookup {
    Held,
    Free,
    Recorded,
}

/// Runs the soak with `opts` and reports. Panics if a store cannot be reached.
pub async fn run(opts: Options) -> Report {
    trace_ring::install_from_env();
    let started = Instant::now();
    let ledger_errors_before = LEDGER_ERRORS.load(Ordering::Relaxed);
    let ledger_slow_before = LEDGER_SLOW.load(Ordering::Relaxed);
    let rss_start = rss_kib();
    let run_id = format!("{:012x}", fastrand::u64(..) & 0xffff_ffff_ffff);
    let unavailable = Unavailable::first_attempts(opts.unavailable_p, opts.seed ^ 0x5eed);
    let url = || opts.url.clone().expect("a store URL for this store");
    let record_ttl = opts.duration + RECORD_TTL_PAST_RUN;
    // The instances and the handles the end-of-run checks need.
    let (instances, ledger, mut links, checker): (
        Vec<Instance>,
        Ledger,
        Option<FaultedLinks>,
        Checker,
    ) = match opts.store {
        StoreKind::Memory => {
            // Sized for the run (peak writes x TTL), as the store's docs ask: with the
            // defaults (100 000 records, 128 MiB) a long run's claims would be refused once
            // the store is full of records younger than its minimum retention (1 h).
            let store = if opts.memory_defaults {
                MemoryStore::new()
            } else {
                MemoryStore::builder()
                    .max_entries(MEMORY_CAPACITY)
                    .max_bytes(MEMORY_MAX_BYTES)
                    .build()
                    .expect("valid MemoryStore settings")
            };
            let ledger = Ledger::Memory(Arc::default());
            let layer = IdempotencyLayer::new(store.clone())
                .tenant(idempotency_layer::TenantSource::fixed(TENANT))
                .ttl(record_ttl)
                .lease(opts.lease);
            let instance = start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await;
            (
                vec![instance],
                ledger,
                None,
                Checker::Memory(store, vec![layer]),
            )
        }
        StoreKind::Redis => {
            let url = url();
            let links = FaultedLinks::start(&[authority(&url).to_owned()]).await;
            let prefix = format!("chaos:{run_id}:");
            let connect = || async {
                RedisStore::builder(via(&url, links.addr(0)))
                    .prefix(prefix.clone())
                    .connect()
                    .await
                    .expect("REDIS_URL must be reachable")
            };
            let client = redis::Client::open(url.as_str()).expect("a Redis URL");
            // No response timeout (redis-rs has 500 ms by default): a slow reply on a
            // loaded machine must not turn an applied HINCRBY into an error (the soak's own retry counted twice).
            let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
            let conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .expect("REDIS_URL must be reachable");
            let ledger = Ledger::Redis(conn, format!("chaos:{run_id}:ledger"));
            let mut addrs = Vec::new();
            let mut layers = Vec::new();
            for _ in 0..2 {
                let layer = IdempotencyLayer::new(connect().await)
                    .tenant(idempotency_layer::TenantSource::fixed(TENANT))
                    .ttl(record_ttl)
                    .lease(opts.lease);
                addrs
                    .push(start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await);
                layers.push(layer);
            }
            let direct = RedisStore::builder(url.clone())
                .prefix(prefix.clone())
                .connect()
                .await
                .expect("REDIS_URL must be reachable");
            (addrs, ledger, Some(links), Checker::Redis(direct, layers))
        }
        StoreKind::Postgres => {
            let url = url();
            let links = FaultedLinks::start(&[authority(&url).to_owned()]).await;
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
            let ledger_url = opts.ledger_url.clone().unwrap_or_else(|| url.clone());
            let (client, conn) = tokio_postgres::connect(&ledger_url, tokio_postgres::NoTls)
                .await
                .expect("the ledger's PostgreSQL must be reachable");
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
                let layer = IdempotencyLayer::new(connect(via(&url, links.addr(0))).await)
                    .tenant(idempotency_layer::TenantSource::fixed(TENANT))
                    .ttl(record_ttl)
                    .lease(opts.lease);
                addrs
                    .push(start_instance(layer.clone(), unavailable.clone(), ledger.clone()).await);
                layers.push(layer);
            }
            let direct = connect(url.clone()).await;
            (
                addrs,
                ledger,
                Some(links),
                Checker::Postgres(direct, layers),
            )
        }
    };
    // A fault proxy per wire, in front of every instance's listener of that wire.
    let mut proxies: BTreeMap<Wire, Proxy> = BTreeMap::new();
    for (n, &wire) in opts.wires.iter().enumerate() {
        let seed = opts.seed.wrapping_add(n as u64 * 0x9e37_79b9);
        let (protocol, reset_p) = match wire {
            Wire::Http1 => (Protocol::Http1, opts.reset_p),
            Wire::Http2 | Wire::Grpc => (Protocol::Http2, 0.0),
        };
        let upstreams = instances
            .iter()
            .map(|i| if wire == Wire::Grpc { i.grpc } else { i.http })
            .collect();
        let faults = chooser(seed, opts.drop_p, reset_p, opts.delay_p);
        proxies.insert(wire, Proxy::start(upstreams, protocol, faults).await);
    }

    // The store link's faults, each in turn for `store_fault_for` every `store_fault_every`.
    if let Some(links) = &mut links {
        links.fault_every(opts.store_fault_every, opts.store_fault_for);
    }

    // The client groups, each with a layer of its own, and the clients spread over them.
    let attempt_log = attempts::AttemptLog::default();
    let groups: Vec<(Group, RetryLayer, WireClient)> = opts
        .wires
        .iter()
        .flat_map(|&wire| {
            opts.policies
                .iter()
                .map(move |&policy| Group { wire, policy })
        })
        .map(|group| {
            let layer = RetryLayer::new(group.policy.retry_policy());
            let client = WireClient::new(
                group.wire,
                &layer,
                proxies[&group.wire].addr,
                attempt_log.clone(),
                opts.h2_keep_alive,
            );
            (group, layer, client)
        })
        .collect();
    assert!(!groups.is_empty(), "at least one wire and one policy");
    let clients: Arc<Vec<(Group, WireClient)>> =
        Arc::new(groups.iter().map(|(g, _, c)| (*g, c.clone())).collect());
    // Reports HTTP attempts that wait far longer than any answer should take, with what the
    // fault proxies saw then; and, within seconds, attempts still pending after the connection
    // they were handed is gone, with the client's trace around them when `CHAOS_TRACE` is set
    // (a stranded request).
    let watchdog = {
        let log = attempt_log.clone();
        let stats: Vec<(Wire, Arc<test_support::proxy::ProxyStats>)> =
            proxies.iter().map(|(w, p)| (*w, p.stats.clone())).collect();
        tokio::spawn(async move {
            let mut followups: Vec<(Instant, Vec<attempts::Suspect>)> = Vec::new();
            let mut dumps = 0usize;
            for tick in 1u64.. {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let suspects = log.suspects(SUSPECT_AFTER);
                if !suspects.is_empty() {
                    report_suspects(&suspects, &stats, &mut dumps);
                    followups.push((Instant::now(), suspects));
                }
                followups.retain(|(since, suspects)| {
                    let settled = suspects.iter().all(attempts::Suspect::body_dropped);
                    if settled || since.elapsed() > HUNG_AFTER {
                        let lines: Vec<String> =
                            suspects.iter().map(attempts::Suspect::describe).collect();
                        eprintln!(
                            "attempts pending after their connection was gone, {}:\n  {}",
                            if settled {
                                "now settled"
                            } else {
                                "still unsettled"
                            },
                            lines.join("\n  ")
                        );
                        return false;
                    }
                    true
                });
                if tick % 5 != 0 {
                    continue;
                }
                let (stuck, since) = log.stuck(STUCK_AFTER);
                let Some(since) = since else {
                    continue;
                };
                let mut proxies = log.conns.report();
                for (wire, s) in &stats {
                    proxies.push_str(&format!("{}:\n{}", wire.name(), s.h2_report_around(since)));
                }
                let events =
                    trace_ring::around(since, Duration::from_millis(3), Duration::from_millis(15));
                if !events.is_empty() {
                    proxies.push_str("client events around the earliest stuck attempt's start:\n");
                    proxies.push_str(&events);
                }
                eprintln!(
                    "attempts pending over {STUCK_AFTER:?}:\n{}\nthe fault proxies then:\n{proxies}",
                    stuck.join("\n")
                );
            }
        })
    };
    let proxy_stats: Arc<BTreeMap<Wire, Arc<test_support::proxy::ProxyStats>>> =
        Arc::new(proxies.iter().map(|(w, p)| (*w, p.stats.clone())).collect());
    let rss_middle = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let rss_middle = rss_middle.clone();
        let half = opts.duration / 2;
        tokio::spawn(async move {
            tokio::time::sleep(half).await;
            rss_middle.store(rss_kib() as usize, Ordering::SeqCst);
        })
    };
    let stop_at = Instant::now() + opts.duration;
    let results = drive(opts.clients, stop_at, move |w, i| {
        let clients = clients.clone();
        let proxy_stats = proxy_stats.clone();
        async move {
            let (group, client) = &clients[w % clients.len()];
            let key = format!("op-{w:03}-{i:08}-{:08x}", fastrand::u32(..));
            let (outcome, attempts) =
                match tokio::time::timeout(HUNG_AFTER, client.operation(&key)).await {
                    Ok(done) => done,
                    Err(_) => {
                        // Where the call's stream waits, as the fault proxy saw it (a stranded request).
                        let seen = proxy_stats
                            .get(&group.wire)
                            .map(|s| s.h2_waiting_streams(Duration::from_secs(30)))
                            .unwrap_or_default();
                        eprintln!(
                        "{group} {key} hung; the proxy's HTTP/2 streams waiting over 30 s:\n{seen}"
                    );
                        (Outcome::Failed(HUNG.into()), 0)
                    }
                };
            (*group, key, outcome, attempts)
        }
    })
    .await;
    let store_faults = links.as_mut().map(FaultedLinks::stop).unwrap_or_default();
    watchdog.abort();
    let _ = sampler.await;
    // Let detached completions and releases land.
    tokio::time::sleep(SETTLE).await;

    let scopes: Vec<(String, String)> = results
        .iter()
        .map(|(g, k, _, _)| (g.wire.scope_method(), k.clone()))
        .collect();
    let succeeded_keys: HashSet<&str> = results
        .iter()
        .filter(|(_, _, o, _)| *o == Outcome::Succeeded)
        .map(|(_, k, _, _)| k.as_str())
        .collect();
    let ledger_all = ledger.all().await.expect("read the ledger");
    let patience = opts.lease / 2;
    let (claims, layers) = match &checker {
        Checker::Memory(s, l) => (settle_claims(s, &scopes, patience).await, sum(l)),
        Checker::Redis(s, l) => (settle_claims(s, &scopes, patience).await, sum(l)),
        Checker::Postgres(s, l) => (settle_claims(s, &scopes, patience).await, sum(l)),
    };
    let faults = |p: &Proxy| {
        [
            p.stats.dropped.load(Ordering::SeqCst),
            p.stats.reset.load(Ordering::SeqCst),
            p.stats.delayed.load(Ordering::SeqCst),
        ]
    };
    let wire_faults: BTreeMap<Wire, [usize; 3]> =
        proxies.iter().map(|(w, p)| (*w, faults(p))).collect();
    let total = |i: usize| wire_faults.values().map(|f| f[i]).sum();
    let mut report = Report {
        store: format!("{:?}", opts.store).to_lowercase(),
        instances: instances.len(),
        lease: opts.lease,
        attempted: results.len(),
        http_attempts: results.iter().map(|(_, _, _, n)| u64::from(*n)).sum(),
        dropped: total(0),
        reset: total(1),
        delayed: total(2),
        unavailable: unavailable.injected(),
        store_faults,
        executions: ledger_all.values().sum(),
        in_flight_left: claims.left,
        claims_settled_late: claims.late,
        layer: layers,
        unrecorded: claims
            .free
            .into_iter()
            .filter(|k| succeeded_keys.contains(k.as_str()))
            .collect(),
        wire_faults,
        groups: groups
            .iter()
            .enumerate()
            .map(|(n, (group, layer, _))| {
                let clients = (0..opts.clients).filter(|w| w % groups.len() == n).count();
                let report = GroupReport {
                    clients,
                    retry: layer.stats(),
                    ..GroupReport::default()
                };
                (*group, report)
            })
            .collect(),
        ..Report::default()
    };
    let used: HashSet<&str> = results.iter().map(|(_, k, _, _)| k.as_str()).collect();
    report.unknown_keys = ledger_all
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .count();
    for (group, key, outcome, _) in &results {
        let n = ledger_all.get(key).copied().unwrap_or(0);
        if n > 1 {
            report.duplicates.push((key.clone(), n));
        }
        let g = report
            .groups
            .get_mut(group)
            .expect("every group is reported");
        g.attempted += 1;
        match outcome {
            Outcome::Succeeded => {
                report.succeeded += 1;
                g.succeeded += 1;
                if n == 0 {
                    report.lost.push(key.clone());
                }
            }
            Outcome::Failed(why) => {
                if why == HUNG {
                    report.hung.push((*group, key.clone()));
                }
                *report.failed.entry(why.clone()).or_default() += 1;
                *g.failed.entry(why.clone()).or_default() += 1;
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
    report.ledger_errors = LEDGER_ERRORS.load(Ordering::Relaxed) - ledger_errors_before;
    if let Checker::Memory(store, _) = &checker {
        let stats = store.stats();
        report.memory_store = Some((stats.refused, stats.evicted));
    }
    report.ledger_slow = LEDGER_SLOW.load(Ordering::Relaxed) - ledger_slow_before;
    report.rss_kib = [
        rss_start,
        rss_middle.load(Ordering::SeqCst) as u64,
        rss_kib(),
    ];
    report.elapsed = started.elapsed();
    report
}

/// The store (reached directly, not through the fault proxy) and layers the end-of-run checks read.
enum Checker {
    Memory(MemoryStore, Vec<IdempotencyLayer<MemoryStore>>),
    Redis(RedisStore, Vec<IdempotencyLayer<RedisStore>>),
    Postgres(PostgresStore, Vec<IdempotencyLayer<PostgresStore>>),
}

fn sum<St>(layers: &[IdempotencyLayer<St>]) -> [u64; 8] {
    let mut out = [0; 8];
    for l in layers {
        let m = l.stats();
        for (o, v) in out.iter_mut().zip([
            m.executed,
            m.replayed,
            m.waited,
            m.recorded,
            m.released,
            m.store_errors,
            m.lapsed,
            m.detached_refused,
        ]) {
            *o += v;
        }
    }
    out
}

pub mod failover;
pub mod kill;
pub mod pg_failover;
pub mod storm;
mod wire;

//! The load test's machinery, shared by the `loadtest` and `targets` binaries: servers on
//! 127.0.0.1 (axum for HTTP, tonic for gRPC, see [`crate::grpc`]), clients with one request in
//! flight per connection, scenarios run in interleaved rounds, and the servers' own statistics
//! for Redis round trips (`INFO commandstats`) and PostgreSQL statements (`pg_stat_statements`).
//!
//! Every scenario's requests/s is compared with the baseline of its protocol in the same run:
//! `no_layers` for HTTP, `grpc/no_layers` for gRPC ([`baseline_of`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
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

use crate::baseline::NaiveCacheLayer;
use crate::retry::CloneOn503;
use crate::{grpc, keys, resident_bytes, RESPONSE_200};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long and how wide every scenario runs.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Concurrent connections (one request in flight on each).
    pub connections: usize,
    /// Measured seconds per scenario and round.
    pub seconds: f64,
    /// Unmeasured warm-up seconds before each scenario and round.
    pub warmup: f64,
    /// Rounds: every scenario runs once per round, the scenarios interleaved, and the medians
    /// over the rounds are reported.
    pub rounds: usize,
    /// Only these scenarios (names as printed, or a prefix before a `/`); empty: all.
    pub only: Vec<String>,
}

impl LoadConfig {
    /// Whether scenario `name` is to run.
    pub fn selected(&self, name: &str) -> bool {
        self.only.is_empty()
            || self
                .only
                .iter()
                .any(|o| name == o || name.starts_with(&format!("{o}/")))
    }
}

/// One scenario's result (or the medians over its rounds).
#[derive(Debug, Clone)]
pub struct Run {
    /// The scenario's name, e.g. `memory/first` or `grpc/no_layers`.
    pub name: String,
    /// Answered requests in the measured seconds (all rounds).
    pub requests: u64,
    /// Requests sent, warm-up included (all rounds): the denominator of round trips and
    /// statements per request.
    pub sent: u64,
    /// Failed requests in the measured seconds (all rounds).
    pub errors: u64,
    /// Answered requests per second (median over rounds).
    pub rps: f64,
    /// Median latency in µs (median over rounds).
    pub p50_us: f64,
    /// 99th percentile latency in µs (median over rounds).
    pub p99_us: f64,
    /// Answered requests per second of each round, in order.
    pub round_rps: Vec<f64>,
    /// The rounds the scenario ran in: scenarios of one group ran interleaved, round `i` of
    /// each right beside round `i` of the others.
    pub group: RoundGroup,
}

/// A set of interleaved rounds (one section of the load test): [`Report::ratio_to`] compares
/// two scenarios of the same group round by round. The default is no group: a run not yet
/// [`merge`]d.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoundGroup(u64);

impl RoundGroup {
    /// A group no other run belongs to yet.
    pub fn new() -> RoundGroup {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        RoundGroup(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

/// One scenario over its rounds (of `group`): medians of requests/s, p50 and p99, sums of the
/// counts.
pub fn merge(rounds: Vec<Run>, group: RoundGroup) -> Run {
    let med = |f: fn(&Run) -> f64| crate::median(&mut rounds.iter().map(f).collect::<Vec<_>>());
    Run {
        name: rounds[0].name.clone(),
        requests: rounds.iter().map(|r| r.requests).sum(),
        sent: rounds.iter().map(|r| r.sent).sum(),
        errors: rounds.iter().map(|r| r.errors).sum(),
        rps: med(|r| r.rps),
        p50_us: med(|r| r.p50_us),
        p99_us: med(|r| r.p99_us),
        round_rps: rounds
            .iter()
            .flat_map(|r| r.round_rps.iter().copied())
            .collect(),
        group,
    }
}

/// The scenario a scenario's requests/s is compared with: `grpc/no_layers` for `grpc/...`,
/// else `no_layers`.
pub fn baseline_of(name: &str) -> &'static str {
    if name.starts_with("grpc/") {
        "grpc/no_layers"
    } else {
        "no_layers"
    }
}

/// What a group of scenarios measured: runs, per-request counts from the servers' statistics
/// (`(scenario, round trips or statements per request)`), and notes to print.
#[derive(Debug, Default)]
pub struct Report {
    /// The scenarios' results.
    pub runs: Vec<Run>,
    /// Round trips (Redis) or statements (PostgreSQL) per request sent, by scenario name;
    /// `"{name} background"`: PostgreSQL statements off the requests' path (lease renewals).
    pub per_request: Vec<(String, f64)>,
    /// Lines to print after the table (skips, counts, caveats).
    pub notes: Vec<String>,
}

impl Report {
    /// Appends `other`.
    pub fn extend(&mut self, other: Report) {
        self.runs.extend(other.runs);
        self.per_request.extend(other.per_request);
        self.notes.extend(other.notes);
    }

    /// The run of scenario `name`.
    pub fn run(&self, name: &str) -> Option<&Run> {
        self.runs.iter().find(|r| r.name == name)
    }

    /// Requests/s of `name` over requests/s of `base`, both of this report: the median of the
    /// rounds' ratios when the two ran in the same interleaved rounds (each round's pair ran
    /// seconds apart, so a slow drift of the machine cancels), else the ratio of the medians.
    pub fn ratio_to(&self, name: &str, base: &str) -> Option<f64> {
        let (r, b) = (self.run(name)?, self.run(base)?);
        let grouped = r.group != RoundGroup::default();
        if grouped && r.group == b.group && r.round_rps.len() == b.round_rps.len() {
            let mut ratios: Vec<f64> = (r.round_rps.iter().zip(&b.round_rps))
                .filter(|(_, b)| **b > 0.0)
                .map(|(r, b)| r / b)
                .collect();
            if ratios.len() == r.round_rps.len() && !ratios.is_empty() {
                return Some(crate::median(&mut ratios));
            }
        }
        (b.rps > 0.0).then(|| r.rps / b.rps)
    }

    /// Requests/s of `name` over its protocol's baseline ([`baseline_of`]).
    pub fn ratio(&self, name: &str) -> Option<f64> {
        self.ratio_to(name, baseline_of(name))
    }

    /// The per-request count of scenario `name`, if counted.
    pub fn per_request(&self, name: &str) -> Option<f64> {
        self.per_request
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Prints the table (ratio to each protocol's baseline) and the notes.
    pub fn print(&self) {
        println!(
            "\n{:<26} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7}",
            "scenario", "requests", "req/s", "p50 us", "p99 us", "ratio", "errors"
        );
        for r in &self.runs {
            let ratio = self
                .ratio(&r.name)
                .map_or_else(|| "-".to_owned(), |x| format!("{x:.3}x"));
            println!(
                "{:<26} {:>10} {:>9.0} {:>9.0} {:>9.0} {:>8} {:>7}",
                r.name, r.requests, r.rps, r.p50_us, r.p99_us, ratio, r.errors
            );
        }
        println!(
            "(ratio: req/s over no_layers, gRPC scenarios over grpc/no_layers, same run; \
             the median of the rounds' ratios where they ran in the same rounds)"
        );
        if !self.notes.is_empty() {
            println!();
            for n in &self.notes {
                println!("{n}");
            }
        }
    }
}

// ---------- HTTP: servers, clients, requests ----------

/// The trivial HTTP handler: `POST /orders` answers 201 with [`RESPONSE_200`].
pub fn handler_app() -> Router {
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

/// The layer every server scenario runs: `IdempotencyLayer` on `store`, tenant `bench`.
pub fn bench_layer<St: IdempotencyStore>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store).tenant(idempotency_layer::TenantSource::fixed("bench"))
}

/// A note if the layer's counters between `before` and `after` do not show what scenario
/// `name` meant to run: every request sent executed (`.../first`) or replayed
/// (`.../replay`). Otherwise the scenario timed something else (refusals, say).
fn check_counters(
    name: &str,
    sent: u64,
    before: &idempotency_layer::IdempotencyStats,
    after: &idempotency_layer::IdempotencyStats,
) -> Option<String> {
    let executed = after.executed - before.executed;
    let replayed = after.replayed - before.replayed;
    let expected = if name.ends_with("/first") {
        (sent, 0)
    } else {
        (0, sent)
    };
    ((executed, replayed) != expected).then(|| {
        format!(
            "WARNING {name}: the layer executed {executed} and replayed {replayed} of {sent} \
             requests sent; expected {} and {}",
            expected.0, expected.1
        )
    })
}

/// A `MemoryStore` sized for every first execution of a run: the defaults (100 000 entries,
/// 128 MiB, half per tenant) would start refusing claims (503) after about 100 000 of them.
pub fn run_memory_store() -> MemoryStore {
    MemoryStore::builder()
        .max_entries(8_000_000)
        .max_bytes(8 << 30)
        .tenant_share_percent(100)
        .build()
        .expect("valid MemoryStore settings")
}

/// Serves `app` on 127.0.0.1 until the returned handle is aborted.
pub async fn serve(app: Router) -> (SocketAddr, tokio::task::JoinHandle<()>) {
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

/// A hyper client (HTTP/1.1, `TCP_NODELAY`, a connection per request in flight).
pub fn client<B>() -> Client<HttpConnector, B>
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
#[derive(Debug, Clone, Copy)]
pub enum Keys {
    /// A new key for every request: first executions.
    Unique,
    /// One key per connection, recorded before the run: replays.
    PerConnection,
}

/// The key of request `i` on connection `conn`.
pub fn key_of(prefix: &str, keys: Keys, conn: usize, i: u64) -> String {
    match keys {
        Keys::Unique => format!("{prefix}-{conn:03}-{i:010}"),
        Keys::PerConnection => format!("{prefix}-replay-{conn:03}"),
    }
}

/// A `POST /orders` to `addr` with idempotency key `key`.
pub fn request(addr: SocketAddr, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::from_static(crate::ORDER)))
        .expect("valid request")
}

/// One client connection's way to send a keyed write and tell whether it got the expected
/// answer (HTTP: 201 and its whole body; gRPC: OK and the 200-byte message).
pub trait Caller: Send + 'static {
    /// Sends one write with idempotency key `key`.
    fn call(&mut self, key: String) -> impl Future<Output = bool> + Send;
}

/// A [`Caller`] over a tower service of HTTP requests to `addr` (a hyper client, possibly
/// behind `RetryLayer`).
#[derive(Debug, Clone)]
pub struct HttpCaller<S> {
    svc: S,
    addr: SocketAddr,
}

impl<S> HttpCaller<S> {
    /// Requests to `addr` through `svc`.
    pub fn new(svc: S, addr: SocketAddr) -> Self {
        HttpCaller { svc, addr }
    }
}

impl<S, B> Caller for HttpCaller<S>
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Send + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn call(&mut self, key: String) -> impl Future<Output = bool> + Send {
        let req = request(self.addr, &key);
        async move {
            match self.svc.ready().await {
                Ok(s) => match s.call(req).await {
                    Ok(res) => {
                        let good = res.status() == StatusCode::CREATED;
                        good && res.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                },
                Err(_) => false,
            }
        }
    }
}

/// Sends one request per connection key so that [`Keys::PerConnection`] runs only replay.
pub async fn record_replay_keys<C: Caller>(mut caller: C, prefix: &str, connections: usize) {
    for conn in 0..connections {
        let key = key_of(prefix, Keys::PerConnection, conn, 0);
        assert!(caller.call(key).await, "pre-record a replay key");
    }
}

/// Runs `cfg.connections` loops, each with the caller `make(conn)` makes, for warm-up +
/// measured seconds, and reports requests/s, p50 and p99 of the measured part.
pub async fn load<C: Caller>(
    name: &str,
    make: impl Fn(usize) -> C,
    keys: Keys,
    prefix: &str,
    cfg: &LoadConfig,
) -> Run {
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(cfg.warmup);
    let end = measure_from + Duration::from_secs_f64(cfg.seconds);
    let tasks: Vec<_> = (0..cfg.connections)
        .map(|conn| {
            let mut caller = make(conn);
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
                    let ok = caller.call(key_of(&prefix, keys, conn, i)).await;
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
    let mut sent = 0;
    for t in tasks {
        let (lat, e, i) = t.await.expect("load task");
        all.extend(lat);
        errors += e;
        sent += i;
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
        sent,
        errors,
        rps: all.len() as f64 / cfg.seconds,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        round_rps: vec![all.len() as f64 / cfg.seconds],
        group: RoundGroup::default(),
    }
}

// ---------- the in-process scenarios: HTTP and gRPC, no store server ----------

/// The scenarios [`in_process_scenarios`] runs (those `cfg.only` selects), in order.
pub fn in_process_scenario_names() -> Vec<&'static str> {
    NAMES.into_iter().chain(PEER_NAMES).collect()
}

/// The in-process scenarios but the peer's.
const NAMES: [&str; 14] = [
    "no_layers",
    "client_retry",
    "client_tower_retry",
    "memory/first",
    "memory/replay",
    "naive/first",
    "naive/replay",
    "grpc/no_layers",
    "grpc/client_retry",
    "grpc/client_tower_retry",
    "grpc/memory/first",
    "grpc/memory/replay",
    "grpc/naive/first",
    "grpc/naive/replay",
];

/// The scenarios with no store server, interleaved in rounds: HTTP `no_layers`,
/// `client_retry`, `memory/first`, `memory/replay`, and the same four over gRPC (`grpc/...`,
/// see [`crate::grpc`]); and, as references of what the same work costs done the way a user
/// would hand-roll it, `client_tower_retry` (`tower::retry` with a cloning policy,
/// [`CloneOn503`]) and `naive/first`, `naive/replay` ([`NaiveCacheLayer`]), and the same three
/// over gRPC (`tower::retry` through [`grpc::TowerRetryChannel`]). With the `axum-idempotent`
/// feature, also the peer a user would pick instead, in the same rounds:
/// `axum-idempotent/first` and `axum-idempotent/replay` (see `benchmarks::peer`). `tag` makes
/// this run's keys unique.
pub async fn in_process_scenarios(cfg: &LoadConfig, tag: &str) -> Report {
    let (plain, plain_task) = serve(handler_app()).await;
    let http_layer = bench_layer(run_memory_store());
    let (memory, memory_task) = serve(handler_app().layer(http_layer.clone())).await;
    record_replay_keys(HttpCaller::new(client(), memory), tag, cfg.connections).await;
    let (naive, naive_task) = serve(handler_app().layer(NaiveCacheLayer::default())).await;
    record_replay_keys(HttpCaller::new(client(), naive), tag, cfg.connections).await;
    let (grpc_plain, grpc_plain_task) = grpc::serve_plain().await;
    let grpc_layer = bench_layer(run_memory_store());
    let (grpc_memory, grpc_memory_task) = grpc::serve_layered(grpc_layer.clone()).await;
    let grpc_replay = format!("{tag}g");
    record_replay_keys(grpc::caller(grpc_memory), &grpc_replay, cfg.connections).await;
    let (grpc_naive, grpc_naive_task) = grpc::serve_layered(NaiveCacheLayer::default()).await;
    record_replay_keys(grpc::caller(grpc_naive), &grpc_replay, cfg.connections).await;
    #[cfg(feature = "axum-idempotent")]
    let (peer, peer_task) = serve(crate::peer::app()).await;
    #[cfg(feature = "axum-idempotent")]
    let peer_sessions = crate::peer::replay_sessions(peer, tag, cfg.connections).await;
    let names = in_process_scenario_names();
    // One retry layer per scenario, shared by its connections (one budget, as one client).
    let http_retry = RetryLayer::new(RetryPolicy::default());
    let grpc_retry = RetryLayer::new(RetryPolicy::default());
    let mut rounds: Vec<Vec<Run>> = names.iter().map(|_| Vec::new()).collect();
    let group = RoundGroup::new();
    let mut notes = Vec::new();
    for round in 0..cfg.rounds {
        let unique = format!("{tag}x{round}");
        let replay = tag.to_owned();
        let grpc_unique = format!("{tag}gx{round}");
        for (i, &name) in names.iter().enumerate() {
            if !cfg.selected(name) {
                continue;
            }
            let http = |addr| move |_| HttpCaller::new(client(), addr);
            let layer = if name.starts_with("grpc/") {
                &grpc_layer
            } else {
                &http_layer
            };
            let before = layer.stats();
            let run = match name {
                "no_layers" => load(name, http(plain), Keys::Unique, &unique, cfg).await,
                "client_retry" => {
                    let make = |_| HttpCaller::new(http_retry.layer(client()), plain);
                    load(name, make, Keys::Unique, &unique, cfg).await
                }
                "client_tower_retry" => {
                    let tower_retry = tower::retry::RetryLayer::new(CloneOn503(2));
                    let make = |_| HttpCaller::new(tower_retry.layer(client()), plain);
                    load(name, make, Keys::Unique, &unique, cfg).await
                }
                "memory/first" => load(name, http(memory), Keys::Unique, &unique, cfg).await,
                "memory/replay" => {
                    load(name, http(memory), Keys::PerConnection, &replay, cfg).await
                }
                "naive/first" => load(name, http(naive), Keys::Unique, &unique, cfg).await,
                "naive/replay" => load(name, http(naive), Keys::PerConnection, &replay, cfg).await,
                "grpc/no_layers" => {
                    let make = |_| grpc::caller(grpc_plain);
                    load(name, make, Keys::Unique, &grpc_unique, cfg).await
                }
                "grpc/client_retry" => {
                    let make = |_| grpc::retry_caller(grpc_plain, &grpc_retry);
                    load(name, make, Keys::Unique, &grpc_unique, cfg).await
                }
                "grpc/client_tower_retry" => {
                    let make = |_| grpc::tower_retry_caller(grpc_plain);
                    load(name, make, Keys::Unique, &grpc_unique, cfg).await
                }
                "grpc/memory/first" => {
                    let make = |_| grpc::caller(grpc_memory);
                    load(name, make, Keys::Unique, &grpc_unique, cfg).await
                }
                "grpc/memory/replay" => {
                    let make = |_| grpc::caller(grpc_memory);
                    load(name, make, Keys::PerConnection, &grpc_replay, cfg).await
                }
                "grpc/naive/first" => {
                    let make = |_| grpc::caller(grpc_naive);
                    load(name, make, Keys::Unique, &grpc_unique, cfg).await
                }
                "grpc/naive/replay" => {
                    let make = |_| grpc::caller(grpc_naive);
                    load(name, make, Keys::PerConnection, &grpc_replay, cfg).await
                }
                #[cfg(feature = "axum-idempotent")]
                crate::peer::FIRST => {
                    let make = |_| crate::peer::SessionCaller::first_executions(peer);
                    load(name, make, Keys::Unique, &unique, cfg).await
                }
                #[cfg(feature = "axum-idempotent")]
                crate::peer::REPLAY => {
                    let make = |conn: usize| {
                        crate::peer::SessionCaller::replays(peer, peer_sessions[conn].clone())
                    };
                    load(name, make, Keys::PerConnection, &replay, cfg).await
                }
                other => unreachable!("no scenario {other}"),
            };
            if name.contains("memory/") {
                notes.extend(check_counters(name, run.sent, &before, &layer.stats()));
            }
            rounds[i].push(run);
        }
    }
    for task in [
        plain_task,
        memory_task,
        naive_task,
        grpc_plain_task,
        grpc_memory_task,
        grpc_naive_task,
        #[cfg(feature = "axum-idempotent")]
        peer_task,
    ] {
        task.abort();
    }
    Report {
        runs: rounds
            .into_iter()
            .filter(|r| !r.is_empty())
            .map(|r| merge(r, group))
            .collect(),
        notes,
        ..Report::default()
    }
}

/// The peer's scenarios, run by [`in_process_scenarios`] with the `axum-idempotent` feature.
#[cfg(feature = "axum-idempotent")]
const PEER_NAMES: [&str; 2] = [crate::peer::FIRST, crate::peer::REPLAY];
#[cfg(not(feature = "axum-idempotent"))]
const PEER_NAMES: [&str; 0] = [];

// ---------- memory per record ----------

/// Resident bytes per record: fills a `MemoryStore` through the layer (trivial handler
/// answering [`RESPONSE_200`]) with `n` first executions and reads `VmRSS` before and after.
/// `None` if `/proc/self/status` cannot be read.
pub async fn memory_per_record(n: usize) -> Option<f64> {
    // Room for every record: the default byte bound (128 MiB, half of it per tenant) would
    // refuse claims before `n` records of this size.
    let store = MemoryStore::builder()
        .max_entries(2 * n)
        .max_bytes(2 * n * 4096)
        .tenant_share_percent(100)
        .build()
        .expect("valid MemoryStore settings");
    let svc = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("bench"))
        .layer(tower::service_fn(
            crate::created::<idempotency_layer::RequestBody<Full<Bytes>>>,
        ));
    let keys = keys("memory", n);
    // Warm the allocator and the runtime with a few records, not counted.
    for k in keys.iter().take(100) {
        let res = svc
            .clone()
            .oneshot(crate::order_request(&format!("{k}-warm")))
            .await
            .expect("ok");
        res.into_body().collect().await.expect("body");
    }
    let before = resident_bytes();
    for k in &keys {
        let res = svc
            .clone()
            .oneshot(crate::order_request(k))
            .await
            .expect("ok");
        res.into_body().collect().await.expect("body");
    }
    let after = resident_bytes();
    assert_eq!(store.len(), n + 100, "every record kept");
    let (b, a) = (before?, after?);
    Some(a.saturating_sub(b) as f64 / n as f64)
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

/// Round trips (EVALSHA + EVAL) per request in the command-count deltas `d`, and a note with
/// the commands the scripts ran inside Redis (not round trips).
fn redis_trips(d: &BTreeMap<String, u64>, sent: u64) -> (f64, String) {
    let trips = d.get("evalsha").copied().unwrap_or(0) + d.get("eval").copied().unwrap_or(0);
    let per = trips as f64 / sent.max(1) as f64;
    let other: Vec<String> = d
        .iter()
        .filter(|(k, v)| **v > 0 && !matches!(k.as_str(), "evalsha" | "eval" | "info"))
        .map(|(k, v)| format!("{k} {:.2}", *v as f64 / sent as f64))
        .collect();
    let note = format!(
        "{per:.3} round trips/request (EVALSHA+EVAL over {sent} requests; run inside the scripts or by other clients: {})",
        if other.is_empty() { "none".to_owned() } else { other.join(", ") }
    );
    (per, note)
}

/// Where the Redis scenarios run: one server or a cluster's masters.
#[derive(Debug, Clone)]
pub struct RedisTarget {
    /// The server's URL, or the cluster's node URLs.
    pub urls: Vec<String>,
    /// Whether `urls` are a cluster's.
    pub cluster: bool,
}

impl RedisTarget {
    /// The scenario names' prefix: `redis` or `redis-cluster`.
    pub fn label(&self) -> &'static str {
        if self.cluster {
            "redis-cluster"
        } else {
            "redis"
        }
    }
}

/// The near cache of the `+near` Redis scenarios: 64 MiB, the default `max_age`.
pub const NEAR_CACHE_BYTES: usize = 64 << 20;

/// **The one place the Redis scenarios build their store**: with a near cache
/// ([`NEAR_CACHE_BYTES`]) if `near`, run by [`redis_scenarios`] as `{label}+near/first` and
/// `{label}+near/replay`.
pub async fn redis_store(
    target: &RedisTarget,
    prefix: &str,
    near: bool,
) -> Result<RedisStore, String> {
    let mut builder = if target.cluster {
        RedisStore::builder_cluster(target.urls.iter().cloned())
    } else {
        RedisStore::builder(&target.urls[0])
    };
    if near {
        builder = builder.near_cache(idempotency_layer::store::NearCache::new(NEAR_CACHE_BYTES));
    }
    builder.prefix(prefix).connect().await.map_err(|e| {
        format!(
            "{}: skipped, cannot connect to {:?}: {e}",
            target.label(),
            target.urls
        )
    })
}

/// `{label}/first` and `{label}/replay` with `store` (a Redis store on `target`, made by
/// [`redis_store`] with key prefix `prefix`), the round trips per request read from the
/// servers' `INFO commandstats`; and `{label}/memory-replay`, the same replays on a
/// `MemoryStore`, in the same rounds, for a round-by-round comparison
/// ([`Report::ratio_to`]). Deletes the run's keys (`{prefix}*`) afterwards.
pub async fn redis_scenarios(
    label: &str,
    store: RedisStore,
    target: &RedisTarget,
    prefix: &str,
    cfg: &LoadConfig,
) -> Report {
    let mut report = Report::default();
    let first = format!("{label}/first");
    let replay = format!("{label}/replay");
    if !cfg.selected(&first) && !cfg.selected(&replay) {
        return report;
    }
    let mut conns = Vec::new();
    for url in &target.urls {
        conns.push(
            redis::Client::open(url.as_str())
                .expect("redis url")
                .get_multiplexed_async_connection()
                .await
                .expect("redis connection"),
        );
    }
    let layer = bench_layer(store);
    let (addr, server) = serve(handler_app().layer(layer.clone())).await;
    let tag = format!("r{}", std::process::id());
    // Loads the scripts (EVALSHA answered NOSCRIPT, then EVAL) and records the replay keys.
    record_replay_keys(HttpCaller::new(client(), addr), &tag, cfg.connections).await;
    let memory_layer = bench_layer(run_memory_store());
    let (memory_addr, memory_server) = serve(handler_app().layer(memory_layer.clone())).await;
    record_replay_keys(
        HttpCaller::new(client(), memory_addr),
        &tag,
        cfg.connections,
    )
    .await;
    let reference = format!("{label}/memory-replay");
    let scenarios = [
        (first, Keys::Unique),
        (replay.clone(), Keys::PerConnection),
        (reference.clone(), Keys::PerConnection),
    ];
    let mut rounds: Vec<Vec<Run>> = scenarios.iter().map(|_| Vec::new()).collect();
    let group = RoundGroup::new();
    let mut deltas = vec![BTreeMap::<String, u64>::new(); scenarios.len()];
    for round in 0..cfg.rounds {
        for (i, (name, keys)) in scenarios.iter().enumerate() {
            if !cfg.selected(name) {
                continue;
            }
            let before = commandstats_all(&mut conns).await;
            let key_prefix = match keys {
                Keys::Unique => format!("{tag}x{round}"),
                Keys::PerConnection => tag.clone(),
            };
            let on_memory = *name == reference;
            let stats = || {
                if on_memory {
                    memory_layer.stats()
                } else {
                    layer.stats()
                }
            };
            let addr = if on_memory { memory_addr } else { addr };
            let make = |_| HttpCaller::new(client(), addr);
            let counted = stats();
            let run = load(name, make, *keys, &key_prefix, cfg).await;
            report
                .notes
                .extend(check_counters(name, run.sent, &counted, &stats()));
            let after = commandstats_all(&mut conns).await;
            for (k, v) in &after {
                let d = v - before.get(k).copied().unwrap_or(0);
                *deltas[i].entry(k.clone()).or_insert(0) += d;
            }
            rounds[i].push(run);
        }
    }
    for (i, (name, _)) in scenarios.iter().enumerate() {
        if rounds[i].is_empty() {
            continue;
        }
        let run = merge(std::mem::take(&mut rounds[i]), group);
        if *name != reference {
            let (per, note) = redis_trips(&deltas[i], run.sent);
            report.notes.push(format!("{name:<18} {note}"));
            report.per_request.push((name.clone(), per));
        }
        report.runs.push(run);
    }
    server.abort();
    memory_server.abort();
    for conn in &mut conns {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(conn)
            .await
            .unwrap_or_default();
        // One key per DEL: a cluster node refuses a DEL of keys in several slots.
        let step = if target.cluster { 1 } else { 1000 };
        for chunk in keys.chunks(step) {
            let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(conn).await;
        }
    }
    report
}

/// The Redis scenarios on `target`, without and with a near cache: connects the store
/// ([`redis_store`]) and runs [`redis_scenarios`], or says why they were skipped.
pub async fn redis_section(target: &RedisTarget, cfg: &LoadConfig) -> Report {
    let mut report = Report::default();
    for near in [false, true] {
        let label = if near {
            format!("{}+near", target.label())
        } else {
            target.label().to_owned()
        };
        let prefix = format!("loadtest:{}:{label}:", std::process::id());
        match redis_store(target, &prefix, near).await {
            Ok(store) => {
                let cache = store.clone();
                let mut part = redis_scenarios(&label, store, target, &prefix, cfg).await;
                if let Some(stats) = cache.near_cache_stats() {
                    part.notes.push(format!(
                        "{label:<18} near cache: {} hits, {} misses, {} entries ({} bytes)",
                        stats.hits, stats.misses, stats.entries, stats.bytes
                    ));
                }
                report.extend(part);
            }
            Err(note) => report.notes.push(note),
        }
    }
    report
}

// ---------- PostgreSQL statements (pg_stat_statements) ----------

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
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

/// How to turn `pg_stat_statements` on, for the note printed when it is not available.
const PG_STAT_STATEMENTS_HOWTO: &str = "to count statements, load pg_stat_statements: \
     `shared_preload_libraries = 'pg_stat_statements'` in postgresql.conf (or `ALTER SYSTEM SET \
     shared_preload_libraries = 'pg_stat_statements'`), restart PostgreSQL, then \
     `CREATE EXTENSION pg_stat_statements;` in the database of DATABASE_URL as a superuser";

/// Reads `pg_stat_statements` for one database: calls by statement text.
struct StatementCounter {
    client: tokio_postgres::Client,
    dbid: u32,
}

impl StatementCounter {
    /// A counter of the statements run in database `db`, reading the view through `admin` (the
    /// database of DATABASE_URL) if the extension is there, else through a connection to `db`
    /// after creating the extension in it (needs the library preloaded and a superuser).
    async fn new(admin_url: &str, db: &str) -> Result<StatementCounter, String> {
        let mut errors = Vec::new();
        for (url, create) in [
            (admin_url.to_owned(), false),
            (with_database(admin_url, db), true),
        ] {
            let (client, conn) = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                Ok(c) => c,
                Err(e) => {
                    errors.push(e.to_string());
                    continue;
                }
            };
            tokio::spawn(conn);
            if create {
                if let Err(e) = client
                    .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                    .await
                {
                    errors.push(db_error(&e));
                    continue;
                }
            }
            let dbid = match client
                .query_one("SELECT oid FROM pg_database WHERE datname = $1", &[&db])
                .await
            {
                Ok(row) => row.get::<_, u32>(0),
                Err(e) => {
                    errors.push(db_error(&e));
                    continue;
                }
            };
            let counter = StatementCounter { client, dbid };
            match counter.read().await {
                Ok(_) => return Ok(counter),
                Err(e) => errors.push(e),
            }
        }
        Err(errors.join("; "))
    }

    /// Calls of every statement run in the database so far (the counter's own reads, which
    /// name the view, left out).
    async fn read(&self) -> Result<BTreeMap<String, i64>, String> {
        let rows = self
            .client
            .query(
                "SELECT query, sum(calls)::bigint FROM pg_stat_statements \
                 WHERE dbid = $1 AND query NOT ILIKE '%pg_stat_statements%' GROUP BY query",
                &[&self.dbid],
            )
            .await
            .map_err(|e| db_error(&e))?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            .collect())
    }
}

fn db_error(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned())
}

/// Statements that run once per store or connection, not per request: `LISTEN`, migrations,
/// session settings, transaction control.
fn is_setup_statement(sql: &str) -> bool {
    let head = sql.trim_start().to_ascii_uppercase();
    [
        "LISTEN", "UNLISTEN", "CREATE", "ALTER", "SET", "SHOW", "RESET", "DISCARD", "BEGIN",
        "START", "COMMIT", "ROLLBACK",
    ]
    .iter()
    .any(|k| head.starts_with(k))
        || head.contains("PG_ADVISORY")
        || head.contains("PG_NAMESPACE")
}

/// A short name for a statement: its first words.
fn short_sql(sql: &str) -> String {
    let words: Vec<&str> = sql.split_whitespace().take(6).collect();
    let mut s = words.join(" ");
    if s.len() > 60 {
        s.truncate(60);
        s.push_str("..");
    }
    s
}

/// Statements the store runs off the requests' path: lease renewals (the layer's renewal task
/// extends every claim it holds each third of the lease, in one statement per claim) and the
/// expiry cleanup (off in the loadtest).
fn is_background_statement(sql: &str) -> bool {
    let head = sql.trim_start().to_ascii_uppercase();
    (head.starts_with("UPDATE") && head.contains("SET EXPIRES_AT"))
        || (head.starts_with("DELETE") && head.contains("CTID"))
}

/// Statements counted for one scenario, per request sent.
#[derive(Debug, Clone, Copy)]
struct StatementCounts {
    /// Statements on the requests' path (claims, records, lookups).
    path: f64,
    /// Statements off the path: lease renewals, cleanup.
    background: f64,
}

/// Statements per request sent from the calls by statement `delta` of a scenario, and a note
/// listing each statement's calls per request, with the background and one-time statements
/// apart.
fn statements_per_request(delta: &BTreeMap<String, i64>, sent: u64) -> (StatementCounts, String) {
    let per = |d: i64| d as f64 / sent.max(1) as f64;
    let (mut path, mut background) = (0i64, 0i64);
    let (mut each, mut off_path, mut setup) = (Vec::new(), Vec::new(), Vec::new());
    for (sql, &d) in delta {
        if d == 0 {
            continue;
        }
        if is_setup_statement(sql) {
            setup.push(format!("`{}` {d}", short_sql(sql)));
        } else if is_background_statement(sql) {
            background += d;
            off_path.push(format!("`{}` {:.3} ({d} calls)", short_sql(sql), per(d)));
        } else {
            path += d;
            each.push(format!("`{}` {:.3}", short_sql(sql), per(d)));
        }
    }
    let list = |v: Vec<String>| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    let counts = StatementCounts {
        path: per(path),
        background: per(background),
    };
    let note = format!(
        "{:.3} statements/request (pg_stat_statements calls in the run's database over {sent} \
         requests: {}; off the requests' path, not counted: {}; one-time, not counted: {})",
        counts.path,
        list(each),
        list(off_path),
        list(setup)
    );
    (counts, note)
}

async fn pg_store(url: &str) -> PostgresStore {
    PostgresStore::builder(url)
        .cleanup_interval(Duration::ZERO)
        .connect()
        .await
        .expect("postgres store")
}

/// `postgres/first` and `postgres/replay` in a private database made for the run (dropped
/// afterwards), with the store's statements per request counted by `pg_stat_statements` for
/// that database. Without the extension the scenarios still run and a note says how to turn
/// it on; no count is reported then.
pub async fn postgres_section(url: &str, cfg: &LoadConfig) -> Report {
    let mut report = Report::default();
    if !cfg.selected("postgres/first") && !cfg.selected("postgres/replay") {
        return report;
    }
    let (admin, conn) = match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => {
            report
                .notes
                .push(format!("postgres: skipped, cannot connect to {url}: {e}"));
            return report;
        }
    };
    tokio::spawn(conn);
    // A private database: the statements counted for it are this run's only.
    let db = format!("idem_loadtest_{}", std::process::id());
    for sql in [
        format!("DROP DATABASE IF EXISTS {db}"),
        format!("CREATE DATABASE {db}"),
    ] {
        admin.batch_execute(&sql).await.expect("create database");
    }
    let db_url = with_database(url, &db);
    let counter = match StatementCounter::new(url, &db).await {
        Ok(c) => Some(c),
        Err(e) => {
            report.notes.push(format!(
                "postgres: statements per request NOT counted: pg_stat_statements is not \
                 available ({e}); {PG_STAT_STATEMENTS_HOWTO}"
            ));
            None
        }
    };
    let tag = format!("p{}", std::process::id());
    let store = pg_store(&db_url).await;
    store.migrate().await.expect("migrate");
    let layer = bench_layer(store);
    let (addr, server) = serve(handler_app().layer(layer.clone())).await;
    record_replay_keys(HttpCaller::new(client(), addr), &tag, cfg.connections).await;
    let scenarios = [
        ("postgres/first", Keys::Unique),
        ("postgres/replay", Keys::PerConnection),
    ];
    let mut rounds: Vec<Vec<Run>> = scenarios.iter().map(|_| Vec::new()).collect();
    let group = RoundGroup::new();
    // Calls by statement, summed over the rounds; `None` once a reading failed.
    let mut deltas: Vec<Option<BTreeMap<String, i64>>> = scenarios
        .iter()
        .map(|_| counter.as_ref().map(|_| BTreeMap::new()))
        .collect();
    for round in 0..cfg.rounds {
        for (i, (name, keys)) in scenarios.into_iter().enumerate() {
            if !cfg.selected(name) {
                continue;
            }
            let prefix = match keys {
                Keys::Unique => format!("{tag}x{round}"),
                Keys::PerConnection => tag.clone(),
            };
            let before = match &counter {
                Some(c) => c.read().await.ok(),
                None => None,
            };
            let make = |_| HttpCaller::new(client(), addr);
            let counted = layer.stats();
            let run = load(name, make, keys, &prefix, cfg).await;
            report
                .notes
                .extend(check_counters(name, run.sent, &counted, &layer.stats()));
            // pg_stat_statements counts a statement as it finishes executing, before the
            // client has its answer; every request of the run has been answered here.
            let after = match &counter {
                Some(c) => c.read().await.ok(),
                None => None,
            };
            deltas[i] = match (deltas[i].take(), before, after) {
                (Some(mut delta), Some(before), Some(after)) => {
                    for (sql, calls) in after {
                        let d = calls - before.get(&sql).copied().unwrap_or(0);
                        *delta.entry(sql).or_insert(0) += d;
                    }
                    Some(delta)
                }
                _ => None,
            };
            rounds[i].push(run);
        }
    }
    server.abort();
    let _ = server.await;
    for (i, (name, _)) in scenarios.into_iter().enumerate() {
        if rounds[i].is_empty() {
            continue;
        }
        let run = merge(std::mem::take(&mut rounds[i]), group);
        if let Some(delta) = &deltas[i] {
            let (counts, note) = statements_per_request(delta, run.sent);
            report.notes.push(format!("{name:<18} {note}"));
            report.per_request.push((name.to_owned(), counts.path));
            report
                .per_request
                .push((format!("{name} background"), counts.background));
        } else if counter.is_some() {
            report.notes.push(format!(
                "{name:<18} statements NOT counted: a pg_stat_statements reading failed"
            ));
        }
        report.runs.push(run);
    }
    drop(counter);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, round_rps: &[f64], group: RoundGroup) -> Run {
        let mut rps = round_rps.to_vec();
        Run {
            name: name.to_owned(),
            requests: 0,
            sent: 0,
            errors: 0,
            rps: crate::median(&mut rps),
            p50_us: 0.0,
            p99_us: 0.0,
            round_rps: round_rps.to_vec(),
            group,
        }
    }

    /// Scenarios of the same rounds are compared round by round, others by their medians.
    #[test]
    fn ratios_are_per_round_within_a_group_else_of_the_medians() {
        let (a, b) = (RoundGroup::new(), RoundGroup::new());
        assert_ne!(a, b);
        let report = Report {
            runs: vec![
                // The machine slows down over the rounds; the scenario stays at 0.9x.
                run("no_layers", &[100.0, 80.0, 60.0], a),
                run("memory/first", &[90.0, 72.0, 54.0], a),
                run("redis/first", &[45.0, 45.0, 45.0], b),
            ],
            ..Report::default()
        };
        let per_round = report.ratio("memory/first").expect("ratio");
        assert!((per_round - 0.9).abs() < 1e-9, "{per_round}");
        let of_medians = report.ratio("redis/first").expect("ratio");
        assert!((of_medians - 45.0 / 80.0).abs() < 1e-9, "{of_medians}");
    }

    #[test]
    fn statements_are_split_into_path_background_and_one_time() {
        let t = "\"public\".\"idempotency_records\"";
        let delta: BTreeMap<String, i64> = [
            (
                format!("WITH claimed AS (INSERT INTO {t} AS e VALUES ($1))"),
                1000,
            ),
            (format!("WITH done AS (UPDATE {t} SET state = $1)"), 1000),
            (
                format!("UPDATE {t} SET expires_at = now() + $3::bigint * interval $4"),
                3,
            ),
            ("LISTEN \"idem_0123\"".to_owned(), 1),
            (format!("CREATE TABLE IF NOT EXISTS {t} (scope bytea)"), 1),
        ]
        .into_iter()
        .collect();
        let (counts, note) = statements_per_request(&delta, 1000);
        assert_eq!(counts.path, 2.0);
        assert_eq!(counts.background, 0.003);
        assert!(note.contains("LISTEN"), "{note}");
    }
}

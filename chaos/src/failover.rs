//! Redis failover chaos: concurrent `begin` + `complete` through two [`RedisStore`]s on a
//! Sentinel-managed primary, one plain and one with
//! [`wait_for_replicas`](idempotency_layer::RedisStoreBuilder::wait_for_replicas), while the run
//! forces failovers; each pair resends its `complete` after an error (as the layer does) and is
//! followed by a duplicate `begin`. At the end, every record a client was answered with (a
//! `complete` acknowledged it, `Ok`, or a duplicate was replayed it) is looked up on the
//! primary of the day: a missing one is a record the failover lost (its key would execute
//! again). Before the failovers, the cost of `wait_for_replicas` is measured on the healthy
//! pair: ops/s and latency of begin + complete, with and without, in the same run.
//!
//! `cargo run --release -p chaos --bin failover -- --help`.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey};
use idempotency_layer::{IdempotencyStore, RedisStore, Scope, StoreError};
use test_support::fault_proxy::{authority, via, LinkFault};
use tokio::time::Instant;

use crate::links::{describe, FaultedLinks};

/// How a failover is forced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum How {
    /// `SENTINEL FAILOVER`: the Sentinel promotes the replica, then demotes the old primary,
    /// which accepts writes until then.
    Sentinel,
    /// SIGKILL of the primary's process; the Sentinel promotes the replica once it is seen
    /// down; the killed node is restarted as a replica.
    Kill,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct FailoverOptions {
    /// The Sentinel URLs and master name.
    pub sentinels: Vec<String>,
    /// The master name the Sentinels watch.
    pub master: String,
    /// Failovers to force.
    pub failovers: usize,
    /// How.
    pub how: How,
    /// With [`How::Kill`]: the replica drops its link and sleeps this long (`DEBUG SLEEP`),
    /// from half of it before the kill: the writes of that half reach the primary alone
    /// (0: none).
    pub cut_replica: Duration,
    /// Load between two failovers.
    pub between: Duration,
    /// Concurrent tasks per store.
    pub concurrency: usize,
    /// During the failovers, at most this many begin + complete per second per store (0: as
    /// fast as they go). The cost figures are always measured flat out.
    pub rate: f64,
    /// `wait_for_replicas(replicas, wait_timeout)` of the waiting store.
    pub replicas: usize,
    /// See `replicas`.
    pub wait_timeout: Duration,
    /// How long each store is measured for the cost figures (in two slices each, alternating).
    pub cost: Duration,
    /// The command that restarts a killed node as a replica (`.ci/redis-sentinel.sh`).
    pub restore: PathBuf,
    /// The stores reach the Sentinels through fault proxies, and during the failovers every
    /// `sentinel_faults` the links suffer the next fault of [`LinkFault::ALL`] in turn, for half
    /// that long (zero: direct). The data nodes are reached at the addresses the Sentinels
    /// name, directly.
    pub sentinel_faults: Duration,
}

/// Latency and throughput of begin + complete for one store.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    /// Pairs that both answered `Ok`.
    pub ops: u64,
    /// Over this long.
    pub elapsed: Duration,
    /// Median latency of one pair.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
}

impl Cost {
    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// What one store saw during the failovers.
#[derive(Clone, Debug, Default)]
pub struct Losses {
    /// Records a client was answered with: `complete` acknowledged them, or a duplicate was
    /// replayed them.
    pub acknowledged: u64,
    /// Of those, answered only by a duplicate's replay (their `complete` was not
    /// acknowledged).
    pub replayed: u64,
    /// Of those, missing on the final primary.
    pub lost: u64,
    /// `begin` or `complete` errors (the store unreachable, or too few replicas).
    pub errors: u64,
    /// Times the store moved to another primary.
    pub switches: u64,
    /// Lost records by when they were acknowledged: (seconds from the failover they preceded
    /// or followed most closely, count), in 100 ms buckets.
    pub lost_when: Vec<(f64, u64)>,
}

/// The run's figures.
#[derive(Clone, Debug, Default)]
pub struct FailoverReport {
    /// Without `wait_for_replicas`.
    pub plain_cost: Cost,
    /// With it.
    pub wait_cost: Cost,
    /// With it, replays of records no replica was known to have (written without it: the
    /// first replay of each waits for the replicas, and marks it) ...
    pub unmarked_replay: Cost,
    /// ... and the second replays of the same records (marked: a read).
    pub marked_replay: Cost,
    /// Without `wait_for_replicas`.
    pub plain: Losses,
    /// With it.
    pub wait: Losses,
    /// Failovers forced, and how long each took until the Sentinel named the new primary.
    pub failovers: Vec<Duration>,
    /// The faults the links to the Sentinels suffered, by kind.
    pub sentinel_faults: Vec<(LinkFault, usize)>,
}

impl FailoverReport {
    /// Failed checks: a record acknowledged with `wait_for_replicas` that is missing.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.wait.lost > 0 {
            p.push(format!(
                "{} records acknowledged with wait_for_replicas were lost",
                self.wait.lost
            ));
        }
        p
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One line of a cost table: `name`, ops/s, p50, p99, and how many `what` in how long.
fn write_cost(f: &mut fmt::Formatter<'_>, name: &str, c: &Cost, what: &str) -> fmt::Result {
    writeln!(
        f,
        "  {name:18} {:>9.0} ops/s  p50 {:>6.2} ms  p99 {:>6.2} ms  ({} {what} in {:.1} s)",
        c.ops_per_sec(),
        ms(c.p50),
        ms(c.p99),
        c.ops,
        c.elapsed.as_secs_f64()
    )
}

impl fmt::Display for FailoverReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, w) = (&self.plain_cost, &self.wait_cost);
        if p.ops == 0 || w.ops == 0 {
            writeln!(f, "cost: not measured (--cost-secs 0)")?;
        } else {
            writeln!(
                f,
                "cost of begin + complete on the healthy pair (same run):"
            )?;
        }
        for (name, c) in [("plain", p), ("wait_for_replicas", w)]
            .into_iter()
            .filter(|_| p.ops > 0 && w.ops > 0)
        {
            write_cost(f, name, c, "pairs")?;
        }
        if p.ops > 0 && w.ops > 0 {
            writeln!(
                f,
                "  ratio wait/plain:  ops/s x{:.2}  p50 x{:.2}  p99 x{:.2}",
                w.ops_per_sec() / p.ops_per_sec(),
                ms(w.p50) / ms(p.p50).max(1e-9),
                ms(w.p99) / ms(p.p99).max(1e-9)
            )?;
        }
        let (u, m) = (&self.unmarked_replay, &self.marked_replay);
        if u.ops > 0 && m.ops > 0 {
            writeln!(
                f,
                "replays with wait_for_replicas, of records written without it (same run):"
            )?;
            for (name, c) in [("first (unmarked)", u), ("second (marked)", m)] {
                write_cost(f, name, c, "replays")?;
            }
            writeln!(
                f,
                "  ratio unmarked/marked:  ops/s x{:.2}  p50 x{:.2}",
                u.ops_per_sec() / m.ops_per_sec(),
                ms(u.p50) / ms(m.p50).max(1e-9)
            )?;
        }
        let took: Vec<String> = self
            .failovers
            .iter()
            .map(|d| format!("{:.1}s", d.as_secs_f64()))
            .collect();
        writeln!(
            f,
            "failovers: {} (until the Sentinel named the new primary: {})",
            self.failovers.len(),
            took.join(", ")
        )?;
        if !self.sentinel_faults.is_empty() {
            writeln!(
                f,
                "the links to the Sentinels: {}",
                describe(&self.sentinel_faults)
            )?;
        }
        for (name, l) in [("plain", &self.plain), ("wait_for_replicas", &self.wait)] {
            writeln!(
                f,
                "  {name:18} acknowledged {:>7} (replayed only {})  lost {:>5}  errors {:>6}  primary switches {}",
                l.acknowledged, l.replayed, l.lost, l.errors, l.switches
            )?;
            write_lost_when(f, l, "forced failover")?;
        }
        write_checks(f, &self.problems())
    }
}

/// The line that says when `l`'s lost records were acknowledged, relative to the nearest
/// `event`, if any was lost.
pub(crate) fn write_lost_when(f: &mut fmt::Formatter<'_>, l: &Losses, event: &str) -> fmt::Result {
    if l.lost_when.is_empty() {
        return Ok(());
    }
    let when: Vec<String> = l
        .lost_when
        .iter()
        .map(|(t, n)| format!("{t:+.1}s: {n}"))
        .collect();
    writeln!(
        f,
        "    lost, by when acknowledged relative to the nearest {event}: {}",
        when.join(", ")
    )
}

/// The report's last line: PASS, or what failed.
pub(crate) fn write_checks(f: &mut fmt::Formatter<'_>, problems: &[String]) -> fmt::Result {
    if problems.is_empty() {
        write!(f, "checks: PASS")
    } else {
        write!(f, "checks: FAIL: {}", problems.join("; "))
    }
}

/// One store's load: acknowledged scopes, errors, and (when timed) pair latencies.
#[derive(Default)]
pub(crate) struct Load {
    pub(crate) acknowledged: Mutex<Vec<(ScopeKey, Instant)>>,
    pub(crate) errors: AtomicU64,
    pub(crate) latencies: Mutex<Vec<Duration>>,
    /// Duplicates answered with a replay of a record whose `complete` was not acknowledged
    /// (also in `acknowledged`: a client was answered with it).
    pub(crate) replayed: AtomicU64,
}

fn record() -> Arc<Record> {
    Arc::new(Record::new(
        Fingerprint([7; 32]),
        StatusCode::CREATED,
        HeaderMap::new(),
        Bytes::from_static(b"{\"order\":\"placed\"}"),
    ))
}

const LEASE: Duration = Duration::from_secs(30);
/// Long enough for the end-of-run check; the run removes its keys after it anyway.
const TTL: Duration = Duration::from_secs(600);

/// Runs begin + complete on fresh scopes until `stop`.
async fn drive<S: IdempotencyStore>(
    store: S,
    label: String,
    load: Arc<Load>,
    stop: Arc<AtomicBool>,
    timed: bool,
    pace: Option<Duration>,
) {
    let record = record();
    let mut n = 0u64;
    let mut ticks = pace.map(|every| {
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    while !stop.load(Ordering::Relaxed) {
        if let Some(t) = &mut ticks {
            t.tick().await;
        }
        n += 1;
        let scope = Scope::new("failover", &label, &n.to_string()).key();
        let started = Instant::now();
        let token = match store.begin(scope, Fingerprint([7; 32]), LEASE).await {
            Ok(Begin::New(token)) => token,
            Ok(_) => continue,
            Err(_) => {
                load.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let mut acknowledged = match store.complete(scope, token, record.clone(), TTL).await {
            Ok(()) => true,
            Err(_) => {
                load.errors.fetch_add(1, Ordering::Relaxed);
                false
            }
        };
        // Already answered to a client (and counted) by a duplicate's replay.
        let mut replayed = false;
        if !timed {
            // A duplicate of the request, at once (a client's retry after its first answer, or
            // another client, while the server resends the complete in the background). A
            // replay answers a client with the record just as an acknowledged complete does:
            // one whose complete was not acknowledged counts as answered too, and must survive
            // the failovers like the acknowledged ones.
            match store.begin(scope, Fingerprint([7; 32]), LEASE).await {
                Ok(Begin::Completed(_)) if !acknowledged => {
                    replayed = true;
                    load.replayed.fetch_add(1, Ordering::Relaxed);
                    load.acknowledged
                        .lock()
                        .unwrap()
                        .push((scope, Instant::now()));
                }
                // The claim was released or lapsed: this duplicate holds it now; let it go.
                Ok(Begin::New(token)) => {
                    let _ = store.release(scope, token).await;
                }
                Ok(_) => {}
                Err(_) => {
                    load.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Resent through errors, as the layer resends a complete through an outage.
        for _ in 1..COMPLETE_SENDS {
            if acknowledged {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            match store.complete(scope, token, record.clone(), TTL).await {
                Ok(()) => acknowledged = true,
                Err(StoreError::Fenced) => break,
                Err(_) => {
                    load.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if acknowledged && !replayed {
            let took = started.elapsed();
            load.acknowledged
                .lock()
                .unwrap()
                .push((scope, Instant::now()));
            if timed {
                load.latencies.lock().unwrap().push(took);
            }
        }
    }
}

/// How many times a pair sends its `complete` before giving up on it (the first and the
/// resends after an error).
const COMPLETE_SENDS: usize = 3;

/// Runs `concurrency` drivers on `store` until `stop`; returns their load.
pub(crate) async fn run_load<S: IdempotencyStore>(
    store: &S,
    label: &str,
    concurrency: usize,
    stop: Arc<AtomicBool>,
    timed: bool,
    rate: f64,
) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
    let load = Arc::new(Load::default());
    // Each task's share of the rate.
    let pace = (rate > 0.0).then(|| Duration::from_secs_f64(concurrency as f64 / rate));
    let tasks = (0..concurrency)
        .map(|i| {
            tokio::spawn(drive(
                store.clone(),
                format!("{label}-{i}"),
                load.clone(),
                stop.clone(),
                timed,
                pace,
            ))
        })
        .collect();
    (load, tasks)
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Measures each store alone for `each` (two alternating slices per store).
async fn measure_cost(
    plain: &RedisStore,
    wait: &RedisStore,
    opts: &FailoverOptions,
) -> (Cost, Cost) {
    let slice = opts.cost / 2;
    let mut lat = [Vec::new(), Vec::new()];
    let mut ops = [0u64, 0];
    let mut elapsed = [Duration::ZERO, Duration::ZERO];
    for round in 0..4 {
        let which = round % 2;
        let store = if which == 0 { plain } else { wait };
        let stop = Arc::new(AtomicBool::new(false));
        let (load, tasks) = run_load(
            store,
            &format!("cost{round}"),
            opts.concurrency,
            stop.clone(),
            true,
            0.0,
        )
        .await;
        let started = Instant::now();
        tokio::time::sleep(slice).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        elapsed[which] += started.elapsed();
        let l = std::mem::take(&mut *load.latencies.lock().unwrap());
        ops[which] += l.len() as u64;
        lat[which].extend(l);
    }
    let mut cost = |i: usize| {
        lat[i].sort_unstable();
        Cost {
            ops: ops[i],
            elapsed: elapsed[i],
            p50: percentile(&lat[i], 0.50),
            p99: percentile(&lat[i], 0.99),
        }
    };
    let plain_cost = cost(0);
    let wait_cost = cost(1);
    (plain_cost, wait_cost)
}

/// Replays through `wait` of records `writer` (same prefix, no `wait_for_replicas`) completed:
/// first of each unmarked record (the replay waits for the replicas and marks it), then of
/// each again (marked). `concurrency` tasks, 200 records each.
async fn measure_replays(
    writer: &RedisStore,
    wait: &RedisStore,
    concurrency: usize,
) -> (Cost, Cost) {
    const EACH: usize = 200;
    let record = record();
    let scopes: Vec<Vec<ScopeKey>> = (0..concurrency)
        .map(|t| {
            (0..EACH)
                .map(|i| Scope::new("failover", "replays", &format!("{t}-{i}")).key())
                .collect()
        })
        .collect();
    for chunk in &scopes {
        for &scope in chunk {
            if let Ok(Begin::New(token)) = writer.begin(scope, Fingerprint([7; 32]), LEASE).await {
                let _ = writer.complete(scope, token, record.clone(), TTL).await;
            }
        }
    }
    let mut costs = Vec::new();
    for _pass in 0..2 {
        let started = Instant::now();
        let tasks: Vec<_> = scopes
            .iter()
            .cloned()
            .map(|chunk| {
                let wait = wait.clone();
                tokio::spawn(async move {
                    let mut took = Vec::new();
                    for scope in chunk {
                        let t = Instant::now();
                        if let Ok(Begin::Completed(_)) =
                            wait.begin(scope, Fingerprint([7; 32]), LEASE).await
                        {
                            took.push(t.elapsed());
                        }
                    }
                    took
                })
            })
            .collect();
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await.unwrap_or_default());
        }
        let elapsed = started.elapsed();
        lat.sort_unstable();
        costs.push(Cost {
            ops: lat.len() as u64,
            elapsed,
            p50: percentile(&lat, 0.50),
            p99: percentile(&lat, 0.99),
        });
    }
    let marked = costs.pop().unwrap_or_default();
    let unmarked = costs.pop().unwrap_or_default();
    (unmarked, marked)
}

async fn sentinel_conn(opts: &FailoverOptions) -> redis::aio::MultiplexedConnection {
    redis::Client::open(opts.sentinels[0].as_str())
        .expect("a sentinel URL")
        .get_multiplexed_async_connection()
        .await
        .expect("the Sentinel answers")
}

async fn primary(opts: &FailoverOptions) -> (String, u16) {
    redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(&opts.master)
        .query_async(&mut sentinel_conn(opts).await)
        .await
        .expect("the Sentinel names a primary")
}

async fn node(host: &str, port: u16) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    redis::Client::open(format!("redis://{host}:{port}"))?
        .get_multiplexed_async_connection()
        .await
}

async fn info_field(host: &str, port: u16, section: &str, field: &str) -> Option<String> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut node(host, port).await.ok()?)
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::to_owned)
}

/// Runs the restore command (it waits for a healthy primary + replica).
async fn restore(opts: &FailoverOptions) {
    run_script(&opts.restore).await;
}

/// Runs `script` (a `.ci/` script that waits for a healthy primary + replica); panics if it
/// fails. Answers what it printed.
pub(crate) async fn run_script(script: &std::path::Path) -> String {
    let cmd = script.to_owned();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(&cmd).output())
        .await
        .expect("the restore task")
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Forces one failover; answers how long until the Sentinel named another primary.
async fn force_failover(opts: &FailoverOptions) -> Duration {
    let (host, port) = primary(opts).await;
    let started = Instant::now();
    match opts.how {
        How::Sentinel => {
            let _: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(&opts.master)
                .query_async(&mut sentinel_conn(opts).await)
                .await;
        }
        How::Kill => {
            if !opts.cut_replica.is_zero() {
                let slave = info_field(&host, port, "replication", "slave0").await;
                let replica: Option<u16> = slave.as_deref().and_then(|l| {
                    l.split(',')
                        .find_map(|kv| kv.strip_prefix("port=")?.parse().ok())
                });
                if let Some(r) = replica {
                    let secs = opts.cut_replica.as_secs_f64();
                    let host = host.clone();
                    tokio::spawn(async move {
                        if let Ok(mut c) = node(&host, r).await {
                            let _: redis::RedisResult<Vec<redis::Value>> = redis::pipe()
                                .cmd("CLIENT")
                                .arg("KILL")
                                .arg("TYPE")
                                .arg("master")
                                .cmd("DEBUG")
                                .arg("SLEEP")
                                .arg(secs)
                                .query_async(&mut c)
                                .await;
                        }
                    });
                    // The load writes on the primary alone for the length of the cut.
                    tokio::time::sleep(opts.cut_replica / 2).await;
                }
            }
            if let Some(pid) = info_field(&host, port, "server", "process_id").await {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid])
                    .status();
            }
        }
    }
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        if primary(opts).await.1 != port {
            break;
        }
        assert!(Instant::now() < give_up, "no failover within 120 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    restore(opts).await;
    took
}

/// When the records of `scopes` that have no record on the current primary were acknowledged.
async fn missing(
    store: &RedisStore,
    scopes: &[(ScopeKey, Instant)],
    opts: &FailoverOptions,
) -> Vec<Instant> {
    let (host, port) = primary(opts).await;
    let mut conn = node(&host, port).await.expect("the primary answers");
    let mut lost = Vec::new();
    for chunk in scopes.chunks(1000) {
        let mut pipe = redis::pipe();
        for (s, _) in chunk {
            pipe.cmd("HGET")
                .arg(format!("{}{}", store.prefix(), s.to_hex()))
                .arg("s");
        }
        let states: Vec<Option<String>> = pipe.query_async(&mut conn).await.expect("HGET");
        for ((_, at), state) in chunk.iter().zip(states) {
            if state.as_deref() != Some("c") {
                lost.push(*at);
            }
        }
    }
    lost
}

/// Removes the run's keys (a full resync of a replica carries every key: a large data set
/// makes the next failovers slower).
async fn remove_keys(prefix: &str, opts: &FailoverOptions) {
    let (host, port) = primary(opts).await;
    let Ok(mut conn) = node(&host, port).await else {
        return;
    };
    let mut cursor = 0u64;
    loop {
        let Ok((next, keys)) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async::<(u64, Vec<String>)>(&mut conn)
            .await
        else {
            return;
        };
        if !keys.is_empty() {
            let _: redis::RedisResult<u64> =
                redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await;
        }
        cursor = next;
        if cursor == 0 {
            return;
        }
    }
}

/// `lost` in 100 ms buckets around the nearest of `forced` (the instants failovers were forced).
pub(crate) fn lost_when(lost: &[Instant], forced: &[Instant]) -> Vec<(f64, u64)> {
    let mut buckets = std::collections::BTreeMap::<i64, u64>::new();
    for &at in lost {
        let offset = forced
            .iter()
            .map(|&f| {
                if at >= f {
                    (at - f).as_secs_f64()
                } else {
                    -(f - at).as_secs_f64()
                }
            })
            .min_by(|a, b| a.abs().total_cmp(&b.abs()))
            .unwrap_or(0.0);
        *buckets.entry((offset * 10.0).floor() as i64).or_default() += 1;
    }
    buckets
        .into_iter()
        .map(|(b, n)| (b as f64 / 10.0, n))
        .collect()
}

/// Runs it: the cost on the healthy pair, then load on both stores through the failovers.
pub async fn run_failover(opts: FailoverOptions) -> FailoverReport {
    restore(&opts).await;
    let prefix = format!("failover:{}:", std::process::id());
    // The Sentinels, through fault proxies if asked.
    let (mut links, sentinels) = if opts.sentinel_faults.is_zero() {
        (None, opts.sentinels.clone())
    } else {
        let nodes: Vec<String> = opts
            .sentinels
            .iter()
            .map(|u| authority(u).to_owned())
            .collect();
        let links = FaultedLinks::start(&nodes).await;
        let via_links = opts
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, u)| via(u, links.addr(i)))
            .collect();
        (Some(links), via_links)
    };
    let connect = |wait: bool, prefix: String| {
        let mut b = RedisStore::builder_sentinel(sentinels.iter().cloned(), opts.master.clone())
            .prefix(prefix);
        if wait {
            b = b.wait_for_replicas(opts.replicas, opts.wait_timeout);
        }
        b.connect()
    };
    let plain = connect(false, format!("{prefix}plain:"))
        .await
        .expect("connect");
    let wait = connect(true, format!("{prefix}wait:"))
        .await
        .expect("connect");

    let (plain_cost, wait_cost) = if opts.cost.is_zero() {
        (Cost::default(), Cost::default())
    } else {
        measure_cost(&plain, &wait, &opts).await
    };
    let (unmarked_replay, marked_replay) = if opts.cost.is_zero() {
        (Cost::default(), Cost::default())
    } else {
        let writer = RedisStore::builder_sentinel(sentinels.iter().cloned(), opts.master.clone())
            .prefix(format!("{prefix}wait:"))
            .connect()
            .await
            .expect("connect");
        measure_replays(&writer, &wait, opts.concurrency).await
    };

    let stop = Arc::new(AtomicBool::new(false));
    let (plain_load, mut tasks) = run_load(
        &plain,
        "plain",
        opts.concurrency,
        stop.clone(),
        false,
        opts.rate,
    )
    .await;
    let (wait_load, wait_tasks) = run_load(
        &wait,
        "wait",
        opts.concurrency,
        stop.clone(),
        false,
        opts.rate,
    )
    .await;
    tasks.extend(wait_tasks);
    if let Some(links) = &mut links {
        links.fault_every(opts.sentinel_faults, opts.sentinel_faults / 2);
    }
    let mut failovers = Vec::new();
    let mut forced = Vec::new();
    for _ in 0..opts.failovers {
        tokio::time::sleep(opts.between).await;
        forced.push(Instant::now());
        failovers.push(force_failover(&opts).await);
    }
    tokio::time::sleep(opts.between).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let sentinel_faults = links.as_mut().map(FaultedLinks::stop).unwrap_or_default();

    let losses = |store: &RedisStore, load: &Load| {
        let scopes = load.acknowledged.lock().unwrap().clone();
        let errors = load.errors.load(Ordering::Relaxed);
        let replayed = load.replayed.load(Ordering::Relaxed);
        let store = store.clone();
        let opts = opts.clone();
        let forced = forced.clone();
        async move {
            let lost = missing(&store, &scopes, &opts).await;
            Losses {
                acknowledged: scopes.len() as u64,
                replayed,
                lost: lost.len() as u64,
                errors,
                switches: store.primary_switches(),
                lost_when: lost_when(&lost, &forced),
            }
        }
    };
    let plain_losses = losses(&plain, &plain_load).await;
    let wait_losses = losses(&wait, &wait_load).await;
    remove_keys(&prefix, &opts).await;
    FailoverReport {
        plain_cost,
        wait_cost,
        plain: plain_losses,
        wait: wait_losses,
        unmarked_replay,
        marked_replay,
        failovers,
        sentinel_faults,
    }
}

//! Kill chaos: the soak with instances that die. The instances are real `orders-server`
//! processes (this crate's `kill` binary re-executed as `kill serve ...`, so that nothing but
//! `cargo run -p chaos --bin kill` has to be built), sharing a store, with orders in a
//! PostgreSQL `orders` table. Each is killed with SIGKILL at random moments and, through the
//! failpoint `ORDERS_FAILPOINT=abort-after-commit:P`, aborts right after an order commits and
//! before its response leaves; either way it is restarted at once on the same port. Clients
//! with `RetryLayer` keep placing orders, each with a key of its own, through the fault proxy.
//!
//! The side-effect ledger is durable: the `orders` table (in a database of the run's own),
//! whose rows carry the idempotency key that created them. A key with two rows or more is a
//! duplicate side effect; a succeeded order whose row is missing is a lost write.
//!
//! - PostgreSQL store, record in the order's transaction (`TxCompletion`, on tokio-postgres or,
//!   with `--orders-driver sqlx`, on sqlx): no crash can leave an order without its record, so
//!   duplicates must be 0.
//! - PostgreSQL with `--record-after-commit`, Redis, memory: the record is written after the
//!   order's commit, so a crash between the two lets the retry run the order again. Those
//!   duplicates are counted, not failed; what is checked is that they come from crashes only
//!   (a key runs at most once more per crash) and that nothing is ever lost.
//!
//! **Chain mode** ([`KillOptions::chain`], `kill --chain`) puts a tier below the killed one:
//! the killed instances take each order's stock from an inventory tier of `orders-server`
//! instances that are never killed (`--inventory-url`, through a proxy that spreads their
//! connections over the inventory instances; the same store kind, shared), with deduction keys
//! derived from the order ([`ChainKeys::Derived`]) or fresh per call ([`ChainKeys::Fresh`]).
//! The failpoint moves to `abort-after-side-effect:P`: right after the inventory answered the
//! deduction, before the order's own transaction. Each executed deduction is a row of the
//! `deductions` table carrying the order's key (`order_ref`): a logical order with two
//! deductions or more is a duplicate downstream execution. With derived keys there must be
//! none; with fresh keys they are counted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use retry_layer::{RetryInfo, RetryLayer};
use test_support::proxy::{Protocol, Proxy};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tower::ServiceExt;

use crate::wire::http_client;
pub use axum_orders::orders_server::OrdersDriver;
use idempotency_layer::store::AnyStore;
use idempotency_layer::Scope;

use crate::{
    chooser, drive_while, error_kind, settle_claims, HttpClient, Outcome, Policy, StoreKind, Wire,
};

/// The tenant the clients order as (`x-tenant-id`).
const TENANT: &str = "chaos";
/// How long a started server may take to say it listens.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// The signal `std::process::abort` ends a process with.
const SIGABRT: i32 = 6;
/// Starts of one server in a row that may fail (its port still taken, the store unreachable)
/// before the run gives up.
const START_TRIES: usize = 50;

/// How to start one server process: a program and the arguments that come before the
/// `orders-server` options (`kill serve` for this crate's binary).
#[derive(Debug, Clone)]
pub struct ServerCommand {
    /// The program.
    pub program: PathBuf,
    /// Its leading arguments.
    pub args: Vec<String>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct KillOptions {
    /// Where the idempotency records live: memory (one instance: a memory store is not
    /// shared), Redis or PostgreSQL (two instances).
    pub store: StoreKind,
    /// The PostgreSQL server of the `orders` table (and of the records, for that store): the
    /// run creates a database of its own there and drops it at the end.
    pub database_url: String,
    /// The Redis server, for that store.
    pub redis_url: Option<String>,
    /// PostgreSQL store only: the record commits in the order's transaction (true), or the
    /// layer writes it after the commit (false: `--record-after-commit`).
    pub transactional: bool,
    /// The client of the servers' order transactions (`orders-server --orders-driver`):
    /// tokio-postgres, or sqlx.
    pub orders_driver: OrdersDriver,
    /// The server processes.
    pub server: ServerCommand,
    /// How long clients start new orders.
    pub duration: Duration,
    /// Concurrent clients, each placing one order at a time.
    pub clients: usize,
    /// An instance is SIGKILLed every `kill_every.0` to `kill_every.1` (uniform); `None`: never.
    pub kill_every: Option<(Duration, Duration)>,
    /// The probability that an order aborts its server after its commit, before its response
    /// (`ORDERS_FAILPOINT=abort-after-commit:P`); 0: the failpoint is off.
    pub abort_p: f64,
    /// The claims' lease: how soon the claim of a killed instance is taken over.
    pub lease: Duration,
    /// Share of connections the proxy drops after the request reached the server.
    pub drop_p: f64,
    /// Share of connections reset before anything was relayed.
    pub reset_p: f64,
    /// Share of connections whose answer is delayed by 20 to 200 ms.
    pub delay_p: f64,
    /// The seed of the kills and the proxy's faults.
    pub seed: u64,
    /// Let the servers' stderr through (off: discarded).
    pub server_stderr: bool,
    /// Chain mode: the killed instances take their orders' stock from an inventory tier that
    /// is not killed, with deduction keys derived or fresh; `None`: the orders tier alone.
    pub chain: Option<ChainKeys>,
    /// The clients go on past `duration` until at least this many SIGKILLs and this many aborts
    /// at the failpoint have happened (for at most four more `duration`s): a short run on a
    /// loaded machine, whose restarts are slow, still sees the crashes it is about. `(0, 0)`:
    /// `duration` alone.
    pub min_crashes: (usize, usize),
}

/// The keys of the killed tier's deductions in chain mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainKeys {
    /// Derived from the order (`orders-server --derived-keys-secret`): a second run of an order
    /// sends its deduction under the same key, and the inventory replays.
    Derived,
    /// Fresh per call (`orders-server --no-derived-keys`): a second run deducts again.
    Fresh,
}

impl KillOptions {
    /// The defaults: 16 clients, a kill every 2 to 5 s, 2 % of orders abort after their
    /// commit, lease 1.5 s, proxy faults as the soak's (10 % drops, 5 % resets, 5 % delays).
    pub fn new(
        store: StoreKind,
        database_url: String,
        server: ServerCommand,
        duration: Duration,
    ) -> Self {
        KillOptions {
            store,
            database_url,
            redis_url: None,
            transactional: true,
            orders_driver: OrdersDriver::TokioPostgres,
            server,
            duration,
            clients: 16,
            kill_every: Some((Duration::from_secs(2), Duration::from_secs(5))),
            abort_p: 0.02,
            lease: Duration::from_millis(1500),
            drop_p: 0.10,
            reset_p: 0.05,
            delay_p: 0.05,
            seed: 7,
            server_stderr: false,
            chain: None,
            min_crashes: (0, 0),
        }
    }

    /// Whether no crash can separate an order from its record.
    pub fn crash_safe(&self) -> bool {
        self.store == StoreKind::Postgres && self.transactional
    }

    /// The store's name and path, as the report shows it.
    fn mode(&self) -> String {
        let mode = match self.store {
            StoreKind::Postgres if self.transactional => "postgres, record in the order's tx",
            StoreKind::Postgres => "postgres, --record-after-commit",
            StoreKind::Redis => "redis records, orders in postgres",
            StoreKind::Memory => "memory records, orders in postgres",
        };
        let mode = match self.orders_driver {
            OrdersDriver::TokioPostgres => mode.to_owned(),
            OrdersDriver::Sqlx => format!("{mode}, orders on sqlx"),
        };
        match self.chain {
            None => mode,
            Some(ChainKeys::Derived) => format!("{mode}; chain, derived deduction keys"),
            Some(ChainKeys::Fresh) => format!("{mode}; chain, fresh deduction keys"),
        }
    }
}

/// A database of the run's own on a PostgreSQL server, dropped by [`Database::drop_now`].
struct Database {
    admin: tokio_postgres::Client,
    name: String,
    url: String,
}

impl Database {
    async fn create(server_url: &str, run_id: &str) -> Database {
        let admin = connect(server_url).await;
        let name = format!("chaos_kill_{run_id}");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create the run's database");
        let url = with_database(server_url, &name);
        // The tables, once, before any server starts: two servers starting together would
        // race on `CREATE TABLE IF NOT EXISTS`.
        connect(&url)
            .await
            .batch_execute(axum_orders::pg_orders::MIGRATION)
            .await
            .expect("create the orders table");
        Database { admin, name, url }
    }

    async fn drop_now(self) {
        let _ = self
            .admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
    }
}

/// A client of `url` (its connection driven by a task).
async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("DATABASE_URL must be reachable");
    tokio::spawn(conn);
    client
}

/// `postgres://user@host:port/db?params` with the database `name` instead of `db`.
fn with_database(url: &str, name: &str) -> String {
    let (base, params) = url
        .split_once('?')
        .map_or((url, None), |(b, p)| (b, Some(p)));
    let server = base
        .rsplit_once('/')
        .map(|(server, _)| server)
        .filter(|server| server.contains("://"))
        .unwrap_or(base);
    match params {
        Some(p) => format!("{server}/{name}?{p}"),
        None => format!("{server}/{name}"),
    }
}

/// What the supervisors count.
#[derive(Debug, Default)]
struct Deaths {
    /// SIGKILLs sent (and the process gone).
    killed: AtomicUsize,
    /// Processes that aborted at the failpoint (SIGABRT).
    aborted: AtomicUsize,
    /// Processes that ended otherwise (must be none).
    unexpected: Mutex<Vec<String>>,
    /// Restarts.
    restarted: AtomicUsize,
}

/// How the supervisors start a server: the command, the `orders-server` options, the
/// environment.
#[derive(Debug, Clone)]
struct Launch {
    cmd: ServerCommand,
    args: Vec<String>,
    envs: Vec<(&'static str, String)>,
    stderr: bool,
}

impl Launch {
    /// Starts one server on `listen`; the process and its address, once it says it listens.
    /// `Err`: it ended or failed to say so.
    async fn start(&self, listen: SocketAddr) -> Result<(Child, SocketAddr), String> {
        let listen = listen.to_string();
        let mut child = Command::new(&self.cmd.program)
            .args(&self.cmd.args)
            .args(&self.args)
            .args(["--listen", &listen])
            .env_remove("ORDERS_FAILPOINT")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(if self.stderr {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.cmd.program.display()))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        let read = tokio::time::timeout(READY_TIMEOUT, stdout.read_line(&mut line));
        match read.await {
            Ok(Ok(n)) if n > 0 => {}
            _ => {
                let _ = child.start_kill();
                let status = child.wait().await;
                return Err(format!("the server did not start: {status:?}"));
            }
        }
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("unexpected first line {line:?}"))?;
        Ok((child, addr))
    }
}

/// Keeps one instance alive until `stop`: starts it (the first time on a free port, then on
/// the same one), kills it when `kill` says so, restarts it whenever it ended. Sends its address
/// on `ready` once.
async fn supervise(
    launch: Launch,
    ready: tokio::sync::oneshot::Sender<SocketAddr>,
    mut kill: mpsc::Receiver<()>,
    mut stop: watch::Receiver<bool>,
    deaths: Arc<Deaths>,
) {
    let mut ready = Some(ready);
    let mut listen: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    loop {
        let mut tries = 0;
        let mut child = loop {
            match launch.start(listen).await {
                Ok((child, addr)) => {
                    listen = addr;
                    break child;
                }
                Err(e) if tries < START_TRIES => {
                    tries += 1;
                    eprintln!("kill chaos: a server start failed ({e}); trying again");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("{e} ({START_TRIES} tries)"),
            }
        };
        if let Some(ready) = ready.take() {
            let _ = ready.send(listen);
        }
        tokio::select! {
            status = child.wait() => match status {
                Ok(s) if s.signal() == Some(SIGABRT) => {
                    deaths.aborted.fetch_add(1, Ordering::SeqCst);
                }
                other => deaths.unexpected.lock().unwrap().push(format!("{other:?}")),
            },
            Some(()) = kill.recv() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                deaths.killed.fetch_add(1, Ordering::SeqCst);
            }
            _ = stop.changed() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return;
            }
        }
        if *stop.borrow() {
            return;
        }
        deaths.restarted.fetch_add(1, Ordering::SeqCst);
    }
}

/// One order: a key of its own, retried by the layer until it succeeds or gives up. On
/// success, the order's id.
async fn place_order(client: &HttpClient, base: &str, key: &str) -> (Outcome, Option<String>, u32) {
    let req = Request::post(format!("{base}/orders"))
        .header("x-idempotency-key", key)
        .header("x-tenant-id", TENANT)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"book_id":"b1","quantity":1}"#,
        )))
        .expect("a request");
    let res = match client.clone().oneshot(req).await {
        Ok(res) => res,
        Err(e) => return (Outcome::Failed(error_kind(&*e)), None, 0),
    };
    let status = res.status();
    let attempts = RetryInfo::attempts_of(&res);
    let Ok(body) = res.into_body().collect().await.map(|b| b.to_bytes()) else {
        return (Outcome::Failed("body cut".into()), None, attempts);
    };
    let order_id = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| Some(v.get("order_id")?.as_str()?.to_owned()));
    match (status, order_id) {
        (StatusCode::CREATED, Some(id)) => (Outcome::Succeeded, Some(id), attempts),
        _ => (
            Outcome::Failed(format!("HTTP {}", status.as_u16())),
            None,
            attempts,
        ),
    }
}

/// What a kill-chaos run did and found.
#[derive(Debug, Default)]
pub struct KillReport {
    /// The store and path.
    pub mode: String,
    /// Whether duplicates are failures (the transactional path) or counted.
    pub crash_safe: bool,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Server instances.
    pub instances: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// SIGKILLs.
    pub killed: usize,
    /// Aborts at the failpoint (between an order's commit and its response).
    pub aborted: usize,
    /// Restarts.
    pub restarted: usize,
    /// Server exits that were neither (must be empty).
    pub unexpected_exits: Vec<String>,
    /// Orders started.
    pub attempted: usize,
    /// Orders whose client got a 201 with an order id.
    pub succeeded: usize,
    /// Orders whose client gave up, by reason.
    pub failed: BTreeMap<String, usize>,
    /// HTTP attempts (from `RetryInfo`, for answered orders).
    pub http_attempts: u64,
    /// Connections the proxy dropped after the request, reset, delayed.
    pub proxy_faults: [usize; 3],
    /// Rows in the `orders` table.
    pub rows: u64,
    /// Keys with more than one order row, and how many.
    pub duplicates: Vec<(String, u64)>,
    /// Succeeded orders whose row is missing (must be empty).
    pub lost: Vec<String>,
    /// Failed orders whose row exists (allowed: the client gave up on an ambiguous outcome; a
    /// retry with the same key gets the replay).
    pub failed_but_executed: usize,
    /// Rows whose key no client used (must be 0).
    pub unknown_keys: usize,
    /// Claims still in flight after the run waited a lease (must be 0); `None` for the memory
    /// store, which dies with its process.
    pub in_flight_left: Option<usize>,
    /// Succeeded orders whose key holds no record, so a retry would run again: the crash
    /// window (must be empty on the transactional path); `None` for the memory store.
    pub unrecorded: Option<Vec<String>>,
    /// Chain mode: what the inventory tier executed.
    pub chain: Option<ChainReport>,
}

/// What the inventory tier of a chain-mode run executed, per logical order.
#[derive(Debug)]
pub struct ChainReport {
    /// How the killed tier keyed its deductions.
    pub keys: ChainKeys,
    /// Inventory instances (never killed).
    pub instances: usize,
    /// Inventory instances that ended during the run (must be empty).
    pub unexpected_exits: Vec<String>,
    /// Rows in the `deductions` table: executed deductions.
    pub rows: u64,
    /// Logical orders (client keys) by how many deductions the inventory executed for them:
    /// 0, 1, 2, ...
    pub orders_by_executions: BTreeMap<u64, usize>,
    /// Orders whose deduction ran more than once, and how many times (must be empty with
    /// derived keys).
    pub duplicates: Vec<(String, u64)>,
    /// Succeeded orders without a deduction (must be empty).
    pub succeeded_without: Vec<String>,
    /// Deductions for an order no client placed (must be 0).
    pub unknown_orders: usize,
}

impl ChainReport {
    /// Deductions beyond the first, over all orders.
    pub fn extra_executions(&self) -> u64 {
        self.duplicates.iter().map(|(_, n)| n - 1).sum()
    }

    fn problems(&self, crashes: u64, p: &mut Vec<String>) {
        if !self.unexpected_exits.is_empty() {
            p.push(format!(
                "inventory servers ended: {:?}",
                self.unexpected_exits
            ));
        }
        if !self.succeeded_without.is_empty() {
            p.push(format!(
                "{} succeeded orders have no deduction: {:?}",
                self.succeeded_without.len(),
                &self.succeeded_without[..self.succeeded_without.len().min(5)]
            ));
        }
        if self.unknown_orders > 0 {
            p.push(format!(
                "{} deductions of orders no client placed",
                self.unknown_orders
            ));
        }
        if self.keys == ChainKeys::Derived && !self.duplicates.is_empty() {
            p.push(format!(
                "{} orders had their deduction executed more than once with derived keys: {:?}",
                self.duplicates.len(),
                &self.duplicates[..self.duplicates.len().min(5)]
            ));
        }
        if let Some((key, n)) = self.duplicates.iter().find(|(_, n)| n - 1 > crashes) {
            p.push(format!(
                "{key}'s deduction ran {n} times in a run with {crashes} crashes: a duplicate no crash explains"
            ));
        }
    }
}

impl KillReport {
    /// Crashes: SIGKILLs and aborts.
    pub fn crashes(&self) -> usize {
        self.killed + self.aborted
    }

    /// Executions beyond the first, over all keys.
    pub fn extra_executions(&self) -> u64 {
        self.duplicates.iter().map(|(_, n)| n - 1).sum()
    }

    /// Duplicates per 10 000 succeeded orders.
    pub fn duplicate_rate(&self) -> f64 {
        self.extra_executions() as f64 * 10_000.0 / self.succeeded.max(1) as f64
    }

    /// What went wrong; empty when every check passed.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.attempted == 0 {
            p.push("no order was attempted".into());
        }
        if !self.unexpected_exits.is_empty() {
            p.push(format!(
                "servers ended unexpectedly: {:?}",
                self.unexpected_exits
            ));
        }
        if !self.lost.is_empty() {
            p.push(format!(
                "{} succeeded orders have no row: {:?}",
                self.lost.len(),
                &self.lost[..self.lost.len().min(5)]
            ));
        }
        if self.unknown_keys > 0 {
            p.push(format!("{} rows of keys no client used", self.unknown_keys));
        }
        if let Some(n @ 1..) = self.in_flight_left {
            p.push(format!("{n} claims left in flight a lease after the run"));
        }
        match &self.unrecorded {
            Some(keys) if self.crash_safe && !keys.is_empty() => p.push(format!(
                "{} succeeded orders have no record with the record in the order's transaction: {:?}",
                keys.len(),
                &keys[..keys.len().min(5)]
            )),
            _ => {}
        }
        if self.crash_safe && !self.duplicates.is_empty() {
            p.push(format!(
                "{} keys ran more than once with the record in the order's transaction: {:?}",
                self.duplicates.len(),
                &self.duplicates[..self.duplicates.len().min(5)]
            ));
        }
        // Without the transaction a crash may cost each order in its window one more run,
        // never more: a key that ran more often than crashes happened ran twice otherwise.
        let crashes = self.crashes() as u64;
        if let Some((key, n)) = self.duplicates.iter().find(|(_, n)| n - 1 > crashes) {
            p.push(format!(
                "{key} ran {n} times in a run with {crashes} crashes: a duplicate no crash explains"
            ));
        }
        if let Some(chain) = &self.chain {
            chain.problems(crashes, &mut p);
        }
        p
    }
}

impl fmt::Display for KillReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed: usize = self.failed.values().sum();
        writeln!(
            f,
            "kill chaos: {}, {} instance(s), {} clients, {:.1} s",
            self.mode,
            self.instances,
            self.clients,
            self.elapsed.as_secs_f64()
        )?;
        let abort_point = match self.chain {
            None => "commit",
            Some(_) => "side effect",
        };
        writeln!(
            f,
            "  crashes                {} SIGKILL, {} abort after {abort_point}, {} restarts",
            self.killed, self.aborted, self.restarted
        )?;
        writeln!(f, "  orders attempted       {}", self.attempted)?;
        writeln!(f, "  succeeded              {}", self.succeeded)?;
        writeln!(f, "  failed                 {failed}")?;
        for (why, n) in &self.failed {
            writeln!(f, "    {why}: {n}")?;
        }
        writeln!(f, "  HTTP attempts          {}", self.http_attempts)?;
        let [dropped, reset, delayed] = self.proxy_faults;
        writeln!(
            f,
            "  proxy faults           {dropped} dropped after request, {reset} reset, {delayed} delayed"
        )?;
        writeln!(f, "  order rows             {}", self.rows)?;
        writeln!(
            f,
            "  duplicates             {} keys, {} extra orders ({:.1} per 10 000 succeeded)",
            self.duplicates.len(),
            self.extra_executions(),
            self.duplicate_rate()
        )?;
        writeln!(f, "  lost (succeeded, 0)    {}", self.lost.len())?;
        writeln!(f, "  failed but executed    {}", self.failed_but_executed)?;
        writeln!(f, "  unknown keys           {}", self.unknown_keys)?;
        match (self.in_flight_left, &self.unrecorded) {
            (Some(n), Some(keys)) => {
                writeln!(f, "  in-flight claims left  {n}")?;
                writeln!(f, "  succeeded, no record   {}", keys.len())?;
            }
            _ => writeln!(
                f,
                "  claims and records     not checked (the memory store died with its process)"
            )?,
        }
        if let Some(chain) = &self.chain {
            let keys = match chain.keys {
                ChainKeys::Derived => "derived",
                ChainKeys::Fresh => "fresh (--no-derived-keys)",
            };
            writeln!(
                f,
                "  chain                  deduction keys {keys}; {} inventory instance(s), not killed",
                chain.instances
            )?;
            writeln!(f, "  deduction rows         {}", chain.rows)?;
            let by: Vec<String> = chain
                .orders_by_executions
                .iter()
                .map(|(n, orders)| format!("{n}: {orders}"))
                .collect();
            writeln!(
                f,
                "  orders by deductions   {} (executions: orders)",
                by.join(", ")
            )?;
            writeln!(
                f,
                "  duplicate deductions   {} orders, {} extra deductions ({:.1} per 10 000 succeeded, {:.2} per crash)",
                chain.duplicates.len(),
                chain.extra_executions(),
                chain.extra_executions() as f64 * 10_000.0 / self.succeeded.max(1) as f64,
                chain.extra_executions() as f64 / self.crashes().max(1) as f64
            )?;
            writeln!(
                f,
                "  succeeded, no deduction {}",
                chain.succeeded_without.len()
            )?;
            writeln!(f, "  unknown deductions     {}", chain.unknown_orders)?;
        }
        match self.problems().as_slice() {
            [] => write!(f, "  checks                 PASS"),
            problems => write!(f, "  checks                 FAIL: {}", problems.join("; ")),
        }
    }
}

/// Runs kill chaos with `opts` and reports. Panics if PostgreSQL (or Redis) cannot be reached
/// or a server cannot be started.
pub async fn run_kill(opts: KillOptions) -> KillReport {
    let started = Instant::now();
    let run_id = format!("{:012x}", fastrand::u64(..) & 0xffff_ffff_ffff);
    let db = Database::create(&opts.database_url, &run_id).await;

    // The servers' options.
    let mut args: Vec<String> = vec!["--lease-ms".into(), opts.lease.as_millis().to_string()];
    if opts.orders_driver == OrdersDriver::Sqlx {
        args.extend(["--orders-driver".into(), "sqlx".into()]);
    }
    let instances = match opts.store {
        StoreKind::Postgres => {
            args.extend(["--store".into(), db.url.clone()]);
            if !opts.transactional {
                args.push("--record-after-commit".into());
            }
            2
        }
        StoreKind::Redis => {
            let redis = opts.redis_url.clone().expect("a Redis URL for this store");
            args.extend([
                "--store".into(),
                redis,
                "--orders-db".into(),
                db.url.clone(),
            ]);
            2
        }
        StoreKind::Memory => {
            args.extend(["--store".into(), "memory".into()]);
            args.extend(["--orders-db".into(), db.url.clone()]);
            1
        }
    };
    let mut envs = vec![(
        "RUST_LOG",
        std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
    )];
    let (stop_tx, stop_rx) = watch::channel(false);

    // Chain mode: the inventory tier first (the same store options, no failpoint, never
    // killed), behind a proxy without faults that spreads connections over its instances; the
    // killed tier takes its stock there.
    let inventory_deaths = Arc::new(Deaths::default());
    let mut inventory_supervisors = Vec::new();
    let mut inventory_proxy = None;
    if let Some(keys) = opts.chain {
        let inventory = Launch {
            cmd: opts.server.clone(),
            args: args.clone(),
            envs: envs.clone(),
            stderr: opts.server_stderr,
        };
        let mut inventory_addrs = Vec::new();
        for _ in 0..instances {
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            // No sender: never killed.
            let (_, kill_rx) = mpsc::channel(1);
            inventory_supervisors.push(tokio::spawn(supervise(
                inventory.clone(),
                ready_tx,
                kill_rx,
                stop_rx.clone(),
                inventory_deaths.clone(),
            )));
            inventory_addrs.push(
                ready_rx
                    .await
                    .expect("the first start of an inventory server"),
            );
        }
        let no_faults = chooser(opts.seed, 0.0, 0.0, 0.0);
        let proxy = Proxy::start(inventory_addrs, Protocol::Http1, no_faults).await;
        args.extend(["--inventory-url".into(), format!("http://{}", proxy.addr)]);
        match keys {
            ChainKeys::Derived => args.extend([
                "--derived-keys-secret".into(),
                format!("kill-chaos-{run_id}"),
            ]),
            ChainKeys::Fresh => args.push("--no-derived-keys".into()),
        }
        inventory_proxy = Some(proxy);
    }

    if opts.abort_p > 0.0 {
        let point = match opts.chain {
            None => "abort-after-commit",
            Some(_) => "abort-after-side-effect",
        };
        envs.push(("ORDERS_FAILPOINT", format!("{point}:{}", opts.abort_p)));
    }
    let launch = Launch {
        cmd: opts.server.clone(),
        args,
        envs,
        stderr: opts.server_stderr,
    };

    // The instances, each under a supervisor.
    let deaths = Arc::new(Deaths::default());
    let mut kill_txs = Vec::new();
    let mut supervisors = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..instances {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (kill_tx, kill_rx) = mpsc::channel(1);
        supervisors.push(tokio::spawn(supervise(
            launch.clone(),
            ready_tx,
            kill_rx,
            stop_rx.clone(),
            deaths.clone(),
        )));
        kill_txs.push(kill_tx);
        addrs.push(ready_rx.await.expect("the first start of a server"));
    }
    let faults = chooser(opts.seed, opts.drop_p, opts.reset_p, opts.delay_p);
    let proxy = Proxy::start(addrs.clone(), Protocol::Http1, faults).await;
    let base = format!("http://{}", proxy.addr);

    // The killer: one instance at a time, at random intervals.
    let killer = opts.kill_every.map(|(min, max)| {
        let mut rng = fastrand::Rng::with_seed(opts.seed ^ 0x6b11);
        tokio::spawn(async move {
            loop {
                let wait = min.as_secs_f64() + rng.f64() * (max - min).as_secs_f64();
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
                let _ = kill_txs[rng.usize(..kill_txs.len())].try_send(());
            }
        })
    });

    // The clients.
    let client = http_client(
        Wire::Http1,
        &RetryLayer::new(Policy::Tuned.retry_policy()),
        crate::attempts::AttemptLog::off(),
        true,
    );
    let stop_at = Instant::now() + opts.duration;
    let give_up = stop_at + opts.duration * 4;
    let go_on = {
        let (deaths, (kills, aborts)) = (deaths.clone(), opts.min_crashes);
        move || {
            let now = Instant::now();
            let crashed = deaths.killed.load(Ordering::SeqCst) >= kills
                && deaths.aborted.load(Ordering::SeqCst) >= aborts;
            now < stop_at || (now < give_up && !crashed)
        }
    };
    let results = drive_while(opts.clients, go_on, move |w, i| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let key = format!("kill-{w:03}-{i:08}-{:08x}", fastrand::u32(..));
            let (outcome, order_id, n) = place_order(&client, &base, &key).await;
            (key, outcome, order_id, n)
        }
    })
    .await;
    if let Some(k) = killer {
        k.abort();
    }
    // Every order has been answered or given up on; a detached handler may still be finishing
    // one the client gave up on. Let it land, then stop the servers.
    tokio::time::sleep(opts.lease).await;
    let _ = stop_tx.send(true);
    for s in supervisors.into_iter().chain(inventory_supervisors) {
        s.await.expect("a supervisor");
    }
    drop(inventory_proxy);

    // The store: claims left, and succeeded orders without a record.
    let store_url = match opts.store {
        StoreKind::Postgres => Some(db.url.clone()),
        StoreKind::Redis => opts.redis_url.clone(),
        StoreKind::Memory => None,
    };
    let checked = match store_url {
        Some(url) => {
            let store = AnyStore::from_url(&url)
                .await
                .expect("the run's store is reachable");
            let method = Scope::http_operation(&http::Method::POST, "/orders");
            let scopes: Vec<(String, String)> = results
                .iter()
                .map(|(key, _, _, _)| (method.clone(), key.clone()))
                .collect();
            let claims = settle_claims(&store, &scopes, opts.lease / 2).await;
            let succeeded: HashSet<&str> = results
                .iter()
                .filter(|(_, o, _, _)| *o == Outcome::Succeeded)
                .map(|(k, _, _, _)| k.as_str())
                .collect();
            let unrecorded = claims
                .free
                .into_iter()
                .filter(|k| succeeded.contains(k.as_str()))
                .collect();
            Some((claims.left, unrecorded))
        }
        None => None,
    };

    // The ledger.
    let mut rows_by_key: HashMap<String, Vec<String>> = HashMap::new();
    let orders = connect(&db.url).await;
    let mut rows = 0;
    for row in orders
        .query("SELECT idempotency_key, order_id FROM orders", &[])
        .await
        .expect("read the orders")
    {
        rows += 1;
        let key: Option<String> = row.get(0);
        rows_by_key
            .entry(key.unwrap_or_default())
            .or_default()
            .push(row.get(1));
    }
    // The inventory's ledger (chain mode): deductions per order.
    let mut deductions_by_order: HashMap<String, u64> = HashMap::new();
    let mut deduction_rows = 0;
    if opts.chain.is_some() {
        for row in orders
            .query(
                "SELECT order_ref, count(*) FROM deductions GROUP BY order_ref",
                &[],
            )
            .await
            .expect("read the deductions")
        {
            let order: Option<String> = row.get(0);
            let n: i64 = row.get(1);
            deduction_rows += n as u64;
            *deductions_by_order
                .entry(order.unwrap_or_default())
                .or_default() += n as u64;
        }
    }
    drop(orders);
    db.drop_now().await;

    let mut report = KillReport {
        mode: opts.mode(),
        crash_safe: opts.crash_safe(),
        instances,
        clients: opts.clients,
        killed: deaths.killed.load(Ordering::SeqCst),
        aborted: deaths.aborted.load(Ordering::SeqCst),
        restarted: deaths.restarted.load(Ordering::SeqCst),
        unexpected_exits: std::mem::take(&mut *deaths.unexpected.lock().unwrap()),
        attempted: results.len(),
        http_attempts: results.iter().map(|(_, _, _, n)| u64::from(*n)).sum(),
        proxy_faults: [
            proxy.stats.dropped.load(Ordering::SeqCst),
            proxy.stats.reset.load(Ordering::SeqCst),
            proxy.stats.delayed.load(Ordering::SeqCst),
        ],
        rows,
        in_flight_left: checked.as_ref().map(|(left, _)| *left),
        unrecorded: checked.map(|(_, unrecorded)| unrecorded),
        ..KillReport::default()
    };
    let used: HashSet<&str> = results.iter().map(|(k, _, _, _)| k.as_str()).collect();
    report.unknown_keys = rows_by_key
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .count();
    for (key, outcome, order_id, _) in &results {
        let ids = rows_by_key.get(key).map_or(&[][..], Vec::as_slice);
        if ids.len() > 1 {
            report.duplicates.push((key.clone(), ids.len() as u64));
        }
        match outcome {
            Outcome::Succeeded => {
                report.succeeded += 1;
                if !order_id.as_ref().is_some_and(|id| ids.contains(id)) {
                    report.lost.push(key.clone());
                }
            }
            Outcome::Failed(why) => {
                *report.failed.entry(why.clone()).or_default() += 1;
                if !ids.is_empty() {
                    report.failed_but_executed += 1;
                }
            }
        }
    }
    report.chain = opts.chain.map(|keys| {
        let mut chain = ChainReport {
            keys,
            instances,
            unexpected_exits: std::mem::take(&mut *inventory_deaths.unexpected.lock().unwrap()),
            rows: deduction_rows,
            orders_by_executions: BTreeMap::new(),
            duplicates: Vec::new(),
            succeeded_without: Vec::new(),
            unknown_orders: deductions_by_order
                .keys()
                .filter(|k| !used.contains(k.as_str()))
                .count(),
        };
        let died = inventory_deaths.killed.load(Ordering::SeqCst)
            + inventory_deaths.aborted.load(Ordering::SeqCst);
        if died > 0 {
            chain
                .unexpected_exits
                .push(format!("{died} killed or aborted"));
        }
        for (key, outcome, _, _) in &results {
            let n = deductions_by_order.get(key).copied().unwrap_or(0);
            *chain.orders_by_executions.entry(n).or_default() += 1;
            if n > 1 {
                chain.duplicates.push((key.clone(), n));
            }
            if *outcome == Outcome::Succeeded && n == 0 {
                chain.succeeded_without.push(key.clone());
            }
        }
        chain
    });
    report.elapsed = started.elapsed();
    report
}

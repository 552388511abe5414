//! `orders-server --store postgres://...` on the real binaries and a real PostgreSQL
//! (`DATABASE_URL`; each test in a database of its own): orders go to the `orders` table, one
//! row per key however many duplicates arrive at once; and the crash that transactional
//! completion makes harmless. For that, the server aborts right after an order's transaction
//! commits and before its response leaves (`ORDERS_FAILPOINT=abort-after-commit`), so the
//! client's request fails; the server restarts without the failpoint, and the client retries
//! with the same key.
//!
//! - With the record in the order's transaction (the default): the retry gets the replay, the
//!   same order, and the table holds one order.
//! - With the record written by the layer after the commit (`--record-after-commit`, as with any
//!   store that is not in the order's database): the retry runs again, and the table holds two.
//!
//! And the chain (`--inventory-url`): an orders server that takes its stock from another one's
//! inventory aborts right after the inventory answered the deduction and before its own
//! transaction (`ORDERS_FAILPOINT=abort-after-side-effect`); restarted, it runs the client's
//! retry of the order again. With derived keys the second run's deduction is the first one's
//! replay: one `deductions` row for the order; with `--no-derived-keys` two.
//!
//! Unset `DATABASE_URL`: each test says so and passes, except with `IDEMPOTENCY_TESTS_STRICT` set, where it fails.
#![cfg(feature = "postgres")]

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use test_support::process::ServerProcess;
use tokio_postgres::{NoTls, Row};

/// A server process, killed when dropped.
struct Server {
    process: ServerProcess,
    url: String,
}

impl Server {
    /// Starts `orders-server` on `store`, with `args` and `failpoint` (`ORDERS_FAILPOINT`).
    fn start(store: &str, args: &[&str], failpoint: Option<&str>) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_orders-server"));
        cmd.args(["--listen", "127.0.0.1:0", "--store", store])
            // A claim left in flight by the crash is taken over after 1 s, not 30.
            .args(["--lease-ms", "1000"])
            .args(args)
            .env_remove("ORDERS_FAILPOINT");
        if let Some(f) = failpoint {
            cmd.env("ORDERS_FAILPOINT", f);
        }
        let process = ServerProcess::start(cmd);
        let url = process.url();
        Server { process, url }
    }

    /// Waits (at most 10 s) for the process to end by itself (the failpoint aborts it); how
    /// it ended.
    fn wait_for_exit(&mut self) -> std::process::ExitStatus {
        self.process.wait_for_exit(Duration::from_secs(10))
    }
}

/// `orders-client --key KEY [extra] create --book b1 --quantity 1` against `url`: whether it
/// succeeded, and its JSON lines.
fn create_orders(url: &str, key: &str, extra: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let out = Command::new(env!("CARGO_BIN_EXE_orders-client"))
        .args(["--url", url, "--key", key])
        .args(extra)
        .args(["create", "--book", "b1", "--quantity", "1"])
        .output()
        .expect("orders-client runs");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    (out.status.success(), lines)
}

/// One order with `key`: whether it succeeded, and its JSON line.
fn create_order(url: &str, key: &str) -> (bool, serde_json::Value) {
    let (ok, mut lines) = create_orders(url, key, &[]);
    assert_eq!(lines.len(), 1, "one line per order");
    (ok, lines.remove(0))
}

/// A database of the test's own on the server `DATABASE_URL` names, dropped at the end.
struct Database {
    admin_url: String,
    name: String,
    url: String,
}

impl Database {
    fn create() -> Option<Database> {
        let admin_url = test_support::env::env_url("DATABASE_URL")?;
        let name = format!(
            "orders_crash_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        sql(&admin_url, &format!("CREATE DATABASE {name}"));
        // postgres://user@host:port/db?params -> the same with our database.
        let (base, params) = admin_url
            .split_once('?')
            .map_or((admin_url.as_str(), None), |(b, p)| (b, Some(p)));
        let (server, _db) = base
            .rsplit_once('/')
            .filter(|(server, _)| server.contains("://"))
            .expect("DATABASE_URL in the form postgres://USER@HOST:PORT/DB");
        let url = match params {
            Some(p) => format!("{server}/{name}?{p}"),
            None => format!("{server}/{name}"),
        };
        Some(Database {
            admin_url,
            name,
            url,
        })
    }

    /// The order ids in the `orders` table.
    fn order_ids(&self) -> Vec<String> {
        rows(&self.url, "SELECT order_id FROM orders ORDER BY created_at")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        sql(
            &self.admin_url,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// Runs `statements` on the database at `url` (a connection of its own, on a runtime of its own:
/// the tests drive processes synchronously).
fn sql(url: &str, statements: &str) {
    with_client(url, |c| async move { c.batch_execute(statements).await });
}

fn rows(url: &str, query: &str) -> Vec<Row> {
    with_client(url, |c| async move { c.query(query, &[]).await })
}

fn with_client<T, F, Fut>(url: &str, f: F) -> T
where
    F: FnOnce(tokio_postgres::Client) -> Fut,
    Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(url, NoTls)
            .await
            .expect("DATABASE_URL is set, so PostgreSQL must be reachable");
        let driver = tokio::spawn(conn);
        let out = f(client).await.expect("SQL");
        let _ = driver.await;
        out
    })
}

/// The first attempt: the server commits the order, then aborts before answering.
fn crash_after_commit(db: &Database, args: &[&str], key: &str) -> String {
    let mut server = Server::start(&db.url, args, Some("abort-after-commit"));
    let (ok, line) = create_order(&server.url, key);
    assert!(!ok, "the client got no answer: {line}");
    assert_eq!(line["status"], 0, "{line}");
    let status = server.wait_for_exit();
    assert_eq!(status.signal(), Some(6), "aborted (SIGABRT): {status:?}");
    let ids = db.order_ids();
    assert_eq!(ids.len(), 1, "the order committed before the crash");
    ids[0].clone()
}

#[test]
fn concurrent_duplicates_make_one_order_row() {
    let Some(db) = Database::create() else { return };
    let server = Server::start(&db.url, &["--work-ms", "50"], None);
    let extra = ["--count", "5", "--concurrency", "5"];
    let (ok, lines) = create_orders(&server.url, "pg-duplicates-0001", &extra);
    assert!(ok, "{lines:?}");
    assert_eq!(lines.len(), 5);
    for l in &lines {
        assert_eq!(l["status"], 201, "{l}");
        assert_eq!(
            l["order_id"], lines[0]["order_id"],
            "one order for every duplicate"
        );
    }
    assert_eq!(db.order_ids(), [lines[0]["order_id"].as_str().unwrap()]);
}

#[test]
fn a_crash_between_commit_and_response_replays_the_order_after_restart() {
    let Some(db) = Database::create() else { return };
    let key = "crash-after-commit-0001";
    let committed = crash_after_commit(&db, &[], key);

    let server = Server::start(&db.url, &[], None);
    let (ok, line) = create_order(&server.url, key);
    assert!(ok, "{line}");
    assert_eq!(line["status"], 201, "{line}");
    assert_eq!(
        line["order_id"], committed,
        "the retry gets the order committed before the crash (its replay)"
    );
    assert_eq!(db.order_ids(), [committed], "one order");
}

#[test]
fn without_transactional_completion_the_same_crash_creates_a_second_order() {
    let Some(db) = Database::create() else { return };
    let key = "crash-after-commit-0002";
    let committed = crash_after_commit(&db, &["--record-after-commit"], key);

    let server = Server::start(&db.url, &["--record-after-commit"], None);
    let (ok, line) = create_order(&server.url, key);
    assert!(ok, "{line}");
    assert_eq!(line["status"], 201, "{line}");
    assert_ne!(
        line["order_id"], committed,
        "the record was never written: the retry ran the handler again"
    );
    let ids = db.order_ids();
    assert_eq!(
        ids.len(),
        2,
        "the crash window made a duplicate order: {ids:?}"
    );
}

impl Database {
    /// How many deductions the inventory executed for the order with key `order`.
    fn deductions_for(&self, order: &str) -> i64 {
        let n = rows(
            &self.url,
            &format!("SELECT count(*) FROM deductions WHERE order_ref = '{order}'"),
        );
        n[0].get(0)
    }
}

/// An order through a chain whose middle tier crashes after the deduction and is restarted:
/// the inventory's deductions for the order, once the retry succeeded.
fn chain_crash_after_deduction(db: &Database, keys: &[&str], key: &str) -> i64 {
    // The inventory: the same database, never restarted.
    let inventory = Server::start(&db.url, &[], None);
    let mut args = vec!["--inventory-url", inventory.url.as_str()];
    args.extend(keys);

    let mut orders = Server::start(&db.url, &args, Some("abort-after-side-effect"));
    let (ok, line) = create_order(&orders.url, key);
    assert!(!ok, "the client got no answer: {line}");
    let status = orders.wait_for_exit();
    assert_eq!(status.signal(), Some(6), "aborted (SIGABRT): {status:?}");
    assert_eq!(db.deductions_for(key), 1, "deducted before the crash");
    assert!(db.order_ids().is_empty(), "the order was not stored");

    // Restarted: the retry takes the crashed run's claim over (after its lease) and runs the
    // order again, deduction included.
    let orders = Server::start(&db.url, &args, None);
    let (ok, line) = create_order(&orders.url, key);
    assert!(ok, "{line}");
    assert_eq!(line["status"], 201, "{line}");
    assert_eq!(db.order_ids().len(), 1, "one order");
    db.deductions_for(key)
}

#[test]
fn a_chain_crash_after_the_deduction_deducts_once_with_derived_keys() {
    let Some(db) = Database::create() else { return };
    let keys = ["--derived-keys-secret", "chain test secret"];
    assert_eq!(
        chain_crash_after_deduction(&db, &keys, "chain-crash-0001"),
        1,
        "the second run's deduction was answered with the first one's record"
    );
}

#[test]
fn a_chain_crash_after_the_deduction_deducts_twice_with_fresh_keys() {
    let Some(db) = Database::create() else { return };
    assert_eq!(
        chain_crash_after_deduction(&db, &["--no-derived-keys"], "chain-crash-0002"),
        2,
        "a fresh key made the inventory deduct again"
    );
}

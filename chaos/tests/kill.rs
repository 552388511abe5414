//! Kill chaos, short: `orders-server` processes (the `kill` binary re-executed) with their
//! orders in a real PostgreSQL (`DATABASE_URL`), SIGKILLed every 1 to 2 s and aborting after
//! 5 % of order commits, restarted at once, for 10 s of orders each, or until 3 kills and an
//! abort have happened if that takes longer. The long runs are in
//! RELIABILITY.md.
//!
//! - PostgreSQL store, record in the order's transaction, on tokio-postgres and on sqlx
//!   (`--orders-driver sqlx`): no duplicate, nothing lost, and every succeeded order holds its
//!   record.
//! - PostgreSQL with `--record-after-commit`, Redis (`REDIS_URL`) and memory (one instance, its
//!   records die with it): nothing lost, and every duplicate is one a crash explains (a key runs
//!   at most once more per crash); how many there are depends on where the crashes fall, so the
//!   count is reported, not asserted.
//! - For the shared stores, no claim is left in flight a lease after the last order.
//! - Chain mode (PostgreSQL, record in the order's transaction): the killed instances deduct
//!   each order's stock on an inventory tier that is not killed and abort right after the
//!   deduction (`abort-after-side-effect`). With derived keys no order is deducted twice; with
//!   fresh keys (`--no-derived-keys`) the orders run again after those aborts deduct again.
//!
//! The runs take turns (each starts its own servers). Unset `DATABASE_URL` (or `REDIS_URL` for
//! Redis): the test says so and passes, except with `IDEMPOTENCY_TESTS_STRICT` set, where it fails.

use std::sync::Mutex;
use std::time::Duration;

use chaos::kill::{run_kill, ChainKeys, KillOptions, KillReport, OrdersDriver, ServerCommand};
use chaos::StoreKind;

/// One run at a time: each starts two servers on a machine with few cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn short(store: StoreKind, transactional: bool) -> Option<KillReport> {
    short_on(store, transactional, OrdersDriver::TokioPostgres, None)
}

fn short_on(
    store: StoreKind,
    transactional: bool,
    driver: OrdersDriver,
    chain: Option<ChainKeys>,
) -> Option<KillReport> {
    let url = test_support::env::env_url("DATABASE_URL")?;
    let redis_url = match store {
        StoreKind::Redis => Some(test_support::env::env_url("REDIS_URL")?),
        _ => None,
    };
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = ServerCommand {
        program: env!("CARGO_BIN_EXE_kill").into(),
        args: vec!["serve".into()],
    };
    let mut o = KillOptions::new(store, url, server, Duration::from_secs(10));
    o.redis_url = redis_url;
    o.transactional = transactional;
    o.orders_driver = driver;
    o.clients = 8;
    o.kill_every = Some((Duration::from_secs(1), Duration::from_secs(2)));
    o.abort_p = 0.05;
    // The run goes on until it has seen 3 kills and an abort (a loaded machine restarts its
    // servers slowly; the kills are what this test is about, not how many fit in 10 s).
    o.min_crashes = (3, 1);
    o.chain = chain;
    let report = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run_kill(o));
    println!("{report}");
    assert_eq!(report.problems(), Vec::<String>::new(), "{report}");
    assert!(report.succeeded > 50, "{report}");
    assert!(
        report.killed >= 3 && report.aborted > 0,
        "instances were killed and aborted at the failpoint (the run went on for them, up to \
         5 x its duration): {report}"
    );
    // Every crash was restarted, but a crash as the run stops (at most one per instance).
    assert!(
        report.restarted + report.instances >= report.crashes(),
        "{report}"
    );
    assert!(report.lost.is_empty(), "{report}");
    match store {
        StoreKind::Memory => assert_eq!(report.in_flight_left, None, "{report}"),
        _ => assert_eq!(report.in_flight_left, Some(0), "{report}"),
    }
    Some(report)
}

/// A crash duplicates at most the orders in its window, each once: at most one per client.
fn duplicates_only_through_crashes(report: &KillReport) {
    assert!(!report.crash_safe);
    assert!(
        report.extra_executions() <= (report.crashes() * report.clients) as u64,
        "{report}"
    );
}

#[test]
fn kills_with_transactional_completion_make_no_duplicate_and_lose_nothing() {
    let Some(report) = short(StoreKind::Postgres, true) else {
        return;
    };
    assert!(report.crash_safe);
    assert_eq!(report.duplicates, Vec::new(), "{report}");
    assert_eq!(report.unrecorded, Some(Vec::new()), "{report}");
}

#[test]
fn kills_with_transactional_completion_on_sqlx_make_no_duplicate_and_lose_nothing() {
    let Some(report) = short_on(StoreKind::Postgres, true, OrdersDriver::Sqlx, None) else {
        return;
    };
    assert!(report.crash_safe);
    assert!(report.mode.contains("sqlx"), "{report}");
    assert_eq!(report.duplicates, Vec::new(), "{report}");
    assert_eq!(report.unrecorded, Some(Vec::new()), "{report}");
}

#[test]
fn kills_with_the_record_after_the_commit_duplicate_only_through_crashes() {
    let Some(report) = short(StoreKind::Postgres, false) else {
        return;
    };
    duplicates_only_through_crashes(&report);
}

#[test]
fn kills_with_redis_records_duplicate_only_through_crashes() {
    let Some(report) = short(StoreKind::Redis, false) else {
        return;
    };
    duplicates_only_through_crashes(&report);
}

#[test]
fn kills_with_memory_records_duplicate_only_through_crashes() {
    let Some(report) = short(StoreKind::Memory, false) else {
        return;
    };
    duplicates_only_through_crashes(&report);
}

fn short_chain(keys: ChainKeys) -> Option<KillReport> {
    let report = short_on(
        StoreKind::Postgres,
        true,
        OrdersDriver::TokioPostgres,
        Some(keys),
    )?;
    let chain = report.chain.as_ref().expect("a chain report");
    assert_eq!(chain.keys, keys, "{report}");
    assert_eq!(chain.succeeded_without, Vec::<String>::new(), "{report}");
    assert!(chain.rows >= report.succeeded as u64, "{report}");
    // The orders tier itself stays effectively-once (its record is in the order's transaction).
    assert_eq!(report.duplicates, Vec::new(), "{report}");
    Some(report)
}

#[test]
fn kills_on_the_middle_of_a_chain_deduct_once_per_order_with_derived_keys() {
    let Some(report) = short_chain(ChainKeys::Derived) else {
        return;
    };
    let chain = report.chain.as_ref().unwrap();
    assert_eq!(chain.duplicates, Vec::new(), "{report}");
    assert!(
        chain.orders_by_executions.keys().all(|n| *n <= 1),
        "at most one deduction per order: {report}"
    );
}

#[test]
fn kills_on_the_middle_of_a_chain_deduct_again_with_fresh_keys() {
    let Some(report) = short_chain(ChainKeys::Fresh) else {
        return;
    };
    // Each abort after a deduction leaves its order unrecorded; the client's retry runs it
    // again, and with a fresh key the inventory deducts again.
    assert!(
        report.chain.as_ref().unwrap().extra_executions() > 0,
        "{} aborts after a deduction, and no order deducted twice: {report}",
        report.aborted
    );
}

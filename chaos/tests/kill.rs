//! Kill chaos, short: two `orders-server` processes (the `kill` binary re-executed) sharing a
//! real PostgreSQL (`DATABASE_URL`), SIGKILLed every 1 to 2 s and aborting after 5 % of order
//! commits, restarted at once, for 10 s of orders each. The long runs are in RELIABILITY.md.
//!
//! - With the record in the order's transaction: no duplicate, nothing lost.
//! - With `--record-after-commit`: nothing lost, and every duplicate is one a crash explains
//!   (a key runs at most once more per crash); how many there are depends on where the crashes
//!   fall, so the count is reported, not asserted.
//!
//! The two runs take turns (each starts its own servers). Unset `DATABASE_URL`: each test says so
//! and passes, except under `CI`, where it fails.

use std::sync::Mutex;
use std::time::Duration;

use chaos::kill::{run_kill, KillOptions, KillReport, ServerCommand};
use chaos::StoreKind;

/// One run at a time: each starts two servers on a machine with few cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn short(transactional: bool) -> Option<KillReport> {
    let url = e2e::scenario::env_url("DATABASE_URL")?;
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let server = ServerCommand {
        program: env!("CARGO_BIN_EXE_kill").into(),
        args: vec!["serve".into()],
    };
    let mut o = KillOptions::new(StoreKind::Postgres, url, server, Duration::from_secs(10));
    o.transactional = transactional;
    o.clients = 8;
    o.kill_every = Some((Duration::from_secs(1), Duration::from_secs(2)));
    o.abort_p = 0.05;
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
        "instances were killed and aborted at the failpoint: {report}"
    );
    // Every crash was restarted, but a crash as the run stops (at most one per instance).
    assert!(
        report.restarted + report.instances >= report.crashes(),
        "{report}"
    );
    assert!(report.lost.is_empty(), "{report}");
    Some(report)
}

#[test]
fn kills_with_transactional_completion_make_no_duplicate_and_lose_nothing() {
    let Some(report) = short(true) else { return };
    assert!(report.crash_safe);
    assert_eq!(report.duplicates, Vec::new(), "{report}");
}

#[test]
fn kills_with_the_record_after_the_commit_duplicate_only_through_crashes() {
    let Some(report) = short(false) else { return };
    assert!(!report.crash_safe);
    // A crash duplicates at most the orders in its window, each once: at most one per client.
    assert!(
        report.extra_executions() <= (report.crashes() * report.clients) as u64,
        "{report}"
    );
}

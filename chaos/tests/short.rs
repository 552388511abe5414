//! The short chaos soak: memory (one instance) and Redis (two instances, the store cut twice),
//! each under 30 s, with clients on every wire (HTTP/1.1, HTTP/2, gRPC) and policy (tuned,
//! default). The long runs are in RELIABILITY.md.
//!
//! It runs on the wall clock and asserts that every group made progress, which a machine busy
//! with the rest of the test suite cannot promise: `cargo test` skips it (`#[ignore]`), and
//! `.ci/run` runs it on its own after the suite, one soak at a time:
//! `cargo test -p chaos --test short -- --ignored --test-threads 1`.

use std::time::Duration;

use chaos::{run, Options, Policy, StoreKind, Wire};
use test_support::fault_proxy::LinkFault;

fn short(store: StoreKind, url: Option<String>) -> Options {
    let mut o = Options::new(store, url, Duration::from_secs(14));
    o.clients = 18;
    // Every fault of the store's link once (six, 2 s apart) within the 14 s.
    o.store_fault_every = Duration::from_secs(2);
    o.store_fault_for = Duration::from_secs(1);
    o
}

fn check(report: &chaos::Report) {
    println!("{report}");
    assert_eq!(report.problems(), Vec::<String>::new(), "{report}");
    assert!(report.succeeded > 100, "{report}");
    assert!(
        report.dropped > 0 && report.reset > 0,
        "faults were injected: {report}"
    );
    assert!(
        report.layer[1] > 0,
        "dropped answers were replayed: {report}"
    );
    // Every group ran, and every wire was faulted.
    assert_eq!(report.groups.len(), Wire::ALL.len() * Policy::ALL.len());
    for (group, g) in &report.groups {
        assert!(g.succeeded > 10, "{group} made progress: {report}");
        assert_eq!(g.clients, 3, "{report}");
    }
    for wire in Wire::ALL {
        assert!(
            report.wire_faults[&wire][0] > 0,
            "{wire:?} answers were dropped: {report}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a wall-clock soak: .ci/run runs it alone, after the suite"]
async fn short_soak_memory() {
    let report = run(short(StoreKind::Memory, None)).await;
    check(&report);
    assert_eq!(report.instances, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a wall-clock soak: .ci/run runs it alone, after the suite"]
async fn short_soak_redis() {
    let Some(url) = test_support::env::env_url("REDIS_URL") else {
        return;
    };
    let report = run(short(StoreKind::Redis, Some(url))).await;
    check(&report);
    assert_eq!(report.instances, 2);
    // Faults on a schedule of wall-clock time, one every 2 s from 1 s on: the first four (a
    // half-open link, held replies, a reset, a cut) are inflicted by 8 s of the 14 s the
    // clients start operations in; the rest depends on the machine's load. Their effects are
    // checked in `check`.
    let kinds: Vec<LinkFault> = report.store_faults.iter().map(|(f, _)| *f).collect();
    assert_eq!(
        kinds.get(..4),
        Some(&LinkFault::ALL[..4]),
        "the store link's faults were inflicted: {report}"
    );
}

//! The simulator in `cargo test`: the seeds that found bugs (each must now hold every
//! promise) and a sweep of a few hundred seeds (the check that a seed replays exactly is in
//! `replay.rs`, a binary of its own).

use sim::run_seed;

/// Seeds that found a broken promise, with what they found. Each is fixed; each must hold.
const REGRESSIONS: &[(u64, &str)] = &[
    (3, "a response body that panics after its 201 head: the HTTP/1.1 call never ended and the retry ran the write again"),
    (20, "a response body that panics: the layer's future resumed after the panic, the write ran twice"),
    (11, "a client whose service never becomes ready: calls never ended, whatever their deadline"),
    (15, "a call's deadline counted only from `call`, not from the wait for readiness before it"),
    (103, "the store refused `complete` for longer than a lease: the lease lapsed under a write that ran, and it ran twice"),
    (621, "a store that never answers a `complete` held the response's final frame forever"),
    (1876, "a store outage shorter than the lease lapsed a claim (renewals every third of the lease, drifting)"),
    (12689, "one slow renewal reply held back the next renewals, and the lease lapsed under its leader"),
    (1003904, "the simulator's own: a restarted client numbered its attempts from 0 again, so a fail-open execution was judged by another attempt's store answers and counted as a second execution"),
    (108122, "a store that never answered a `begin` kept a server's one `ConcurrencyLimit` permit for ever, and the server answered nothing again"),
];

#[test]
fn the_seeds_that_found_bugs_hold_every_promise() {
    for (seed, found) in REGRESSIONS {
        let report = run_seed(*seed);
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed} (found: {found}) breaks a promise again:\n{}",
            report.explain()
        );
    }
}

/// Seeds whose small memory bounds are reached: a duplicate refused its wait (the servers'
/// waiters' bytes), a request body not kept for replay (the client's). Each holds its bound;
/// with the bound taken out of the layer, each breaks promise 5.
#[test]
fn seeds_that_reach_their_memory_bounds_hold_them() {
    for (seed, reached) in [
        (4, "bounds: servers' waiting memory full"),
        (1, "bounds: clients' replay memory full"),
    ] {
        let report = run_seed(seed);
        assert!(
            report.faults().iter().any(|(kind, _)| kind == reached),
            "seed {seed} no longer reaches its bound ({reached}): pick another seed that does"
        );
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed}:\n{}",
            report.explain()
        );
    }
}

/// Seeds `from..from + n`: every promise holds.
fn sweep(from: u64, n: u64) {
    for seed in from..from + n {
        let report = run_seed(seed);
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed}:\n{}",
            report.explain()
        );
    }
}

// The sweep in four parts, which the test harness runs in parallel.
#[test]
fn sweep_seeds_0_to_75() {
    sweep(0, 75);
}

#[test]
fn sweep_seeds_75_to_150() {
    sweep(75, 75);
}

#[test]
fn sweep_seeds_150_to_225() {
    sweep(150, 75);
}

#[test]
fn sweep_seeds_225_to_300() {
    sweep(225, 75);
}

//! The simulator in `cargo test`: the seeds that found bugs (each must now hold every
//! promise), a fixed sweep, and a sweep from a seed derived from the commit (each landing tries
//! new schedules). One test, so that the seeds run one after another on one thread: tokio
//! numbers tasks with one counter for the whole process, and a seed replays exactly only when
//! no other thread spawns tasks meanwhile (the check that a seed replays exactly is in
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

/// The holes of issue 50 the adversary finds, not yet fixed in the layers: each seed breaks a
/// promise today (its letter is the list: A a late `begin` reply, B hung renewals, C a
/// body method that panics, D a stale `complete` acknowledged, E a refused `complete`, G
/// fail-open beside a leader, H a draining server's new claims). Run with
/// `cargo test -p sim --test seeds -- --ignored --test-threads 1`.
pub const HOLES: &[(u64, &str)] = &[
    (1030, "A: server 0's `begin` answered 778 ms late (DelayReply) on a 1 s lease; the claim begun at 1.745 s was never renewed and was taken over at 2.75 s (NotRenewed)"),
    (1785, "B: four `renew_many` calls hung after running (HangAfter x4); claim begun at 1.13 s renewed once at 1.635 s, then no renewal reached the healthy store until its takeover at 4.315 s"),
    (3, "C: `is_end_stream` panics after the 201 head (HTTP/1.1): the claim was released at 5.955 s without a shared failure and the retry ran again"),
    (16, "C: `size_hint` panics at byte 0 after the 201 head: the claim was released at 3.035 s, the retry ran again at 4.87 s"),
    (609, "D: the store answered Ok to the `complete` of a claim taken over (stale token), and the write ran twice"),
    (728, "E: `complete` refused with Full on server 0: the claim begun at 645 ms was never renewed again and was taken over at 6.025 s (lease 3 s)"),
    (152, "E: `complete` refused with Corrupt (one-shot): the claim was dropped, taken over after the 30 s lease; the write and its downstream write ran twice"),
    (790, "G: with fail_open, a duplicate ran unprotected at 350 ms on server 0 beside that server's leader holding the key since 310 ms"),
    (832, "H (to confirm): server 0 claimed a key at 4.055 s, after its drain began at 3.29 s"),
];

/// Seeds `from..from + n`: every promise holds.
fn sweep(from: u64, n: u64) {
    eprintln!("sim: sweeping seeds {from}..{}", from + n);
    for seed in from..from + n {
        let report = run_seed(seed);
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed} (of the sweep {from}..{}):\n{}",
            from + n,
            report.explain()
        );
    }
}

/// Everything in one test, run in order on one thread.
#[test]
fn the_simulator_holds_every_promise() {
    for (seed, found) in REGRESSIONS {
        let report = run_seed(*seed);
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed} (found: {found}) breaks a promise again:\n{}",
            report.explain()
        );
    }
    // Seeds whose small memory bounds are reached: a duplicate refused its wait (the servers'
    // waiters' bytes), a request body not kept for replay (the client's). Each holds its bound;
    // with the bound taken out of the layer, each breaks promise 5.
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
    sweep(0, 300);
    // New schedules on every commit (the range is printed; rerun a failing seed alone with
    // `cargo run --release -p sim -- --seed N`).
    sweep(sim::commit_seed(), 100);
}

/// The holes' seeds hold every promise: ignored until the fixes of issue 50 land in the layers
/// (each breaks a promise today); then un-ignore it, or move the seeds to `REGRESSIONS`.
#[test]
#[ignore = "the layers do not have the fixes of issue 50 yet"]
fn the_holes_seeds_hold_every_promise() {
    for (seed, hole) in HOLES {
        let report = run_seed(*seed);
        assert!(
            report.verdict.violations.is_empty(),
            "seed {seed} (hole {hole}) still breaks a promise:\n{}",
            report.explain()
        );
    }
}

//! Both promises of the workspace, checked by deterministic simulation.
//!
//! The real layers run unmodified on [turmoil](https://docs.rs/turmoil)'s simulated hosts,
//! network and time, all in one thread and all decided by one seed:
//!
//! - client hosts: `RetryLayer` over hyper-util's client (HTTP/1.1 or h2c), through a router
//!   that sends each attempt to the next server and a readiness gate the schedule can close;
//! - two or three server instances: `IdempotencyLayer` over axum and hyper, sharing one
//!   `MemoryStore` (wrapped in the conformance suite's `FaultStore`) that lives on a store host
//!   of its own, so that it has one clock;
//! - handlers whose side effect the ledger counts, with the faults the schedule gives them;
//! - for chained writes, `HopLayer` in front of each server and a downstream tier written with
//!   derived keys (through `RetryLayer`, with `HedgeLayer` under it when the seed hedges).
//!
//! A seed draws a [`schedule::Schedule`]: the settings of both layers (and their memory bounds,
//! often small), the intents (keys, bodies, duplicates sent at once, cancellations) and the
//! timed faults (partitions, half-open links, server crashes, rolling restarts that drain a
//! server with GOAWAY, client crashes after which every unanswered write is sent again with its
//! key, store errors, delays, lost replies, hangs, a full store, a client service that stops
//! being ready). After the run, [`invariants::check`] checks every
//! promise. The same seed replays the same run.
//!
//! ```no_run
//! let report = sim::run_seed(42);
//! assert!(report.verdict.violations.is_empty(), "{}", report.explain());
//! ```

pub mod app;
pub mod chain;
pub mod client;
pub mod connection;
pub mod grpc;
pub mod held;
pub mod invariants;
pub mod ledger;
pub mod net;
pub mod schedule;
pub mod store_host;
pub mod tag;
pub mod world;

use std::fmt::Write as _;

use invariants::Verdict;
use schedule::{Handler, Schedule};
use world::Run;

/// One seed's run and its verdict.
#[derive(Debug)]
pub struct SeedReport {
    /// The run.
    pub run: Run,
    /// The verdict.
    pub verdict: Verdict,
}

/// Runs seed `seed` and checks every promise.
pub fn run_seed(seed: u64) -> SeedReport {
    align_task_ids();
    let run = world::run(Schedule::draw(seed));
    let verdict = invariants::check(&run);
    SeedReport { run, verdict }
}

/// A starting seed derived from the current commit, so that each landing tries new schedules:
/// `GITHUB_SHA` or `git rev-parse HEAD` (its first 12 hex digits, times 1000), or 0 outside a
/// git checkout.
pub fn commit_seed() -> u64 {
    let sha = std::env::var("GITHUB_SHA").ok().or_else(|| {
        std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
    });
    sha.and_then(|s| u64::from_str_radix(s.trim().get(..12)?, 16).ok())
        .map_or(0, |n| n.wrapping_mul(1000))
}

/// Makes the next tokio task id a multiple of [`TASK_ID_ALIGNMENT`].
///
/// Tokio numbers tasks with one counter for the whole process, and a runtime keeps its tasks
/// in lists sharded by that number (four lists on a current-thread runtime): when a host's
/// runtime is dropped (a crash, the end of a seed), its tasks are dropped list by list, in an
/// order that depends on how many tasks the process spawned before. A seed then behaved
/// differently after different seeds. From an aligned start, its tasks get the same numbers
/// modulo every shard count up to the alignment, whatever ran before, as long as no other
/// thread spawns tasks meanwhile (`cargo run -p sim` runs its seeds on one thread).
fn align_task_ids() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime to align task ids on");
    loop {
        let id = rt.spawn(async {}).id();
        let n: u64 = id.to_string().parse().expect("a task id is a number");
        if n % TASK_ID_ALIGNMENT == TASK_ID_ALIGNMENT - 1 {
            return;
        }
    }
}

/// A multiple of every shard count tokio's task lists use on the simulation's runtimes.
const TASK_ID_ALIGNMENT: u64 = 64;

impl SeedReport {
    /// Faults this seed injected, by kind (network, hosts and store as applied; handlers and
    /// cancellations as drawn).
    pub fn faults(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .run
            .observed
            .faults
            .iter()
            .map(|(k, n)| ((*k).to_owned(), *n))
            .collect();
        let settings = &self.run.schedule.settings;
        let peaks = self.run.observed.peaks;
        if let Some(max) = settings.bounds.max_waiting_bytes {
            out.push(("bounds: servers' waiting memory drawn small".to_owned(), 1));
            // One more waiter (1 KiB and its body) would not fit: a duplicate was refused, or
            // would have been.
            if peaks.waiting_bytes + 1024 > max as u64 {
                out.push(("bounds: servers' waiting memory full".to_owned(), 1));
            }
        }
        if let Some(max) = settings.bounds.max_response_buffer_bytes {
            out.push(("bounds: servers' response buffer drawn small".to_owned(), 1));
            // Less room left than one more frame of a response read slowly.
            if peaks.response_buffer_bytes as usize + app::BIG_FRAME > max {
                out.push(("bounds: servers' response buffer full".to_owned(), 1));
            }
        }
        if let Some((max, _)) = settings.bounds.store {
            out.push(("bounds: store bytes drawn small".to_owned(), 1));
            // No room for one more claim and a small record.
            if peaks.store_bytes as usize + 512 > max {
                out.push(("bounds: store full".to_owned(), 1));
            }
        }
        if let Some(max) = settings.bounds.max_replay_bytes_total {
            out.push(("bounds: clients' replay memory drawn small".to_owned(), 1));
            let largest = self.run.schedule.intents.iter().map(|i| i.body.len()).max();
            if largest.is_some_and(|b| peaks.replay_bytes as usize + b > max) {
                out.push(("bounds: clients' replay memory full".to_owned(), 1));
            }
        }
        if settings.fail_rate > 0.0 {
            out.push(("network: resets (a per-message fail rate)".to_owned(), 1));
        }
        // gRPC clients are `RetryLayer::tonic_channel` alone: no hedging there.
        let grpc = settings.protocol == schedule::Protocol::Grpc;
        if !grpc && settings.hedging && settings.hedging_alone {
            out.push(("settings: hedged writes, no retry layer".to_owned(), 1));
        } else if !grpc && settings.hedging {
            out.push((
                "settings: hedged writes under the retry layer".to_owned(),
                1,
            ));
        }
        if settings.chain {
            out.push((
                "settings: a downstream write with derived keys".to_owned(),
                1,
            ));
        }
        if !grpc && settings.client_buffer.is_some() {
            out.push(("client: a Buffer in front of the layer".to_owned(), 1));
        }
        if !grpc && settings.client_limit.is_some() {
            out.push(("client: a ConcurrencyLimit under the layer".to_owned(), 1));
        }
        if settings.client_one_connection {
            out.push((
                "client: one HTTP/1.1 connection under the layer".to_owned(),
                1,
            ));
        }
        if settings.client_reuses_service {
            out.push((
                "client: one service for all calls (ready, then call)".to_owned(),
                1,
            ));
        }
        if settings.client_ready_timeout.is_some() {
            out.push(("client: callers that give up a slow ready()".to_owned(), 1));
        }
        if settings.call_deadline.is_some() {
            out.push(("client: a per-request Deadline".to_owned(), 1));
        }
        if settings.fail_open {
            out.push(("settings: fail_open".to_owned(), 1));
        }
        if settings
            .per_server
            .iter()
            .any(|s| s.request_body_timeout.is_some())
        {
            out.push(("bounds: request_body_timeout drawn small".to_owned(), 1));
            let timed_out = self.run.observed.calls.iter().any(|c| {
                matches!(
                    c.end,
                    Some((_, ledger::Ending::Response { status: 408, .. }))
                )
            });
            if timed_out {
                out.push(("bounds: request_body_timeout reached (408)".to_owned(), 1));
            }
        }
        for m in &self.run.schedule.malformed {
            out.push((format!("caller: malformed write ({:?})", m.kind), 1));
        }
        for i in &self.run.schedule.intents {
            let kind = match i.first {
                Handler::Ok => None,
                Handler::Error => Some("handler: error"),
                Handler::Unavailable => Some("handler: 503"),
                Handler::PanicBeforeHead => Some("handler: panic before the head"),
                Handler::PanicInBody { .. } => Some("handler: panic in the body"),
                Handler::ErrorInBody { .. } => Some("handler: error in the body"),
                Handler::StallInBody { .. } => Some("handler: body stalls"),
                Handler::Slow(_) => Some("handler: slow"),
                Handler::NeverEnds => Some("handler: never ends"),
                Handler::PanicInIsEndStream { .. } => Some("handler: body's is_end_stream panics"),
                Handler::PanicInSizeHint { .. } => Some("handler: body's size_hint panics"),
            };
            if !i.later.is_empty() {
                out.push(("handler: a fault on a later run".to_owned(), 1));
            }
            if i.sends.iter().any(|s| s.other_body) {
                out.push(("caller: the same key with another body".to_owned(), 1));
            }
            for send in &i.sends {
                match send.body_fault {
                    Some(schedule::BodyFault::Stall { .. }) => {
                        out.push(("caller: request body stalls midway".to_owned(), 1));
                    }
                    Some(schedule::BodyFault::Fail { .. }) => {
                        out.push(("caller: request body fails midway".to_owned(), 1));
                    }
                    None => {}
                }
            }
            if i.sends.len() > 4 {
                out.push(("caller: many duplicates of one key at once".to_owned(), 1));
            }
            if let Some(kind) = kind {
                out.push((kind.to_owned(), 1));
            }
            let cancels = i.sends.iter().filter(|s| s.cancel_after.is_some()).count() as u64;
            if cancels > 0 {
                out.push(("caller: cancellation".to_owned(), cancels));
            }
        }
        out
    }

    /// The violations, the command that reruns the seed, its schedule and the trace of events
    /// for the keys involved.
    pub fn explain(&self) -> String {
        let mut s = String::new();
        let seed = self.run.schedule.seed;
        for v in &self.verdict.violations {
            let _ = writeln!(s, "{v}");
        }
        let _ = writeln!(s, "rerun: cargo run --release -p sim -- --seed {seed}");
        if !self.verdict.exceptions.is_empty() {
            let _ = writeln!(
                s,
                "allowed second executions: {:?}",
                self.verdict.exceptions
            );
        }
        let _ = write!(s, "{}", self.run.schedule);
        let keys: Vec<String> = self
            .verdict
            .violations
            .iter()
            .filter_map(|v| v.scope.as_ref().map(|(t, k)| format!("{t}/{k}")))
            .collect();
        let _ = writeln!(s, "trace:");
        for (at, line) in &self.run.observed.trace {
            let involved = keys.is_empty()
                || keys.iter().any(|k| line.contains(k.as_str()))
                || line.starts_with("fault")
                || line.starts_with("panic")
                || line.starts_with("all calls");
            if involved {
                let _ = writeln!(s, "  {:>9.3}s {line}", at.as_secs_f64());
            }
        }
        s
    }
}

//! The promises, checked after every seed. A new promise is one function here.
//!
//! 1. Every call ends within its bound with a classified answer: the layer answers by the
//!    call's deadline (with none, by [`NO_DEADLINE_BOUND`], what the documented defaults add up
//!    to), and a body that started ends.
//! 2. Per tenant + method + key, the side effect runs once, but for the documented exceptions,
//!    each recorded by cause.
//! 3. Every replay equals what an execution answered; every message is well formed (a
//!    `content-length` matches the body that came).
//! 4. No panic but the handlers' own escapes; every server still serves a fresh write at the
//!    end.
//! 5. The memory bounds hold: the bytes a server's waiters hold, the response bytes it holds
//!    for clients, the request bytes a client keeps for replay and the store's bytes, each read
//!    after every step of the simulation, never pass their bound (drawn small per seed, or the
//!    default).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::app::HANDLER_PANIC;
use crate::ledger::{Ending, Execution, Memory, ScopeName};
use idempotency_layer::conformance::{Fault as StoreFault, Op};
use idempotency_layer::MemoryStore;

use crate::schedule::{Fault, Protocol, Schedule};
use crate::world::{Run, TICK};

/// With no deadline, the documented bound of a call with the default policy: three attempts,
/// each waiting at most `response_head_timeout` (60 s) for the service to become ready and as
/// long again for its response head, plus two waits between attempts of at most
/// `max_pushback` (30 s), and slack.
pub const NO_DEADLINE_BOUND: Duration = Duration::from_secs(3 * (60 + 60) + 2 * 30 + 5);

/// The bound within which the layer must answer a call of `schedule`.
pub fn call_bound(schedule: &Schedule) -> Duration {
    match schedule.settings.deadline {
        // The deadline, to the tick that notices it.
        Some(d) => d + 2 * TICK,
        None => NO_DEADLINE_BOUND,
    }
}

/// A broken promise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which promise (1 to 5).
    pub promise: u8,
    /// What broke, in a few words: the summary groups by it.
    pub cause: &'static str,
    /// The scope involved, if one is.
    pub scope: Option<ScopeName>,
    /// The details.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "promise {}: {}", self.promise, self.cause)?;
        if let Some((t, k)) = &self.scope {
            write!(f, " [{t}/{k}]")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// A second execution the docs allow, by cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Exception {
    /// The server that ran the first crashed after its side effect, before its record was
    /// stored: the claim's lease lapsed and a retry ran again (a store in another system than
    /// the side effect has this window; a transactional completion closes it).
    CrashBeforeRecord,
    /// `fail_open`: the store was down for a request that had not seen its key in flight.
    FailOpen,
    /// The store refused or delayed the leader's renewals for half a lease or more: its lease
    /// could lapse under it, and a duplicate then took the claim over (the layer renews every
    /// fourth of a lease and again shortly after a failure, so shorter outages never lapse it).
    RenewalsRefused,
}

/// The verdict on one seed.
#[derive(Debug, Default)]
pub struct Verdict {
    /// The broken promises.
    pub violations: Vec<Violation>,
    /// The allowed second executions, by cause.
    pub exceptions: BTreeMap<Exception, u64>,
}

/// Checks every promise on `run`.
pub fn check(run: &Run) -> Verdict {
    let mut v = Verdict::default();
    if let Some(e) = &run.sim_error {
        v.violations.push(Violation {
            promise: 1,
            cause: "the simulation did not end",
            scope: None,
            detail: e.clone(),
        });
    }
    calls_end(run, &mut v);
    runs_once(run, &mut v);
    replays_equal(run, &mut v);
    no_panic_and_still_serving(run, &mut v);
    memory_bounded(run, &mut v);
    v
}

/// The default of `IdempotencyLayer::max_waiting_bytes` and of `max_response_buffer_bytes`
/// (64 MiB each, as their docs say).
const DEFAULT_LAYER_BYTES: u64 = 64 << 20;

/// The bounds of one seed's holdings, by kind (what [`Memory`] reads).
pub fn memory_bounds(schedule: &Schedule) -> Memory {
    let b = schedule.settings.bounds;
    let or = |v: Option<usize>, default: u64| v.map_or(default, |v| v as u64);
    Memory {
        waiting_bytes: or(b.max_waiting_bytes, DEFAULT_LAYER_BYTES),
        // Over it by at most one frame per response: every response of the seed, whole.
        response_buffer_bytes: DEFAULT_LAYER_BYTES
            + schedule
                .intents
                .iter()
                .map(|i| i.response_len as u64)
                .sum::<u64>(),
        replay_bytes: or(
            b.max_replay_bytes_total,
            retry_layer::DEFAULT_MAX_REPLAY_BYTES_TOTAL as u64,
        ),
        store_bytes: MemoryStore::DEFAULT_MAX_BYTES as u64,
    }
}

fn memory_bounded(run: &Run, v: &mut Verdict) {
    let peak = run.observed.peaks;
    let bound = memory_bounds(&run.schedule);
    let kinds = [
        (
            "a server's waiters held more bytes than max_waiting_bytes",
            peak.waiting_bytes,
            bound.waiting_bytes,
        ),
        (
            "a server held more response bytes than max_response_buffer_bytes",
            peak.response_buffer_bytes,
            bound.response_buffer_bytes,
        ),
        (
            "a client kept more bytes for replay than max_replay_bytes_total",
            peak.replay_bytes,
            bound.replay_bytes,
        ),
        (
            "the store held more bytes than its max_bytes",
            peak.store_bytes,
            bound.store_bytes,
        ),
    ];
    for (cause, peak, bound) in kinds {
        if peak > bound {
            v.violations.push(Violation {
                promise: 5,
                cause,
                scope: None,
                detail: format!("peak {peak} bytes, bound {bound}"),
            });
        }
    }
}

fn calls_end(run: &Run, v: &mut Verdict) {
    let bound = call_bound(&run.schedule);
    for c in &run.observed.calls {
        let scope = Some(c.scope.clone());
        match (&c.head, &c.end) {
            (_, Some((_, Ending::Cancelled | Ending::Crashed))) => {}
            // A gRPC call's answer is its message and trailers: with no deadline, nothing on
            // the client bounds reading them (as for an HTTP body), so a connection the network
            // cut after the head leaves it waiting, as it would on a real connection that died
            // silently.
            (None, _)
                if run.schedule.settings.protocol == Protocol::Grpc
                    && run.schedule.settings.deadline.is_none()
                    && network_cut(&run.schedule, c.client, c.start) => {}
            (None, _) => v.violations.push(Violation {
                promise: 1,
                cause: "a call never got an answer",
                scope,
                detail: format!(
                    "client {} started at {:?}, bound {bound:?}",
                    c.client, c.start
                ),
            }),
            (Some(head), end) => {
                if *head - c.start > bound {
                    v.violations.push(Violation {
                        promise: 1,
                        cause: "an answer came after the call's bound",
                        scope: scope.clone(),
                        detail: format!(
                            "client {} started at {:?}, answered after {:?}, bound {bound:?}",
                            c.client,
                            c.start,
                            *head - c.start
                        ),
                    });
                }
                if end.is_none() && !network_cut(&run.schedule, c.client, *head) {
                    v.violations.push(Violation {
                        promise: 1,
                        cause: "a response body never ended",
                        scope,
                        detail: format!(
                            "client {} started at {:?}, head at {head:?}",
                            c.client, c.start
                        ),
                    });
                }
            }
        }
    }
}

/// Whether a partition, a held link, a server crash or a per-message fail rate touched
/// `client`'s links after `from`.
/// turmoil's TCP does not retransmit: a segment lost there is lost for good, and a body read
/// over that connection waits as it would on a real connection that died silently. The client
/// layer does not bound an HTTP body (long streams stay alive), so such a read is not the
/// layer's hang.
fn network_cut(schedule: &Schedule, client: usize, from: Duration) -> bool {
    schedule.settings.fail_rate > 0.0
        || schedule.faults.iter().any(|t| {
            let touches = match t.fault {
                Fault::Partition { client: c, .. } | Fault::Hold { client: c, .. } => c == client,
                Fault::Crash { .. } => true,
                _ => false,
            };
            touches && t.heal.is_none_or(|heal| heal >= from)
        })
}

/// Whether the store refused (or delayed past use) renewals for half a lease or more, in a
/// window that overlaps `from..to`.
fn renewals_refused(schedule: &Schedule, from: Duration, to: Duration) -> bool {
    let lease = schedule.settings.lease.unwrap_or(DEFAULT_LEASE);
    schedule.faults.iter().any(|t| {
        let Fault::Store { op, fault } = t.fault else {
            return false;
        };
        let renewals = matches!(op, None | Some(Op::RenewMany));
        let refuses = match fault {
            StoreFault::Delay(d) => d >= lease / 8,
            StoreFault::Fail | StoreFault::Hang | StoreFault::LoseReply => true,
            _ => false,
        };
        let end = t.heal.unwrap_or(Duration::MAX);
        renewals && refuses && end.saturating_sub(t.at) >= lease / 2 && t.at <= to && end >= from
    })
}

/// The layer's default lease.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

fn unprotected(run: &Run, e: &Execution) -> (bool, bool) {
    match e.attempt {
        Some(a) => {
            let seen = run.tags.seen(a);
            (seen.failed && !seen.claimed, seen.in_flight)
        }
        None => (false, false),
    }
}

fn runs_once(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    // Downstream writes: one per upstream write, whatever ran the upstream handler again (the
    // derived key is the same on every run).
    let mut per_parent: BTreeMap<&str, usize> = BTreeMap::new();
    for ((tenant, _), execs) in &o.executions {
        if let Some(parent) = tenant.strip_prefix("down:") {
            *per_parent.entry(parent).or_default() += execs.len();
        }
    }
    for (parent, n) in per_parent {
        if n > 1 {
            v.violations.push(Violation {
                promise: 2,
                cause: "a downstream write ran twice for one upstream write",
                scope: parent
                    .split_once('/')
                    .map(|(t, k)| (t.to_owned(), k.to_owned())),
                detail: format!("{n} downstream executions"),
            });
        }
    }
    for (scope, execs) in &o.executions {
        if scope.0.starts_with("down:") {
            continue;
        }
        for (k, later) in execs.iter().enumerate().skip(1) {
            let earlier = &execs[..k];
            let crash = earlier.iter().any(|e| {
                o.crashes
                    .get(&e.server)
                    .is_some_and(|ts| ts.iter().any(|t| *t >= e.at && *t <= later.at))
            });
            // Either claim may have lapsed: the window spans both, from the first start.
            let renewals_refused = earlier.iter().any(|e| {
                renewals_refused(
                    &run.schedule,
                    e.started.min(later.started),
                    later.at.max(e.at),
                )
            });
            let (later_unprotected, later_saw_in_flight) = unprotected(run, later);
            let earlier_unprotected = earlier.iter().any(|e| unprotected(run, e).0);
            let fail_open = run.schedule.settings.fail_open
                && ((later_unprotected && !later_saw_in_flight) || earlier_unprotected);
            if later_unprotected && later_saw_in_flight {
                v.violations.push(Violation {
                    promise: 2,
                    cause: "a request that had seen its key in flight ran unprotected",
                    scope: Some(scope.clone()),
                    detail: format!("execution {} of {}", k + 1, execs.len()),
                });
            } else if crash {
                *v.exceptions
                    .entry(Exception::CrashBeforeRecord)
                    .or_default() += 1;
            } else if renewals_refused {
                *v.exceptions.entry(Exception::RenewalsRefused).or_default() += 1;
            } else if fail_open {
                *v.exceptions.entry(Exception::FailOpen).or_default() += 1;
            } else {
                v.violations.push(Violation {
                    promise: 2,
                    cause: "a write ran twice",
                    scope: Some(scope.clone()),
                    detail: format!(
                        "execution {} of {} at {:?} on server {}, the first at {:?} on server {}",
                        k + 1,
                        execs.len(),
                        later.at,
                        later.server,
                        execs[0].at,
                        execs[0].server
                    ),
                });
            }
        }
    }
}

fn replays_equal(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    for c in &o.calls {
        let Some((
            _,
            Ending::Response {
                status,
                replayed,
                body_omitted,
                body,
                body_error,
                content_length,
                ..
            },
        )) = &c.end
        else {
            continue;
        };
        let scope = Some(c.scope.clone());
        if let (Some(n), None) = (content_length, body_error) {
            if *n != body.len() as u64 {
                v.violations.push(Violation {
                    promise: 3,
                    cause: "a message's content-length does not match its body",
                    scope: scope.clone(),
                    detail: format!(
                        "status {status}, content-length {n}, {} bytes came",
                        body.len()
                    ),
                });
            }
        }
        if c.scope.0 == "-" {
            // A malformed write: refused before anything is claimed, never executed.
            let refused = matches!(*status, 400 | 401);
            let unavailable = matches!(*status, 502 | 503);
            if !refused && !unavailable {
                v.violations.push(Violation {
                    promise: 3,
                    cause: "a malformed write was not refused",
                    scope: scope.clone(),
                    detail: format!("status {status}"),
                });
            }
            continue;
        }
        if !(200..300).contains(status) {
            continue;
        }
        let execs = o.executions.get(&c.scope).map(Vec::as_slice).unwrap_or(&[]);
        let matches = |e: &Execution| {
            *status == e.status
                && if *replayed {
                    if *body_omitted {
                        body.is_empty()
                    } else {
                        *body == e.body
                    }
                } else if body_error.is_some() {
                    e.body.starts_with(body)
                } else {
                    *body == e.body
                }
        };
        if !execs.iter().any(matches) {
            v.violations.push(Violation {
                promise: 3,
                cause: if *replayed {
                    "a replay differs from every execution's answer"
                } else {
                    "an answer differs from every execution's answer"
                },
                scope,
                detail: format!(
                    "status {status}, {} bytes{}, {} execution(s)",
                    body.len(),
                    if *body_omitted { " (body omitted)" } else { "" },
                    execs.len()
                ),
            });
        }
    }
}

fn no_panic_and_still_serving(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    for p in &o.panics {
        if p.message != HANDLER_PANIC {
            v.violations.push(Violation {
                promise: 4,
                cause: "a panic other than the handler's",
                scope: None,
                detail: format!("at {}: {}", p.location, p.message),
            });
        }
    }
    if run.sim_error.is_none() {
        for server in 0..run.schedule.settings.servers {
            match o.probes.iter().find(|(s, _)| *s == server) {
                Some((_, Ok(status))) if (200..300).contains(status) => {}
                other => v.violations.push(Violation {
                    promise: 4,
                    cause: "a server no longer serves a fresh write",
                    scope: None,
                    detail: format!("server {server}: {other:?}"),
                }),
            }
        }
    }
}

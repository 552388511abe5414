//! The promises, checked after every seed. A new promise is one function here.
//!
//! 1. Every call ends within its bound with a classified answer: the layer answers by the
//!    call's deadline (a per-request `Deadline` too; with none, by [`NO_DEADLINE_BOUND`], what
//!    the documented defaults add up to), never with `DeadlineExceeded` while the deadline
//!    leaves an attempt, and a body that started ends.
//! 2. Per tenant + method + key, the side effect runs once, but for the documented exceptions,
//!    each granted only from a fact the store host recorded (the earlier run's claim was taken
//!    over after its holder crashed before its record landed, after the store refused its
//!    renewals, after `max_claim_lifetime`, or after the store lied; its record expired; a
//!    fail-open run whose call never saw the key in flight and had no leader beside it).
//! 3. Every replay equals the record the store holds for its scope; every fresh answer equals
//!    an execution's; every message is well formed (a `content-length` matches the body that
//!    came); every handler received a body its client sent.
//! 4. No panic but the handlers' own escapes; every server still serves a fresh write at the
//!    end; a client's stack is never discarded (a `Buffer` in front of the layer serves every
//!    call after any stall: tower's contract, a slow service is never a readiness error); a
//!    call never waits for a connection its own unread answer holds (on one HTTP/1.1
//!    connection, nothing of a failed attempt is held while the call waits to send the next).
//! 5. The memory bounds hold: the bytes a server's waiters hold, the response bytes it holds
//!    for clients, the request bytes a client keeps for replay and the store's bytes, each read
//!    after every step of the simulation, never pass their bound (drawn small per seed, or the
//!    default), and every request byte a client's layers keep for a retry is one they count
//!    (the bytes of its body frames, alive while the call is in the layers with no attempt's
//!    body in the transport, never pass what the layers' replay memory says: see
//!    [`crate::held`]); the clients' retry budgets spend tokens only on attempts that were sent; and
//!    retries happen at one tier (under an inbound retry, a handler's downstream write, hedged
//!    or not, is sent once; an attempt sent after one of its call reached a server says it is
//!    a retry; a failed downstream write tells its hop how it ended).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::app::HANDLER_PANIC;
use crate::client::PROBE;
use crate::ledger::{BudgetOf, Ending, Execution, Memory, ScopeName};
use crate::store_host::Claim;
use crate::store_host::Landed;
use idempotency_layer::conformance::Op;
use idempotency_layer::store::ScopeKey;
use idempotency_layer::MemoryStore;

use crate::schedule::{Fault, Protocol, Schedule};
use crate::world::{Run, TICK};

/// With no deadline, the documented bound of a call with the default policy: three attempts,
/// each waiting at most `response_head_timeout` (60 s) for the service to become ready and as
/// long again for its response head, plus two waits between attempts of at most
/// `max_pushback` (30 s), and slack.
pub const NO_DEADLINE_BOUND: Duration = Duration::from_secs(3 * (60 + 60) + 2 * 30 + 5);

/// The layer's default `max_claim_lifetime` (five minutes, as its docs say).
pub const DEFAULT_MAX_CLAIM_LIFETIME: Duration = Duration::from_secs(5 * 60);

/// The bound within which the layer must answer a call of `schedule`.
pub fn call_bound(schedule: &Schedule) -> Duration {
    match schedule.settings.deadline {
        // Hedging alone has no deadline of its own: the policy's `total_timeout` is the retry
        // layer's; the hedge answers on its own bounds.
        Some(_)
            if schedule.settings.hedging
                && schedule.settings.hedging_alone
                && schedule.settings.protocol != Protocol::Grpc =>
        {
            NO_DEADLINE_BOUND
        }
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
    /// The store refused the leader's renewals up to the lapse (it recorded a fault on a
    /// renewal of that claim in the second half of its last lease), and a duplicate took the
    /// claim over.
    RenewalsRefused,
    /// The store acknowledged work it never did for the claim (an injected `Ack`).
    StoreLied,
    /// The claim passed its server's `max_claim_lifetime` and lapsed (documented).
    MaxClaimLifetime,
    /// The record landed, then the store no longer held it (it expired with its `ttl`, or a
    /// full store evicted it past its `min_retention`), and the store granted a new claim.
    RecordExpired,
    /// The earlier run's gRPC response broke off (its body failed or panicked) before its
    /// status, and the store recorded its claim's release: its answer was a failure the table
    /// does not record (the status of a gRPC response is in its trailers), so a retry runs it
    /// again, as for any handler that fails after its side effect.
    AnswerBrokeBeforeItsStatus,
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
    no_early_deadline(run, &mut v);
    runs_once(run, &mut v);
    quiescent(run, &mut v);
    replays_equal(run, &mut v);
    no_panic_and_still_serving(run, &mut v);
    memory_bounded(run, &mut v);
    budget_spent_on_attempts_sent(run, &mut v);
    retries_at_one_tier(run, &mut v);
    retries_say_so(run, &mut v);
    hops_told(run, &mut v);
    v
}

/// The default of `IdempotencyLayer::max_waiting_bytes` and of `max_response_buffer_bytes`
/// (64 MiB each, as their docs say).
const DEFAULT_LAYER_BYTES: u64 = 64 << 20;

/// The bounds of one seed's holdings, by kind (what [`Memory`] reads), in a run of
/// `executions` executions.
pub fn memory_bounds(schedule: &Schedule, executions: usize) -> Memory {
    let b = schedule.settings.bounds;
    let or = |v: Option<usize>, default: u64| v.map_or(default, |v| v as u64);
    Memory {
        waiting_bytes: or(b.max_waiting_bytes, DEFAULT_LAYER_BYTES),
        // Over it by at most one frame per response: every response of the seed, whole.
        response_buffer_bytes: match b.max_response_buffer_bytes {
            // Drawn small: over it by at most one frame of each response held (a frame is
            // charged as it is read), each execution's at most.
            Some(max) => max as u64 + (crate::app::BIG_FRAME * executions) as u64,
            None => {
                DEFAULT_LAYER_BYTES
                    + schedule
                        .intents
                        .iter()
                        .map(|i| i.response_len as u64)
                        .sum::<u64>()
            }
        },
        replay_bytes: or(
            b.max_replay_bytes_total,
            retry_layer::RetryPolicy::DEFAULT_MAX_REPLAY_BYTES_TOTAL as u64,
        ),
        // A record the store has no room for is kept without its body, charged whatever the
        // bound (it must be kept): over it by at most the heads of the records of the claims in
        // flight then, a kilobyte each here.
        store_bytes: b
            .store
            .map_or(MemoryStore::DEFAULT_MAX_BYTES as u64, |(max, _)| {
                max as u64 + 1024 * schedule.intents.len() as u64
            }),
    }
}

fn memory_bounded(run: &Run, v: &mut Verdict) {
    let peak = run.observed.peaks;
    let executions = run.observed.executions.values().map(Vec::len).sum();
    let bound = memory_bounds(&run.schedule, executions);
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
    // Every byte a client's layers keep for a retry is counted in their replay memory: the
    // frames of calls inside the layers, sent once and held by no transport, are kept alive by
    // the layers alone (see `crate::held`).
    if let Some(u) = &run.observed.uncounted_replay {
        let calls: Vec<String> = u
            .calls
            .iter()
            .map(|(call, n)| format!("call {call}: {n} B"))
            .collect();
        v.violations.push(Violation {
            promise: 5,
            cause: "a client's layers kept request bytes for a retry that their replay memory did not count",
            scope: None,
            detail: format!(
                "at {:?}, client {}: {} B kept ({}), {} B counted",
                u.at,
                u.client,
                u.held,
                calls.join(", "),
                u.counted
            ),
        });
    }
}

/// The clients' retry budgets spend tokens only on attempts that were sent: a retry layer's
/// tokens held at the end (granted, less given back) are at most the requests it handed on
/// beyond each call's first (as the service under it saw them; for a gRPC client, whose layer
/// calls the channel itself, the attempts its router saw), a hedge layer's at most the attempts
/// that reached the wire beyond each request's first. A retry a deferring hop below asked for
/// takes none.
fn budget_spent_on_attempts_sent(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    let beyond_first =
        |counts: &mut dyn Iterator<Item = i64>| -> i64 { counts.map(|n| (n - 1).max(0)).sum() };
    let mut wire: BTreeMap<usize, i64> = BTreeMap::new();
    for call in o.attempt_calls.values() {
        *wire.entry(*call).or_default() += 1;
    }
    let handed_on = if o.handoffs.is_empty() {
        beyond_first(&mut wire.values().copied())
    } else {
        beyond_first(&mut o.handoffs.values().copied())
    };
    let hedged = beyond_first(&mut o.handoff_attempts.values().copied());
    for (layer, sent) in [(BudgetOf::Retry, handed_on), (BudgetOf::Hedge, hedged)] {
        let held = o.budget_tokens.get(&layer).copied().unwrap_or(0);
        if held > sent {
            v.violations.push(Violation {
                promise: 5,
                cause: "a retry budget kept tokens for attempts never sent",
                scope: None,
                detail: format!(
                    "{layer:?}: {held} tokens held at the end, {sent} attempts sent beyond \
                     each request's first"
                ),
            });
        }
    }
}

/// Retries at one tier: a handler run for an attempt that arrived as a retry (an earlier
/// attempt of its call had reached a server) sends its downstream write once (`HopLayer`'s
/// default, `InboundRetry::SendOnce`), hedged or not: the downstream tier receives it at most
/// once. (An attempt whose earlier ones were all lost on the way is not judged: its client may
/// rightly have sent it as a first.)
fn retries_at_one_tier(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    for (&upstream, &received) in &o.down_received {
        if received < 2 {
            continue;
        }
        let Some(&call) = o.attempt_calls.get(&upstream) else {
            continue;
        };
        let earlier_arrived = o
            .attempt_calls
            .range(..upstream)
            .any(|(tag, c)| *c == call && o.arrived.contains_key(tag));
        if earlier_arrived {
            v.violations.push(Violation {
                promise: 5,
                cause: "a tier below retried under an inbound retry",
                scope: o.calls.get(call).map(|c| c.scope.clone()),
                detail: format!(
                    "attempt {upstream} of call {call} arrived as a retry; its handler's \
                     downstream write reached the downstream tier {received} times"
                ),
            });
        }
    }
}

/// A handler whose downstream write failed in a way its client could have tried again (a
/// transport error, a timeout, a status the table retries; not a final answer) told its hop how
/// it ended (retried below, or do not retry), whether a retry layer, a hedge under it or a hedge
/// alone made the write: the hop's answer tells the tier above not to multiply the retries
/// already made.
fn hops_told(run: &Run, v: &mut Verdict) {
    for (scope, attempt) in &run.observed.hops_untold {
        v.violations.push(Violation {
            promise: 5,
            cause: "a failed downstream write did not tell its hop how it ended",
            scope: Some(scope.clone()),
            detail: format!("the handler run of attempt {attempt:?}"),
        });
    }
}

/// An attempt that arrived after another of its call had reached a server says it is a retry
/// (its previous-attempts header above zero): that header is what tells the hop serving it to
/// send its own downstream writes once. (It may count fewer attempts than reached the wire:
/// a retry layer counts its own attempts, not the hedges a hedge layer sent under it.)
fn retries_say_so(run: &Run, v: &mut Verdict) {
    let o = &run.observed;
    let mut arrived_before: BTreeMap<usize, u64> = BTreeMap::new();
    for (&tag, &previous) in &o.arrived {
        let Some(&call) = o.attempt_calls.get(&tag) else {
            continue;
        };
        if let Some(&first) = arrived_before.get(&call) {
            if previous == 0 {
                v.violations.push(Violation {
                    promise: 5,
                    cause: "a retry arrived saying it was a first attempt",
                    scope: o.calls.get(call).map(|c| c.scope.clone()),
                    detail: format!(
                        "attempt {tag} of call {call} said no attempt came before it; attempt \
                         {first} of the same call had reached a server"
                    ),
                });
            }
        } else {
            arrived_before.insert(call, tag);
        }
    }
}

fn calls_end(run: &Run, v: &mut Verdict) {
    let bound = call_bound(&run.schedule);
    for c in run.observed.calls.iter().filter(|c| c.client != PROBE) {
        let scope = Some(c.scope.clone());
        // The layer's bound runs from when the call took its service (a call of a client that
        // shares one waits for it first, outside the layer); a per-request `Deadline` from the
        // call's start, whatever the call waits for in the layer (its readiness too).
        let answer_by = [
            Some(c.took_service.unwrap_or(c.start) + bound),
            run.schedule
                .settings
                .call_deadline
                .map(|d| c.start + d + 2 * TICK),
        ]
        .into_iter()
        .flatten()
        .min()
        .expect("the layer's bound");
        match (&c.head, &c.end) {
            (_, Some((_, Ending::Cancelled | Ending::Crashed))) => {}
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
                if *head > answer_by {
                    v.violations.push(Violation {
                        promise: 1,
                        cause: "an answer came after the call's bound",
                        scope: scope.clone(),
                        detail: format!(
                            "client {} started at {:?}, answered after {:?}, to answer by \
                             {answer_by:?}",
                            c.client,
                            c.start,
                            *head - c.start
                        ),
                    });
                }
                // A gRPC call's status is in its trailers: with a deadline (`grpc-timeout`),
                // the whole answer, message and trailers, comes by it, not just the head. With
                // none, reading them is bounded by nothing on the client, as an HTTP body is
                // (the rule below: seed 4201855, a server crashed mid-message).
                let grpc_deadline = run.schedule.settings.protocol == Protocol::Grpc
                    && run.schedule.settings.deadline.is_some();
                let ended = end.as_ref().map(|(at, _)| *at);
                if grpc_deadline && ended.is_none_or(|ended| ended > answer_by) {
                    v.violations.push(Violation {
                        promise: 1,
                        cause: "a gRPC answer's message and trailers came after its deadline",
                        scope: scope.clone(),
                        detail: format!(
                            "client {} started at {:?}, ended at {ended:?}, to end by \
                             {answer_by:?}",
                            c.client, c.start
                        ),
                    });
                    continue;
                }
                // From the start of the run, not of the head: the client pools its connections,
                // and a segment a partition lost before the head (an HTTP/2 WINDOW_UPDATE, say)
                // leaves a connection that carried the head unable to carry a body past its
                // flow-control window (seeds 2007431, 2008327: responses over 128 KiB).
                if end.is_none() && !network_cut(&run.schedule, c.client, Duration::ZERO) {
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

/// The policy's `min_attempt_time` (the simulator's policy keeps the default): with less of
/// its deadline left, a call sends nothing more and answers `DeadlineExceeded`.
const MIN_ATTEMPT_TIME: Duration = Duration::from_millis(50);

/// The layers answer `DeadlineExceeded` only once the call's deadline leaves no attempt (less
/// than `min_attempt_time` of it): the policy's `total_timeout` counted from when the call took
/// its service (a shared service's `ready()` is part of the call), a per-request `Deadline` from
/// the call's start. Never from a wait an earlier call abandoned.
fn no_early_deadline(run: &Run, v: &mut Verdict) {
    let settings = &run.schedule.settings;
    for c in run.observed.calls.iter().filter(|c| c.client != PROBE) {
        let (Some(took), Some(head), Some((_, Ending::Error(e)))) =
            (c.took_service, c.head, &c.end)
        else {
            continue;
        };
        if !e.contains("deadline passed") {
            continue;
        }
        // Hedging alone has no `total_timeout` (the policy's is the retry layer's).
        let hedging_alone = settings.hedging && settings.hedging_alone;
        let deadline = [
            settings
                .deadline
                .filter(|_| !hedging_alone)
                .map(|d| took + d),
            settings.call_deadline.map(|d| c.start + d),
        ]
        .into_iter()
        .flatten()
        .min();
        if deadline.is_some_and(|deadline| head + MIN_ATTEMPT_TIME + TICK < deadline) {
            v.violations.push(Violation {
                promise: 1,
                cause: "the layer answered DeadlineExceeded before the call's deadline",
                scope: Some(c.scope.clone()),
                detail: format!(
                    "client {} started at {:?}, took its service at {took:?}, answered at {head:?}, \
                     deadline {deadline:?}: {e}",
                    c.client, c.start
                ),
            });
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
                Fault::Partition { client: c, .. }
                | Fault::Hold { client: c, .. }
                | Fault::OneWay { client: c, .. } => c == client,
                Fault::Crash { .. } => true,
                _ => false,
            };
            touches && t.heal.is_none_or(|heal| heal >= from)
        })
}

/// The layer's default lease.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Why the store let a claim be taken over, from what it recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lapse {
    /// Its holder's server crashed (or was killed after its drain) while it held the claim.
    HolderCrashed,
    /// The store refused or faulted its renewals up to the lapse.
    RenewalsRefused,
    /// The store acknowledged a renewal, a record or a release it never did.
    StoreLied,
    /// The claim passed its server's `max_claim_lifetime`.
    MaxClaimLifetime,
    /// No renewal of it reached the store for a whole lease, though the store was healthy for
    /// them: a layer bug, never an exception.
    NotRenewed,
}

/// Why `claim`, taken over at `at`, lapsed.
pub fn lapse_cause(run: &Run, claim: &Claim, at: Duration) -> Lapse {
    let crashed = run
        .observed
        .crashes
        .get(&claim.server)
        .is_some_and(|ts| ts.iter().any(|t| *t >= claim.begun && *t <= at));
    if crashed {
        return Lapse::HolderCrashed;
    }
    if at >= claim.begun + lifetime_of(run, claim.server) {
        return Lapse::MaxClaimLifetime;
    }
    if claim.acked.iter().any(|(t, _)| *t <= at) {
        return Lapse::StoreLied;
    }
    let (touched, lease) = claim
        .touched
        .iter()
        .rev()
        .find(|(t, _)| *t <= at)
        .copied()
        .unwrap_or((claim.begun, DEFAULT_LEASE));
    // The store kept refusing: a fault hit its renewals in the second half of its last lease.
    let refused = claim
        .renewal_faults
        .iter()
        .any(|(t, _)| *t >= touched + lease / 2 && *t <= at);
    if refused {
        return Lapse::RenewalsRefused;
    }
    Lapse::NotRenewed
}

/// Server `server`'s `max_claim_lifetime`.
fn lifetime_of(run: &Run, server: usize) -> Duration {
    run.schedule
        .settings
        .per_server
        .get(server)
        .and_then(|s| s.max_claim_lifetime)
        .unwrap_or(DEFAULT_MAX_CLAIM_LIFETIME)
}

/// The claim an execution ran under: the last its attempt's `begin` was granted before it.
fn claim_of<'a>(run: &'a Run, scope: ScopeKey, e: &Execution) -> Option<&'a Claim> {
    let attempt = e.attempt?;
    run.facts
        .claims
        .iter()
        .rev()
        // The claim is begun on the store host's clock and the run started on the server's: the
        // two read the simulation's time up to a step apart.
        .find(|c| c.scope == scope && c.attempt == Some(attempt) && c.begun <= e.started + TICK)
}

/// Whether `attempt` ran unprotected (its `begin` failed, it claimed nothing), and whether its
/// call knew the key was in flight: the attempt itself saw it at the store, or its client had
/// been told so (an answer of its call's) before it sent it. Judged per call: an attempt sent
/// before any answer told the client (a hedge racing the first) did not know.
fn unprotected(run: &Run, attempt: Option<u64>) -> (bool, bool) {
    let Some(a) = attempt else {
        return (false, false);
    };
    let seen = run.tags.seen(a);
    let knew = run.observed.attempts_sent_knowing.contains(&a);
    (seen.failed && !seen.claimed, seen.in_flight || knew)
}

/// Whether a later execution after `earlier` is allowed, and by which exception.
fn second_run(
    run: &Run,
    key: ScopeKey,
    earlier: &Execution,
    later: &Execution,
) -> Result<Exception, (&'static str, String)> {
    let fail_open = run.schedule.settings.fail_open;
    if fail_open && unprotected(run, earlier.attempt).0 {
        return Ok(Exception::FailOpen);
    }
    let Some(claim) = claim_of(run, key, earlier) else {
        return Err((
            "a write ran twice",
            format!(
                "the store recorded no claim for the earlier run (attempt {:?})",
                earlier.attempt
            ),
        ));
    };
    // The pair's executions are in the order their side effects happened: the one that
    // committed later may have started first and lost its claim first (a handler slower than
    // its claim's lifetime). Whichever claim was taken over is the one whose lapse is judged.
    let later_claim = claim_of(run, key, later);
    let claim = match later_claim {
        Some(c)
            if claim.taken_over.is_none() && c.taken_over.is_some() && c.begun < claim.begun =>
        {
            c
        }
        _ => claim,
    };
    // The earlier run's answer was a failure the table does not record (a gRPC response that
    // broke off before its status): whether its claim was then released, or lapsed (its release
    // refused for want of detached room), a retry runs it again, as the table says.
    if earlier.broke_before_status && claim.recorded.is_none() {
        return Ok(Exception::AnswerBrokeBeforeItsStatus);
    }
    if let Some((at, by)) = claim.taken_over {
        return match lapse_cause(run, claim, at) {
            Lapse::HolderCrashed if claim.recorded.is_none() => Ok(Exception::CrashBeforeRecord),
            Lapse::RenewalsRefused => Ok(Exception::RenewalsRefused),
            Lapse::StoreLied => Ok(Exception::StoreLied),
            Lapse::MaxClaimLifetime => Ok(Exception::MaxClaimLifetime),
            cause => Err((
                "a live claim lapsed though its renewals reached a healthy store (no renewal for a lease)",
                format!(
                    "claim {:x} of server {} begun at {:?}, last set at {:?}, taken over at {at:?} by {by:x} ({cause:?})",
                    claim.token & 0xffff,
                    claim.server,
                    claim.begun,
                    claim.touched.last().map(|t| t.0),
                ),
            )),
        };
    }
    if let Some(recorded) = claim.recorded {
        let later_claim = claim_of(run, key, later);
        if later_claim.is_some_and(|c| c.after_record.is_some_and(|r| r >= recorded)) {
            return Ok(Exception::RecordExpired);
        }
    }
    // Released by the layer at the end of the claim's lifetime (a response still streaming).
    if claim
        .released
        .is_some_and(|at| at >= claim.begun + lifetime_of(run, claim.server))
    {
        return Ok(Exception::MaxClaimLifetime);
    }
    if let Some(released) = claim.released {
        return Err((
            "a claim was released after its write ran (no shared failure, no record)",
            format!("released at {released:?} on server {}", claim.server),
        ));
    }
    Err((
        "a write ran twice",
        format!(
            "the earlier run's claim (server {}) recorded at {:?}",
            claim.server, claim.recorded
        ),
    ))
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
    // The store lied to the downstream tier (an `Ack` of a record it never stored): a second
    // downstream run is then the store's doing, as an upstream one is.
    let downstream_lied = run
        .facts
        .claims
        .iter()
        .any(|c| c.server == crate::store_host::DOWNSTREAM && !c.acked.is_empty());
    // A downstream record the store no longer held (it expired, or a full store evicted it past
    // its retention) and a downstream scope claimed again: its second run is the store's bound.
    let downstream_record_gone = run
        .facts
        .claims
        .iter()
        .any(|c| c.server == crate::store_host::DOWNSTREAM && c.after_record.is_some());
    for (parent, n) in per_parent {
        if n > 1 && downstream_lied {
            *v.exceptions.entry(Exception::StoreLied).or_default() += n as u64 - 1;
        } else if n > 1 && downstream_record_gone {
            *v.exceptions.entry(Exception::RecordExpired).or_default() += n as u64 - 1;
        } else if n > 1 {
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
        let key = run.schedule.scope_key(&scope.0, &scope.1);
        for (k, later) in execs.iter().enumerate().skip(1) {
            let (later_unprotected, saw_in_flight) = unprotected(run, later.attempt);
            let outcome = if later_unprotected && saw_in_flight {
                Err((
                    "a request that had seen its key in flight ran unprotected",
                    format!("execution {} of {}", k + 1, execs.len()),
                ))
            } else if later_unprotected && run.schedule.settings.fail_open {
                // A claim the layer knew it held: not this attempt's own, not one whose
                // `begin` reply was lost.
                // A claim of the same process: its server did not restart (a crash, a drain's
                // restart) between the claim and this run, whose new boot knows nothing of it.
                let same_boot = |c: &Claim| {
                    let between = |ts: Option<&Vec<Duration>>| {
                        ts.is_some_and(|ts| ts.iter().any(|t| *t >= c.begun && *t <= later.started))
                    };
                    !between(o.crashes.get(&c.server)) && !between(o.restarts.get(&c.server))
                };
                // ... and that layer had the claim's `begin` answer when this run began (a reply
                // lost, held back, or handed to a caller that had gone tells it nothing).
                // Held, not let go: a claim whose release was sent (its write ended without a
                // record) is the layer's no more, whatever the store did with the release.
                // A run that ended without its side effect lets its claim go too (a release sent,
                // or refused for want of room: the claim then lapses with its lease).
                let ended_undone = |c: &Claim| {
                    c.attempt
                        .and_then(|a| o.runs_ended_undone.get(&a))
                        .is_some_and(|at| *at <= later.started)
                };
                // A claim whose record the store acknowledged without storing it (an injected
                // `Ack`) is the layer's no more either: it ended it as recorded.
                let acked_recorded = |c: &Claim| {
                    c.acked
                        .iter()
                        .any(|(at, op)| *op == Op::Complete && *at <= later.started)
                };
                let known = |c: &Claim| {
                    c.attempt != later.attempt
                        && c.heard.is_some_and(|at| at <= later.started)
                        && c.let_go.is_none_or(|at| at > later.started)
                        && !ended_undone(c)
                        && !acked_recorded(c)
                        && same_boot(c)
                };
                let beside = run.facts.claims.iter().find(|c| {
                    c.scope == key
                        && c.server == later.server
                        && c.live_at(later.started)
                        && known(c)
                });
                match beside {
                    Some(c) => Err((
                        "fail_open ran a write beside a leader of the same server holding its key",
                        format!(
                            "execution {} at {:?} on server {}, claim begun at {:?}",
                            k + 1,
                            later.started,
                            later.server,
                            c.begun
                        ),
                    )),
                    None => Ok(Exception::FailOpen),
                }
            } else {
                execs[..k]
                    .iter()
                    .map(|e| second_run(run, key, e, later))
                    .collect::<Result<Vec<_>, _>>()
                    .map(|causes| causes.last().copied().unwrap_or(Exception::FailOpen))
            };
            match outcome {
                Ok(e) => *v.exceptions.entry(e).or_default() += 1,
                Err((cause, detail)) => v.violations.push(Violation {
                    promise: 2,
                    cause,
                    scope: Some(scope.clone()),
                    detail: format!(
                        "execution {} of {} at {:?} on server {}, the first at {:?} on server {}: {detail}",
                        k + 1,
                        execs.len(),
                        later.at,
                        later.server,
                        execs[0].at,
                        execs[0].server
                    ),
                }),
            }
        }
    }
    let names: BTreeMap<ScopeKey, ScopeName> = run
        .schedule
        .intents
        .iter()
        .map(|i| {
            (
                run.schedule.scope_key(i.tenant, &i.key),
                (i.tenant.to_owned(), i.key.clone()),
            )
        })
        .collect();
    for (at, scope, token) in &run.facts.stale_completes {
        v.violations.push(Violation {
            promise: 2,
            cause: "the store acknowledged the complete of a claim it no longer held",
            scope: names.get(scope).cloned(),
            detail: format!("at {at:?}, token {:x}", token & 0xffff),
        });
    }
    for c in &run.facts.claims {
        // A drain lasts until the server's restart, or a crash before it (the next boot does
        // not drain).
        let crashes = o
            .crashes
            .get(&c.server)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let draining = o.drains.get(&c.server).is_some_and(|ds| {
            ds.iter().any(|(from, to)| {
                let crash = crashes.iter().copied().filter(|t| t >= from).min();
                let end = [*to, crash].into_iter().flatten().min();
                c.begun > *from && end.is_none_or(|end| c.begun < end)
            })
        });
        // A claim made while draining must be given up, never led: a handler run on it is one
        // the drain does not wait for.
        let ran = draining
            && names.get(&c.scope).is_some_and(|scope| {
                o.executions.get(scope).is_some_and(|execs| {
                    execs.iter().any(|e| {
                        e.server == c.server
                            && e.attempt == c.attempt
                            && e.started + TICK >= c.begun
                    })
                })
            });
        if ran {
            v.violations.push(Violation {
                promise: 2,
                cause: "a draining server ran a handler on a claim it took while draining",
                scope: names.get(&c.scope).cloned(),
                detail: format!("server {} at {:?}", c.server, c.begun),
            });
        }
    }
    for (scope, what) in &o.wrong_bodies {
        v.violations.push(Violation {
            promise: 3,
            cause: "a handler received a request body its client never sent",
            scope: Some(scope.clone()),
            detail: what.clone(),
        });
    }
}

/// Quiescence: every fault healed, each key was answered once more (checked with the other
/// answers), and nothing is left: no claim in the store, no claim, waiter or detached work in
/// any server's layer.
fn quiescent(run: &Run, v: &mut Verdict) {
    if run.sim_error.is_some() {
        return;
    }
    let o = &run.observed;
    for c in o.calls.iter().filter(|c| c.client == PROBE) {
        let answered = c.end.as_ref().is_some_and(|(_, e)| {
            let other = run.schedule.intents.iter().any(|i| {
                (i.tenant, i.key.as_str()) == (c.scope.0.as_str(), c.scope.1.as_str())
                    && i.sends.iter().any(|s| s.other_body)
            });
            crate::client::quiescent_answer(e, other)
        });
        if !answered {
            v.violations.push(Violation {
                promise: 1,
                cause: "quiescence: a key was not answered after every fault healed",
                scope: Some(c.scope.clone()),
                detail: format!("{:?}", c.end.as_ref().map(|e| &e.1)),
            });
        }
    }
    let names: BTreeMap<ScopeKey, ScopeName> = run
        .schedule
        .intents
        .iter()
        .map(|i| {
            (
                run.schedule.scope_key(i.tenant, &i.key),
                (i.tenant.to_owned(), i.key.clone()),
            )
        })
        .collect();
    for (key, name) in &names {
        let last = run.facts.claims.iter().rev().find(|c| c.scope == *key);
        if let Some(c) = last {
            // A claim not ended lapses with its lease once nothing renews it (an orphan of a lost
            // `begin` reply, a release the store never took or the layer had no room to send, a
            // crash): what must never happen is a claim renewed past its documented bound, its
            // lifetime (and the lease it was begun with, for a late `begin` reply).
            let bound = c.begun + lifetime_of(run, c.server) + c.touched[0].1;
            let renewed_past = c.touched.last().is_some_and(|(at, _)| *at > bound);
            let ended = c.recorded.is_some() || c.released.is_some() || c.taken_over.is_some();
            if !ended && renewed_past {
                v.violations.push(Violation {
                    promise: 5,
                    cause: "quiescence: a claim was renewed past its lifetime",
                    scope: Some(name.clone()),
                    detail: format!("server {} begun at {:?}", c.server, c.begun),
                });
            }
        }
    }
    // turmoil's TCP does not retransmit: a connection whose segment was lost (a fail rate, a
    // partition, a held link) may never tell its server that its client went away, and a handler
    // that never ends then runs for as long as that connection, attached (its claim lapses with
    // its lifetime; the store check above holds for it).
    let silent_cuts = (0..run.schedule.settings.clients)
        .any(|client| network_cut(&run.schedule, client, Duration::ZERO));
    for (server, stats) in &o.final_stats {
        let in_flight = stats.in_flight > 0 && !silent_cuts;
        if in_flight || stats.detached > 0 || stats.waiting_bytes > 0 {
            v.violations.push(Violation {
                promise: 5,
                cause: "quiescence: a server's layer still holds claims, waiters or detached work",
                scope: None,
                detail: format!(
                    "server {server}: in_flight {}, detached {}, waiting_bytes {}",
                    stats.in_flight, stats.detached, stats.waiting_bytes
                ),
            });
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
                execution,
                content_type,
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
        if *replayed {
            // A replay equals the record the store holds for its scope.
            let key = run.schedule.scope_key(&c.scope.0, &c.scope.1);
            let grpc = run.schedule.settings.protocol == Protocol::Grpc;
            let records: Vec<&Landed> = run
                .facts
                .records
                .iter()
                .filter(|r| r.scope == key)
                .collect();
            let matches = |r: &&Landed| {
                let stored: &[u8] = if grpc {
                    r.body.get(5..).unwrap_or_default()
                } else {
                    &r.body
                };
                // A store with no room for a record's body keeps it without (it says so in its
                // counts): the replay is then its status and headers.
                let trimmed = *body_omitted
                    && !r.body_omitted
                    && body.is_empty()
                    && run.store_stats.bodies_dropped > 0;
                (grpc || *status == r.status)
                    && *execution == r.execution
                    && (grpc || *content_type == r.content_type)
                    && (body_omitted == &r.body_omitted || trimmed)
                    && (trimmed
                        || body_error.is_some() && stored.starts_with(body)
                        || *body == stored)
            };
            if !records.iter().any(matches) {
                v.violations.push(Violation {
                    promise: 3,
                    cause: "a replay differs from the record the store holds",
                    scope,
                    detail: format!(
                        "status {status}, {} bytes{}, execution {execution:?}, content-type \
                         {content_type:?}, {} record(s) stored: {:?}",
                        body.len(),
                        if *body_omitted { " (body omitted)" } else { "" },
                        records.len(),
                        records
                            .iter()
                            .map(|r| (
                                r.status,
                                r.body.len(),
                                r.execution.as_deref(),
                                r.content_type.as_deref()
                            ))
                            .collect::<Vec<_>>()
                    ),
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
                && *execution == e.name
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
                    "status {status}, {} bytes{}, execution {execution:?}, {} execution(s): \
                     {:?}",
                    body.len(),
                    if *body_omitted { " (body omitted)" } else { "" },
                    execs.len(),
                    execs.iter().map(|e| e.name.as_deref()).collect::<Vec<_>>()
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
    for c in &o.calls {
        if let Some((_, Ending::Error(e))) = &c.end {
            if e.contains("buffered service failed") || e.contains("buffer's worker closed") {
                v.violations.push(Violation {
                    promise: 4,
                    cause: "a client's stack was discarded",
                    scope: Some(c.scope.clone()),
                    detail: format!("client {}, started at {:?}: {e}", c.client, c.start),
                });
            }
        }
    }
    for (call, at) in &o.waited_on_themselves {
        let c = &o.calls[*call];
        v.violations.push(Violation {
            promise: 4,
            cause: "a call waited for a connection its own unread answer held",
            scope: Some(c.scope.clone()),
            detail: format!(
                "client {}, call {call} started at {:?}, waited from {at:?}, ended {:?}",
                c.client,
                c.start,
                c.end.as_ref().map(|(t, e)| (t, e))
            ),
        });
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

//! The decision after an attempt: a pure function from the policy, the attempt and its outcome
//! to the next [`Step`]. No service, no request body and no timer are in scope, so every row of
//! the decision is table-tested (`decide/tests.rs`); the response future only carries the step
//! out.

use std::time::Duration;

use http::HeaderMap;
use reason_code::{Code, Outcome, Verdict};
use tokio::time::Instant;

use crate::budget::Budget;
use crate::classify::{self, PushbackHint};
use crate::retry::policy::{RetryCandidate, RetryPolicy, Rules};

/// What the decision knows of a call between attempts. The response future owns one and
/// updates it as it carries out each [`Step`].
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    /// Attempts sent so far, the one that just ended included.
    pub(crate) sent: u32,
    /// Transparent retries taken beyond `max_attempts` (for requests that were never sent).
    pub(crate) unsent_retries: u32,
    /// Computed backoff delays since the first attempt or the last server pushback: the next
    /// computed delay is the schedule's `backoff_step + 1`-th.
    pub(crate) backoff_step: u32,
    /// The last computed delay (decorrelated jitter grows from it).
    pub(crate) previous_delay: Duration,
    /// A safe method, a declared gRPC method, or a keyed request.
    pub(crate) idempotent: bool,
    /// The gRPC method config that applies (see `RetryPolicy::from_grpc_service_config`).
    pub(crate) method: Option<usize>,
    /// The call's deadline.
    pub(crate) deadline: Option<Instant>,
    /// The request being served is a retry of the hop above, and the policy says send once
    /// ([`InboundRetry::SendOnce`](crate::InboundRetry::SendOnce)): one attempt, plus the
    /// transparent retries of unsent ones.
    pub(crate) send_once: bool,
    /// The request carries [`NoRetry`](crate::NoRetry): one attempt, plus the transparent
    /// retries of unsent ones.
    pub(crate) opted_out: bool,
}

impl Attempt {
    /// The first attempt of a call.
    pub(crate) fn first(
        idempotent: bool,
        method: Option<usize>,
        deadline: Option<Instant>,
    ) -> Self {
        Attempt {
            sent: 1,
            unsent_retries: 0,
            backoff_step: 0,
            previous_delay: Duration::ZERO,
            idempotent,
            method,
            deadline,
            send_once: false,
            opted_out: false,
        }
    }
}

/// How an attempt ended, as the decision reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended<'a> {
    /// The classified outcome.
    pub(crate) outcome: Outcome,
    /// The response's headers (pushback, and a rebuild hook needs a response); `None` for a
    /// transport error or an attempt timeout.
    pub(crate) headers: Option<&'a HeaderMap>,
    /// The request as it was sent (what a `retry_if` predicate is shown); `None` when it was
    /// not kept (then no retry is possible: it is not replayable).
    pub(crate) request: Option<&'a http::request::Parts>,
}

/// The budgets a retry may draw on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budgets<'a> {
    /// The policy's budget (or the inbound-retry budget, for a call made under one).
    pub(crate) main: &'a dyn Budget,
    /// The adaptive budget of retries a hop below deferred to this one
    /// ([`RETRIES_DEFERRED`](reason_code::RETRIES_DEFERRED)).
    pub(crate) deferred: &'a dyn Budget,
}

/// What to do after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Return the attempt's result as it is.
    Return(ReturnReason),
    /// Send the request again after `delay`. The budget has granted the retry.
    Retry {
        delay: Duration,
        /// The delay is the server's pushback: the backoff restarts from its base (gRFC A6).
        pushed_back: bool,
        /// No attempt was left: this is one of the transparent retries of an unsent request.
        beyond_max_attempts: bool,
    },
    /// Ask the rebuild hook for the next request, and send it no sooner than `delay` after
    /// this outcome. The deadline and the budget are asked again once the hook answers.
    Rebuild {
        /// The server's pushback (zero without one: the hook re-reads the state first).
        delay: Duration,
        /// The server sent a pushback: the backoff restarts from its base.
        pushed_back: bool,
    },
}

/// Why an attempt's result is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReturnReason {
    /// The table says so: a success, a failure that is not retried for this request, or a
    /// conflict with no rebuild hook (or no response to show it).
    Final,
    /// The request's head or body could not be kept for another attempt.
    NotReplayable,
    /// No attempt (and no transparent retry) is left.
    Exhausted,
    /// The server's pushback says stop (a negative or malformed `grpc-retry-pushback-ms`).
    PushbackSaysNo,
    /// The server's pushback is longer than `max_pushback`.
    PushbackTooLong(Duration),
    /// The deadline leaves less than the delay plus `min_attempt_time`.
    DeadlineTooShort {
        /// The delay before the retry.
        delay: Duration,
        /// What was left of the deadline.
        left: Duration,
    },
    /// The call's deadline passed before it had an answer (during an attempt, or while it
    /// waited for the inner service or the rebuild hook). Never a step of [`decide`]: the
    /// response future ends the call with `DeadlineExceeded`, counted as a deadline stop.
    DeadlinePassed,
    /// The retry budget refused the retry.
    BudgetRefused,
    /// The request being served is itself a retry of the hop above: this call sends once.
    InboundRetry,
    /// The caller said no: its `retry_if` predicate declined, or the request carries
    /// [`NoRetry`](crate::NoRetry).
    Declined,
}

/// Decides what follows an attempt: the three checks (the outcome is retryable, an attempt is
/// left, the deadline fits the delay plus `min_attempt_time`), the caller's `retry_if` (after an
/// attempt left), the server's pushback, then the retry budget, in that order. An answer marked
/// `idempotent-replayed: true` is final.
///
/// It also keeps the budget's gRFC A6 accounting: a success adds to the budget; an attempt that
/// failed in a way the policy would retry takes from it (a conflict only when a hook could
/// retry it).
///
/// `now` and `replayable` are asked only when the outcome is retryable, so that a final answer
/// (the common success) reads neither the clock nor the body's lock.
pub(crate) fn decide(
    policy: &RetryPolicy,
    budgets: Budgets<'_>,
    attempt: &Attempt,
    ended: Ended<'_>,
    now: impl FnOnce() -> Instant,
    replayable: impl FnOnce() -> bool,
) -> Step {
    let rules = policy.rules(attempt.method);
    let outcome = ended.outcome;
    let mut verdict = rules.table.verdict(outcome, attempt.idempotent);
    // A replayed answer is final whatever its status: a replay of the same key answers the
    // same again. (Looked at only when the table would go on: a success reads no more.)
    if verdict != Verdict::Final && ended.headers.is_some_and(classify::replayed) {
        verdict = Verdict::Final;
    }
    let rebuild = verdict == Verdict::Rebuild;
    let failed = match (outcome, verdict) {
        (Outcome::Status(Code::Ok), _) => Some(false),
        (_, Verdict::Retry) => Some(true),
        (_, Verdict::Rebuild) if policy.rebuild.is_some() => Some(true),
        _ => None,
    };
    if let Some(failed) = failed {
        budgets.main.record(failed);
        budgets.deferred.record(failed);
    }
    // The common case, a final answer, returns before anything else is looked at.
    if verdict == Verdict::Final {
        return Step::Return(ReturnReason::Final);
    }
    if rebuild && (policy.rebuild.is_none() || ended.headers.is_none()) {
        return Step::Return(ReturnReason::Final);
    }
    // The caller opted this request out: only an attempt that never left goes again (and the
    // layer kept no body for more).
    if attempt.opted_out && outcome != Outcome::Unsent {
        return Step::Return(ReturnReason::Declined);
    }
    if !replayable() {
        return Step::Return(ReturnReason::NotReplayable);
    }

    let transparent =
        outcome == Outcome::Unsent && attempt.unsent_retries < policy.max_unsent_retries;
    let max_attempts = if attempt.send_once || attempt.opted_out {
        1
    } else {
        rules.max_attempts
    };
    let beyond_max_attempts = attempt.sent >= max_attempts;
    if beyond_max_attempts && !transparent {
        if attempt.sent < rules.max_attempts {
            if attempt.opted_out {
                return Step::Return(ReturnReason::Declined);
            }
            return Step::Return(ReturnReason::InboundRetry);
        }
        return Step::Return(ReturnReason::Exhausted);
    }
    // The caller's predicate may decline a retry of an attempt the server may have seen.
    if let (Some(retry_if), Some(request), false) =
        (&policy.retry_if, ended.request, outcome == Outcome::Unsent)
    {
        let candidate = RetryCandidate {
            request,
            attempt: attempt.sent,
            outcome,
            code: outcome.code(),
            response: ended.headers,
        };
        if !retry_if.allows(&candidate) {
            return Step::Return(ReturnReason::Declined);
        }
    }

    let pushback = ended.headers.map_or(PushbackHint::None, |h| {
        classify::pushback(h, &policy.reason_codes)
    });
    let budget = match pushback {
        PushbackHint::Deferred => budgets.deferred,
        _ => budgets.main,
    };
    let (delay, pushed_back) = match pushback {
        PushbackHint::Stop => return Step::Return(ReturnReason::PushbackSaysNo),
        PushbackHint::After(d) if d > policy.max_pushback => {
            return Step::Return(ReturnReason::PushbackTooLong(d))
        }
        // A quota answered "come back in 0": never resend at once, use the backoff.
        PushbackHint::After(d)
            if d.is_zero() && outcome == Outcome::Status(Code::ResourceExhausted) =>
        {
            backoff(policy, rules, attempt, rebuild)
        }
        PushbackHint::After(d) => (d, true),
        PushbackHint::None | PushbackHint::Deferred => backoff(policy, rules, attempt, rebuild),
    };

    if let Some(deadline) = attempt.deadline {
        let left = deadline.saturating_duration_since(now());
        if left < delay.saturating_add(policy.min_attempt_time) {
            return Step::Return(ReturnReason::DeadlineTooShort { delay, left });
        }
    }

    if rebuild {
        return Step::Rebuild { delay, pushed_back };
    }
    if !budget.withdraw() {
        return Step::Return(ReturnReason::BudgetRefused);
    }
    Step::Retry {
        delay,
        pushed_back,
        beyond_max_attempts,
    }
}

/// The computed delay, when the server asked for none: the backoff schedule's next one; zero
/// before a rebuild (it re-reads the state first: it waits for the hook, not for a backoff).
fn backoff(
    policy: &RetryPolicy,
    rules: &Rules,
    attempt: &Attempt,
    rebuild: bool,
) -> (Duration, bool) {
    if rebuild {
        return (Duration::ZERO, false);
    }
    let u = policy.rng.sample();
    let n = attempt.backoff_step.saturating_add(1);
    (rules.backoff.delay(n, u, attempt.previous_delay), false)
}

#[cfg(test)]
mod tests;

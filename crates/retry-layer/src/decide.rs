//! The decision after an attempt: a pure function from the policy, the attempt and its outcome
//! to the next [`Step`]. No service, no request body and no timer are in scope, so every row of
//! the decision is table-tested below; the response future only carries the step out.

use std::time::Duration;

use http::HeaderMap;
use reason_code::{Code, Outcome, Verdict};
use tokio::time::Instant;

use crate::budget::Budget;
use crate::classify::{self, PushbackHint};
use crate::policy::{RetryPolicy, Rules};

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
    Return(Why),
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
pub(crate) enum Why {
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
    /// The retry budget refused the retry.
    BudgetRefused,
    /// The request being served is itself a retry of the hop above: this call sends once.
    InboundRetry,
}

/// Decides what follows an attempt: the three checks (the outcome is retryable, an attempt is
/// left, the deadline fits the delay plus `min_attempt_time`), the server's pushback, then the
/// retry budget, in that order.
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
    let verdict = rules.table.verdict(outcome, attempt.idempotent);
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
        return Step::Return(Why::Final);
    }
    if rebuild && (policy.rebuild.is_none() || ended.headers.is_none()) {
        return Step::Return(Why::Final);
    }
    if !replayable() {
        return Step::Return(Why::NotReplayable);
    }

    let transparent =
        outcome == Outcome::Unsent && attempt.unsent_retries < policy.max_unsent_retries;
    let max_attempts = if attempt.send_once {
        1
    } else {
        rules.max_attempts
    };
    let beyond_max_attempts = attempt.sent >= max_attempts;
    if beyond_max_attempts && !transparent {
        if attempt.sent < rules.max_attempts {
            return Step::Return(Why::InboundRetry);
        }
        return Step::Return(Why::Exhausted);
    }

    let pushback = ended.headers.map_or(PushbackHint::None, |h| {
        classify::pushback(h, &policy.reason_codes)
    });
    let budget = match pushback {
        PushbackHint::Deferred => budgets.deferred,
        _ => budgets.main,
    };
    let (delay, pushed_back) = match pushback {
        PushbackHint::Stop => return Step::Return(Why::PushbackSaysNo),
        PushbackHint::After(d) if d > policy.max_pushback => {
            return Step::Return(Why::PushbackTooLong(d))
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
            return Step::Return(Why::DeadlineTooShort { delay, left });
        }
    }

    if rebuild {
        return Step::Rebuild { delay, pushed_back };
    }
    if !budget.withdraw() {
        return Step::Return(Why::BudgetRefused);
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
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use http::HeaderValue;

    use super::*;
    use crate::backoff::Jitter;
    use crate::budget::Unlimited;
    use crate::policy::Conflict;

    const MS: Duration = Duration::from_millis(1);

    /// `google.rpc.Status { code: 8, message: "slow down", details: [RetryInfo { retry_delay:
    /// 2 s }] }`, base64 as gRPC sends it.
    const RETRY_INFO_2S: &str =
        "CAgSCXNsb3cgZG93bhowCih0eXBlLmdvb2dsZWFwaXMuY29tL2dvb2dsZS5ycGMuUmV0cnlJbmZvEgQKAggC";
    /// `RetryInfo { retry_delay: 1.5 s }` (seconds and nanos), padded.
    const RETRY_INFO_1_5S: &str =
        "CA4aNgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxIKCggIARCAyrXuAQ==";
    /// `RetryInfo { retry_delay: 0 s }`.
    const RETRY_INFO_0S: &str =
        "CAgaLgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxICCgA=";
    /// A `google.rpc.DebugInfo` detail only.
    const OTHER_DETAIL: &str = "CAgaLAoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLkRlYnVnSW5mbxIA";

    /// A budget that counts what the decision told it, and grants retries or not.
    #[derive(Debug, Default)]
    struct Counting {
        refuse: bool,
        successes: AtomicU32,
        failures: AtomicU32,
        withdrawals: AtomicU32,
    }

    impl Budget for Counting {
        fn deposit(&self) {}
        fn record(&self, failed: bool) {
            let c = if failed {
                &self.failures
            } else {
                &self.successes
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
        fn withdraw(&self) -> bool {
            self.withdrawals.fetch_add(1, Ordering::Relaxed);
            !self.refuse
        }
    }

    /// One row of the table: the default policy without jitter (so delays are exact), the first
    /// attempt of an idempotent call without deadline, an unlimited budget, a replayable body.
    struct Case {
        policy: RetryPolicy,
        attempt: Attempt,
        outcome: Outcome,
        headers: Option<HeaderMap>,
        budget: Arc<dyn Budget>,
        deferred: Arc<dyn Budget>,
        replayable: bool,
        now: Instant,
    }

    fn no_jitter() -> crate::policy::RetryPolicyBuilder {
        RetryPolicy::builder().jitter(Jitter::None)
    }

    fn case(outcome: Outcome) -> Case {
        let headers = match outcome {
            Outcome::Status(_) => Some(HeaderMap::new()),
            _ => None,
        };
        Case {
            policy: no_jitter().build().unwrap(),
            attempt: Attempt::first(true, None, None),
            outcome,
            headers,
            budget: Arc::new(Unlimited),
            deferred: Arc::new(Unlimited),
            replayable: true,
            now: Instant::now(),
        }
    }

    fn status(code: Code) -> Case {
        case(Outcome::Status(code))
    }

    impl Case {
        fn policy(mut self, builder: crate::policy::RetryPolicyBuilder) -> Self {
            self.policy = builder.build().unwrap();
            self
        }
        fn with_hook(self) -> Self {
            self.policy(no_jitter().rebuild_on_conflict(|_c: Conflict| async { None }))
        }
        fn not_idempotent(mut self) -> Self {
            self.attempt.idempotent = false;
            self
        }
        fn sent(mut self, n: u32) -> Self {
            self.attempt.sent = n;
            self
        }
        fn unsent_retries(mut self, n: u32) -> Self {
            self.attempt.unsent_retries = n;
            self
        }
        fn backoff_step(mut self, n: u32, previous: Duration) -> Self {
            self.attempt.backoff_step = n;
            self.attempt.previous_delay = previous;
            self
        }
        fn deadline_in(mut self, left: Duration) -> Self {
            self.attempt.deadline = Some(self.now + left);
            self
        }
        fn header(mut self, name: &'static str, value: &'static str) -> Self {
            let headers = self.headers.as_mut().expect("a response");
            headers.insert(name, HeaderValue::from_static(value));
            self
        }
        fn refusing_budget(mut self) -> Self {
            self.budget = Arc::new(Counting {
                refuse: true,
                ..Counting::default()
            });
            self
        }
        fn not_replayable(mut self) -> Self {
            self.replayable = false;
            self
        }
        fn under_inbound_retry(mut self) -> Self {
            self.attempt.send_once = true;
            self
        }
        fn decide(&self) -> Step {
            let ended = Ended {
                outcome: self.outcome,
                headers: self.headers.as_ref(),
            };
            decide(
                &self.policy,
                Budgets {
                    main: &*self.budget,
                    deferred: &*self.deferred,
                },
                &self.attempt,
                ended,
                || self.now,
                || self.replayable,
            )
        }
    }

    fn retry(delay: Duration) -> Step {
        Step::Retry {
            delay,
            pushed_back: false,
            beyond_max_attempts: false,
        }
    }

    fn retry_after(delay: Duration) -> Step {
        Step::Retry {
            delay,
            pushed_back: true,
            beyond_max_attempts: false,
        }
    }

    fn rebuild(delay: Duration, pushed_back: bool) -> Step {
        Step::Rebuild { delay, pushed_back }
    }

    const fn stop(why: Why) -> Step {
        Step::Return(why)
    }

    macro_rules! decide_table {
        ($($name:ident: $case:expr => $expected:expr;)*) => {
            $(
                #[test]
                fn $name() {
                    assert_eq!($case.decide(), $expected);
                }
            )*
        };
    }

    decide_table! {
        // Under a retry of the hop above (one tier of retries): send once, but an attempt that
        // never left is still retried transparently, and a final answer stays final.
        under_an_inbound_retry_a_503_is_not_retried:
            status(Code::Unavailable).under_inbound_retry() => stop(Why::InboundRetry);
        under_an_inbound_retry_an_unsent_attempt_is_still_retried:
            case(Outcome::Unsent).under_inbound_retry() => Step::Retry {
                delay: 20 * MS,
                pushed_back: false,
                beyond_max_attempts: true,
            };
        under_an_inbound_retry_a_success_is_final:
            status(Code::Ok).under_inbound_retry() => stop(Why::Final);
        a_hop_below_that_gave_up_stops_retries:
            status(Code::Unavailable).header("x-reason-code", "DO_NOT_RETRY")
                => stop(Why::PushbackSaysNo);

        // Final by the table.
        a_success_is_final: status(Code::Ok) => stop(Why::Final);
        a_permanent_failure_is_final: status(Code::InvalidArgument) => stop(Why::Final);
        internal_is_final_unless_opted_in: status(Code::Internal) => stop(Why::Final);
        data_loss_is_final: status(Code::DataLoss) => stop(Why::Final);
        unavailable_for_a_write_without_key_is_final:
            status(Code::Unavailable).not_idempotent() => stop(Why::Final);
        ambiguous_for_a_write_without_key_is_final:
            case(Outcome::Ambiguous).not_idempotent() => stop(Why::Final);

        // Retry, with the computed backoff.
        unavailable_for_an_idempotent_request_is_retried:
            status(Code::Unavailable) => retry(20 * MS);
        deadline_exceeded_is_retried: status(Code::DeadlineExceeded) => retry(20 * MS);
        ambiguous_for_an_idempotent_request_is_retried:
            case(Outcome::Ambiguous) => retry(20 * MS);
        the_backoff_grows_with_each_computed_delay:
            status(Code::Unavailable).sent(2).backoff_step(1, 20 * MS) => retry(40 * MS);
        too_many_requests_is_retried_for_a_write:
            status(Code::ResourceExhausted).not_idempotent() => retry(20 * MS);
        unsent_is_retried_for_a_write: case(Outcome::Unsent).not_idempotent() => retry(20 * MS);

        // Attempts exhausted, and the unsent cap.
        no_attempt_left: status(Code::Unavailable).sent(3) => stop(Why::Exhausted);
        an_unsent_request_may_go_beyond_max_attempts:
            case(Outcome::Unsent).not_idempotent().sent(3) => Step::Retry {
                delay: 20 * MS,
                pushed_back: false,
                beyond_max_attempts: true,
            };
        the_unsent_cap_ends_it:
            case(Outcome::Unsent).sent(5).unsent_retries(2) => stop(Why::Exhausted);
        an_ambiguous_outcome_gets_no_transparent_retry:
            case(Outcome::Ambiguous).sent(3) => stop(Why::Exhausted);

        // The deadline.
        the_deadline_fits_the_delay_plus_min_attempt_time:
            status(Code::Unavailable).deadline_in(70 * MS) => retry(20 * MS);
        the_deadline_is_too_short:
            status(Code::Unavailable).deadline_in(69 * MS) => stop(Why::DeadlineTooShort {
                delay: 20 * MS,
                left: 69 * MS,
            });
        min_attempt_time_is_the_policys:
            status(Code::Unavailable)
                .policy(no_jitter().min_attempt_time(Duration::ZERO))
                .deadline_in(20 * MS) => retry(20 * MS);

        // Server pushback.
        retry_after_replaces_the_backoff:
            status(Code::ResourceExhausted).header("retry-after", "2")
                => retry_after(Duration::from_secs(2));
        grpc_pushback_replaces_the_backoff:
            status(Code::Unavailable).header("grpc-retry-pushback-ms", "150")
                => retry_after(150 * MS);
        a_negative_grpc_pushback_stops:
            status(Code::Unavailable).header("grpc-retry-pushback-ms", "-1")
                => stop(Why::PushbackSaysNo);
        a_malformed_grpc_pushback_stops:
            status(Code::Unavailable).header("grpc-retry-pushback-ms", "soon")
                => stop(Why::PushbackSaysNo);
        a_malformed_retry_after_is_ignored:
            status(Code::Unavailable).header("retry-after", "soon") => retry(20 * MS);
        // google.rpc.RetryInfo in grpc-status-details-bin is a pushback (issue 31 item 14) ...
        retry_info_is_a_pushback:
            status(Code::ResourceExhausted).header("grpc-status-details-bin", RETRY_INFO_2S)
                => retry_after(Duration::from_secs(2));
        retry_info_with_nanos_is_a_pushback:
            status(Code::Unavailable).header("grpc-status-details-bin", RETRY_INFO_1_5S)
                => retry_after(1_500 * MS);
        grpc_pushback_wins_over_retry_info:
            status(Code::ResourceExhausted)
                .header("grpc-status-details-bin", RETRY_INFO_2S)
                .header("grpc-retry-pushback-ms", "150")
                => retry_after(150 * MS);
        details_without_retry_info_use_the_backoff:
            status(Code::ResourceExhausted).header("grpc-status-details-bin", OTHER_DETAIL)
                => retry(20 * MS);
        malformed_details_are_ignored:
            status(Code::ResourceExhausted).header("grpc-status-details-bin", "%%%")
                => retry(20 * MS);
        // ... and a pushback of 0 on RESOURCE_EXHAUSTED means "use the backoff", never "at once".
        a_zero_retry_info_on_resource_exhausted_uses_the_backoff:
            status(Code::ResourceExhausted).header("grpc-status-details-bin", RETRY_INFO_0S)
                => retry(20 * MS);
        a_zero_retry_after_on_resource_exhausted_uses_the_backoff:
            status(Code::ResourceExhausted).header("retry-after", "0") => retry(20 * MS);
        a_zero_grpc_pushback_on_resource_exhausted_uses_the_backoff:
            status(Code::ResourceExhausted).header("grpc-retry-pushback-ms", "0") => retry(20 * MS);
        a_zero_pushback_on_unavailable_is_honoured:
            status(Code::Unavailable).header("grpc-retry-pushback-ms", "0")
                => retry_after(Duration::ZERO);
        a_pushback_over_max_pushback_stops:
            status(Code::ResourceExhausted).header("retry-after", "31")
                => stop(Why::PushbackTooLong(Duration::from_secs(31)));
        a_pushback_that_does_not_fit_the_deadline_stops:
            status(Code::ResourceExhausted).header("retry-after", "1").deadline_in(900 * MS)
                => stop(Why::DeadlineTooShort { delay: Duration::from_secs(1), left: 900 * MS });

        // The budget, asked last.
        the_budget_refuses: status(Code::Unavailable).refusing_budget() => stop(Why::BudgetRefused);
        a_final_answer_never_asks_the_budget:
            status(Code::Ok).refusing_budget() => stop(Why::Final);
        no_attempt_left_is_reported_before_the_budget:
            status(Code::Unavailable).sent(3).refusing_budget() => stop(Why::Exhausted);

        // The body.
        a_body_that_could_not_be_kept_stops:
            status(Code::Unavailable).not_replayable() => stop(Why::NotReplayable);
        a_final_answer_never_asks_about_the_body:
            status(Code::Ok).not_replayable() => stop(Why::Final);

        // Conflicts: rebuild.
        a_conflict_without_hook_is_final: status(Code::Aborted) => stop(Why::Final);
        a_conflict_with_a_hook_is_rebuilt:
            status(Code::Aborted).with_hook() => rebuild(Duration::ZERO, false);
        a_conflict_of_a_write_is_rebuilt_too:
            status(Code::Aborted).with_hook().not_idempotent() => rebuild(Duration::ZERO, false);
        a_rebuild_asks_the_budget_after_the_hook:
            status(Code::Aborted).with_hook().refusing_budget() => rebuild(Duration::ZERO, false);
        a_rebuild_after_a_pushback_restarts_the_backoff:
            status(Code::Aborted).with_hook().header("retry-after", "0")
                => rebuild(Duration::ZERO, true);
        a_rebuild_is_sent_after_the_servers_pushback:
            status(Code::Aborted).with_hook().header("retry-after", "2")
                => rebuild(Duration::from_secs(2), true);
        a_rebuild_whose_pushback_does_not_fit_the_deadline_stops:
            status(Code::Aborted).with_hook().header("retry-after", "2").deadline_in(Duration::from_secs(2))
                => stop(Why::DeadlineTooShort { delay: Duration::from_secs(2), left: Duration::from_secs(2) });
        a_rebuild_needs_an_attempt_left:
            status(Code::Aborted).with_hook().sent(3) => stop(Why::Exhausted);
        a_rebuild_needs_the_deadline_to_fit_min_attempt_time:
            status(Code::Aborted).with_hook().deadline_in(49 * MS)
                => stop(Why::DeadlineTooShort { delay: Duration::ZERO, left: 49 * MS });
    }

    /// A gRPC method config's rules replace the policy's for the methods it names.
    #[test]
    fn a_method_config_chooses_the_attempts_and_codes() {
        let policy = RetryPolicy::from_grpc_service_config(
            r#"{"methodConfig": [{"name": [{"service": "a.S", "method": "M"}],
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "1s",
                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
        )
        .unwrap();
        let method = policy.grpc_method("/a.S/M");
        assert!(method.is_some());
        let mut c = status(Code::Unavailable);
        c.policy = policy;
        c.attempt.method = method;
        assert!(
            matches!(c.decide(), Step::Retry { delay, .. } if delay <= 10 * MS),
            "full jitter up to initialBackoff"
        );
        assert_eq!(c.sent(2).decide(), stop(Why::Exhausted), "maxAttempts 2");
        let mut c = status(Code::DeadlineExceeded);
        c.policy = RetryPolicy::from_grpc_service_config(
            r#"{"methodConfig": [{"name": [{"service": "a.S", "method": "M"}],
                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "1s",
                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
        )
        .unwrap();
        c.attempt.method = method;
        assert_eq!(
            c.decide(),
            stop(Why::Final),
            "a code the method config does not list"
        );
    }

    /// gRFC A6 accounting: successes add, retryable failures take, nothing else counts.
    #[test]
    fn the_budget_hears_successes_and_retryable_failures() {
        let counted = |c: Case| {
            let budget = Arc::new(Counting::default());
            let c = Case {
                budget: budget.clone(),
                ..c
            };
            c.decide();
            (
                budget.successes.load(Ordering::Relaxed),
                budget.failures.load(Ordering::Relaxed),
                budget.withdrawals.load(Ordering::Relaxed),
            )
        };
        assert_eq!(counted(status(Code::Ok)), (1, 0, 0));
        assert_eq!(counted(status(Code::Unavailable)), (0, 1, 1));
        assert_eq!(counted(status(Code::Unavailable).sent(3)), (0, 1, 0));
        assert_eq!(
            counted(status(Code::Unavailable).not_idempotent()),
            (0, 0, 0)
        );
        assert_eq!(counted(status(Code::NotFound)), (0, 0, 0));
        assert_eq!(counted(status(Code::Aborted)), (0, 0, 0), "no hook");
        assert_eq!(counted(status(Code::Aborted).with_hook()), (0, 1, 0));
    }

    /// A hop below that deferred is retried within the adaptive budget, not the main one; the
    /// adaptive budget hears every outcome the main one hears.
    #[test]
    fn a_deferred_failure_draws_on_the_adaptive_budget() {
        let main = Arc::new(Counting::default());
        let deferred = Arc::new(Counting {
            refuse: true,
            ..Counting::default()
        });
        let c = Case {
            budget: main.clone(),
            deferred: deferred.clone(),
            ..status(Code::Unavailable).header("x-reason-code", "RETRIES_DEFERRED")
        };
        assert_eq!(c.decide(), stop(Why::BudgetRefused));
        assert_eq!(deferred.withdrawals.load(Ordering::Relaxed), 1);
        assert_eq!(main.withdrawals.load(Ordering::Relaxed), 0);
        assert_eq!(deferred.failures.load(Ordering::Relaxed), 1);
        assert_eq!(main.failures.load(Ordering::Relaxed), 1);

        let c = Case {
            deferred: Arc::new(Unlimited),
            ..status(Code::Unavailable).header("x-reason-code", "RETRIES_DEFERRED")
        };
        assert_eq!(c.decide(), retry(20 * MS), "granted: the computed backoff");
    }
}

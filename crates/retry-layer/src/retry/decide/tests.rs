//! The decision as a table: one row per outcome, policy, attempt and budget, and the step it
//! leads to.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use http::HeaderValue;

use super::*;
use crate::backoff::Jitter;
use crate::budget::Unlimited;
use crate::retry::policy::Conflict;

const MS: Duration = Duration::from_millis(1);

/// `google.rpc.Status { code: 8, message: "slow down", details: [RetryInfo { retry_delay:
/// 2 s }] }`, base64 as gRPC sends it.
const RETRY_INFO_2S: &str =
    "CAgSCXNsb3cgZG93bhowCih0eXBlLmdvb2dsZWFwaXMuY29tL2dvb2dsZS5ycGMuUmV0cnlJbmZvEgQKAggC";
/// `RetryInfo { retry_delay: 1.5 s }` (seconds and nanos), padded.
const RETRY_INFO_1_5S: &str =
    "CA4aNgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxIKCggIARCAyrXuAQ==";
/// `RetryInfo { retry_delay: 0 s }`.
const RETRY_INFO_0S: &str = "CAgaLgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxICCgA=";
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
    request: http::request::Parts,
}

fn no_jitter() -> crate::retry::policy::RetryPolicyBuilder {
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
        request: http::Request::post("http://orders/orders")
            .body(())
            .unwrap()
            .into_parts()
            .0,
    }
}

fn status(code: Code) -> Case {
    case(Outcome::Status(code))
}

impl Case {
    fn policy(mut self, builder: crate::retry::policy::RetryPolicyBuilder) -> Self {
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
    fn opted_out(mut self) -> Self {
        self.attempt.opted_out = true;
        self
    }
    /// A `retry_if` that allows only retries of a GET (this case's request is a POST).
    fn retry_if_get_only(self) -> Self {
        self.policy(no_jitter().retry_if(|c| c.request.method == http::Method::GET))
    }
    fn retry_if_panics(self) -> Self {
        self.policy(no_jitter().retry_if(|_| panic!("a bug in the caller's predicate")))
    }
    fn decide(&self) -> Step {
        let ended = Ended {
            outcome: self.outcome,
            headers: self.headers.as_ref(),
            request: Some(&self.request),
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

const fn stop(reason: ReturnReason) -> Step {
    Step::Return(reason)
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
        status(Code::Unavailable).under_inbound_retry() => stop(ReturnReason::InboundRetry);
    under_an_inbound_retry_an_unsent_attempt_is_still_retried:
        case(Outcome::Unsent).under_inbound_retry() => Step::Retry {
            delay: 20 * MS,
            pushed_back: false,
            beyond_max_attempts: true,
        };
    under_an_inbound_retry_a_success_is_final:
        status(Code::Ok).under_inbound_retry() => stop(ReturnReason::Final);
    a_hop_below_that_gave_up_stops_retries:
        status(Code::Unavailable).header("x-reason-code", "DO_NOT_RETRY")
            => stop(ReturnReason::PushbackSaysNo);

    // The caller's say: `NoRetry` sends once (an unsent attempt still goes again), and
    // `retry_if` only declines what the table would retry.
    a_request_that_opted_out_is_not_retried:
        status(Code::Unavailable).opted_out() => stop(ReturnReason::Declined);
    a_request_that_opted_out_is_declined_before_its_body_is_looked_at:
        status(Code::Unavailable).opted_out().not_replayable() => stop(ReturnReason::Declined);
    a_request_that_opted_out_stops_at_the_unsent_cap:
        case(Outcome::Unsent).opted_out().unsent_retries(2) => stop(ReturnReason::Declined);
    a_request_that_opted_out_is_still_sent_when_it_never_left:
        case(Outcome::Unsent).opted_out() => Step::Retry {
            delay: 20 * MS,
            pushed_back: false,
            beyond_max_attempts: true,
        };
    a_declining_predicate_stops_the_retry:
        status(Code::Unavailable).retry_if_get_only() => stop(ReturnReason::Declined);
    a_declining_predicate_is_not_asked_of_an_unsent_attempt:
        case(Outcome::Unsent).retry_if_get_only() => retry(20 * MS);
    a_predicate_cannot_retry_what_the_table_does_not:
        status(Code::Unavailable).not_idempotent()
            .policy(no_jitter().retry_if(|_| true)) => stop(ReturnReason::Final);
    a_predicate_that_allows_leaves_the_retry:
        status(Code::Unavailable).policy(no_jitter().retry_if(|_| true)) => retry(20 * MS);
    a_panicking_predicate_declines:
        status(Code::Unavailable).retry_if_panics() => stop(ReturnReason::Declined);
    a_predicate_is_not_asked_when_no_attempt_is_left:
        status(Code::Unavailable).retry_if_panics().sent(3) => stop(ReturnReason::Exhausted);

    // Final by the table.
    a_success_is_final: status(Code::Ok) => stop(ReturnReason::Final);
    a_permanent_failure_is_final: status(Code::InvalidArgument) => stop(ReturnReason::Final);
    internal_is_final_unless_opted_in: status(Code::Internal) => stop(ReturnReason::Final);
    data_loss_is_final: status(Code::DataLoss) => stop(ReturnReason::Final);
    unavailable_for_a_write_without_key_is_final:
        status(Code::Unavailable).not_idempotent() => stop(ReturnReason::Final);
    ambiguous_for_a_write_without_key_is_final:
        case(Outcome::Ambiguous).not_idempotent() => stop(ReturnReason::Final);

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
    no_attempt_left: status(Code::Unavailable).sent(3) => stop(ReturnReason::Exhausted);
    an_unsent_request_may_go_beyond_max_attempts:
        case(Outcome::Unsent).not_idempotent().sent(3) => Step::Retry {
            delay: 20 * MS,
            pushed_back: false,
            beyond_max_attempts: true,
        };
    the_unsent_cap_ends_it:
        case(Outcome::Unsent).sent(5).unsent_retries(2) => stop(ReturnReason::Exhausted);
    an_ambiguous_outcome_gets_no_transparent_retry:
        case(Outcome::Ambiguous).sent(3) => stop(ReturnReason::Exhausted);

    // The deadline.
    the_deadline_fits_the_delay_plus_min_attempt_time:
        status(Code::Unavailable).deadline_in(70 * MS) => retry(20 * MS);
    the_deadline_is_too_short:
        status(Code::Unavailable).deadline_in(69 * MS) => stop(ReturnReason::DeadlineTooShort {
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
            => stop(ReturnReason::PushbackSaysNo);
    a_malformed_grpc_pushback_stops:
        status(Code::Unavailable).header("grpc-retry-pushback-ms", "soon")
            => stop(ReturnReason::PushbackSaysNo);
    a_malformed_retry_after_is_ignored:
        status(Code::Unavailable).header("retry-after", "soon") => retry(20 * MS);
    // google.rpc.RetryInfo in grpc-status-details-bin is a pushback ...
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
            => stop(ReturnReason::PushbackTooLong(Duration::from_secs(31)));
    a_pushback_that_does_not_fit_the_deadline_stops:
        status(Code::ResourceExhausted).header("retry-after", "1").deadline_in(900 * MS)
            => stop(ReturnReason::DeadlineTooShort { delay: Duration::from_secs(1), left: 900 * MS });

    // The budget, asked last.
    the_budget_refuses: status(Code::Unavailable).refusing_budget() => stop(ReturnReason::BudgetRefused);
    a_final_answer_never_asks_the_budget:
        status(Code::Ok).refusing_budget() => stop(ReturnReason::Final);
    no_attempt_left_is_reported_before_the_budget:
        status(Code::Unavailable).sent(3).refusing_budget() => stop(ReturnReason::Exhausted);

    // A replayed answer is final, whatever its status: the replay will not change.
    a_replayed_unavailable_is_final:
        status(Code::Unavailable).header("idempotent-replayed", "true") => stop(ReturnReason::Final);
    a_replayed_deadline_exceeded_is_final:
        status(Code::DeadlineExceeded).header("idempotent-replayed", "True")
            => stop(ReturnReason::Final);
    a_replayed_conflict_is_not_rebuilt:
        status(Code::Aborted).with_hook().header("idempotent-replayed", "true")
            => stop(ReturnReason::Final);
    a_replayed_header_that_is_not_true_changes_nothing:
        status(Code::Unavailable).header("idempotent-replayed", "false") => retry(20 * MS);

    // The body.
    a_body_that_could_not_be_kept_stops:
        status(Code::Unavailable).not_replayable() => stop(ReturnReason::NotReplayable);
    a_final_answer_never_asks_about_the_body:
        status(Code::Ok).not_replayable() => stop(ReturnReason::Final);

    // Conflicts: rebuild.
    a_conflict_without_hook_is_final: status(Code::Aborted) => stop(ReturnReason::Final);
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
            => stop(ReturnReason::DeadlineTooShort { delay: Duration::from_secs(2), left: Duration::from_secs(2) });
    a_rebuild_needs_an_attempt_left:
        status(Code::Aborted).with_hook().sent(3) => stop(ReturnReason::Exhausted);
    a_rebuild_needs_the_deadline_to_fit_min_attempt_time:
        status(Code::Aborted).with_hook().deadline_in(49 * MS)
            => stop(ReturnReason::DeadlineTooShort { delay: Duration::ZERO, left: 49 * MS });
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
    assert_eq!(
        c.sent(2).decide(),
        stop(ReturnReason::Exhausted),
        "maxAttempts 2"
    );
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
        stop(ReturnReason::Final),
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
    assert_eq!(
        counted(status(Code::Unavailable).header("idempotent-replayed", "true")),
        (0, 0, 0),
        "a replay is a final answer"
    );
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
    assert_eq!(c.decide(), stop(ReturnReason::BudgetRefused));
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

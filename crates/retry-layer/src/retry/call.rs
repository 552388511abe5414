//! One call across its attempts: what the response future carries between them, and how it
//! carries out each [`Step`] the decision returns (counters, tracing, the next request).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use reason_code::{BoxError, Hop, Outcome};
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use crate::body::{BodyHandle, ReplayBody};
use crate::budget::Budget;
use crate::classify::{self, PushbackHint};
use crate::deadline::{deadline_of, instant_after, rewrite_grpc_timeout, AttemptBounds, Timer};
use crate::error::{DeadlineExceeded, RetryError, RetryInfo};
use crate::request::{
    intent_key, judge, judge_scanned, remove_attempt_headers, write_previous_attempts, HeaderScan,
    PreviousAttempts, SeenInFlight,
};
use crate::retry::decide::{decide, Attempt, Budgets, Ended, ReturnReason, Step};
use crate::retry::observe::{self, GiveUp};
use crate::retry::policy::{Conflict, InboundRetry, NoRetry, RebuildFuture, RetryEvent};
use crate::retry::shared::Shared;
use crate::retry::stats::Counter;

/// Everything an attempt after the first needs.
pub(crate) struct Call<S, B> {
    service: S,
    shared: Arc<Shared>,
    /// The request head to resend; `None` when the policy allows no retry at all.
    parts: Option<Parts>,
    body: BodyHandle<B>,
    /// The body a rebuild hook supplied, replacing the original.
    fixed_body: Option<Bytes>,
    /// What the decision reads: attempts, backoff, idempotency, deadline.
    attempt: Attempt,
    /// Attempts that may have reached the server: every attempt made but those that provably
    /// never left the client. The attempt header of the next attempt carries it.
    went_out: u32,
    grpc: bool,
    /// An attempt was answered that its key was in flight at the server: every later attempt
    /// says so ([`IDEMPOTENCY_SEEN_IN_FLIGHT`](reason_code::IDEMPOTENCY_SEEN_IN_FLIGHT)), and the
    /// server never runs it unprotected (fail-open) while that write may run.
    saw_in_flight: bool,
    /// The key `ensure_idempotency_key` generated, if it did.
    generated_key: Option<HeaderValue>,
    /// The code of the last attempt's outcome: labels a stop after it (a deadline too short
    /// once the service is ready, a budget refusal of a rebuilt request).
    last_code: reason_code::Code,
    /// When the server's pushback lets the rebuilt request go (the conflict's arrival plus the
    /// pushback; the arrival alone without one). Set when a rebuild starts.
    rebuild_not_before: Option<Instant>,
    /// Why nothing was sent, when nothing was: the answer.
    not_sent: Option<BoxError>,
    /// The server hop this call is made from, if the handler runs in one: told when the call
    /// gives up, so the hop answers its caller "do not retry".
    hop: Option<Arc<Hop>>,
    /// The call draws on the budget kept for calls under an inbound retry.
    inbound_retry_budget: bool,
    /// The budget of the request's authority, with `budget_per_authority`.
    authority_budget: Option<Arc<dyn Budget>>,
    /// The budget granted the retry the call waits to send: given back if it is never sent
    /// (the deadline ends the wait, the service never becomes ready, the caller drops the call).
    granted: bool,
    /// The budget paid for the attempt in flight: given back if it ends provably never sent
    /// (an inner service that waits for its own readiness in its future, a hedge, answers so).
    paid: bool,
}

impl<S, B> Drop for Call<S, B> {
    fn drop(&mut self) {
        if self.granted {
            self.budget().refund();
        }
    }
}

/// The budget a call draws on: the inbound-retry budget for a call made under an inbound
/// retry (when the policy keeps one), else its authority's, else the policy's.
fn budget_of<'a>(
    shared: &'a Shared,
    inbound_retry_budget: bool,
    authority_budget: Option<&'a Arc<dyn Budget>>,
) -> &'a dyn Budget {
    match (&shared.inbound_retry_budget, authority_budget) {
        (Some(b), _) if inbound_retry_budget => &**b,
        (_, Some(b)) => &**b,
        _ => &*shared.budget,
    }
}

/// Sends a call's first attempt on `service`, which must be ready: counts it as sent and pays
/// the budget's deposit for the request.
fn send_first_on<S, B>(
    service: &mut S,
    shared: &Shared,
    budget: &dyn Budget,
    attempt: &mut Attempt,
    req: Request<ReplayBody<B>>,
) -> S::Future
where
    S: Service<Request<ReplayBody<B>>>,
{
    attempt.sent = 1;
    shared.stats.incr(Counter::Attempts);
    budget.deposit();
    service.call(req)
}

/// The first attempt of a call, as [`Call::start`] leaves it.
pub(crate) enum First<F, B> {
    /// Sent: its future.
    Sent(F),
    /// Ready to go once the service is (boxed: the rarer case pays for its room).
    Unready(Box<Request<ReplayBody<B>>>),
    /// Nothing is sent: the deadline had passed, or the body failed before its first byte.
    NotSent,
}

/// What the response future does next with an attempt's result, once a [`Step`] is carried
/// out. The decision reads the result where the future holds it: a success is moved once, into
/// the answer.
pub(crate) enum Next {
    /// Answer the caller with the result.
    Answer,
    /// Wait this long, then retry. What the decision needed of the result (its outcome, its
    /// pushback) is read; the rest is let go: a response's body is drained while the call waits
    /// (on one HTTP/1 connection the retry can be sent only once it is read; on HTTP/2 an
    /// unread body keeps the connection's flow-control window).
    Wait(std::time::Duration),
    /// Wait for the rebuild hook; the result, a conflict response, is the answer if it
    /// declines.
    Rebuild(RebuildFuture),
}

impl<S, B> Call<S, B> {
    /// The budget this call draws on.
    fn budget(&self) -> &dyn Budget {
        budget_of(
            &self.shared,
            self.inbound_retry_budget,
            self.authority_budget.as_ref(),
        )
    }

    /// The budgets a retry of this call may draw on.
    fn budgets(&self) -> Budgets<'_> {
        Budgets {
            main: self.budget(),
            deferred: &self.shared.deferred_budget,
        }
    }

    /// Attempts sent so far.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempt.sent
    }

    /// True when the request being sent is a gRPC call.
    pub(crate) fn grpc(&self) -> bool {
        self.grpc
    }

    /// The call's deadline.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.attempt.deadline
    }

    /// How long an attempt (or the wait before it) may wait for a response head.
    pub(crate) fn head_timeout(&self) -> std::time::Duration {
        self.shared.policy.response_head_timeout
    }

    /// True when the call has a deadline and it has passed.
    pub(crate) fn deadline_passed(&self) -> bool {
        self.attempt.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The call's answer: a response with its [`RetryInfo`], or the error as a [`RetryError`]
    /// that carries the attempts and the generated key.
    pub(crate) fn answer<R>(
        &mut self,
        result: Result<Response<R>, BoxError>,
    ) -> Result<Response<R>, BoxError> {
        match result {
            Ok(res) => Ok(self.with_retry_info(res)),
            Err(e) => {
                let kind = classify::error_kind(&e);
                Err(Box::new(
                    RetryError::new(e, self.attempt.sent, self.generated_key.take())
                        .reached(self.went_out)
                        .classified(kind),
                ))
            }
        }
    }

    /// Adds [`RetryInfo`] to a response that took retries or got a generated key; the common
    /// first-time success is left alone (no allocation).
    fn with_retry_info<R>(&mut self, mut res: Response<R>) -> Response<R> {
        if self.attempt.sent > 1 || self.generated_key.is_some() {
            res.extensions_mut().insert(RetryInfo {
                attempts: self.attempt.sent,
                idempotency_key: self.generated_key.take(),
            });
        }
        res
    }
}

impl<S, B, R> Call<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body + Send + 'static,
{
    /// Sets the request up (its idempotency, key, deadline and `grpc-timeout`), keeps what a
    /// retry needs, and sends the first attempt on `service` if it is `ready` (else the
    /// response future waits for it, and sends with [`send_first`](Self::send_first)). Hands
    /// the call, the first attempt, its timer and the call's span to `assemble`, and returns
    /// what it makes.
    ///
    /// Inlined into its one caller,
    /// [`ResponseFuture::new`](crate::retry::future::ResponseFuture::new), whose `assemble`
    /// puts the call in the response future: the call (about 500 bytes) is written there, not
    /// into a tuple that is then copied (returned as a tuple, it cost two copies more, 75
    /// instructions per call, callgrind). The first attempt goes out before the call is put
    /// together for the same reason.
    #[inline(always)]
    pub(crate) fn start<T>(
        mut service: S,
        shared: Arc<Shared>,
        req: Request<B>,
        ready: bool,
        assemble: impl FnOnce(Self, First<S::Future, B>, Timer, Span) -> T,
    ) -> T {
        let policy = &shared.policy;
        let (mut parts, body) = req.into_parts();
        let scan = HeaderScan::of(&parts.headers, &policy.key_headers);
        // The layer owns the attempt headers on every attempt: one forwarded from a request
        // this service is serving would tell the hop below that a first attempt is a retry.
        if scan.attempt_headers {
            remove_attempt_headers(&mut parts);
        }
        let judged = judge_scanned(policy, &mut parts, None, scan);
        // The deadline counts from the call (the wait for readiness, if any, is in it).
        // `grpc-timeout` is read only where the scan saw one.
        let deadline = deadline_of(
            &parts,
            judged.grpc && scan.grpc_timeout,
            policy.total_timeout,
        );
        if judged.grpc {
            rewrite_grpc_timeout(&mut parts, deadline, policy.attempt_timeout);
        }

        let content_length = scan.content_length;
        let hop = parts
            .extensions
            .get::<Arc<Hop>>()
            .cloned()
            .or_else(Hop::current);
        let under_retry = hop.as_ref().is_some_and(|h| h.arrived_as_retry());
        let (send_once, inbound_retry_budget) = match policy.inbound_retry {
            _ if !under_retry => (false, false),
            InboundRetry::SendOnce => (true, false),
            InboundRetry::RetryAsUsual => (false, false),
            InboundRetry::Budget { .. } => (false, true),
        };
        let opted_out = parts.extensions.get::<NoRetry>().is_some();
        let sent_retries_possible =
            !send_once && !opted_out && policy.rules(judged.method).max_attempts > 1;
        let retries_possible = sent_retries_possible || policy.max_unsent_retries > 0;
        let kept = retries_possible.then(|| parts.clone());
        // Only unsent retries possible: nothing of the body is kept (a retry can only carry a
        // body nobody read yet).
        let keep = if sent_retries_possible {
            policy.max_replay_bytes
        } else {
            0
        };
        // Nothing is sent when the deadline has passed, or when the body failed before any
        // byte of it was read (the server would see a request start and break off).
        let expired = deadline.is_some_and(|d| Instant::now() >= d);
        let wrapped = if expired {
            Err(DeadlineExceeded::new().into())
        } else {
            ReplayBody::new(body, keep, content_length, &shared.replay_memory)
        };

        let mut attempt = Attempt::first(judged.idempotent, judged.method, deadline);
        attempt.send_once = send_once;
        attempt.opted_out = opted_out;
        shared.stats.incr(Counter::Requests);
        observe::call_started();
        let span = observe::call_span(&parts, judged.grpc);
        let authority_budget = shared.budget_for(&parts.uri);
        let bounds = AttemptBounds::new(
            deadline,
            policy.attempt_timeout,
            policy.response_head_timeout,
        );
        // The first attempt goes out before the call's state is put together: its request is
        // built where the service takes it, not moved through that state.
        let (first, timer, body, not_sent) = match wrapped {
            Ok((first_body, body)) if ready => {
                let future = send_first_on(
                    &mut service,
                    &shared,
                    budget_of(&shared, inbound_retry_budget, authority_budget.as_ref()),
                    &mut attempt,
                    Request::from_parts(parts, first_body),
                );
                (First::Sent(future), Timer::for_attempt(bounds), body, None)
            }
            Ok((first_body, body)) => {
                // Not ready yet: the wait is bounded by the deadline, or by the head bound. The
                // first attempt counts as sent once it is.
                attempt.sent = 0;
                let wait = AttemptBounds::readiness(deadline, policy.response_head_timeout);
                let request = Box::new(Request::from_parts(parts, first_body));
                (
                    First::Unready(request),
                    Timer::for_attempt(wait),
                    body,
                    None,
                )
            }
            Err(e) => {
                attempt.sent = 0;
                (
                    First::NotSent,
                    Timer::default(),
                    BodyHandle::empty(),
                    Some(e),
                )
            }
        };
        assemble(
            Call {
                service,
                shared,
                parts: kept,
                body,
                fixed_body: None,
                attempt,
                went_out: 0,
                grpc: judged.grpc,
                saw_in_flight: false,
                generated_key: judged.generated_key,
                last_code: reason_code::Code::Ok,
                rebuild_not_before: None,
                not_sent,
                hop,
                inbound_retry_budget,
                authority_budget,
                granted: false,
                paid: false,
            },
            first,
            timer,
            span,
        )
    }

    /// Sends the first attempt on the service, which must be ready (it was not when the call
    /// started).
    pub(crate) fn send_first(&mut self, req: Request<ReplayBody<B>>) -> S::Future {
        let budget = budget_of(
            &self.shared,
            self.inbound_retry_budget,
            self.authority_budget.as_ref(),
        );
        send_first_on(
            &mut self.service,
            &self.shared,
            budget,
            &mut self.attempt,
            req,
        )
    }

    /// The bounds of an attempt sent now.
    pub(crate) fn bounds(&self) -> AttemptBounds {
        let policy = &self.shared.policy;
        AttemptBounds::new(
            self.attempt.deadline,
            policy.attempt_timeout,
            policy.response_head_timeout,
        )
    }

    /// Classifies an attempt's result (recording it on the attempt's `span`), decides, and
    /// carries the step out.
    pub(crate) fn after_attempt(
        &mut self,
        result: &Result<Response<R>, BoxError>,
        span: &Span,
    ) -> Next {
        let shared = &*self.shared;
        let policy = &shared.policy;
        let outcome = match result {
            Ok(res) => classify::response(res, self.grpc, &policy.reason_codes),
            Err(e) => classify::error(e),
        };
        observe::attempt_ended(outcome.code());
        observe::record_attempt(span, result, outcome, self.grpc);
        let paid = std::mem::take(&mut self.paid);
        if outcome != Outcome::Unsent {
            self.went_out += 1;
        } else if paid {
            // The budget pays for load on the server: an attempt that never left costs none.
            self.budget().refund();
        }
        // The server's own "in flight" answer is UNAVAILABLE-like: only such an outcome is looked
        // at, so a success pays nothing for it.
        if outcome.code() == reason_code::Code::Unavailable {
            if let Ok(res) = result {
                self.saw_in_flight |= policy.reason_codes.says_in_flight(res.headers());
            }
        }
        // A hedge below may have been told it by another of its attempts than the one it
        // answers with: it marks its answer.
        if outcome.code() != reason_code::Code::Ok {
            if let Ok(res) = result {
                self.saw_in_flight |= res.extensions().get::<SeenInFlight>().is_some();
            }
        }
        let ended = Ended {
            outcome,
            headers: result.as_ref().ok().map(Response::headers),
            request: self.parts.as_ref(),
        };
        let step = decide(
            policy,
            self.budgets(),
            &self.attempt,
            ended,
            Instant::now,
            || self.parts.is_some() && (self.fixed_body.is_some() || self.body.is_replayable()),
        );
        let code = outcome.code();
        self.last_code = code;
        let attempt = self.attempt.sent;
        match step {
            Step::Return(ReturnReason::Final) => Next::Answer,
            Step::Return(reason) => {
                self.count_and_trace(reason, code);
                Next::Answer
            }
            Step::Retry {
                delay,
                pushed_back,
                beyond_max_attempts,
            } => {
                if beyond_max_attempts {
                    self.attempt.unsent_retries += 1;
                }
                if pushed_back {
                    self.restart_backoff();
                } else {
                    self.attempt.backoff_step = self.attempt.backoff_step.saturating_add(1);
                    self.attempt.previous_delay = delay;
                }
                // Readers of the attempts so far must stop now: a transport may still be
                // sending them.
                self.body.cut_off();
                // The main budget granted it, unless the server said the hop below deferred to
                // this one (that budget takes nothing to give back).
                self.granted = !result.as_ref().is_ok_and(|res| {
                    classify::pushback(res.headers(), &self.shared.policy.reason_codes)
                        == PushbackHint::Deferred
                });
                self.shared.stats.incr(Counter::Retries);
                observe::retried(code);
                tracing::debug!(attempt, code = %code, delay_ms = delay.as_millis() as u64, "retrying");
                self.tell_on_retry(outcome, delay, false);
                Next::Wait(delay)
            }
            Step::Rebuild { delay, pushed_back } => {
                // `decide` rebuilds only responses, and only with a hook.
                let Ok(response) = result else {
                    return Next::Answer;
                };
                // A rebuild needs the whole body the conflict answered; without it the conflict
                // is the answer, and nothing is counted or taken from the budget.
                let Some(body) = self
                    .fixed_body
                    .clone()
                    .or_else(|| self.body.complete_bytes())
                else {
                    tracing::debug!(code = %code, "not rebuilding: the request body was not read whole");
                    return Next::Answer;
                };
                let Some(hook) = self.shared.policy.rebuild.clone() else {
                    return Next::Answer;
                };
                self.tell_on_retry(outcome, delay, true);
                if pushed_back {
                    self.restart_backoff();
                }
                self.body.cut_off();
                self.rebuild_not_before = Some(instant_after(Instant::now(), delay));
                let parts = self
                    .parts
                    .as_ref()
                    .expect("replayable: the head is kept")
                    .clone();
                let mut head = Response::new(()).into_parts().0;
                head.status = response.status();
                head.version = response.version();
                head.headers = response.headers().clone();
                let conflict = Conflict {
                    request: Request::from_parts(parts, body),
                    code,
                    response: head,
                };
                tracing::debug!(attempt, code = %code, "rebuilding the request");
                Next::Rebuild(hook.rebuild(conflict))
            }
        }
    }

    /// Tells the caller's `on_retry` callback, if any, of the retry about to wait `delay`.
    fn tell_on_retry(&self, outcome: Outcome, delay: std::time::Duration, rebuild: bool) {
        if let (Some(on_retry), Some(request)) = (&self.shared.policy.on_retry, &self.parts) {
            on_retry.tell(&RetryEvent {
                request,
                attempt: self.attempt.sent,
                outcome,
                code: outcome.code(),
                delay,
                rebuild,
            });
        }
    }

    /// After a server pushback the backoff schedule restarts from its base (gRFC A6).
    fn restart_backoff(&mut self) {
        self.attempt.backoff_step = 0;
        self.attempt.previous_delay = std::time::Duration::ZERO;
    }

    /// Counts and traces why a retryable outcome is returned. Each give-up and refusal is a
    /// DEBUG event; the layer's WARN summary counts them (at most one WARN per period, so a dead
    /// backend does not flood the logs).
    fn count_and_trace(&self, reason: ReturnReason, code: reason_code::Code) {
        let stats = &self.shared.stats;
        let attempt = self.attempt.sent;
        // The hop this call is made from answers its caller "do not retry" when no retry can
        // help (a downstream stop, the deadline), and "retried below: retry only within your
        // adaptive budget" when this call has done its share.
        // A stop on a choice of this hop's own (its `max_pushback`, a deadline tighter than the
        // inbound request's) is "retried below": its caller may well fit another attempt.
        if let Some(hop) = &self.hop {
            match reason {
                ReturnReason::Final => {}
                ReturnReason::PushbackSaysNo => hop.note_gave_up(),
                ReturnReason::DeadlineTooShort { delay, .. }
                    if hop.inbound_deadline_leaves_less_than(
                        delay.saturating_add(self.shared.policy.min_attempt_time),
                    ) =>
                {
                    hop.note_gave_up()
                }
                // At least "more than nothing" is needed: a spent inbound deadline gives up
                // even with a `min_attempt_time` of zero.
                ReturnReason::DeadlinePassed
                    if hop.inbound_deadline_leaves_less_than(
                        self.shared
                            .policy
                            .min_attempt_time
                            .max(std::time::Duration::from_nanos(1)),
                    ) =>
                {
                    hop.note_gave_up()
                }
                ReturnReason::DeadlineTooShort { .. }
                | ReturnReason::DeadlinePassed
                | ReturnReason::PushbackTooLong(_)
                | ReturnReason::Exhausted
                | ReturnReason::BudgetRefused
                | ReturnReason::InboundRetry
                | ReturnReason::NotReplayable => hop.note_deferred(),
                // The caller's own choice for this request: the hop above retries as usual.
                ReturnReason::Declined => {}
            }
        }
        let gave_up = match reason {
            ReturnReason::Final => return,
            ReturnReason::NotReplayable => {
                tracing::debug!(code = %code, "not retrying: the request body could not be kept");
                GiveUp::NotReplayable
            }
            ReturnReason::Exhausted => {
                stats.incr(Counter::Exhausted);
                tracing::debug!(attempt, code = %code, "giving up: no attempt left");
                GiveUp::Exhausted
            }
            ReturnReason::PushbackSaysNo => {
                stats.incr(Counter::PushbackStops);
                tracing::debug!(attempt, code = %code, "giving up: server pushback says stop");
                GiveUp::Pushback
            }
            ReturnReason::PushbackTooLong(d) => {
                stats.incr(Counter::PushbackStops);
                tracing::debug!(attempt, code = %code, pushback_ms = d.as_millis() as u64, "giving up: pushback longer than max_pushback");
                GiveUp::Pushback
            }
            ReturnReason::DeadlineTooShort { delay, left } => {
                stats.incr(Counter::DeadlineStops);
                tracing::debug!(attempt, code = %code, delay_ms = delay.as_millis() as u64, left_ms = left.as_millis() as u64, "giving up: the deadline cannot fit another attempt");
                GiveUp::Deadline
            }
            ReturnReason::DeadlinePassed => {
                stats.incr(Counter::DeadlineStops);
                tracing::debug!(attempt, code = %code, "giving up: the deadline has passed");
                GiveUp::Deadline
            }
            ReturnReason::InboundRetry => {
                stats.incr(Counter::InboundRetryStops);
                tracing::debug!(attempt, code = %code, "not retrying: the request being served is itself a retry of the hop above");
                GiveUp::InboundRetry
            }
            ReturnReason::Declined => {
                stats.incr(Counter::Declined);
                tracing::debug!(attempt, code = %code, "not retrying: the caller declined (retry_if, or NoRetry on the request)");
                GiveUp::Declined
            }
            ReturnReason::BudgetRefused => {
                stats.incr(Counter::BudgetRefusals);
                observe::budget_refused(code);
                tracing::debug!(attempt, code = %code, "retry budget exhausted: not retrying");
                self.shared.warnings.note(true);
                return;
            }
        };
        observe::gave_up(gave_up, code);
        self.shared.warnings.note(false);
    }

    /// Takes the request a hook rebuilt: checks that the deadline still fits the server's
    /// pushback plus `min_attempt_time`, asks the budget, then judges the request's idempotency
    /// and key afresh (a rebuilt write keeps the intent's key unless the hook set another).
    /// Returns when to send it, or `None` when the conflict is the answer.
    pub(crate) fn take_rebuilt(&mut self, req: Request<Bytes>) -> Option<Instant> {
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let now = Instant::now();
        let send_at = self.rebuild_not_before.unwrap_or(now);
        if let Some(deadline) = self.attempt.deadline {
            let delay = send_at.saturating_duration_since(now);
            let left = deadline.saturating_duration_since(now);
            if left < delay.saturating_add(policy.min_attempt_time) {
                self.count_and_trace(
                    ReturnReason::DeadlineTooShort { delay, left },
                    self.last_code,
                );
                return None;
            }
        }
        if !self.budget().withdraw() {
            shared.stats.incr(Counter::BudgetRefusals);
            observe::budget_refused(self.last_code);
            tracing::debug!(
                attempt = self.attempt.sent,
                "retry budget exhausted: not sending the rebuilt request"
            );
            shared.warnings.note(true);
            return None;
        }
        self.granted = true;
        shared.stats.incr(Counter::Retries);
        observe::retried(self.last_code);
        let (mut parts, body) = req.into_parts();
        let intent = self.parts.as_ref().and_then(|old| intent_key(policy, old));
        remove_attempt_headers(&mut parts);
        let judged = judge(policy, &mut parts, intent);
        self.grpc = judged.grpc;
        self.attempt.method = judged.method;
        self.attempt.idempotent = judged.idempotent;
        if judged.generated_key.is_some() {
            self.generated_key = judged.generated_key;
        }
        self.parts = Some(parts);
        self.fixed_body = Some(body);
        Some(send_at)
    }

    /// True when the deadline, now that the service is ready for the next attempt, leaves less
    /// than `min_attempt_time` (or nothing at all): the attempt is not sent, and the stop is
    /// counted and traced as a deadline stop, as when the decision finds the deadline too
    /// short. The answer is then [`DeadlineExceeded`] (the last attempt's response was let go
    /// before the wait).
    pub(crate) fn deadline_leaves_no_attempt(&self) -> bool {
        let Some(deadline) = self.attempt.deadline else {
            return false;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if !left.is_zero() && left >= self.shared.policy.min_attempt_time {
            return false;
        }
        self.count_and_trace(
            ReturnReason::DeadlineTooShort {
                delay: std::time::Duration::ZERO,
                left,
            },
            self.last_code,
        );
        true
    }

    /// The answer of a call whose first attempt was not sent: the body's error when it failed
    /// before its first byte; else the deadline had passed (see [`deadline_ended`]).
    ///
    /// [`deadline_ended`]: Self::deadline_ended
    pub(crate) fn answer_not_sent(&mut self) -> Result<Response<R>, BoxError> {
        match self.not_sent.take() {
            Some(e) if !e.is::<DeadlineExceeded>() => self.answer(Err(e)),
            _ => self.deadline_ended(),
        }
    }

    /// The answer of a call its deadline ended (before the first attempt, during an attempt,
    /// or while waiting for the inner service or the rebuild hook): [`DeadlineExceeded`],
    /// counted and traced as a deadline stop, and the hop told as for one (it gives up when the
    /// deadline was its inbound request's).
    pub(crate) fn deadline_ended(&mut self) -> Result<Response<R>, BoxError> {
        self.count_and_trace(
            ReturnReason::DeadlinePassed,
            reason_code::Code::DeadlineExceeded,
        );
        self.answer(Err(DeadlineExceeded::new().into()))
    }

    /// Polls the inner service's readiness for the next attempt.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.service.poll_ready(cx).map_err(Into::into)
    }

    /// Sends the next attempt on the service, which must be ready. Returns its future and
    /// bounds.
    pub(crate) fn send_retry(&mut self) -> (S::Future, AttemptBounds) {
        let policy = &self.shared.policy;
        let mut parts = self.parts.as_ref().expect("retries keep the head").clone();
        write_previous_attempts(&mut parts, self.grpc, self.went_out);
        parts.extensions.insert(PreviousAttempts(self.went_out));
        if self.saw_in_flight {
            parts.headers.insert(
                reason_code::IDEMPOTENCY_SEEN_IN_FLIGHT,
                HeaderValue::from_static("?1"),
            );
        }
        if self.grpc {
            rewrite_grpc_timeout(&mut parts, self.attempt.deadline, policy.attempt_timeout);
        }
        let body = match &self.fixed_body {
            Some(b) => ReplayBody::fixed(b.clone()),
            None => self.body.replay(),
        };
        self.attempt.sent += 1;
        self.paid = std::mem::take(&mut self.granted);
        self.shared.stats.incr(Counter::Attempts);
        let future = self.service.call(Request::from_parts(parts, body));
        (future, self.bounds())
    }
}

//! The response future: one state machine that sends attempts, waits, and decides.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use reason_code::{
    encode_grpc_timeout, parse_grpc_timeout, single, Code, Outcome, Verdict,
    GRPC_PREVIOUS_RPC_ATTEMPTS, GRPC_TIMEOUT, X_PREVIOUS_ATTEMPTS,
};
use tokio::time::{sleep_until, Instant, Sleep};
use tower_service::Service;

use crate::body::{BodyHandle, ReplayBody};
use crate::classify::{self, PushbackHint};
use crate::error::{after, AttemptTimedOut, DeadlineExceeded, RetryError};
use crate::layer::Shared;
use crate::policy::{Conflict, RebuildFuture};
use crate::stats::Counter;
use crate::{BoxError, Deadline, RetryInfo, RetryPolicy};

pin_project! {
    /// The response future of [`Retry`](crate::Retry).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        state: State<S::Future, S::Response>,
        // The attempt's deadline while an attempt runs; the backoff while waiting.
        // Boxed: a `Sleep` is larger than the rest of the future, and the common path (no
        // deadline, no attempt timeout, first attempt succeeds) never makes one, so the future
        // that is moved on every call stays small.
        timer: Option<Pin<Box<Sleep>>>,
        ctx: Ctx<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, T> {
        Called { #[pin] future: F },
        Waiting,
        // The conflict response is held until the hook decides: it is the answer if it declines.
        Rebuilding { future: RebuildFuture, response: Option<T> },
        Retrying,
        Done,
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("attempt", &self.ctx.attempt)
            .finish_non_exhaustive()
    }
}

/// Everything an attempt after the first needs.
struct Ctx<S, B> {
    service: S,
    shared: Arc<Shared>,
    /// The request head to resend; `None` when the policy allows no retry at all.
    parts: Option<Parts>,
    body: BodyHandle<B>,
    /// The body a rebuild hook supplied, replacing the original.
    fixed_body: Option<Bytes>,
    /// Attempts sent so far.
    attempt: u32,
    unsent_retries: u32,
    /// Computed backoff delays since the first attempt or the last server pushback: the next
    /// computed delay is the schedule's `backoff_step + 1`-th.
    backoff_step: u32,
    idempotent: bool,
    grpc: bool,
    /// The gRPC method config that applies (see `RetryPolicy::from_grpc_service_config`).
    method: Option<usize>,
    deadline: Option<Instant>,
    previous_delay: Duration,
    /// The key `ensure_idempotency_key` generated, if it did.
    generated_key: Option<HeaderValue>,
}

enum Step<R> {
    Return(Result<Response<R>, BoxError>),
    Wait(Duration),
    Rebuild(RebuildFuture, Response<R>),
}

fn clone_parts(p: &Parts) -> Parts {
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = p.method.clone();
    parts.uri = p.uri.clone();
    parts.version = p.version;
    parts.headers = p.headers.clone();
    parts.extensions = p.extensions.clone();
    parts
}

/// Decides whether a request (first, or rebuilt by a hook) is idempotent, and gives it its key.
///
/// A request with a key is idempotent. A write without one gets `intent_key`, the key of the
/// request it replaces (a rebuilt write is the same intent), else a generated one when the
/// policy ensures keys. Returns whether it is idempotent and the key generated, if one was.
fn settle_key(
    policy: &RetryPolicy,
    parts: &mut Parts,
    grpc: bool,
    intent_key: Option<(HeaderName, HeaderValue)>,
) -> (bool, Option<HeaderValue>) {
    if policy.key_headers.is_keyed(&parts.headers) {
        return (true, None);
    }
    let by_method = if grpc {
        policy.idempotent_grpc.contains(parts.uri.path())
    } else {
        classify::is_idempotent_method(&parts.method)
    };
    if by_method {
        return (true, None);
    }
    if let Some((name, value)) = intent_key {
        parts.headers.insert(name, value);
        return (true, None);
    }
    if !policy.ensure_key {
        return (false, None);
    }
    let key = uuid::Uuid::new_v4();
    let mut buf = uuid::Uuid::encode_buffer();
    let key = key.hyphenated().encode_lower(&mut buf);
    let value = HeaderValue::from_str(key).expect("a UUID is a valid header value");
    parts
        .headers
        .insert(policy.key_headers.first().clone(), value.clone());
    (true, Some(value))
}

impl<S, B, R> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    pub(crate) fn new(mut service: S, shared: Arc<Shared>, req: Request<B>) -> Self {
        let policy = &shared.policy;
        let (mut parts, body) = req.into_parts();
        let grpc = reason_code::is_grpc(&parts.headers);
        let method = if grpc {
            policy.grpc_method(parts.uri.path())
        } else {
            None
        };
        let (idempotent, generated_key) = settle_key(policy, &mut parts, grpc, None);

        let deadline = deadline_of(&parts, grpc, policy.total_timeout);
        if grpc {
            if let Some(t) = grpc_timeout(deadline, policy.attempt_timeout) {
                parts.headers.insert(GRPC_TIMEOUT, t);
            }
        }

        let content_length = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let (first_body, body) = ReplayBody::new(body, policy.max_replay_bytes, content_length);
        let retries_possible =
            policy.rules(method).max_attempts > 1 || policy.max_unsent_retries > 0;
        let kept = retries_possible.then(|| clone_parts(&parts));

        shared.budget.deposit();
        shared.stats.incr(Counter::Requests);
        shared.stats.incr(Counter::Attempts);
        let future = service.call(Request::from_parts(parts, first_body));
        let timer = attempt_timer(deadline, policy.attempt_timeout);
        ResponseFuture {
            state: State::Called { future },
            timer,
            ctx: Ctx {
                service,
                shared,
                parts: kept,
                body,
                fixed_body: None,
                attempt: 1,
                unsent_retries: 0,
                backoff_step: 0,
                idempotent,
                grpc,
                method,
                deadline,
                previous_delay: Duration::ZERO,
                generated_key,
            },
        }
    }
}

/// The call's deadline: the extension, else `grpc-timeout`, else the policy's total timeout.
fn deadline_of(parts: &Parts, grpc: bool, total: Option<Duration>) -> Option<Instant> {
    if let Some(Deadline(d)) = parts.extensions.get::<Deadline>() {
        return Some(*d);
    }
    if grpc {
        match single(&parts.headers, "grpc-timeout") {
            Ok(Some(v)) => match parse_grpc_timeout(v) {
                Ok(d) => return Some(after(Instant::now(), d)),
                Err(e) => tracing::warn!(error = %e, "ignoring malformed grpc-timeout"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "ignoring repeated grpc-timeout"),
        }
    }
    total.map(|t| after(Instant::now(), t))
}

/// The `grpc-timeout` of an attempt: the time left before the deadline, capped at the attempt
/// timeout (the client abandons the attempt then, so the server should stop too).
fn grpc_timeout(
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
) -> Option<HeaderValue> {
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    let t = match (left, attempt_timeout) {
        (Some(l), Some(a)) => l.min(a),
        (l, a) => l.or(a)?,
    };
    Some(encode_grpc_timeout(t))
}

fn attempt_timer(
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
) -> Option<Pin<Box<Sleep>>> {
    let per_attempt = attempt_timeout.map(|t| after(Instant::now(), t));
    let end = match (deadline, per_attempt) {
        (Some(d), Some(a)) => d.min(a),
        (d, a) => d.or(a)?,
    };
    Some(Box::pin(sleep_until(end)))
}

/// Points `timer` at `until`, making it if there is none yet.
fn set_timer(timer: &mut Option<Pin<Box<Sleep>>>, until: Instant) {
    match timer.as_mut() {
        Some(t) => t.as_mut().reset(until),
        None => *timer = Some(Box::pin(sleep_until(until))),
    }
}

/// True when the timer exists and has fired.
fn fired(timer: &mut Option<Pin<Box<Sleep>>>, cx: &mut Context<'_>) -> bool {
    match timer.as_mut() {
        Some(t) => t.as_mut().poll(cx).is_ready(),
        None => false,
    }
}

impl<S, B, R> Ctx<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    /// The three checks (retryable, an attempt left, the deadline fits), pushback and the
    /// budget, in that order.
    fn after_attempt(&mut self, result: Result<Response<R>, BoxError>) -> Step<R> {
        let shared = &*self.shared;
        let policy = &shared.policy;
        let rules = policy.rules(self.method);
        let outcome = match &result {
            Ok(res) => classify::response(res, self.grpc, &policy.reason_codes),
            Err(e) => classify::error(e),
        };
        let verdict = rules.table.verdict(outcome, self.idempotent);
        // gRFC A6 throttling: a success adds to the budget; an attempt that failed in a way the
        // policy would retry takes from it. A conflict only counts when a hook could retry it.
        match (outcome, verdict) {
            (Outcome::Status(Code::Ok), _) => shared.budget.record(false),
            (_, Verdict::Retry) => shared.budget.record(true),
            (_, Verdict::Rebuild) if policy.rebuild.is_some() => shared.budget.record(true),
            _ => {}
        }
        // The common case, a final answer, returns before anything else is looked at.
        if verdict == Verdict::Final {
            return Step::Return(result);
        }
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let rules = policy.rules(self.method);
        let code = outcome.code();
        let rebuild_hook = match verdict {
            Verdict::Final => return Step::Return(result),
            Verdict::Rebuild => match (&policy.rebuild, &result) {
                (Some(hook), Ok(_)) => Some(hook.clone()),
                _ => return Step::Return(result),
            },
            Verdict::Retry => None,
        };
        if self.parts.is_none() || (self.fixed_body.is_none() && !self.body.is_replayable()) {
            tracing::debug!(code = %code, "not retrying: the request body could not be kept");
            return Step::Return(result);
        }

        let unsent = outcome == Outcome::Unsent;
        let transparent = unsent && self.unsent_retries < policy.max_unsent_retries;
        if self.attempt >= rules.max_attempts && !transparent {
            shared.stats.incr(Counter::Exhausted);
            tracing::info!(attempt = self.attempt, code = %code, "giving up: no attempt left");
            return Step::Return(result);
        }

        let pushback = match &result {
            Ok(r) => classify::pushback(r.headers()),
            Err(_) => PushbackHint::None,
        };
        let (delay, pushed_back) = match pushback {
            PushbackHint::Stop => {
                shared.stats.incr(Counter::PushbackStops);
                tracing::info!(attempt = self.attempt, code = %code, "giving up: server pushback says stop");
                return Step::Return(result);
            }
            PushbackHint::After(d) if d > policy.max_pushback => {
                shared.stats.incr(Counter::PushbackStops);
                tracing::info!(attempt = self.attempt, code = %code, pushback_ms = d.as_millis() as u64, "giving up: pushback longer than max_pushback");
                return Step::Return(result);
            }
            PushbackHint::After(d) => (d, true),
            PushbackHint::None if rebuild_hook.is_some() => (Duration::ZERO, false),
            PushbackHint::None => {
                let u = policy.rng.sample();
                let n = self.backoff_step.saturating_add(1);
                (rules.backoff.delay(n, u, self.previous_delay), false)
            }
        };

        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left < delay.saturating_add(policy.min_attempt_budget) {
                shared.stats.incr(Counter::DeadlineStops);
                tracing::info!(attempt = self.attempt, code = %code, delay_ms = delay.as_millis() as u64, left_ms = left.as_millis() as u64, "giving up: the deadline cannot fit another attempt");
                return Step::Return(result);
            }
        }

        // A rebuild needs the whole body the conflict answered; without it the conflict is the
        // answer, and nothing is counted or taken from the budget.
        let conflict = match rebuild_hook {
            None => None,
            Some(hook) => {
                let body = match self
                    .fixed_body
                    .clone()
                    .or_else(|| self.body.complete_bytes())
                {
                    Some(b) => b,
                    None => {
                        tracing::debug!(code = %code, "not rebuilding: the request body was not read whole");
                        return Step::Return(result);
                    }
                };
                Some((hook, body))
            }
        };

        if conflict.is_none() && !shared.budget.withdraw() {
            shared.stats.incr(Counter::BudgetRefusals);
            tracing::warn!(attempt = self.attempt, code = %code, "retry budget exhausted: not retrying");
            return Step::Return(result);
        }

        if self.attempt >= rules.max_attempts {
            self.unsent_retries += 1;
        }
        // After a pushback the schedule restarts from its base (gRFC A6).
        if pushed_back {
            self.backoff_step = 0;
            self.previous_delay = Duration::ZERO;
        } else if conflict.is_none() {
            self.backoff_step = self.backoff_step.saturating_add(1);
            self.previous_delay = delay;
        }
        // Readers of the attempts so far must stop now: a transport may still be sending them.
        self.body.cut_off();

        match conflict {
            None => {
                shared.stats.incr(Counter::Retries);
                tracing::debug!(attempt = self.attempt, code = %code, delay_ms = delay.as_millis() as u64, "retrying");
                Step::Wait(delay)
            }
            Some((hook, body)) => {
                let Ok(response) = result else {
                    return Step::Return(result);
                };
                let parts = clone_parts(self.parts.as_ref().expect("checked above"));
                let mut head = Response::new(()).into_parts().0;
                head.status = response.status();
                head.version = response.version();
                head.headers = response.headers().clone();
                let conflict = Conflict {
                    request: Request::from_parts(parts, body),
                    code,
                    response: head,
                };
                tracing::debug!(attempt = self.attempt, code = %code, "rebuilding the request");
                Step::Rebuild(hook.rebuild(conflict), response)
            }
        }
    }

    /// Takes the request a hook rebuilt: decides its idempotency and key afresh (a rebuilt
    /// write keeps the intent's key unless the hook set another), then asks the budget.
    /// Returns false when the budget refuses the retry.
    fn take_rebuilt(&mut self, req: Request<Bytes>) -> bool {
        let shared = self.shared.clone();
        let policy = &shared.policy;
        if !shared.budget.withdraw() {
            shared.stats.incr(Counter::BudgetRefusals);
            tracing::warn!(
                attempt = self.attempt,
                "retry budget exhausted: not sending the rebuilt request"
            );
            return false;
        }
        shared.stats.incr(Counter::Retries);
        let (mut parts, body) = req.into_parts();
        let intent_key = self.parts.as_ref().and_then(|old| {
            policy
                .key_headers
                .as_slice()
                .iter()
                .find_map(|h| old.headers.get(h).map(|v| (h.clone(), v.clone())))
        });
        // Headers the layer writes per attempt are written afresh.
        parts.headers.remove(X_PREVIOUS_ATTEMPTS);
        parts.headers.remove(GRPC_PREVIOUS_RPC_ATTEMPTS);
        self.grpc = reason_code::is_grpc(&parts.headers);
        self.method = if self.grpc {
            policy.grpc_method(parts.uri.path())
        } else {
            None
        };
        let (idempotent, generated) = settle_key(policy, &mut parts, self.grpc, intent_key);
        self.idempotent = idempotent;
        if generated.is_some() {
            self.generated_key = generated;
        }
        self.parts = Some(parts);
        self.fixed_body = Some(body);
        true
    }

    /// Adds [`RetryInfo`] to a response that took retries or got a generated key; the common
    /// first-time success is left alone (no allocation).
    fn annotate(&mut self, mut res: Response<R>) -> Response<R> {
        if self.attempt > 1 || self.generated_key.is_some() {
            res.extensions_mut().insert(RetryInfo {
                attempts: self.attempt,
                idempotency_key: self.generated_key.take(),
            });
        }
        res
    }

    /// The call's answer: a response with its [`RetryInfo`], or the error as a [`RetryError`]
    /// that carries the attempts and the generated key.
    fn finish(&mut self, result: Result<Response<R>, BoxError>) -> Result<Response<R>, BoxError> {
        match result {
            Ok(res) => Ok(self.annotate(res)),
            Err(e) => Err(Box::new(RetryError::new(
                e,
                self.attempt,
                self.generated_key.take(),
            ))),
        }
    }

    fn next_request(&mut self) -> Request<ReplayBody<B>> {
        let mut parts = clone_parts(self.parts.as_ref().expect("retries keep the head"));
        let previous = HeaderValue::from(self.attempt);
        if self.grpc {
            parts.headers.insert(GRPC_PREVIOUS_RPC_ATTEMPTS, previous);
            let policy = &self.shared.policy;
            if let Some(t) = grpc_timeout(self.deadline, policy.attempt_timeout) {
                parts.headers.insert(GRPC_TIMEOUT, t);
            }
        } else {
            parts.headers.insert(X_PREVIOUS_ATTEMPTS, previous);
        }
        let body = match &self.fixed_body {
            Some(b) => ReplayBody::fixed(b.clone()),
            None => self.body.replay(),
        };
        Request::from_parts(parts, body)
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Called { future } => {
                    let result = match future.poll(cx) {
                        Poll::Ready(r) => r.map_err(Into::into),
                        Poll::Pending => {
                            if !fired(this.timer, cx) {
                                return Poll::Pending;
                            }
                            if this.ctx.deadline.is_some_and(|d| Instant::now() >= d) {
                                this.state.set(State::Done);
                                let e = DeadlineExceeded::new().into();
                                return Poll::Ready(this.ctx.finish(Err(e)));
                            }
                            Err(AttemptTimedOut::new().into())
                        }
                    };
                    match this.ctx.after_attempt(result) {
                        Step::Return(r) => {
                            this.state.set(State::Done);
                            return Poll::Ready(this.ctx.finish(r));
                        }
                        Step::Wait(delay) => {
                            set_timer(this.timer, after(Instant::now(), delay));
                            this.state.set(State::Waiting);
                        }
                        Step::Rebuild(future, response) => {
                            // The hook runs within the call's deadline.
                            match this.ctx.deadline {
                                Some(d) => set_timer(this.timer, d),
                                None => *this.timer = None,
                            }
                            this.state.set(State::Rebuilding {
                                future,
                                response: Some(response),
                            })
                        }
                    }
                }
                StateProj::Waiting => {
                    if let Some(timer) = this.timer.as_mut() {
                        ready!(timer.as_mut().poll(cx));
                    }
                    // Waiting for the inner service to be ready is bounded by the deadline.
                    match this.ctx.deadline {
                        Some(d) => set_timer(this.timer, d),
                        None => *this.timer = None,
                    }
                    this.state.set(State::Retrying);
                }
                StateProj::Rebuilding { future, response } => {
                    let rebuilt = match future.as_mut().poll(cx) {
                        Poll::Ready(r) => r,
                        Poll::Pending => {
                            if !fired(this.timer, cx) {
                                return Poll::Pending;
                            }
                            this.state.set(State::Done);
                            let e = DeadlineExceeded::new().into();
                            return Poll::Ready(this.ctx.finish(Err(e)));
                        }
                    };
                    let accepted = match rebuilt {
                        Some(req) => this.ctx.take_rebuilt(req),
                        None => false,
                    };
                    if accepted {
                        this.state.set(State::Retrying);
                    } else {
                        let response = response.take().expect("held until the hook decides");
                        this.state.set(State::Done);
                        return Poll::Ready(this.ctx.finish(Ok(response)));
                    }
                }
                StateProj::Retrying => {
                    match this.ctx.service.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            return Poll::Ready(this.ctx.finish(Err(e.into())));
                        }
                        Poll::Pending => {
                            if !fired(this.timer, cx) {
                                return Poll::Pending;
                            }
                            this.state.set(State::Done);
                            let e = DeadlineExceeded::new().into();
                            return Poll::Ready(this.ctx.finish(Err(e)));
                        }
                    }
                    let req = this.ctx.next_request();
                    this.ctx.attempt += 1;
                    this.ctx.shared.stats.incr(Counter::Attempts);
                    let future = this.ctx.service.call(req);
                    let policy = &this.ctx.shared.policy;
                    *this.timer = attempt_timer(this.ctx.deadline, policy.attempt_timeout);
                    this.state.set(State::Called { future });
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

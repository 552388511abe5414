//! The response future: one state machine that sends attempts, waits, and decides.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
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
use crate::error::{AttemptTimedOut, DeadlineExceeded};
use crate::layer::Shared;
use crate::policy::{Conflict, RebuildFuture};
use crate::stats::Counter;
use crate::{BoxError, Deadline, RetryInfo};

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
    idempotent: bool,
    grpc: bool,
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

        let has_key = policy
            .key_headers
            .iter()
            .any(|h| parts.headers.contains_key(h));
        let mut idempotent = has_key
            || if grpc {
                is_declared_idempotent(&policy.idempotent_grpc, parts.uri.path())
            } else {
                classify::is_idempotent_method(&parts.method)
            };
        let mut generated_key = None;
        if !idempotent && policy.ensure_key {
            let key = uuid::Uuid::new_v4();
            let mut buf = uuid::Uuid::encode_buffer();
            let key = key.hyphenated().encode_lower(&mut buf);
            let value = HeaderValue::from_str(key).expect("a UUID is a valid header value");
            parts
                .headers
                .insert(policy.key_headers[0].clone(), value.clone());
            generated_key = Some(value);
            idempotent = true;
        }

        let deadline = deadline_of(&parts, grpc, policy.total_timeout);
        if let (true, Some(d)) = (grpc, deadline) {
            parts.headers.insert(GRPC_TIMEOUT, remaining_timeout(d));
        }

        let (first_body, body) = ReplayBody::new(body, policy.max_replay_bytes);
        let retries_possible = policy.max_attempts > 1 || policy.max_unsent_retries > 0;
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
                idempotent,
                grpc,
                deadline,
                previous_delay: Duration::ZERO,
                generated_key,
            },
        }
    }
}

fn is_declared_idempotent(set: &std::collections::HashSet<String>, path: &str) -> bool {
    if set.is_empty() {
        return false;
    }
    if set.contains(path) {
        return true;
    }
    // "/package.Service/" declares every method of the service.
    match path.rfind('/') {
        Some(i) if i > 0 => set.contains(&path[..=i]),
        _ => false,
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
                Ok(d) => return Some(Instant::now() + d),
                Err(e) => tracing::warn!(error = %e, "ignoring malformed grpc-timeout"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "ignoring repeated grpc-timeout"),
        }
    }
    total.map(|t| Instant::now() + t)
}

fn remaining_timeout(deadline: Instant) -> HeaderValue {
    encode_grpc_timeout(deadline.saturating_duration_since(Instant::now()))
}

fn attempt_timer(
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
) -> Option<Pin<Box<Sleep>>> {
    let per_attempt = attempt_timeout.map(|t| Instant::now() + t);
    let end = match (deadline, per_attempt) {
        (Some(d), Some(a)) => d.min(a),
        (d, a) => d.or(a)?,
    };
    Some(Box::pin(sleep_until(end)))
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
        let (outcome, verdict) = {
            let shared = &*self.shared;
            let outcome = match &result {
                Ok(res) => classify::response(res, self.grpc, &shared.policy.reason_codes),
                Err(e) => classify::error(e),
            };
            let verdict = shared.policy.table.verdict(outcome, self.idempotent);
            match (outcome, verdict) {
                (Outcome::Status(Code::Ok), _) => shared.budget.record(false),
                (_, Verdict::Retry | Verdict::Rebuild) => shared.budget.record(true),
                _ => {}
            }
            (outcome, verdict)
        };
        // The common case, a final answer, returns before anything else is looked at.
        if verdict == Verdict::Final {
            return Step::Return(result);
        }
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let code = outcome.code();
        let rebuild_hook = match verdict {
            Verdict::Final => return Step::Return(result),
            Verdict::Rebuild => match &policy.rebuild {
                Some(hook) => Some(hook.clone()),
                None => return Step::Return(result),
            },
            Verdict::Retry => None,
        };
        if self.parts.is_none() || (self.fixed_body.is_none() && !self.body.is_replayable()) {
            tracing::debug!(code = %code, "not retrying: the request body could not be kept");
            return Step::Return(result);
        }

        let unsent = outcome == Outcome::Unsent;
        let transparent = unsent && self.unsent_retries < policy.max_unsent_retries;
        if self.attempt >= policy.max_attempts && !transparent {
            shared.stats.incr(Counter::Exhausted);
            tracing::info!(attempt = self.attempt, code = %code, "giving up: no attempt left");
            return Step::Return(result);
        }

        let delay = match result.as_ref().map(|r| classify::pushback(r.headers())) {
            Ok(PushbackHint::Stop) => {
                shared.stats.incr(Counter::PushbackStops);
                tracing::info!(attempt = self.attempt, code = %code, "giving up: server pushback says stop");
                return Step::Return(result);
            }
            Ok(PushbackHint::After(d)) if d > policy.max_pushback => {
                shared.stats.incr(Counter::PushbackStops);
                tracing::info!(attempt = self.attempt, code = %code, pushback_ms = d.as_millis() as u64, "giving up: pushback longer than max_pushback");
                return Step::Return(result);
            }
            Ok(PushbackHint::After(d)) => d,
            _ if rebuild_hook.is_some() => Duration::ZERO,
            _ => {
                let u = policy.rng.sample();
                policy.backoff.delay(self.attempt, u, self.previous_delay)
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

        if !shared.budget.withdraw() {
            shared.stats.incr(Counter::BudgetRefusals);
            tracing::warn!(attempt = self.attempt, code = %code, "retry budget exhausted: not retrying");
            return Step::Return(result);
        }

        if self.attempt >= policy.max_attempts {
            self.unsent_retries += 1;
        }
        shared.stats.incr(Counter::Retries);
        tracing::debug!(attempt = self.attempt, code = %code, delay_ms = delay.as_millis() as u64, "retrying");
        self.previous_delay = delay;

        match rebuild_hook {
            None => Step::Wait(delay),
            Some(hook) => {
                let Ok(response) = result else {
                    return Step::Return(result);
                };
                let body = match self
                    .fixed_body
                    .clone()
                    .or_else(|| self.body.complete_bytes())
                {
                    Some(b) => b,
                    None => return Step::Return(Ok(response)),
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
                Step::Rebuild(hook.rebuild(conflict), response)
            }
        }
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

    fn next_request(&mut self) -> Request<ReplayBody<B>> {
        let mut parts = clone_parts(self.parts.as_ref().expect("retries keep the head"));
        let previous = HeaderValue::from(self.attempt);
        if self.grpc {
            parts.headers.insert(GRPC_PREVIOUS_RPC_ATTEMPTS, previous);
            if let Some(d) = self.deadline {
                parts.headers.insert(GRPC_TIMEOUT, remaining_timeout(d));
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
                            let fired = match this.timer.as_mut() {
                                Some(timer) => timer.as_mut().poll(cx).is_ready(),
                                None => false,
                            };
                            if !fired {
                                return Poll::Pending;
                            }
                            if this.ctx.deadline.is_some_and(|d| Instant::now() >= d) {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(DeadlineExceeded::new().into()));
                            }
                            Err(AttemptTimedOut::new().into())
                        }
                    };
                    match this.ctx.after_attempt(result) {
                        Step::Return(r) => {
                            this.state.set(State::Done);
                            return Poll::Ready(r.map(|res| this.ctx.annotate(res)));
                        }
                        Step::Wait(delay) => {
                            let until = Instant::now() + delay;
                            match this.timer.as_mut() {
                                Some(t) => t.as_mut().reset(until),
                                None => *this.timer = Some(Box::pin(sleep_until(until))),
                            }
                            this.state.set(State::Waiting);
                        }
                        Step::Rebuild(future, response) => this.state.set(State::Rebuilding {
                            future,
                            response: Some(response),
                        }),
                    }
                }
                StateProj::Waiting => {
                    if let Some(timer) = this.timer.as_mut() {
                        ready!(timer.as_mut().poll(cx));
                    }
                    this.state.set(State::Retrying);
                }
                StateProj::Rebuilding { future, response } => {
                    match ready!(future.as_mut().poll(cx)) {
                        Some(req) => {
                            let (parts, body) = req.into_parts();
                            this.ctx.parts = Some(parts);
                            this.ctx.fixed_body = Some(body);
                            this.state.set(State::Retrying);
                        }
                        None => {
                            let response = response.take().expect("held until the hook decides");
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(this.ctx.annotate(response)));
                        }
                    }
                }
                StateProj::Retrying => {
                    if let Err(e) = ready!(this.ctx.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(e.into()));
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

//! [`ResponseFuture`]: the attempts of one hedged call in flight, the next hedge, and the bounds
//! that end the call (its deadline, each attempt's head timeout).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use reason_code::{BoxError, Code, Hop, Outcome};
use tokio::time::{sleep_until, Instant, Sleep};
use tower_service::Service;

use super::shared::HedgeShared;
use super::stats::incr;
use crate::body::{BodyHandle, ReplayBody};
use crate::classify::{self, PushbackHint};
use crate::deadline::{instant_after, rewrite_grpc_timeout};
use crate::error::{DeadlineExceeded, ResponseHeadTimedOut, ServiceNotReady};
use crate::request::{write_previous_attempts, SeenInFlight};

/// What a call's hedging follows, from its policy and request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) max_attempts: u32,
    pub(super) delay: Duration,
    /// By code number.
    pub(super) non_fatal: [bool; 17],
    pub(super) grpc: bool,
    pub(super) deadline: Option<Instant>,
    /// Attempts a retry layer above sent before this call (its attempt header): the hedges
    /// count on from it.
    pub(super) previous: u32,
}

/// One attempt in flight: its number (0 for the first), and when its head is due at the latest.
struct InFlight<F> {
    n: u32,
    head_by: Instant,
    future: Pin<Box<F>>,
}

/// The response future of [`Hedge`](super::Hedge).
///
/// Its attempts are boxed (there may be up to five at once, each the inner service's future);
/// the call ends at the first answer that is not a non-fatal failure, at its deadline, or once
/// no attempt is in flight and no hedge is due.
pub struct ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    service: S,
    shared: Arc<HedgeShared>,
    plan: Plan,
    /// The first attempt, while the service the call took is not ready for it (boxed: the
    /// rarer case pays for its room). Bounded by `ready_by` and the deadline.
    first: Option<Box<Request<ReplayBody<B>>>>,
    /// The hop the call is made from, when its request may be hedged: told when the call
    /// ends with a failure it could have tried again.
    hop: Option<Arc<Hop>>,
    /// A pushback said stop: a failure answer is the hop's "do not retry".
    pushback_stop: bool,
    /// The head hedges are sent with; `None` when the request is not hedged.
    parts: Option<Parts>,
    body: BodyHandle<B>,
    attempts: Vec<InFlight<S::Future>>,
    sent: u32,
    /// Attempts that ended provably never sent: a hedge's attempt header does not count them.
    unsent: u32,
    /// When the next hedge is due; `None` when no more will be sent.
    next_hedge: Option<Instant>,
    /// The budget granted the hedge that is due (asked before it waits for readiness, so that
    /// a refused hedge reserves no capacity of the service; given back if it is not sent).
    granted: bool,
    /// When the due hedge (or the first attempt) stops waiting for the service to become
    /// ready.
    ready_by: Option<Instant>,
    /// The one timer: the next hedge, the deadline, or the earliest head due.
    timer: Option<Pin<Box<Sleep>>>,
    /// The last non-fatal result, the answer if nothing better comes.
    last: Option<Result<S::Response, BoxError>>,
    /// `last` is an answer that said the key was in flight (kept over a later transport error,
    /// which would not carry that to the layer above).
    last_in_flight: bool,
    /// An attempt was told its key was in flight at the server: later hedges say so, and so
    /// does the answer (for a retry layer above).
    seen_in_flight: bool,
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("sent", &self.sent)
            .field("in_flight", &self.attempts.len())
            .finish_non_exhaustive()
    }
}

// Every field is either `Unpin` or pinned in a box.
impl<S, B> Unpin for ResponseFuture<S, B> where S: Service<Request<ReplayBody<B>>> {}

impl<S, B> Drop for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    /// A hedge the budget granted and that was never sent gives its token back.
    fn drop(&mut self) {
        self.refund();
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    /// Gives back the due hedge's budget token, if one was granted: it is not sent.
    fn refund(&mut self) {
        if std::mem::take(&mut self.granted) {
            self.shared.budget.refund();
        }
    }
}

impl<S, B, R> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    /// Sends the first attempt on `service` if it is `ready` (else once it is, bounded by the
    /// deadline and the head bound). `parts` is kept for hedges when the request is hedged.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        service: S,
        shared: Arc<HedgeShared>,
        plan: Plan,
        first: Request<ReplayBody<B>>,
        parts: Option<Parts>,
        body: BodyHandle<B>,
        ready: bool,
        hop: Option<Arc<Hop>>,
    ) -> Self {
        let mut future = ResponseFuture {
            service,
            shared,
            plan,
            first: None,
            hop,
            pushback_stop: false,
            parts,
            body,
            attempts: Vec::with_capacity(1),
            sent: 0,
            unsent: 0,
            next_hedge: None,
            granted: false,
            ready_by: None,
            timer: None,
            last: None,
            last_in_flight: false,
            seen_in_flight: false,
        };
        if ready {
            future.send_first(first);
        } else {
            // The wait is bounded by the call's deadline, else by the head bound.
            let head = future.shared.policy.response_head_timeout;
            let by = plan
                .deadline
                .unwrap_or_else(|| instant_after(Instant::now(), head));
            future.ready_by = Some(by);
            future.first = Some(Box::new(first));
        }
        future
    }

    /// Sends the first attempt on the service, which is ready.
    fn send_first(&mut self, first: Request<ReplayBody<B>>) {
        let now = Instant::now();
        let head_by = instant_after(now, self.shared.policy.response_head_timeout);
        let future = Box::pin(self.service.call(first));
        self.attempts.push(InFlight {
            n: 0,
            head_by,
            future,
        });
        self.sent = 1;
        self.ready_by = None;
        self.next_hedge = (self.plan.max_attempts > 1).then(|| instant_after(now, self.plan.delay));
    }

    /// Waits for the service the call took to be ready for the first attempt, then sends it.
    /// `Some` is the answer: the service's readiness error, or the bound that ended the wait.
    fn poll_first(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Response<R>, BoxError>>> {
        loop {
            match self.service.poll_ready(cx) {
                Poll::Ready(Ok(())) => {
                    let first = self.first.take().expect("held until sent");
                    self.send_first(*first);
                    return Poll::Ready(None);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                Poll::Pending => {}
            }
            let now = Instant::now();
            if self.plan.deadline.is_some_and(|d| now >= d) {
                // As when the deadline ends an attempt: the hop is told (it gives up when the
                // deadline was its inbound request's).
                self.tell_hop();
                return Poll::Ready(Some(Err(DeadlineExceeded::new().into())));
            }
            let ready_by = self.ready_by.expect("set while the first attempt waits");
            if now >= ready_by {
                tracing::debug!(
                    "hedge: the inner service did not become ready in time; nothing was sent"
                );
                let head = self.shared.policy.response_head_timeout;
                return Poll::Ready(Some(Err(ServiceNotReady::new(head).into())));
            }
            match self.next_wake(Some(ready_by)) {
                Some(at) if self.timer_fired(at, cx) => continue,
                _ => return Poll::Pending,
            }
        }
    }

    /// A call that sends nothing: `error` is its answer.
    pub(super) fn not_sent(
        service: S,
        shared: Arc<HedgeShared>,
        plan: Plan,
        error: BoxError,
    ) -> Self {
        ResponseFuture {
            service,
            shared,
            plan,
            first: None,
            hop: None,
            pushback_stop: false,
            parts: None,
            body: BodyHandle::empty(),
            attempts: Vec::new(),
            sent: 0,
            unsent: 0,
            next_hedge: None,
            granted: false,
            ready_by: None,
            timer: None,
            last: Some(Err(error)),
            last_in_flight: false,
            seen_in_flight: false,
        }
    }

    /// Reads one finished attempt: `Some` is the answer; `None` means it failed non-fatally
    /// (kept as the fallback answer), and the next hedge is due now, after the pushback, or
    /// never (a pushback that says stop, is longer than `max_pushback`, or than the deadline
    /// leaves).
    fn settle(
        &mut self,
        n: u32,
        result: Result<Response<R>, BoxError>,
    ) -> Option<Result<Response<R>, BoxError>> {
        let shared = &*self.shared;
        let outcome = match &result {
            Ok(res) => classify::response(res, self.plan.grpc, &shared.policy.reason_codes),
            Err(e) => classify::error(e),
        };
        if outcome == Outcome::Unsent {
            self.unsent += 1;
            // A hedge that provably never left gives back the token that paid for it.
            if n > 0 {
                self.shared.budget.refund();
            }
        }
        let non_fatal = match outcome {
            // A replayed answer is final: a replay of the same key answers the same again.
            _ if result
                .as_ref()
                .is_ok_and(|res| classify::replayed(res.headers())) =>
            {
                false
            }
            Outcome::Status(code) => self.plan.non_fatal[code.as_i32() as usize],
            // A transport error (or a head that did not come) of a hedged request: try another.
            _ => self.parts.is_some(),
        };
        if !non_fatal {
            if outcome == Outcome::Status(Code::Ok) {
                shared.budget.record(false);
            }
            // Sent once under an inbound retry (no head kept to hedge with): a failure on the
            // way is one a hedge could have tried again, and the hop is told, as for a 503.
            if self.parts.is_none() && !matches!(outcome, Outcome::Status(_)) {
                self.tell_hop();
            }
            if n > 0 {
                incr(&shared.stats.won_by_hedge);
            }
            return Some(result);
        }
        shared.budget.record(true);
        // Told its key is in flight at the server: every later hedge says so, and a server
        // that fails open never runs it beside that write (as the retry layer's later attempts),
        // and so does the answer, for a retry layer above.
        let told = outcome == Outcome::Status(Code::Unavailable)
            && result
                .as_ref()
                .is_ok_and(|res| shared.policy.reason_codes.says_in_flight(res.headers()));
        if told {
            self.seen_in_flight = true;
            if let Some(parts) = self.parts.as_mut() {
                parts.headers.insert(
                    reason_code::IDEMPOTENCY_SEEN_IN_FLIGHT,
                    http::HeaderValue::from_static("?1"),
                );
            }
        }
        let pushback = match &result {
            Ok(res) => classify::pushback(res.headers(), &shared.policy.reason_codes),
            Err(_) => PushbackHint::None,
        };
        let now = Instant::now();
        let next = match pushback {
            PushbackHint::Stop => {
                self.pushback_stop = true;
                None
            }
            PushbackHint::After(d) if d > shared.policy.max_pushback => {
                tracing::debug!(
                    pushback_ms = d.as_millis() as u64,
                    "not hedging: pushback longer than max_pushback"
                );
                None
            }
            // A quota answered "come back in 0": not at once, after the hedging delay.
            PushbackHint::After(d)
                if d.is_zero() && outcome == Outcome::Status(Code::ResourceExhausted) =>
            {
                Some(instant_after(now, self.plan.delay))
            }
            PushbackHint::After(d) => Some(instant_after(now, d)),
            PushbackHint::None | PushbackHint::Deferred => Some(now),
        };
        self.next_hedge = match (next, self.plan.deadline) {
            (Some(at), Some(deadline)) if at >= deadline => {
                tracing::debug!("not hedging: the pushback does not fit the deadline");
                None
            }
            (next, _) => next.filter(|_| self.sent < self.plan.max_attempts),
        };
        // A transport error does not replace an answer that said the key was in flight: that
        // one says what the layer above must know (nothing ran for it, and the key is in flight).
        // Nor does a hedge that provably never left replace an attempt's that did: answered
        // "never sent", a retry layer above would count its attempt as unsent (its retry would
        // tell the server it is a first attempt, and its token would come back).
        let keeps_last = self.last.is_some()
            && (outcome == Outcome::Unsent || (result.is_err() && self.last_in_flight));
        if !keeps_last {
            self.last = Some(result);
            self.last_in_flight = told;
        }
        None
    }

    /// The call ends with a failure it could have tried again: tells the hop it is made from,
    /// as `Retry` does. "Do not retry" when a pushback said stop or the inbound deadline is
    /// spent; else "retried below" (the caller retries only within its adaptive budget).
    fn tell_hop(&self) {
        let Some(hop) = &self.hop else {
            return;
        };
        if self.pushback_stop || hop.inbound_deadline_leaves_less_than(Duration::from_nanos(1)) {
            hop.note_gave_up();
        } else {
            hop.note_deferred();
        }
    }

    /// The call's answer, marked when an attempt was told its key was in flight.
    fn mark(&self, answer: Result<Response<R>, BoxError>) -> Result<Response<R>, BoxError> {
        answer.map(|mut res| {
            if self.seen_in_flight {
                res.extensions_mut().insert(SeenInFlight);
            }
            res
        })
    }

    /// Sends the next hedge if the body, the budget and the service allow it. `Pending` while
    /// the service is not ready.
    fn send_hedge(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(bytes) = self.body.complete_bytes() else {
            tracing::debug!("not hedging: the request body is not complete yet");
            self.next_hedge = None;
            return Poll::Ready(());
        };
        // The budget first: a hedge it refuses reserves no capacity of the service.
        if !self.granted {
            if !self.shared.budget.withdraw() {
                incr(&self.shared.stats.budget_refusals);
                tracing::debug!("not hedging: the retry budget refused");
                self.next_hedge = None;
                return Poll::Ready(());
            }
            self.granted = true;
        }
        match self.service.poll_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => {
                let e: BoxError = e.into();
                tracing::debug!(error = %e, "not hedging: the service failed readiness");
                self.next_hedge = None;
                self.refund();
                self.ready_by = None;
                return Poll::Ready(());
            }
            Poll::Ready(Ok(())) => {}
        }
        self.granted = false;
        self.ready_by = None;
        let mut parts = self
            .parts
            .as_ref()
            .expect("hedged requests keep the head")
            .clone();
        let previous = self.plan.previous + (self.sent - self.unsent);
        write_previous_attempts(&mut parts, self.plan.grpc, previous);
        if self.plan.grpc {
            rewrite_grpc_timeout(&mut parts, self.plan.deadline, None);
        }
        let now = Instant::now();
        let future = self
            .service
            .call(Request::from_parts(parts, ReplayBody::fixed(bytes)));
        self.attempts.push(InFlight {
            n: self.sent,
            head_by: instant_after(now, self.shared.policy.response_head_timeout),
            future: Box::pin(future),
        });
        self.sent += 1;
        incr(&self.shared.stats.hedges);
        self.next_hedge =
            (self.sent < self.plan.max_attempts).then(|| instant_after(now, self.plan.delay));
        Poll::Ready(())
    }

    /// Ends the attempts whose head is overdue, as transport failures. `Some` is the answer.
    fn expire_heads(&mut self, now: Instant) -> Option<Result<Response<R>, BoxError>> {
        let mut i = 0;
        while i < self.attempts.len() {
            if self.attempts[i].head_by > now {
                i += 1;
                continue;
            }
            // Dropping the future cancels the attempt (hyper and h2 abandon the request).
            let n = self.attempts.swap_remove(i).n;
            let e = ResponseHeadTimedOut::new(self.shared.policy.response_head_timeout);
            if let Some(answer) = self.settle(n, Err(e.into())) {
                return Some(answer);
            }
        }
        None
    }

    /// Points the timer at `at` and polls it: true when it has fired.
    fn timer_fired(&mut self, at: Instant, cx: &mut Context<'_>) -> bool {
        let timer = match &mut self.timer {
            Some(t) => {
                if t.deadline() != at {
                    t.as_mut().reset(at);
                }
                t
            }
            None => self.timer.insert(Box::pin(sleep_until(at))),
        };
        timer.as_mut().poll(cx).is_ready()
    }

    /// The earliest of the deadline and the heads due, and `also` if given.
    fn next_wake(&self, also: Option<Instant>) -> Option<Instant> {
        let heads = self.attempts.iter().map(|a| a.head_by).min();
        [self.plan.deadline, heads, also]
            .into_iter()
            .flatten()
            .min()
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
        let this = self.get_mut();
        if this.first.is_some() {
            if let Some(answer) = std::task::ready!(this.poll_first(cx)) {
                return Poll::Ready(answer);
            }
        }
        let answer = std::task::ready!(this.poll_answer(cx));
        // A hedge granted but not sent (the call ended while it waited for the service).
        this.refund();
        Poll::Ready(this.mark(answer))
    }
}

impl<S, B, R> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<Result<Response<R>, BoxError>> {
        let this = self;
        loop {
            let mut i = 0;
            while i < this.attempts.len() {
                match this.attempts[i].future.as_mut().poll(cx) {
                    Poll::Pending => i += 1,
                    Poll::Ready(result) => {
                        let n = this.attempts.swap_remove(i).n;
                        if let Some(answer) = this.settle(n, result.map_err(Into::into)) {
                            // The others are cancelled as they drop with the future.
                            this.attempts.clear();
                            return Poll::Ready(answer);
                        }
                    }
                }
            }
            let now = Instant::now();
            if this.plan.deadline.is_some_and(|d| now >= d) {
                this.attempts.clear();
                this.tell_hop();
                let answer = this
                    .last
                    .take()
                    .unwrap_or_else(|| Err(DeadlineExceeded::new().into()));
                return Poll::Ready(answer);
            }
            if let Some(answer) = this.expire_heads(now) {
                this.attempts.clear();
                return Poll::Ready(answer);
            }
            if this.next_hedge.is_some_and(|at| at <= now) {
                if this.send_hedge(cx).is_pending() {
                    if this.attempts.is_empty() && matches!(this.last, Some(Ok(_))) {
                        // Every attempt sent has failed and the service is not ready for the
                        // next: the failure in hand is the answer. Held through the wait, its
                        // unread body may be what keeps the service from being ready (one
                        // HTTP/1.1 connection is ready only once the body before it is read);
                        // a retry layer above lets it go and retries after its backoff.
                        tracing::debug!(
                            "not hedging: the service is not ready and a failed answer is in hand"
                        );
                        this.next_hedge = None;
                        this.ready_by = None;
                        this.refund();
                        continue;
                    }
                    // Waiting for readiness, bounded by the deadline, the heads due and the
                    // response head timeout (with no attempt in flight and no deadline, that
                    // timer is the only one).
                    let ready_by = *this.ready_by.get_or_insert_with(|| {
                        instant_after(now, this.shared.policy.response_head_timeout)
                    });
                    if now >= ready_by {
                        tracing::debug!("not hedging: the service did not become ready in time");
                        this.next_hedge = None;
                        this.ready_by = None;
                        this.refund();
                        continue;
                    }
                    match this.next_wake(Some(ready_by)) {
                        Some(at) if this.timer_fired(at, cx) => continue,
                        _ => return Poll::Pending,
                    }
                }
                continue;
            }
            if this.attempts.is_empty() && this.next_hedge.is_none() {
                this.tell_hop();
                return Poll::Ready(
                    this.last
                        .take()
                        .expect("an attempt ended before the last one was settled"),
                );
            }
            match this.next_wake(this.next_hedge) {
                Some(at) if this.timer_fired(at, cx) => continue,
                _ => return Poll::Pending,
            }
        }
    }
}

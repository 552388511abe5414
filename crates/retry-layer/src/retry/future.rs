//! The response future: one state machine that sends attempts and waits. What to do after an
//! attempt is decided in [`decide`](crate::retry::decide) and carried out by [`Call`]; this file only
//! drives.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use reason_code::BoxError;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use crate::body::ReplayBody;
use crate::deadline::{instant_after, Bound, Timer};
use crate::error::{AttemptTimedOut, ResponseHeadTimedOut};
use crate::retry::call::{Call, Next};
use crate::retry::observe;
use crate::retry::policy::RebuildFuture;
use crate::retry::shared::Shared;

pin_project! {
    /// The response future of [`Retry`](crate::Retry).
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        state: State<S::Future, S::Response>,
        // The attempt's end while an attempt runs; the backoff while waiting; the deadline
        // while waiting for readiness or the rebuild hook.
        #[pin]
        timer: Timer,
        call: Call<S, B>,
        // `retry_layer.call`, entered while the future is polled, and the `retry_layer.attempt`
        // of the attempt in flight, entered while its future is polled. Both are
        // `Span::none()` unless a subscriber enables DEBUG.
        call_span: Span,
        attempt_span: Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, T> {
        Called { #[pin] future: F },
        // The last attempt's result (or the conflict a rebuilt request answers) is held until
        // the next attempt is sent: it is the answer if the deadline leaves too little by then.
        Waiting { last: Option<Result<T, BoxError>> },
        // The conflict response is held until the hook decides: it is the answer if it declines.
        Rebuilding { future: RebuildFuture, response: Option<T> },
        Retrying { last: Option<Result<T, BoxError>> },
        // Nothing was sent: the deadline had passed, or the body failed before its first byte.
        NotSent,
        Done,
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("attempt", &self.call.attempts())
            .finish_non_exhaustive()
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    /// The call's deadline (fixed when the call starts).
    #[cfg(feature = "tonic")]
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.call.deadline()
    }
}

impl<S, B, R> ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    /// Sends the first attempt on `service` (which must be ready).
    /// `waited`: how long the caller waited for `service` to become ready (the call's
    /// `total_timeout` counts from the start of that wait).
    pub(crate) fn new(
        service: S,
        shared: std::sync::Arc<Shared>,
        req: Request<B>,
        waited: std::time::Duration,
    ) -> Self {
        let (call, future, timer, call_span) = Call::start(service, shared, req, waited);
        let attempt_span = observe::attempt_span(&call_span, call.grpc(), 0);
        let state = match future {
            Some(future) => State::Called { future },
            None => State::NotSent,
        };
        ResponseFuture {
            state,
            timer,
            call,
            call_span,
            attempt_span,
        }
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
        let _entered = this.call_span.enter();
        let answer = loop {
            match this.state.as_mut().project() {
                StateProj::Called { future } => {
                    let result = match this.attempt_span.in_scope(|| future.poll(cx)) {
                        Poll::Ready(r) => r.map_err(Into::into),
                        Poll::Pending => {
                            if !this.timer.as_mut().fired(cx) {
                                return Poll::Pending;
                            }
                            if this.call.deadline_passed() {
                                this.state.set(State::Done);
                                break this.call.deadline_ended();
                            }
                            match this.timer.bound() {
                                Bound::Head => {
                                    Err(ResponseHeadTimedOut::new(this.call.head_timeout()).into())
                                }
                                _ => Err(AttemptTimedOut::new().into()),
                            }
                        }
                    };
                    match this.call.after_attempt(result, this.attempt_span) {
                        Next::Answer(r) => {
                            this.state.set(State::Done);
                            break this.call.answer(r);
                        }
                        Next::Wait(delay, last) => {
                            this.timer
                                .as_mut()
                                .set_delay(instant_after(Instant::now(), delay));
                            this.state.set(State::Waiting { last: Some(last) });
                        }
                        Next::Rebuild(future, response) => {
                            // The hook runs within the call's deadline (or the head bound).
                            this.timer
                                .as_mut()
                                .set_to_deadline(this.call.deadline(), this.call.head_timeout());
                            this.state.set(State::Rebuilding {
                                future,
                                response: Some(response),
                            })
                        }
                    }
                }
                StateProj::Waiting { last } => {
                    if !this.timer.as_mut().fired(cx) {
                        return Poll::Pending;
                    }
                    // Waiting for the inner service to be ready is bounded by the deadline, or
                    // without one by the head bound: the next head cannot come before.
                    this.timer
                        .as_mut()
                        .set_to_deadline(this.call.deadline(), this.call.head_timeout());
                    let last = last.take();
                    this.state.set(State::Retrying { last });
                }
                StateProj::Rebuilding { future, response } => {
                    let rebuilt = match future.as_mut().poll(cx) {
                        Poll::Ready(r) => r,
                        Poll::Pending => {
                            if !this.timer.as_mut().fired(cx) {
                                return Poll::Pending;
                            }
                            if this.timer.bound() == Bound::Deadline {
                                this.state.set(State::Done);
                                break this.call.deadline_ended();
                            }
                            // A hook that does not answer within the head bound declines.
                            tracing::debug!(
                                "the rebuild hook did not answer in time: returning the conflict"
                            );
                            let response = response.take().expect("held until the hook decides");
                            this.state.set(State::Done);
                            break this.call.answer(Ok(response));
                        }
                    };
                    let send_at = match rebuilt {
                        Some(req) => this.call.take_rebuilt(req),
                        None => None,
                    };
                    if let Some(send_at) = send_at {
                        // After the server's pushback, if it asked for one.
                        this.timer.as_mut().set_delay(send_at);
                        let last = response.take().map(Ok);
                        this.state.set(State::Waiting { last });
                    } else {
                        let response = response.take().expect("held until the hook decides");
                        this.state.set(State::Done);
                        break this.call.answer(Ok(response));
                    }
                }
                StateProj::Retrying { last } => {
                    match this.call.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            break this.call.answer(Err(e));
                        }
                        Poll::Pending => {
                            if !this.timer.as_mut().fired(cx) {
                                return Poll::Pending;
                            }
                            this.state.set(State::Done);
                            if this.timer.bound() == Bound::Deadline {
                                break this.call.deadline_ended();
                            }
                            let e = ResponseHeadTimedOut::new(this.call.head_timeout()).into();
                            break this.call.answer(Err(e));
                        }
                    }
                    // The wait for readiness took time: the attempt is sent only if the deadline
                    // still leaves `min_attempt_time` for it.
                    if this.call.deadline_leaves_no_attempt() {
                        let last = last.take().expect("held until the next attempt is sent");
                        this.state.set(State::Done);
                        break this.call.answer(last);
                    }
                    // The last attempt's answer goes before the next attempt is sent (a
                    // response holds its connection).
                    drop(last.take());
                    let (future, bounds) = this.call.send_retry();
                    *this.attempt_span = observe::attempt_span(
                        this.call_span,
                        this.call.grpc(),
                        this.call.attempts() - 1,
                    );
                    this.timer.as_mut().next_attempt(bounds);
                    this.state.set(State::Called { future });
                }
                StateProj::NotSent => {
                    this.state.set(State::Done);
                    break this.call.answer_not_sent();
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        };
        *this.attempt_span = Span::none();
        observe::record_call(
            this.call_span,
            &answer,
            this.call.grpc(),
            this.call.attempts(),
        );
        Poll::Ready(answer)
    }
}

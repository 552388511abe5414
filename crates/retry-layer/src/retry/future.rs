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
use crate::error::{AttemptTimedOut, DeadlineExceeded, ResponseHeadTimedOut, ServiceNotReady};
use crate::retry::call::{Call, First, Next};
use crate::retry::drain::{drain, Draining};
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
        state: State<S::Future, S::Response, B>,
        // The attempt's end while an attempt runs; the backoff while waiting; the deadline
        // (or the head bound) while waiting for readiness or the rebuild hook.
        #[pin]
        timer: Timer,
        call: Call<S, B>,
        // The last failed response's body, read and discarded while the call waits for its
        // retry (its connection is free for the retry once it is); `None` once read, or when
        // there is none.
        drain: Option<Draining>,
        // `retry_layer.call`, entered while the future is polled, and the `retry_layer.attempt`
        // of the attempt in flight, entered while its future is polled. Both are
        // `Span::none()` unless a subscriber enables DEBUG.
        call_span: Span,
        attempt_span: Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, T, B> {
        // The first attempt, waiting for the service the call took to become ready.
        Readying { request: Option<Box<Request<ReplayBody<B>>>> },
        Called { #[pin] future: F },
        // The backoff (or pushback) before a retry. Nothing of the last attempt is held.
        Waiting,
        // The conflict response is held until the hook decides: it is the answer if it declines.
        // (Boxed: a rare state, and a response head would otherwise size every call's future.)
        Rebuilding { future: RebuildFuture, response: Option<Box<T>> },
        // Waiting for the service to be ready for the retry.
        Retrying,
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
    R: Body + Send + 'static,
{
    /// Sends the first attempt on `service` if it is `ready` (its `poll_ready` said so), else
    /// once it is, bounded by the call's deadline or the head bound.
    pub(crate) fn new(
        service: S,
        shared: std::sync::Arc<Shared>,
        req: Request<B>,
        ready: bool,
    ) -> Self {
        Call::start(
            service,
            shared,
            req,
            ready,
            |call, first, timer, call_span| {
                let attempt_span = observe::attempt_span(&call_span, call.grpc(), 0);
                let state = match first {
                    First::Sent(future) => State::Called { future },
                    First::Unready(request) => State::Readying {
                        request: Some(request),
                    },
                    First::NotSent => State::NotSent,
                };
                ResponseFuture {
                    state,
                    timer,
                    call,
                    drain: None,
                    call_span,
                    attempt_span,
                }
            },
        )
    }
}

impl<S, B, R> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body + Send + 'static,
{
    type Output = Result<Response<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.call_span.enter();
        let answer = loop {
            match this.state.as_mut().project() {
                StateProj::Readying { request } => {
                    match this.call.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            break this.call.answer(Err(e));
                        }
                        Poll::Pending => {
                            let Some(answer) = not_ready(this.call, this.timer.as_mut(), cx) else {
                                return Poll::Pending;
                            };
                            this.state.set(State::Done);
                            break answer;
                        }
                    }
                    if this.call.deadline_passed() {
                        this.state.set(State::Done);
                        break this.call.deadline_ended();
                    }
                    let request = request.take().expect("held until the service is ready");
                    let future = this.call.send_first(*request);
                    this.timer.as_mut().next_attempt(this.call.bounds());
                    this.state.set(State::Called { future });
                }
                StateProj::Called { future } => {
                    poll_drain(this.drain, cx);
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
                    match this.call.after_attempt(&result, this.attempt_span) {
                        Next::Answer => {
                            this.state.set(State::Done);
                            break this.call.answer(result);
                        }
                        Next::Wait(delay) => {
                            // A response's body is read and let go while the call waits.
                            *this.drain = result.ok().map(|res| drain(res.into_body()));
                            this.timer
                                .as_mut()
                                .set_delay(instant_after(Instant::now(), delay));
                            this.state.set(State::Waiting);
                        }
                        Next::Rebuild(future) => {
                            // Only a response is rebuilt.
                            let response = match result {
                                Ok(response) => response,
                                Err(e) => {
                                    this.state.set(State::Done);
                                    break this.call.answer(Err(e));
                                }
                            };
                            // The hook runs within the call's deadline (or the head bound).
                            this.timer
                                .as_mut()
                                .set_to_deadline(this.call.deadline(), this.call.head_timeout());
                            this.state.set(State::Rebuilding {
                                future,
                                response: Some(Box::new(response)),
                            })
                        }
                    }
                }
                StateProj::Waiting => {
                    poll_drain(this.drain, cx);
                    if !this.timer.as_mut().fired(cx) {
                        return Poll::Pending;
                    }
                    // Waiting for the inner service to be ready is bounded by the deadline, or
                    // without one by the head bound.
                    this.timer
                        .as_mut()
                        .set_to_ready_bound(this.call.deadline(), this.call.head_timeout());
                    this.state.set(State::Retrying);
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
                            break this.call.answer(Ok(*response));
                        }
                    };
                    let send_at = match rebuilt {
                        Some(req) => this.call.take_rebuilt(req),
                        None => None,
                    };
                    if let Some(send_at) = send_at {
                        // After the server's pushback, if it asked for one. The conflict is let
                        // go: its body is drained meanwhile.
                        let conflict = response.take().expect("held until the hook decides");
                        *this.drain = Some(drain(conflict.into_body()));
                        this.timer.as_mut().set_delay(send_at);
                        this.state.set(State::Waiting);
                    } else {
                        let response = response.take().expect("held until the hook decides");
                        this.state.set(State::Done);
                        break this.call.answer(Ok(*response));
                    }
                }
                StateProj::Retrying => {
                    // On one HTTP/1 connection, the service is ready once the body is read.
                    poll_drain(this.drain, cx);
                    match this.call.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => {
                            this.state.set(State::Done);
                            break this.call.answer(Err(e));
                        }
                        Poll::Pending => {
                            let Some(answer) = not_ready(this.call, this.timer.as_mut(), cx) else {
                                return Poll::Pending;
                            };
                            this.state.set(State::Done);
                            break answer;
                        }
                    }
                    // The wait for readiness took time: the attempt is sent only if the deadline
                    // still leaves `min_attempt_time` for it.
                    if this.call.deadline_leaves_no_attempt() {
                        this.state.set(State::Done);
                        break this.call.answer(Err(DeadlineExceeded::new().into()));
                    }
                    // The last body is read on while the retry is in flight (an inner service
                    // that is always ready, a hedge, waits for its connection inside its own
                    // future): dropped unread, an HTTP/1.1 connection would close.
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

/// The service the call took is not ready yet: `None` while its bound leaves time, else the
/// answer: [`DeadlineExceeded`] at the call's deadline, [`ServiceNotReady`] at the head bound
/// (nothing was sent for this attempt).
fn not_ready<S, B, R>(
    call: &mut Call<S, B>,
    mut timer: Pin<&mut Timer>,
    cx: &mut Context<'_>,
) -> Option<Result<Response<R>, BoxError>>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body + Send + 'static,
{
    if !timer.as_mut().fired(cx) {
        return None;
    }
    if timer.bound() == Bound::Deadline {
        return Some(call.deadline_ended());
    }
    tracing::debug!(
        waited_ms = call.head_timeout().as_millis() as u64,
        "retry: the inner service did not become ready in time; nothing was sent"
    );
    Some(call.answer(Err(ServiceNotReady::new(call.head_timeout()).into())))
}

/// Reads on in the last failed response's body, if one is being drained; lets it go once read.
fn poll_drain(drain: &mut Option<Draining>, cx: &mut Context<'_>) {
    if let Some(d) = drain {
        if d.as_mut().poll(cx).is_ready() {
            *drain = None;
        }
    }
}

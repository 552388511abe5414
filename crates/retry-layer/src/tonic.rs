//! A nameable retrying tonic client (cargo feature `tonic`).
//!
//! [`RetryLayer`] hands its inner service requests whose body is a
//! [`ReplayBody`]; a tonic `Channel` takes `tonic::body::Body`. [`TonicBody`] converts between
//! the two, so the retrying channel is a plain, nameable type, [`RetryChannel<Channel>`], that a
//! generated client can hold in a struct field or a type alias (a `map_request` closure would
//! make it unnameable).
//!
//! Its errors are `tonic::Status`es, so that a tonic client sees the
//! classified outcome rather than `Unknown` (which every tier above would take as final): the
//! layer's timeouts ([`DeadlineExceeded`],
//! [`AttemptTimedOut`],
//! [`ResponseHeadTimedOut`], and the channel's own
//! `TimeoutExpired` at the `grpc-timeout` the layer wrote) are DEADLINE_EXCEEDED, a status
//! tonic or the server made is kept as it is, and every other failure of the transport
//! (connection refused or reset, DNS, TLS) is UNAVAILABLE. The [`RetryError`] (attempts, the
//! generated key, the cause) is the status's source: [`retry_error`] finds it.
//!
//! The call's deadline bounds its whole response, not only its head: a response body (the
//! message and the trailers of a unary call) still open when the deadline passes ends with
//! DEADLINE_EXCEEDED ([`DeadlineBody`]), as gRPC deadlines do.
//!
//! ```no_run
//! use retry_layer::tonic::RetryChannel;
//! use retry_layer::{RetryLayer, RetryPolicy};
//! use tonic::transport::{Channel, Endpoint};
//!
//! /// A generated client over a retrying channel, as a field of your own type.
//! struct Clients {
//!     channel: RetryChannel<Channel>,
//! }
//!
//! let channel = Endpoint::from_static("http://[::1]:50051").connect_lazy();
//! let layer = RetryLayer::new(RetryPolicy::builder().ensure_idempotency_key().build().unwrap());
//! let clients = Clients { channel: layer.tonic_channel(channel) };
//! // e.g. `LibraryClient::new(clients.channel.clone())`
//! # let _ = clients.channel;
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use reason_code::BoxError;
use tokio::time::{sleep_until, Instant, Sleep};
use tower_service::Service;

use crate::body::ReplayBody;
use crate::error::{AttemptTimedOut, DeadlineExceeded, ResponseHeadTimedOut, RetryError};
use crate::retry::layer::RetryLayer;
use crate::retry::service::Retry;

/// Adapts a service of `http::Request<tonic::body::Body>` (a tonic `Channel`) to the
/// [`ReplayBody`] requests that [`Retry`] sends.
#[derive(Clone, Debug)]
pub struct TonicBody<S> {
    inner: S,
}

impl<S> TonicBody<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        TonicBody { inner }
    }

    define_inner_service_accessors!();
}

impl<S, B> Service<http::Request<ReplayBody<B>>> for TonicBody<S>
where
    S: Service<http::Request<::tonic::body::Body>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReplayBody<B>>) -> Self::Future {
        self.inner.call(req.map(::tonic::body::Body::new))
    }
}

/// A tonic channel that retries what is safe to retry: `RetryChannel<Channel>`. Made by
/// [`RetryLayer::tonic_channel`]; its errors are `tonic::Status`es (see the
/// [module docs](self)).
#[derive(Clone, Debug)]
pub struct RetryChannel<S> {
    inner: Retry<TonicBody<S>>,
}

impl<S> RetryChannel<S> {
    /// The retry service inside.
    pub fn get_ref(&self) -> &Retry<TonicBody<S>> {
        &self.inner
    }

    /// The retry service inside, mutably.
    pub fn get_mut(&mut self) -> &mut Retry<TonicBody<S>> {
        &mut self.inner
    }

    /// Consumes the channel, returning the retry service inside.
    pub fn into_inner(self) -> Retry<TonicBody<S>> {
        self.inner
    }
}

impl<S, B, R> Service<http::Request<B>> for RetryChannel<S>
where
    Retry<TonicBody<S>>: Service<http::Request<B>, Response = http::Response<R>, Error = BoxError>,
    <Retry<TonicBody<S>> as Service<http::Request<B>>>::Future: sealed::CallDeadline,
{
    type Response = http::Response<DeadlineBody<R>>;
    type Error = BoxError;
    type Future = ResponseFuture<<Retry<TonicBody<S>> as Service<http::Request<B>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| Box::new(status_of(e)) as BoxError)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        ResponseFuture {
            inner: self.inner.call(req),
        }
    }
}

pin_project! {
    /// The response future of [`RetryChannel`]: the layer's, with its error as a
    /// `tonic::Status`, and its response body bounded by the call's deadline.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F, R> Future for ResponseFuture<F>
where
    F: Future<Output = Result<http::Response<R>, BoxError>> + sealed::CallDeadline,
{
    type Output = Result<http::Response<DeadlineBody<R>>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut inner = self.project().inner;
        let res = match inner.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(res)) => res,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(Box::new(status_of(e)))),
        };
        let deadline = inner.as_ref().get_ref().call_deadline();
        Poll::Ready(Ok(res.map(|body| DeadlineBody::new(body, deadline))))
    }
}

mod sealed {
    use tokio::time::Instant;

    /// A response future that knows its call's deadline.
    pub trait CallDeadline {
        /// The call's deadline, if it has one.
        fn call_deadline(&self) -> Option<Instant>;
    }
}

impl<S, B> sealed::CallDeadline for crate::retry::future::ResponseFuture<S, B>
where
    S: Service<http::Request<ReplayBody<B>>>,
{
    fn call_deadline(&self) -> Option<Instant> {
        self.deadline()
    }
}

pin_project! {
    /// The response body of a [`RetryChannel`] call: the channel's body, ended with
    /// DEADLINE_EXCEEDED (a `tonic::Status`, which a generated client returns as it is) when the
    /// call's deadline passes before the body ends. A unary call's message and trailers are
    /// then bounded by the deadline like its head. Without a deadline it is the body as it is.
    pub struct DeadlineBody<B> {
        #[pin]
        inner: B,
        // `None` without a deadline, and once the body has ended.
        deadline: Option<Instant>,
        // Made at the first poll that has a deadline to wait for.
        sleep: Option<Pin<Box<Sleep>>>,
        expired: bool,
    }
}

impl<B> DeadlineBody<B> {
    fn new(inner: B, deadline: Option<Instant>) -> Self {
        DeadlineBody {
            inner,
            deadline,
            sleep: None,
            expired: false,
        }
    }

    /// The channel's body inside.
    pub fn into_inner(self) -> B {
        self.inner
    }
}

impl<B> std::fmt::Debug for DeadlineBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadlineBody")
            .field("deadline", &self.deadline)
            .field("expired", &self.expired)
            .finish_non_exhaustive()
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if *this.expired {
            return Poll::Ready(None);
        }
        // The deadline first: a body whose frames keep coming is bounded too.
        if let Some(deadline) = *this.deadline {
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
            if sleep.as_mut().poll(cx).is_ready() {
                *this.expired = true;
                *this.deadline = None;
                *this.sleep = None;
                let status = ::tonic::Status::deadline_exceeded(
                    "the call's deadline passed before its response ended",
                );
                return Poll::Ready(Some(Err(Box::new(status))));
            }
        }
        let frame = match this.inner.poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(frame) => frame,
        };
        if frame.is_none() {
            // Ended: nothing left to bound.
            *this.deadline = None;
            *this.sleep = None;
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.expired {
            return SizeHint::with_exact(0);
        }
        self.inner.size_hint()
    }
}

/// The `tonic::Status` of an error of the layer: a status in its source chain as it is, the
/// layer's timeouts as DEADLINE_EXCEEDED, anything else (a transport failure) as UNAVAILABLE;
/// the error itself is the status's source.
fn status_of(e: BoxError) -> ::tonic::Status {
    let mut status = match find_status(&*e) {
        Some(s) => ::tonic::Status::with_details_and_metadata(
            s.code(),
            s.message(),
            s.details().to_vec().into(),
            s.metadata().clone(),
        ),
        None => {
            let code = if timed_out(&*e) {
                ::tonic::Code::DeadlineExceeded
            } else {
                ::tonic::Code::Unavailable
            };
            ::tonic::Status::new(code, e.to_string())
        }
    };
    status.set_source(Arc::from(e));
    status
}

/// The errors in `e`'s source chain, `e` first.
fn chain<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

fn find_status<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a ::tonic::Status> {
    chain(e).find_map(|e| e.downcast_ref::<::tonic::Status>())
}

fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    // `TimeoutExpired`: a tonic `Channel` ends a call at the `grpc-timeout` the layer wrote.
    chain(e).any(|e| {
        e.is::<DeadlineExceeded>()
            || e.is::<AttemptTimedOut>()
            || e.is::<ResponseHeadTimedOut>()
            || e.is::<::tonic::TimeoutExpired>()
    })
}

/// The [`RetryError`] behind a status a [`RetryChannel`] returned: the attempts it took, the
/// idempotency key it generated (resend with it to stay one intent), and the cause. `None` for
/// a status the server sent.
///
/// ```
/// use retry_layer::tonic::retry_error;
///
/// let status = tonic::Status::unavailable("from the server");
/// assert!(retry_error(&status).is_none());
/// ```
pub fn retry_error(status: &::tonic::Status) -> Option<&RetryError> {
    std::error::Error::source(status)?.downcast_ref::<RetryError>()
}

impl RetryLayer {
    /// Wraps a tonic `Channel` (or any service of `http::Request<tonic::body::Body>`) in this
    /// layer: a [`RetryChannel`], ready for a generated client's `new`.
    pub fn tonic_channel<S>(&self, channel: S) -> RetryChannel<S> {
        RetryChannel {
            inner: tower_layer::Layer::layer(self, TonicBody::new(channel)),
        }
    }
}

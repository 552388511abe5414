//! A nameable retrying tonic client (cargo feature `tonic`).
//!
//! [`RetryLayer`] hands its inner service requests whose body is a
//! [`ReplayBody`]; a tonic `Channel` takes `tonic::body::Body`. [`TonicBody`] converts between
//! the two, so the retrying channel is a plain, nameable type, [`RetryChannel<Channel>`], that a
//! generated client can hold in a struct field or a type alias (a `map_request` closure would
//! make it unnameable).
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

use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Body;
use tower_service::Service;

use crate::{BoxError, ReplayBody, Retry, RetryLayer};

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

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the adapter, returning the wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
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

/// A tonic channel that retries what is safe to retry: `RetryChannel<Channel>`.
pub type RetryChannel<S> = Retry<TonicBody<S>>;

impl RetryLayer {
    /// Wraps a tonic `Channel` (or any service of `http::Request<tonic::body::Body>`) in this
    /// layer: a [`RetryChannel`], ready for a generated client's `new`.
    pub fn tonic_channel<S>(&self, channel: S) -> RetryChannel<S> {
        tower_layer::Layer::layer(self, TonicBody::new(channel))
    }
}

//! The two halves compose in one tower `ServiceBuilder`, checked by the compiler.
//!
//! Nothing here runs: each function only has to type-check (as tower-http's
//! `classify::usable_for_retries`). A client stack with `RetryLayer`, over a hyper-util
//! `Client` and over a tonic `Channel`, and a server stack with `IdempotencyLayer` (behind
//! `HopLayer`, the retry layer's server half), on an axum `Router` and on a tonic `Server`, are
//! each handed to a function whose bounds are what its user asks of it: a client shared by
//! spawned tasks, a generated tonic client called from a handler, `Router::layer` and
//! `axum::serve`, `Server::serve`. A change to either layer that breaks one of those bounds
//! stops this file from compiling.

#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

use axum::body::HttpBody;
use axum::extract::Request;
use axum::response::IntoResponse;
use axum::routing::{post, Route};
use axum::Router;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use reason_code::BoxError;
use retry_layer::hop::HopLayer;
use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
use tonic::service::Routes;
use tonic::transport::{Endpoint, Server};
use tonic_library::pb::library_client::LibraryClient;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service, ServiceBuilder};

// --- What users ask of the stacks -------------------------------------------------------------

/// What code that shares one client across tasks asks of it: a clone per task, called there,
/// the call's future spawned.
fn shared_by_spawned_tasks<S, B>(client: S) -> S
where
    S: Service<http::Request<B>, Error = BoxError> + Clone + Send + Sync + 'static,
    S::Response: Send + 'static,
    S::Future: Send + 'static,
{
    client
}

/// What a tonic generated client (`LibraryClient::new`) asks of its channel, plus what a server
/// handler that keeps one in its state asks (`Clone + Send + Sync`).
fn drives_a_generated_client<T>(channel: T) -> T
where
    T: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + Sync + 'static,
    T::Error: Into<BoxError>,
    T::ResponseBody: HttpBody<Data = Bytes> + Send + 'static,
    <T::ResponseBody as HttpBody>::Error: Into<BoxError> + Send,
    T::Future: Send,
{
    channel
}

/// A future a server handler can await: `#[tonic::async_trait]` and axum handlers need `Send`.
fn awaitable_in_a_handler<F: Future + Send>(_: F) {}

/// What `Router::layer` asks of a layer.
fn layers_an_axum_router<L>(layer: L) -> L
where
    L: Layer<Route> + Clone + Send + Sync + 'static,
    L::Service: Service<Request> + Clone + Send + Sync + 'static,
    <L::Service as Service<Request>>::Response: IntoResponse + 'static,
    <L::Service as Service<Request>>::Error: Into<Infallible> + 'static,
    <L::Service as Service<Request>>::Future: Send + 'static,
{
    layer
}

/// What `tonic::transport::Server::serve` asks of the service its layers make of the routes.
fn served_by_tonic<S, ResBody>(service: S) -> S
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError> + Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    service
}

// --- Client stacks ----------------------------------------------------------------------------

/// `RetryLayer` over a hyper-util client: the client's body type is the layer's `ReplayBody`.
fn retrying_hyper_util_client() {
    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody<Full<Bytes>>>();
    let retrying = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(client);
    shared_by_spawned_tasks::<_, Full<Bytes>>(retrying);
}

/// `RetryLayer` over a tonic `Channel`, its `ReplayBody` turned back into tonic's body, driving
/// a generated client whose calls a handler awaits.
fn retrying_tonic_channel() {
    let channel = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
    let retrying = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .map_request(|req: http::Request<ReplayBody<tonic::body::Body>>| {
            req.map(tonic::body::Body::new)
        })
        .service(channel);
    let mut client = LibraryClient::new(drives_a_generated_client(retrying));
    awaitable_in_a_handler(client.get_book(tonic_library::pb::GetBookRequest::default()));
}

// --- Server stacks ----------------------------------------------------------------------------

/// `HopLayer`, then `IdempotencyLayer`: the server stack both servers take.
type HopAndIdempotency =
    ServiceBuilder<Stack<IdempotencyLayer<MemoryStore>, Stack<HopLayer, Identity>>>;

/// `HopLayer` and `IdempotencyLayer` in one `ServiceBuilder`.
fn hop_and_idempotency() -> HopAndIdempotency {
    ServiceBuilder::new()
        .layer(HopLayer::new())
        .layer(IdempotencyLayer::new(MemoryStore::new()))
}

/// The stack on an axum `Router`, served by `axum::serve`.
async fn idempotent_axum_router(listener: tokio::net::TcpListener) -> std::io::Result<()> {
    let app: Router = Router::new()
        .route("/orders", post(|| async { "created" }))
        .layer(layers_an_axum_router(hop_and_idempotency()));
    axum::serve(listener, app).await
}

/// The stack on a tonic `Server`.
async fn idempotent_tonic_server(addr: SocketAddr) -> Result<(), tonic::transport::Error> {
    served_by_tonic(hop_and_idempotency().service(Routes::default()));
    Server::builder()
        .layer(hop_and_idempotency())
        .add_routes(Routes::default())
        .serve(addr)
        .await
}

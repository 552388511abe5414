//! The load test's gRPC scenarios' pieces: a tonic server of `bench.v1.Orders/CreateOrder`
//! (`proto/bench/v1/orders.proto`, compiled by `build.rs` with protox as
//! `examples/tonic-library` does), answering every write with the same 200 bytes as the HTTP
//! handler, bare or behind a layer (`IdempotencyLayer`, or the hand-rolled
//! [`NaiveCacheLayer`](crate::baseline::NaiveCacheLayer)); and a client per connection: a tonic
//! `Channel` (one HTTP/2 connection, one call in flight), bare, through `RetryLayer`
//! ([`RetryLayer::tonic_channel`]) or through `tower::retry` as a user would hand-roll it
//! ([`TowerRetryChannel`]), sending the idempotency key as `x-idempotency-key` metadata.

use std::net::SocketAddr;

use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use retry_layer::tonic::RetryChannel;
use retry_layer::RetryLayer;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tower::util::MapRequest;
use tower::{Layer, Service};

use crate::load::Caller;
use crate::RESPONSE_200;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The generated protobuf and gRPC code of `bench.v1`.
#[allow(
    missing_docs,
    unreachable_pub,
    missing_debug_implementations,
    clippy::all
)]
pub mod pb {
    tonic::include_proto!("bench.v1");
}

use pb::orders_client::OrdersClient;
use pb::orders_server::{Orders, OrdersServer};

/// The trivial gRPC handler: every `CreateOrder` answers OK with [`RESPONSE_200`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OrdersService;

#[tonic::async_trait]
impl Orders for OrdersService {
    async fn create_order(
        &self,
        _req: Request<pb::CreateOrderRequest>,
    ) -> Result<Response<pb::Order>, Status> {
        Ok(Response::new(pb::Order {
            body: Bytes::from_static(RESPONSE_200),
        }))
    }
}

async fn incoming() -> (SocketAddr, TcpIncoming) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    // TCP_NODELAY, as the HTTP server sets it.
    (addr, TcpIncoming::from(listener).with_nodelay(Some(true)))
}

/// Serves [`OrdersService`] with no layer on 127.0.0.1 until the handle is aborted.
pub async fn serve_plain() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let (addr, incoming) = incoming().await;
    let task = tokio::spawn(async move {
        Server::builder()
            .add_service(OrdersServer::new(OrdersService))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    (addr, task)
}

/// Serves [`OrdersService`] behind `layer` on 127.0.0.1 until the handle is aborted: e.g.
/// `IdempotencyLayer::new(store).tenant(idempotency_layer::TenantSource::fixed("bench"))` (a clone of it keeps reading its
/// counters) or [`NaiveCacheLayer`](crate::baseline::NaiveCacheLayer).
pub async fn serve_layered<L, ResBody>(layer: L) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    L: Layer<Routes> + Clone + Send + 'static,
    L::Service: Service<http::Request<tonic::body::Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Future: Send,
    <L::Service as Service<http::Request<tonic::body::Body>>>::Error: Into<BoxError> + Send,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (addr, incoming) = incoming().await;
    let task = tokio::spawn(async move {
        Server::builder()
            .layer(layer)
            .add_service(OrdersServer::new(OrdersService))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    (addr, task)
}

fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a valid URI")
        .tcp_nodelay(true)
        .connect_lazy()
}

/// A caller with a bare channel of its own to `addr` (connected on its first call).
pub fn caller(addr: SocketAddr) -> GrpcCaller {
    GrpcCaller::Plain(OrdersClient::new(channel(addr)))
}

/// A caller with a channel of its own to `addr` through `layer` (a clone of the layer: one
/// budget for every connection, as one client).
pub fn retry_caller(addr: SocketAddr, layer: &RetryLayer) -> GrpcCaller {
    GrpcCaller::Retry(OrdersClient::new(layer.tonic_channel(channel(addr))))
}

/// A caller with a channel of its own to `addr` through [`TowerRetryChannel`].
pub fn tower_retry_caller(addr: SocketAddr) -> GrpcCaller {
    GrpcCaller::TowerRetry(OrdersClient::new(TowerRetryChannel::new(channel(addr))))
}

/// One connection's gRPC client: a bare `Channel`, one through `RetryLayer`, or one through
/// `tower::retry`.
#[derive(Debug, Clone)]
pub enum GrpcCaller {
    /// A bare tonic `Channel`.
    Plain(OrdersClient<Channel>),
    /// A tonic `Channel` through `RetryLayer`.
    Retry(OrdersClient<RetryChannel<Channel>>),
    /// A tonic `Channel` through [`TowerRetryChannel`].
    TowerRetry(OrdersClient<TowerRetryChannel>),
}

/// The `tower::retry` policy a user writes for gRPC: clone the request (`Request::clone`, as
/// [`CloneOn503`](crate::retry::CloneOn503) does), retry on `UNAVAILABLE` (a trailers-only
/// `grpc-status: 14`, or an HTTP 503 from a proxy), at most `.0` retries.
#[derive(Clone, Debug)]
pub struct CloneOnUnavailable(pub usize);

impl<B, E> tower::retry::Policy<http::Request<Full<Bytes>>, http::Response<B>, E>
    for CloneOnUnavailable
{
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut http::Request<Full<Bytes>>,
        result: &mut Result<http::Response<B>, E>,
    ) -> Option<Self::Future> {
        let unavailable = |res: &http::Response<B>| {
            res.status() == StatusCode::SERVICE_UNAVAILABLE
                || res.headers().get("grpc-status").is_some_and(|s| s == "14")
        };
        match result {
            Ok(res) if unavailable(res) && self.0 > 0 => {
                self.0 -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(
        &mut self,
        req: &http::Request<Full<Bytes>>,
    ) -> Option<http::Request<Full<Bytes>>> {
        Some(req.clone())
    }
}

type FullToTonic = fn(http::Request<Full<Bytes>>) -> http::Request<tonic::body::Body>;

/// `tower::retry` on a tonic `Channel`, the way a user would hand-roll it: a tonic request's
/// body is a stream that cannot be cloned, so each call first reads it whole into `Bytes`, then
/// goes through `tower::retry::Retry` with [`CloneOnUnavailable`] (2 retries), which sends a
/// `Full` body on the channel. The load test's reference for `grpc/client_retry`
/// (`grpc/client_tower_retry`).
#[derive(Clone, Debug)]
pub struct TowerRetryChannel<S = Channel> {
    inner: tower::retry::Retry<CloneOnUnavailable, MapRequest<S, FullToTonic>>,
}

impl<S> TowerRetryChannel<S> {
    /// `tower::retry` over `channel` (a tonic `Channel`, or any service of
    /// `http::Request<tonic::body::Body>`).
    pub fn new(channel: S) -> Self {
        let to_tonic: FullToTonic = |req| req.map(tonic::body::Body::new);
        let channel = MapRequest::new(channel, to_tonic);
        TowerRetryChannel {
            inner: tower::retry::Retry::new(CloneOnUnavailable(2), channel),
        }
    }
}

impl<S, B> Service<http::Request<tonic::body::Body>> for TowerRetryChannel<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
{
    type Response = http::Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        // The readied service goes into the future; a clone stays for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body.collect().await?.to_bytes();
            let req = http::Request::from_parts(parts, Full::new(body));
            inner.call(req).await.map_err(Into::into)
        })
    }
}

fn create_order(key: &str) -> Request<pb::CreateOrderRequest> {
    let mut req = Request::new(pb::CreateOrderRequest {
        sku: "b1".to_owned(),
        quantity: 1,
    });
    req.metadata_mut()
        .insert("x-idempotency-key", key.parse().expect("keys are ASCII"));
    req
}

impl Caller for GrpcCaller {
    async fn call(&mut self, key: String) -> bool {
        let req = create_order(&key);
        let res = match self {
            GrpcCaller::Plain(c) => c.create_order(req).await,
            GrpcCaller::Retry(c) => c.create_order(req).await,
            GrpcCaller::TowerRetry(c) => c.create_order(req).await,
        };
        matches!(res, Ok(r) if r.get_ref().body.len() == RESPONSE_200.len())
    }
}

/// `CreateOrder`'s answer as it arrives from a server: 200, `application/grpc`, the
/// length-prefixed [`pb::Order`] of [`RESPONSE_200`], then `grpc-status: 0` in the trailers.
pub fn encoded_answer() -> http::Response<tonic::body::Body> {
    use prost::Message;
    let message = pb::Order {
        body: Bytes::from_static(RESPONSE_200),
    }
    .encode_to_vec();
    let mut frame = Vec::with_capacity(5 + message.len());
    frame.push(0); // not compressed
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let body = Full::new(Bytes::from(frame)).with_trailers(ready(Some(Ok(trailers))));
    let mut res = http::Response::new(tonic::body::Body::new(body));
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    res
}

/// A gRPC backend with no wire, for instruction counts of the client side (`retry_profile`):
/// reads the request body to its end, as a transport does, and answers [`encoded_answer`].
pub fn in_process_backend() -> impl Service<
    http::Request<tonic::body::Body>,
    Response = http::Response<tonic::body::Body>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|req: http::Request<tonic::body::Body>| async move {
        let read = req.into_body().collect().await;
        assert!(read.is_ok(), "the request body reads to its end");
        Ok(encoded_answer())
    })
}

/// One `CreateOrder` through a generated client over `svc` (key `key`); true if it answered
/// OK with the 200-byte message.
pub async fn create_order_on<S>(svc: S, key: &str) -> bool
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::Error: Into<BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    let res = OrdersClient::new(svc).create_order(create_order(key)).await;
    matches!(res, Ok(r) if r.get_ref().body.len() == RESPONSE_200.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-process backend answers what a tonic server answers, through every client the
    /// load test and the profile use.
    #[tokio::test]
    async fn the_in_process_backend_answers_through_every_client() {
        let backend = in_process_backend();
        assert!(create_order_on(backend.clone(), "order-000000000001").await);
        assert!(
            create_order_on(
                TowerRetryChannel::new(backend.clone()),
                "order-000000000002"
            )
            .await
        );
        let layer = RetryLayer::new(retry_layer::RetryPolicy::default());
        assert!(create_order_on(layer.tonic_channel(backend), "order-000000000003").await);
        assert_eq!(layer.stats().requests, 1);
    }
}

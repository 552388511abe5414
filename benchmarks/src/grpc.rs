//! The load test's gRPC scenarios' pieces: a tonic server of `bench.v1.Orders/CreateOrder`
//! (`proto/bench/v1/orders.proto`, compiled by `build.rs` with protox as
//! `examples/tonic-library` does), answering every write with the same 200 bytes as the HTTP
//! handler, bare or behind `IdempotencyLayer`; and a client per connection: a tonic `Channel`
//! (one HTTP/2 connection, one call in flight), bare or through `RetryLayer`
//! ([`RetryLayer::tonic_channel`]), sending the idempotency key as `x-idempotency-key`
//! metadata.

use std::net::SocketAddr;

use bytes::Bytes;
use idempotency_layer::{IdempotencyLayer, IdempotencyStore};
use retry_layer::tonic::RetryChannel;
use retry_layer::RetryLayer;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

use crate::load::Caller;
use crate::RESPONSE_200;

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

/// Serves [`OrdersService`] behind `layer` (e.g. `IdempotencyLayer::new(store)
/// .default_tenant("bench")`; a clone of it keeps reading its counters) on 127.0.0.1 until the
/// handle is aborted.
pub async fn serve_idempotent<St: IdempotencyStore>(
    layer: IdempotencyLayer<St>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
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

/// A caller with a channel of its own to `addr` (connected on its first call), through
/// `retry` if given (a clone of the layer: one budget for every connection, as one client).
pub fn caller(addr: SocketAddr, retry: Option<&RetryLayer>) -> GrpcCaller {
    let channel = channel(addr);
    match retry {
        None => GrpcCaller::Plain(OrdersClient::new(channel)),
        Some(layer) => GrpcCaller::Retry(OrdersClient::new(layer.tonic_channel(channel))),
    }
}

/// One connection's gRPC client: a bare `Channel` or one through `RetryLayer`.
#[derive(Debug, Clone)]
pub enum GrpcCaller {
    /// A bare tonic `Channel`.
    Plain(OrdersClient<Channel>),
    /// A tonic `Channel` through `RetryLayer`.
    Retry(OrdersClient<RetryChannel<Channel>>),
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
        };
        matches!(res, Ok(r) if r.get_ref().body.len() == RESPONSE_200.len())
    }
}

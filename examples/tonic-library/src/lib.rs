//! Example: the `plume.linkd.v3.Library` gRPC service behind `IdempotencyLayer`, and a client
//! whose tonic `Channel` goes through `RetryLayer`.
//!
//! ```text
//! cargo run -p tonic-library --bin library-server -- --listen 127.0.0.1:50051
//! cargo run -p tonic-library --bin library-client -- --url http://127.0.0.1:50051 create-order --book b1 --quantity 1
//! ```
//!
//! The service shares its domain ([`Inventory`]) and demo auth layer with the `axum-orders`
//! example: the two protocols, one behaviour.

use std::time::Duration;

use axum_orders::auth::demo_auth_layer;
use axum_orders::inventory::{Inventory, InventoryError};
use idempotency_layer::reason_code::GrpcMethods;
use idempotency_layer::{IdempotencyLayer, IdempotencyStore, Writes};
use retry_layer::hop::HopLayer;
use tonic::{Request, Response, Status};

/// The generated protobuf and gRPC code.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod pb {
    tonic::include_proto!("plume.linkd.v3");
}

pub mod client;
pub mod gateway;

use pb::library_server::{Library, LibraryServer};

/// The gRPC methods that are reads: declared idempotent on both sides.
pub const IDEMPOTENT_METHODS: [&str; 2] = [
    "/plume.linkd.v3.Library/GetBook",
    "/plume.linkd.v3.Library/GetStats",
];

/// The Library service over an [`Inventory`].
#[derive(Debug, Clone)]
pub struct LibraryService {
    inventory: Inventory,
}

impl LibraryService {
    /// A service over `inventory`.
    pub fn new(inventory: Inventory) -> Self {
        LibraryService { inventory }
    }
}

fn status(e: InventoryError) -> Status {
    match &e {
        InventoryError::NoSuchBook(_) => Status::not_found(e.to_string()),
        InventoryError::BadQuantity(_) => Status::invalid_argument(e.to_string()),
        InventoryError::NotEnoughStock { .. } => Status::failed_precondition(e.to_string()),
        InventoryError::VersionConflict { .. } => {
            let mut s = Status::aborted(e.to_string());
            s.metadata_mut()
                .insert("x-reason-code", "STOCK_CONFLICT".parse().expect("ASCII"));
            s
        }
        // Not made by this service's own inventory (only by an orders-server with
        // `--inventory-url`), mapped for completeness.
        InventoryError::Refused { .. } => Status::failed_precondition(e.to_string()),
        InventoryError::Unavailable(_) => Status::unavailable(e.to_string()),
    }
}

#[tonic::async_trait]
impl Library for LibraryService {
    async fn get_book(
        &self,
        req: Request<pb::GetBookRequest>,
    ) -> Result<Response<pb::Book>, Status> {
        let id = req.into_inner().book_id;
        let book = self
            .inventory
            .book(&id)
            .ok_or_else(|| status(InventoryError::NoSuchBook(id)))?;
        Ok(Response::new(pb::Book {
            book_id: book.book_id,
            title: book.title,
            stock: book.stock,
            version: book.version,
        }))
    }

    async fn create_order(
        &self,
        req: Request<pb::CreateOrderRequest>,
    ) -> Result<Response<pb::Order>, Status> {
        let r = req.into_inner();
        let order = self
            .inventory
            .create_order(&r.book_id, i64::from(r.quantity))
            .await
            .map_err(status)?;
        Ok(Response::new(pb::Order {
            order_id: order.order_id,
            book_id: order.book_id,
            quantity: order.quantity,
        }))
    }

    async fn deduct_stock(
        &self,
        req: Request<pb::DeductStockRequest>,
    ) -> Result<Response<pb::Stock>, Status> {
        let r = req.into_inner();
        let deducted = self
            .inventory
            .deduct(&r.book_id, i64::from(r.quantity), r.expected_version)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::Stock {
            book_id: r.book_id,
            remaining: deducted.remaining,
            version: deducted.version,
        }))
    }

    async fn get_stats(
        &self,
        _req: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::Stats>, Status> {
        let s = self.inventory.stats();
        Ok(Response::new(pb::Stats {
            orders_created: s.orders_created,
            deductions: s.deductions,
        }))
    }
}

/// [`IDEMPOTENT_METHODS`] as the type both layers take.
pub fn idempotent_methods() -> GrpcMethods {
    GrpcMethods::new(IDEMPOTENT_METHODS).expect("the method paths above are valid")
}

/// The idempotency layer configured for this service: reads declared idempotent.
pub fn idempotency<St: IdempotencyStore>(store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .writes(Writes::default().idempotent_grpc_methods(idempotent_methods()))
}

/// Serves the Library over `incoming` with the demo auth layer in front of `idempotency`,
/// until `shutdown` resolves.
pub async fn serve<St, I, IO, IE>(
    inventory: Inventory,
    idempotency: IdempotencyLayer<St>,
    incoming: I,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    St: IdempotencyStore,
    I: tokio_stream::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tonic::transport::Server::builder()
        .timeout(Duration::from_secs(30))
        .layer(HopLayer::new())
        .layer(demo_auth_layer::<tonic::body::Body>())
        .layer(idempotency)
        .add_service(LibraryServer::new(LibraryService::new(inventory)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// Serves a [`Gateway`](gateway::Gateway) (a second hop forwarding to `downstream`) over
/// `incoming` with `HopLayer`, so that its retries and its callers' stay at one tier, until
/// `shutdown` resolves.
pub async fn serve_gateway<I, IO, IE>(
    downstream: pb::library_client::LibraryClient<client::RetryChannel>,
    incoming: I,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    I: tokio_stream::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tonic::transport::Server::builder()
        .timeout(Duration::from_secs(30))
        .layer(HopLayer::new())
        .add_service(LibraryServer::new(gateway::Gateway::new(downstream)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

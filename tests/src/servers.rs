//! Starting the example services on 127.0.0.1:0, with or without the idempotency layer, with
//! an optional fault layer inside it (between the idempotency layer and the handlers).

use std::net::SocketAddr;

use axum::body::Body;
use axum_orders::auth::demo_auth_layer;
use axum_orders::inventory::Inventory;
use axum_orders::server::routes;
use idempotency_layer::{IdempotencyLayer, IdempotencyStore};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_library::pb::library_server::LibraryServer;
use tonic_library::LibraryService;

use test_support::faults::Unavailable;
use test_support::gate::Gate;

/// Starts the orders service. `idempotency: None` runs it without the layer (to show that
/// faults then create duplicates).
pub async fn start_orders<St: IdempotencyStore>(
    inventory: Inventory,
    idempotency: Option<IdempotencyLayer<St>>,
    faults: Unavailable,
) -> SocketAddr {
    let router = routes(inventory).layer(faults);
    let router = match idempotency {
        Some(layer) => router.layer(layer),
        None => router,
    };
    let app = router.layer(demo_auth_layer::<Body>());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// Starts the Library gRPC service with `idempotency` and `faults` inside it.
pub async fn start_library<St: IdempotencyStore>(
    inventory: Inventory,
    idempotency: IdempotencyLayer<St>,
    faults: Unavailable,
) -> SocketAddr {
    start_library_gated(inventory, idempotency, faults, Gate::opened()).await
}

/// [`start_library`] with `gate` inside the faults: the handlers run once it lets them (a claim
/// held for as long as the test wants, and seen by `gate.waiting()`).
pub async fn start_library_gated<St: IdempotencyStore>(
    inventory: Inventory,
    idempotency: IdempotencyLayer<St>,
    faults: Unavailable,
    gate: Gate,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = TcpListenerStream::new(listener);
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .layer(demo_auth_layer::<tonic::body::Body>())
            .layer(idempotency)
            .layer(faults)
            .layer(gate)
            .add_service(LibraryServer::new(LibraryService::new(inventory)))
            .serve_with_incoming(incoming)
            .await;
    });
    addr
}

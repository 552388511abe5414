//! Effectively-once across a chain: `client -> orders -> inventory`, both servers behind
//! `IdempotencyLayer`, the orders handler calling inventory through a `RetryLayer`. The orders
//! handler is made to run twice for one order: its first run deducts the stock, then fails with
//! a 503 (not recorded: its claim is released) and the client's retry runs it again. With
//! derived keys the second run sends the same key as the first and inventory replays: the stock
//! is deducted once. With fresh keys it is deducted twice. Over HTTP/1.1 and HTTP/2, and over
//! gRPC (tonic) with a hand-written unary service on both tiers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use retry_layer::{KeyLabel, RetryLayer, RetryPolicy};
use test_support::net::serve;
use tower::{Service, ServiceBuilder, ServiceExt};

const SECRET: &str = "the orders service's derived-key secret (test)";

/// What the inventory tier saw: its executions (the side effect) and the keys they came with.
#[derive(Clone, Default)]
struct Inventory {
    executions: Arc<AtomicUsize>,
    keys: Arc<Mutex<Vec<String>>>,
}

async fn deduct(State(inv): State<Inventory>, headers: HeaderMap) -> (StatusCode, &'static str) {
    inv.executions.fetch_add(1, Ordering::SeqCst);
    let key = headers
        .get("x-idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    inv.keys.lock().unwrap().push(key);
    (StatusCode::CREATED, "deducted")
}

async fn start_inventory() -> (SocketAddr, Inventory) {
    let inv = Inventory::default();
    let app = Router::new()
        .route("/inventory/deduct", post(deduct))
        .with_state(inv.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(idempotency_layer::TenantSource::fixed("orders")),
        );
    (serve(app).await, inv)
}

/// The orders tier: each run of its handler deducts stock for the order's two lines (two calls
/// to the same target, told apart by their place), then a payment capture (labelled); the first
/// `fail_runs` runs then answer 503 (not recorded, so the order's key is released and the
/// client's retry runs the handler again).
#[derive(Clone)]
struct Orders {
    inventory: SocketAddr,
    policy: RetryPolicy,
    runs: Arc<AtomicUsize>,
    fail_runs: usize,
}

async fn place_order(State(o): State<Orders>) -> (StatusCode, String) {
    let run = o.runs.fetch_add(1, Ordering::SeqCst);
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(o.policy.clone()))
        .service(Client::builder(TokioExecutor::new()).build_http());
    for line in ["line-1", "line-2", "capture"] {
        let mut req = Request::post(format!("http://{}/inventory/deduct", o.inventory))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!("{{\"line\":\"{line}\"}}"))))
            .unwrap();
        if line == "capture" {
            req.extensions_mut()
                .insert(KeyLabel::new("capture-payment"));
        }
        let res = client.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        let _ = res.into_body().collect().await;
    }
    if run < o.fail_runs {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the order's database is down".into(),
        );
    }
    (StatusCode::CREATED, "order placed".into())
}

async fn start_orders(
    inventory: SocketAddr,
    policy: RetryPolicy,
    fail_runs: usize,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let orders = Orders {
        inventory,
        policy,
        runs: runs.clone(),
        fail_runs,
    };
    let app = Router::new()
        .route("/orders", post(place_order))
        .with_state(orders)
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(idempotency_layer::TenantSource::fixed("shop")),
        );
    (serve(app).await, runs)
}

/// Places one order through a client `RetryLayer` (it retries the 503) over `http2` or not.
async fn place(orders: SocketAddr, http2: bool) -> StatusCode {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(http2)
        .build_http();
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(
            RetryPolicy::builder()
                .base_delay(Duration::from_millis(5))
                .build()
                .unwrap(),
        ))
        .service(client);
    let req = Request::post(format!("http://{orders}/orders"))
        .header("x-idempotency-key", "order-chain-0001")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"b1\",\"qty\":2}")))
        .unwrap();
    let res = tokio::time::timeout(
        Duration::from_secs(20),
        client.ready().await.unwrap().call(req),
    )
    .await
    .expect("an answer within 20 s")
    .expect("a response");
    res.status()
}

fn fresh_keys() -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .build()
        .unwrap()
}

fn derived_keys(secret: &str) -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .derive_idempotency_keys(secret)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_run_twice_deducts_once_with_derived_keys_and_twice_without() {
    for http2 in [false, true] {
        for (derive, policy) in [(true, derived_keys(SECRET)), (false, fresh_keys())] {
            let case = format!("http2={http2} derived={derive}");
            let (inventory, inv) = start_inventory().await;
            let (orders, runs) = start_orders(inventory, policy, 1).await;
            assert_eq!(place(orders, http2).await, StatusCode::CREATED, "{case}");
            assert_eq!(
                runs.load(Ordering::SeqCst),
                2,
                "{case}: the orders handler ran twice"
            );
            let keys = inv.keys.lock().unwrap().clone();
            assert_eq!(keys.len(), if derive { 3 } else { 6 }, "{case}: {keys:?}");
            assert_eq!(
                inv.executions.load(Ordering::SeqCst),
                if derive { 3 } else { 6 },
                "{case}: inventory executed each of the 3 calls {}",
                if derive { "once" } else { "twice (fresh keys)" }
            );
            let distinct: std::collections::HashSet<_> = keys.iter().collect();
            assert_eq!(
                distinct.len(),
                keys.len(),
                "{case}: every call has a key of its own"
            );
        }
    }
}

/// The keys of one order's calls are the same on another instance (same secret), and differ
/// for another order or another secret: a takeover on another instance replays downstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_with_the_same_secret_derives_the_same_keys() {
    let (inventory, inv) = start_inventory().await;
    // Two orders instances over one inventory; each runs the order once, completely.
    let (a, _) = start_orders(inventory, derived_keys(SECRET), 0).await;
    let (b, _) = start_orders(inventory, derived_keys(SECRET), 0).await;
    assert_eq!(place(a, false).await, StatusCode::CREATED);
    assert_eq!(place(b, false).await, StatusCode::CREATED);
    assert_eq!(
        inv.executions.load(Ordering::SeqCst),
        3,
        "the second instance replayed"
    );
    let (c, _) = start_orders(inventory, derived_keys("another secret"), 0).await;
    assert_eq!(place(c, false).await, StatusCode::CREATED);
    assert_eq!(
        inv.executions.load(Ordering::SeqCst),
        6,
        "another secret, other keys"
    );
}

// --- gRPC -----------------------------------------------------------------------------------

mod grpc {
    use super::*;
    use axum_orders::inventory::Inventory;
    use e2e::servers::start_library;
    use test_support::faults::Unavailable;
    use tonic::{Request as GrpcRequest, Response, Status};
    use tonic_library::client::{connect_lazy, RetryChannel};
    use tonic_library::pb;
    use tonic_library::pb::library_client::LibraryClient;
    use tonic_library::pb::library_server::{Library, LibraryServer};

    /// The middle tier: `CreateOrder` deducts the stock of its book on the library below,
    /// twice (two lines of one order, told apart by their place), and its first `fail_runs`
    /// runs then answer UNAVAILABLE (not recorded: the key is released, the client retries).
    struct OrdersTier {
        below: LibraryClient<RetryChannel>,
        runs: Arc<AtomicUsize>,
        fail_runs: usize,
    }

    #[tonic::async_trait]
    impl Library for OrdersTier {
        async fn get_book(
            &self,
            _: GrpcRequest<pb::GetBookRequest>,
        ) -> Result<Response<pb::Book>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn create_order(
            &self,
            req: GrpcRequest<pb::CreateOrderRequest>,
        ) -> Result<Response<pb::Order>, Status> {
            let run = self.runs.fetch_add(1, Ordering::SeqCst);
            let tenant = req
                .metadata()
                .get(axum_orders::auth::TENANT_HEADER)
                .cloned()
                .ok_or_else(|| Status::unauthenticated("no tenant"))?;
            let order = req.into_inner();
            for _line in 0..2 {
                let mut deduct = GrpcRequest::new(pb::DeductStockRequest {
                    book_id: order.book_id.clone(),
                    quantity: 1,
                    expected_version: None,
                });
                deduct
                    .metadata_mut()
                    .insert(axum_orders::auth::TENANT_HEADER, tenant.clone());
                self.below.clone().deduct_stock(deduct).await?;
            }
            if run < self.fail_runs {
                return Err(Status::unavailable("the order's database is down"));
            }
            Ok(Response::new(pb::Order {
                order_id: "o-1".into(),
                book_id: order.book_id,
                quantity: order.quantity,
            }))
        }

        async fn deduct_stock(
            &self,
            _: GrpcRequest<pb::DeductStockRequest>,
        ) -> Result<Response<pb::Stock>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn get_stats(
            &self,
            _: GrpcRequest<pb::GetStatsRequest>,
        ) -> Result<Response<pb::Stats>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    async fn start_orders_tier(
        below: SocketAddr,
        policy: RetryPolicy,
    ) -> (SocketAddr, Arc<AtomicUsize>) {
        let (below, _) = connect_lazy(&format!("http://{below}"), policy).unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let tier = OrdersTier {
            below,
            runs: runs.clone(),
            fail_runs: 1,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .layer(axum_orders::auth::demo_auth_layer::<tonic::body::Body>())
                .layer(tonic_library::idempotency(MemoryStore::new()))
                .add_service(LibraryServer::new(tier))
                .serve_with_incoming(incoming)
                .await;
        });
        (addr, runs)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grpc_handler_run_twice_deducts_once_with_derived_keys_and_twice_without() {
        for derive in [true, false] {
            let mut policy = RetryPolicy::builder()
                .idempotent_grpc_methods(tonic_library::idempotent_methods())
                .ensure_idempotency_key();
            if derive {
                policy = policy.derive_idempotency_keys(SECRET);
            }
            let policy = policy.build().unwrap();
            let inventory = Inventory::seeded(Duration::ZERO);
            let below = start_library(
                inventory.clone(),
                tonic_library::idempotency(MemoryStore::new()),
                Unavailable::first_attempts(0.0, 0),
            )
            .await;
            let (middle, runs) = start_orders_tier(below, policy).await;
            let (mut client, _) = connect_lazy(
                &format!("http://{middle}"),
                RetryPolicy::builder()
                    .base_delay(Duration::from_millis(5))
                    .build()
                    .unwrap(),
            )
            .unwrap();
            let mut req = GrpcRequest::new(pb::CreateOrderRequest {
                book_id: "b1".into(),
                quantity: 2,
            });
            req.metadata_mut()
                .insert("x-idempotency-key", "order-chain-grpc-1".parse().unwrap());
            req.metadata_mut()
                .insert(axum_orders::auth::TENANT_HEADER, "shop".parse().unwrap());
            let placed = tokio::time::timeout(Duration::from_secs(20), client.create_order(req))
                .await
                .expect("an answer within 20 s");
            assert!(placed.is_ok(), "derived={derive}: {placed:?}");
            assert_eq!(
                runs.load(Ordering::SeqCst),
                2,
                "derived={derive}: the middle ran twice"
            );
            assert_eq!(
                inventory.stats().deductions,
                if derive { 2 } else { 4 },
                "derived={derive}: the library deducted each line {}",
                if derive { "once" } else { "twice (fresh keys)" }
            );
        }
    }
}

//! The layer on a tonic server over a real socket, with a hand-written prost service (no
//! protoc): replays with trailers, key validation and mismatches as gRPC statuses.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::support::collect;
use bytes::{BufMut, Bytes, BytesMut};
use http::uri::PathAndQuery;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{IdempotencyLayer, InFlight, MemoryStore, OnDisconnect};
use prost::Message;
use tonic::server::{NamedService, UnaryService};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::Service;

#[derive(Clone, PartialEq, prost::Message)]
struct CreateOrder {
    #[prost(string, tag = "1")]
    sku: String,
    #[prost(uint32, tag = "2")]
    qty: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(string, tag = "2")]
    sku: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// `shop.Orders`: `CreateOrder` (a write) and `GetOrder` (declared idempotent).
#[derive(Clone, Default)]
struct Orders {
    created: Arc<AtomicUsize>,
}

impl NamedService for Orders {
    const NAME: &'static str = "shop.Orders";
}

struct Create(Arc<AtomicUsize>);

impl UnaryService<CreateOrder> for Create {
    type Response = Order;
    type Future = BoxFuture<Result<tonic::Response<Order>, Status>>;

    fn call(&mut self, req: tonic::Request<CreateOrder>) -> Self::Future {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        let write = req
            .extensions()
            .get::<idempotency_layer::IdempotentWrite>()
            .cloned();
        let msg = req.into_inner();
        Box::pin(async move {
            if msg.sku == "whoami" {
                // The handler's view of its write, as the order's id: with the stable scope
                // key, and whether its outbound writes derive their keys from that key.
                let inbound = idempotency_layer::reason_code::InboundWrite::current()
                    .map(|i| i.scope_bytes());
                let id = write.map_or("none".to_owned(), |w| {
                    format!(
                        "{}|{}|{}|{}|{}",
                        w.key(),
                        w.tenant(),
                        w.operation(),
                        w.may_have_run_before(),
                        if inbound == Some(w.scope_key().0) && w.scope_key() == stable_key(&w) {
                            "stable"
                        } else {
                            "unstable"
                        },
                    )
                });
                return Ok(tonic::Response::new(Order { id, sku: msg.sku }));
            }
            if msg.sku == "slow" {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            if msg.sku == "flaky" && n == 1 {
                return Err(Status::unavailable("inventory is restarting"));
            }
            Ok(tonic::Response::new(Order {
                id: format!("order-{n}"),
                sku: msg.sku,
            }))
        })
    }
}

/// The stable key of a write's scope, made from its parts.
fn stable_key(w: &idempotency_layer::IdempotentWrite) -> idempotency_layer::store::ScopeKey {
    idempotency_layer::Scope::new(w.tenant(), w.operation(), w.key()).key()
}

struct Get;

impl UnaryService<CreateOrder> for Get {
    type Response = Order;
    type Future = BoxFuture<Result<tonic::Response<Order>, Status>>;

    fn call(&mut self, req: tonic::Request<CreateOrder>) -> Self::Future {
        let sku = req.into_inner().sku;
        Box::pin(async move {
            Ok(tonic::Response::new(Order {
                id: "read".into(),
                sku,
            }))
        })
    }
}

impl Service<http::Request<tonic::body::Body>> for Orders {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let created = self.created.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Order, CreateOrder>::default());
            Ok(match req.uri().path() {
                "/shop.Orders/CreateOrder" => grpc.unary(Create(created), req).await,
                "/shop.Orders/GetOrder" => grpc.unary(Get, req).await,
                CHAT => grpc.streaming(tower::service_fn(chat), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

/// `shop.Orders/Chat`, bidirectional: one reply per message, as each message arrives.
const CHAT: &str = "/shop.Orders/Chat";

type Replies = Pin<Box<dyn futures_util::Stream<Item = Result<Order, Status>> + Send>>;

async fn chat(
    req: tonic::Request<tonic::Streaming<CreateOrder>>,
) -> Result<tonic::Response<Replies>, Status> {
    let replies = futures_util::stream::unfold(req.into_inner(), |mut inbound| async move {
        match inbound.message().await {
            Ok(Some(m)) => Some((
                Ok(Order {
                    id: "echo".into(),
                    sku: m.sku,
                }),
                inbound,
            )),
            Ok(None) => None,
            Err(e) => Some((Err(e), inbound)),
        }
    });
    Ok(tonic::Response::new(Box::pin(replies) as Replies))
}

async fn start(layer: IdempotencyLayer) -> (SocketAddr, Orders) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let orders = Orders::default();
    let router = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(orders.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    (addr, orders)
}

fn layer() -> IdempotencyLayer {
    layer_on(MemoryStore::new())
}

fn layer_on(store: MemoryStore) -> IdempotencyLayer {
    IdempotencyLayer::new(store)
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .writes(
            idempotency_layer::Writes::default().idempotent_grpc_methods(
                reason_code::GrpcMethods::new(["/shop.Orders/GetOrder"]).unwrap(),
            ),
        )
}

type Grpc = tonic::client::Grpc<tonic::transport::Channel>;

async fn grpc_client(addr: SocketAddr) -> Grpc {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(channel)
}

async fn unary(
    client: &mut Grpc,
    path: &'static str,
    key: Option<&str>,
    msg: CreateOrder,
) -> Result<tonic::Response<Order>, Status> {
    client.ready().await.unwrap();
    let mut req = tonic::Request::new(msg);
    if let Some(k) = key {
        req.metadata_mut()
            .insert("x-idempotency-key", k.parse().unwrap());
    }
    client
        .unary(
            req,
            PathAndQuery::from_static(path),
            ProstCodec::<CreateOrder, Order>::default(),
        )
        .await
}

fn order(sku: &str) -> CreateOrder {
    CreateOrder {
        sku: sku.into(),
        qty: 1,
    }
}

const CREATE: &str = "/shop.Orders/CreateOrder";

#[tokio::test]
async fn create_order_twice_gets_the_same_response_and_is_marked_replayed() {
    let (addr, orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    let first = unary(&mut client, CREATE, Some("grpc-key-0001"), order("b1"))
        .await
        .unwrap();
    let second = unary(&mut client, CREATE, Some("grpc-key-0001"), order("b1"))
        .await
        .unwrap();
    assert_eq!(first.get_ref(), second.get_ref());
    assert_eq!(first.get_ref().id, "order-1");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert_eq!(
        second.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn replay_is_byte_identical_including_trailers() {
    let (addr, orders) = start(layer()).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let frame = {
        let msg = order("b2").encode_to_vec();
        let mut b = BytesMut::new();
        b.put_u8(0);
        b.put_u32(msg.len() as u32);
        b.put_slice(&msg);
        b.freeze()
    };
    let send = || {
        let req = http::Request::post(format!("http://{addr}{CREATE}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-idempotency-key", "grpc-key-0002")
            .body(Full::new(frame.clone()))
            .unwrap();
        let client = client.clone();
        async move { collect(client.request(req).await.unwrap()).await }
    };
    let first = send().await;
    let replay = send().await;
    let trailers = first
        .trailers
        .clone()
        .expect("a unary gRPC response ends in trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(replay.trailers, first.trailers, "trailers replayed");
    assert_eq!(replay.body, first.body, "message bytes replayed");
    assert_eq!(replay.status, first.status);
    assert_eq!(
        replay.headers["content-type"],
        first.headers["content-type"]
    );
    assert!(!first.replayed());
    assert!(replay.replayed());
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_write_without_a_key_is_invalid_argument() {
    let (addr, orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    let err = unary(&mut client, CREATE, None, order("b1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(err.message(), "write operations require x-idempotency-key");
    let err = unary(&mut client, CREATE, Some("short"), order("b1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("too short"), "{}", err.message());
    assert_eq!(orders.created.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_mismatch_is_failed_precondition_and_nothing_runs() {
    let (addr, orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    unary(&mut client, CREATE, Some("grpc-key-0003"), order("b1"))
        .await
        .unwrap();
    let err = unary(&mut client, CREATE, Some("grpc-key-0003"), order("b9"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("different request"));
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn declared_idempotent_methods_pass_through_without_a_key() {
    let (addr, _orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    let res = unary(&mut client, "/shop.Orders/GetOrder", None, order("b1"))
        .await
        .unwrap();
    assert_eq!(res.get_ref().id, "read");
}

#[tokio::test]
async fn an_unavailable_status_is_not_recorded() {
    let (addr, orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    let err = unary(&mut client, CREATE, Some("grpc-key-0004"), order("flaky"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let ok = unary(&mut client, CREATE, Some("grpc-key-0004"), order("flaky"))
        .await
        .unwrap();
    assert_eq!(ok.get_ref().id, "order-2");
    assert!(ok.metadata().get("idempotent-replayed").is_none());
    assert_eq!(orders.created.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_retries_over_a_channel_are_replays_in_every_mode() {
    for on_disconnect in [OnDisconnect::Complete, OnDisconnect::Release] {
        for in_flight in [InFlight::Wait, InFlight::Reject] {
            let case = format!("{on_disconnect:?} {in_flight:?}");
            let layer = layer().on_disconnect(on_disconnect).in_flight(in_flight);
            let (addr, orders) = start(layer).await;
            let mut client = grpc_client(addr).await;
            for k in 0..5 {
                let key = format!("grpc-sequential-{k:04}");
                let first = unary(&mut client, CREATE, Some(&key), order("b1")).await;
                let retry = unary(&mut client, CREATE, Some(&key), order("b1")).await;
                let (first, retry) = (
                    first.unwrap(),
                    retry.unwrap_or_else(|e| panic!("{case}: {e}")),
                );
                assert_eq!(first.get_ref(), retry.get_ref(), "{case}");
                assert_eq!(
                    retry.metadata().get("idempotent-replayed").unwrap(),
                    "true",
                    "{case}"
                );
            }
            assert_eq!(orders.created.load(Ordering::SeqCst), 5, "{case}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_over_a_channel_run_once() {
    let (addr, orders) = start(layer()).await;
    let client = grpc_client(addr).await;
    let calls = (0..20).map(|_| {
        let mut client = client.clone();
        async move {
            unary(
                &mut client,
                CREATE,
                Some("grpc-concurrent-1"),
                order("slow"),
            )
            .await
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
    for a in answers {
        assert_eq!(a.unwrap().get_ref().id, "order-1");
    }
}

/// Over a tonic `Channel`, the waiters of a layer hold at most `max_waiting_bytes` in all: with
/// room for two (each counts its 13-byte message and 1 KiB), two duplicates wait and get the
/// leader's order, and the ones past the bound get ABORTED at once, saying why; the write runs
/// once.
#[tokio::test]
async fn over_a_channel_waiters_are_bounded_by_max_waiting_bytes() {
    let layer = layer().max_waiting_bytes(2_500);
    let (addr, orders) = start(layer.clone()).await;
    let client = grpc_client(addr).await;
    let calls = (0..10).map(|_| {
        let mut client = client.clone();
        async move { unary(&mut client, CREATE, Some("grpc-bounded-1"), order("slow")).await }
    });
    // What the waiters hold, read while they wait: never past the bound.
    let mut calls = std::pin::pin!(futures_util::future::join_all(calls));
    let mut most_held = 0;
    let answers = loop {
        tokio::select! {
            answers = &mut calls => break answers,
            _ = tokio::time::sleep(std::time::Duration::from_millis(1)) => {
                most_held = most_held.max(layer.stats().waiting_bytes);
            }
        }
    };
    assert!(most_held <= 2_500, "the waiters held {most_held} bytes");
    assert_eq!(layer.stats().waiting_bytes, 0, "and let them go");
    assert_eq!(
        orders.created.load(Ordering::SeqCst),
        1,
        "the write ran once"
    );
    assert_eq!(layer.stats().waited, 2, "two fit in the bytes allowed");
    let mut refused = 0;
    for a in answers {
        match a {
            Ok(order) => assert_eq!(order.get_ref().id, "order-1"),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert!(status.message().contains("max_waiting_bytes"), "{status:?}");
                refused += 1;
            }
        }
    }
    assert!(
        refused >= 1,
        "the duplicates past the bound were turned away"
    );
}

/// Over a tonic `Channel`, the handler finds its write in the request's extensions: the key
/// from the metadata, the tenant, and the method's path as the operation.
#[tokio::test]
async fn the_handler_sees_its_write_in_the_extensions() {
    let (addr, _) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    let res = unary(&mut client, CREATE, Some("grpc-who-1"), order("whoami"))
        .await
        .unwrap();
    assert_eq!(
        res.get_ref().id,
        "grpc-who-1|t|/shop.Orders/CreateOrder|false|stable"
    );
    let mut retry = tonic::Request::new(order("whoami"));
    retry
        .metadata_mut()
        .insert("x-idempotency-key", "grpc-who-2".parse().unwrap());
    retry
        .metadata_mut()
        .insert("grpc-previous-rpc-attempts", "1".parse().unwrap());
    client.ready().await.unwrap();
    let res = client
        .unary(
            retry,
            PathAndQuery::from_static(CREATE),
            ProstCodec::<CreateOrder, Order>::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        res.get_ref().id,
        "grpc-who-2|t|/shop.Orders/CreateOrder|true|stable"
    );
}

/// A gRPC client cannot use a replay without its message: a response too large to record is
/// replayed as ALREADY_EXISTS that says why, not as an OK with no message (which a unary client
/// turns into INTERNAL "missing response message").
#[tokio::test]
async fn a_replay_whose_message_was_too_large_to_record_is_already_exists() {
    let (addr, orders) = start(layer().max_record_bytes(4)).await;
    let mut client = grpc_client(addr).await;
    let first = unary(&mut client, CREATE, Some("grpc-too-large-1"), order("b1"))
        .await
        .expect("the first client gets the whole response");
    assert_eq!(first.get_ref().id, "order-1");
    let err = unary(&mut client, CREATE, Some("grpc-too-large-1"), order("b1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    assert!(
        err.message().contains("max_record_bytes"),
        "{}",
        err.message()
    );
    assert!(err.message().contains("executed once"), "{}", err.message());
    assert_eq!(
        err.metadata().get("idempotent-body-omitted").unwrap(),
        "true"
    );
    assert_eq!(orders.created.load(Ordering::SeqCst), 1);
}

/// Health probes and server reflection are never writes: they reach the server without a key.
#[tokio::test]
async fn health_checks_and_reflection_pass_through_without_a_key() {
    let (addr, _orders) = start(layer()).await;
    let mut client = grpc_client(addr).await;
    for path in [
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    ] {
        let err = unary(&mut client, path, None, order("b1"))
            .await
            .unwrap_err();
        // This test server serves neither: the answer comes from it, not from the layer.
        assert_eq!(err.code(), Code::Unimplemented, "{path}: {err:?}");
    }
}

/// A bidirectional call whose client waits for a reply before it half-closes: the layer reads a
/// write's whole request before its handler runs, so undeclared it is answered DEADLINE_EXCEEDED
/// at `request_body_timeout` (nothing ran), never left hanging; declared with
/// `streaming_grpc_methods` it passes through and converses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_call_is_bounded_or_passed_through_when_declared() {
    let open_stream =
        |key: &str| {
            let (tx, rx) = tokio::sync::mpsc::channel::<CreateOrder>(4);
            let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            let mut req = tonic::Request::new(outbound);
            req.metadata_mut()
                .insert("x-idempotency-key", key.parse().unwrap());
            (tx, req)
        };
    let codec = || ProstCodec::<CreateOrder, Order>::default();

    let undeclared = layer().request_body_timeout(std::time::Duration::from_millis(300));
    let (addr, _) = start(undeclared).await;
    let mut client = grpc_client(addr).await;
    let (tx, req) = open_stream("grpc-chat-0001");
    tx.send(order("b1")).await.unwrap();
    let answer = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        client.ready().await.unwrap();
        let mut replies = client
            .streaming(req, PathAndQuery::from_static(CHAT), codec())
            .await?
            .into_inner();
        replies.message().await
    })
    .await
    .expect("answered within 20 s, not left hanging");
    let err = answer.expect_err("the body never ended: DEADLINE_EXCEEDED");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        err.message().contains("request_body_timeout"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("Writes::streaming_grpc_methods"),
        "{}",
        err.message()
    );
    drop(tx);

    let declared = layer().writes(
        idempotency_layer::Writes::default()
            .idempotent_grpc_methods(
                reason_code::GrpcMethods::new(["/shop.Orders/GetOrder"]).unwrap(),
            )
            .streaming_grpc_methods(reason_code::GrpcMethods::new([CHAT]).unwrap()),
    );
    let (addr, _) = start(declared).await;
    let mut client = grpc_client(addr).await;
    let (tx, req) = open_stream("grpc-chat-0002");
    tx.send(order("b1")).await.unwrap();
    client.ready().await.unwrap();
    let mut replies = client
        .streaming(req, PathAndQuery::from_static(CHAT), codec())
        .await
        .expect("passed through")
        .into_inner();
    let first = tokio::time::timeout(std::time::Duration::from_secs(20), replies.message())
        .await
        .expect("a reply while the stream is open")
        .unwrap()
        .unwrap();
    assert_eq!(first.sku, "b1");
    tx.send(order("b2")).await.unwrap();
    drop(tx);
    assert_eq!(replies.message().await.unwrap().unwrap().sku, "b2");
    assert!(
        replies.message().await.unwrap().is_none(),
        "ended with the client's stream"
    );
}

/// Over tonic: a `begin` the store never answers ends at one lease as UNAVAILABLE (retryable,
/// nothing ran), and the capacity it readied (a `ConcurrencyLimit` of one behind the layer)
/// goes to the next call. Before, the call held it for as long as its channel stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_the_store_never_answers_ends_at_one_lease() {
    use idempotency_layer::conformance::{Fault, FaultStore, Op, Rule};
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Begin, Fault::Hang).times(1));
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .lease(std::time::Duration::from_millis(500))
        .fail_open(true);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let orders = Orders::default();
    let router = tonic::transport::Server::builder()
        .layer(
            tower::ServiceBuilder::new()
                .layer(layer)
                .concurrency_limit(1)
                .into_inner(),
        )
        .add_service(orders.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.unwrap() });
    let mut held = grpc_client(addr).await;
    let mut other = grpc_client(addr).await;
    let stuck =
        tokio::spawn(
            async move { unary(&mut held, CREATE, Some("grpc-hung-1"), order("b1")).await },
        );
    test_support::wait::until("the first begin is made", || {
        store.calls(Op::Begin).made == 1
    })
    .await;
    let next =
        tokio::spawn(
            async move { unary(&mut other, CREATE, Some("grpc-hung-2"), order("b2")).await },
        );
    let stuck = tokio::time::timeout(test_support::wait::LIMIT, stuck)
        .await
        .expect("the hung begin ends")
        .unwrap();
    assert_eq!(
        stuck.as_ref().map_err(|s| s.code()).err(),
        Some(Code::Unavailable),
        "{stuck:?}"
    );
    tokio::time::timeout(test_support::wait::LIMIT, next)
        .await
        .expect("the next call gets the capacity")
        .unwrap()
        .expect("the next call succeeds");
    assert_eq!(
        orders.created.load(Ordering::SeqCst),
        1,
        "only the second ran"
    );
}

//! One-tier retries over gRPC, end to end: a tonic client -> the example's gateway hop (tonic,
//! `HopLayer`, forwarding through a retrying channel) -> the Library server. With the library
//! down, the client's and the gateway's retries no longer multiply; with the library failing
//! first attempts, the gateway's retries get every call through.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::inventory::Inventory;
use e2e::servers::start_library;
use idempotency_layer::MemoryStore;
use test_support::faults::Unavailable;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::Code;
use tonic_library::client::{connect_lazy, policy};
use tonic_library::gateway::Gateway;
use tonic_library::pb::library_server::LibraryServer;
use tonic_library::pb::GetBookRequest;

/// Starts a gateway to `library`, with or without `HopLayer`.
async fn gateway(library: SocketAddr, with_hop_layer: bool) -> SocketAddr {
    let (downstream, _) = connect_lazy(&format!("http://{library}"), policy()).expect("a url");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = TcpListenerStream::new(listener);
    tokio::spawn(async move {
        if with_hop_layer {
            let _ =
                tonic_library::serve_gateway(downstream, incoming, std::future::pending()).await;
        } else {
            let _ = tonic::transport::Server::builder()
                .add_service(LibraryServer::new(Gateway::new(downstream)))
                .serve_with_incoming(incoming)
                .await;
        }
    });
    addr
}

async fn library(faults: Unavailable) -> SocketAddr {
    let inventory = Inventory::seeded(Duration::ZERO);
    let layer = tonic_library::idempotency(MemoryStore::new());
    start_library(inventory, layer, faults).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_library_sees_the_gateways_retries_not_their_product() {
    for (with_hop_layer, expected) in [(false, 9), (true, 5)] {
        let faults = Unavailable::every_attempt();
        let library = library(faults.clone()).await;
        let gateway = gateway(library, with_hop_layer).await;
        let (mut client, layer) =
            connect_lazy(&format!("http://{gateway}"), policy()).expect("a url");

        let status = tokio::time::timeout(
            Duration::from_secs(20),
            client.get_book(GetBookRequest {
                book_id: "b1".into(),
            }),
        )
        .await
        .expect("the call ends")
        .expect_err("the library is down");

        assert_eq!(status.code(), Code::Unavailable);
        // Without HopLayer: 3 client attempts x 3 gateway attempts. With it: the gateway's 3
        // for the first attempt, then the client's 2 retries (within its adaptive budget),
        // each forwarded once because it arrived as a retry.
        assert_eq!(
            faults.injected(),
            expected,
            "HopLayer {with_hop_layer}: attempts at the library"
        );
        assert_eq!(layer.stats().attempts, 3);
        if with_hop_layer {
            assert_eq!(
                status
                    .metadata()
                    .get("x-reason-code")
                    .map(|v| v.to_str().unwrap()),
                Some("RETRIES_DEFERRED"),
                "the gateway says it retried below"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_failing_first_attempts_is_retried_by_the_gateway_alone() {
    let faults = Unavailable::first_attempts(1.0, 3);
    let library = library(faults.clone()).await;
    let gateway = gateway(library, true).await;
    let (mut client, layer) = connect_lazy(&format!("http://{gateway}"), policy()).expect("a url");
    for i in 0..10 {
        let book = client
            .get_book(GetBookRequest {
                book_id: "b1".into(),
            })
            .await
            .unwrap_or_else(|s| panic!("call {i}: {s}"))
            .into_inner();
        assert_eq!(book.book_id, "b1");
    }
    assert_eq!(faults.injected(), 10, "one failed first attempt per call");
    assert_eq!(layer.stats().retries, 0, "the client never had to retry");
}

/// A handler the idempotency layer finishes after its client went away (`OnDisconnect::Complete`,
/// the default) still runs in its hop: a request that arrived as a retry keeps its handler's
/// outbound calls to one attempt. Before, the detached run lost the hop (a tokio task-local of
/// the request's task), and its downstream write retried as a first attempt's would (simulator
/// seed 5101991). Over a real socket: axum::serve, a hyper-util client that gives up mid-call;
/// the handler goes on only once the layer has detached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_finished_after_its_client_went_away_keeps_its_hop() {
    use std::sync::{Arc, Mutex};

    use axum::routing::post;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use idempotency_layer::{IdempotencyLayer, TenantSource};
    use retry_layer::hop::{Hop, HopLayer};
    use tokio::sync::Notify;

    type Seen = Arc<Mutex<Option<tokio::sync::oneshot::Sender<Option<bool>>>>>;
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let seen: Seen = Arc::new(Mutex::new(Some(seen_tx)));
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (seen, started, go) = (seen.clone(), started.clone(), go.clone());
        move || {
            let (seen, started, go) = (seen.clone(), started.clone(), go.clone());
            async move {
                started.notify_one();
                go.notified().await;
                if let Some(tx) = seen.lock().unwrap().take() {
                    let _ = tx.send(Hop::current().map(|h| h.arrived_as_retry()));
                }
                "created"
            }
        }
    };
    let layer = IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::header(
        http::HeaderName::from_static("x-tenant"),
    ));
    let app = axum::Router::new()
        .route("/orders", post(handler))
        .layer(layer.clone())
        .layer(HopLayer::new());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();
    let req = http::Request::post(format!("http://{addr}/orders"))
        .header("x-tenant", "acme")
        .header("idempotency-key", "order-0042")
        .header("x-previous-attempts", "1")
        .body(Full::new(bytes::Bytes::from_static(b"{}")))
        .expect("a request");
    // The client gives up once the handler runs: the connection closes under it.
    let bound = Duration::from_secs(10);
    tokio::time::timeout(bound, async {
        tokio::select! {
            _ = client.request(req) => panic!("the handler answered before it was let go"),
            () = started.notified() => {}
        }
    })
    .await
    .expect("the handler starts");
    drop(client);
    tokio::time::timeout(bound, async {
        while layer.stats().detached == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the layer detaches the handler once its client is gone");
    go.notify_one();

    let seen = tokio::time::timeout(bound, seen_rx)
        .await
        .expect("the handler ran to its end, detached")
        .expect("the handler reports what it saw");
    assert_eq!(
        seen,
        Some(true),
        "the detached handler runs in its hop, which knows the request arrived as a retry"
    );
}

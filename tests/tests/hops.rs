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

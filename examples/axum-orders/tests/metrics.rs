//! `/metrics` over a real socket: after an execution and a replay, the page shows both, in the
//! Prometheus text format. A test binary of its own: the recorder is the process's.

use axum_orders::inventory::Inventory;
use axum_orders::server::{app, bind, serve};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::IdempotencyLayer;

#[tokio::test]
async fn metrics_shows_an_execution_and_a_replay() {
    let (recorder, handle) = axum_orders::metrics::recorder().unwrap();
    metrics::set_global_recorder(recorder).unwrap();
    let router = app(
        Inventory::seeded(std::time::Duration::ZERO),
        IdempotencyLayer::default(),
    )
    .merge(axum_orders::metrics::routes(handle));
    let (listener, addr) = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let server = tokio::spawn(serve(listener, router));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();

    let order = || {
        Request::post(format!("http://{addr}/orders"))
            .header("x-idempotency-key", "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d")
            .header("x-tenant-id", "alice")
            .header("content-type", "application/json")
            .body(Full::from(r#"{"book_id":"b1","quantity":1}"#))
            .unwrap()
    };
    for _ in 0..2 {
        let res = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(order()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(res.status(), 201);
    }
    let res = client
        .request(
            Request::get(format!("http://{addr}/metrics"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let page = res.into_body().collect().await.unwrap().to_bytes();
    let page = String::from_utf8(page.to_vec()).unwrap();
    for line in [
        "idempotency_layer_executions_total 1",
        "idempotency_layer_replays_total 1",
        "idempotency_layer_store_duration_seconds_count{op=\"begin\",store=\"memory\"} 2",
    ] {
        assert!(page.lines().any(|l| l == line), "no `{line}` in:\n{page}");
    }
    server.abort();
}

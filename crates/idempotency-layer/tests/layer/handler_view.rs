//! What a handler sees of its write (`IdempotentWrite`), and what a replay sends of the headers
//! it set (`RecordedHeaders`), over real sockets: axum::serve with a
//! hyper-util client over HTTP/1.1 and HTTP/2; the gRPC side is in `grpc.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use idempotency_layer::reason_code::InboundWrite;
use idempotency_layer::store::ScopeKey;
use idempotency_layer::{
    IdempotencyLayer, IdempotentWrite, MemoryStore, OnDisconnect, Scope, TenantSource,
};
use test_support::net::Transport;

use crate::support::{collect, serve, wait, Collected};

/// The handler's view as JSON.
fn view(write: &IdempotentWrite) -> serde_json::Value {
    serde_json::json!({
        "key": write.key(),
        "tenant": write.tenant(),
        "operation": write.operation(),
        "scope_key": write.scope_key().to_hex(),
        // What a client `RetryLayer` in the handler derives its outbound writes' keys from.
        "inbound_scope": InboundWrite::current().map(|w| ScopeKey(w.scope_bytes()).to_hex()),
        "protected": write.is_protected(),
        "previous_attempts": write.previous_attempts(),
        "again": write.may_have_run_before(),
    })
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("shop"))
}

async fn post_with(transport: Transport, url: String, headers: &[(&str, &str)]) -> Collected {
    let mut req = Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
    collect(transport.client().request(req).await.unwrap()).await
}

/// The key as the handler gets it is the validated one, its structured-field quotes taken off;
/// the operation is the route's template; the scope key is the stable one (`Scope::key`), and
/// so is what the handler's outbound writes derive their keys from, though a `MemoryStore` files
/// the write under a key of its process; the client's attempt count is read. A replay never reaches the handler, and its answer is
/// the first run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_the_validated_key_tenant_and_scope() {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/books/{id}/orders",
            post(move |write: IdempotentWrite| {
                r.fetch_add(1, Ordering::SeqCst);
                async move { view(&write).to_string() }
            }),
        )
        .layer(layer());
    let addr = serve(app).await;
    for transport in Transport::BOTH {
        let key = format!("order-{transport:?}");
        let quoted = format!("\"{key}\"");
        let url = format!("http://{addr}/books/b1/orders");
        let first = post_with(transport, url.clone(), &[("x-idempotency-key", &quoted)]).await;
        assert_eq!(first.status, StatusCode::OK, "{transport:?}: {first:?}");
        let expected_scope = Scope::new("shop", "POST /books/{id}/orders", &key).key();
        assert_eq!(
            first.json(),
            serde_json::json!({
                "key": key,
                "tenant": "shop",
                "operation": "POST /books/{id}/orders",
                "scope_key": expected_scope.to_hex(),
                "inbound_scope": expected_scope.to_hex(),
                "protected": true,
                "previous_attempts": 0,
                "again": false,
            }),
            "{transport:?}"
        );

        // The client's retry: the first run's record, with no second run.
        let retry = post_with(
            transport,
            url,
            &[("x-idempotency-key", &quoted), ("x-previous-attempts", "1")],
        )
        .await;
        assert!(retry.replayed(), "{transport:?}");
        assert_eq!(retry.body, first.body, "{transport:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one run per key");
}

/// A write that runs again is told so: a retry the client marks as one (its first attempt
/// never reached the layer, or ran and failed), and a duplicate that waited for a run which
/// ended without a record (cancelled when its client went away, `OnDisconnect::Release`) and
/// then runs itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_after_a_cancelled_run_or_a_marked_retry_knows_it_may_be_again() {
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let layer = layer().on_disconnect(OnDisconnect::Release);
    let app = Router::new()
        .route(
            "/orders",
            post(move |write: IdempotentWrite| {
                let n = s.fetch_add(1, Ordering::SeqCst);
                async move {
                    if write.key().starts_with("cancelled-first") && n == 0 {
                        // The first run stalls until its client goes away: cancelled.
                        std::future::pending::<()>().await;
                    }
                    (StatusCode::CREATED, view(&write).to_string())
                }
            }),
        )
        .layer(layer.clone());
    let addr = serve(app).await;
    let url = format!("http://{addr}/orders");

    let first = tokio::spawn(post_with(
        Transport::Http1,
        url.clone(),
        &[("x-idempotency-key", "cancelled-first-1")],
    ));
    wait::until("the first run started", || {
        started.load(Ordering::SeqCst) == 1
    })
    .await;
    let duplicate = tokio::spawn(post_with(
        Transport::Http2,
        url.clone(),
        &[("x-idempotency-key", "cancelled-first-1")],
    ));
    wait::until("the duplicate waits for the first run", || {
        layer.stats().waited == 1
    })
    .await;
    // The first client goes away (its client and connection with it): its run is cancelled.
    first.abort();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, StatusCode::CREATED, "{duplicate:?}");
    assert_eq!(
        duplicate.json()["again"],
        true,
        "it ran after a run that left no record"
    );

    for transport in Transport::BOTH {
        let marked = post_with(
            transport,
            url.clone(),
            &[
                ("x-idempotency-key", &format!("marked-{transport:?}")),
                ("x-previous-attempts", "2"),
            ],
        )
        .await;
        assert_eq!(marked.status, StatusCode::CREATED, "{transport:?}");
        assert_eq!(marked.json()["previous_attempts"], 2, "{transport:?}");
        assert_eq!(marked.json()["again"], true, "{transport:?}");
    }
}

/// The extractor on a route the layer does not cover answers 500 with what to do;
/// `Option<IdempotentWrite>` is `None` on a request the layer passes through (a read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_layer_the_extractor_says_what_is_missing() {
    let outside = Router::new().route("/orders", post(|_: IdempotentWrite| async { "ran" }));
    let inside =
        Router::new()
            .route(
                "/books",
                get(|write: Option<IdempotentWrite>| async move {
                    format!("write: {}", write.is_some())
                }),
            )
            .layer(layer());
    let addr = serve(outside.merge(inside)).await;
    for transport in Transport::BOTH {
        let res = post_with(
            transport,
            format!("http://{addr}/orders"),
            &[("x-idempotency-key", "k-1")],
        )
        .await;
        assert_eq!(
            res.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{transport:?}"
        );
        let text = String::from_utf8_lossy(&res.body);
        assert!(text.contains("IdempotencyLayer"), "{transport:?}: {text}");

        let req = Request::get(format!("http://{addr}/books"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let read = collect(transport.client().request(req).await.unwrap()).await;
        assert_eq!(read.body, "write: false", "{transport:?}");
    }
}

/// A record keeps every header but `set-cookie` and `date` by default: the first client gets
/// its cookie and its handler's `date`, a replay neither (the server dates it); with
/// `RecordedHeaders::all()` the replay carries the cookie too. Over HTTP/1.1 and HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_carry_no_cookie_and_no_stale_date_unless_asked() {
    use idempotency_layer::RecordedHeaders;
    const OLD_DATE: &str = "Sat, 01 Jan 2000 00:00:00 GMT";
    let handler = || {
        post(|| async {
            (
                StatusCode::CREATED,
                [
                    ("set-cookie", "session=first-client; HttpOnly"),
                    ("date", OLD_DATE),
                    ("x-order", "77"),
                ],
                "order 77",
            )
        })
    };
    let filtered = serve(Router::new().route("/orders", handler()).layer(layer())).await;
    let everything = serve(
        Router::new()
            .route("/orders", handler())
            .layer(layer().recorded_headers(RecordedHeaders::all())),
    )
    .await;
    for transport in Transport::BOTH {
        let key = format!("cookie-{transport:?}");
        let headers = [("x-idempotency-key", key.as_str())];
        let url = format!("http://{filtered}/orders");
        let first = post_with(transport, url.clone(), &headers).await;
        assert_eq!(
            first.headers["set-cookie"],
            "session=first-client; HttpOnly"
        );
        assert_eq!(first.headers["date"], OLD_DATE, "{transport:?}");
        let replay = post_with(transport, url, &headers).await;
        assert!(replay.replayed(), "{transport:?}");
        assert_eq!(replay.headers["x-order"], "77", "{transport:?}");
        assert_eq!(replay.body, "order 77", "{transport:?}");
        assert!(
            replay.headers.get("set-cookie").is_none(),
            "{transport:?}: {replay:?}"
        );
        assert!(
            replay.headers.get("date").is_none_or(|d| d != OLD_DATE),
            "{transport:?}: the replay is dated when it is sent: {replay:?}"
        );

        let url = format!("http://{everything}/orders");
        post_with(transport, url.clone(), &headers).await;
        let replay = post_with(transport, url, &headers).await;
        assert!(replay.replayed(), "{transport:?}");
        assert_eq!(
            replay.headers["set-cookie"], "session=first-client; HttpOnly",
            "{transport:?}"
        );
        assert_eq!(replay.headers["date"], OLD_DATE, "{transport:?}");
    }
}

/// An operator's view of a key, beside `forget`: after a write over the wire, `lookup` finds
/// its record (what every duplicate gets); after `forget`, nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_shows_what_a_key_answered_until_it_is_forgotten() {
    let layer = layer();
    let app = Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::CREATED, "order 9") }),
        )
        .layer(layer.clone());
    let addr = serve(app).await;
    let scope = || Scope::new("shop", "POST /orders", "order-00009");
    assert!(layer.lookup(scope()).await.unwrap().is_none());
    let first = post_with(
        Transport::Http2,
        format!("http://{addr}/orders"),
        &[("x-idempotency-key", "order-00009")],
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    match layer.lookup(scope()).await.unwrap() {
        Some(idempotency_layer::store::Held::Completed(record)) => {
            assert_eq!(record.status(), StatusCode::CREATED);
            assert_eq!(record.body(), "order 9");
        }
        other => panic!("the record, got {other:?}"),
    }
    assert!(layer.forget(scope()).await.unwrap());
    assert!(layer.lookup(scope()).await.unwrap().is_none());
}

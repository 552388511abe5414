//! The layer's extension points, over real sockets (HTTP/1.1 and h2): a fingerprint of your
//! own, a key rule of your own, and the shape of the layer's own answers. Defaults unchanged.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::support::{serve, Collected};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::Full;
use idempotency_layer::store::Fingerprint;
use idempotency_layer::{IdempotencyLayer, MemoryStore, RejectReason};

fn clients() -> [(&'static str, test_support::net::HttpClient); 2] {
    [
        ("h1", test_support::net::client_h1()),
        ("h2", test_support::net::client_h2()),
    ]
}

async fn send(
    client: &test_support::net::HttpClient,
    addr: std::net::SocketAddr,
    key: Option<&str>,
    body: &'static str,
) -> Collected {
    let mut req =
        Request::post(format!("http://{addr}/orders")).header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("x-idempotency-key", key);
    }
    let res = client
        .request(
            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap(),
        )
        .await
        .unwrap();
    test_support::net::collect(res).await
}

fn counting(executions: &Arc<AtomicUsize>) -> Router {
    let executions = executions.clone();
    Router::new().route(
        "/orders",
        post(move || {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (StatusCode::CREATED, format!("order {n}")) }
        }),
    )
}

/// A client that re-serialises its JSON body on a retry (keys in another order, other spaces)
/// is refused with 422 by the default fingerprint, and gets the replay with a canonical one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fingerprint_of_your_own_accepts_a_reserialised_body() {
    let canonical = |parts: &http::request::Parts, body: &Bytes| match serde_json::from_slice::<
        serde_json::Value,
    >(body)
    {
        Ok(json) => Fingerprint::of_request(parts, json.to_string().as_bytes()),
        Err(_) => Fingerprint::of_request(parts, body),
    };
    for custom in [false, true] {
        let executions = Arc::new(AtomicUsize::new(0));
        let mut layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"));
        if custom {
            layer = layer.fingerprint_fn(canonical);
        }
        let addr = serve(counting(&executions).layer(layer)).await;
        for (name, client) in clients() {
            let key = format!("order-json-{name}-{custom}");
            let first = send(&client, addr, Some(&key), r#"{"sku":"b1","qty":2}"#).await;
            assert_eq!(first.status, StatusCode::CREATED, "{name}");
            let retry = send(&client, addr, Some(&key), r#"{ "qty": 2, "sku": "b1" }"#).await;
            if custom {
                assert!(retry.replayed(), "{name}: the same request, canonically");
                assert_eq!(retry.body, first.body, "{name}");
            } else {
                assert_eq!(retry.status, StatusCode::UNPROCESSABLE_ENTITY, "{name}");
            }
            let other = send(&client, addr, Some(&key), r#"{"sku":"b1","qty":3}"#).await;
            assert_eq!(
                other.status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{name}: another request"
            );
        }
        assert_eq!(executions.load(Ordering::SeqCst), 2);
    }
}

/// Keys of 255 characters with dots, by a rule of your own; a key the rule refuses gets 400
/// with the rule's message, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rule_of_your_own_decides_which_keys_are_valid() {
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .key_rule(|key| match key.len() {
            1..=255 => Ok(()),
            n => Err(format!(
                "idempotency key is {n} characters long: use 1 to 255"
            )),
        });
    let addr = serve(counting(&executions).layer(layer.clone())).await;
    for (name, client) in clients() {
        let long = format!("{name}.{}", "k".repeat(240));
        assert!(long.len() <= 255 && long.len() > 64);
        let first = send(&client, addr, Some(&long), "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{name}: {first:?}");
        let retry = send(&client, addr, Some(&long), "{}").await;
        assert!(retry.replayed(), "{name}");
        let quoted = format!("\"{long}\"");
        assert!(
            send(&client, addr, Some(&quoted), "{}").await.replayed(),
            "{name}"
        );
        let too_long = "k".repeat(256);
        let refused = send(&client, addr, Some(&too_long), "{}").await;
        assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{name}");
        assert!(
            String::from_utf8_lossy(&refused.body).contains("use 1 to 255"),
            "{name}: {refused:?}"
        );
    }
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    assert_eq!(layer.stats().rejected(RejectReason::InvalidKey), 2);
}

/// The layer's own answers in your own shape: the body and its content type change; the status,
/// `Retry-After` and the reason code stay the layer's, so a client reads them as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_body_of_your_own_keeps_status_and_reason_code() {
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_request_bytes(4)
        .rejection_body(|r| {
            let body = format!("{} {}: {}", r.status.as_u16(), r.code.as_str(), r.detail);
            (HeaderValue::from_static("text/plain"), Bytes::from(body))
        });
    let addr = serve(counting(&executions).layer(layer)).await;
    for (name, client) in clients() {
        let missing = send(&client, addr, None, "{}").await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(missing.headers["content-type"], "text/plain", "{name}");
        assert_eq!(
            missing.body, "400 INVALID_ARGUMENT: write operations require x-idempotency-key",
            "{name}"
        );
        let large = send(&client, addr, Some("order-large-1"), "{\"sku\":1}").await;
        assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE, "{name}");
        assert_eq!(
            large.headers["x-reason-code"], "REQUEST_TOO_LARGE",
            "{name}"
        );
        assert!(
            String::from_utf8_lossy(&large.body).starts_with("413 "),
            "{name}"
        );
    }
    assert_eq!(executions.load(Ordering::SeqCst), 0);
}

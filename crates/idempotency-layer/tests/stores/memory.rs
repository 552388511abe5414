//! `MemoryStore` bounds seen through the layer over a real socket: a full store (or a
//! tenant's full share, while another tenant is present) answers 503 with `Retry-After` and
//! executes nothing, counted by the store; the other tenant keeps writing. And the default
//! store, as it ships, takes a single-tenant service's writes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderName, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{IdempotencyLayer, MemoryStore, RejectReason};

#[tokio::test]
async fn a_full_tenant_share_answers_503_with_retry_after_and_runs_nothing() {
    let store = MemoryStore::builder()
        .max_entries(200)
        .shards(1)
        .tenant_share_percent(50)
        .build()
        .unwrap();
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone()).tenant(
        idempotency_layer::TenantSource::header(HeaderName::from_static("x-tenant")),
    );
    let app = {
        let executions = executions.clone();
        Router::new()
            .route(
                "/orders",
                post(move || {
                    let executions = executions.clone();
                    async move {
                        executions.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, "created")
                    }
                }),
            )
            .layer(layer.clone())
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let post = |tenant: &'static str, key: String| {
        let client = client.clone();
        async move {
            let req = Request::post(format!("http://{addr}/orders"))
                .header("x-tenant", tenant)
                .header("x-idempotency-key", key)
                .body(Full::new(Bytes::from_static(b"{}")))
                .unwrap();
            let res = tokio::time::timeout(Duration::from_secs(10), client.request(req))
                .await
                .expect("answered within 10 s")
                .unwrap();
            let status = res.status();
            let retry_after = res.headers().contains_key("retry-after");
            let _ = res.into_body().collect().await.unwrap();
            (status, retry_after)
        }
    };

    // The quiet tenant is present: the flooder's share applies.
    assert_eq!(
        post("quiet", "quiet-key-first".to_owned()).await.0,
        StatusCode::CREATED
    );
    let mut created = 0;
    let mut refused = 0;
    for i in 0..150 {
        match post("flooder", format!("flood-key-{i:04}")).await {
            (StatusCode::CREATED, _) => created += 1,
            (StatusCode::SERVICE_UNAVAILABLE, retry_after) => {
                assert!(retry_after, "a refusal tells the client when to retry");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(created, 100, "the flooder gets exactly its share");
    assert_eq!(refused, 50);
    assert_eq!(
        executions.load(Ordering::SeqCst),
        101,
        "nothing executes when refused"
    );
    assert_eq!(store.stats().refused, 50);
    assert_eq!(layer.stats().rejected(RejectReason::StoreFull), 50);
    // Another tenant still writes.
    for i in 0..50 {
        assert_eq!(
            post("quiet", format!("quiet-key-{i:04}")).await.0,
            StatusCode::CREATED
        );
    }
    // And the flooder's recorded keys still replay (nothing was dropped).
    assert_eq!(
        post("flooder", "flood-key-0000".to_owned()).await.0,
        StatusCode::CREATED
    );
    assert_eq!(executions.load(Ordering::SeqCst), 151);
}

/// The default store, as it ships, behind a single-tenant service
/// (`IdempotencyLayer::new(MemoryStore::new()).tenant(idempotency_layer::TenantSource::fixed("shop"))`): 90 000 distinct keyed
/// writes within the TTL all execute, none refused (the tenant is alone, so the store is all
/// its own, bounded as a whole: before, the 50 % tenant share split per shard refused 40 016 of
/// them from write 47 365 on), and each one's retry is its replay.
#[tokio::test]
async fn the_default_store_takes_a_single_tenant_services_writes() {
    use tower::{Layer, ServiceExt};

    let store = MemoryStore::new();
    let executions = Arc::new(AtomicUsize::new(0));
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("shop"));
    let svc = layer.layer(tower::service_fn({
        let executions = executions.clone();
        move |_: Request<idempotency_layer::RequestBody<Full<Bytes>>>| {
            executions.fetch_add(1, Ordering::Relaxed);
            async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                    Bytes::from_static(b"{\"id\":1}"),
                )))
            }
        }
    }));
    let write = |i: usize| {
        Request::post("/orders")
            .header("x-idempotency-key", format!("order-{i:08}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"sku\":\"b1\"}")))
            .unwrap()
    };
    for i in 0..90_000 {
        let res = svc.clone().oneshot(write(i)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "write {i}");
        let _ = res.into_body().collect().await.unwrap();
    }
    let stats = store.stats();
    assert_eq!(
        (stats.refused, stats.evicted, stats.entries),
        (0, 0, 90_000)
    );
    assert_eq!(layer.stats().rejected(RejectReason::StoreFull), 0);
    for i in (0..90_000).step_by(997) {
        let res = svc.clone().oneshot(write(i)).await.unwrap();
        assert_eq!(res.headers()["idempotent-replayed"], "true", "write {i}");
    }
    assert_eq!(executions.load(Ordering::Relaxed), 90_000);
}

/// The default store, as it ships, under a single instance's sustained load: 100 new writes a
/// second, one tenant, each recording a 200-byte response kept for the layer's default 24 h
/// TTL, for 75 minutes of (paused) time: nothing is refused. The store is bounded by bytes
/// (128 MiB), and records older than the default minimum retention (15 minutes, more than
/// twice the longest a client with `RetryPolicy::default()` keeps retrying) make room once it
/// is full.
/// (Before: 100 000 entries and a one-hour minimum refused every new write from the 1 000th
/// second on.)
#[tokio::test(start_paused = true)]
async fn the_default_store_takes_100_writes_a_second_for_75_minutes() {
    use idempotency_layer::store::{Begin, Fingerprint, Record, TenantKey};
    use idempotency_layer::{IdempotencyStore, Scope};

    let store = MemoryStore::new();
    let tenant = TenantKey::of("shop");
    let ttl = Duration::from_secs(24 * 3600);
    let lease = Duration::from_secs(30);
    let record = {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        Arc::new(Record::new(
            Fingerprint([0; 32]),
            StatusCode::CREATED,
            headers,
            Bytes::from(vec![b'x'; 200]),
        ))
    };
    let method = Scope::http_operation(&http::Method::POST, "/orders");
    let (rate, seconds) = (100, 75 * 60);
    let mut refused = 0;
    for second in 0..seconds {
        for i in 0..rate {
            let scope = Scope::new("shop", &method, &format!("order-{second}-{i}")).key();
            match store
                .begin_for_tenant(tenant, scope, Fingerprint([0; 32]), lease)
                .await
            {
                Ok(Begin::New(token)) => store
                    .complete(scope, token, record.clone(), ttl)
                    .await
                    .unwrap(),
                Err(idempotency_layer::StoreError::Full) => refused += 1,
                other => panic!("write {second}/{i}: {other:?}"),
            }
        }
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let stats = store.stats();
    assert_eq!(
        (refused, stats.refused),
        (0, 0),
        "writes refused at 100 a second (evicted {}, held {})",
        stats.evicted,
        stats.entries
    );
}

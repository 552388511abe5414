//! The layer on axum routers: over real sockets where the issue asks for it, else through the
//! router as a tower service.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotency_layer::{
    IdempotencyLayer, InFlight, MemoryStore, OnDisconnect, RejectReason, Scope, Tenant,
};
use reason_code::RetryTable;
use tower::ServiceExt;

/// A counting handler that answers `201 order N` after yielding a few times.
fn counting(count: &Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    let count = count.clone();
    post(move |body: Bytes| {
        let count = count.clone();
        async move {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            let n = count.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                [("x-order", n.to_string())],
                format!("order {n} for {}", String::from_utf8_lossy(&body)),
            )
        }
    })
}

fn app(layer: IdempotencyLayer, count: &Arc<AtomicUsize>) -> Router {
    Router::new()
        .route("/orders", counting(count).get(|| async { "list" }))
        .route("/items", counting(count))
        .layer(layer)
}

fn layer() -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new()).tenant(idempotency_layer::TenantSource::fixed("t"))
}

async fn call(app: &Router, req: Request<Body>) -> Collected {
    collect(app.clone().oneshot(req).await.unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_identical_posts_over_a_socket_run_once() {
    let count = Arc::new(AtomicUsize::new(0));
    let layer = layer();
    let addr = serve(app(layer.clone(), &count)).await;
    let client = client();
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let req = Request::post(format!("http://{addr}/orders"))
                .header("x-idempotency-key", "order-0000-0001")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{\"sku\":\"b1\"}")))
                .unwrap();
            collect(client.request(req).await.unwrap()).await
        }));
    }
    let mut responses = Vec::new();
    for t in tasks {
        responses.push(t.await.unwrap());
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "the handler ran once");
    let replayed = responses.iter().filter(|r| r.replayed()).count();
    assert_eq!(replayed, 999);
    let first = &responses[0];
    assert_eq!(first.status, StatusCode::CREATED);
    for r in &responses {
        assert_eq!((r.status, &r.body), (first.status, &first.body));
        assert_eq!(r.headers["x-order"], "1");
    }
    let m = layer.stats();
    assert_eq!(m.executed, 1);
    assert_eq!(m.replayed, 999);
    assert_eq!(m.recorded, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_keys_times_hundred_concurrent_duplicates_run_hundred_times() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer(), &count);
    let mut tasks = Vec::new();
    for _dup in 0..100 {
        for k in 0..100 {
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                let key = format!("key-{k:04}-abcdef");
                let req = req_post("/orders", Some(&key), "{}");
                (k, call(&app, req).await)
            }));
        }
    }
    let mut by_key: Vec<Option<Bytes>> = vec![None; 100];
    for t in tasks {
        let (k, r) = t.await.unwrap();
        assert_eq!(r.status, StatusCode::CREATED);
        match &by_key[k] {
            Some(body) => assert_eq!(body, &r.body, "key {k}: all duplicates get one response"),
            None => by_key[k] = Some(r.body),
        }
    }
    assert_eq!(count.load(Ordering::SeqCst), 100);
}

#[tokio::test]
async fn tenants_and_methods_are_isolated() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(IdempotencyLayer::default(), &count);
    let key = Some("shared-key-0001");
    let a = call(&app, with_tenant(req_post("/orders", key, "{}"), "acme")).await;
    let b = call(&app, with_tenant(req_post("/orders", key, "{}"), "globex")).await;
    let c = call(&app, with_tenant(req_post("/items", key, "{}"), "acme")).await;
    assert_eq!(
        count.load(Ordering::SeqCst),
        3,
        "other tenant or path: separate executions"
    );
    assert!(![&a, &b, &c].iter().any(|r| r.replayed()));
    let again = call(&app, with_tenant(req_post("/orders", key, "{}"), "acme")).await;
    assert!(again.replayed());
    assert_eq!(again.body, a.body);
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn missing_tenant_is_unauthenticated_unless_configured() {
    let count = Arc::new(AtomicUsize::new(0));
    let app_required = app(IdempotencyLayer::default(), &count);
    let r = call(
        &app_required,
        req_post("/orders", Some("order-00000001"), "{}"),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["code"], "UNAUTHENTICATED");
    // The message says how to give the layer a tenant.
    let message = r.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(
        message.contains("Tenant extension") && message.contains("TenantSource::fixed"),
        "{message}"
    );

    // Header-based tenant: explicit opt-in.
    let app_header = app(
        IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::header(
            "x-tenant".parse().unwrap(),
        )),
        &count,
    );
    let mut req = req_post("/orders", Some("order-00000001"), "{}");
    req.headers_mut()
        .insert("x-tenant", "acme".parse().unwrap());
    assert_eq!(call(&app_header, req).await.status, StatusCode::CREATED);
    assert_eq!(count.load(Ordering::SeqCst), 1);
    let r = call(
        &app_header,
        req_post("/orders", Some("order-00000001"), "{}"),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn mismatch_is_422_and_nothing_runs() {
    let count = Arc::new(AtomicUsize::new(0));
    let layer = layer();
    let app = app(layer.clone(), &count);
    let key = Some("order-00000042");
    assert_eq!(
        call(&app, req_post("/orders", key, "{\"a\":1}"))
            .await
            .status,
        StatusCode::CREATED
    );
    let r = call(&app, req_post("/orders", key, "{\"a\":2}")).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.headers["content-type"], "application/problem+json");
    let j = r.json();
    assert_eq!(j["code"], "FAILED_PRECONDITION");
    assert_eq!(j["status"], 422);
    assert!(j["detail"].as_str().unwrap().contains("different request"));
    assert_eq!(count.load(Ordering::SeqCst), 1);
    // Query is part of the fingerprint too.
    let r = call(&app, req_post("/orders?x=1", key, "{\"a\":1}")).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(layer.stats().rejected(RejectReason::Mismatch), 2);
}

#[tokio::test]
async fn missing_and_invalid_keys_are_400_naming_the_rule() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer(), &count);
    let r = call(&app, req_post("/orders", None, "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.json()["detail"],
        "write operations require x-idempotency-key"
    );
    assert_eq!(r.json()["code"], "INVALID_ARGUMENT");

    let cases: [(&[&[u8]], &str); 5] = [
        (&[b"short"], "too short"),
        (&[&[b'k'; 65]], "too long"),
        (&[b"has space!"], "invalid character"),
        (&[b"caf\xc3\xa9-key-0001"], "not ASCII"),
        (&[b"order-00000001", b"order-00000002"], "repeated"),
    ];
    for (values, rule) in cases {
        let mut req = req_post("/orders", None, "{}");
        for v in values {
            req.headers_mut().append(
                "x-idempotency-key",
                http::HeaderValue::from_bytes(v).unwrap(),
            );
        }
        let r = call(&app, req).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{rule}");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(rule), "{rule}: {detail}");
    }
    // Both key headers at once is a repeat too.
    let mut req = req_post("/orders", Some("order-00000001"), "{}");
    req.headers_mut()
        .insert("idempotency-key", "\"order-00000001\"".parse().unwrap());
    assert_eq!(call(&app, req).await.status, StatusCode::BAD_REQUEST);
    // The structured-field form alone is accepted.
    let mut req = req_post("/orders", None, "{}");
    req.headers_mut()
        .insert("idempotency-key", "\"order-00000001\"".parse().unwrap());
    assert_eq!(call(&app, req).await.status, StatusCode::CREATED);
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "no rejected request executed"
    );
}

#[tokio::test]
async fn reads_pass_through_with_or_without_a_key() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer(), &count);
    for key in [None, Some("order-00000001"), Some("bad")] {
        let mut b = Request::get("/orders");
        if let Some(k) = key {
            b = b.header("x-idempotency-key", k);
        }
        let r = call(&app, b.body(Body::empty()).unwrap()).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.body, "list");
        assert!(!r.replayed());
    }
}

#[tokio::test]
async fn key_optional_passes_keyless_writes_through() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer().key_optional(true), &count);
    call(&app, req_post("/orders", None, "{}")).await;
    call(&app, req_post("/orders", None, "{}")).await;
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

fn scripted(statuses: Vec<StatusCode>, count: &Arc<AtomicUsize>) -> Router {
    let count = count.clone();
    let statuses = Arc::new(statuses);
    Router::new().route(
        "/pay",
        post(move || {
            let n = count.fetch_add(1, Ordering::SeqCst);
            let status = statuses[n.min(statuses.len() - 1)];
            async move { (status, format!("attempt {n}")) }
        }),
    )
}

#[tokio::test]
async fn a_503_is_not_recorded_and_the_retry_executes() {
    let count = Arc::new(AtomicUsize::new(0));
    let layer = layer();
    let app = scripted(
        vec![StatusCode::SERVICE_UNAVAILABLE, StatusCode::OK],
        &count,
    )
    .layer(layer.clone());
    let key = Some("payment-000001");
    let r = call(&app, req_post("/pay", key, "{}")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    let r = call(&app, req_post("/pay", key, "{}")).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::OK, false));
    let r = call(&app, req_post("/pay", key, "{}")).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::OK, true));
    assert_eq!(r.body, "attempt 1");
    assert_eq!(count.load(Ordering::SeqCst), 2);
    assert_eq!(layer.stats().released, 1);
}

#[tokio::test]
async fn permanent_failures_are_recorded_only_when_opted_in() {
    for (opt_in, executions) in [(false, 2), (true, 1)] {
        let count = Arc::new(AtomicUsize::new(0));
        let layer = layer().table(RetryTable::default().record_permanent_failures(opt_in));
        let app = scripted(vec![StatusCode::NOT_FOUND], &count).layer(layer.clone());
        let key = Some("payment-000002");
        call(&app, req_post("/pay", key, "{}")).await;
        let r = call(&app, req_post("/pay", key, "{}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(count.load(Ordering::SeqCst), executions, "opt_in {opt_in}");
        if opt_in {
            // An admin can clear the recorded failure.
            let method = Scope::http_operation(&http::Method::POST, "/pay");
            let scope = Scope::new("t", &method, "payment-000002");
            assert!(layer.forget(scope).await.unwrap());
            call(&app, req_post("/pay", key, "{}")).await;
            assert_eq!(count.load(Ordering::SeqCst), 2);
        }
    }
}

/// A reason code refines a failure (it takes precedence over a 409), never a success: a 200
/// that carries one was executed and is recorded.
#[tokio::test]
async fn a_reason_code_refines_a_failure_never_a_success() {
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let app = Router::new()
        .route(
            "/stock",
            post(move |headers: http::HeaderMap| {
                c.fetch_add(1, Ordering::SeqCst);
                let status = match headers["x-idempotency-key"].to_str().unwrap() {
                    "stock-conflict-1" => StatusCode::CONFLICT,
                    _ => StatusCode::OK,
                };
                async move {
                    (
                        status,
                        [("x-reason-code", "UPSTREAM_UNAVAILABLE")],
                        "answer",
                    )
                }
            }),
        )
        .layer(layer());
    // 409 + UPSTREAM_UNAVAILABLE is UNAVAILABLE: never recorded, the retry executes.
    call(&app, req_post("/stock", Some("stock-conflict-1"), "{}")).await;
    let r = call(&app, req_post("/stock", Some("stock-conflict-1"), "{}")).await;
    assert!(!r.replayed());
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "UNAVAILABLE is never recorded"
    );
    // 200 + UPSTREAM_UNAVAILABLE is a success: recorded, the retry is its replay.
    let first = call(&app, req_post("/stock", Some("stock-success-1"), "{}")).await;
    let r = call(&app, req_post("/stock", Some("stock-success-1"), "{}")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(r.replayed(), "a success with a reason code is recorded");
    assert_eq!(count.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_panicking_handler_answers_500_and_releases_the_key() {
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let layer = layer();
    let app = Router::new()
        .route(
            "/boom",
            post(move || {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        panic!("handler bug (expected by the test)");
                    }
                    "fine now"
                }
            }),
        )
        .layer(layer.clone());
    let r = call(&app, req_post("/boom", Some("boom-00000001"), "{}")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.json()["code"], "INTERNAL");
    let r = call(&app, req_post("/boom", Some("boom-00000001"), "{}")).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::OK, false));
    assert_eq!(r.body, "fine now");
    assert_eq!(layer.stats().rejected(RejectReason::Internal), 1);
}

/// A handler that signals when it starts and finishes only when the test says so; `cancelled`
/// counts handlers dropped before they finished.
struct Gated {
    router: Router,
    count: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Notify>,
}

/// Counts a cancellation unless disarmed.
struct CancelGuard(Arc<AtomicUsize>, bool);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn gated() -> Gated {
    let count = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Notify::new());
    let (c, x, s, g) = (
        count.clone(),
        cancelled.clone(),
        started.clone(),
        gate.clone(),
    );
    let router = Router::new().route(
        "/slow",
        post(move || {
            let (c, x, s, g) = (c.clone(), x.clone(), s.clone(), g.clone());
            async move {
                let mut guard = CancelGuard(x, false);
                s.notify_one();
                g.notified().await;
                guard.1 = true;
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                format!("done {n}")
            }
        }),
    );
    Gated {
        router,
        count,
        cancelled,
        started,
        gate,
    }
}

#[tokio::test]
async fn a_dropped_first_request_still_completes_and_the_retry_replays() {
    let Gated {
        router,
        count,
        cancelled,
        started,
        gate,
    } = gated();
    let app = router.layer(layer());
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.oneshot(req_post("/slow", Some("slow-00000001"), "{}"))
                .await
        }
    });
    started.notified().await;
    first.abort(); // the client goes away mid-handler
    let _ = first.await;
    gate.notify_one();
    let r = call(&app, req_post("/slow", Some("slow-00000001"), "{}")).await;
    assert_eq!(r.body, "done 1");
    assert!(r.replayed(), "the retry gets the first execution's outcome");
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(
        cancelled.load(Ordering::SeqCst),
        0,
        "Complete mode never cancels"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_over_a_socket_still_gets_a_replay_on_retry() {
    let Gated {
        router,
        count,
        cancelled,
        started,
        gate,
    } = gated();
    let addr = serve(router.layer(layer())).await;
    let send = move || {
        let req = Request::post(format!("http://{addr}/slow"))
            .header("x-idempotency-key", "slow-00000002")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        // A fresh client per attempt: dropping it closes its connection.
        async move { collect(client().request(req).await.unwrap()).await }
    };
    let first = tokio::spawn(send());
    started.notified().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    gate.notify_one();
    let r = send().await;
    assert_eq!(r.body, "done 1");
    assert!(r.replayed());
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(
        cancelled.load(Ordering::SeqCst),
        0,
        "Complete mode never cancels"
    );
}

#[tokio::test]
async fn on_disconnect_release_cancels_and_releases() {
    let Gated {
        router,
        count,
        cancelled,
        started,
        gate,
    } = gated();
    let layer = layer().on_disconnect(OnDisconnect::Release);
    let app = router.layer(layer.clone());
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.oneshot(req_post("/slow", Some("slow-00000003"), "{}"))
                .await
        }
    });
    started.notified().await;
    first.abort();
    let _ = first.await;
    assert_eq!(
        cancelled.load(Ordering::SeqCst),
        1,
        "Release mode drops the handler when its client goes away"
    );
    // The release is spawned on drop.
    wait::until_yielding("the claim is released", || layer.stats().in_flight == 0).await;
    let retry = tokio::spawn({
        let app = app.clone();
        async move { call(&app, req_post("/slow", Some("slow-00000003"), "{}")).await }
    });
    started.notified().await;
    gate.notify_one();
    let r = retry.await.unwrap();
    assert_eq!((r.body.as_ref(), r.replayed()), (&b"done 1"[..], false));
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "the first handler was cancelled"
    );
    assert_eq!(layer.stats().executed, 2);
}

/// The single-flight rule: duplicates waiting on a leader whose outcome is not recorded
/// (a 503) share that failure instead of each running the handler again; the key is free, and
/// the client's next retry (under its budget) runs it.
#[tokio::test]
async fn waiters_share_the_leaders_failure_and_the_retry_runs_it() {
    // First execution: 503 (released); the second: 200.
    let count = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let (c, g) = (count.clone(), gate.clone());
    let layer = layer();
    let app = Router::new()
        .route(
            "/w",
            post(move || {
                let (c, g) = (c.clone(), g.clone());
                async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        g.notified().await;
                        (StatusCode::SERVICE_UNAVAILABLE, "busy")
                    } else {
                        (StatusCode::OK, "ok")
                    }
                }
            }),
        )
        .layer(layer.clone());
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            call(&app, req_post("/w", Some("wait-00000001"), "{}")).await
        }));
    }
    wait::until_yielding("nine duplicates wait", || layer.stats().waited >= 9).await;
    gate.notify_one();
    for t in tasks {
        let answer = t.await.unwrap();
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        assert_eq!(answer.body, "busy", "the leader's own answer");
        assert!(!answer.replayed(), "nothing was recorded");
    }
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "ten duplicates, one execution"
    );
    let m = layer.stats();
    assert_eq!((m.shared_failures, m.executed), (9, 1));
    // The client's retry runs it.
    let retry = call(&app, req_post("/w", Some("wait-00000001"), "{}")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn in_flight_reject_answers_409_with_retry_after() {
    let Gated {
        router,
        started,
        gate,
        ..
    } = gated();
    let app = router.layer(layer().in_flight(InFlight::Reject));
    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app, req_post("/slow", Some("slow-00000004"), "{}")).await }
    });
    started.notified().await;
    let r = call(&app, req_post("/slow", Some("slow-00000004"), "{}")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(r.json()["code"], "ABORTED");
    gate.notify_one();
    assert_eq!(first.await.unwrap().body, "done 1");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_gives_up_at_max_wait() {
    let Gated {
        router,
        started,
        gate,
        ..
    } = gated();
    let layer = layer().max_wait(Duration::from_secs(2));
    let app = router.layer(layer.clone());
    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app, req_post("/slow", Some("slow-00000005"), "{}")).await }
    });
    started.notified().await;
    let waited_from = tokio::time::Instant::now();
    let r = call(&app, req_post("/slow", Some("slow-00000005"), "{}")).await;
    // Paused time: the clock moved exactly as far as the duplicate waited.
    assert_eq!(
        waited_from.elapsed(),
        Duration::from_secs(2),
        "the duplicate waited max_wait, then gave up"
    );
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(r.headers["x-reason-code"], "IDEMPOTENCY_IN_FLIGHT");
    let stats = layer.stats();
    assert_eq!(
        (stats.waited, stats.rejected(RejectReason::InFlight)),
        (1, 1)
    );
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn records_expire_after_the_ttl() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer().ttl(Duration::from_secs(60)), &count);
    let key = Some("ttl-00000001");
    call(&app, req_post("/orders", key, "{}")).await;
    tokio::time::advance(Duration::from_secs(30)).await;
    assert!(call(&app, req_post("/orders", key, "{}")).await.replayed());
    tokio::time::advance(Duration::from_secs(31)).await;
    let r = call(&app, req_post("/orders", key, "{}")).await;
    assert!(!r.replayed());
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "the key executes again after its TTL"
    );
}

#[tokio::test]
async fn capacity_holds_with_ten_times_the_keys() {
    // Full: new keys are refused retryably (503, nothing runs); no record is dropped early.
    let count = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::builder()
        .max_entries(50)
        .tenant_share_percent(100)
        .build()
        .unwrap();
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("t"));
    let app = app(layer.clone(), &count);
    let mut created = Vec::new();
    for i in 0..500 {
        let key = format!("cap-key-{i:05}");
        let r = call(&app, req_post("/orders", Some(&key), "{}")).await;
        match r.status {
            StatusCode::CREATED => created.push(key),
            StatusCode::SERVICE_UNAVAILABLE => {}
            other => panic!("{other}"),
        }
        wait::until_yielding("the spawned completion runs", || {
            layer.stats().in_flight == 0
        })
        .await;
        assert!(store.len() <= 50, "len {} after {i}", store.len());
    }
    assert_eq!(count.load(Ordering::SeqCst), created.len());
    assert_eq!(store.stats().refused as usize, 500 - created.len());
    for key in &created {
        let r = call(&app, req_post("/orders", Some(key), "{}")).await;
        assert!(r.replayed(), "{key} was dropped before its TTL");
    }

    // Eviction opted in: every key executes, the newest is still replayed.
    let count = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::builder()
        .max_entries(50)
        .tenant_share_percent(100)
        .min_retention(Duration::ZERO)
        .build()
        .unwrap();
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("t"));
    let app = self::app(layer.clone(), &count);
    for i in 0..500 {
        let key = format!("cap-key-{i:05}");
        let r = call(&app, req_post("/orders", Some(&key), "{}")).await;
        assert_eq!(r.status, StatusCode::CREATED);
        wait::until_yielding("the spawned completion runs", || {
            layer.stats().in_flight == 0
        })
        .await;
        assert!(store.len() <= 50, "len {} after {i}", store.len());
    }
    assert_eq!(count.load(Ordering::SeqCst), 500);
    assert!(store.stats().evicted >= 450);
    let r = call(&app, req_post("/orders", Some("cap-key-00499"), "{}")).await;
    assert!(r.replayed());
}

#[tokio::test]
async fn oversized_requests_are_413_and_oversized_records_omit_the_body() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer().max_request_bytes(16).max_record_bytes(8), &count);
    let r = call(
        &app,
        req_post("/orders", Some("big-00000001"), "{\"sku\":\"0123456789\"}"),
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.json()["code"], "RESOURCE_EXHAUSTED");
    assert_eq!(count.load(Ordering::SeqCst), 0);

    let first = call(&app, req_post("/orders", Some("big-00000002"), "{}")).await;
    assert_eq!(
        first.body, "order 1 for {}",
        "the first client gets the whole body"
    );
    let replay = call(&app, req_post("/orders", Some("big-00000002"), "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["idempotent-body-omitted"], "true");
    assert_eq!(replay.headers["x-order"], "1");
    assert!(replay.body.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_response_reaches_the_first_client_before_the_handler_finishes() {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let app = Router::new()
        .route(
            "/stream",
            post(move || {
                c.fetch_add(1, Ordering::SeqCst);
                let rx = rx.lock().unwrap().take().expect("handler runs once");
                async move { Body::new(ChannelBody(rx)) }
            }),
        )
        .layer(layer());
    let addr = serve(app).await;
    let req = || {
        Request::post(format!("http://{addr}/stream"))
            .header("x-idempotency-key", "stream-00000001")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let client = client();
    tx.send(Bytes::from_static(b"first chunk;")).await.unwrap();
    let res = client.request(req()).await.unwrap();
    let mut body = res.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first chunk;");
    // The handler's body is still open: the rest comes later.
    tx.send(Bytes::from_static(b"second chunk")).await.unwrap();
    drop(tx);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "second chunk");
    let replay = collect(client.request(req()).await.unwrap()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, "first chunk;second chunk");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_failing_store_fails_closed_by_default_and_open_when_configured() {
    let count = Arc::new(AtomicUsize::new(0));
    let store = FlakyStore::default();
    down(&store);
    let closed =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("t"));
    let app_closed = Router::new()
        .route("/orders", counting(&count))
        .layer(closed.clone());
    let r = call(
        &app_closed,
        req_post("/orders", Some("store-00000001"), "{}"),
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(r.json()["code"], "UNAVAILABLE");
    assert_eq!(
        count.load(Ordering::SeqCst),
        0,
        "fail closed executes nothing"
    );
    assert_eq!(closed.stats().store_errors, 1);

    let open = closed.clone().fail_open(true);
    let app_open = Router::new().route("/orders", counting(&count)).layer(open);
    let r = call(&app_open, req_post("/orders", Some("store-00000001"), "{}")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(count.load(Ordering::SeqCst), 1, "fail open executes");

    // The store comes back: protection resumes.
    up(&store);
    call(
        &app_closed,
        req_post("/orders", Some("store-00000002"), "{}"),
    )
    .await;
    wait::until_yielding("the spawned completion records", || {
        closed.stats().in_flight == 0
    })
    .await;
    let r = call(
        &app_closed,
        req_post("/orders", Some("store-00000002"), "{}"),
    )
    .await;
    assert!(r.replayed());
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn tenant_extension_from_an_auth_layer_is_used() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(IdempotencyLayer::default(), &count).layer(tower::util::MapRequestLayer::new(
        |mut req: Request<Body>| {
            let t = req
                .headers()
                .get("authorization")
                .map(|v| Tenant::new(v.to_str().unwrap().trim_start_matches("Bearer ")));
            if let Some(t) = t {
                req.extensions_mut().insert(t);
            }
            req
        },
    ));
    let req = |who: &str| {
        let mut r = req_post("/orders", Some("auth-00000001"), "{}");
        r.headers_mut()
            .insert("authorization", format!("Bearer {who}").parse().unwrap());
        r
    };
    call(&app, req("acme")).await;
    assert!(call(&app, req("acme")).await.replayed());
    assert!(!call(&app, req("globex")).await.replayed());
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_key_header_is_configurable() {
    let count = Arc::new(AtomicUsize::new(0));
    let headers = reason_code::KeyHeaders::new(["x-request-key".parse().unwrap()]).unwrap();
    let app = app(layer().key_headers(headers), &count);
    let r = call(&app, req_post("/orders", Some("order-00000001"), "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["detail"], "write operations require x-request-key");
    let mut req = req_post("/orders", None, "{}");
    req.headers_mut()
        .insert("x-request-key", "order-00000001".parse().unwrap());
    assert_eq!(call(&app, req).await.status, StatusCode::CREATED);
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// The IETF draft's `Idempotency-Key` is an RFC 8941 string: parameters are accepted and
/// ignored, so `"k";v=1` and `"k"` are the same key; a value that is not a structured-field
/// string is refused, naming the rule.
#[tokio::test]
async fn a_structured_field_key_with_parameters_is_the_same_key() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = app(layer(), &count);
    let with = |value: &'static str| {
        let mut req = req_post("/orders", None, "{}");
        req.headers_mut()
            .insert("idempotency-key", HeaderValue::from_static(value));
        req
    };
    let first = call(&app, with(r#""order-sf-0001";v=1"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = call(&app, with(r#""order-sf-0001""#)).await;
    assert!(again.replayed(), "the parameters are not part of the key");
    assert_eq!(again.body, first.body);
    let bad = call(&app, with(r#""order-sf-0001";"#)).await;
    assert_eq!(
        bad.status,
        StatusCode::BAD_REQUEST,
        "a dangling ';' is not RFC 8941"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// `TenantSource::from_fn` reads the tenant an auth step left in the request head: each tenant its own
/// scope, and no tenant a 401.
#[tokio::test]
async fn tenant_fn_reads_the_tenant_from_the_request_head() {
    #[derive(Clone)]
    struct Claims(&'static str);

    let count = Arc::new(AtomicUsize::new(0));
    let layer =
        IdempotencyLayer::new(MemoryStore::new()).tenant(idempotency_layer::TenantSource::from_fn(
            |parts| parts.extensions.get::<Claims>().map(|c| c.0),
        ));
    let app = app(layer, &count);
    let as_org = |org: Option<&'static str>| {
        let mut req = req_post("/orders", Some("order-tenant-fn-1"), "{}");
        if let Some(org) = org {
            req.extensions_mut().insert(Claims(org));
        }
        req
    };
    let a = call(&app, as_org(Some("acme"))).await;
    let b = call(&app, as_org(Some("globex"))).await;
    let a_again = call(&app, as_org(Some("acme"))).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!b.replayed(), "another tenant's key is another scope");
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(count.load(Ordering::SeqCst), 2);
    let none = call(&app, as_org(None)).await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

//! The layer as a plain tower service around scripted handlers: classification of gRPC
//! trailers, body errors, lease renewal, and the waiter's own deadline.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use idempotency_layer::{IdempotencyLayer, InFlight, RequestBody};
use tower::{service_fn, Layer, ServiceExt};

/// A body that plays back a script of frames and errors.
struct Script(VecDeque<Result<Frame<Bytes>, std::io::Error>>);

impl Body for Script {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        Poll::Ready(self.0.pop_front())
    }
}

fn grpc_request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/shop.Orders/CreateOrder")
        .header("content-type", "application/grpc")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

fn grpc_response(status: &'static str) -> Response<Script> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", status.parse().unwrap());
    Response::builder()
        .header("content-type", "application/grpc")
        .body(Script(VecDeque::from([
            Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x02hi"))),
            Ok(Frame::trailers(trailers)),
        ])))
        .unwrap()
}

#[tokio::test]
async fn grpc_status_in_trailers_decides_what_is_recorded() {
    for (status, executions) in [("0", 1), ("14", 2), ("13", 2)] {
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let svc = IdempotencyLayer::default()
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .layer(service_fn(
                move |_req: Request<RequestBody<Full<Bytes>>>| {
                    c.fetch_add(1, Ordering::SeqCst);
                    async move { Ok::<_, Infallible>(grpc_response(status)) }
                },
            ));
        let mut last = None;
        for _ in 0..2 {
            let res = svc
                .clone()
                .oneshot(grpc_request("trailer-key-1"))
                .await
                .unwrap();
            let replayed = res.headers().contains_key("idempotent-replayed");
            let collected = res.into_body().collect().await.unwrap();
            let trailers = collected.trailers().cloned().unwrap();
            assert_eq!(trailers["grpc-status"], status);
            last = Some((replayed, collected.to_bytes()));
        }
        let (replayed, body) = last.unwrap();
        assert_eq!(body, &b"\0\0\0\0\x02hi"[..]);
        assert_eq!(replayed, executions == 1, "status {status}");
        assert_eq!(count.load(Ordering::SeqCst), executions, "status {status}");
    }
}

/// A body that fails mid-stream after a head whose outcome is recorded (HTTP 200): the
/// handler's side effect happened, so the record is kept without its body and the retry gets
/// "executed once" instead of running it again. A gRPC response whose status was to come in its
/// trailers never got one: not recorded, the retry runs again.
#[tokio::test]
async fn a_body_error_mid_stream_after_a_recorded_head_is_recorded_without_its_body() {
    for grpc in [false, true] {
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let layer = IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t"));
        let svc = layer.layer(service_fn(
            move |_req: Request<RequestBody<Full<Bytes>>>| {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move {
                    let mut frames = VecDeque::from([Ok(Frame::data(Bytes::from_static(b"part")))]);
                    if n == 0 {
                        frames.push_back(Err(std::io::Error::other("upstream reset")));
                    }
                    let mut res = Response::new(Script(frames));
                    if grpc {
                        res.headers_mut()
                            .insert("content-type", "application/grpc".parse().unwrap());
                    }
                    Ok::<_, Infallible>(res)
                }
            },
        ));
        let req = || {
            let mut req = Request::post("/shop.Orders/CreateOrder")
                .header("x-idempotency-key", "body-error-1");
            if grpc {
                req = req.header("content-type", "application/grpc");
            }
            req.body(Full::new(Bytes::new())).unwrap()
        };
        let res = svc.clone().oneshot(req()).await.unwrap();
        assert!(res.into_body().collect().await.is_err(), "grpc={grpc}");
        // The claim ends in a spawned task.
        test_support::wait::until_yielding("the claim ends", || layer.stats().in_flight == 0).await;
        let res = svc.clone().oneshot(req()).await.unwrap();
        if grpc {
            assert!(!res.headers().contains_key("idempotent-replayed"));
            assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "part");
            assert_eq!(count.load(Ordering::SeqCst), 2, "released: executed again");
        } else {
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(res.headers()["idempotent-replayed"], "true");
            assert_eq!(res.headers()["idempotent-body-omitted"], "true");
            assert!(res
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .is_empty());
            assert_eq!(count.load(Ordering::SeqCst), 1, "recorded: executed once");
        }
    }
}

type Svc = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<idempotency_layer::IdempotencyBody<Full<Bytes>>>,
    Infallible,
>;

type Notify = Arc<tokio::sync::Notify>;

fn gated_service(layer: IdempotencyLayer) -> (Svc, Arc<AtomicUsize>, Notify, Notify) {
    let count = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Notify::new());
    let (c, s, g) = (count.clone(), started.clone(), gate.clone());
    let svc = layer.layer(service_fn(
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let (c, s, g) = (c.clone(), s.clone(), g.clone());
            async move {
                s.notify_one();
                g.notified().await;
                c.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
            }
        },
    ));
    (Svc::new(svc), count, started, gate)
}

#[tokio::test(start_paused = true)]
async fn the_leader_renews_its_lease_while_the_handler_runs() {
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .lease(Duration::from_secs(1))
        .in_flight(InFlight::Reject);
    let (svc, count, started, gate) = gated_service(layer);
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "lease-key-1")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let first = tokio::spawn(svc.clone().oneshot(req()));
    started.notified().await;
    // Ten leases pass while the handler runs.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Without renewal the duplicate would take the lapsed claim over and block on the gate.
    let dup = tokio::time::timeout(Duration::from_secs(5), svc.clone().oneshot(req()))
        .await
        .expect("the duplicate is answered at once")
        .unwrap();
    assert_eq!(
        dup.status(),
        StatusCode::CONFLICT,
        "the claim is still held"
    );
    gate.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_grpc_waiter_stops_at_its_own_deadline() {
    let layer = IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t"));
    let (svc, _count, started, gate) = gated_service(layer);
    let first = tokio::spawn(svc.clone().oneshot(grpc_request("deadline-key")));
    started.notified().await;
    let mut req = grpc_request("deadline-key");
    req.headers_mut()
        .insert("grpc-timeout", "200m".parse().unwrap());
    let t0 = tokio::time::Instant::now();
    let dup = svc.clone().oneshot(req).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(
        dup.status(),
        StatusCode::OK,
        "gRPC rejections are trailers-only"
    );
    assert_eq!(dup.headers()["grpc-status"], "10", "ABORTED");
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(1));
    gate.notify_one();
    first.await.unwrap().unwrap();
}

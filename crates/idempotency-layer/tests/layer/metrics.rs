//! The `metrics` feature: the counters of an execution, a replay and a rejection, and the store
//! latency histogram, read from a local debugging recorder.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idempotency_layer::{IdempotencyLayer, RequestBody, IDEMPOTENT_REPLAYED};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::{service_fn, Layer, ServiceExt};

const KEY: &str = "5f0e9a8c-3b1d-4c2e-8a7f-6d5c4b3a2910";

fn post(key: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("x-idempotency-key", key);
    }
    req.body(Full::new(Bytes::from_static(b"{\"sku\":1}")))
        .unwrap()
}

#[test]
fn an_execution_then_a_replay_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = {
        let runs = runs.clone();
        IdempotencyLayer::default()
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .layer(service_fn(
                move |_req: Request<RequestBody<Full<Bytes>>>| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    async {
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(StatusCode::CREATED)
                                .body(Full::new(Bytes::from_static(b"{\"id\":1}")))
                                .unwrap(),
                        )
                    }
                },
            ))
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let first = svc.clone().oneshot(post(Some(KEY))).await.unwrap();
            assert_eq!(first.status(), StatusCode::CREATED);
            assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
            let again = svc.clone().oneshot(post(Some(KEY))).await.unwrap();
            assert_eq!(again.status(), StatusCode::CREATED);
            assert!(again.headers().get(IDEMPOTENT_REPLAYED).is_some());
            let rejected = svc.clone().oneshot(post(None)).await.unwrap();
            assert_eq!(rejected.status(), StatusCode::BAD_REQUEST);
        })
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let mut counters = HashMap::new();
    let mut histograms = HashMap::new();
    let mut gauges = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        match value {
            DebugValue::Counter(n) => {
                counters.insert(name, n);
            }
            DebugValue::Histogram(v) => {
                histograms.insert(name, v.len());
            }
            DebugValue::Gauge(v) => {
                gauges.insert(name, v.into_inner());
            }
        }
    }
    let c = &counters;
    assert_eq!(
        c.get("idempotency_layer_executions_total{}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(
        c.get("idempotency_layer_replays_total{}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(
        c.get("idempotency_layer_records_total{}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(
        c.get("idempotency_layer_rejections_total{reason=missing_key}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(c.get("idempotency_layer_waits_total{}"), None, "{c:?}");
    // One claim was held, and ended.
    assert_eq!(
        gauges.get("idempotency_layer_in_flight{}"),
        Some(&0.0),
        "{gauges:?}"
    );
    let h = &histograms;
    // Two writes began a scope in the memory store; one completed it.
    assert_eq!(
        h.get("idempotency_layer_store_duration_seconds{op=begin,store=memory}"),
        Some(&2),
        "{h:?}"
    );
    assert_eq!(
        h.get("idempotency_layer_store_duration_seconds{op=complete,store=memory}"),
        Some(&1),
        "{h:?}"
    );
}

//! The `metrics` feature: the counters of a retried call, read from a local debugging recorder.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{Service, ServiceBuilder, ServiceExt};

/// Every counter as `name{label=value,...}` (labels in the order the key has them) -> value.
fn counters(snapshotter: &Snapshotter) -> HashMap<String, u64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let DebugValue::Counter(n) = value else {
                return None;
            };
            let key = key.key();
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            Some((format!("{}{{{}}}", key.name(), labels.join(",")), n))
        })
        .collect()
}

/// Runs `f` on a paused current-thread runtime with `recorder` as this thread's recorder.
fn with_recorder<F: std::future::Future>(recorder: &DebuggingRecorder, f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(recorder, || rt.block_on(f))
}

#[test]
fn a_retried_call_counts_its_attempts_and_retries_by_code() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let calls = Arc::new(AtomicU32::new(0));
    let backend = {
        let calls = calls.clone();
        tower::service_fn(move |_req: Request<_>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                let status = if n < 2 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::CREATED
                };
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(status)
                        .body(http_body_util::Empty::<bytes::Bytes>::new())
                        .unwrap(),
                )
            }
        })
    };
    let layer = RetryLayer::new(RetryPolicy::default());
    let mut client = ServiceBuilder::new().layer(layer.clone()).service(backend);

    let status = with_recorder(&recorder, async {
        let req = Request::put("http://orders/orders/1")
            .body(Full::new(Bytes::from("{}")))
            .unwrap();
        let res = client.ready().await.unwrap().call(req).await.unwrap();
        res.status()
    });
    assert_eq!(status, StatusCode::CREATED);

    let c = counters(&snapshotter);
    assert_eq!(c.get("retry_layer_requests_total{}"), Some(&1), "{c:?}");
    assert_eq!(
        c.get("retry_layer_attempts_total{code=UNAVAILABLE}"),
        Some(&2),
        "{c:?}"
    );
    assert_eq!(
        c.get("retry_layer_attempts_total{code=OK}"),
        Some(&1),
        "{c:?}"
    );
    let attempts: u64 = c
        .iter()
        .filter(|(k, _)| k.starts_with("retry_layer_attempts_total"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(attempts, 3);
    assert_eq!(
        c.get("retry_layer_retries_total{code=UNAVAILABLE}"),
        Some(&2),
        "{c:?}"
    );
    assert!(
        !c.keys()
            .any(|k| k.starts_with("retry_layer_give_ups_total")),
        "{c:?}"
    );
    // The metrics agree with the layer's own counters.
    assert_eq!(layer.stats().attempts, 3);
    assert_eq!(layer.stats().retries, 2);
}

/// A backend that answers every request 503.
fn always_unavailable() -> impl tower::Service<
    Request<retry_layer::ReplayBody<Full<Bytes>>>,
    Response = Response<http_body_util::Empty<bytes::Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    tower::service_fn(
        |_req: Request<retry_layer::ReplayBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(
                Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap(),
            )
        },
    )
}

#[test]
fn a_give_up_is_counted_by_reason_and_code() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let backend = always_unavailable();
    // Two attempts per call: the second 503 is returned, `exhausted`.
    let exhausting = RetryLayer::new(RetryPolicy::builder().max_attempts(2).build().unwrap());
    let mut client = ServiceBuilder::new().layer(exhausting).service(backend);
    with_recorder(&recorder, async {
        let req = Request::get("http://orders/orders/1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = client.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    });

    let c = counters(&snapshotter);
    assert_eq!(
        c.get("retry_layer_give_ups_total{reason=exhausted,code=UNAVAILABLE}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(
        c.get("retry_layer_attempts_total{code=UNAVAILABLE}"),
        Some(&2),
        "{c:?}"
    );
    assert_eq!(
        c.get("retry_layer_retries_total{code=UNAVAILABLE}"),
        Some(&1),
        "{c:?}"
    );
}

/// A retry the caller declined (`NoRetry` on the request) is a give-up of reason `declined`.
#[test]
fn a_declined_retry_is_counted_as_declined() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let backend = always_unavailable();
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(backend);
    with_recorder(&recorder, async {
        let mut req = Request::get("http://orders/orders/1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        req.extensions_mut().insert(retry_layer::NoRetry);
        let res = client.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    });

    let c = counters(&snapshotter);
    assert_eq!(
        c.get("retry_layer_give_ups_total{reason=declined,code=UNAVAILABLE}"),
        Some(&1),
        "{c:?}"
    );
    assert_eq!(
        c.get("retry_layer_retries_total{code=UNAVAILABLE}"),
        None,
        "{c:?}"
    );
}

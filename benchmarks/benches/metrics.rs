//! What the layers' `metrics` feature costs on the hot path: the same calls with no recorder
//! installed (the facade's no-op: what a build with the feature pays when nobody scrapes) and
//! with a Prometheus recorder (`metrics-exporter-prometheus`, what `orders-server` installs),
//! each against the bare service of the same run.
//!
//! - `retry/*`: `RetryLayer` with its default policy, a `POST` with a key and a 1 KiB body, a
//!   backend answering 200 at once (as in the `retry` bench);
//! - `idempotency/first/*`, `idempotency/replay/*`: `IdempotencyLayer` on `MemoryStore`, a
//!   handler answering 201 with 200 bytes (as in the `idempotency` bench).
//!
//! `cargo bench -p benchmarks --features metrics --bench metrics`; without `--features metrics`
//! the layers are built without their feature and only the `no_recorder` rows run, so the two
//! runs' `no_recorder / bare` ratios show what compiling the feature in costs.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::time::Duration;

use benchmarks::{call_to_end, created, order_request, roomy_memory_store};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response};
use http_body_util::Full;
use idempotency_layer::{IdempotencyLayer, RequestBody};
#[cfg(feature = "metrics")]
use metrics::Recorder;
#[cfg(feature = "metrics")]
use metrics_exporter_prometheus::PrometheusBuilder;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{service_fn, Layer};

fn ok<B>(_req: Request<B>) -> Ready<Result<Response<Full<Bytes>>, Infallible>> {
    ready(Ok(Response::new(Full::new(Bytes::new()))))
}

/// Runs `f` with `recorder` as this thread's recorder (the benches run on a current-thread
/// runtime, so every metric the layers record lands there), or with none.
#[cfg(feature = "metrics")]
fn recording<T>(recorder: Option<&dyn Recorder>, f: impl FnOnce() -> T) -> T {
    match recorder {
        Some(r) => metrics::with_local_recorder(r, f),
        None => f(),
    }
}

/// Without the feature there is no recorder to install.
#[cfg(not(feature = "metrics"))]
fn recording<T>(_: Option<&()>, f: impl FnOnce() -> T) -> T {
    f()
}

fn metrics_cost(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // The recorder `orders-server` installs (examples/axum-orders/src/metrics.rs): histograms
    // with buckets. (Without them the exporter keeps a summary per histogram, whose quantile
    // sketch costs a first execution, with its several store timings, about twice as much.)
    #[cfg(feature = "metrics")]
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25,
            ],
        )
        .expect("valid buckets")
        .build_recorder();
    #[cfg(feature = "metrics")]
    let recorders: [(&str, Option<&dyn Recorder>); 2] =
        [("no_recorder", None), ("prometheus", Some(&prometheus))];
    #[cfg(not(feature = "metrics"))]
    let recorders: [(&str, Option<&()>); 1] = [("no_recorder", None)];
    let mut group = c.benchmark_group("metrics");
    let body = Bytes::from(vec![b'x'; 1024]);
    let mut n = 0u64;
    let mut next_key = move || {
        n += 1;
        format!("order-{n:012}")
    };

    group.bench_function("retry/bare", |b| {
        let svc = service_fn(ok::<Full<Bytes>>);
        b.to_async(&rt).iter(|| {
            let req = order_request("k").map(|_| Full::new(body.clone()));
            let mut svc = svc;
            async move { call_to_end(&mut svc, req).await }
        })
    });
    let retry = RetryLayer::new(RetryPolicy::default());
    for (name, recorder) in recorders {
        let svc = retry.layer(service_fn(ok));
        group.bench_function(format!("retry/{name}"), |b| {
            recording(recorder, || {
                b.to_async(&rt).iter(|| {
                    let req = order_request("k").map(|_| Full::new(body.clone()));
                    let mut svc = svc.clone();
                    async move { call_to_end(&mut svc, req).await }
                })
            })
        });
    }

    group.bench_function("idempotency/bare", |b| {
        let svc = service_fn(created::<Full<Bytes>>);
        b.to_async(&rt).iter(|| {
            let req = order_request(&next_key());
            let mut svc = svc;
            async move { call_to_end(&mut svc, req).await }
        })
    });
    let store = roomy_memory_store();
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("bench"));
    let svc = layer.layer(service_fn(created::<RequestBody<Full<Bytes>>>));
    let replayed = next_key();
    rt.block_on(call_to_end(&mut svc.clone(), order_request(&replayed)));
    for (name, recorder) in recorders {
        group.bench_function(format!("idempotency/first/{name}"), |b| {
            recording(recorder, || {
                b.to_async(&rt).iter(|| {
                    let req = order_request(&next_key());
                    let mut svc = svc.clone();
                    async move { call_to_end(&mut svc, req).await }
                })
            })
        });
        group.bench_function(format!("idempotency/replay/{name}"), |b| {
            recording(recorder, || {
                b.to_async(&rt).iter(|| {
                    let req = order_request(&replayed);
                    let mut svc = svc.clone();
                    async move { call_to_end(&mut svc, req).await }
                })
            })
        });
    }
    group.finish();

    let held = store.stats();
    assert_eq!(
        (held.refused, held.evicted, held.bodies_dropped),
        (0, 0, 0),
        "every first execution ran and was recorded whole"
    );
    // The recorder did record: the bench measured the real cost, not a no-op.
    #[cfg(feature = "metrics")]
    {
        let scrape = prometheus.handle().render();
        for name in [
            "retry_layer_requests_total",
            "idempotency_layer_executions_total",
            "idempotency_layer_replays_total",
        ] {
            assert!(
                scrape.contains(name),
                "{name} missing from the scrape:\n{scrape}"
            );
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = metrics_cost
}
criterion_main!(benches);

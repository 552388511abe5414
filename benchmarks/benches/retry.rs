//! Retry success path with a trivial inner service (answers 200 at once): the bare service,
//! `tower::retry::Retry` with the minimal policy a user would write (clone the
//! `Request<Full<Bytes>>`, retry on 503), and our `RetryLayer` with its default policy, for
//! request bodies of 0 B, 1 KiB and 64 KiB. The setup is `benchmarks::retry`, shared with the
//! `targets` binary.
//!
//! `cargo bench -p benchmarks --bench retry`

use std::time::Duration;

use benchmarks::retry::{bare, drive, retry_layer, tower_retry, BODY_SIZES};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

fn success_path(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("retry_success");
    for (size, label) in BODY_SIZES {
        let body = Bytes::from(vec![b'x'; size]);
        group.bench_with_input(BenchmarkId::new("bare", label), &body, |b, body| {
            let svc = bare();
            b.to_async(&rt).iter(|| {
                let mut svc = svc;
                async move { drive(&mut svc, body).await }
            });
        });
        group.bench_with_input(BenchmarkId::new("tower_retry", label), &body, |b, body| {
            let svc = tower_retry();
            b.to_async(&rt).iter(|| {
                let mut svc = svc.clone();
                async move { drive(&mut svc, body).await }
            });
        });
        group.bench_with_input(BenchmarkId::new("retry_layer", label), &body, |b, body| {
            // The layer outlives the iterations: its budget and counters are shared by clones.
            let svc = retry_layer();
            b.to_async(&rt).iter(|| {
                let mut svc = svc.clone();
                async move { drive(&mut svc, body).await }
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = success_path
}
criterion_main!(benches);

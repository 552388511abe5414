//! The idempotency layer with a trivial handler (201 with a 200-byte body), no sockets, one
//! request at a time, each response body read to its end (that is when a record is stored):
//!
//! - `no_layer`: the handler alone (the baseline);
//! - `layer/first`: first executions, a new key each time (claim, run, record);
//! - `layer/replay`: one recorded key, replayed;
//! - `layer/waiters`: one leader whose handler waits on a gate, and 4 duplicates that join it
//!   in flight and get its response (time per group of 5 requests);
//! - `naive_cache/first`, `naive_cache/replay`: the `Mutex<HashMap<key, body>>` a user might
//!   write instead (no tenant, fingerprint, single-flight, TTL or streaming).
//!
//! The setup is `benchmarks::idempotency`, shared with the `targets` binary.
//!
//! `cargo bench -p benchmarks --bench idempotency`

use std::sync::Arc;
use std::time::Duration;

use benchmarks::idempotency::{assert_recorded_whole, bench_layer, naive, KeyGen};
use benchmarks::{call_to_end, created, order_request, NaiveCache};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::{Request, Response};
use http_body_util::Full;
use idempotency_layer::{IdempotencyLayer, MemoryStore, RequestBody};
use tokio::sync::Semaphore;
use tower::{service_fn, Layer};

const WAITERS: usize = 4;

/// A handler that waits for a permit of the request's gate, then answers like `created`.
async fn gated(
    req: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    if let Some(gate) = req.extensions().get::<Arc<Semaphore>>().cloned() {
        gate.acquire().await.expect("open").forget();
    }
    created(req).await
}

fn idempotency(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("idempotency");
    let mut keys = KeyGen::new("order");
    let mut next_key = move || keys.next_key();

    group.bench_function("no_layer", |b| {
        let svc = service_fn(created::<Full<Bytes>>);
        b.to_async(&rt).iter(|| {
            let req = order_request(&next_key());
            let mut svc = svc;
            async move { call_to_end(&mut svc, req).await }
        })
    });

    let (layer, store) = bench_layer();
    let svc = layer.layer(service_fn(created::<RequestBody<Full<Bytes>>>));
    group.bench_function("layer/first", |b| {
        b.to_async(&rt).iter(|| {
            let req = order_request(&next_key());
            let mut svc = svc.clone();
            async move { call_to_end(&mut svc, req).await }
        })
    });
    let replayed = next_key();
    rt.block_on(call_to_end(&mut svc.clone(), order_request(&replayed)));
    group.bench_function("layer/replay", |b| {
        b.to_async(&rt).iter(|| {
            let req = order_request(&replayed);
            let mut svc = svc.clone();
            async move { call_to_end(&mut svc, req).await }
        })
    });
    let before = layer.stats();

    let cache = Arc::new(NaiveCache::default());
    group.bench_function("naive_cache/first", |b| {
        b.to_async(&rt).iter(|| {
            let req = order_request(&next_key());
            let cache = cache.clone();
            async move { naive(&cache, req).await }
        })
    });
    rt.block_on(naive(&cache, order_request(&replayed)));
    group.bench_function("naive_cache/replay", |b| {
        b.to_async(&rt).iter(|| {
            let req = order_request(&replayed);
            let cache = cache.clone();
            async move { naive(&cache, req).await }
        })
    });

    let waiting = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("bench"));
    let gated_svc = waiting.layer(service_fn(gated));
    group.throughput(Throughput::Elements(1 + WAITERS as u64));
    group.bench_function("layer/waiters", |b| {
        b.to_async(&rt).iter(|| {
            let key = next_key();
            let gate = Arc::new(Semaphore::new(0));
            let svc = gated_svc.clone();
            async move {
                let mut leader = order_request(&key);
                leader.extensions_mut().insert(gate.clone());
                let mut all = vec![tokio::spawn({
                    let mut svc = svc.clone();
                    async move { call_to_end(&mut svc, leader).await }
                })];
                // Let the leader claim the key before the duplicates arrive.
                tokio::task::yield_now().await;
                for _ in 0..WAITERS {
                    let mut svc = svc.clone();
                    let req = order_request(&key);
                    all.push(tokio::spawn(
                        async move { call_to_end(&mut svc, req).await },
                    ));
                }
                tokio::task::yield_now().await;
                gate.add_permits(1);
                for h in all {
                    std::hint::black_box(h.await.expect("joined"));
                }
            }
        })
    });
    group.finish();

    assert_recorded_whole(&store);
    let m = layer.stats();
    assert_eq!(
        m.replayed, before.replayed,
        "no replay outside layer/replay"
    );
    let w = waiting.stats();
    println!(
        "layer/waiters: {} executed, {} waited, {} replayed (waiters get the leader's response)",
        w.executed, w.waited, w.replayed
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = idempotency
}
criterion_main!(benches);

//! Retry success path with a trivial inner service (answers 200 at once): the bare service,
//! `tower::retry::Retry` with the minimal policy a user would write (clone the
//! `Request<Full<Bytes>>`, retry on 503), and our `RetryLayer` with its default policy, for
//! request bodies of 0 B, 1 KiB and 64 KiB.
//!
//! `cargo bench -p benchmarks --bench retry`

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::retry::Policy;
use tower::{service_fn, Layer, Service, ServiceExt};

/// The trivial backend: 200, empty body, whatever the request.
fn ok<B>(_req: Request<B>) -> Ready<Result<Response<()>, Infallible>> {
    ready(Ok(Response::new(())))
}

/// The tower::retry policy a user writes: clone the request, retry on 503, at most 2 retries.
#[derive(Clone, Debug)]
struct CloneOn503(usize);

impl Policy<Request<Full<Bytes>>, Response<()>, Infallible> for CloneOn503 {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<()>, Infallible>,
    ) -> Option<Self::Future> {
        match result {
            Ok(res) if res.status() == StatusCode::SERVICE_UNAVAILABLE && self.0 > 0 => {
                self.0 -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

fn request(body: &Bytes) -> Request<Full<Bytes>> {
    Request::post("http://orders.local/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", "order-7f3a9c21-5b1e")
        .body(Full::new(body.clone()))
        .expect("valid request")
}

async fn drive<S>(svc: &mut S, body: &Bytes)
where
    S: Service<Request<Full<Bytes>>>,
    S::Error: std::fmt::Debug,
{
    let res = svc
        .ready()
        .await
        .expect("ready")
        .call(request(body))
        .await
        .expect("ok");
    std::hint::black_box(res);
}

fn success_path(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("retry_success");
    for size in [0usize, 1024, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        let label = match size {
            0 => "0B",
            1024 => "1KiB",
            _ => "64KiB",
        };
        group.bench_with_input(BenchmarkId::new("bare", label), &body, |b, body| {
            let svc = service_fn(ok::<Full<Bytes>>);
            b.to_async(&rt).iter(|| {
                let mut svc = svc;
                async move { drive(&mut svc, body).await }
            });
        });
        group.bench_with_input(BenchmarkId::new("tower_retry", label), &body, |b, body| {
            let svc =
                tower::retry::RetryLayer::new(CloneOn503(2)).layer(service_fn(ok::<Full<Bytes>>));
            b.to_async(&rt).iter(|| {
                let mut svc = svc.clone();
                async move { drive(&mut svc, body).await }
            });
        });
        group.bench_with_input(BenchmarkId::new("retry_layer", label), &body, |b, body| {
            // The layer outlives the iterations: its budget and counters are shared by clones.
            let svc = RetryLayer::new(RetryPolicy::default())
                .layer(service_fn(ok::<retry_layer::ReplayBody<Full<Bytes>>>));
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

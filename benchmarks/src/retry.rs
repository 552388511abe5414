//! The retry success path's setup, shared by `benches/retry.rs` and the `targets` binary: a
//! trivial backend answering 200 at once, the `tower::retry` policy a user writes (clone the
//! `Request<Full<Bytes>>`, retry on 503), the request, and one call driven to its answer.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{Empty, Full};
use retry_layer::{RetryLayer, RetryPolicy};
use tower::retry::Policy;
use tower::{service_fn, Layer, Service, ServiceExt};

/// The request body sizes measured: 0 B, 1 KiB and 64 KiB, with their labels.
pub const BODY_SIZES: [(usize, &str); 3] = [(0, "0B"), (1024, "1KiB"), (64 * 1024, "64KiB")];

/// The trivial backend: 200, empty body, whatever the request.
pub fn ok<B>(_req: Request<B>) -> Ready<Result<Response<Empty<Bytes>>, Infallible>> {
    ready(Ok(Response::new(Empty::new())))
}

/// The `tower::retry` policy a user writes: clone the request (`Request::clone`, http 1: its
/// head with its extensions, and its body, a `Bytes`: a reference count; the retry layer keeps
/// the same copy of the head), retry on 503, at most `.0` retries. Any response body and error: the micro benchmark's trivial backend and the load
/// test's hyper client alike.
#[derive(Clone, Debug)]
pub struct CloneOn503(pub usize);

impl<B, E> Policy<Request<Full<Bytes>>, Response<B>, E> for CloneOn503 {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<B>, E>,
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
        Some(req.clone())
    }
}

/// A keyed `POST` with `body`.
pub fn request(body: &Bytes) -> Request<Full<Bytes>> {
    Request::post("http://orders.local/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", "order-7f3a9c21-5b1e")
        .body(Full::new(body.clone()))
        .expect("valid request")
}

/// One request through `svc`: ready, call, await the answer.
pub async fn drive<S>(svc: &mut S, body: &Bytes)
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

/// The bare backend.
pub fn bare() -> impl Service<Request<Full<Bytes>>, Error = Infallible> + Copy {
    service_fn(ok::<Full<Bytes>>)
}

/// The backend behind `tower::retry::Retry` with [`CloneOn503`] (2 retries).
pub fn tower_retry() -> impl Service<Request<Full<Bytes>>, Error = Infallible> + Clone {
    tower::retry::RetryLayer::new(CloneOn503(2)).layer(service_fn(ok::<Full<Bytes>>))
}

/// The backend behind our `RetryLayer` with `RetryPolicy::default()`. Keep it for the whole
/// measurement: its budget and counters are shared by its clones.
pub fn retry_layer(
) -> impl Service<Request<Full<Bytes>>, Error = retry_layer::reason_code::BoxError> + Clone {
    RetryLayer::new(RetryPolicy::default())
        .layer(service_fn(ok::<retry_layer::ReplayBody<Full<Bytes>>>))
}

/// Mean time per call of `iters` calls of a clone of `svc` with `body`, one at a time on the
/// current-thread runtime `rt` (what criterion's `to_async(..).iter` does per iteration).
pub fn time_calls<S>(rt: &tokio::runtime::Runtime, svc: &S, body: &Bytes, iters: u64) -> Duration
where
    S: Service<Request<Full<Bytes>>> + Clone,
    S::Error: std::fmt::Debug,
{
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let mut svc = svc.clone();
            drive(&mut svc, body).await;
        }
        start.elapsed() / iters.max(1) as u32
    })
}

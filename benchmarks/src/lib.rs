//! Shared pieces of the benchmarks: the requests, the trivial handlers and the baselines a user
//! would write instead of our layers. See `BENCHMARKS.md` at the repository root for what is
//! measured, how to run it, and the results.
//!
//! - `benches/retry.rs`: the retry success path (bare, `tower::retry` with a cloning policy,
//!   ours); its setup is [`retry`].
//! - `benches/retry_budget.rs`: the retry budget under contention from two threads.
//! - `benches/idempotency.rs`: the idempotency layer with a trivial handler; its setup is
//!   [`idempotency`].
//! - `benches/store.rs`: `MemoryStore` against a `Mutex<HashMap>` store, on one and two
//!   threads; its work is [`store_pairs`].
//! - `src/bin/loadtest.rs`: both layers over real sockets (HTTP and gRPC), with Redis and
//!   PostgreSQL stores; its machinery is [`load`] and [`grpc`].
//! - `peer` (feature `axum-idempotent`): the peer a user would pick instead, axum-idempotent, in
//!   the load test's rounds beside our layer and the naive cache.
//! - `src/bin/targets.rs`: the whole performance target table in one run, from the same pieces.
//!
//! Every binary runs on the system allocator, or on mimalloc or jemalloc with the feature of
//! that name ([`ALLOCATOR`] says which).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;

pub mod baseline;
pub mod grpc;

// The allocator every benchmark binary runs on: a feature of this crate, so that one binary
// compares them (`--features mimalloc`, `--features jemalloc`); the libraries never choose.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The allocator this build runs on (`system`, `mimalloc` or `jemalloc`), for the reports.
pub const ALLOCATOR: &str = if cfg!(feature = "mimalloc") {
    "mimalloc"
} else if cfg!(feature = "jemalloc") {
    "jemalloc"
} else {
    "system"
};

pub mod idempotency;
pub mod load;
#[cfg(feature = "axum-idempotent")]
pub mod peer;
pub mod retry;
pub mod store_pairs;

/// The body every trivial handler answers with: 200 bytes of JSON.
pub const RESPONSE_200: &[u8] = br#"{"order":"o-0000000001","status":"created","sku":"b1","quantity":1,"unit_price_cents":1299,"total_cents":1299,"currency":"EUR","warehouse":"fra-1","estimated_delivery":"2026-12-03","note":"benchmark"}"#;

/// The request body of a write: a small JSON order.
pub const ORDER: &[u8] = br#"{"sku":"b1","qty":1}"#;

/// A POST `/orders` with `key` as its idempotency key and [`ORDER`] as its body.
pub fn order_request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::from_static(ORDER)))
        .expect("a valid request")
}

/// A `MemoryStore` with room for every first execution of a benchmark run (millions): the
/// default's 128 MiB, half of it per tenant, fills after about 85 000 records of these
/// responses, and a full store answers 503 without running anything, so a benchmark would time
/// refusals. Check `stats().refused == 0` after the run.
pub fn roomy_memory_store() -> idempotency_layer::MemoryStore {
    idempotency_layer::MemoryStore::builder()
        .max_entries(8_000_000)
        .max_bytes(8 << 30)
        .tenant_share_percent(100)
        .build()
        .expect("valid MemoryStore settings")
}

/// Calls `svc` once it is ready and reads the response body to its end (when an idempotency
/// layer stores its record).
pub async fn call_to_end<S, B>(svc: &mut S, req: Request<Full<Bytes>>) -> Bytes
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let res = svc
        .ready()
        .await
        .expect("ready")
        .call(req)
        .await
        .expect("ok");
    res.into_body().collect().await.expect("body").to_bytes()
}

/// A trivial handler: answers 201 with [`RESPONSE_200`], whatever the request.
pub fn created<B>(_req: Request<B>) -> Ready<Result<Response<Full<Bytes>>, Infallible>> {
    let mut res = Response::new(Full::new(Bytes::from_static(RESPONSE_200)));
    *res.status_mut() = StatusCode::CREATED;
    ready(Ok(res))
}

/// [`created`] with the head of a JSON API's answer, `content-type: application/json` (as the
/// load test's axum handler answers).
pub fn created_json<B>(_req: Request<B>) -> Ready<Result<Response<Full<Bytes>>, Infallible>> {
    let mut res = Response::new(Full::new(Bytes::from_static(RESPONSE_200)));
    *res.status_mut() = StatusCode::CREATED;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    ready(Ok(res))
}

/// Idempotency keys `{prefix}-{i:012}` (valid keys: 8 to 64 of `[A-Za-z0-9_-]`).
pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:012}")).collect()
}

/// Resident memory of this process in bytes (`VmRSS` of `/proc/self/status`), if readable.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The median of `values` (sorted in place); 0 when empty.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A hand-rolled response cache a user might write instead of an idempotency layer: one
/// `Mutex<HashMap>` from key to a recorded value (a body, or [`baseline::NaiveResponse`]). No
/// tenant scoping, fingerprint, single-flight, TTL or capacity.
#[derive(Debug)]
pub struct NaiveCache<V = Bytes> {
    map: Mutex<HashMap<String, V>>,
}

impl<V> Default for NaiveCache<V> {
    fn default() -> Self {
        NaiveCache {
            map: Mutex::default(),
        }
    }
}

impl<V: Clone> NaiveCache<V> {
    /// The recorded value of `key`, if any.
    pub fn get(&self, key: &str) -> Option<V> {
        self.map.lock().expect("not poisoned").get(key).cloned()
    }

    /// Records `value` for `key`.
    pub fn put(&self, key: String, value: V) {
        self.map.lock().expect("not poisoned").insert(key, value);
    }
}

/// Wall time of `threads` threads running the work `make(t)` returns (made beforehand, on this
/// thread: setup is not timed), all released at once by a barrier; the clock stops when the
/// last one ends. What a work returns is dropped after that (not timed).
pub fn timed_threads<W, R>(threads: usize, make: impl Fn(usize) -> W) -> Duration
where
    W: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let work = make(t);
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let kept = work();
                barrier.wait();
                // Dropped after the clock stopped: a work's store or runtime, emptied here,
                // is not part of its time.
                drop(kept);
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    barrier.wait();
    let elapsed = start.elapsed();
    for h in handles {
        h.join().expect("thread");
    }
    elapsed
}

//! Shared pieces of the benchmarks: the requests, the trivial handlers and the baselines a user
//! would write instead of our layers. See `BENCHMARKS.md` at the repository root for what is
//! measured, how to run it, and the results.
//!
//! - `benches/retry.rs`: the retry success path (bare, `tower::retry` with a cloning policy, ours).
//! - `benches/retry_budget.rs`: the retry budget under contention from two threads.
//! - `benches/idempotency.rs`: the idempotency layer with a trivial handler.
//! - `benches/store.rs`: `MemoryStore` against a `Mutex<HashMap>` store, on one and two threads.
//! - `src/bin/loadtest.rs`: both layers over real sockets, with Redis and PostgreSQL stores.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::Mutex;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;

pub mod baseline;

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

/// A trivial handler: answers 201 with [`RESPONSE_200`], whatever the request.
pub fn created<B>(_req: Request<B>) -> Ready<Result<Response<Full<Bytes>>, Infallible>> {
    let mut res = Response::new(Full::new(Bytes::from_static(RESPONSE_200)));
    *res.status_mut() = StatusCode::CREATED;
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
/// `Mutex<HashMap>` from key to recorded body. No tenant scoping, fingerprint, single-flight,
/// TTL or capacity.
#[derive(Debug, Default)]
pub struct NaiveCache {
    map: Mutex<HashMap<String, Bytes>>,
}

impl NaiveCache {
    /// The recorded body of `key`, if any.
    pub fn get(&self, key: &str) -> Option<Bytes> {
        self.map.lock().expect("not poisoned").get(key).cloned()
    }

    /// Records `body` for `key`.
    pub fn put(&self, key: String, body: Bytes) {
        self.map.lock().expect("not poisoned").insert(key, body);
    }
}

//! The idempotency benchmark's setup, shared by `benches/idempotency.rs` and the `targets`
//! binary: the layer over a store with room for the whole run, the hand-rolled cache a user
//! might write instead, fresh keys, and a timed loop.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use idempotency_layer::{IdempotencyLayer, MemoryStore};

use crate::{created, roomy_memory_store, NaiveCache};

/// The layer the benchmark measures: a [`roomy_memory_store`] (so that no first execution is
/// refused), tenant `bench`. Check [`assert_recorded_whole`] on its store afterwards.
pub fn bench_layer() -> (IdempotencyLayer<MemoryStore>, MemoryStore) {
    let store = roomy_memory_store();
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("bench"));
    (layer, store)
}

/// Panics unless every first execution on `store` ran and was recorded whole (none refused,
/// evicted, or stored without its body): otherwise a benchmark timed something else.
pub fn assert_recorded_whole(store: &MemoryStore) {
    let held = store.stats();
    assert_eq!(
        (held.refused, held.evicted, held.bodies_dropped),
        (0, 0, 0),
        "every first execution ran and was recorded whole"
    );
}

/// The hand-rolled peer: check the map, else run the handler and remember its body.
pub async fn naive(cache: &NaiveCache, req: Request<Full<Bytes>>) -> Bytes {
    let key = req.headers()["x-idempotency-key"]
        .to_str()
        .expect("ascii")
        .to_owned();
    if let Some(b) = cache.get(&key) {
        return b;
    }
    let res = created(req).await.expect("infallible");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    cache.put(key, body.clone());
    body
}

/// Fresh idempotency keys: `{prefix}-{n:012}` for n = 1, 2, ...
#[derive(Debug)]
pub struct KeyGen {
    prefix: &'static str,
    n: u64,
}

impl KeyGen {
    /// Keys starting with `prefix`.
    pub fn new(prefix: &'static str) -> Self {
        KeyGen { prefix, n: 0 }
    }

    /// The next key. Written digit by digit into a string of the right capacity: `format!`
    /// (its formatter, padding and the string's growth) cost ~1 500 instructions per key, a
    /// quarter of the `no_layer` baseline's request, which every case of the benchmark paid.
    pub fn next_key(&mut self) -> String {
        self.n += 1;
        let mut digits = [b'0'; 20];
        let (mut n, mut start) = (self.n, digits.len());
        while n > 0 {
            start -= 1;
            digits[start] = b'0' + (n % 10) as u8;
            n /= 10;
        }
        let start = start.min(digits.len() - 12);
        let mut key = String::with_capacity(self.prefix.len() + 1 + digits.len() - start);
        key.push_str(self.prefix);
        key.push('-');
        key.push_str(std::str::from_utf8(&digits[start..]).expect("ASCII digits"));
        key
    }
}

/// Mean time per request of `iters` requests, one at a time on `rt`: `make(key)` builds each
/// request's future from a fresh key of `keys` (or ignores it, for a replay).
pub fn time_requests<F: Future>(
    rt: &tokio::runtime::Runtime,
    iters: u64,
    keys: &mut KeyGen,
    mut make: impl FnMut(String) -> F,
) -> Duration {
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            std::hint::black_box(make(keys.next_key()).await);
        }
        start.elapsed() / iters.max(1) as u32
    })
}

#[cfg(test)]
mod tests {
    use super::KeyGen;

    #[test]
    fn keys_are_the_prefix_and_twelve_digits() {
        let mut keys = KeyGen::new("order");
        assert_eq!(keys.next_key(), "order-000000000001");
        keys.n = 999_999_999_998;
        assert_eq!(keys.next_key(), "order-999999999999");
        assert_eq!(keys.next_key(), "order-1000000000000");
        keys.n = u64::MAX - 1;
        assert_eq!(keys.next_key(), format!("order-{}", u64::MAX));
    }
}

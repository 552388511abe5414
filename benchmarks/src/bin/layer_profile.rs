//! The idempotency layer's first execution and replay as one loop, for instruction counts
//! under callgrind (instructions, not seconds: the same on a loaded machine as on an idle one).
//! `bare` (the handler alone), `first` (a new key per request: claim, run, record) or `replay`
//! (one recorded key), on the idempotency bench's handler and request; and `near_replay`, the
//! replay on a `RedisStore` with a near cache (`REDIS_URL` must be set: the record is stored in
//! Redis once, the first replay reads it from Redis, and every later one is a near-cache hit,
//! with no round trip); `tenant_replay`, the replay of a request whose tenant an auth layer set
//! (the `Tenant` extension, its key computed per request); and `bare_json`, `first_json` and
//! `replay_json`, the same three on a handler that answers `content-type: application/json`, as
//! a JSON API (and the load test's handler) does:
//!
//! ```text
//! cargo build --profile bench -p benchmarks --bin layer_profile
//! for w in bare first replay bare_json first_json replay_json near_replay tenant_replay; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$w target/release/layer_profile $w 20000
//! done
//! callgrind_annotate --inclusive=yes cg.first | head -80
//! ```
//!
//! Instructions per request = (total - the `bare` total) / requests; see BENCHMARKS.md.

use std::convert::Infallible;
use std::future::Ready;

use benchmarks::idempotency::{assert_recorded_whole, bench_layer, KeyGen};
use benchmarks::{call_to_end, created, created_json, order_request};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use idempotency_layer::store::NearCache;
use idempotency_layer::{IdempotencyLayer, RedisStore, RequestBody};
use tower::{service_fn, Layer};

/// The answer of a bench handler ([`created`], [`created_json`]).
type Answer = Ready<Result<Response<Full<Bytes>>, Infallible>>;

/// `handler` alone, a new key per request.
async fn bare<H>(handler: H, requests: usize, keys: &mut KeyGen)
where
    H: FnMut(Request<Full<Bytes>>) -> Answer,
{
    let mut svc = service_fn(handler);
    for _ in 0..requests {
        call_to_end(&mut svc, order_request(&keys.next_key())).await;
    }
}

/// `handler` under the layer: a new key per request (`first`), or one recorded key.
async fn first_or_replay<H>(handler: H, first: bool, requests: usize, keys: &mut KeyGen)
where
    H: FnMut(Request<RequestBody<Full<Bytes>>>) -> Answer + Clone + Send + Sync + 'static,
{
    let (layer, store) = bench_layer();
    let mut svc = layer.layer(service_fn(handler));
    let replayed = keys.next_key();
    call_to_end(&mut svc, order_request(&replayed)).await;
    for _ in 0..requests {
        let key = if first {
            keys.next_key()
        } else {
            replayed.clone()
        };
        call_to_end(&mut svc, order_request(&key)).await;
    }
    assert_recorded_whole(&store);
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let requests: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().expect("requests: a number"))
        .unwrap_or(20_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut keys = KeyGen::new("order");
    rt.block_on(async {
        match which.as_str() {
            "bare" => bare(created, requests, &mut keys).await,
            "bare_json" => bare(created_json, requests, &mut keys).await,
            "first" | "replay" => {
                first_or_replay(created, which == "first", requests, &mut keys).await
            }
            "first_json" | "replay_json" => {
                first_or_replay(created_json, which == "first_json", requests, &mut keys).await
            }
            "tenant_replay" => {
                let tenant = idempotency_layer::Tenant::new("acme-corporation");
                let request = |key: &str| {
                    let mut req = order_request(key);
                    req.extensions_mut().insert(tenant.clone());
                    req
                };
                let layer = IdempotencyLayer::new(benchmarks::roomy_memory_store());
                let mut svc = layer.layer(service_fn(created::<RequestBody<Full<Bytes>>>));
                let replayed = keys.next_key();
                call_to_end(&mut svc, request(&replayed)).await;
                for _ in 0..requests {
                    call_to_end(&mut svc, request(&replayed)).await;
                }
                assert_eq!(
                    layer.stats().replayed,
                    requests as u64,
                    "every later one replayed"
                );
            }
            "near_replay" => {
                let url = std::env::var("REDIS_URL").expect("near_replay needs REDIS_URL");
                let prefix = format!("layer_profile:{}:", std::process::id());
                let store = RedisStore::builder(&url)
                    .near_cache(NearCache::new(1 << 20))
                    .prefix(&prefix)
                    .connect()
                    .await
                    .expect("connect to REDIS_URL");
                let layer = IdempotencyLayer::new(store.clone())
                    .tenant(idempotency_layer::TenantSource::fixed("bench"));
                let mut svc = layer.layer(service_fn(created::<RequestBody<Full<Bytes>>>));
                let replayed = keys.next_key();
                call_to_end(&mut svc, order_request(&replayed)).await;
                for _ in 0..requests {
                    call_to_end(&mut svc, order_request(&replayed)).await;
                }
                // The first replay reads Redis and fills the near cache; the rest are hits.
                let stats = store.near_cache_stats().expect("a near cache");
                assert_eq!(stats.hits + 1, requests as u64, "every later replay a hit");
            }
            other => panic!(
                "usage: layer_profile bare|first|replay|bare_json|first_json|replay_json|\
                 near_replay|tenant_replay [requests], not {other:?}"
            ),
        }
    });
}

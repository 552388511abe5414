//! Measures the layer's hot paths against the peer a user would otherwise write: a hand-rolled
//! `Mutex<HashMap<key, response>>` in front of the handler (no tenant scoping, no fingerprint,
//! no single-flight, no streaming, no TTL).
//!
//! Run: `cargo run --release -p idempotency-layer --example measure`. Prints nanoseconds per
//! request and the ratio to the peer, all from one run.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idempotency_layer::{IdempotencyLayer, MemoryStore, RequestBody};
use tower::{service_fn, Layer, Service, ServiceExt};

const N: usize = 50_000;

fn request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"b1\",\"qty\":1}")))
        .unwrap()
}

async fn handler<B>(_req: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(
        b"{\"order\":\"o-1\",\"status\":\"created\"}",
    ))))
}

/// The peer: check a map, else run the handler and remember its body.
async fn peer(
    map: &Mutex<HashMap<String, Bytes>>,
    req: Request<Full<Bytes>>,
) -> Response<Full<Bytes>> {
    let key = req.headers()["x-idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    if let Some(b) = map.lock().unwrap().get(&key).cloned() {
        return Response::new(Full::new(b));
    }
    let res = handler(req).await.unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    map.lock().unwrap().insert(key, body.clone());
    Response::new(Full::new(body))
}

fn per_request(start: Instant) -> f64 {
    start.elapsed().as_nanos() as f64 / N as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let keys: Vec<String> = (0..N).map(|i| format!("order-key-{i:08}")).collect();

    // Layer: first executions (distinct keys), then replays (one key).
    let layer = IdempotencyLayer::new(MemoryStore::with_capacity(2 * N)).default_tenant("t");
    let mut svc = layer.layer(service_fn(handler::<RequestBody<Full<Bytes>>>));
    let t = Instant::now();
    for k in &keys {
        let res = svc.ready().await.unwrap().call(request(k)).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    let layer_first = per_request(t);
    let t = Instant::now();
    for _ in 0..N {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request(&keys[0]))
            .await
            .unwrap();
        res.into_body().collect().await.unwrap();
    }
    let layer_replay = per_request(t);

    // Peer.
    let map = Mutex::new(HashMap::new());
    let t = Instant::now();
    for k in &keys {
        peer(&map, request(k))
            .await
            .into_body()
            .collect()
            .await
            .unwrap();
    }
    let peer_first = per_request(t);
    let t = Instant::now();
    for _ in 0..N {
        peer(&map, request(&keys[0]))
            .await
            .into_body()
            .collect()
            .await
            .unwrap();
    }
    let peer_replay = per_request(t);

    // Reads through the layer vs the bare handler.
    let mut bare = service_fn(handler::<Full<Bytes>>);
    let get = || {
        Request::get("/orders")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let t = Instant::now();
    for _ in 0..N {
        let res = bare.ready().await.unwrap().call(get()).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    let bare_read = per_request(t);
    let t = Instant::now();
    for _ in 0..N {
        let res = svc.ready().await.unwrap().call(get()).await.unwrap();
        res.into_body().collect().await.unwrap();
    }
    let layer_read = per_request(t);

    println!("requests per case: {N}");
    println!(
        "first execution: layer {layer_first:>8.0} ns, Mutex<HashMap> {peer_first:>8.0} ns, ratio {:.2}",
        layer_first / peer_first
    );
    println!(
        "replay:          layer {layer_replay:>8.0} ns, Mutex<HashMap> {peer_replay:>8.0} ns, ratio {:.2}",
        layer_replay / peer_replay
    );
    println!(
        "read passthrough: layer {layer_read:>7.0} ns, bare handler   {bare_read:>8.0} ns, ratio {:.2}",
        layer_read / bare_read
    );
    let m = layer.metrics();
    assert_eq!(m.executed as usize, N);
    assert_eq!(m.replayed as usize, N);
}

//! Peers on the same axum handler (POST /orders answering 201 with 200 bytes), in one process,
//! requests through `Router::oneshot` (no sockets), interleaved rounds, median ns/request:
//! no layer; idempotency-layer (MemoryStore) first executions and replays; axum-idempotent
//! 0.6 (ruts session layer with MokaStore, key from `x-idempotency-key`) first executions and
//! replays. axum-idempotent caches responses only for a request that carries an existing
//! session, so the peer's requests carry a session cookie from a `/login` route; its first
//! executions get a fresh session every 100 requests (one session holding every response
//! grows without bound and makes each first execution cost ~0.5 ms).
//!
//! `cargo run --release --manifest-path benchmarks/peers/Cargo.toml`
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use http::{Request, StatusCode};
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use ruts::store::moka::MokaStore;
use ruts::store::Ttl;
use ruts::{CookieOptions, Session, SessionLayer};
use tower::ServiceExt;
use tower_cookies::CookieManagerLayer;

const RESPONSE_200: &[u8] = br#"{"order":"o-0000000001","status":"created","sku":"b1","quantity":1,"unit_price_cents":1299,"total_cents":1299,"currency":"EUR","warehouse":"fra-1","estimated_delivery":"2026-12-03","note":"benchmark"}"#;
const N: usize = 20_000;
const ROUNDS: usize = 7;

fn handler() -> Router {
    Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, [("content-type", "application/json")], RESPONSE_200) }),
    )
}

fn req(key: &str, cookie: Option<&str>) -> Request<Body> {
    let mut b = Request::post("/orders")
        .header("content-type", "application/json")
        .header("x-idempotency-key", key);
    if let Some(c) = cookie {
        b = b.header("cookie", c);
    }
    b.body(Body::from(&br#"{"sku":"b1","qty":1}"#[..])).unwrap()
}

async fn send(app: &Router, r: Request<Body>) -> (StatusCode, bool) {
    let res = app.clone().oneshot(r).await.unwrap();
    let s = res.status();
    let replayed = res.headers().contains_key("idempotent-replayed") || res.headers().contains_key("idempotency-replayed");
    axum::body::to_bytes(res.into_body(), 1 << 20).await.unwrap();
    (s, replayed)
}

async fn time(app: &Router, cookie: Option<&str>, keys: impl Fn(usize) -> String) -> (f64, usize) {
    let t = Instant::now();
    let mut replays = 0;
    for i in 0..N {
        let (s, r) = send(app, req(&keys(i), cookie)).await;
        assert_eq!(s, StatusCode::CREATED);
        replays += r as usize;
    }
    (t.elapsed().as_nanos() as f64 / N as f64, replays)
}

async fn login(peer: &Router) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let k = format!("login-{:010}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let login = peer.clone().oneshot(Request::post("/login").header("x-idempotency-key", k).body(Body::empty()).unwrap()).await.unwrap();
    login.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_owned()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let bare = handler();
    let ours = handler().layer(IdempotencyLayer::new(MemoryStore::new()).tenant(idempotency_layer::TenantSource::fixed("bench")));
    let moka = Arc::new(MokaStore::builder().build());
    let peer = handler()
        .route(
            "/login",
            post(|s: Session<MokaStore>| async move {
                s.set("user", &1i64, Ttl::new(3600).unwrap(), None).await.unwrap();
                "ok"
            }),
        )
        .layer(IdempotentLayer::<MokaStore>::new(
            IdempotentOptions::default().use_idempotency_key_header(Some("x-idempotency-key"), true),
        ))
        .layer(SessionLayer::new(moka).with_cookie_options(CookieOptions::build().name("session").path("/")))
        .layer(CookieManagerLayer::new());
    let cookie = login(&peer).await;
    let cookie = Some(cookie.as_str());

    let mut r: [Vec<f64>; 5] = Default::default();
    let mut replays = [0usize; 5];
    for round in 0..ROUNDS {
        let (t, _) = time(&bare, None, |i| format!("bare-{round}-{i:010}")).await;
        r[0].push(t);
        let (t, n) = time(&ours, None, |i| format!("ours-{round}-{i:010}")).await;
        r[1].push(t);
        replays[1] += n;
        let (t, n) = time(&ours, None, |_| "ours-replay-0000".to_owned()).await;
        r[2].push(t);
        replays[2] += n;
        // A fresh session every 100 requests: axum-idempotent keeps every cached response in
        // the client's session, so one session with 20 000 keys grows without bound.
        let mut total = 0.0;
        for block in 0..N / 100 {
            let c = login(&peer).await;
            let t = Instant::now();
            for i in 0..100 {
                let (s, r) = send(&peer, req(&format!("peer-{round}-{block:05}-{i:03}"), Some(&c))).await;
                assert_eq!(s, StatusCode::CREATED);
                replays[3] += r as usize;
            }
            total += t.elapsed().as_nanos() as f64;
        }
        r[3].push(total / N as f64);
        let (t, n) = time(&peer, cookie, |_| "peer-replay-0000".to_owned()).await;
        r[4].push(t);
        replays[4] += n;
    }
    let base = median(r[0].clone());
    let names = ["no layer", "idempotency-layer first", "idempotency-layer replay", "axum-idempotent first*", "axum-idempotent replay"];
    println!("{N} requests x {ROUNDS} interleaved rounds, median ns/request, ratio to no layer");
    for (i, n) in names.iter().enumerate() {
        let m = median(r[i].clone());
        println!("{n:<26} {m:>8.0} ns  {:>5.2}x  (replayed responses: {})", m / base, replays[i]);
    }
    let ours_first = median(r[1].clone());
    let ours_replay = median(r[2].clone());
    println!("axum-idempotent / ours: first {:.2}x, replay {:.2}x", median(r[3].clone()) / ours_first, median(r[4].clone()) / ours_replay);
}

//! Hostile and malformed input: control bytes and CR/LF in keys, 64 KiB header values, one
//! tenant flooding the store with keys, a flood of duplicates of one key, bodies at and over
//! the limit, a corrupt store entry, and what reaches the logs.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use idempotency_layer::{IdempotencyLayer, MemoryStore, RejectReason, Scope};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

/// A handler that counts executions and echoes the request body's length.
fn counting(count: &Arc<AtomicUsize>) -> Router {
    let count = count.clone();
    Router::new().route(
        "/orders",
        post(move |body: Bytes| {
            let count = count.clone();
            async move {
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                (
                    StatusCode::CREATED,
                    format!("order {n}: {} bytes", body.len()),
                )
            }
        }),
    )
}

async fn call(app: &Router, req: Request<Body>) -> Collected {
    collect(app.clone().oneshot(req).await.unwrap()).await
}

fn post_with_key(key: HeaderValue, body: &'static str) -> Request<Body> {
    let mut req = Request::post("/orders").body(Body::from(body)).unwrap();
    req.headers_mut().insert("x-idempotency-key", key);
    req
}

/// Sends raw HTTP/1.1 bytes and returns the status line the server answers with.
async fn raw_status(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !got.windows(2).any(|w| w == b"\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("the server answers within 10 s")
            .unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cr_lf_and_control_bytes_in_keys_never_reach_the_handler() {
    let count = Arc::new(AtomicUsize::new(0));
    let app = counting(&count)
        .layer(IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t")));

    // The http crate refuses CR, LF, NUL and other controls in a header value outright.
    for bad in [
        &b"abcd\r\nefgh"[..],
        b"abcd\refgh",
        b"abcd\nefgh",
        b"abcd\0efgh",
        b"abcd\x7fefgh",
    ] {
        assert!(HeaderValue::from_bytes(bad).is_err(), "{bad:?}");
    }
    // What a header value can still carry: tab, space, obs-text bytes. Each is a 400 naming
    // the rule, and nothing runs.
    for (bad, rule) in [
        (&b"abcd\tefgh"[..], "invalid character"),
        (b"abcd efgh", "invalid character"),
        (b"\"abcd\tefgh\"", "invalid character"),
        (b"abcd\x80\xffefgh", "not ASCII"),
        (b"\t\t\t", "too short"),
    ] {
        let r = call(
            &app,
            post_with_key(HeaderValue::from_bytes(bad).unwrap(), "{}"),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad:?}");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(rule), "{bad:?}: {detail}");
    }

    // Over a socket: a bare CR, a NUL or a raw control byte in the key line is refused by the
    // HTTP parser before any middleware runs.
    let addr = serve(app.clone()).await;
    for key in [
        &b"abcd\refgh"[..],
        b"abcd\x00efgh",
        b"abcd\x01efgh",
        b"abcd\x1befgh",
    ] {
        let mut req = b"POST /orders HTTP/1.1\r\nhost: x\r\nx-idempotency-key: ".to_vec();
        req.extend_from_slice(key);
        req.extend_from_slice(b"\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}");
        let status = raw_status(addr, &req).await;
        assert!(
            status.is_empty() || status.contains(" 400 "),
            "{key:?}: {status:?}"
        );
    }
    // A key line split by CR LF is two header lines: the second is another header, not part
    // of the key, and the key before it is validated on its own.
    let status = raw_status(
        addr,
        b"POST /orders HTTP/1.1\r\nhost: x\r\nx-idempotency-key: abc\r\nx-idempotency-key: defghijk\r\n\
          content-length: 2\r\nconnection: close\r\n\r\n{}",
    )
    .await;
    assert!(
        status.contains(" 400 "),
        "a repeated key header: {status:?}"
    );
    assert_eq!(count.load(Ordering::SeqCst), 0, "no bad key ever executed");
}

#[tokio::test]
async fn header_values_of_64_kib_are_refused_or_ignored_cheaply() {
    let count = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t"));
    let app = counting(&count).layer(layer.clone());
    let huge = |c: u8| HeaderValue::from_bytes(&vec![c; 64 * 1024]).unwrap();

    // A 64 KiB key: 400 too long, and the answer does not echo it.
    let r = call(&app, post_with_key(huge(b'a'), "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.json()["detail"].as_str().unwrap().contains("too long"));
    assert!(
        r.body.len() < 1024,
        "the rejection is small: {}",
        r.body.len()
    );
    let quoted = HeaderValue::from_bytes(&[b"\"".as_slice(), &[b'a'; 65534], b"\""].concat());
    let r = call(&app, post_with_key(quoted.unwrap(), "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // A 64 KiB grpc-timeout or content-type beside a valid key: the timeout is ignored as
    // malformed, the content type is hashed into the fingerprint; the write runs once.
    for (name, value) in [("grpc-timeout", huge(b'9')), ("content-type", huge(b'x'))] {
        let key = HeaderValue::from_str(&format!("big-header-{name}")).unwrap();
        let mut req = post_with_key(key, "{}");
        req.headers_mut().insert(name, value);
        let r = call(&app, req).await;
        assert_eq!(r.status, StatusCode::CREATED, "{name}");
    }
    assert_eq!(count.load(Ordering::SeqCst), 2);

    // A 64 KiB tenant from a trusted header is hashed into the scope like any other.
    let app = counting(&count).layer(IdempotencyLayer::default().tenant(
        idempotency_layer::TenantSource::header(http::HeaderName::from_static("x-tenant")),
    ));
    let mut req = post_with_key(HeaderValue::from_static("tenant-huge-1"), "{}");
    req.headers_mut().insert("x-tenant", huge(b't'));
    assert_eq!(call(&app, req).await.status, StatusCode::CREATED);

    // The shared header parsers take 64 KiB values without trouble.
    let now = std::time::SystemTime::now();
    // 64 KiB of "1" is a delay in seconds far past any clock: it saturates, never panics.
    let far = reason_code::parse_retry_after(&huge(b'1'), now).expect("a number of seconds");
    assert!(
        far >= std::time::Duration::from_secs(u64::from(u32::MAX)),
        "{far:?}"
    );
    assert!(reason_code::parse_retry_after(&huge(b'x'), now).is_err());
    assert!(reason_code::parse_grpc_timeout(&huge(b'1')).is_err());
    assert!(reason_code::parse_grpc_pushback(&huge(b'1')).is_err());
    assert!(reason_code::parse_grpc_status(&huge(b'1')).is_err());
    assert_eq!(
        reason_code::decode_grpc_message(&huge(b'%')).len(),
        64 * 1024
    );
}

#[tokio::test]
async fn one_tenant_with_thousands_of_keys_cannot_grow_the_store_or_break_others() {
    let count = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::builder().max_entries(1_000).build().unwrap();
    let layer = IdempotencyLayer::new(store.clone());
    let app = counting(&count).layer(layer.clone());
    let as_tenant = |tenant: &str, key: String| {
        with_tenant(
            post_with_key(HeaderValue::try_from(key).unwrap(), "{}"),
            tenant,
        )
    };

    // The flood gets its share of the store (half, by default), then retryable 503s on which
    // nothing runs; no record is dropped before its TTL.
    let mut flood_created = 0;
    for i in 0..5_000 {
        let r = call(&app, as_tenant("flood", format!("flood-key-{i:06}"))).await;
        match r.status {
            StatusCode::CREATED => flood_created += 1,
            StatusCode::SERVICE_UNAVAILABLE => {}
            other => panic!("flood key {i}: {other}"),
        }
        // Another tenant, meanwhile: its writes run once and replay.
        if i % 500 == 0 {
            let key = format!("calm-key-{i:06}");
            let first = call(&app, as_tenant("calm", key.clone())).await;
            assert_eq!(first.status, StatusCode::CREATED);
            wait::until_yielding("the spawned completion records", || {
                layer.stats().in_flight == 0
            })
            .await;
            let again = call(&app, as_tenant("calm", key)).await;
            assert!(again.replayed(), "calm tenant's key {i} replays");
            assert_eq!(again.body, first.body);
        }
        assert!(store.len() <= 1_000, "capacity holds: {}", store.len());
    }
    assert!(
        flood_created <= 500,
        "the flood holds at most its share: {flood_created}"
    );
    assert_eq!(store.stats().refused as usize, 5_000 - flood_created);
    assert_eq!(count.load(Ordering::SeqCst), flood_created + 10);
    // After the flood, every record the calm tenant made before and during it still replays:
    // nothing of its was evicted or refused.
    for i in (0..5_000).step_by(500) {
        let again = call(&app, as_tenant("calm", format!("calm-key-{i:06}"))).await;
        assert!(
            again.replayed(),
            "calm tenant's key {i} still replays after the flood"
        );
    }
    let late = call(&app, as_tenant("calm", "calm-key-late-0001".into())).await;
    assert_eq!(
        late.status,
        StatusCode::CREATED,
        "the calm tenant still writes"
    );
    assert_eq!(count.load(Ordering::SeqCst), flood_created + 11);
    // The same key under the other tenant is another scope: it executes.
    let r = call(&app, as_tenant("calm", "flood-key-004999".into())).await;
    assert!(!r.replayed());
}

#[tokio::test]
async fn ten_thousand_waiters_on_one_key_are_bounded_by_max_waiters() {
    let count = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Notify::new());
    let (c, s, g) = (count.clone(), started.clone(), gate.clone());
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_waiters(100);
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (c, s, g) = (c.clone(), s.clone(), g.clone());
                async move {
                    s.notify_one();
                    g.notified().await;
                    c.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "the one order")
                }
            }),
        )
        .layer(layer.clone());
    let key = || post_with_key(HeaderValue::from_static("hot-key-0001"), "{}");
    let leader = tokio::spawn({
        let app = app.clone();
        async move { call(&app, key()).await }
    });
    started.notified().await;

    let mut duplicates = Vec::new();
    for _ in 0..10_000 {
        let app = app.clone();
        duplicates.push(tokio::spawn(async move { call(&app, key()).await }));
    }
    // Every duplicate has either joined the 100 waiters or been turned away.
    wait::until_yielding("every duplicate waits or is turned away", || {
        layer.stats().waited + layer.stats().rejected(RejectReason::InFlight) >= 10_000
    })
    .await;
    assert_eq!(layer.stats().waited, 100, "only max_waiters wait");
    gate.notify_one();

    let (mut replayed, mut turned_away) = (0, 0);
    for d in duplicates {
        let r = d.await.unwrap();
        match r.status {
            StatusCode::CREATED => {
                assert!(r.replayed());
                assert_eq!(r.body, "the one order");
                replayed += 1;
            }
            StatusCode::CONFLICT => {
                assert_eq!(r.headers["retry-after"], "1");
                assert_eq!(r.json()["code"], "ABORTED");
                assert!(r.json()["detail"].as_str().unwrap().contains("too many"));
                turned_away += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(leader.await.unwrap().status, StatusCode::CREATED);
    assert_eq!((replayed, turned_away), (100, 9_900));
    assert_eq!(count.load(Ordering::SeqCst), 1, "the handler ran once");
    // The places were given back: later duplicates wait again (and replay at once).
    let r = call(&app, key()).await;
    assert!(r.replayed());
}

#[tokio::test]
async fn request_bodies_at_the_limit_pass_and_over_it_are_413() {
    let count = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_request_bytes(1024);
    let app = counting(&count).layer(layer.clone());
    let req = |key: &'static str, body: Body, length: Option<usize>| {
        let mut b = Request::post("/orders").header("x-idempotency-key", key);
        if let Some(n) = length {
            b = b.header("content-length", n);
        }
        b.body(body).unwrap()
    };
    let at = call(
        &app,
        req("body-at-limit", Body::from(vec![b'x'; 1024]), Some(1024)),
    )
    .await;
    assert_eq!(at.status, StatusCode::CREATED);
    assert_eq!(at.body, "order 1: 1024 bytes");

    // Declared over the limit: refused before reading.
    let over = call(
        &app,
        req("body-over-decl", Body::from(vec![b'x'; 1025]), Some(1025)),
    )
    .await;
    assert_eq!(over.status, StatusCode::PAYLOAD_TOO_LARGE);
    // Undeclared (streamed in chunks) over the limit: refused while reading.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let send = tokio::spawn(async move {
        for _ in 0..5 {
            if tx.send(Bytes::from(vec![b'y'; 256])).await.is_err() {
                break;
            }
        }
    });
    let streamed = call(
        &app,
        req("body-over-strm", Body::new(ChannelBody(rx)), None),
    )
    .await;
    assert_eq!(streamed.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(streamed.json()["code"], "RESOURCE_EXHAUSTED");
    send.await.unwrap();
    // A lying content-length (smaller than the body) does not get past the limit either.
    let lying = call(
        &app,
        req("body-over-lie1", Body::from(vec![b'z'; 4096]), Some(10)),
    )
    .await;
    assert_eq!(lying.status, StatusCode::PAYLOAD_TOO_LARGE, "{lying:?}");
    assert_eq!(lying.headers["x-reason-code"], "REQUEST_TOO_LARGE");
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "nothing over the limit ran"
    );
    assert_eq!(layer.stats().rejected(RejectReason::TooLarge), 3);
}

#[tokio::test]
async fn a_corrupt_entry_is_a_clear_non_retryable_error_until_forgotten() {
    let count = Arc::new(AtomicUsize::new(0));
    // The entry of one scope does not decode (what a hand-edited Redis key or PostgreSQL row
    // looks like to the layer).
    let store = FaultStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .fail_open(true); // even fail-open must not execute over a corrupt entry
    let app = counting(&count).layer(layer.clone());
    let key = "corrupt-key-01";
    let method = Scope::http_operation(&http::Method::POST, "/orders");
    store.inject(
        Rule::new(Op::Begin, Fault::Corrupt).scope(Scope::new("t", &method, key).key_in(&store)),
    );

    let r = call(&app, post_with_key(HeaderValue::from_static(key), "{}")).await;
    assert_eq!(
        r.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "not a retryable 503"
    );
    let detail = r.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("corrupt") && detail.contains("new key"),
        "{detail}"
    );
    assert_eq!(count.load(Ordering::SeqCst), 0, "nothing executed");
    assert_eq!(layer.stats().store_errors, 1);

    // Forgetting the key removes the entry that did not decode (the fault stood for it).
    store.heal();
    assert!(!layer.forget(Scope::new("t", &method, key)).await.unwrap());
    let r = call(&app, post_with_key(HeaderValue::from_static(key), "{}")).await;
    assert_eq!(r.status, StatusCode::CREATED, "usable again once forgotten");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// Collects everything written to the log.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn logs_never_carry_keys_tenants_or_bodies() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // The process-wide subscriber, not a thread's: with a thread-local one, other tests of this
    // binary running on other threads race tracing's per-callsite interest cache, and some of
    // this test's events were missed (it passed or failed by chance). Only this test of the
    // binary sets a subscriber; the other tests' events land here too, and carry none of the
    // secrets below.
    tracing::subscriber::set_global_default(subscriber)
        .expect("no other test of this binary sets a subscriber");

    const KEY: &str = "SECRETKEY-7f3a9c";
    const TENANT: &str = "tenant-SECRET-acme";
    const BODY: &str = "{\"card\":\"BODY-SECRET-4111\"}";
    let count = Arc::new(AtomicUsize::new(0));
    let flaky = FlakyStore::default();
    let layer = IdempotencyLayer::new(flaky.clone()).max_request_bytes(64);
    let app = counting(&count).layer(layer.clone());
    let send = |key: &str, body: &'static str| {
        with_tenant(
            post_with_key(HeaderValue::from_str(key).unwrap(), body),
            TENANT,
        )
    };
    // Executed, replayed, mismatched, too large, bad key, store down (closed and open), forgotten.
    assert_eq!(
        call(&app, send(KEY, BODY)).await.status,
        StatusCode::CREATED
    );
    wait::until_yielding("the spawned completion records", || {
        layer.stats().in_flight == 0
    })
    .await;
    assert!(call(&app, send(KEY, BODY)).await.replayed());
    assert_eq!(
        call(&app, send(KEY, "{\"card\":\"BODY-SECRET-x\"}"))
            .await
            .status,
        422
    );
    let big = "BODY-SECRET-big-BODY-SECRET-big-BODY-SECRET-big-BODY-SECRET-big-BODY-SECRET";
    assert_eq!(call(&app, send(KEY, big)).await.status, 413);
    assert_eq!(
        call(&app, send("SECRETKEY with space", BODY)).await.status,
        400
    );
    down(&flaky);
    assert_eq!(call(&app, send("SECRETKEY-down01", BODY)).await.status, 503);
    let open = counting(&count).layer(layer.clone().fail_open(true));
    assert_eq!(
        call(&open, send("SECRETKEY-open01", BODY)).await.status,
        201
    );
    up(&flaky);
    let method = Scope::http_operation(&http::Method::POST, "/orders");
    assert!(layer
        .forget(Scope::new(TENANT, &method, KEY))
        .await
        .unwrap());

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("idempotency: executing"),
        "events were captured:\n{text}"
    );
    assert!(text.contains("idempotency: replayed"), "{text}");
    assert!(text.contains("ScopeKey("), "scopes appear hashed:\n{text}");
    for secret in ["SECRETKEY", "SECRET-acme", "BODY-SECRET"] {
        assert!(
            !text.contains(secret),
            "{secret} leaked into the logs:\n{text}"
        );
    }
}

/// Found by the chaos soak: a record lost to a brief store outage left the key in flight, so
/// the client's retry waited out the lease (or, after it, executed again).
#[tokio::test(start_paused = true)]
async fn a_brief_store_outage_at_completion_neither_loses_the_record_nor_strands_the_claim() {
    let count = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_wait(Duration::from_secs(1));
    let app = counting(&count).layer(layer.clone());
    let key = || post_with_key(HeaderValue::from_static("outage-at-end-1"), "{}");

    // About 750 ms of outage at 50, 100, 200, 400 ms: the record's first four tries fail.
    store.inject(Rule::new(Op::Complete, Fault::Fail).times(4));
    let first = call(&app, key()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = call(&app, key()).await;
    assert!(
        retry.replayed(),
        "the record was stored after the outage: {retry:?}"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(layer.stats().recorded, 1);
    assert_eq!(
        store.answers(Op::Complete),
        [
            Reply::Backend,
            Reply::Backend,
            Reply::Backend,
            Reply::Backend,
            Reply::Ok
        ],
        "the record was stored through the outage"
    );

    // A release (the handler failed) lost to the outage: the retry executes at once instead
    // of waiting for the lease to lapse.
    let failing = Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::SERVICE_UNAVAILABLE, "busy") }),
        )
        .layer(layer.clone());
    store.inject(Rule::new(Op::Release, Fault::Fail).times(3));
    let key2 = || post_with_key(HeaderValue::from_static("outage-at-end-2"), "{}");
    assert_eq!(
        call(&failing, key2()).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let r = call(&app, key2()).await;
    assert_eq!(r.status, StatusCode::CREATED, "not stuck in flight: {r:?}");
    assert!(!r.replayed());
}

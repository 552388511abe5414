//! The layer's promises over real sockets: axum::serve with a hyper-util client over HTTP/1.1
//! (keep-alive) and HTTP/2 (h2c), response bodies empty, with a Content-Length, chunked, with
//! trailers, and not ready when the layer first polls them, in every `OnDisconnect` and
//! `InFlight` mode.
//!
//! Real servers stop polling a response body once its Content-Length is written or its
//! trailers are sent, and never poll an empty one; these tests are the ones that catch a layer
//! that records only when a body returns `None`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::{
    collect, down, serve, up, wait, Collected, FaultStore, FlakyStore, Op, Reply,
};
use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{Full, StreamBody};
use idempotency_layer::{IdempotencyLayer, InFlight, MemoryStore, OnDisconnect};

use test_support::net::Transport;

/// The shape of the handler's response body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Empty,
    ContentLength,
    Chunked,
    Trailers,
    /// Chunked, its first frame a few milliseconds late: the layer's first poll of the body
    /// (before the head goes out) finds it not ready, and the server's polls must get it all.
    Late,
}

const SHAPES: [Shape; 5] = [
    Shape::Empty,
    Shape::ContentLength,
    Shape::Chunked,
    Shape::Trailers,
    Shape::Late,
];

use test_support::net::HttpClient;

fn client(transport: Transport) -> HttpClient {
    transport.client()
}

/// What the handlers did: executions started and finished, and handlers cancelled mid-run.
#[derive(Clone, Default)]
struct Counts {
    started: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
}

impl Counts {
    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }
}

/// Counts a cancellation if dropped before [`Finish::done`].
struct Finish(Counts, bool);

impl Finish {
    fn done(mut self) -> usize {
        self.1 = true;
        self.0.finished.fetch_add(1, Ordering::SeqCst) + 1
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        if !self.1 {
            self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A response of `shape` for execution `n`: `201`, `x-order: n`, a body naming `n`.
fn respond(shape: Shape, n: usize) -> Response<Body> {
    let text = format!("order {n} created");
    let body = match shape {
        Shape::Empty => Body::empty(),
        Shape::ContentLength => Body::from(text),
        Shape::Chunked => {
            let chunks = ["order ", &n.to_string(), " created"]
                .map(|c| Ok::<_, Infallible>(Bytes::from(c.to_owned())));
            Body::from_stream(futures_util::stream::iter(chunks))
        }
        Shape::Late => {
            use futures_util::StreamExt;
            let (head, tail) = (Bytes::from("order "), Bytes::from(format!("{n} created")));
            let late = futures_util::stream::once(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, Infallible>(head)
            });
            Body::from_stream(late.chain(futures_util::stream::once(async move { Ok(tail) })))
        }
        Shape::Trailers => {
            let mut trailers = HeaderMap::new();
            trailers.insert("x-order-total", HeaderValue::from(n));
            let frames = [
                Frame::data(Bytes::from("order ")),
                Frame::data(Bytes::from(format!("{n} created"))),
                Frame::trailers(trailers),
            ]
            .map(Ok::<_, Infallible>);
            Body::new(StreamBody::new(futures_util::stream::iter(frames)))
        }
    };
    let mut res = Response::builder()
        .status(StatusCode::CREATED)
        .header("x-order", n);
    if shape == Shape::Trailers {
        // An HTTP/1.1 server sends only the trailer fields the head announces.
        res = res.header("trailer", "x-order-total");
    }
    res.body(body).unwrap()
}

/// `/orders`, answered by `handle` with the test's counts.
fn orders<F, Fut>(counts: &Counts, handle: F) -> Router
where
    F: Fn(Counts) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    let counts = counts.clone();
    Router::new().route("/orders", post(move || handle(counts.clone())))
}

/// `/orders` answers with `shape` after `work` (a real delay: the clients are real too).
fn app(layer: IdempotencyLayer, shape: Shape, work: Duration, counts: &Counts) -> Router {
    orders(counts, move |counts| async move {
        counts.started.fetch_add(1, Ordering::SeqCst);
        let finish = Finish(counts, false);
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        respond(shape, finish.done())
    })
    .layer(layer)
}

/// `POST /orders` with `key` and `body` on `client`, answered within 20 s, read whole.
async fn post_order<B>(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        B,
    >,
    addr: SocketAddr,
    key: &str,
    body: B,
) -> Collected
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let req = Request::post(format!("http://{addr}/orders"))
        .header("x-idempotency-key", key)
        .header("content-type", "application/json")
        // HTTP/1.1 servers send trailers only to clients that accept them.
        .header("te", "trailers")
        .body(body)
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("an answer within 20 s")
        .expect("a response");
    collect(res).await
}

async fn send(client: &HttpClient, addr: SocketAddr, key: &str) -> Collected {
    let body = Full::new(Bytes::from_static(b"{\"sku\":\"b1\"}"));
    post_order(client, addr, key, body).await
}

fn layer(on_disconnect: OnDisconnect, in_flight: InFlight) -> IdempotencyLayer {
    IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .on_disconnect(on_disconnect)
        .in_flight(in_flight)
}

/// A client that received a whole response and sends the same write again gets the replay:
/// never a 409, never a second execution, in every transport, body shape and mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_retry_after_a_delivered_response_is_a_replay() {
    for transport in Transport::BOTH {
        for shape in SHAPES {
            for on_disconnect in [OnDisconnect::Complete, OnDisconnect::Release] {
                for in_flight in [InFlight::Wait, InFlight::Reject] {
                    let case = format!("{transport:?} {shape:?} {on_disconnect:?} {in_flight:?}");
                    let counts = Counts::default();
                    let layer = layer(on_disconnect, in_flight);
                    let addr = serve(app(layer.clone(), shape, Duration::ZERO, &counts)).await;
                    let client = client(transport);
                    for k in 0..5 {
                        let key = format!("order-{k:04}-sequential");
                        let first = send(&client, addr, &key).await;
                        let retry = send(&client, addr, &key).await;
                        assert_eq!(first.status, StatusCode::CREATED, "{case}");
                        assert!(!first.replayed(), "{case}");
                        // The handler's whole body, as it made it (whole at once, streamed, or
                        // none), both times.
                        let n = first.headers["x-order"].to_str().unwrap();
                        let made = match shape {
                            Shape::Empty => String::new(),
                            _ => format!("order {n} created"),
                        };
                        assert_eq!(first.body, made, "{case}");
                        assert_eq!(retry.status, StatusCode::CREATED, "{case}: {retry:?}");
                        assert!(retry.replayed(), "{case}: the retry must be a replay");
                        assert_eq!(retry.headers["x-order"], first.headers["x-order"], "{case}");
                        assert_eq!(retry.body, first.body, "{case}");
                        assert_eq!(retry.trailers, first.trailers, "{case}");
                        if shape == Shape::Trailers {
                            let t = first.trailers.as_ref().expect("trailers reach the client");
                            assert_eq!(t["x-order-total"], first.headers["x-order"], "{case}");
                        }
                    }
                    assert_eq!(counts.started(), 5, "{case}: one execution per key");
                    let m = layer.stats();
                    assert_eq!((m.executed, m.replayed, m.recorded), (5, 5, 5), "{case}");
                }
            }
        }
    }
}

/// A store that is down, with `fail_open`: every write executes without protection and its
/// whole response (every body shape, trailers included) reaches the client unchanged, not
/// marked as a replay; once the store is back, the same key is recorded and then replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_answers_the_handlers_whole_response_while_the_store_is_down() {
    for transport in Transport::BOTH {
        for shape in SHAPES {
            let case = format!("{transport:?} {shape:?}");
            let counts = Counts::default();
            let store = FlakyStore::default();
            down(&store);
            let layer = IdempotencyLayer::new(store.clone())
                .tenant(idempotency_layer::TenantSource::fixed("t"))
                .fail_open(true);
            let router = orders(&counts, move |counts| async move {
                counts.started.fetch_add(1, Ordering::SeqCst);
                respond(shape, Finish(counts, false).done())
            });
            let addr = serve(router.layer(layer.clone())).await;
            let client = client(transport);
            for n in 1..=2 {
                let r = send(&client, addr, "order-fail-open-1").await;
                assert_eq!(r.status, StatusCode::CREATED, "{case}");
                assert!(!r.replayed(), "{case}: executed, not replayed");
                assert_eq!(r.headers["x-order"], n.to_string().as_str(), "{case}");
                if shape != Shape::Empty {
                    assert_eq!(r.body, format!("order {n} created"), "{case}");
                }
                if shape == Shape::Trailers {
                    let t = r.trailers.as_ref().expect("trailers reach the client");
                    assert_eq!(t["x-order-total"], n.to_string().as_str(), "{case}");
                }
            }
            assert_eq!(counts.started(), 2, "{case}: unprotected while down");
            assert_eq!(layer.stats().failed_open, 2, "{case}");
            up(&store);
            let first = send(&client, addr, "order-fail-open-1").await;
            let retry = send(&client, addr, "order-fail-open-1").await;
            assert!(!first.replayed(), "{case}");
            assert!(
                retry.replayed(),
                "{case}: protected again once the store is back"
            );
            assert_eq!(retry.body, first.body, "{case}");
            assert_eq!(counts.started(), 3, "{case}");
        }
    }
}

/// Twenty concurrent duplicates run the handler once: with `Wait` all twenty get its response;
/// with `Reject` the others get 409 with the reason code that tells a client to retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_once() {
    for transport in Transport::BOTH {
        for shape in SHAPES {
            for in_flight in [InFlight::Wait, InFlight::Reject] {
                let case = format!("{transport:?} {shape:?} {in_flight:?}");
                let counts = Counts::default();
                let layer = layer(OnDisconnect::Complete, in_flight);
                let addr = serve(app(layer, shape, Duration::from_millis(100), &counts)).await;
                let client = client(transport);
                let answers = futures_util::future::join_all(
                    (0..20).map(|_| send(&client, addr, "order-concurrent-1")),
                )
                .await;
                assert_eq!(counts.started(), 1, "{case}");
                for a in &answers {
                    match a.status {
                        StatusCode::CREATED => assert_eq!(a.headers["x-order"], "1", "{case}"),
                        StatusCode::CONFLICT if in_flight == InFlight::Reject => {
                            assert_eq!(a.headers["x-reason-code"], "IDEMPOTENCY_IN_FLIGHT");
                            assert_eq!(a.headers["retry-after"], "1");
                        }
                        other => panic!("{case}: unexpected {other}: {a:?}"),
                    }
                }
                if in_flight == InFlight::Wait {
                    assert!(
                        answers.iter().all(|a| a.status == StatusCode::CREATED),
                        "{case}"
                    );
                }
            }
        }
    }
}

/// A client whose request bodies are streamed frame by frame (chunked over HTTP/1.1, several
/// DATA frames over HTTP/2).
type StreamingClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::combinators::BoxBody<Bytes, Infallible>,
>;

fn streaming_client(transport: Transport) -> StreamingClient {
    transport.client()
}

/// `key` with `chunks` as the request body, one frame each and no Content-Length.
async fn send_chunks(
    client: &StreamingClient,
    addr: SocketAddr,
    key: &str,
    chunks: &[&'static str],
) -> Collected {
    use http_body_util::BodyExt;
    let frames = chunks
        .iter()
        .map(|c| Ok::<_, Infallible>(Frame::data(Bytes::from_static(c.as_bytes()))))
        .collect::<Vec<_>>();
    let body = StreamBody::new(futures_util::stream::iter(frames)).boxed();
    post_order(client, addr, key, body).await
}

/// The layer reads the whole request body before it fingerprints it, however it was framed: the
/// same bytes sent in three frames and then as one frame are the same request (a replay), other
/// bytes under the same key are refused as a mismatch, and a streamed body over the limit with no
/// declared length is refused while it is read, with nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_in_frames_is_fingerprinted_whole() {
    for transport in Transport::BOTH {
        let case = format!("{transport:?}");
        let counts = Counts::default();
        let layer = layer(OnDisconnect::Complete, InFlight::Wait).max_request_bytes(32);
        let addr = serve(app(
            layer.clone(),
            Shape::ContentLength,
            Duration::ZERO,
            &counts,
        ))
        .await;
        let streaming = streaming_client(transport);
        const WHOLE: &str = "{\"sku\":\"b1\",\"n\":2}";
        let chunks = ["{\"sku\":", "\"b1\",", "\"n\":2}"];
        assert_eq!(chunks.concat(), WHOLE);

        let first = send_chunks(&streaming, addr, "order-frames-1", &chunks).await;
        assert_eq!(first.status, StatusCode::CREATED, "{case}: {first:?}");
        assert!(!first.replayed(), "{case}");
        let whole = send_chunks(&streaming, addr, "order-frames-1", &[WHOLE]).await;
        assert_eq!(whole.status, StatusCode::CREATED, "{case}: {whole:?}");
        assert!(
            whole.replayed(),
            "{case}: the same bytes in one frame are the same request"
        );
        assert_eq!(whole.body, first.body, "{case}");

        let other = send_chunks(
            &streaming,
            addr,
            "order-frames-1",
            &["{\"sku\":", "\"b2\"}"],
        )
        .await;
        assert_eq!(
            other.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{case}: {other:?}"
        );

        let big = ["0123456789", "0123456789", "0123456789", "0123456789"];
        let over = send_chunks(&streaming, addr, "order-frames-2", &big).await;
        assert_eq!(
            over.status,
            StatusCode::PAYLOAD_TOO_LARGE,
            "{case}: {over:?}"
        );
        assert_eq!(over.headers["x-reason-code"], "REQUEST_TOO_LARGE", "{case}");
        assert_eq!(counts.started(), 1, "{case}: only the first request ran");
    }
}

/// A handler that panics: over the wire the client gets a whole `500` problem document with
/// the code `INTERNAL` (on a connection that stays usable), nothing is recorded, and the key
/// runs again. Duplicates waiting on the panicking execution get its failure too (one execution
/// for all of them, not one each), and the next call runs it, in both `OnDisconnect` modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_500_over_the_wire_and_its_key_runs_again() {
    for transport in Transport::BOTH {
        for on_disconnect in [OnDisconnect::Complete, OnDisconnect::Release] {
            let case = format!("{transport:?} {on_disconnect:?}");
            let counts = Counts::default();
            let layer = layer(on_disconnect, InFlight::Wait);
            let waiting = layer.clone();
            // The waits counted before the ten duplicates are sent (set by the test below):
            // read in the handler instead, it would miss duplicates that began waiting before
            // the handler first ran.
            let waited_before = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let base = waited_before.clone();
            let router = orders(&counts, move |counts| {
                let (waiting, base) = (waiting.clone(), base.clone());
                async move {
                    let n = counts.started.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 3 {
                        // The duplicates below are all waiting on this execution when it fails.
                        let before = base.load(Ordering::SeqCst);
                        for _ in 0..10_000 {
                            if waiting.stats().waited >= before + 9 {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    if n == 1 || n == 3 {
                        panic!("handler bug (expected by the test)");
                    }
                    respond(Shape::ContentLength, n)
                }
            });
            let addr = serve(router.layer(layer.clone())).await;
            let client = client(transport);

            let failed = send(&client, addr, "order-panic-1").await;
            assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR, "{case}");
            assert!(
                String::from_utf8_lossy(&failed.body).contains(r#""code":"INTERNAL""#),
                "{case}: a problem document with the code: {failed:?}"
            );
            let again = send(&client, addr, "order-panic-1").await;
            assert_eq!(again.status, StatusCode::CREATED, "{case}: {again:?}");
            assert!(!again.replayed(), "{case}: executed again, not replayed");
            assert_eq!(again.body, "order 2 created", "{case}");
            let replay = send(&client, addr, "order-panic-1").await;
            assert!(replay.replayed(), "{case}");
            assert_eq!(replay.body, again.body, "{case}");

            // Ten duplicates at once; the one that leads panics (execution 3) once the nine
            // others wait for it: all ten get its 500.
            waited_before.store(layer.stats().waited, Ordering::SeqCst);
            let answers = futures_util::future::join_all(
                (0..10).map(|_| send(&client, addr, "order-panic-2")),
            )
            .await;
            for a in &answers {
                assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{case}: {a:?}");
                assert!(
                    String::from_utf8_lossy(&a.body).contains(r#""code":"INTERNAL""#),
                    "{case}: {a:?}"
                );
            }
            assert_eq!(
                counts.started(),
                3,
                "{case}: one execution for ten duplicates"
            );
            let next = send(&client, addr, "order-panic-2").await;
            assert_eq!(
                next.status,
                StatusCode::CREATED,
                "{case}: the next call runs it"
            );
            assert_eq!(next.body, "order 4 created", "{case}");
            let m = layer.stats();
            assert_eq!((m.executed, m.recorded), (4, 2), "{case}");
            assert_eq!(m.shared_failures, 9, "{case}");
        }
    }
}

/// A client that goes away mid-handler: `Complete` finishes the handler and the retry gets the
/// replay; `Release` cancels it (its drop guard fires) and the retry executes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_handler() {
    for transport in Transport::BOTH {
        for on_disconnect in [OnDisconnect::Complete, OnDisconnect::Release] {
            let case = format!("{transport:?} {on_disconnect:?}");
            let counts = Counts::default();
            let started = Arc::new(tokio::sync::Notify::new());
            let gate = Arc::new(tokio::sync::Semaphore::new(0));
            let router = {
                let (counts, started, gate) = (counts.clone(), started.clone(), gate.clone());
                Router::new().route(
                    "/orders",
                    post(move || {
                        let (counts, started, gate) =
                            (counts.clone(), started.clone(), gate.clone());
                        async move {
                            counts.started.fetch_add(1, Ordering::SeqCst);
                            let finish = Finish(counts, false);
                            started.notify_one();
                            gate.acquire().await.unwrap().forget();
                            respond(Shape::ContentLength, finish.done())
                        }
                    }),
                )
            };
            let layer = layer(on_disconnect, InFlight::Wait);
            let addr = serve(router.layer(layer.clone())).await;
            // A client of its own, dropped with the request: its connection closes.
            let first =
                tokio::spawn(
                    async move { send(&client(transport), addr, "order-disconnect-1").await },
                );
            tokio::time::timeout(Duration::from_secs(10), started.notified())
                .await
                .expect("the handler starts");
            first.abort();
            assert!(first.await.unwrap_err().is_cancelled(), "{case}");
            // Wait (bounded) until the server saw the disconnect: a cancelled handler, or (in
            // Complete mode) nothing to see; then let handlers finish.
            if on_disconnect == OnDisconnect::Release {
                wait::until("the server cancels the handler", || {
                    counts.cancelled.load(Ordering::SeqCst) == 1
                })
                .await;
            }
            gate.add_permits(10);
            let retry = send(&client(transport), addr, "order-disconnect-1").await;
            assert_eq!(retry.status, StatusCode::CREATED, "{case}");
            match on_disconnect {
                OnDisconnect::Complete => {
                    assert!(retry.replayed(), "{case}: the retry gets the first outcome");
                    assert_eq!(retry.headers["x-order"], "1", "{case}");
                    assert_eq!(counts.started(), 1, "{case}");
                    assert_eq!(counts.cancelled.load(Ordering::SeqCst), 0, "{case}");
                }
                OnDisconnect::Release => {
                    assert!(!retry.replayed(), "{case}: the retry executes again");
                    assert_eq!(counts.started(), 2, "{case}");
                    assert_eq!(counts.finished.load(Ordering::SeqCst), 1, "{case}");
                }
                other => unreachable!("the loop covers Complete and Release, not {other:?}"),
            }
        }
    }
}

/// Post-redirect-get: a 303 See Other after a POST is a completed create, recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_303_after_a_post_is_recorded_and_replayed() {
    for transport in Transport::BOTH {
        let counts = Counts::default();
        let c = counts.clone();
        let router = Router::new().route(
            "/orders",
            post(move || {
                let n = c.started.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    Response::builder()
                        .status(StatusCode::SEE_OTHER)
                        .header("location", format!("/orders/{n}"))
                        .body(Body::empty())
                        .unwrap()
                }
            }),
        );
        let addr = serve(router.layer(layer(OnDisconnect::Complete, InFlight::Wait))).await;
        let client = client(transport);
        let first = send(&client, addr, "order-redirect-1").await;
        let retry = send(&client, addr, "order-redirect-1").await;
        assert_eq!(first.status, StatusCode::SEE_OTHER);
        assert_eq!(retry.status, StatusCode::SEE_OTHER, "{transport:?}");
        assert!(retry.replayed(), "{transport:?}");
        assert_eq!(retry.headers["location"], "/orders/1");
        assert_eq!(counts.started(), 1, "{transport:?}: the create ran once");
    }
}

/// A duplicate waiting for the request in flight holds none of the inner service's capacity:
/// with a concurrency limit of 2 directly inside the layer (as in
/// `ServiceBuilder::new().layer(IdempotencyLayer).concurrency_limit(2)`, or a tonic server's
/// layers), a leader and a waiter leave room for a write with another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_holds_no_inner_capacity() {
    for transport in Transport::BOTH {
        let started = Arc::new(tokio::sync::Notify::new());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let router = {
            let (started, gate) = (started.clone(), gate.clone());
            Router::new().route(
                "/orders",
                post(move |headers: HeaderMap| {
                    let (started, gate) = (started.clone(), gate.clone());
                    async move {
                        if headers["x-idempotency-key"] == "order-capacity-slow" {
                            started.notify_one();
                            gate.acquire().await.unwrap().forget();
                        }
                        "done"
                    }
                }),
            )
        };
        let idempotency = layer(OnDisconnect::Complete, InFlight::Wait);
        let svc = tower::ServiceBuilder::new()
            .map_response(|r: Response<idempotency_layer::IdempotencyBody<Body>>| r.map(Body::new))
            .layer(idempotency.clone())
            .concurrency_limit(2)
            .service(router);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let make = axum::ServiceExt::<Request<Body>>::into_make_service(svc);
        tokio::spawn(async move { axum::serve(listener, make).await });
        let client = client(transport);
        let leader = tokio::spawn({
            let client = client.clone();
            async move { send(&client, addr, "order-capacity-slow").await }
        });
        tokio::time::timeout(Duration::from_secs(10), started.notified())
            .await
            .expect("the leader starts");
        let waiter = tokio::spawn({
            let client = client.clone();
            async move { send(&client, addr, "order-capacity-slow").await }
        });
        // The duplicate waits (the layer counts it as it gives up its permit); it cannot finish
        // before the gate opens.
        wait::until("the duplicate waits for the leader", || {
            idempotency.stats().waited == 1
        })
        .await;
        let other = tokio::time::timeout(
            Duration::from_secs(5),
            send(&client, addr, "order-capacity-other"),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("{transport:?}: a write with another key is blocked by the waiter's permit")
        });
        assert_eq!(other.status, StatusCode::OK);
        assert!(!waiter.is_finished());
        gate.add_permits(1);
        let (leader, waiter) = (leader.await.unwrap(), waiter.await.unwrap());
        assert_eq!((leader.status, leader.replayed()), (StatusCode::OK, false));
        assert_eq!((waiter.status, waiter.replayed()), (StatusCode::OK, true));
    }
}

/// Two layers configured from one base with different leases: the short lease is renewed in
/// time while its handler runs, so a duplicate waits instead of taking the claim over. The
/// 600 s layer claims first, so the renewal task starts at its pace (a tick every 200 s); the
/// 3 s claim must bring it to a tick a second, seen in the store's renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_with_different_leases_each_renew_in_time() {
    let store = FaultStore::new(MemoryStore::new());
    let base =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("t"));
    let long = base.clone().lease(Duration::from_secs(600));
    let short = base.clone().lease(Duration::from_secs(3));
    let counts = Counts::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = |counts: &Counts| {
        let (counts, gate) = (counts.clone(), gate.clone());
        post(move || {
            let (counts, gate) = (counts.clone(), gate.clone());
            async move {
                let n = counts.started.fetch_add(1, Ordering::SeqCst) + 1;
                gate.acquire().await.unwrap().forget();
                format!("done {n}")
            }
        })
    };
    let router = Router::new()
        .route("/long", held(&counts).layer(long))
        .route("/orders", held(&counts).layer(short.clone()));
    let addr = serve(router).await;
    let client = client(Transport::Http1);
    let warm = tokio::spawn({
        let client = client.clone();
        async move {
            let req = Request::post(format!("http://{addr}/long"))
                .header("x-idempotency-key", "order-long-lease")
                .body(Full::new(Bytes::new()))
                .unwrap();
            collect(client.request(req).await.unwrap()).await
        }
    });
    wait::until("the 600 s claim is held", || counts.started() == 1).await;
    let first = tokio::spawn({
        let client = client.clone();
        async move { send(&client, addr, "order-short-lease").await }
    });
    wait::until("the 3 s claim is held", || counts.started() == 2).await;
    // Four ticks: the claim is renewed for longer than its first lease.
    let renewals =
        |s: &FaultStore<MemoryStore>| s.calls(Op::RenewMany).made + s.calls(Op::Renew).made;
    let before = renewals(&store);
    store
        .until(
            wait::LIMIT,
            "the renewal task ticks at the 3 s lease's pace",
            |s| renewals(s) >= before + 4,
        )
        .await;
    let refused: Vec<Reply> = [Op::RenewMany, Op::Renew]
        .into_iter()
        .flat_map(|op| store.answers(op))
        .filter(|a| *a != Reply::Ok)
        .collect();
    assert_eq!(refused, [], "every renewal kept its claim");
    // A duplicate now finds the claim still held, and waits for it.
    let duplicate = tokio::spawn({
        let client = client.clone();
        async move { send(&client, addr, "order-short-lease").await }
    });
    wait::until("the duplicate waits", || short.stats().waited == 1).await;
    gate.add_permits(2);
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(
        duplicate.body, first.body,
        "the duplicate got the first outcome"
    );
    assert!(duplicate.replayed());
    assert_eq!(
        counts.started(),
        2,
        "one execution per key, none taken over"
    );
    assert_eq!(warm.await.unwrap().status, StatusCode::OK);
}

/// A gRPC-Web frame: flag, big-endian length, payload.
fn grpc_web_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![flag];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// gRPC-Web carries its status in a trailers frame at the end of the body (base64-encoded in the
/// `-text` variant): an error there is not recorded, a success is, and the layer's own answers
/// are in the request's gRPC-Web content type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_web_statuses_in_the_body_decide_what_is_recorded() {
    use base64::Engine as _;

    for text in [false, true] {
        let content_type = if text {
            "application/grpc-web-text+proto"
        } else {
            "application/grpc-web+proto"
        };
        let counts = Counts::default();
        let c = counts.clone();
        let router = Router::new().route(
            "/shop.Orders/CreateOrder",
            post(move |headers: HeaderMap| {
                let n = c.started.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    let key = headers["x-idempotency-key"].to_str().unwrap().to_owned();
                    // Keys ending in "-error" fail with NOT_FOUND the first time.
                    let status = if key.ends_with("-error") && n == 1 {
                        5
                    } else {
                        0
                    };
                    let mut body = grpc_web_frame(0, format!("order {n}").as_bytes());
                    body.extend(grpc_web_frame(
                        0x80,
                        format!("grpc-status:{status}\r\ngrpc-message:\r\n").as_bytes(),
                    ));
                    let body = if text {
                        base64::engine::general_purpose::STANDARD
                            .encode(body)
                            .into_bytes()
                    } else {
                        body
                    };
                    Response::builder()
                        .header("content-type", content_type)
                        .body(Body::from(body))
                        .unwrap()
                }
            }),
        );
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"));
        let addr = serve(router.layer(layer.clone())).await;
        let client = client(Transport::Http1);
        let send = |key: Option<&'static str>| {
            let mut req = Request::post(format!("http://{addr}/shop.Orders/CreateOrder"))
                .header("content-type", content_type);
            if let Some(key) = key {
                req = req.header("x-idempotency-key", key);
            }
            let req = req
                .body(Full::new(Bytes::from_static(b"AAAAAAA=")))
                .unwrap();
            let client = client.clone();
            async move { collect(client.request(req).await.unwrap()).await }
        };
        // NOT_FOUND in the body's trailers frame: not recorded, the retry executes.
        let failed = send(Some("order-web-0001-error")).await;
        let retry = send(Some("order-web-0001-error")).await;
        assert!(
            !retry.replayed(),
            "text={text}: an error in the body is not a success"
        );
        assert_ne!(retry.body, failed.body, "text={text}");
        assert_eq!(counts.started(), 2, "text={text}");
        // OK: recorded and replayed byte for byte.
        let ok = send(Some("order-web-0002-ok")).await;
        let replay = send(Some("order-web-0002-ok")).await;
        assert!(replay.replayed(), "text={text}");
        assert_eq!(replay.body, ok.body, "text={text}");
        assert_eq!(counts.started(), 3, "text={text}");
        // The layer's own answer speaks gRPC-Web.
        let missing = send(None).await;
        assert_eq!(missing.status, StatusCode::OK, "text={text}");
        assert_eq!(missing.headers["content-type"], content_type);
        assert_eq!(missing.headers["grpc-status"], "3", "INVALID_ARGUMENT");
        assert_eq!(
            layer.stats().recorded,
            2,
            "text={text}: the OK retry and the OK write"
        );
    }
}

/// Duplicates waiting on many keys at once hold at most `max_waiting_bytes` in all: three keys
/// in flight, four duplicates of each with a 64 KiB body, and room for five of them; five wait
/// and get the one response of their key, the seven others are turned away at once with 409
/// and the reason code that tells a client to retry. (Before, the bound was per key only:
/// `max_waiters` x body size, times every key in flight.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_every_key_together_hold_at_most_max_waiting_bytes() {
    const BODY: usize = 64 * 1024;
    for transport in Transport::BOTH {
        let counts = Counts::default();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let layer =
            layer(OnDisconnect::Complete, InFlight::Wait).max_waiting_bytes(5 * (BODY + 2048));
        let app = orders(&counts, {
            let gate = gate.clone();
            move |counts| {
                let gate = gate.clone();
                async move {
                    counts.started.fetch_add(1, Ordering::SeqCst);
                    let finish = Finish(counts, false);
                    let _open = gate.acquire().await.unwrap();
                    respond(Shape::ContentLength, finish.done())
                }
            }
        })
        .layer(layer.clone());
        let addr = serve(app).await;
        let client = client(transport);
        let body = Bytes::from(vec![b'x'; BODY]);
        let send = |key: &'static str| {
            let (client, body) = (client.clone(), body.clone());
            tokio::spawn(async move { post_order(&client, addr, key, Full::new(body)).await })
        };
        let keys = ["order-wide-1", "order-wide-2", "order-wide-3"];
        let leaders: Vec<_> = keys.iter().map(|k| send(k)).collect();
        wait::until("the three leaders run", || counts.started() == 3).await;
        let duplicates: Vec<_> = keys
            .iter()
            .flat_map(|k| (0..4).map(move |_| *k))
            .map(send)
            .collect();
        wait::until("every duplicate waits or is turned away", || {
            let s = layer.stats();
            s.waited + s.rejected(idempotency_layer::RejectReason::InFlight) >= 12
        })
        .await;
        assert_eq!(
            layer.stats().waited,
            5,
            "{transport:?}: five fit in the bytes allowed"
        );
        // The gauge says what the five hold: each its body and its share of the overhead,
        // together within the bound.
        let held = layer.stats().waiting_bytes;
        assert!(
            held > 5 * BODY as u64 && held <= 5 * (BODY as u64 + 2048),
            "{transport:?}: the waiters hold {held} bytes"
        );
        gate.add_permits(100);

        for l in leaders {
            assert_eq!(l.await.unwrap().status, StatusCode::CREATED);
        }
        let (mut replayed, mut turned_away) = (0, 0);
        for d in duplicates {
            let a = d.await.unwrap();
            match a.status {
                StatusCode::CREATED => {
                    assert!(a.replayed(), "{transport:?}");
                    replayed += 1;
                }
                StatusCode::CONFLICT => {
                    assert_eq!(a.headers["x-reason-code"], "IDEMPOTENCY_IN_FLIGHT");
                    assert_eq!(a.headers["retry-after"], "1");
                    let detail = a.json()["detail"].as_str().unwrap().to_owned();
                    assert!(detail.contains("max_waiting_bytes"), "{detail}");
                    turned_away += 1;
                }
                other => panic!("{transport:?}: unexpected {other}: {a:?}"),
            }
        }
        assert_eq!((replayed, turned_away), (5, 7), "{transport:?}");
        assert_eq!(counts.started(), 3, "{transport:?}: each key ran once");
        assert_eq!(
            layer.stats().waiting_bytes,
            0,
            "{transport:?}: the waiters let their bytes go"
        );
    }
}

/// A write whose `content-length` is over `max_request_bytes` is refused with 413 before its body
/// is read or anything is made for it, over HTTP/1.1 and HTTP/2: nothing runs, the key stays
/// free, and the client's next request (on the connection it kept, if it kept one) is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_too_large_is_413_and_nothing_runs() {
    for transport in Transport::BOTH {
        let counts = Counts::default();
        let layer = layer(OnDisconnect::Complete, InFlight::Wait).max_request_bytes(1024);
        let addr = serve(app(
            layer.clone(),
            Shape::ContentLength,
            Duration::ZERO,
            &counts,
        ))
        .await;
        let client = client(transport);
        let key = format!("order-declared-large-{transport:?}");
        let big = Full::new(Bytes::from(vec![b'x'; 4096]));
        let refused = post_order(&client, addr, &key, big).await;
        assert_eq!(
            refused.status,
            StatusCode::PAYLOAD_TOO_LARGE,
            "{transport:?}"
        );
        assert_eq!(refused.headers["x-reason-code"], "REQUEST_TOO_LARGE");
        assert!(
            refused.json()["detail"]
                .as_str()
                .unwrap()
                .contains("1024 bytes"),
            "{transport:?}: {refused:?}"
        );
        assert_eq!(counts.started(), 0, "{transport:?}: nothing ran");
        assert_eq!(
            layer
                .stats()
                .rejected(idempotency_layer::RejectReason::TooLarge),
            1
        );

        let small = Full::new(Bytes::from_static(b"{\"sku\":\"b1\"}"));
        let served = post_order(&client, addr, &key, small).await;
        assert_eq!(
            served.status,
            StatusCode::CREATED,
            "{transport:?}: the key was free"
        );
        assert!(!served.replayed(), "{transport:?}");
        assert_eq!(counts.started(), 1, "{transport:?}");
    }
}

/// A response body that counts being dropped before its end (the server let go of it: its
/// client went away mid-body).
struct Watched<B> {
    inner: std::pin::Pin<Box<B>>,
    ended: bool,
    dropped_early: Arc<AtomicUsize>,
}

impl<B: http_body::Body> http_body::Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = self.inner.as_mut().poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) || self.inner.is_end_stream() {
            self.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for Watched<B> {
    fn drop(&mut self) {
        if !self.ended {
            self.dropped_early.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A client that drops the response mid-body (HTTP/1.1: its connection closes; HTTP/2: its
/// stream is reset) while the handler's body is still coming: the server lets go of the body,
/// the layer reads the rest of it anyway and stores the record, and the retry gets the replay.
/// Nothing runs twice. With a body small enough to record, the replay is the whole body; with a
/// larger one (`max_record_bytes`), it is the head, its body marked omitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_drops_the_response_mid_body_gets_the_replay() {
    use http_body_util::BodyExt;

    for transport in Transport::BOTH {
        for recordable in [true, false] {
            let case = format!("{transport:?}, body recordable: {recordable}");
            let counts = Counts::default();
            let rest = Arc::new(tokio::sync::Semaphore::new(0));
            let router = {
                let rest = rest.clone();
                orders(&counts, move |counts| {
                    let rest = rest.clone();
                    async move {
                        let n = counts.started.fetch_add(1, Ordering::SeqCst) + 1;
                        use futures_util::StreamExt;
                        let first = futures_util::stream::once(async move {
                            Ok::<_, Infallible>(Frame::data(Bytes::from(format!("order {n};"))))
                        });
                        let second = futures_util::stream::once(async move {
                            rest.acquire().await.unwrap().forget();
                            Ok(Frame::data(Bytes::from_static(b" the rest")))
                        });
                        Response::builder()
                            .status(StatusCode::CREATED)
                            .body(Body::new(StreamBody::new(first.chain(second))))
                            .unwrap()
                    }
                })
            };
            let max_record = if recordable { 1 << 20 } else { 4 };
            let layer = layer(OnDisconnect::Complete, InFlight::Wait).max_record_bytes(max_record);
            let dropped_early = Arc::new(AtomicUsize::new(0));
            let watch = {
                let dropped_early = dropped_early.clone();
                tower::util::MapResponseLayer::new(move |r: Response<Body>| {
                    let dropped_early = dropped_early.clone();
                    r.map(|inner| {
                        Body::new(Watched {
                            inner: Box::pin(inner),
                            ended: false,
                            dropped_early,
                        })
                    })
                })
            };
            let addr = serve(router.layer(layer.clone()).layer(watch)).await;

            // The first frame arrives; the client drops the response.
            let req = Request::post(format!("http://{addr}/orders"))
                .header("x-idempotency-key", "order-dropped-mid-body")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"{\"sku\":\"b1\"}")))
                .unwrap();
            let mut res = client(transport).request(req).await.unwrap();
            assert_eq!(res.status(), StatusCode::CREATED, "{case}");
            let frame = res.body_mut().frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), "order 1;", "{case}");
            drop(res);
            wait::until("the server lets go of the response body", || {
                dropped_early.load(Ordering::SeqCst) == 1
            })
            .await;
            assert_eq!(
                layer.stats().recorded,
                0,
                "{case}: the body is not whole yet"
            );

            // The rest of the body comes: the layer reads it and stores the record.
            rest.add_permits(1);
            wait::until("the record is stored", || layer.stats().recorded == 1).await;
            let retry = send(&client(transport), addr, "order-dropped-mid-body").await;
            assert_eq!(retry.status, StatusCode::CREATED, "{case}: {retry:?}");
            assert!(retry.replayed(), "{case}: {retry:?}");
            if recordable {
                assert_eq!(retry.body, "order 1; the rest", "{case}");
            } else {
                assert!(retry.body.is_empty(), "{case}: {retry:?}");
                assert_eq!(retry.headers["idempotent-body-omitted"], "true", "{case}");
            }
            assert_eq!(counts.started(), 1, "{case}: the handler ran once");
            let m = layer.stats();
            assert_eq!((m.executed, m.replayed, m.released), (1, 1, 0), "{case}");
        }
    }
}

/// A handler answers 201, then its body panics: at its first poll (inside the layer's own read
/// before the head goes out) or later (in the task that reads the rest). Over both transports
/// the call ends with an error instead of waiting forever, the 201 is recorded as a body that
/// breaks off after a recorded head is (without its body), and a retry gets that replay: the
/// handler never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_panics_after_its_201_head_ends_the_call_and_never_runs_again() {
    use http_body_util::BodyExt;

    for transport in Transport::BOTH {
        for late in [false, true] {
            let case = format!(
                "{transport:?}, panics {}",
                if late { "late" } else { "at once" }
            );
            let counts = Counts::default();
            let router = orders(&counts, move |counts| async move {
                counts.started.fetch_add(1, Ordering::SeqCst);
                let frames = futures_util::stream::unfold(0u8, move |step| async move {
                    match step {
                        0 if late => {
                            Some((Ok::<_, Infallible>(Frame::data(Bytes::from("part"))), 1))
                        }
                        _ => {
                            if late {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            panic!("the response body panics (expected by the test)")
                        }
                    }
                });
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-length", "100")
                    .body(Body::new(StreamBody::new(frames)))
                    .unwrap()
            });
            let addr = serve(router.layer(layer(OnDisconnect::Complete, InFlight::Wait))).await;
            let client = client(transport);
            let req = || {
                Request::post(format!("http://{addr}/orders"))
                    .header("x-idempotency-key", "order-body-panics")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap()
            };
            let read = async {
                let res = client.request(req()).await.map_err(|e| e.to_string())?;
                let status = res.status();
                res.into_body()
                    .collect()
                    .await
                    .map(|_| status)
                    .map_err(|e| e.to_string())
            };
            let first = tokio::time::timeout(Duration::from_secs(20), read)
                .await
                .unwrap_or_else(|_| panic!("{case}: the call never ended"));
            assert!(
                first.is_err(),
                "{case}: the body ends in an error: {first:?}"
            );

            let retry = tokio::time::timeout(Duration::from_secs(20), client.request(req()))
                .await
                .expect("a retry answered within 20 s")
                .expect("a response");
            let retry = collect(retry).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{case}: {retry:?}");
            assert!(retry.replayed(), "{case}: the retry is a replay: {retry:?}");
            assert_eq!(
                retry
                    .headers
                    .get("idempotent-body-omitted")
                    .map(|v| v.as_bytes()),
                Some(&b"true"[..]),
                "{case}: recorded without its body"
            );
            assert_eq!(counts.started(), 1, "{case}: the handler ran once");
        }
    }
}

/// Which method of [`HostileBody`] panics.
#[derive(Clone, Copy, Debug)]
enum Panics {
    /// `is_end_stream`, from its first call.
    IsEndStream,
    /// `is_end_stream`, once its first frame was taken.
    IsEndStreamLater,
    /// `size_hint`.
    SizeHint,
}

/// A body of two frames whose `is_end_stream` or `size_hint` panics: user code the layer calls
/// besides `poll_frame`.
struct HostileBody {
    frames: std::collections::VecDeque<Bytes>,
    taken: usize,
    panics: Panics,
}

impl http_body::Body for HostileBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.taken += 1;
        std::task::Poll::Ready(self.frames.pop_front().map(|d| Ok(Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        match self.panics {
            Panics::IsEndStream => panic!("is_end_stream panics (expected by the test)"),
            Panics::IsEndStreamLater if self.taken > 0 => {
                panic!("is_end_stream panics (expected by the test)")
            }
            _ => self.frames.is_empty(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.panics {
            Panics::SizeHint => panic!("size_hint panics (expected by the test)"),
            _ => http_body::SizeHint::default(),
        }
    }
}

/// A response body whose `is_end_stream` or `size_hint` panics after a 201 head is a failure of
/// that response like a panic in `poll_frame`: the call ends, the outcome (a 201: the write ran)
/// is recorded without its body, and the retry is its replay. The handler runs once. (Only
/// `poll_frame` was guarded: the panic reached the server's task, the claim was released
/// without a shared failure, and the retry ran the handler again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_whose_is_end_stream_or_size_hint_panics_never_runs_again() {
    for transport in Transport::BOTH {
        for panics in [
            Panics::IsEndStream,
            Panics::IsEndStreamLater,
            Panics::SizeHint,
        ] {
            let case = format!("{transport:?}, {panics:?}");
            let counts = Counts::default();
            let router = orders(&counts, move |counts| async move {
                counts.started.fetch_add(1, Ordering::SeqCst);
                let body = HostileBody {
                    frames: [Bytes::from("part one"), Bytes::from("part two")].into(),
                    taken: 0,
                    panics,
                };
                Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Body::new(body))
                    .unwrap()
            });
            let addr = serve(router.layer(layer(OnDisconnect::Complete, InFlight::Wait))).await;
            let client = client(transport);
            let req = || {
                Request::post(format!("http://{addr}/orders"))
                    .header("x-idempotency-key", "order-hostile-body")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap()
            };
            let first = tokio::time::timeout(Duration::from_secs(20), async {
                use http_body_util::BodyExt;
                let res = client.request(req()).await.map_err(|e| e.to_string())?;
                let (status, replayed) = (
                    res.status(),
                    res.headers().contains_key("idempotent-replayed"),
                );
                let body = res.into_body().collect().await.map_err(|e| e.to_string());
                body.map(|_| (status, replayed))
            })
            .await
            .unwrap_or_else(|_| panic!("{case}: the call never ended"));
            if let Ok(first) = &first {
                assert_eq!(
                    *first,
                    (StatusCode::CREATED, false),
                    "{case}: the first answer, if whole, is the handler's own"
                );
            }
            let retry = tokio::time::timeout(Duration::from_secs(20), client.request(req()))
                .await
                .unwrap_or_else(|_| panic!("{case}: the retry never got an answer"))
                .unwrap_or_else(|e| panic!("{case}: the retry failed: {e}"));
            let retry = collect(retry).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{case}: {retry:?}");
            assert!(retry.replayed(), "{case}: the retry is a replay: {retry:?}");
            assert_eq!(counts.started(), 1, "{case}: the handler ran once");
        }
    }
}

/// A `begin` the store never answers ends at one lease, over the wire: the write is answered
/// 503 (retryable; not even `fail_open` runs it, since a lease later a retry may run it
/// elsewhere) while its client holds the connection open, and the capacity it readied (the one
/// permit of a `ConcurrencyLimit` behind the layer) goes to the next write. Before, such a
/// write held the permit for as long as its client kept the connection, and the server
/// answered nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_the_store_never_answers_ends_at_one_lease_over_the_wire() {
    for transport in Transport::BOTH {
        let store = FaultStore::new(MemoryStore::new());
        store.inject(
            idempotency_layer::conformance::Rule::new(
                Op::Begin,
                idempotency_layer::conformance::Fault::Hang,
            )
            .times(1),
        );
        let counts = Counts::default();
        let idempotency = IdempotencyLayer::new(store.clone())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .lease(Duration::from_millis(500))
            .fail_open(true);
        let svc = tower::ServiceBuilder::new()
            .map_response(|r: Response<idempotency_layer::IdempotencyBody<Body>>| r.map(Body::new))
            .layer(idempotency)
            .concurrency_limit(1)
            .service(orders(&counts, |counts| async move {
                counts.started.fetch_add(1, Ordering::SeqCst);
                respond(Shape::ContentLength, 1)
            }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let make = axum::ServiceExt::<Request<Body>>::into_make_service(svc);
        tokio::spawn(async move { axum::serve(listener, make).await });
        let (held, other) = (client(transport), client(transport));
        let stuck = tokio::spawn(async move { send(&held, addr, "order-hung-begin-1").await });
        wait::until("the first begin is made", || {
            store.calls(Op::Begin).made == 1
        })
        .await;
        let next = tokio::spawn(async move { send(&other, addr, "order-hung-begin-2").await });
        let stuck = tokio::time::timeout(wait::LIMIT, stuck)
            .await
            .unwrap_or_else(|_| panic!("{transport:?}: the hung begin never ended"))
            .unwrap();
        let next = tokio::time::timeout(wait::LIMIT, next)
            .await
            .unwrap_or_else(|_| panic!("{transport:?}: the next write never got the capacity"))
            .unwrap();
        assert_eq!(
            stuck.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{transport:?}: {stuck:?}"
        );
        assert!(
            next.status.is_success(),
            "{transport:?}: the next write gets the capacity: {next:?}"
        );
        assert_eq!(counts.started(), 1, "{transport:?}: only the second ran");
    }
}

/// One key names one operation over HTTP too: behind an axum `Router` (the layer added with
/// `Router::layer`), the route's template is the operation in the scope and the concrete path
/// is in the fingerprint, so a key used on `POST /books/b1/deduct` and then reused on
/// `POST /books/b2/deduct` is a 422 and the second deduction does not run, as gRPC answers
/// FAILED_PRECONDITION for a key reused with another message. Around the router (no route
/// matched yet) the concrete path names the operation, and both run, as documented. (Before,
/// both ran either way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_on_two_resources_of_one_route_is_a_422() {
    for transport in Transport::BOTH {
        for inside_the_router in [true, false] {
            let deductions = Arc::new(AtomicUsize::new(0));
            let routes = Router::new().route(
                "/books/{id}/deduct",
                post({
                    let deductions = deductions.clone();
                    move || async move {
                        deductions.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, "deducted")
                    }
                }),
            );
            let layer = IdempotencyLayer::new(MemoryStore::new())
                .tenant(idempotency_layer::TenantSource::fixed("t"));
            let addr = if inside_the_router {
                crate::support::serve(routes.layer(layer)).await
            } else {
                let svc = tower::ServiceBuilder::new()
                    .map_response(|r: Response<idempotency_layer::IdempotencyBody<Body>>| {
                        r.map(Body::new)
                    })
                    .layer(layer)
                    .service(routes);
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                let make = axum::ServiceExt::<Request<Body>>::into_make_service(svc);
                tokio::spawn(async move { axum::serve(listener, make).await });
                addr
            };
            let client = client(transport);
            let deduct = |book: &str| {
                Request::post(format!("http://{addr}/books/{book}/deduct"))
                    .header("x-idempotency-key", "deduct-key-0001")
                    .body(Full::new(Bytes::from_static(b"{\"quantity\":1}")))
                    .unwrap()
            };
            let first = collect(client.request(deduct("b1")).await.unwrap()).await;
            assert_eq!(first.status, StatusCode::CREATED, "{transport:?}");
            let again = collect(client.request(deduct("b1")).await.unwrap()).await;
            assert!(
                again.replayed(),
                "{transport:?}: the same write is a replay"
            );
            let other = collect(client.request(deduct("b2")).await.unwrap()).await;
            if inside_the_router {
                assert_eq!(
                    other.status,
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "{transport:?}: one key reused on another book: {other:?}"
                );
                assert_eq!(deductions.load(Ordering::SeqCst), 1, "{transport:?}");
            } else {
                assert_eq!(other.status, StatusCode::CREATED, "{transport:?}");
                assert_eq!(deductions.load(Ordering::SeqCst), 2, "{transport:?}");
            }
        }
    }
}

/// A replay sends the head its record keeps: the handler's headers that records keep, in order
/// and repeated, and one `idempotent-replayed: true` (the layer's, not one the handler set);
/// never `set-cookie` or the first answer's `date`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sends_the_recorded_head_marked_once() {
    for transport in Transport::BOTH {
        let router = Router::new().route(
            "/orders",
            post(|| async {
                let mut res = Response::new(Body::from("order 1 created"));
                *res.status_mut() = StatusCode::CREATED;
                let h = res.headers_mut();
                h.insert("content-type", HeaderValue::from_static("application/json"));
                h.append("x-order", HeaderValue::from_static("1"));
                h.append("x-order", HeaderValue::from_static("2"));
                h.insert(
                    "set-cookie",
                    HeaderValue::from_static("session=first-client"),
                );
                h.insert(
                    "date",
                    HeaderValue::from_static("Mon, 07 Dec 2026 00:00:00 GMT"),
                );
                h.insert("idempotent-replayed", HeaderValue::from_static("handler"));
                res
            }),
        );
        let layer = layer(OnDisconnect::Complete, InFlight::Wait);
        let addr = serve(router.layer(layer.clone())).await;
        let client = client(transport);
        let first = send(&client, addr, "order-head-1").await;
        assert_eq!(first.status, StatusCode::CREATED, "{transport:?}");
        assert_eq!(first.headers["set-cookie"], "session=first-client");
        assert_eq!(
            first.headers["idempotent-replayed"], "handler",
            "the handler's own"
        );
        for _ in 0..2 {
            let replay = send(&client, addr, "order-head-1").await;
            assert_eq!(replay.status, StatusCode::CREATED, "{transport:?}");
            assert_eq!(replay.body, first.body, "{transport:?}");
            let marks: Vec<_> = replay
                .headers
                .get_all("idempotent-replayed")
                .iter()
                .collect();
            assert_eq!(marks, ["true"], "{transport:?}: one marker, the layer's");
            let orders: Vec<_> = replay.headers.get_all("x-order").iter().collect();
            assert_eq!(orders, ["1", "2"], "{transport:?}: repeats kept, in order");
            assert_eq!(replay.headers["content-type"], "application/json");
            assert!(!replay.headers.contains_key("set-cookie"), "{transport:?}");
            assert_ne!(
                replay.headers.get("date").map(|d| d.as_bytes()),
                Some(&b"Mon, 07 Dec 2026 00:00:00 GMT"[..]),
                "{transport:?}: dated when it is sent"
            );
        }
        assert_eq!((layer.stats().executed, layer.stats().replayed), (1, 2));
    }
}

/// Duplicates that waited for a leader whose answer is not recorded (a 503) get that answer as
/// it was: not marked as a replay, over the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_failure_is_not_marked_as_a_replay() {
    for transport in Transport::BOTH {
        let (router, gate) = crate::support::gated_orders(|| {
            (StatusCode::SERVICE_UNAVAILABLE, [("x-busy", "yes")], "busy")
        });
        let layer = layer(OnDisconnect::Complete, InFlight::Wait);
        let addr = serve(router.layer(layer.clone())).await;
        let client = client(transport);
        let calls: Vec<_> = (0..4)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { send(&client, addr, "order-busy-1").await })
            })
            .collect();
        wait::until("three duplicates wait", || layer.stats().waited == 3).await;
        gate.add_permits(1);
        for call in calls {
            let answer = call.await.unwrap();
            assert_eq!(
                answer.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{transport:?}"
            );
            assert_eq!(answer.body, "busy", "{transport:?}");
            assert_eq!(answer.headers["x-busy"], "yes", "{transport:?}");
            assert!(
                !answer.headers.contains_key("idempotent-replayed"),
                "{transport:?}: nothing was recorded: {answer:?}"
            );
        }
        let m = layer.stats();
        assert_eq!((m.executed, m.shared_failures), (1, 3), "{transport:?}");
    }
}

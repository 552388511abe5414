//! Every wait the server holds has a bound, and every failure mid-response is safe: a stalled
//! client, a hung handler, a slow request body, a `Buffer` in front of a limit, a response body
//! that fails, a client that leaves mid-body, detached work, a full or unanswering store, and
//! settings at their extremes. Over real sockets (HTTP/1.1 and h2) where a transport is
//! involved, on paused time where time is the subject.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::{collect, serve, Collected, Fault, FaultStore, Op, Reply, Rule};
use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey};
use idempotency_layer::{
    IdempotencyLayer, IdempotencyStore, InFlight, MemoryStore, OnDisconnect, RejectReason,
    RequestBody,
};
use test_support::wait::until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};

use test_support::net::Transport;

type StreamingClient =
    Client<HttpConnector, http_body_util::combinators::BoxBody<Bytes, std::io::Error>>;

fn client<B>(transport: Transport) -> Client<HttpConnector, B>
where
    B: http_body::Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    transport.client()
}

fn keyed(addr: SocketAddr, path: &str, key: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}{path}"))
        .header("x-idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// Sends `req` and reads the response whole, within 20 s.
async fn send<B>(client: &Client<HttpConnector, B>, req: Request<B>) -> Collected
where
    B: http_body::Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let res = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("an answer within 20 s")
        .expect("a response");
    collect(res).await
}

/// A body of `chunks` chunks of `size` bytes each, made as the server asks for them.
fn big_body(chunks: usize, size: usize) -> Body {
    let chunk = Bytes::from(vec![b'x'; size]);
    Body::from_stream(futures_util::stream::iter(
        (0..chunks).map(move |_| Ok::<_, Infallible>(chunk.clone())),
    ))
}

/// A router whose `/orders` answers 201 with `make()`'s body, counting executions.
fn orders(executions: &Arc<AtomicUsize>, make: fn() -> Body) -> Router {
    let executions = executions.clone();
    Router::new().route(
        "/orders",
        post(move || {
            executions.fetch_add(1, Ordering::SeqCst);
            async move { (StatusCode::CREATED, make()) }
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Item: a slow client does not hold its key.

const STALL_CHUNK: usize = 64 * 1024;

/// A client that reads the head of a large response and nothing of its body (a full
/// flow-control window, a stalled or half-open peer) does not keep the key in flight: the layer
/// reads the handler's body to its end by itself and records it, and a retry on another
/// connection gets the replay, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_hold_its_key() {
    for transport in Transport::BOTH {
        // HTTP/1.1: more than the socket buffers hold (up to 4 MiB on this kernel, plus hyper's
        // own); h2: more than the stream's flow-control window the client grants (64 KiB).
        let chunks = match transport {
            Transport::Http1 => 128, // 8 MiB
            Transport::Http2 => 8,   // 512 KiB
        };
        let executions = Arc::new(AtomicUsize::new(0));
        let store = MemoryStore::builder()
            .shards(1)
            .max_bytes(64 << 20)
            .tenant_share_percent(100)
            .build()
            .unwrap();
        let layer = IdempotencyLayer::new(store)
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .max_record_bytes(16 << 20)
            .in_flight(InFlight::Reject);
        let make: fn() -> Body = match transport {
            Transport::Http1 => || big_body(128, STALL_CHUNK),
            Transport::Http2 => || big_body(8, STALL_CHUNK),
        };
        let addr = serve(orders(&executions, make).layer(layer.clone())).await;

        // The stalled client: the request goes out, the response's body is never read.
        let stalled = match transport {
            Transport::Http1 => {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.set_recv_buffer_size(4096).unwrap();
                let mut stream = socket.connect(addr).await.unwrap();
                let request = "POST /orders HTTP/1.1\r\nhost: test\r\nx-idempotency-key: \
                               order-stalled-1\r\ncontent-type: application/json\r\n\
                               content-length: 2\r\n\r\n{}";
                stream.write_all(request.as_bytes()).await.unwrap();
                let mut head = [0u8; 12];
                stream.read_exact(&mut head).await.unwrap();
                assert_eq!(&head, b"HTTP/1.1 201");
                Box::new(stream) as Box<dyn std::any::Any + Send>
            }
            Transport::Http2 => {
                let client = Client::builder(TokioExecutor::new())
                    .http2_only(true)
                    .http2_initial_stream_window_size(65_535)
                    .http2_initial_connection_window_size(65_535)
                    .build_http::<Full<Bytes>>();
                let res = client
                    .request(keyed(addr, "/orders", "order-stalled-1"))
                    .await
                    .unwrap();
                assert_eq!(res.status(), StatusCode::CREATED);
                Box::new((client, res)) as Box<dyn std::any::Any + Send>
            }
        };
        until("the record is stored while the client stalls", || {
            layer.stats().recorded == 1
        })
        .await;
        let retry = send(
            &client::<Full<Bytes>>(transport),
            keyed(addr, "/orders", "order-stalled-1"),
        )
        .await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{transport:?}: {:?}",
            retry.headers
        );
        assert!(retry.replayed(), "{transport:?}: a replay, not a 409");
        assert_eq!(retry.body.len(), chunks * STALL_CHUNK, "{transport:?}");
        assert_eq!(executions.load(Ordering::SeqCst), 1, "{transport:?}");
        drop(stalled);
    }
}

/// A response body that never ends is bounded by the claim's lifetime: its client's stream ends
/// with an error there, the claim is counted as lapsed, and (its head being a 201) it is recorded
/// without its body, so the retry gets "executed once" instead of running it again.
#[tokio::test(start_paused = true)]
async fn a_response_body_that_never_ends_stops_at_the_claims_lifetime() {
    let executions = Arc::new(AtomicUsize::new(0));
    let e = executions.clone();
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_claim_lifetime(Duration::from_secs(60));
    let svc = layer.layer(service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        e.fetch_add(1, Ordering::SeqCst);
        let first = futures_util::stream::once(async {
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"first")))
        });
        let never = futures_util::stream::pending();
        let body = StreamBody::new(futures_util::StreamExt::chain(first, never));
        async move {
            Ok::<_, Infallible>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .body(body)
                    .unwrap(),
            )
        }
    }));
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "order-endless-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let res = svc.clone().oneshot(req()).await.unwrap();
    let read = tokio::spawn(async move { res.into_body().collect().await.map(|_| ()) });
    let err = tokio::time::timeout(Duration::from_secs(3600), read)
        .await
        .expect("the body ends within an hour of virtual time")
        .unwrap()
        .expect_err("an endless body ends in an error");
    assert!(err.to_string().contains("max_claim_lifetime"), "{err}");
    let m = layer.stats();
    assert_eq!((m.lapsed, m.recorded), (1, 1));
    let retry = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-body-omitted"], "true");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A handler that never answers keeps its key no longer than its lifetime and a lease: its
/// lease stops being renewed there (counted, logged), and a duplicate then takes the claim over
/// and runs. Without the bound the lease was renewed for as long as the handler hung, and every
/// duplicate waited `max_wait` for a 409.
#[tokio::test(start_paused = true)]
async fn a_hung_handler_keeps_its_key_no_longer_than_its_lifetime() {
    let executions = Arc::new(AtomicUsize::new(0));
    let e = executions.clone();
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_claim_lifetime(Duration::from_secs(120));
    let svc = layer.layer(service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        let n = e.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }));
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "order-hung-0001")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let hung = tokio::spawn(svc.clone().oneshot(req()));
    // Past the lifetime and one lease (30 s): the claim has lapsed.
    tokio::time::sleep(Duration::from_secs(120 + 31)).await;
    assert_eq!(layer.stats().lapsed, 1);
    let duplicate = svc.clone().oneshot(req()).await.unwrap();
    let body = duplicate.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "done", "the duplicate took the lapsed claim over");
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    assert!(!hung.is_finished());
    hung.abort();
}

// ---------------------------------------------------------------------------------------------
// Item: a write's request body is read with a time limit.

/// A request body that does not arrive is answered 408 with a message naming the setting, and
/// nothing is claimed or run: over HTTP/1.1 (a slow-loris client that sends its headers and a
/// few bytes) and h2 (a body that stalls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_does_not_arrive_is_408_and_nothing_runs() {
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .request_body_timeout(Duration::from_millis(300));
    let addr = serve(orders(&executions, Body::empty).layer(layer.clone())).await;

    // HTTP/1.1: 10 of the 100 bytes announced, then nothing.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = "POST /orders HTTP/1.1\r\nhost: test\r\nx-idempotency-key: order-loris-1\r\n\
                   content-length: 100\r\n\r\n0123456789";
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut answer))
        .await
        .expect("answered within 20 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_body_timeout"), "{answer}");

    // h2: one frame of the body, then a stall.
    let (tx, req) = stalled_upload(addr, "order-loris-2").await;
    let h2: StreamingClient = client(Transport::Http2);
    let res = send(&h2, req).await;
    assert_eq!(res.status, StatusCode::REQUEST_TIMEOUT, "{res:?}");
    drop(tx);

    assert_eq!(executions.load(Ordering::SeqCst), 0, "nothing ran");
    let m = layer.stats();
    assert_eq!(m.rejected(RejectReason::BodyTimeout), 2);
    assert_eq!(m.executed, 0, "nothing was claimed");
}

/// A keyed write to `/orders` whose body sends its first frame, then waits for the frames `tx`
/// sends (its end when `tx` is dropped): an upload that stalls mid-way.
async fn stalled_upload(
    addr: SocketAddr,
    key: &str,
) -> (
    tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    Request<http_body_util::combinators::BoxBody<Bytes, std::io::Error>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
    tx.send(Ok(Frame::data(Bytes::from_static(b"{\"sku\":"))))
        .await
        .unwrap();
    let stalled = StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|f| (f, rx))
    }))
    .boxed();
    let req = Request::post(format!("http://{addr}/orders"))
        .header("x-idempotency-key", key)
        .body(stalled)
        .unwrap();
    (tx, req)
}

/// The default bound, as it ships: a body that never comes is answered 408 after 30 s.
#[tokio::test(start_paused = true)]
async fn by_default_a_request_body_is_awaited_30_seconds() {
    let svc = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .layer(service_fn(|_: Request<RequestBody<Body>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
    let never = Body::from_stream(futures_util::stream::pending::<Result<Bytes, Infallible>>());
    let req = Request::post("/orders")
        .header("x-idempotency-key", "order-never-01")
        .body(never)
        .unwrap();
    let started = tokio::time::Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(3600), svc.oneshot(req))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(started.elapsed(), Duration::from_secs(30));
}

// ---------------------------------------------------------------------------------------------
// Items: a body that fails at its first poll, or mid-stream, after a recorded head.

/// A body that fails: at its first frame, or after one. The client sees an error (never a clean,
/// complete answer: over HTTP/1.1 a `Content-Length: 0` would have said the empty body was all
/// of it), and since its head was a 201 (the handler's side effect happened) the retry gets
/// "executed once", recorded without its body, instead of running it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_body_that_fails_is_an_error_on_the_wire_and_is_not_run_again() {
    for transport in Transport::BOTH {
        for at_once in [true, false] {
            let case = format!("{transport:?} fails at once: {at_once}");
            let executions = Arc::new(AtomicUsize::new(0));
            let make: fn() -> Body = if at_once {
                || {
                    Body::from_stream(futures_util::stream::once(async {
                        Err::<Bytes, _>(std::io::Error::other("the database cursor broke"))
                    }))
                }
            } else {
                || {
                    Body::from_stream(futures_util::stream::iter([
                        Ok(Bytes::from_static(b"part")),
                        Err(std::io::Error::other("the database cursor broke")),
                    ]))
                }
            };
            let layer = IdempotencyLayer::new(MemoryStore::new())
                .tenant(idempotency_layer::TenantSource::fixed("t"));
            let addr = serve(orders(&executions, make).layer(layer.clone())).await;
            let c = client::<Full<Bytes>>(transport);
            let first = tokio::time::timeout(
                Duration::from_secs(20),
                c.request(keyed(addr, "/orders", "order-failing-1")),
            )
            .await
            .expect("an answer within 20 s");
            let outcome = match first {
                Ok(res) => res
                    .into_body()
                    .collect()
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            assert!(outcome.is_err(), "{case}: the client must see the failure");
            until("recorded", || layer.stats().recorded == 1).await;
            let retry = send(&c, keyed(addr, "/orders", "order-failing-1")).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{case}");
            assert!(retry.replayed(), "{case}");
            assert_eq!(retry.headers["idempotent-body-omitted"], "true", "{case}");
            assert_eq!(executions.load(Ordering::SeqCst), 1, "{case}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Item: a `Buffer` in front and a limit behind.

/// `ServiceBuilder::new().buffer(8).layer(idempotency).concurrency_limit(1)`: every keyed write
/// is answered, one after another and all at once. The Buffer's worker readies the layer (which
/// readies the limit, taking its one permit) and keeps that readied service for its next call,
/// so a write that ran on a clone of its own would wait forever for the permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_in_front_and_a_limit_behind_answer_every_write() {
    let executions = Arc::new(AtomicUsize::new(0));
    let router = orders(&executions, || Body::from("created"));
    let svc = ServiceBuilder::new()
        .layer(axum::error_handling::HandleErrorLayer::new(
            |e: tower::BoxError| async move { (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()) },
        ))
        .buffer(8)
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .tenant(idempotency_layer::TenantSource::fixed("t")),
        )
        .concurrency_limit(1)
        .service(router);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let make = axum::ServiceExt::<Request<Body>>::into_make_service(svc);
    tokio::spawn(async move { axum::serve(listener, make).await });
    for transport in Transport::BOTH {
        let c = client::<Full<Bytes>>(transport);
        let one_by_one = async {
            for k in 0..5 {
                let key = format!("order-buffer-{transport:?}-{k}");
                let res = send(&c, keyed(addr, "/orders", &key)).await;
                assert_eq!(res.status, StatusCode::CREATED, "{transport:?}: {res:?}");
            }
        };
        tokio::time::timeout(Duration::from_secs(5), one_by_one)
            .await
            .unwrap_or_else(|_| panic!("{transport:?}: a write was not answered within 5 s"));
        let at_once = futures_util::future::join_all((0..8).map(|k| {
            let key = format!("order-buffer-{transport:?}-all-{k}");
            send(&c, keyed(addr, "/orders", &key))
        }));
        let answers = tokio::time::timeout(Duration::from_secs(10), at_once)
            .await
            .unwrap_or_else(|_| panic!("{transport:?}: concurrent writes were not answered"));
        assert!(answers.iter().all(|a| a.status == StatusCode::CREATED));
    }
    assert_eq!(executions.load(Ordering::SeqCst), 26);
}

// ---------------------------------------------------------------------------------------------
// Items: a client that leaves mid-body; detached work.

/// A body that streams its first frame now and the rest when `gate` opens.
fn gated_body(gate: Arc<tokio::sync::Semaphore>) -> Body {
    let first = futures_util::stream::once(async { Ok::<_, Infallible>(Bytes::from("order ")) });
    let rest = futures_util::stream::once(async move {
        gate.acquire().await.unwrap().forget();
        Ok::<_, Infallible>(Bytes::from("created"))
    });
    Body::from_stream(futures_util::StreamExt::chain(first, rest))
}

/// `OnDisconnect::Release` cancels a handler whose client goes away, but once the handler has
/// answered a recorded head its side effect has happened: a client that leaves mid-body does
/// not make its retry run it again. The body is read to its end and recorded, and the retry
/// gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_mode_records_a_response_whose_client_left_mid_body() {
    for transport in Transport::BOTH {
        let executions = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let router = {
            let (executions, gate) = (executions.clone(), gate.clone());
            Router::new().route(
                "/orders",
                post(move || {
                    executions.fetch_add(1, Ordering::SeqCst);
                    let gate = gate.clone();
                    async move { (StatusCode::CREATED, gated_body(gate)) }
                }),
            )
        };
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .on_disconnect(OnDisconnect::Release);
        let addr = serve(router.layer(layer.clone())).await;
        {
            // A client of its own, dropped after the first frame: its stream or connection
            // closes mid-body.
            let c = client::<Full<Bytes>>(transport);
            let res = c
                .request(keyed(addr, "/orders", "order-left-0001"))
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::CREATED);
            let mut body = res.into_body();
            let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
            assert_eq!(first, "order ");
        }
        gate.add_permits(1);
        until("recorded", || layer.stats().recorded == 1).await;
        let retry = send(
            &client::<Full<Bytes>>(transport),
            keyed(addr, "/orders", "order-left-0001"),
        )
        .await;
        assert!(retry.replayed(), "{transport:?}");
        assert_eq!(retry.body, "order created", "{transport:?}");
        assert_eq!(executions.load(Ordering::SeqCst), 1, "{transport:?}");
    }
}

/// Handlers left running after their client went away are bounded layer-wide: with
/// `max_detached(2)`, of four handlers whose clients leave, two are finished and recorded, and
/// the two past the bound are cancelled (counted), their keys released to run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_work_is_bounded_layer_wide() {
    for transport in Transport::BOTH {
        let started = Arc::new(AtomicUsize::new(0));
        let cancelled = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        struct Cancelled(Arc<AtomicUsize>, bool);
        impl Drop for Cancelled {
            fn drop(&mut self) {
                if !self.1 {
                    self.0.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        let router = {
            let (started, cancelled, gate) = (started.clone(), cancelled.clone(), gate.clone());
            Router::new().route(
                "/orders",
                post(move || {
                    let (started, cancelled, gate) =
                        (started.clone(), cancelled.clone(), gate.clone());
                    async move {
                        started.fetch_add(1, Ordering::SeqCst);
                        let mut guard = Cancelled(cancelled, false);
                        gate.acquire().await.unwrap().forget();
                        guard.1 = true;
                        (StatusCode::CREATED, "created")
                    }
                }),
            )
        };
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .max_detached(2);
        let addr = serve(router.layer(layer.clone())).await;
        let clients: Vec<_> = (0..4)
            .map(|k| {
                tokio::spawn(async move {
                    let c = client::<Full<Bytes>>(transport);
                    send(&c, keyed(addr, "/orders", &format!("order-detached-{k}"))).await
                })
            })
            .collect();
        until("four handlers run", || started.load(Ordering::SeqCst) == 4).await;
        for c in clients {
            c.abort();
        }
        until("two are cancelled past the bound", || {
            cancelled.load(Ordering::SeqCst) == 2
        })
        .await;
        assert_eq!(layer.stats().detached_refused, 2, "{transport:?}");
        gate.add_permits(4);
        until("the detached ones are recorded", || {
            layer.stats().recorded == 2
        })
        .await;
        until("no detached work is left", || layer.stats().detached == 0).await;
        let c = client::<Full<Bytes>>(transport);
        let mut replayed = 0;
        for k in 0..4 {
            gate.add_permits(1);
            let retry = send(&c, keyed(addr, "/orders", &format!("order-detached-{k}"))).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{transport:?}");
            replayed += usize::from(retry.replayed());
        }
        assert_eq!(replayed, 2, "{transport:?}: the finished ones replay");
        assert_eq!(
            started.load(Ordering::SeqCst),
            6,
            "{transport:?}: the others run again"
        );
    }
}

/// Detached work ends at the claim's lifetime: a handler whose client left and that never
/// finishes is cancelled there (counted as lapsed), and its key is free again.
#[tokio::test(start_paused = true)]
async fn detached_work_ends_at_the_claims_lifetime() {
    let executions = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    let (e, c) = (executions.clone(), cancelled.clone());
    struct Cancelled(Arc<AtomicUsize>);
    impl Drop for Cancelled {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let layer = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_claim_lifetime(Duration::from_secs(60));
    let svc = layer.layer(service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        let n = e.fetch_add(1, Ordering::SeqCst);
        let guard = Cancelled(c.clone());
        async move {
            if n == 0 {
                std::future::pending::<()>().await;
            }
            std::mem::forget(guard);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }));
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "order-detached-hung")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    // The client goes away after a second: the handler goes on, detached.
    let gone = tokio::time::timeout(Duration::from_secs(1), svc.clone().oneshot(req())).await;
    assert!(gone.is_err());
    assert_eq!(layer.stats().detached, 1);
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(
        cancelled.load(Ordering::SeqCst),
        1,
        "cancelled at its lifetime"
    );
    let m = layer.stats();
    assert_eq!((m.detached, m.lapsed), (0, 1));
    let retry = svc.clone().oneshot(req()).await.unwrap();
    assert_eq!(
        retry.into_body().collect().await.unwrap().to_bytes(),
        "done"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

// ---------------------------------------------------------------------------------------------
// Items: a full store; a failure's release.

/// A full store is not a store that is down: even with `fail_open`, a write it has no room for
/// is refused (503, retryable) and never runs without its claim.
#[tokio::test]
async fn a_full_store_never_fails_open() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::builder()
        .max_entries(1)
        .shards(1)
        .tenant_share_percent(100)
        .build()
        .unwrap();
    let layer = IdempotencyLayer::new(store)
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .fail_open(true);
    let app = orders(&executions, || Body::from("created")).layer(layer.clone());
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", key)
                .body(Body::from("{}"))
                .unwrap();
            collect(app.oneshot(req).await.unwrap()).await
        }
    };
    assert_eq!(call("order-full-0001").await.status, StatusCode::CREATED);
    let refused = call("order-full-0002").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert!(refused.headers.contains_key("retry-after"));
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1,
        "nothing ran unprotected"
    );
    let m = layer.stats();
    assert_eq!((m.failed_open, m.rejected(RejectReason::StoreFull)), (0, 1));
}

/// A store that never answers a `begin` holds the write no longer than one lease: it is then
/// answered 503 (retryable, nothing ran, even with `fail_open`), and the capacity it readied (here the one permit of a
/// `ConcurrencyLimit` behind the layer) goes to the next write. Before, a write whose client
/// vanished without a reset (a partition: the server's connection half-open, its request future
/// alive) held the permit for ever, and the server answered nothing again.
#[tokio::test(start_paused = true)]
async fn a_begin_the_store_never_answers_ends_at_one_lease_and_frees_its_capacity() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Begin, Fault::Hang).times(1));
    let lease = Duration::from_secs(30);
    let app = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(store.clone())
                .tenant(idempotency_layer::TenantSource::fixed("t"))
                .lease(lease)
                // Not even with fail-open: a lease later, a retry may run it elsewhere.
                .fail_open(true),
        )
        .concurrency_limit(1)
        .service(orders(&executions, || Body::from("created")));
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", key)
                .body(Body::from("{}"))
                .unwrap();
            collect(app.oneshot(req).await.unwrap()).await
        }
    };
    // The first write's begin hangs; its future stays alive (nobody resets it).
    let stuck = tokio::spawn(call("order-hung-begin-1"));
    until("the first begin is made", || {
        store.calls(Op::Begin).made == 1
    })
    .await;
    let next = tokio::spawn(call("order-hung-begin-2"));
    let stuck = tokio::time::timeout(lease * 2, stuck)
        .await
        .expect("the hung begin ends within one lease")
        .unwrap();
    assert_eq!(stuck.status, StatusCode::SERVICE_UNAVAILABLE, "{stuck:?}");
    let next = tokio::time::timeout(lease * 2, next)
        .await
        .expect("the next write gets the capacity")
        .unwrap();
    assert_eq!(next.status, StatusCode::CREATED, "{next:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 1, "only the second ran");
}

/// A `complete` the store never answers holds the response's last frame for a bounded time
/// (each try of the record ends at one lease), never for ever; the record is resent until the
/// store takes it, and the retry is replayed: nothing runs twice. Without the bound on each try
/// the answer never ends.
#[tokio::test(start_paused = true)]
async fn a_complete_the_store_never_answers_ends_at_one_lease_and_nothing_runs_twice() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Complete, Fault::Hang).times(1));
    let lease = Duration::from_secs(30);
    let app = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(store.clone())
                .tenant(idempotency_layer::TenantSource::fixed("t"))
                .lease(lease),
        )
        .service(orders(&executions, || Body::from("created")));
    let call = || {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", "order-hung-complete")
                .body(Body::from("{}"))
                .unwrap();
            let res = app.oneshot(req).await.unwrap();
            let status = res.status();
            let replayed = res.headers().contains_key("idempotent-replayed");
            (status, replayed, res.into_body().collect().await.is_ok())
        }
    };
    let (status, replayed, _) = tokio::time::timeout(lease * 3, call())
        .await
        .expect("the answer ends though the store never answers its complete");
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    until("the record is resent and stored", || {
        store.answers(Op::Complete).contains(&Reply::Ok)
    })
    .await;
    let (status, replayed, whole) = call().await;
    assert_eq!((status, replayed, whole), (StatusCode::CREATED, true, true));
    assert_eq!(executions.load(Ordering::SeqCst), 1, "it ran once");
}

/// Two instances sharing one store; the first's `begin` is claimed at once but its reply comes
/// late (a slow network on the way back, a busy pool). Its lease is counted from when the `begin`
/// was sent: answered 1.9 s into a 2 s lease, the leader renews it before the handler runs, and a
/// duplicate on the other instance 2.2 s in finds the claim held, waits, and gets the replay;
/// answered 2.5 s in, after the duplicate took the lapsed claim over, the renewal is fenced and
/// the late leader refuses its write (503, retryable) without running it. Either way the handler
/// ran once. (The leader started the handler without renewing, its first renewal came after the
/// lease had lapsed, and the duplicate took the claim over and ran the write again.)
#[tokio::test(start_paused = true)]
async fn a_begin_answered_late_is_renewed_before_the_handler_runs_and_nothing_runs_twice() {
    for late_ms in [1900, 2500] {
        let executions = Arc::new(AtomicUsize::new(0));
        let store = FaultStore::new(MemoryStore::new());
        let lease = Duration::from_secs(2);
        let late = Duration::from_millis(late_ms);
        store.inject(Rule::new(Op::Begin, Fault::DelayReply(late)).times(1));
        let instance = || {
            let executions = executions.clone();
            let handler = Router::new().route(
                "/orders",
                post(move || {
                    executions.fetch_add(1, Ordering::SeqCst);
                    async move {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        (StatusCode::CREATED, "created")
                    }
                }),
            );
            let layer = IdempotencyLayer::new(store.clone())
                .tenant(idempotency_layer::TenantSource::fixed("t"))
                .lease(lease);
            tower::util::BoxCloneService::new(ServiceBuilder::new().layer(layer).service(handler))
        };
        type App = tower::util::BoxCloneService<
            Request<Body>,
            Response<idempotency_layer::IdempotencyBody<Body>>,
            Infallible,
        >;
        let call = |app: App| async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", "order-late-begin")
                .body(Body::from("{}"))
                .unwrap();
            let res = app.oneshot(req).await.unwrap();
            let status = res.status();
            let replayed = res.headers().contains_key("idempotent-replayed");
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            (status, replayed, body.ok())
        };
        let first = tokio::spawn(call(instance()));
        tokio::time::sleep(Duration::from_millis(2200)).await;
        let second = call(instance()).await;
        let first = first.await.unwrap();
        if late < lease {
            assert_eq!(first.0, StatusCode::CREATED, "{late:?}: {first:?}");
            assert_eq!(
                (second.0, second.1),
                (StatusCode::CREATED, true),
                "{late:?}: the duplicate is the leader's replay: {second:?}"
            );
            assert_eq!(second.2, first.2, "the same body");
        } else {
            assert_eq!(
                (second.0, second.1),
                (StatusCode::CREATED, false),
                "{late:?}: the duplicate took the lapsed claim over and ran: {second:?}"
            );
            assert_eq!(
                first.0,
                StatusCode::SERVICE_UNAVAILABLE,
                "{late:?}: the late leader refuses: {first:?}"
            );
        }
        assert_eq!(
            executions.load(Ordering::SeqCst),
            1,
            "{late:?}: the handler ran once"
        );
    }
}

/// A record the store refuses as full (a store with an item-size limit) or corrupt keeps the
/// claim: it stays renewed, a duplicate finds it in flight (here told so: `InFlight::Reject`)
/// however many leases later, and the record is resent in the background (without its body to a
/// full store) until the store takes it; the retry then gets the replay, and the handler ran
/// once. (The claim was dropped at the refusal: renewals stopped, the lease lapsed under a write
/// that ran, and the next duplicate ran it again.)
#[tokio::test(start_paused = true)]
async fn a_record_the_store_refuses_as_full_or_corrupt_keeps_the_claim_and_nothing_runs_twice() {
    for fault in [Fault::Full, Fault::Corrupt] {
        let executions = Arc::new(AtomicUsize::new(0));
        let store = FaultStore::new(MemoryStore::new());
        store.inject(Rule::new(Op::Complete, fault));
        let lease = Duration::from_secs(2);
        let layer = IdempotencyLayer::new(store.clone())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .lease(lease)
            .in_flight(InFlight::Reject);
        let app = ServiceBuilder::new()
            .layer(layer.clone())
            .service(orders(&executions, || Body::from("created")));
        let call = || {
            let app = app.clone();
            async move {
                let req = Request::post("/orders")
                    .header("x-idempotency-key", "order-refused-record")
                    .body(Body::from("{}"))
                    .unwrap();
                let res = app.oneshot(req).await.unwrap();
                let status = res.status();
                let flag = |name: &str| res.headers().contains_key(name);
                let (replayed, omitted) =
                    (flag("idempotent-replayed"), flag("idempotent-body-omitted"));
                let body = res.into_body().collect().await.map(|b| b.to_bytes()).ok();
                (status, replayed, omitted, body)
            }
        };
        let first = call().await;
        assert_eq!(
            (first.0, first.1),
            (StatusCode::CREATED, false),
            "{fault:?}: {first:?}"
        );
        tokio::time::sleep(lease * 3).await;
        let second = call().await;
        assert_eq!(
            second.0,
            StatusCode::CONFLICT,
            "{fault:?}: three leases later the claim is still in flight: {second:?}"
        );
        store.heal();
        test_support::wait::until_within(lease * 10, "the record is resent and stored", || {
            layer.stats().recorded == 1
        })
        .await;
        let third = call().await;
        assert_eq!(
            (third.0, third.1),
            (StatusCode::CREATED, true),
            "{fault:?}: {third:?}"
        );
        if fault == Fault::Full {
            assert!(
                third.2,
                "{fault:?}: resent to a full store without its body: {third:?}"
            );
        } else {
            assert_eq!(
                third.3.as_deref(),
                Some(&b"created"[..]),
                "{fault:?}: {third:?}"
            );
        }
        assert_eq!(
            executions.load(Ordering::SeqCst),
            1,
            "{fault:?}: the handler ran once"
        );
    }
}

/// The background resend of a record the store did not take is detached work, counted in
/// `max_detached` like any other: with one place, two records the store refuses are resent one at
/// a time at most; the one without a place keeps its claim in flight to the end of its lifetime
/// (never run twice before), and the other lands once the store takes it. (The resend was a bare
/// `tokio::spawn`, outside every bound.)
#[tokio::test(start_paused = true)]
async fn the_resend_of_a_record_is_counted_in_max_detached() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Complete, Fault::Fail));
    let lease = Duration::from_secs(2);
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .lease(lease)
        .max_claim_lifetime(Duration::from_secs(60))
        .max_detached(1)
        .in_flight(InFlight::Reject);
    let app = ServiceBuilder::new()
        .layer(layer.clone())
        .service(orders(&executions, || Body::from("created")));
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", key)
                .body(Body::from("{}"))
                .unwrap();
            let res = app.oneshot(req).await.unwrap();
            let replayed = res.headers().contains_key("idempotent-replayed");
            (res.status(), replayed)
        }
    };
    for key in ["order-resent-one", "order-resent-two"] {
        assert_eq!(call(key).await, (StatusCode::CREATED, false));
    }
    let stats = layer.stats();
    assert_eq!(
        (stats.detached, stats.detached_refused),
        (1, 1),
        "one resend runs, counted; the other had no place"
    );
    tokio::time::sleep(lease * 3).await;
    for key in ["order-resent-one", "order-resent-two"] {
        assert_eq!(
            call(key).await.0,
            StatusCode::CONFLICT,
            "{key}: three leases later its claim is still in flight"
        );
    }
    store.heal();
    test_support::wait::until_within(lease * 10, "the resent record lands", || {
        layer.stats().recorded == 1
    })
    .await;
    assert_eq!(layer.stats().detached, 0);
    assert_eq!(executions.load(Ordering::SeqCst), 2, "each ran once");
}

/// A waiter is charged its request head, not a flat kilobyte: with room for 16 KiB of waiters,
/// a duplicate with a small head waits (and gets the replay), and one carrying 64 KiB of headers
/// (a large cookie, a token) is refused at once (409) rather than held outside the bound.
#[tokio::test(start_paused = true)]
async fn a_waiter_is_charged_its_request_head() {
    let executions = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_waiting_bytes(16 * 1024);
    let handler = {
        let executions = executions.clone();
        Router::new().route(
            "/orders",
            post(move || {
                executions.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    (StatusCode::CREATED, "created")
                }
            }),
        )
    };
    let app = ServiceBuilder::new().layer(layer.clone()).service(handler);
    let call = |cookie: usize| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", "order-large-head")
                .header("cookie", "c".repeat(cookie))
                .body(Body::from("{}"))
                .unwrap();
            let res = app.oneshot(req).await.unwrap();
            let replayed = res.headers().contains_key("idempotent-replayed");
            (res.status(), replayed)
        }
    };
    let leader = tokio::spawn(call(10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let small = tokio::spawn(call(10));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let held = layer.stats().waiting_bytes;
    assert!(
        held > 0 && held < 4 * 1024,
        "a small waiter holds {held} bytes"
    );
    assert_eq!(
        call(64 * 1024).await,
        (StatusCode::CONFLICT, false),
        "a waiter with 64 KiB of headers does not fit in 16 KiB"
    );
    assert_eq!(leader.await.unwrap(), (StatusCode::CREATED, false));
    assert_eq!(small.await.unwrap(), (StatusCode::CREATED, true));
    assert_eq!(layer.stats().waiting_bytes, 0);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// With `fail_open`, a duplicate whose `begin` fails while a leader of the same process holds
/// its scope is refused (503), not run unprotected beside it: the layer knows a write for that
/// key is in flight. (It ran the handler a second time.) A write on another key still fails
/// open.
#[tokio::test(start_paused = true)]
async fn fail_open_never_runs_beside_a_leader_of_the_same_process() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .fail_open(true);
    let handler = {
        let executions = executions.clone();
        Router::new().route(
            "/orders",
            post(move || {
                executions.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    (StatusCode::CREATED, "created")
                }
            }),
        )
    };
    let app = ServiceBuilder::new().layer(layer.clone()).service(handler);
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", key)
                .body(Body::from("{}"))
                .unwrap();
            app.oneshot(req).await.unwrap().status()
        }
    };
    let leader = tokio::spawn(call("order-fail-open-held"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.inject(Rule::new(Op::Begin, Fault::Fail));
    assert_eq!(
        call("order-fail-open-held").await,
        StatusCode::SERVICE_UNAVAILABLE,
        "the duplicate is refused, not run beside its leader"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(
        call("order-fail-open-other").await,
        StatusCode::CREATED,
        "another key fails open"
    );
    assert_eq!(leader.await.unwrap(), StatusCode::CREATED);
    assert_eq!(executions.load(Ordering::SeqCst), 2, "each key ran once");
}

/// With `fail_open`, a duplicate whose `begin` fails while another `begin` of the same scope
/// in the same process is still unanswered is refused (503), not run unprotected: that begin
/// may have been granted (it was: the store took the claim and answered late), and its leader
/// would run beside it. (It ran the handler a second time: simulator seed 1102119, where two
/// attempts of one key reached one server in the same tick, one `begin` granted, the other's
/// failing.)
#[tokio::test(start_paused = true)]
async fn fail_open_never_runs_beside_a_begin_of_the_same_process_in_flight() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .fail_open(true);
    let handler = {
        let executions = executions.clone();
        Router::new().route(
            "/orders",
            post(move || {
                executions.fetch_add(1, Ordering::SeqCst);
                async move { (StatusCode::CREATED, "created") }
            }),
        )
    };
    let app = ServiceBuilder::new().layer(layer.clone()).service(handler);
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", key)
                .body(Body::from("{}"))
                .unwrap();
            app.oneshot(req).await.unwrap().status()
        }
    };
    // The first `begin` is taken by the store at once and answered 300 ms later.
    store.inject(Rule::new(Op::Begin, Fault::DelayReply(Duration::from_millis(300))).times(1));
    let leader = tokio::spawn(call("order-fail-open-asking"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.inject(Rule::new(Op::Begin, Fault::Fail));
    assert_eq!(
        call("order-fail-open-asking").await,
        StatusCode::SERVICE_UNAVAILABLE,
        "the duplicate is refused, not run beside the begin in flight"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 0);
    assert_eq!(leader.await.unwrap(), StatusCode::CREATED);
    assert_eq!(executions.load(Ordering::SeqCst), 1, "the key ran once");
    assert_eq!(
        call("order-fail-open-other").await,
        StatusCode::CREATED,
        "another key fails open"
    );
}

/// An outcome that is not recorded (a 503, a handler error, a panic) is answered at once; the
/// claim is released after, in the background. The store being slow (or gone) does not hold the
/// answer.
#[tokio::test(start_paused = true)]
async fn a_failure_is_answered_before_its_claim_is_released() {
    // The store's `release` never answers (it went away mid-request).
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Release, Fault::Hang));
    let layer =
        IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("t"));
    let svc = layer.layer(service_fn(
        |req: Request<RequestBody<Full<Bytes>>>| async move {
            match req.uri().path() {
                "/unavailable" => Ok(Response::builder()
                    .status(StatusCode::SERVICE_UNAVAILABLE)
                    .body(Full::new(Bytes::from_static(b"try later")))
                    .unwrap()),
                "/error" => Err(std::io::Error::other("the handler failed")),
                _ => panic!("the handler panicked (expected by the test)"),
            }
        },
    ));
    for path in ["/unavailable", "/error", "/panic"] {
        let req = Request::post(path)
            .header("x-idempotency-key", "order-slow-release")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(1), svc.clone().oneshot(req))
            .await
            .unwrap_or_else(|_| panic!("{path}: the answer waited for the release"));
        match path {
            "/unavailable" => assert_eq!(answer.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE),
            "/error" => assert!(answer.is_err()),
            _ => assert_eq!(answer.unwrap().status(), StatusCode::INTERNAL_SERVER_ERROR),
        }
    }
    // The releases the store never answers end at their bound (tried through one lease, each try
    // bounded by one lease) and give back their places among the detached work: they held them
    // for ever, and past `max_detached` of them no claim of this layer was released again.
    assert!(layer.stats().detached > 0, "the releases are under way");
    test_support::wait::until_within(Duration::from_secs(3 * 30), "the hung releases end", || {
        layer.stats().detached == 0
    })
    .await;
    assert!(
        store.calls(Op::Release).made >= 3,
        "each claim's release was sent"
    );
}

// ---------------------------------------------------------------------------------------------
// Item: settings at their extremes.

type Answer = Pin<Box<dyn Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send>>;

/// A service that answers 201 with a body naming its execution.
fn counting(
    executions: &Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = Answer,
> + Clone {
    let executions = executions.clone();
    service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
        Box::pin(async move {
            Ok(Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from(format!("order {n}"))))
                .unwrap())
        }) as Answer
    })
}

/// Every duration setting at `Duration::MAX` ("keep forever") and at zero, every count at its
/// extremes: no panic, no overflow, and answers that follow from the setting.
#[tokio::test(start_paused = true)]
async fn settings_at_their_extremes_never_panic() {
    let req = |key: &str| {
        Request::post("/orders")
            .header("x-idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let forever = Duration::MAX;
    let huge = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .ttl(forever)
        .lease(forever)
        .max_wait(forever)
        .max_claim_lifetime(forever)
        .request_body_timeout(forever)
        .max_waiters(usize::MAX)
        .max_detached(usize::MAX)
        .max_request_bytes(usize::MAX)
        .max_record_bytes(usize::MAX);
    let executions = Arc::new(AtomicUsize::new(0));
    let svc = huge.layer(counting(&executions));
    for _ in 0..2 {
        let res = svc.clone().oneshot(req("order-extreme-1")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
    }
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1,
        "kept forever: replayed"
    );
    tokio::time::sleep(Duration::from_secs(365 * 24 * 3600)).await;
    let res = svc.clone().oneshot(req("order-extreme-1")).await.unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "true", "a year later");

    let zero = Duration::ZERO;
    let tiny = IdempotencyLayer::default()
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .ttl(zero)
        .lease(zero)
        .max_wait(zero)
        .max_claim_lifetime(zero)
        .request_body_timeout(zero)
        .max_waiters(0)
        .max_detached(0)
        .max_record_bytes(0);
    let executions = Arc::new(AtomicUsize::new(0));
    let svc = tiny.layer(counting(&executions));
    for _ in 0..2 {
        // A body at hand is read without waiting; a TTL of zero keeps nothing.
        let res = svc.clone().oneshot(req("order-extreme-2")).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
    }
    assert_eq!(
        executions.load(Ordering::SeqCst),
        2,
        "a TTL of zero keeps nothing"
    );
    let too_large = tiny
        .clone()
        .max_request_bytes(0)
        .layer(counting(&executions))
        .oneshot(req("order-extreme-3"))
        .await
        .unwrap();
    assert_eq!(too_large.status(), StatusCode::PAYLOAD_TOO_LARGE);

    // The store itself, called directly with the extremes.
    let store = MemoryStore::new();
    let scope = ScopeKey([9; 32]);
    let Begin::New(token) = store
        .begin(scope, Fingerprint([1; 32]), forever)
        .await
        .unwrap()
    else {
        panic!("a new claim");
    };
    store.renew(scope, token, forever).await.unwrap();
    let record = Record::new(
        Fingerprint([1; 32]),
        StatusCode::CREATED,
        http::HeaderMap::new(),
        Bytes::new(),
    );
    store
        .complete(scope, token, Arc::new(record), forever)
        .await
        .unwrap();
    assert!(matches!(
        store.begin(scope, Fingerprint([1; 32]), forever).await,
        Ok(Begin::Completed(_))
    ));
}

/// The in-flight gauge: the claims the layer holds now, over the
/// wire; duplicates waiting are not counted, and it returns to zero when the writes end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_flight_gauge_counts_the_claims_held() {
    for transport in Transport::BOTH {
        let (router, gate) = crate::support::gated_orders(|| (StatusCode::CREATED, "created"));
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"));
        let addr = serve(router.layer(layer.clone())).await;
        let c = client::<Full<Bytes>>(transport);
        let calls: Vec<_> = ["order-gauge-01", "order-gauge-02", "order-gauge-01"]
            .into_iter()
            .map(|key| tokio::spawn(send_owned(c.clone(), keyed(addr, "/orders", key))))
            .collect();
        until("two leaders and a waiter", || {
            let m = layer.stats();
            m.executed == 2 && m.waited == 1
        })
        .await;
        assert_eq!(
            layer.stats().in_flight,
            2,
            "{transport:?}: the waiter holds no claim"
        );
        gate.add_permits(2);
        for call in calls {
            assert_eq!(call.await.unwrap().status, StatusCode::CREATED);
        }
        assert_eq!(layer.stats().in_flight, 0, "{transport:?}");
    }
}

async fn send_owned(c: Client<HttpConnector, Full<Bytes>>, req: Request<Full<Bytes>>) -> Collected {
    send(&c, req).await
}

/// A drain for a graceful shutdown, over the wire: new writes are refused retryably at once
/// (nothing runs), the write in flight finishes and is recorded, and the drain ends when it
/// has; the replay is there for the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_refuses_new_writes_and_lets_the_ones_in_flight_finish() {
    for transport in Transport::BOTH {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let executions = Arc::new(AtomicUsize::new(0));
        let router = {
            let (gate, executions) = (gate.clone(), executions.clone());
            Router::new().route(
                "/orders",
                post(move || {
                    let (gate, executions) = (gate.clone(), executions.clone());
                    async move {
                        executions.fetch_add(1, Ordering::SeqCst);
                        gate.acquire().await.unwrap().forget();
                        (StatusCode::CREATED, "created")
                    }
                }),
            )
        };
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"));
        let addr = serve(router.layer(layer.clone())).await;
        let c = client::<Full<Bytes>>(transport);
        let first = tokio::spawn(send_owned(
            c.clone(),
            keyed(addr, "/orders", "order-drain-01"),
        ));
        until("the handler runs", || layer.stats().in_flight == 1).await;
        let drain = tokio::spawn({
            let layer = layer.clone();
            async move { layer.drain(Duration::from_secs(20)).await }
        });
        until("draining", || layer.is_draining()).await;
        let refused = send(&c, keyed(addr, "/orders", "order-drain-02")).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{transport:?}"
        );
        assert!(refused.headers.contains_key("retry-after"), "{transport:?}");
        assert!(!drain.is_finished(), "{transport:?}: a claim is still held");
        gate.add_permits(1);
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
        let drained = drain.await.unwrap();
        assert_eq!(drained.left, 0, "{transport:?}");
        assert_eq!(layer.stats().recorded, 1, "{transport:?}");
        assert_eq!(executions.load(Ordering::SeqCst), 1, "{transport:?}");
        assert_eq!(layer.stats().rejected(RejectReason::ShuttingDown), 1);
    }
}

/// A drain's grace is its bound: a handler that does not finish in time is left to lapse (its
/// claim no longer renewed), and the drain says how many were left.
#[tokio::test(start_paused = true)]
async fn a_drain_ends_at_its_grace() {
    let layer = IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t"));
    let svc = layer.layer(service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let req = Request::post("/orders")
        .header("x-idempotency-key", "order-drain-hung")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let hung = tokio::spawn(svc.oneshot(req));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(layer.stats().in_flight, 1);
    let started = tokio::time::Instant::now();
    let drained = layer.drain(Duration::from_secs(30)).await;
    assert_eq!(drained.left, 1);
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    hung.abort();
}

/// The store refuses every `complete` for longer than a lease (its renewals still work): the
/// write has run, so its claim must not lapse. The leader's answer waits one lease, then the
/// record is resent in the background while the renewal keeps the claim; a duplicate waits for
/// it and gets the replay once the store takes it. Nothing runs twice.
#[tokio::test(start_paused = true)]
async fn a_record_the_store_refuses_for_longer_than_a_lease_lands_later_and_nothing_runs_twice() {
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Complete, Fault::Fail));
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .lease(Duration::from_millis(500));
    let executions = Arc::new(AtomicUsize::new(0));
    let svc = layer.layer(counting(&executions));
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "order-complete-outage")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let first = tokio::time::timeout(Duration::from_secs(5), svc.clone().oneshot(req()))
        .await
        .expect("the leader answers after one lease of retries")
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // Well past the lease: a duplicate finds the claim still held, and waits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let duplicate = tokio::spawn(svc.clone().oneshot(req()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.heal();
    let replay = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("the duplicate answered once the record landed")
        .unwrap()
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(
        replay
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1, "the write ran once");
}

/// A duplicate waits while its leader runs; the leader's client goes away and the leader is
/// cancelled (`OnDisconnect::Release`: nothing ran, nothing is shared), so the duplicate will
/// lead: but the service has stopped being ready. The duplicate readies it before it claims the
/// key, within its own bound (`max_wait`), and answers a retryable "in flight" when that
/// passes: it never holds a claim while it waits for capacity, and never waits without a bound.
/// (Before: it claimed the key, then waited for readiness forever.)
#[tokio::test(start_paused = true)]
async fn a_waiter_that_would_lead_readies_the_service_within_its_bound_before_claiming() {
    use std::sync::atomic::AtomicBool;
    use std::task::{Context, Poll};

    #[derive(Clone)]
    struct Gated {
        ready: Arc<AtomicBool>,
        calls: Arc<AtomicUsize>,
    }
    impl tower::Service<Request<RequestBody<Full<Bytes>>>> for Gated {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = Answer;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if self.ready.load(Ordering::SeqCst) {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }
        fn call(&mut self, _req: Request<RequestBody<Full<Bytes>>>) -> Answer {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Full::new(Bytes::new()))
                    .unwrap())
            })
        }
    }
    let store = FaultStore::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .on_disconnect(OnDisconnect::Release)
        .max_wait(Duration::from_secs(2));
    let gated = Gated {
        ready: Arc::new(AtomicBool::new(true)),
        calls: Arc::default(),
    };
    let svc = layer.layer(gated.clone());
    let req = || {
        Request::post("/orders")
            .header("x-idempotency-key", "order-waiter-not-ready")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let leader = tokio::spawn(svc.clone().oneshot(req()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiter = tokio::spawn(svc.clone().oneshot(req()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The service stops being ready, and the leader's client goes away.
    gated.ready.store(false, Ordering::SeqCst);
    leader.abort();
    let started = tokio::time::Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter answers within its bound")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() <= Duration::from_secs(2));
    assert!(
        answer.status() == StatusCode::CONFLICT
            || answer.status() == StatusCode::SERVICE_UNAVAILABLE,
        "a retryable in-flight answer, got {}",
        answer.status()
    );
    assert_eq!(gated.calls.load(Ordering::SeqCst), 1, "nothing else ran");
    // The waiter never asked the store again, so it never claimed the key: the leader's
    // claim and the waiter's first ask are the only begins.
    assert_eq!(store.calls(Op::Begin).made, 2);
}

/// A write refused before anything runs (no key, a malformed key, no tenant) lets go of the
/// capacity its `poll_ready` reserved: with a `ConcurrencyLimit` of 1 under the layer, another
/// holder of the limit gets the permit at once, while the layer's service lives on (as a
/// Buffer's worker keeps it). (Before: the readied service kept the permit until its next
/// request.)
#[tokio::test(start_paused = true)]
async fn an_early_rejection_lets_go_of_the_capacity_readiness_reserved() {
    let executions = Arc::new(AtomicUsize::new(0));
    let limit = tower::limit::ConcurrencyLimit::new(counting(&executions), 1);
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::required());
    let mut svc = layer.layer(limit.clone());
    for (key, what) in [
        (None, "no key"),
        (Some("bad"), "a malformed key"),
        (Some("order-no-tenant"), "no tenant"),
    ] {
        let mut req = Request::post("/orders");
        if let Some(key) = key {
            req = req.header("x-idempotency-key", key);
        }
        let req = req.body(Full::new(Bytes::new())).unwrap();
        let answer = tower::Service::call(svc.ready().await.unwrap(), req)
            .await
            .unwrap();
        assert!(
            answer.status().is_client_error(),
            "{what}: {}",
            answer.status()
        );
        let mut other = limit.clone();
        tokio::time::timeout(Duration::from_secs(1), other.ready())
            .await
            .unwrap_or_else(|_| panic!("{what}: the refused write kept the permit"))
            .unwrap();
    }
    assert_eq!(executions.load(Ordering::SeqCst), 0);
}

/// A write whose request body is slow to come holds none of the capacity its `poll_ready`
/// reserved while the body comes: with a `ConcurrencyLimit` of 1 under the layer, an upload
/// stalled mid-way (HTTP/1.1: 10 bytes of the 100 announced; h2: one frame, then nothing) does
/// not keep every other write waiting for `request_body_timeout`; and once its body is whole the
/// stalled write is readied again and runs. (Before: the permit was held through the body read,
/// and the other writes waited the two minutes. Found by simulation seed 2019734.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_request_body_holds_none_of_the_capacity_readiness_reserved() {
    let executions = Arc::new(AtomicUsize::new(0));
    let arrived = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .request_body_timeout(Duration::from_secs(120));
    let svc = ServiceBuilder::new()
        .map_response(axum::response::IntoResponse::into_response)
        .map_request({
            // Called once the layer (and the limit under it) is ready: the write holds the
            // permit from here.
            let arrived = arrived.clone();
            move |req: Request<axum::body::Body>| {
                arrived.fetch_add(1, Ordering::SeqCst);
                req
            }
        })
        .layer(layer.clone())
        .concurrency_limit(1)
        .service(orders(&executions, || Body::from("created")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let make = axum::ServiceExt::<Request<Body>>::into_make_service(svc);
    tokio::spawn(async move { axum::serve(listener, make).await });

    // HTTP/1.1: 10 of the 100 bytes announced, then nothing (for now).
    let mut loris = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = "POST /orders HTTP/1.1\r\nhost: test\r\nx-idempotency-key: order-slow-h1\r\n\
                content-length: 100\r\n\r\n0123456789";
    loris.write_all(head.as_bytes()).await.unwrap();
    until("the stalled HTTP/1.1 write reached the layer", || {
        arrived.load(Ordering::SeqCst) == 1
    })
    .await;

    // h2: one frame of the body, then nothing (for now).
    let (tx, req) = stalled_upload(addr, "order-slow-h2").await;
    let h2: StreamingClient = client(Transport::Http2);
    let stalled_h2 = tokio::spawn(async move { send(&h2, req).await });
    until("the stalled h2 write reached the layer", || {
        arrived.load(Ordering::SeqCst) == 2
    })
    .await;

    // Every other write is served while both bodies stall.
    for transport in Transport::BOTH {
        let c = client::<Full<Bytes>>(transport);
        for k in 0..3 {
            let key = format!("order-beside-{transport:?}-{k}");
            let res = tokio::time::timeout(
                Duration::from_secs(10),
                send(&c, keyed(addr, "/orders", &key)),
            )
            .await
            .unwrap_or_else(|_| {
                panic!("{transport:?}: a write waited behind a stalled request body")
            });
            assert_eq!(res.status, StatusCode::CREATED, "{transport:?}: {res:?}");
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 6);

    // The stalled bodies come whole: each write is readied again and runs.
    loris.write_all(&[b'x'; 90]).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(20), loris.read(&mut answer))
        .await
        .expect("answered within 20 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    tx.send(Ok(Frame::data(Bytes::from_static(b"1}"))))
        .await
        .unwrap();
    drop(tx);
    let res = stalled_h2.await.unwrap();
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 8);
    assert_eq!(layer.stats().rejected_total(), 0);
}

/// The bound on readying the service again after a slow body, as it ships (`max_wait`, 30 s):
/// a write whose body came late while another holder took the only permit is answered 503
/// `Overloaded` with `Retry-After` 30 s after its body arrived, and nothing ran.
#[tokio::test(start_paused = true)]
async fn a_write_whose_service_stays_not_ready_after_its_body_is_503_at_max_wait() {
    let executions = Arc::new(AtomicUsize::new(0));
    let handler = {
        let executions = executions.clone();
        service_fn(move |_: Request<RequestBody<Body>>| {
            executions.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) }
        })
    };
    let limit = tower::limit::ConcurrencyLimit::new(handler, 1);
    let layer = IdempotencyLayer::default().tenant(idempotency_layer::TenantSource::fixed("t"));
    let mut svc = layer.layer(limit.clone());
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(1);
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|f| (f, rx))
    }));
    let req = Request::post("/orders")
        .header("x-idempotency-key", "order-no-capacity")
        .body(body)
        .unwrap();
    let write = tokio::spawn(tower::Service::call(svc.ready().await.unwrap(), req));
    // While the body does not come, the write holds no permit: another holder takes it.
    let mut other = limit.clone();
    tokio::time::timeout(Duration::from_secs(1), other.ready())
        .await
        .expect("the write waiting for its body gave its permit back")
        .unwrap();
    tx.send(Ok(Bytes::from_static(b"{}"))).await.unwrap();
    drop(tx);
    let body_done = tokio::time::Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(3600), write)
        .await
        .expect("answered")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().contains_key("retry-after"));
    assert_eq!(body_done.elapsed(), Duration::from_secs(30));
    assert_eq!(executions.load(Ordering::SeqCst), 0, "nothing ran");
    assert_eq!(layer.stats().rejected(RejectReason::Overloaded), 1);
    drop(other);
}

/// A failure the table does not record (a 503, a response that breaks off, a handler error)
/// frees its key for the client's retry even when no place for detached work is free
/// (`max_detached(0)`): the release is made before the answer goes out, since its client still
/// waits, instead of being dropped and the claim left to lapse with its lease (every retry of
/// the key waiting for it, and the store's room taken meanwhile: with a small store and a
/// downstream tier, simulation seed 2024846 never quiesced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_frees_its_key_even_with_no_room_for_detached_work() {
    let executions = Arc::new(AtomicUsize::new(0));
    let router = {
        let executions = executions.clone();
        Router::new().route(
            "/orders",
            post(move || {
                // The first execution of each key fails (not recorded); the retry succeeds.
                let n = executions.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n.is_multiple_of(2) {
                        (StatusCode::SERVICE_UNAVAILABLE, "try again")
                    } else {
                        (StatusCode::CREATED, "created")
                    }
                }
            }),
        )
    };
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_detached(0);
    let addr = serve(router.layer(layer.clone())).await;
    for transport in Transport::BOTH {
        let c = client::<Full<Bytes>>(transport);
        let key = format!("order-no-detached-{transport:?}");
        let first = send(&c, keyed(addr, "/orders", &key)).await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
        // The retry runs at once: the key is not held by a claim left to lapse (30 s).
        let retry = tokio::time::timeout(
            Duration::from_secs(10),
            send(&c, keyed(addr, "/orders", &key)),
        )
        .await
        .unwrap_or_else(|_| panic!("{transport:?}: the retry waited for the failed claim"));
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{transport:?}: {retry:?}"
        );
    }
    assert_eq!(executions.load(Ordering::SeqCst), 4);
    let m = layer.stats();
    assert_eq!(m.released, 2, "both failures released their claim");
    assert_eq!(
        m.detached_refused, 0,
        "no work was refused: the releases ran in place"
    );
}

/// Four leaders stream 2 MiB bodies to clients that never read them. Each response may hold
/// its first 64 KiB; beyond that the layer holds at most `max_response_buffer_bytes` for all of
/// them together, and the handlers' bodies are read no further (flow control), instead of up to
/// `max_record_bytes` each.
#[tokio::test(start_paused = true)]
async fn response_bytes_held_for_clients_that_do_not_read_have_a_layer_wide_bound() {
    const FRAME: usize = 16 * 1024;
    let produced = Arc::new(AtomicUsize::new(0));
    let handler = {
        let produced = produced.clone();
        service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
            let produced = produced.clone();
            async move {
                let frames = futures_util::stream::unfold(0usize, move |sent| {
                    let produced = produced.clone();
                    async move {
                        if sent >= 2 << 20 {
                            return None;
                        }
                        produced.fetch_add(FRAME, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        Some((
                            Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b'x'; FRAME]))),
                            sent + FRAME,
                        ))
                    }
                });
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .body(StreamBody::new(frames))
                        .unwrap(),
                )
            }
        })
    };
    let budget = 256 * 1024;
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .max_record_bytes(4 << 20)
        .max_response_buffer_bytes(budget);
    let svc = layer.layer(handler);
    let mut held = Vec::new();
    for i in 0..4 {
        let req = Request::post("/orders")
            .header("x-idempotency-key", format!("order-unread-{i}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        // The response is kept, its body never polled: a client that does not read.
        held.push(svc.clone().oneshot(req).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let per_response = 64 * 1024;
    let bound = 4 * (per_response + FRAME) + budget + 4 * FRAME;
    assert!(
        produced.load(Ordering::SeqCst) <= bound,
        "the handlers' bodies were read {} bytes ahead of clients that do not read (bound {bound})",
        produced.load(Ordering::SeqCst)
    );
    let m = layer.stats();
    assert!(
        m.response_buffer_bytes as usize <= budget + 4 * FRAME,
        "held {} bytes beyond the first 64 KiB of each",
        m.response_buffer_bytes
    );
    assert!(m.response_buffer_bytes > 0, "the budget was used");
    drop(held);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        layer.stats().response_buffer_bytes,
        0,
        "given back when the clients left"
    );
}

/// A duplicate that waited on another instance's write, woken after its own layer began to
/// drain, does not become a leader there: when that write fails unrecorded (503) and its claim
/// is released, the woken waiter is refused (503, shutting down) and nothing runs on the
/// draining instance, whose drain had already ended. (It took the released claim and ran the
/// handler, which a drain that reported no claim left does not wait for.)
#[tokio::test(start_paused = true)]
async fn a_waiter_woken_after_its_drain_began_does_not_lead() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = MemoryStore::new();
    let instance = |status: StatusCode| {
        let executions = executions.clone();
        let handler = Router::new().route(
            "/orders",
            post(move || {
                executions.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    (status, "answer")
                }
            }),
        );
        let layer = IdempotencyLayer::new(store.clone())
            .tenant(idempotency_layer::TenantSource::fixed("t"));
        (
            layer.clone(),
            ServiceBuilder::new().layer(layer).service(handler),
        )
    };
    let (_, first) = instance(StatusCode::SERVICE_UNAVAILABLE);
    let (draining, second) = instance(StatusCode::CREATED);
    let send = |app: tower::util::BoxCloneService<
        Request<Body>,
        Response<idempotency_layer::IdempotencyBody<Body>>,
        Infallible,
    >| async move {
        let req = Request::post("/orders")
            .header("x-idempotency-key", "order-drain-waiter")
            .body(Body::from("{}"))
            .unwrap();
        app.oneshot(req).await.unwrap().status()
    };
    let leader = tokio::spawn(send(tower::util::BoxCloneService::new(first)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiter = tokio::spawn(send(tower::util::BoxCloneService::new(second)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let drained = draining.drain(Duration::from_secs(30)).await;
    assert_eq!(drained.left, 0, "the draining instance holds no claim");
    assert_eq!(leader.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        waiter.await.unwrap(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the woken waiter is refused on the draining instance"
    );
    assert_eq!(
        executions.load(Ordering::SeqCst),
        1,
        "nothing ran on the draining instance"
    );
    assert_eq!(draining.stats().in_flight, 0);
}

/// A record the store does not take while its client goes away, with no place for detached
/// work (`max_detached(0)`): the record's store operation is dropped, but the claim is not let
/// lapse at its next lease under a write that ran: it stays renewed to the end of its lifetime,
/// and a duplicate finds it in flight. (The dropped operation took the claim's renewal with it,
/// the lease lapsed, and the duplicate ran the write again.)
#[tokio::test(start_paused = true)]
async fn a_record_dropped_for_want_of_detached_room_keeps_its_claim_in_flight() {
    let executions = Arc::new(AtomicUsize::new(0));
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Complete, Fault::Fail));
    let lease = Duration::from_secs(2);
    let layer = IdempotencyLayer::new(store.clone())
        .tenant(idempotency_layer::TenantSource::fixed("t"))
        .lease(lease)
        .max_claim_lifetime(Duration::from_secs(60))
        .max_detached(0)
        .in_flight(InFlight::Reject);
    let app = ServiceBuilder::new()
        .layer(layer.clone())
        .service(orders(&executions, || Body::from("created")));
    let call = || {
        let app = app.clone();
        async move {
            let req = Request::post("/orders")
                .header("x-idempotency-key", "order-dropped-record")
                .body(Body::from("{}"))
                .unwrap();
            app.oneshot(req).await.unwrap().status()
        }
    };
    // The client gives up while the record is being retried through the outage.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), call())
            .await
            .is_err(),
        "the answer waits for the record"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    tokio::time::sleep(lease * 3).await;
    assert_eq!(
        call().await,
        StatusCode::CONFLICT,
        "three leases later the claim is still in flight"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1, "nothing ran again");
    // Still held, and counted so: a drain does not report it gone (the process would exit
    // under a write that ran and has no record).
    assert_eq!(layer.stats().in_flight, 1);
    let drained = layer.drain(Duration::from_secs(1)).await;
    assert_eq!(drained.left, 1, "the drain says what it leaves");
}

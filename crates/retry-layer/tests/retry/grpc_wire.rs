//! gRPC over a tonic `Channel` to a hyper h2 server of the test's own; and h2 faults
//! (RST_STREAM REFUSED_STREAM, GOAWAY) from servers made with the `h2` crate and by hand.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use reason_code::parse_grpc_timeout;
use retry_layer::budget::Budget;
use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Duration;
use tower::{ServiceBuilder, ServiceExt};

use crate::wire::*;

/// One planned answer of the gRPC server.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// A trailers-only response with this `grpc-status`.
    TrailersOnly(&'static str),
    /// An HTTP error status without `grpc-status` (a proxy answered).
    Http(u16),
    /// Headers without `grpc-status` (committed), with this reason code, then a message and
    /// trailers with `grpc-status: 14`.
    Committed(&'static str),
}

type ResBody =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

async fn grpc_server(plan: Vec<Answer>) -> (SocketAddr, Arc<Mutex<Vec<HeaderMap>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hits = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (s, plan, hits) = (s.clone(), plan.clone(), hits.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let n = hits.fetch_add(1, Ordering::SeqCst);
                    s.lock().unwrap().push(req.headers().clone());
                    let answer = plan[n.min(plan.len() - 1)];
                    async move {
                        let _ = req.into_body().collect().await;
                        let empty = || StreamBody::new(futures_util::stream::iter(vec![]));
                        let res = match answer {
                            Answer::TrailersOnly(code) => Response::builder()
                                .header("content-type", "application/grpc")
                                .header("grpc-status", code)
                                .body(empty()),
                            Answer::Http(status) => Response::builder()
                                .status(StatusCode::from_u16(status).unwrap())
                                .header("content-type", "text/plain")
                                .body(empty()),
                            Answer::Committed(reason) => {
                                let mut trailers = HeaderMap::new();
                                trailers.insert("grpc-status", "14".parse().unwrap());
                                let frames = vec![
                                    Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0"))),
                                    Ok(Frame::trailers(trailers)),
                                ];
                                Response::builder()
                                    .header("content-type", "application/grpc")
                                    .header("x-reason-code", reason)
                                    .body(StreamBody::new(futures_util::stream::iter(frames)))
                            }
                        };
                        Ok::<Response<ResBody>, Infallible>(res.unwrap())
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

fn grpc_request(addr: SocketAddr, path: &str) -> Request<tonic::body::Body> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(Full::new(Bytes::from_static(
            b"\0\0\0\0\x02\x0a\x00",
        ))))
        .unwrap()
}

async fn call_with(
    layer: &RetryLayer,
    addr: SocketAddr,
    req: Request<tonic::body::Body>,
) -> Result<Response<tonic::body::Body>, reason_code::BoxError> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .map_request(|req: Request<ReplayBody<tonic::body::Body>>| req.map(tonic::body::Body::new))
        .service(channel);
    bounded("the call", svc.oneshot(req)).await
}

fn declared() -> RetryPolicy {
    RetryPolicy::builder()
        .idempotent_grpc_methods(
            retry_layer::GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"]).unwrap(),
        )
        .build()
        .unwrap()
}

const GET_BOOK: &str = "/plume.linkd.v3.Library/GetBook";
const CREATE_ORDER: &str = "/plume.linkd.v3.Library/CreateOrder";

/// An HTTP 429 without `grpc-status` is UNAVAILABLE for gRPC (not RESOURCE_EXHAUSTED,
/// which is retried for any request): a write that is not declared idempotent is not retried.
#[tokio::test]
async fn http_429_on_grpc_is_unavailable_so_a_write_is_not_retried() {
    let (addr, seen) = grpc_server(vec![Answer::Http(429), Answer::TrailersOnly("0")]).await;
    let res = call_with(
        &RetryLayer::new(declared()),
        addr,
        grpc_request(addr, CREATE_ORDER),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 429);
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// Over a tonic `Channel`, the caller's say holds for a declared read: a `retry_if` that
/// declines it and `NoRetry` on the request each leave one attempt and its UNAVAILABLE; the same
/// read without either is retried.
#[tokio::test]
async fn a_declined_or_opted_out_grpc_read_is_sent_once() {
    let unavailable = Answer::TrailersOnly("14");
    let (addr, seen) = grpc_server(vec![
        unavailable,
        unavailable,
        unavailable,
        Answer::TrailersOnly("0"),
    ])
    .await;
    let grpc_status = |res: &Response<tonic::body::Body>| {
        res.headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let declining = RetryLayer::new(
        declared()
            .to_builder()
            .retry_if(|c| c.request.uri.path() != GET_BOOK)
            .build()
            .unwrap(),
    );
    let res = call_with(&declining, addr, grpc_request(addr, GET_BOOK))
        .await
        .unwrap();
    assert_eq!(
        grpc_status(&res).as_deref(),
        Some("14"),
        "the declined read"
    );
    assert_eq!(declining.stats().declined, 1);

    let layer = RetryLayer::new(declared());
    let mut opted_out = grpc_request(addr, GET_BOOK);
    opted_out.extensions_mut().insert(retry_layer::NoRetry);
    let res = call_with(&layer, addr, opted_out).await.unwrap();
    assert_eq!(
        grpc_status(&res).as_deref(),
        Some("14"),
        "the opted-out read"
    );
    assert_eq!(seen.lock().unwrap().len(), 2, "each sent once");

    let res = call_with(&layer, addr, grpc_request(addr, GET_BOOK))
        .await
        .unwrap();
    assert_eq!(grpc_status(&res).as_deref(), Some("0"), "retried");
    assert_eq!(seen.lock().unwrap().len(), 4);
    assert_eq!((layer.stats().declined, layer.stats().retries), (1, 1));
}

/// HTTP 502 and 504 without `grpc-status` are UNAVAILABLE: retried for a declared method.
#[tokio::test]
async fn http_502_and_504_on_grpc_are_retried_for_a_declared_method() {
    for status in [502, 504] {
        let (addr, seen) = grpc_server(vec![Answer::Http(status), Answer::TrailersOnly("0")]).await;
        let res = call_with(
            &RetryLayer::new(declared()),
            addr,
            grpc_request(addr, GET_BOOK),
        )
        .await
        .unwrap();
        assert_eq!(res.headers()["grpc-status"], "0", "{status}");
        assert_eq!(seen.lock().unwrap().len(), 2, "{status}");
    }
}

/// Counts what the layer records in its budget.
#[derive(Debug, Default)]
struct Counting {
    successes: AtomicUsize,
    failures: AtomicUsize,
}

impl Budget for Counting {
    fn deposit(&self) {}
    fn record(&self, failed: bool) {
        let c = if failed {
            &self.failures
        } else {
            &self.successes
        };
        c.fetch_add(1, Ordering::SeqCst);
    }
    fn withdraw(&self) -> bool {
        true
    }
}

/// A malformed `grpc-status` is UNKNOWN: returned, and neither an OK nor a budget
/// success (before, it was taken for absent and the response counted as OK).
#[tokio::test]
async fn a_malformed_grpc_status_is_unknown_not_a_success() {
    let (addr, seen) = grpc_server(vec![Answer::TrailersOnly("fourteen")]).await;
    let budget = Arc::new(Counting::default());
    let policy = declared()
        .to_builder()
        .budget(retry_layer::budget::RetryBudget::custom(budget.clone()))
        .build()
        .unwrap();
    let res = call_with(&RetryLayer::new(policy), addr, grpc_request(addr, GET_BOOK))
        .await
        .unwrap();
    assert_eq!(res.headers()["grpc-status"], "fourteen");
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_eq!(budget.successes.load(Ordering::SeqCst), 0, "not a success");
}

/// A committed response (headers sent without `grpc-status`) is final, even when a
/// reason-code header says UPSTREAM_UNAVAILABLE.
#[tokio::test]
async fn a_reason_code_does_not_reopen_a_committed_response() {
    let (addr, seen) = grpc_server(vec![
        Answer::Committed("UPSTREAM_UNAVAILABLE"),
        Answer::TrailersOnly("0"),
    ])
    .await;
    let res = call_with(
        &RetryLayer::new(declared()),
        addr,
        grpc_request(addr, GET_BOOK),
    )
    .await
    .unwrap();
    let collected = res.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(seen.lock().unwrap().len(), 1, "committed: never retried");
}

/// Each attempt's `grpc-timeout` is capped at `attempt_timeout`, so the server stops
/// working on an attempt the client abandons.
#[tokio::test]
async fn grpc_timeout_is_capped_at_the_attempt_timeout() {
    let (addr, seen) =
        grpc_server(vec![Answer::TrailersOnly("14"), Answer::TrailersOnly("0")]).await;
    let policy = declared()
        .to_builder()
        .attempt_timeout(Duration::from_millis(250))
        .build()
        .unwrap();
    let mut req = grpc_request(addr, GET_BOOK);
    req.headers_mut()
        .insert("grpc-timeout", "10S".parse().unwrap());
    call_with(&RetryLayer::new(policy), addr, req)
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    for h in seen.iter() {
        let t = parse_grpc_timeout(&h["grpc-timeout"]).unwrap();
        assert!(t <= Duration::from_millis(250), "{t:?}");
    }
}

/// A real service config (methodConfig[] with name[]) chooses each call's policy by
/// its gRPC path.
#[tokio::test]
async fn a_service_config_chooses_the_policy_by_method() {
    let config = r#"{
        "methodConfig": [{
            "name": [{"service": "plume.linkd.v3.Library", "method": "GetBook"}],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.001s",
                "maxBackoff": "0.01s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]
            }
        }, {
            "name": [{"service": "plume.linkd.v3.Library", "method": "ListBooks"}],
            "timeout": "1s"
        }],
        "retryThrottling": {"maxTokens": 100, "tokenRatio": 0.1}
    }"#;
    let policy = RetryPolicy::from_grpc_service_config(config)
        .unwrap()
        .to_builder()
        .idempotent_grpc_methods(
            retry_layer::GrpcMethods::new(["/plume.linkd.v3.Library/"]).unwrap(),
        )
        .build()
        .unwrap();
    let layer = RetryLayer::new(policy);
    for (path, attempts) in [
        (GET_BOOK, 4),
        ("/plume.linkd.v3.Library/ListBooks", 1),
        ("/plume.linkd.v3.Library/Other", 1),
    ] {
        let (addr, seen) = grpc_server(vec![Answer::TrailersOnly("14")]).await;
        let res = call_with(&layer, addr, grpc_request(addr, path))
            .await
            .unwrap();
        assert_eq!(res.headers()["grpc-status"], "14");
        assert_eq!(seen.lock().unwrap().len(), attempts, "{path}");
    }
}

/// An h2 server (the `h2` crate) that refuses the first `refuse` streams with RST_STREAM
/// REFUSED_STREAM, then reads each request whole (trailers too) and answers 201.
async fn refusing_server(
    refuse: usize,
) -> (SocketAddr, Arc<Mutex<Vec<(Bytes, Option<HeaderMap>)>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let streams = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (s, streams) = (s.clone(), streams.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    if streams.fetch_add(1, Ordering::SeqCst) < refuse {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let s = s.clone();
                    tokio::spawn(async move {
                        let mut body = req.into_body();
                        let mut data = Vec::new();
                        while let Some(chunk) = body.data().await {
                            let Ok(chunk) = chunk else { return };
                            let _ = body.flow_control().release_capacity(chunk.len());
                            data.extend_from_slice(&chunk);
                        }
                        let trailers = body.trailers().await.ok().flatten();
                        s.lock().unwrap().push((Bytes::from(data), trailers));
                        let res = Response::builder().status(201).body(()).unwrap();
                        let _ = respond.send_response(res, true);
                    });
                }
            });
        }
    });
    (addr, seen)
}

/// RST_STREAM REFUSED_STREAM: the server did not process the stream, so a POST without a key
/// is retried, and its streaming body (with trailers) reaches the server whole.
#[tokio::test]
async fn refused_stream_retries_a_post_and_replays_its_body() {
    let (addr, seen) = refusing_server(1).await;
    let layer = RetryLayer::new(RetryPolicy::default());
    let req = streaming_request(
        http::Method::POST,
        format!("http://{addr}/orders"),
        &["{\"qty\":", "1}"],
    );
    let res = bounded("the call", client(&layer, Transport::Http2).oneshot(req))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, "{\"qty\":1}");
    assert_eq!(seen[0].1, Some(checksum_trailers()));
    assert_eq!(layer.stats().attempts, 2);
}

/// A hand-made h2 server whose first connection answers the first request's HEADERS with GOAWAY
/// (last-stream-id 0, NO_ERROR): the stream is beyond it, so the server promises it did not
/// process it. Later connections are served by the `h2` crate.
async fn goaway_server() -> (SocketAddr, Arc<Mutex<Vec<(Bytes, Option<HeaderMap>)>>>) {
    goaway_server_with(0, 0).await
}

/// [`goaway_server`] with the GOAWAY's last-stream-id and error code.
async fn goaway_server_with(
    last_stream_id: u32,
    code: u32,
) -> (SocketAddr, Arc<Mutex<Vec<(Bytes, Option<HeaderMap>)>>>) {
    let (upstream, seen) = refusing_server(0).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            if !std::mem::take(&mut first) {
                // Relay later connections to the real server.
                tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut stream, &mut up).await;
                    }
                });
                continue;
            }
            tokio::spawn(async move {
                let mut preface = [0u8; 24];
                if stream.read_exact(&mut preface).await.is_err() {
                    return;
                }
                // Our SETTINGS (empty).
                let _ = stream.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
                loop {
                    let mut head = [0u8; 9];
                    if stream.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let len = (usize::from(head[0]) << 16)
                        | (usize::from(head[1]) << 8)
                        | usize::from(head[2]);
                    let mut payload = vec![0u8; len];
                    if stream.read_exact(&mut payload).await.is_err() {
                        return;
                    }
                    match head[3] {
                        // SETTINGS without ACK: acknowledge.
                        4 if head[4] & 1 == 0 => {
                            let _ = stream.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await;
                        }
                        // HEADERS: the request was sent. GOAWAY with the planned
                        // last-stream-id and code.
                        1 => {
                            let mut goaway = vec![0, 0, 8, 7, 0, 0, 0, 0, 0];
                            goaway.extend_from_slice(&last_stream_id.to_be_bytes());
                            goaway.extend_from_slice(&code.to_be_bytes());
                            let _ = stream.write_all(&goaway).await;
                            let _ = stream.flush().await;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            return;
                        }
                        _ => {}
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// GOAWAY beyond the request's stream: unsent, so a POST without a key is retried on a new
/// connection, body and trailers intact.
#[tokio::test]
async fn goaway_beyond_the_stream_retries_a_post() {
    let (addr, seen) = goaway_server().await;
    let layer = RetryLayer::new(RetryPolicy::default());
    let req = streaming_request(
        http::Method::POST,
        format!("http://{addr}/orders"),
        &["{\"qty\":", "2}"],
    );
    let res = bounded("the call", client(&layer, Transport::Http2).oneshot(req))
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, "{\"qty\":2}");
    assert_eq!(seen[0].1, Some(checksum_trailers()));
}

/// A GOAWAY with an error code (here ENHANCE_YOUR_CALM, and PROTOCOL_ERROR)
/// still promises that streams past its last-stream-id were not processed: unsent, so a POST
/// without a key is retried on a new connection. Before, only NO_ERROR counted, and this POST
/// was returned as an error (ambiguous).
#[tokio::test]
async fn goaway_with_an_error_code_beyond_the_stream_retries_a_post() {
    for code in [0xb, 0x1] {
        let (addr, seen) = goaway_server_with(0, code).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let req = streaming_request(
            http::Method::POST,
            format!("http://{addr}/orders"),
            &["{\"qty\":", "2}"],
        );
        let res = bounded("the call", client(&layer, Transport::Http2).oneshot(req))
            .await
            .unwrap_or_else(|e| panic!("code {code:#x}: {e}"));
        assert_eq!(res.status(), 201, "code {code:#x}");
        assert_eq!(seen.lock().unwrap().len(), 1, "code {code:#x}");
    }
}

/// The stream a GOAWAY covers (last-stream-id 1, the request's) may have been
/// processed, whatever the code: a POST without a key is not retried.
#[tokio::test]
async fn goaway_covering_the_stream_is_ambiguous_whatever_its_code() {
    for code in [0x0, 0xb] {
        let (addr, seen) = goaway_server_with(1, code).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let req = streaming_request(
            http::Method::POST,
            format!("http://{addr}/orders"),
            &["{\"qty\":", "2}"],
        );
        let err = bounded("the call", client(&layer, Transport::Http2).oneshot(req))
            .await
            .expect_err("the stream may have run: not retried");
        let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
        assert_eq!(err.attempts(), 1, "code {code:#x}: {err}");
        assert_eq!(seen.lock().unwrap().len(), 0, "code {code:#x}");
    }
}

/// What a tonic client sees of the layer's failures through `RetryChannel`:
/// a classified `tonic::Status` (DEADLINE_EXCEEDED, UNAVAILABLE), never `Unknown`, which every
/// tier above would take as final; the `RetryError` is its source.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn tonic_callers_get_classified_statuses() {
    use retry_layer::tonic::retry_error;

    // A server that reads each request and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>().await
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let layer = RetryLayer::new(declared());
    let mut req = grpc_request(addr, GET_BOOK);
    req.extensions_mut()
        .insert(retry_layer::Deadline::after(Duration::from_millis(200)));
    let err = bounded("the call", layer.tonic_channel(channel).oneshot(req))
        .await
        .unwrap_err();
    // What tonic's generated clients do with a transport error.
    let status = tonic::Status::from_error(err);
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let retry = retry_error(&status).expect("the RetryError is the source");
    // The channel ends the call at the grpc-timeout the layer wrote, or the layer at its
    // deadline: a timeout either way.
    assert!(
        retry.is::<retry_layer::DeadlineExceeded>()
            || std::iter::successors(
                Some(retry.inner() as &(dyn std::error::Error + 'static)),
                |e| e.source()
            )
            .any(|e| e.is::<tonic::TimeoutExpired>()),
        "{retry}"
    );
    assert_eq!(retry.attempts(), 1);

    // A connection reset after the request was sent: UNAVAILABLE (it may have run; a caller
    // that retries it keeps the key).
    let (addr, _) = goaway_server_with(1, 0).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let err = bounded(
        "the call",
        RetryLayer::new(RetryPolicy::default())
            .tonic_channel(channel)
            .oneshot(grpc_request(addr, CREATE_ORDER)),
    )
    .await
    .unwrap_err();
    let status = tonic::Status::from_error(err);
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(retry_error(&status).is_some());
}

/// A tonic `Channel` that cannot connect (DNS, TLS, a connect timeout: here a
/// connector that fails) never sent the request: a write without key gets its transparent
/// retries, as with hyper-util's `is_connect` (before: ambiguous, sent once).
#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_tonic_connect_error_is_unsent() {
    let connects = Arc::new(AtomicUsize::new(0));
    let c = connects.clone();
    let connector = tower::service_fn(move |_uri: http::Uri| {
        c.fetch_add(1, Ordering::SeqCst);
        async {
            Err::<hyper_util::rt::TokioIo<tokio::net::TcpStream>, _>(std::io::Error::other(
                "TLS handshake failed",
            ))
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://orders.internal:50051")
        .connect_with_connector_lazy(connector);
    let layer = RetryLayer::new(RetryPolicy::default());
    let err = bounded(
        "the call",
        layer
            .tonic_channel(channel)
            .oneshot(grpc_request("127.0.0.1:1".parse().unwrap(), CREATE_ORDER)),
    )
    .await
    .unwrap_err();
    let status = tonic::Status::from_error(err);
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(
        layer.stats().attempts,
        5,
        "3 attempts and 2 transparent retries"
    );
    assert_eq!(connects.load(Ordering::SeqCst), 5);
}

/// What a generated tonic client does with a service: `ready().await`, its error answered as
/// UNKNOWN ("Service was not ready"), then the call.
#[cfg(feature = "tonic")]
async fn as_a_generated_client<S>(
    svc: &mut S,
    req: Request<tonic::body::Body>,
) -> Result<S::Response, tonic::Status>
where
    S: tower::Service<Request<tonic::body::Body>, Error = reason_code::BoxError>,
{
    svc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(format!("Service was not ready: {e}")))?;
    svc.call(req).await.map_err(tonic::Status::from_error)
}

/// A listener on 127.0.0.1 that does not answer: its accept queue is full (a backlog of one,
/// filled by connections nobody accepts), so a new connection's SYN is dropped and its connect
/// hangs (retried by the kernel after 1 s, 3 s...). Returns it and the filling connections.
#[cfg(feature = "tonic")]
async fn a_host_that_does_not_answer() -> (TcpListener, Vec<tokio::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut filling = Vec::new();
    loop {
        assert!(filling.len() < 16, "the accept queue never filled");
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(stream) => filling.push(stream.unwrap()),
            Err(_) => return (listener, filling),
        }
    }
}

/// A tonic `Channel` (a buffer of one here) to a host that does not answer, behind the layer,
/// called as a generated client calls: while the host is silent every call ends with a
/// classified status, DEADLINE_EXCEEDED or UNAVAILABLE, never UNKNOWN (before: once the
/// channel's buffer was full, the wait for readiness ended in a `poll_ready` error, which a
/// generated client answers UNKNOWN and every tier above takes as final); once the host
/// answers, the same client is served.
#[cfg(feature = "tonic")]
#[tokio::test]
async fn a_tonic_channel_to_a_host_that_does_not_answer_then_does() {
    let (listener, filling) = a_host_that_does_not_answer().await;
    let addr = listener.local_addr().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .buffer_size(1)
        .connect_lazy();
    let policy = RetryPolicy::builder()
        .idempotent_grpc_methods(retry_layer::GrpcMethods::new([GET_BOOK]).unwrap())
        .response_head_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let mut client = RetryLayer::new(policy).tonic_channel(channel);
    for _ in 0..3 {
        let mut req = grpc_request(addr, GET_BOOK);
        req.extensions_mut()
            .insert(retry_layer::Deadline::after(Duration::from_millis(400)));
        let status = bounded(
            "a call to the silent host",
            as_a_generated_client(&mut client, req),
        )
        .await
        .expect_err("the host does not answer");
        assert!(
            matches!(
                status.code(),
                tonic::Code::DeadlineExceeded | tonic::Code::Unavailable
            ),
            "a classified status, not {status:?}"
        );
    }

    // The host answers: the queued connections are accepted (and closed), then every connection
    // is served.
    drop(filling);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", "0")
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let mut req = grpc_request(addr, GET_BOOK);
    req.extensions_mut()
        .insert(retry_layer::Deadline::after(Duration::from_secs(8)));
    let res = bounded(
        "the call once the host answers",
        as_a_generated_client(&mut client, req),
    )
    .await
    .unwrap_or_else(|s| panic!("served once the host answers: {s:?}"));
    assert_eq!(res.headers()["grpc-status"], "0");
}

//! gRPC over HTTP/2 through a tonic `Channel`: trailers-only responses are retried, committed
//! responses are not.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};

type ResBody =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// What the server saw of each call: its headers and its whole body.
type Seen = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

/// A gRPC server answering `plan[n]` to the n-th call: `Some(code)` is a trailers-only
/// response with that status; `None` streams a message, then trailers with `grpc-status: 14`
/// (a committed response whose failure must not be retried).
async fn grpc_server(plan: Vec<Option<&'static str>>) -> (SocketAddr, Arc<AtomicUsize>, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (h, s) = (hits.clone(), seen.clone());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (h, s, plan) = (h.clone(), s.clone(), plan.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let n = h.fetch_add(1, Ordering::SeqCst);
                    let headers = req.headers().clone();
                    let step = plan[n.min(plan.len() - 1)];
                    let s = s.clone();
                    async move {
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        s.lock().unwrap().push((headers, body));
                        let builder =
                            Response::builder().header("content-type", "application/grpc");
                        let frames: Vec<Result<Frame<Bytes>, Infallible>> = match step {
                            Some(code) => {
                                let res = builder
                                    .header("grpc-status", code)
                                    .body(StreamBody::new(futures_util::stream::iter(vec![])))
                                    .unwrap();
                                return Ok::<Response<ResBody>, Infallible>(res);
                            }
                            None => {
                                let mut trailers = HeaderMap::new();
                                trailers.insert("grpc-status", "14".parse().unwrap());
                                vec![
                                    Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0"))),
                                    Ok(Frame::trailers(trailers)),
                                ]
                            }
                        };
                        Ok(builder
                            .body(StreamBody::new(futures_util::stream::iter(frames)))
                            .unwrap())
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, hits, seen)
}

/// A gRPC request message: `GetBook { id: "" }`, length-prefixed.
const MESSAGE: &[u8] = b"\0\0\0\0\x02\x0a\x00";

async fn call(addr: SocketAddr, path: &str) -> Response<tonic::body::Body> {
    let body = http_body_util::Full::new(Bytes::from_static(MESSAGE));
    call_with(addr, path, tonic::body::Body::new(body)).await
}

async fn call_with(
    addr: SocketAddr,
    path: &str,
    body: tonic::body::Body,
) -> Response<tonic::body::Body> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap();
    let channel = crate::wire::bounded("the connection", endpoint.connect())
        .await
        .unwrap();
    let policy = RetryPolicy::builder()
        .idempotent_grpc_methods(
            retry_layer::GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"]).unwrap(),
        )
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .map_request(|req: Request<ReplayBody<tonic::body::Body>>| req.map(tonic::body::Body::new))
        .service(channel);
    let req = Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
    crate::wire::bounded("the call", svc.oneshot(req))
        .await
        .unwrap()
}

#[tokio::test]
async fn trailers_only_unavailable_is_retried_through_a_tonic_channel() {
    let (addr, hits, seen) = grpc_server(vec![Some("14"), Some("14"), Some("0")]).await;
    let res = call(addr, "/plume.linkd.v3.Library/GetBook").await;
    assert_eq!(res.headers()["grpc-status"], "0");
    assert_eq!(hits.load(Ordering::SeqCst), 3);
    let seen = seen.lock().unwrap();
    assert!(seen[0].0.get("grpc-previous-rpc-attempts").is_none());
    assert_eq!(seen[1].0["grpc-previous-rpc-attempts"], "1");
    assert_eq!(seen[2].0["grpc-previous-rpc-attempts"], "2");
    assert!(seen.iter().all(|(_, body)| body == MESSAGE));
}

/// A tonic unary request's body has no size hint and says it has ended only when polled past
/// its one message: the layer reads it whole when the call starts, and every attempt carries
/// the same message over the wire.
#[tokio::test]
async fn a_message_without_a_size_hint_is_replayed_to_every_attempt() {
    let (addr, hits, seen) = grpc_server(vec![Some("14"), Some("14"), Some("0")]).await;
    let frames: Vec<Result<Frame<Bytes>, tonic::Status>> =
        vec![Ok(Frame::data(Bytes::from_static(MESSAGE)))];
    let body = StreamBody::new(futures_util::stream::iter(frames));
    assert!(http_body::Body::size_hint(&body).exact().is_none());
    let res = call_with(
        addr,
        "/plume.linkd.v3.Library/GetBook",
        tonic::body::Body::new(body),
    )
    .await;
    assert_eq!(res.headers()["grpc-status"], "0");
    assert_eq!(hits.load(Ordering::SeqCst), 3);
    let seen = seen.lock().unwrap();
    assert!(seen.iter().all(|(_, body)| body == MESSAGE), "{seen:?}");
}

#[tokio::test]
async fn a_method_not_declared_idempotent_is_not_retried() {
    let (addr, hits, _) = grpc_server(vec![Some("14"), Some("0")]).await;
    let res = call(addr, "/plume.linkd.v3.Library/CreateOrder").await;
    assert_eq!(res.headers()["grpc-status"], "14");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_committed_response_is_returned_as_is() {
    let (addr, hits, _) = grpc_server(vec![None, Some("0")]).await;
    let res = call(addr, "/plume.linkd.v3.Library/GetBook").await;
    assert!(res.headers().get("grpc-status").is_none());
    let collected = res.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "headers were sent: committed, never retried"
    );
}

/// Raw message bytes: a codec for `tonic::client::Grpc`, which generated clients drive.
#[cfg(feature = "tonic")]
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

#[cfg(feature = "tonic")]
impl tonic::codec::Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

#[cfg(feature = "tonic")]
impl tonic::codec::Encoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put(dst, item);
        Ok(())
    }
}

#[cfg(feature = "tonic")]
impl tonic::codec::Decoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Bytes>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n)))
    }
}

/// A channel whose answer is a committed head and the message `hi`, then trailers with
/// `grpc-status: 0` if `trailers`, else nothing more: the body never ends.
#[cfg(feature = "tonic")]
fn scripted_channel(
    trailers: bool,
) -> impl tower::Service<
    Request<tonic::body::Body>,
    Response = Response<tonic::body::Body>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send {
    tower::service_fn(move |req: Request<tonic::body::Body>| async move {
        let _ = req.into_body().collect().await;
        let mut frames = vec![Ok::<_, Infallible>(Frame::data(Bytes::from_static(
            b"\0\0\0\0\x02hi",
        )))];
        if trailers {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            frames.push(Ok(Frame::trailers(t)));
        }
        let rest = futures_util::stream::iter(frames);
        let body: tonic::body::Body = if trailers {
            tonic::body::Body::new(StreamBody::new(rest))
        } else {
            // The server sent its message and then stalls: no trailers ever come.
            let stalled = futures_util::StreamExt::chain(rest, futures_util::stream::pending());
            tonic::body::Body::new(StreamBody::new(stalled))
        };
        Ok(Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap())
    })
}

/// A unary call through `RetryChannel` is bounded by its deadline to its end, not only to its
/// head: a server that sends the head and the message and then stalls before the trailers
/// ends the call with DEADLINE_EXCEEDED at the deadline, as a generated client sees it. A body
/// that ends in time is the answer as it is. Before, such a call waited as long as the stall.
#[cfg(feature = "tonic")]
#[tokio::test(start_paused = true)]
async fn a_unary_calls_message_and_trailers_are_bounded_by_its_deadline() {
    let path = http::uri::PathAndQuery::from_static("/plume.linkd.v3.Library/GetBook");
    let layer = RetryLayer::new(RetryPolicy::default());
    let call = |trailers: bool| {
        let mut grpc = tonic::client::Grpc::new(layer.tonic_channel(scripted_channel(trailers)));
        let path = path.clone();
        async move {
            grpc.ready().await.unwrap();
            let mut req = tonic::Request::new(Bytes::from_static(b"b1"));
            req.set_timeout(std::time::Duration::from_millis(200));
            grpc.unary(req, path, Raw).await
        }
    };

    let started = tokio::time::Instant::now();
    let res = crate::support::within_a_day("the call", call(true)).await;
    assert_eq!(res.unwrap().into_inner(), "hi");
    assert_eq!(started.elapsed(), std::time::Duration::ZERO);

    let started = tokio::time::Instant::now();
    let status = crate::support::within_a_day("the stalled call", call(false))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert_eq!(started.elapsed(), std::time::Duration::from_millis(200));
}

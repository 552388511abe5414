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

/// A gRPC server answering `plan[n]` to the n-th call: `Some(code)` is a trailers-only
/// response with that status; `None` streams a message, then trailers with `grpc-status: 14`
/// (a committed response whose failure must not be retried).
async fn grpc_server(
    plan: Vec<Option<&'static str>>,
) -> (SocketAddr, Arc<AtomicUsize>, Arc<Mutex<Vec<HeaderMap>>>) {
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
                    s.lock().unwrap().push(req.headers().clone());
                    let step = plan[n.min(plan.len() - 1)];
                    async move {
                        let _ = req.into_body().collect().await;
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

async fn call(addr: SocketAddr, path: &str) -> Response<tonic::body::Body> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap();
    let channel = crate::wire::bounded("the connection", endpoint.connect())
        .await
        .unwrap();
    let policy = RetryPolicy::builder()
        .idempotent_grpc_method("/plume.linkd.v3.Library/GetBook")
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .map_request(|req: Request<ReplayBody<tonic::body::Body>>| req.map(tonic::body::Body::new))
        .service(channel);
    let req = Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(http_body_util::Full::new(
            Bytes::from_static(b"\0\0\0\0\x02\x0a\x00"),
        )))
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
    assert!(seen[0].get("grpc-previous-rpc-attempts").is_none());
    assert_eq!(seen[1]["grpc-previous-rpc-attempts"], "1");
    assert_eq!(seen[2]["grpc-previous-rpc-attempts"], "2");
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

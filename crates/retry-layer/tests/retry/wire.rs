//! Socket helpers for the wire tests: a recording hyper server (HTTP/1.1 and h2c) whose answer
//! to each request follows a plan, and a hyper-util client through the layer.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use reason_code::BoxError;
use retry_layer::{ReplayBody, Retry, RetryLayer};
use tokio::net::TcpListener;
use tokio::time::Duration;

/// The request body type of the wire tests: any body, boxed.
pub(crate) type TestBody = BoxBody<Bytes, BoxError>;

/// HTTP/1.1 (keep-alive) or HTTP/2 with prior knowledge (h2c).
pub(crate) use test_support::net::Transport;

/// The client through the layer.
pub(crate) fn client(
    layer: &RetryLayer,
    proto: Transport,
) -> Retry<Client<HttpConnector, ReplayBody<TestBody>>> {
    tower::Layer::layer(layer, proto.client())
}

/// What the server does with one request.
#[derive(Debug, Clone)]
pub(crate) enum Act {
    /// Read the whole request, then answer with this status and headers.
    Status(u16, Vec<(&'static str, &'static str)>),
    /// Read the whole request, then close the connection (HTTP/1) or reset the stream (HTTP/2)
    /// without answering: the "lost after send" case.
    Close,
    /// Read one frame of the body, answer this status, and leave the rest unread.
    AfterFirstFrame(u16),
}

pub(crate) fn status(code: u16) -> Act {
    Act::Status(code, vec![])
}

/// What the server saw of one request (read whole).
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

#[derive(Clone)]
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    hits: Arc<AtomicUsize>,
}

impl Server {
    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Requests that reached the handler (read whole or not).
    pub(crate) fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Serves HTTP/1.1 and h2c on 127.0.0.1:0; request `n` (from 0, per path with `plan`'s first
/// argument) is answered as `plan(path, n)` says.
pub(crate) async fn serve<F>(plan: F) -> Server
where
    F: Fn(&str, usize) -> Act + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server {
        addr,
        seen: Arc::default(),
        hits: Arc::default(),
    };
    let per_path: Arc<Mutex<std::collections::HashMap<String, usize>>> = Arc::default();
    let plan = Arc::new(plan);
    let s = server.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (s, plan, per_path) = (s.clone(), plan.clone(), per_path.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (s, plan, per_path) = (s.clone(), plan.clone(), per_path.clone());
                    async move {
                        s.hits.fetch_add(1, Ordering::SeqCst);
                        let path = req.uri().path().to_owned();
                        let n = {
                            let mut m = per_path.lock().unwrap();
                            let c = m.entry(path.clone()).or_insert(0);
                            *c += 1;
                            *c - 1
                        };
                        let act = plan(&path, n);
                        let (parts, mut body) = req.into_parts();
                        if let Act::AfterFirstFrame(code) = act {
                            let _ = body.frame().await;
                            // Keep the rest unread (and the body alive) while answering.
                            tokio::spawn(async move {
                                tokio::time::sleep(Duration::from_secs(30)).await;
                                drop(body);
                            });
                            return Ok::<_, std::io::Error>(reply(code, &[]));
                        }
                        let collected = match body.collect().await {
                            Ok(c) => c,
                            Err(e) => return Err(std::io::Error::other(e)),
                        };
                        let trailers = collected.trailers().cloned();
                        s.seen.lock().unwrap().push(Seen {
                            headers: parts.headers,
                            body: collected.to_bytes(),
                            trailers,
                        });
                        match act {
                            Act::Status(code, headers) => Ok(reply(code, &headers)),
                            Act::Close => Err(std::io::Error::other("closing without an answer")),
                            Act::AfterFirstFrame(_) => unreachable!("answered above"),
                        }
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    server
}

pub(crate) fn reply(code: u16, headers: &[(&'static str, &'static str)]) -> Response<Full<Bytes>> {
    let mut r = Response::builder().status(StatusCode::from_u16(code).unwrap());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.body(Full::new(Bytes::from_static(b"answer"))).unwrap()
}

/// A body of fixed bytes (sent with Content-Length).
pub(crate) fn full(b: &'static str) -> TestBody {
    Full::new(Bytes::from_static(b.as_bytes()))
        .map_err(|e: Infallible| match e {})
        .boxed()
}

pub(crate) fn checksum_trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("x-checksum", "c0ffee".parse().unwrap());
    t
}

/// A body that streams `chunks` (chunked on HTTP/1), then the `x-checksum` trailer.
pub(crate) fn chunks_with_trailers(chunks: &[&'static str]) -> TestBody {
    let mut frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
        .iter()
        .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
        .collect();
    frames.push(Ok(Frame::trailers(checksum_trailers())));
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// A request with a streaming body and trailers; HTTP/1 needs the `trailer` header to send them.
pub(crate) fn streaming_request(
    method: http::Method,
    url: String,
    chunks: &[&'static str],
) -> Request<TestBody> {
    Request::builder()
        .method(method)
        .uri(url)
        .header("trailer", "x-checksum")
        .body(chunks_with_trailers(chunks))
        .unwrap()
}

/// Bounds a test step: fails instead of hanging.
pub(crate) async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(10), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within 10 s"),
    }
}

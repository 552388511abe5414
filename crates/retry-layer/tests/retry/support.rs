use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use reason_code::BoxError;
use retry_layer::{ReplayBody, Retry, RetryLayer, RetryPolicy};
use std::future::Future;

use tokio::time::{Duration, Instant};
use tower::{Service, ServiceExt};

/// One scripted answer of the backend.
#[derive(Clone)]
pub(crate) enum Reply {
    /// A status with headers.
    Status(u16, Vec<(&'static str, &'static str)>),
    /// A transport error of this kind.
    Io(std::io::ErrorKind),
    /// Answer after this long.
    Slow(Duration, u16),
    /// Never answer.
    Never,
}

pub(crate) fn status(code: u16) -> Reply {
    Reply::Status(code, vec![])
}

pub(crate) fn grpc(code: &'static str) -> Reply {
    Reply::Status(
        200,
        vec![("content-type", "application/grpc"), ("grpc-status", code)],
    )
}

/// What the backend saw of one attempt.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) at: Instant,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

#[derive(Default)]
pub(crate) struct Script {
    replies: Mutex<VecDeque<Reply>>,
    pub(crate) seen: Mutex<Vec<Seen>>,
}

impl Script {
    pub(crate) fn attempts(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A backend that answers with `replies` in order, repeating the last one.
#[allow(clippy::type_complexity)]
pub(crate) fn backend<B>(
    replies: Vec<Reply>,
) -> (
    impl Service<
            Request<ReplayBody<B>>,
            Response = Response<Full<Bytes>>,
            Error = BoxError,
            Future = impl Send,
        > + Clone
        + Send,
    Arc<Script>,
)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let script = Arc::new(Script {
        replies: Mutex::new(replies.into()),
        seen: Mutex::default(),
    });
    let s = script.clone();
    let svc = tower::service_fn(move |req: Request<ReplayBody<B>>| {
        let s = s.clone();
        async move {
            let (parts, body) = req.into_parts();
            let at = Instant::now();
            let body = body.collect().await?.to_bytes();
            s.seen.lock().unwrap().push(Seen {
                at,
                headers: parts.headers,
                body,
            });
            let reply = {
                let mut q = s.replies.lock().unwrap();
                if q.len() > 1 {
                    q.pop_front().unwrap()
                } else {
                    q.front().cloned().expect("a script has at least one reply")
                }
            };
            respond(reply).await
        }
    });
    (svc, script)
}

async fn respond(reply: Reply) -> Result<Response<Full<Bytes>>, BoxError> {
    match reply {
        Reply::Status(code, headers) => {
            let mut r = Response::builder().status(StatusCode::from_u16(code).unwrap());
            for (k, v) in headers {
                r = r.header(k, v);
            }
            Ok(r.body(Full::new(Bytes::from_static(b"body"))).unwrap())
        }
        Reply::Io(kind) => Err(Box::new(std::io::Error::from(kind))),
        Reply::Never => std::future::pending().await,
        Reply::Slow(d, code) => {
            tokio::time::sleep(d).await;
            Ok(Response::builder()
                .status(code)
                .body(Full::new(Bytes::new()))
                .unwrap())
        }
    }
}

/// Sends one request through `Retry` over a fresh scripted backend.
pub(crate) async fn call_scripted(
    policy: RetryPolicy,
    req: Request<Full<Bytes>>,
    replies: Vec<Reply>,
) -> (
    Result<Response<Full<Bytes>>, BoxError>,
    Arc<Script>,
    RetryLayer,
) {
    let (svc, script) = backend::<Full<Bytes>>(replies);
    let layer = RetryLayer::new(policy);
    let mut retry: Retry<_> = tower::Layer::layer(&layer, svc);
    let result = within_a_day("the call", async {
        retry.ready().await.unwrap().call(req).await
    })
    .await;
    (result, script, layer)
}

pub(crate) fn post(path: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://svc{path}"))
        .body(Full::new(Bytes::from_static(b"{\"book_id\":\"b1\"}")))
        .unwrap()
}

pub(crate) fn get(path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("http://svc{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap()
}

pub(crate) fn grpc_req(path: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://svc{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

pub(crate) fn keyed(mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert("x-idempotency-key", "order-7f3a9c21".parse().unwrap());
    req
}

/// Bounds a wait of a paused-time test by `limit` of (paused) time: fails instead of hanging.
pub(crate) async fn within<F: Future>(limit: Duration, what: &str, f: F) -> F::Output {
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} was still waiting after {limit:?} of (paused) time"),
    }
}

/// Bounds a wait of a paused-time test. With the clock paused, a call that hangs with no timer
/// of its own would hang the test; this timer lets tokio advance to it and fail instead. (A day:
/// longer than any deadline or pushback the tests set.)
pub(crate) async fn within_a_day<F: Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(86_400), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within a day of (paused) time"),
    }
}

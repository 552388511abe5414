//! Over real sockets: a hyper server on 127.0.0.1:0 and a hyper-util client through the layer.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retry_layer::{RetryError, RetryLayer, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::time::Duration;
use tower::{Service, ServiceBuilder, ServiceExt};

use crate::wire::bounded;

/// Serves `handler` on 127.0.0.1:0 (HTTP/1 and HTTP/2) until the test ends.
async fn serve<F, Fut>(handler: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler(req).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

fn client(
    layer: RetryLayer,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Incoming>,
    Error = reason_code::BoxError,
    Future = impl Send,
> + Clone {
    ServiceBuilder::new()
        .layer(layer)
        .service(Client::builder(TokioExecutor::new()).build_http())
}

#[tokio::test]
async fn a_server_that_answers_503_twice_then_200() {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let addr = serve(move |req: Request<Incoming>| {
        let n = h.fetch_add(1, Ordering::SeqCst);
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, "{\"quantity\":1}", "every attempt carries the body");
            let status = if n < 2 {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            };
            Response::builder()
                .status(status)
                .body(Full::new(Bytes::from("done")))
                .unwrap()
        }
    })
    .await;
    let layer = RetryLayer::new(
        RetryPolicy::builder()
            .ensure_idempotency_key()
            .build()
            .unwrap(),
    );
    let req = Request::post(format!("http://{addr}/orders"))
        .body(Full::new(Bytes::from("{\"quantity\":1}")))
        .unwrap();
    let res = bounded("the call", client(layer.clone()).oneshot(req))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "done");
    assert_eq!(hits.load(Ordering::SeqCst), 3);
    assert_eq!(layer.stats().retries, 2);
}

/// A server that reads each request whole, records its idempotency key, then closes the
/// connection without answering: the "connection dropped after send" case.
async fn closing_server() -> (SocketAddr, Arc<Mutex<Vec<Option<String>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let k = keys.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let k = k.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                let head_end = loop {
                    let n = stream.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    let n = stream.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let key = head
                    .lines()
                    .find_map(|l| l.strip_prefix("x-idempotency-key:"))
                    .map(|v| v.trim().to_owned());
                k.lock().unwrap().push(key);
                let _ = stream.shutdown().await;
            });
        }
    });
    (addr, keys)
}

#[tokio::test]
async fn connection_closed_after_the_request_is_retried_only_when_keyed_or_idempotent() {
    let (addr, keys) = closing_server().await;
    let post = || {
        Request::post(format!("http://{addr}/orders"))
            .body(Full::new(Bytes::from("{\"quantity\":1}")))
            .unwrap()
    };

    // No key, not idempotent: it may have executed, so it is not retried.
    let layer = RetryLayer::new(RetryPolicy::default());
    let err = bounded("the POST", client(layer.clone()).oneshot(post()))
        .await
        .unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert_lost_after_send(err);
    assert_eq!(err.attempts(), 1, "{err}");
    assert_eq!(err.idempotency_key(), None);
    assert_eq!(keys.lock().unwrap().len(), 1);
    assert_eq!(layer.stats().retries, 0);
    keys.lock().unwrap().clear();

    // With ensure_idempotency_key(): retried, with one key on every attempt, and the error
    // tells the caller that key.
    let layer = RetryLayer::new(
        RetryPolicy::builder()
            .ensure_idempotency_key()
            .build()
            .unwrap(),
    );
    let err = bounded("the keyed POST", client(layer.clone()).oneshot(post()))
        .await
        .unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert_lost_after_send(err);
    assert_eq!(err.attempts(), 3, "{err}");
    assert_eq!(layer.stats().exhausted, 1);
    let seen = keys.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let key = err
        .idempotency_key()
        .expect("the generated key")
        .to_str()
        .unwrap();
    assert!(
        seen.iter().all(|k| k.as_deref() == Some(key)),
        "{seen:?} vs {key}"
    );
    keys.lock().unwrap().clear();

    // Idempotent method: retried.
    let get = Request::get(format!("http://{addr}/books/b1"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = bounded(
        "the GET",
        client(RetryLayer::new(RetryPolicy::default())).oneshot(get),
    )
    .await
    .unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert_lost_after_send(err);
    assert_eq!(err.attempts(), 3, "{err}");
    assert_eq!(err.idempotency_key(), None, "a GET gets no key");
    assert_eq!(keys.lock().unwrap().len(), 3);
}

/// The error of a request the server read and then dropped: the client's own error (not a
/// connect error: the request was sent), caused by the connection closing mid-message.
fn assert_lost_after_send(err: &RetryError) {
    let client_err = err
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .unwrap_or_else(|| panic!("the hyper-util client's error, got {err:?}"));
    assert!(
        !client_err.is_connect(),
        "the request was sent: {client_err:?}"
    );
    let hyper_err = std::iter::successors(
        Some(client_err as &(dyn std::error::Error + 'static)),
        |e| e.source(),
    )
    .find_map(|e| e.downcast_ref::<hyper::Error>())
    .unwrap_or_else(|| panic!("a hyper error in the chain of {client_err:?}"));
    assert!(
        hyper_err.is_incomplete_message(),
        "the connection closed before the response: {hyper_err:?}"
    );
}

#[tokio::test]
async fn connection_refused_is_retried_even_for_a_post_without_key() {
    // Bind then drop: nothing listens on this port.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let layer = RetryLayer::new(RetryPolicy::default());
    let req = Request::post(format!("http://{addr}/orders"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = bounded("the call", client(layer.clone()).oneshot(req))
        .await
        .unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.kind(), retry_layer::RetryErrorKind::NotSent);
    assert!(!err.may_have_executed(), "no attempt reached a server");
    let err = err
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .expect("the client's error");
    assert!(err.is_connect());
    // 3 attempts plus 2 transparent retries: nothing was ever sent.
    assert_eq!(layer.stats().attempts, 5);
}

/// `Retry-After: 1` over real sockets, measured where it matters: the gap between the two
/// attempts as the server saw them. Real time (paused time could jump the clock while the
/// client waits on I/O): at least the second asked for, and not much more (the computed
/// backoff would be 20 ms; a wait of `max_pushback` would be 30 s).
#[tokio::test]
async fn too_many_requests_with_retry_after_1() {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let a = arrivals.clone();
    let addr = serve(move |_req: Request<Incoming>| {
        let n = {
            let mut arrivals = a.lock().unwrap();
            arrivals.push(std::time::Instant::now());
            arrivals.len()
        };
        async move {
            if n == 1 {
                Response::builder()
                    .status(StatusCode::TOO_MANY_REQUESTS)
                    .header("retry-after", "1")
                    .body(Full::new(Bytes::new()))
                    .unwrap()
            } else {
                Response::new(Full::new(Bytes::from("ok")))
            }
        }
    })
    .await;
    let req = Request::post(format!("http://{addr}/orders"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let layer = RetryLayer::new(RetryPolicy::default());
    let res = bounded("the call", client(layer.clone()).oneshot(req))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(layer.stats().retries, 1);
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2, "one 429, then the retry");
    let gap = arrivals[1] - arrivals[0];
    assert!(
        gap >= Duration::from_secs(1),
        "the retry came {gap:?} after the 429, before the second it asked for"
    );
    assert!(
        gap < Duration::from_secs(4),
        "the retry came {gap:?} after the 429: far more than the second it asked for"
    );
}

/// A body over `max_replay_bytes` that was never sent can still be retried:
/// nothing of it was read, so a new attempt reads it from its first byte. A 100 KiB POST that
/// meets a refused connection gets its transparent retries with the default 64 KiB limit, as it
/// did with `max_replay_bytes(0)` (before: sent once, with the default).
#[tokio::test]
async fn an_unsent_body_over_the_replay_limit_is_still_retried() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    for policy in [
        RetryPolicy::default(),
        RetryPolicy::builder().max_replay_bytes(0).build().unwrap(),
    ] {
        let layer = RetryLayer::new(policy);
        // A whole body with a known size, and one that streams without a size hint.
        let bodies: [http_body_util::combinators::BoxBody<Bytes, reason_code::BoxError>; 2] = [
            Full::new(Bytes::from(vec![b'x'; 100 * 1024]))
                .map_err(|e| match e {})
                .boxed(),
            http_body_util::StreamBody::new(futures_util::stream::iter(
                (0..100).map(|_| Ok(http_body::Frame::data(Bytes::from(vec![b'x'; 1024])))),
            ))
            .boxed(),
        ];
        for body in bodies {
            let before = layer.stats().attempts;
            let req = Request::post(format!("http://{addr}/orders"))
                .body(body)
                .unwrap();
            let svc = ServiceBuilder::new()
                .layer(layer.clone())
                .service(Client::builder(TokioExecutor::new()).build_http());
            let err = bounded("the call", svc.oneshot(req)).await.unwrap_err();
            let err = RetryError::of(&*err).expect("a RetryError");
            assert!(
                err.downcast_ref::<hyper_util::client::legacy::Error>()
                    .is_some_and(|e| e.is_connect()),
                "{err}"
            );
            assert_eq!(
                layer.stats().attempts - before,
                5,
                "3 attempts plus 2 transparent retries: nothing was ever sent"
            );
        }
    }
}

//! The layer keeps tower's contract: a slow inner service is never a `poll_ready` error (tower
//! reads one as "discard this service"), the wait for readiness belongs to the call (bounded by
//! its deadline, counted from the call), and nothing of a failed attempt is held through the
//! backoff. With `Buffer`, `ConcurrencyLimit` and `Balance` in front, on paused time; and over
//! real sockets, one HTTP/1.1 connection and one HTTP/2 connection driven directly.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use reason_code::BoxError;
use retry_layer::budget::{Budget, RetryBudget};
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use retry_layer::{
    Deadline, DeadlineExceeded, ReplayBody, RetryError, RetryInfo, RetryLayer, RetryPolicy,
    ServiceNotReady,
};
use tokio::net::TcpListener;
use tokio::time::{Duration, Instant};
use tower::buffer::Buffer;
use tower::limit::ConcurrencyLimit;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

use crate::support::{get, grpc_req, within_a_day};
use crate::wire::bounded;

type Req = Request<ReplayBody<Full<Bytes>>>;

/// A backend that answers 200 at once and counts the calls that reach it.
#[derive(Clone, Default)]
struct Backend {
    calls: Arc<AtomicUsize>,
}

impl Backend {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Service<Req> for Backend {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Req) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok")))))
    }
}

/// A stall: the one permit of `limit`, held until the returned service is dropped (as a long
/// call would hold it).
async fn hold(limit: &ConcurrencyLimit<Backend>) -> ConcurrencyLimit<Backend> {
    let mut holder = limit.clone();
    holder.ready().await.unwrap();
    holder
}

/// The policy of the stall tests: a one-second head bound, so that a stall ends the call.
fn one_second_head() -> RetryPolicy {
    RetryPolicy::builder()
        .response_head_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
}

fn caused_by<E: StdError + 'static>(e: &BoxError) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(&**e);
    while let Some(e) = cur {
        if e.is::<E>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// `Buffer` over the layer: the call in the stall ends with `ServiceNotReady`, and once the
/// permit is free every later call through the same buffer is served. (Before: the stall was a
/// `poll_ready` error, the buffer's worker took it for a dead service, and every later call
/// failed with "buffered service failed" without reaching the backend.)
#[tokio::test(start_paused = true)]
async fn a_buffer_in_front_serves_again_after_a_stall() {
    let backend = Backend::default();
    let limit = ConcurrencyLimit::new(backend.clone(), 1);
    let layer = RetryLayer::new(one_second_head());
    let buffer = Buffer::new(layer.layer(limit.clone()), 4);

    let holder = hold(&limit).await;
    let e = within_a_day(
        "the call in the stall",
        buffer.clone().oneshot(get("/books/b1")),
    )
    .await
    .expect_err("the service stayed not ready");
    assert!(caused_by::<ServiceNotReady>(&e), "a ServiceNotReady: {e}");
    assert_eq!(backend.calls(), 0, "nothing was sent in the stall");

    drop(holder);
    for _ in 0..3 {
        let res = within_a_day(
            "a call after the stall",
            buffer.clone().oneshot(get("/books/b1")),
        )
        .await
        .unwrap_or_else(|e| panic!("the buffer serves again: {e}"));
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(backend.calls(), 3);
}

/// `ConcurrencyLimit` in front of the layer (a `ServiceBuilder` stack): ready at once while the
/// inner service is stalled, the call ends at the head bound, and the stack serves again.
#[tokio::test(start_paused = true)]
async fn a_concurrency_limit_in_front_serves_again_after_a_stall() {
    let backend = Backend::default();
    let limit = ConcurrencyLimit::new(backend.clone(), 1);
    let mut svc = ServiceBuilder::new()
        .concurrency_limit(8)
        .layer(RetryLayer::new(one_second_head()))
        .service(limit.clone());

    let holder = hold(&limit).await;
    let started = Instant::now();
    let ready = svc.ready().await;
    assert!(ready.is_ok(), "slowness is not a readiness error");
    assert_eq!(started.elapsed(), Duration::ZERO, "ready at once");
    let e = within_a_day("the call in the stall", svc.call(get("/books/b1")))
        .await
        .expect_err("stalled");
    assert!(caused_by::<ServiceNotReady>(&e), "{e}");
    assert_eq!(started.elapsed(), Duration::from_secs(1), "the head bound");

    drop(holder);
    let res = within_a_day("the call after", svc.ready().await.unwrap().call(get("/b")))
        .await
        .expect("served again");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(backend.calls(), 1);
}

/// `Balance` over two endpoints, each behind the layer: an endpoint that stalls stays in the
/// set, and serves again once its stall ends. (Before: its stall was a `poll_ready` error, and
/// the balancer dropped the endpoint for good.)
#[tokio::test(start_paused = true)]
async fn a_balance_keeps_an_endpoint_that_stalled() {
    use tower::balance::p2c::Balance;
    use tower::discover::ServiceList;
    use tower::load::{CompleteOnResponse, PendingRequestsDiscover};

    let (a, b) = (Backend::default(), Backend::default());
    let (limit_a, limit_b) = (
        ConcurrencyLimit::new(a.clone(), 1),
        ConcurrencyLimit::new(b.clone(), 1),
    );
    let layer = RetryLayer::new(one_second_head());
    let endpoints = ServiceList::new(vec![layer.layer(limit_a.clone()), layer.layer(limit_b)]);
    let mut balance = Balance::new(PendingRequestsDiscover::new(
        endpoints,
        CompleteOnResponse::default(),
    ));

    let holder = hold(&limit_a).await;
    let mut stalled = 0;
    // Calls spread over three seconds of the stall, three times the head bound.
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let svc = within_a_day("the balancer's readiness", balance.ready())
            .await
            .expect("the balancer stays ready");
        if within_a_day("a call in the stall", svc.call(get("/books/b1")))
            .await
            .is_err()
        {
            stalled += 1;
        }
    }
    assert_eq!(a.calls(), 0, "nothing reached the stalled endpoint");
    assert_eq!(b.calls() + stalled, 16);

    drop(holder);
    for _ in 0..32 {
        let svc = within_a_day("the balancer's readiness", balance.ready())
            .await
            .unwrap();
        within_a_day("a call after the stall", svc.call(get("/books/b1")))
            .await
            .expect("every call is served");
    }
    assert!(a.calls() > 0, "the endpoint that stalled serves again");
}

/// A caller that gives up on `ready()` (a timeout around a generated tonic client's call) leaves
/// nothing behind: five seconds later, on a ready service, a call with a fresh one-second
/// `total_timeout` is sent. (Before: the abandoned wait's start was kept, and the call ended
/// with `DeadlineExceeded` after 0 attempts.)
#[tokio::test(start_paused = true)]
async fn an_abandoned_ready_does_not_spend_the_next_calls_deadline() {
    let backend = Backend::default();
    let limit = ConcurrencyLimit::new(backend.clone(), 1);
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut svc = RetryLayer::new(policy).layer(limit.clone());
    let holder = hold(&limit).await;
    let _ = tokio::time::timeout(Duration::from_millis(200), svc.ready()).await;
    drop(holder);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let res = within_a_day("the next call", async {
        svc.ready().await.unwrap().call(get("/books/b1")).await
    })
    .await
    .unwrap_or_else(|e| panic!("the call is sent: {e}"));
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(backend.calls(), 1);
}

/// A service whose `poll_ready` never resolves.
#[derive(Clone, Default)]
struct NeverReady;

impl Service<Req> for NeverReady {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Pending<Result<Response<Full<Bytes>>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Pending
    }

    fn call(&mut self, _req: Req) -> Self::Future {
        panic!("called before it was ready")
    }
}

/// A per-request deadline bounds the wait for readiness: a `Deadline` extension and a
/// `grpc-timeout` (what `tonic::Request::set_timeout` writes), each counted from the call.
/// (Before: the wait happened in `poll_ready`, before the request was known, bounded only by
/// the policy: 60 s here.)
#[tokio::test(start_paused = true)]
async fn a_per_request_deadline_bounds_the_wait_for_readiness() {
    let layer = RetryLayer::new(RetryPolicy::default());

    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(300)));
    let started = Instant::now();
    let e = within_a_day("the call", layer.layer(NeverReady).oneshot(req))
        .await
        .expect_err("never ready");
    let e = RetryError::of(&*e).expect("a RetryError");
    assert!(e.is::<DeadlineExceeded>(), "{e}");
    assert_eq!(e.attempts(), 0);
    assert_eq!(started.elapsed(), Duration::from_millis(300));

    let mut req = grpc_req("/plume.linkd.v3.Library/GetBook");
    req.headers_mut()
        .insert("grpc-timeout", "250m".parse().unwrap());
    let started = Instant::now();
    let e = within_a_day("the gRPC call", layer.layer(NeverReady).oneshot(req))
        .await
        .expect_err("never ready");
    assert!(caused_by::<DeadlineExceeded>(&e), "{e}");
    assert_eq!(started.elapsed(), Duration::from_millis(250));
}

/// One HTTP/1 connection as a service (hyper's `SendRequest`, shared by its clones): ready only
/// once the previous response's body is let go.
struct OneConnection<B>(Arc<Mutex<hyper::client::conn::http1::SendRequest<B>>>);

impl<B> OneConnection<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    /// One HTTP/1.1 connection to `addr`, its connection task spawned.
    async fn to(addr: std::net::SocketAddr) -> Self {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        OneConnection(Arc::new(Mutex::new(send)))
    }
}

impl<B> Clone for OneConnection<B> {
    fn clone(&self) -> Self {
        OneConnection(self.0.clone())
    }
}

impl<B> Service<Request<B>> for OneConnection<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = Response<Incoming>;
    type Error = hyper::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Incoming>, hyper::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.0.lock().unwrap().poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        Box::pin(self.0.lock().unwrap().send_request(req))
    }
}

/// An HTTP/1.1 server whose first answer is a 503 with a body in two chunks, the second 100 ms
/// after the first (so the client has not received it when the head arrives); then 200s.
/// Returns its address and the requests it answered.
async fn slow_503_then_200() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    use futures_util::StreamExt;
    use http_body::Frame;
    use http_body_util::StreamBody;

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let h = h.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let n = h.fetch_add(1, Ordering::SeqCst);
                    async move {
                        let _ = req.into_body().collect().await;
                        let (status, body) = if n == 0 {
                            let frames =
                                futures_util::stream::iter([0, 100]).then(|ms| async move {
                                    tokio::time::sleep(Duration::from_millis(ms)).await;
                                    Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"busy")))
                                });
                            (503, BodyExt::boxed(StreamBody::new(frames)))
                        } else {
                            (200, BodyExt::boxed(Full::new(Bytes::from_static(b"ok"))))
                        };
                        Ok::<_, Infallible>(Response::builder().status(status).body(body).unwrap())
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, hits)
}

/// Over one real HTTP/1.1 connection: a 503 then a 200. The 503's body is read and discarded
/// while the call waits for its retry, so the connection is free for it: the 200 after one
/// backoff. (Before: the 503 was held until the retry was sent, the connection never became
/// ready, and the call ended at the head bound after one attempt. Dropped unread instead, the
/// body's second chunk not yet received, hyper closes the connection.)
#[tokio::test]
async fn a_failed_answer_is_let_go_before_the_retry_on_one_http1_connection() {
    let (addr, hits) = slow_503_then_200().await;
    let connection = OneConnection::to(addr).await;
    let policy = RetryPolicy::builder()
        .response_head_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let svc = RetryLayer::new(policy).layer(connection);
    let req = Request::get(format!("http://{addr}/books/b1"))
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = bounded("the call", svc.oneshot(req))
        .await
        .unwrap_or_else(|e| panic!("the 200 after one backoff: {e}"));
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(RetryInfo::attempts_of(&res), 2);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "both attempts on the one connection"
    );
}

/// The same over a hedge under the retry layer (as users stack them): the hedge's first attempt
/// answers the 503 and the next hedge is due at once, but the connection is the 503's until its
/// body is read. The hedge answers the failure in hand instead of waiting for the connection it
/// holds; the retry layer drains it and the retry is the 200. (Before: the hedge waited, holding
/// the 503 unread, until the call's deadline, and the call ended without the 200; found by the
/// simulator, seed 4100108.)
#[tokio::test]
async fn a_hedge_does_not_wait_for_the_connection_its_failed_answer_holds() {
    let (addr, hits) = slow_503_then_200().await;
    let connection = OneConnection::to(addr).await;
    let hedging = HedgePolicy::builder()
        .max_attempts(2)
        .hedging_delay(Duration::from_millis(50))
        .response_head_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let retry = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(3))
        .response_head_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(retry))
        .layer(HedgeLayer::new(hedging))
        .service(connection);
    let req = Request::get(format!("http://{addr}/books/b1"))
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = bounded("the call", svc.oneshot(req))
        .await
        .unwrap_or_else(|e| panic!("the 200 after one backoff: {e}"));
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "the 503, then the retry on the one connection"
    );
}

/// An h2 server: `/big` answers 503 with a body larger than the client's connection window
/// and an hour's pushback; `/small` answers 200 with a short body.
async fn h2_window_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let big = req.uri().path() == "/big";
                    let _ = req.into_body().collect().await;
                    let res = if big {
                        Response::builder()
                            .status(503)
                            .header("retry-after", "3600")
                            .body(Full::new(Bytes::from(vec![b'x'; 100_000])))
                    } else {
                        Response::builder()
                            .status(200)
                            .body(Full::new(Bytes::from_static(b"small")))
                    };
                    Ok::<_, Infallible>(res.unwrap())
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// Over one real HTTP/2 connection with a 64 KiB connection window: a call answered 503 with a
/// body that fills the window waits out its pushback, while another call on the same connection
/// reads its body. (Before: the unread 503 kept the window through the wait, and no other
/// stream on the connection could receive a byte.)
#[tokio::test]
async fn a_failed_answer_waiting_for_its_retry_leaves_the_http2_window_free() {
    let addr = h2_window_server().await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_connection_window_size(65_535)
        .initial_stream_window_size(65_535)
        .handshake::<_, ReplayBody<Full<Bytes>>>(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let h2 = tower::service_fn(move |req: Req| {
        let mut send = send.clone();
        async move { send.send_request(req).await }
    });
    let policy = RetryPolicy::builder()
        .max_pushback(Duration::from_secs(7200))
        .build()
        .unwrap();
    let layer = RetryLayer::new(policy);
    let req = |path: &str| {
        Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let waiting = tokio::spawn(layer.layer(h2.clone()).oneshot(req("/big")));
    // The 503's body reaches the client (and fills the window) before the other call starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let res = bounded(
        "the other call's head",
        layer.layer(h2).oneshot(req("/small")),
    )
    .await
    .expect("the other call");
    let body = bounded("the other call's body", res.into_body().collect())
        .await
        .expect("its body");
    assert_eq!(body.to_bytes(), Bytes::from_static(b"small"));
    assert!(!waiting.is_finished(), "the 503 waits out its pushback");
    waiting.abort();
}

/// Counts what a hedge takes from its budget and gives back.
#[derive(Debug, Default)]
struct Tokens {
    withdrawn: AtomicUsize,
    refunded: AtomicUsize,
}

impl Budget for Tokens {
    fn deposit(&self) {}
    fn record(&self, _failed: bool) {}
    fn withdraw(&self) -> bool {
        self.withdrawn.fetch_add(1, Ordering::SeqCst);
        true
    }
    fn refund(&self) {
        self.refunded.fetch_add(1, Ordering::SeqCst);
    }
}

/// A slow backend behind `ConcurrencyLimit(1)`: the first attempt holds the permit, so the
/// hedge that is due never finds the service ready. The budget granted that hedge before it
/// waited; it is given back when the call ends with the hedge unsent. (Before: kept, and real
/// retries were starved of it.)
#[tokio::test(start_paused = true)]
async fn an_unsent_hedge_gives_its_budget_token_back() {
    let slow = tower::service_fn(|_req: Req| async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    });
    let tokens = Arc::new(Tokens::default());
    let policy = HedgePolicy::builder()
        .max_attempts(2)
        .hedging_delay(Duration::from_millis(50))
        .budget(RetryBudget::custom(tokens.clone()))
        .build()
        .unwrap();
    let hedged = HedgeLayer::new(policy).layer(ConcurrencyLimit::new(slow, 1));
    let res = within_a_day("the hedged call", hedged.oneshot(get("/books/b1")))
        .await
        .expect("the first attempt's answer");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(tokens.withdrawn.load(Ordering::SeqCst), 1);
    assert_eq!(
        tokens.refunded.load(Ordering::SeqCst),
        1,
        "the unsent hedge's token is given back"
    );
}

/// Answers its first call with a 503, and is never ready again.
#[derive(Clone, Default)]
struct OnceThenStuck(Arc<AtomicUsize>);

impl<B> Service<Request<B>> for OnceThenStuck {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.0.load(Ordering::SeqCst) == 0 {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        self.0.fetch_add(1, Ordering::SeqCst);
        let mut res = Response::new(Full::new(Bytes::from_static(b"busy")));
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        std::future::ready(Ok(res))
    }
}

/// A retry the budget granted that is never sent (the deadline ends its wait for the service)
/// gives its token back. (Before: kept, and the budget counted a retry that never went out.)
#[tokio::test(start_paused = true)]
async fn a_retry_that_is_never_sent_gives_its_budget_token_back() {
    let tokens = Arc::new(Tokens::default());
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(1))
        .budget(RetryBudget::custom(tokens.clone()))
        .build()
        .unwrap();
    let svc = RetryLayer::new(policy).layer(OnceThenStuck::default());
    let e = within_a_day("the call", svc.oneshot(get("/books/b1")))
        .await
        .expect_err("the deadline ends the wait");
    let e = RetryError::of(&*e).expect("a RetryError");
    assert!(e.is::<DeadlineExceeded>(), "{e}");
    assert_eq!(e.attempts(), 1);
    assert_eq!(tokens.withdrawn.load(Ordering::SeqCst), 1);
    assert_eq!(
        tokens.refunded.load(Ordering::SeqCst),
        1,
        "the unsent retry's token is given back"
    );
}

/// A retry sent to a hedge below that never finds its service ready: the hedge answers that
/// nothing was sent, and the retry layer gives back the token that paid for that retry (the
/// budget pays for load on the server; an attempt that never left costs none). (Before: every
/// such retry kept its token, one per head bound, while nothing reached the server; found by the
/// simulator's budget promise, seed 4100734.)
#[tokio::test(start_paused = true)]
async fn a_retry_a_hedge_below_never_sent_gives_its_token_back() {
    let retry_tokens = Arc::new(Tokens::default());
    let hedge_tokens = Arc::new(Tokens::default());
    let backend = OnceThenStuck::default();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(
            RetryPolicy::builder()
                .total_timeout(Duration::from_secs(5))
                .response_head_timeout(Duration::from_secs(1))
                .budget(RetryBudget::custom(retry_tokens.clone()))
                .build()
                .unwrap(),
        ))
        .layer(HedgeLayer::new(
            HedgePolicy::builder()
                .max_attempts(2)
                .hedging_delay(Duration::from_millis(50))
                .response_head_timeout(Duration::from_secs(1))
                .budget(RetryBudget::custom(hedge_tokens.clone()))
                .build()
                .unwrap(),
        ))
        .service(backend.clone());
    let _ = within_a_day("the call", svc.oneshot(get("/books/b1"))).await;
    assert_eq!(
        backend.0.load(Ordering::SeqCst),
        1,
        "only the first attempt left"
    );
    let withdrawn = retry_tokens.withdrawn.load(Ordering::SeqCst);
    assert!(withdrawn >= 2, "the call retried: {withdrawn} tokens");
    assert_eq!(
        retry_tokens.refunded.load(Ordering::SeqCst),
        withdrawn,
        "every retry that never left gave its token back"
    );
    assert_eq!(
        hedge_tokens.refunded.load(Ordering::SeqCst),
        hedge_tokens.withdrawn.load(Ordering::SeqCst),
        "and so did every hedge"
    );
}

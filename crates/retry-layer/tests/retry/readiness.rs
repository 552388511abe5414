//! Over real sockets: while retrying, waiting for the inner service to be ready and for
//! the rebuild hook is bounded by the call's deadline.

use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use retry_layer::{
    Conflict, Deadline, DeadlineExceeded, ReplayBody, RetryError, RetryLayer, RetryPolicy,
};
use tokio::sync::Notify;
use tokio::time::Duration;
use tower::buffer::Buffer;
use tower::limit::ConcurrencyLimit;
use tower::{Service, ServiceExt};

use crate::wire::*;

/// A `tower::buffer::Buffer` (what a tonic `Channel` is) in front of a slow service: once it is
/// saturated its `poll_ready` stays pending. A retry waiting there ends at the deadline instead
/// of outliving it (before: it waited as long as the buffer stayed full, here forever).
#[tokio::test]
async fn a_retry_waiting_for_a_saturated_buffer_ends_at_the_deadline() {
    for proto in Transport::BOTH {
        let server = serve(|path, _| match path {
            "/slow" => status(200),
            _ => status(503),
        })
        .await;
        // The slow service: a "/slow" call holds its slot until the test ends.
        let never = Arc::new(Notify::new());
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(proto == Transport::Http2)
                .build_http::<ReplayBody<Full<Bytes>>>();
        let slow = tower::service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
            let (http, never) = (http.clone(), never.clone());
            async move {
                let slow = req.uri().path() == "/slow";
                let res = http.oneshot(req).await?;
                if slow {
                    never.notified().await;
                }
                Ok::<_, hyper_util::client::legacy::Error>(res)
            }
        });
        // One call in flight at a time, one waiting in the buffer.
        let buffer = Buffer::new(ConcurrencyLimit::new(slow, 1), 1);
        let layer = RetryLayer::new(RetryPolicy::default());
        let mut retry = tower::Layer::layer(&layer, buffer.clone());

        // The call's first attempt goes through and gets a 503 ...
        let mut req = Request::get(server.url("/books/b1"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_millis(400)));
        bounded("readiness", retry.ready()).await.unwrap();
        let call = retry.call(req);
        // ... while three slow calls take the concurrency slot, the worker's hand and the
        // buffer's one place, so that the retry finds the buffer saturated.
        let no_retries = RetryLayer::new(RetryPolicy::builder().max_attempts(1).build().unwrap());
        for _ in 0..3 {
            let hog = tower::Layer::layer(&no_retries, buffer.clone());
            let req = Request::get(server.url("/slow"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            tokio::spawn(hog.oneshot(req));
        }
        let err = bounded("the call", call).await.unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert!(err.is::<DeadlineExceeded>(), "{proto:?}: {err}");
        assert_eq!(
            err.attempts(),
            1,
            "{proto:?}: the retry waited for readiness: {err}"
        );
        let retries_seen = server
            .seen()
            .iter()
            .filter(|s| s.headers.contains_key("x-previous-attempts"))
            .count();
        assert_eq!(
            retries_seen, 0,
            "{proto:?}: the retry never got past the buffer"
        );
    }
}

/// A rebuild hook that never finishes: the call ends at its deadline.
#[tokio::test]
async fn a_hook_that_never_finishes_ends_at_the_deadline() {
    for proto in Transport::BOTH {
        let server =
            serve(|_, _| Act::Status(409, vec![("x-reason-code", "STOCK_CONFLICT")])).await;
        let policy = RetryPolicy::builder()
            .rebuild_on_conflict(|_c: Conflict| std::future::pending())
            .build()
            .unwrap();
        let layer = RetryLayer::new(policy);
        let mut req = Request::post(server.url("/orders"))
            .header("x-idempotency-key", "order-7f3a9c21")
            .body(full("{}"))
            .unwrap();
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_millis(300)));
        let err = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert!(err.is::<DeadlineExceeded>(), "{proto:?}: {err}");
        assert_eq!(err.attempts(), 1);
    }
}

/// A service whose `poll_ready` never resolves (a Buffer whose worker keeps connecting to a
/// host that does not answer), counting the calls that reach it.
#[derive(Clone, Default)]
struct NeverReady {
    called: Arc<std::sync::atomic::AtomicUsize>,
}

impl Service<Request<ReplayBody<Full<Bytes>>>> for NeverReady {
    type Response = http::Response<Full<Bytes>>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, std::io::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::io::Error>> {
        std::task::Poll::Pending
    }

    fn call(&mut self, _req: Request<ReplayBody<Full<Bytes>>>) -> Self::Future {
        self.called
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::future::ready(Ok(http::Response::new(Full::new(Bytes::new()))))
    }
}

fn post() -> Request<Full<Bytes>> {
    Request::post("http://backend/orders")
        .header("x-idempotency-key", "order-never-ready")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Readiness before the first attempt is bounded too, in the response future (`poll_ready` is
/// ready at once): by `total_timeout` (a `DeadlineExceeded`), else by `response_head_timeout`
/// (a `ServiceNotReady`), for `Retry` with the default policy and for `Hedge`; nothing reaches
/// the service.
#[tokio::test(start_paused = true)]
async fn a_service_that_never_becomes_ready_ends_the_call_at_its_bound() {
    let never = NeverReady::default();
    let default = tower::Layer::layer(&RetryLayer::new(RetryPolicy::default()), never.clone());
    let started = tokio::time::Instant::now();
    let e = default.oneshot(post()).await.expect_err("never ready");
    let e = RetryError::of(&*e).expect("a RetryError");
    assert_eq!(e.attempts(), 0);
    let not_ready = e
        .downcast_ref::<retry_layer::ServiceNotReady>()
        .unwrap_or_else(|| panic!("a ServiceNotReady: {e}"));
    assert_eq!(not_ready.waited(), Duration::from_secs(60));
    assert_eq!(started.elapsed(), Duration::from_secs(60));

    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let bounded = tower::Layer::layer(&RetryLayer::new(policy), never.clone());
    let started = tokio::time::Instant::now();
    let e = bounded.oneshot(post()).await.expect_err("never ready");
    let e = RetryError::of(&*e).expect("a RetryError");
    assert!(e.is::<DeadlineExceeded>(), "a DeadlineExceeded: {e}");
    assert_eq!(started.elapsed(), Duration::from_secs(1));

    let hedge = retry_layer::hedge::HedgeLayer::new(retry_layer::hedge::HedgePolicy::default());
    let hedged = tower::Layer::layer(&hedge, never.clone());
    let e = hedged
        .oneshot(
            Request::get("http://backend/books")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .expect_err("never ready");
    assert!(
        e.is::<retry_layer::ServiceNotReady>(),
        "a ServiceNotReady: {e}"
    );
    assert_eq!(never.called.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// The call's `total_timeout` counts from the call, and the wait for readiness is in it: a
/// call that waited 800 ms of its 1 s for the service has 200 ms left for its attempts.
#[tokio::test(start_paused = true)]
async fn the_total_timeout_counts_the_wait_for_readiness() {
    let svc = tower::service_fn(|_req: Request<ReplayBody<Full<Bytes>>>| async {
        // The backend answers after 500 ms.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok::<_, std::io::Error>(http::Response::new(Full::new(Bytes::new())))
    });
    let limited = tower::limit::ConcurrencyLimit::new(svc, 1);
    // The only permit is held for 800 ms by another holder of the same semaphore-backed limit.
    let mut holder = limited.clone();
    holder.ready().await.unwrap();
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let retry = tower::Layer::layer(&RetryLayer::new(policy), limited);
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        drop(holder);
    });
    let started = tokio::time::Instant::now();
    let e = retry.oneshot(post()).await.expect_err("past the deadline");
    let deadline = std::iter::successors(Some(&*e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|e| e.is::<DeadlineExceeded>());
    assert!(deadline, "a DeadlineExceeded: {e}");
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    release.await.unwrap();
}

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
    for proto in BOTH {
        let server = serve(|path, _| match path {
            "/slow" => status(200),
            _ => status(503),
        })
        .await;
        // The slow service: a "/slow" call holds its slot until the test ends.
        let never = Arc::new(Notify::new());
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(proto == Proto::H2)
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
    for proto in BOTH {
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

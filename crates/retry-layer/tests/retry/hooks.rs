//! The caller's say in retries, over real sockets (hyper-util's client over HTTP/1.1 and h2c):
//! a `retry_if` predicate that declines, an `on_retry` callback told of each retry, and the
//! per-request `NoRetry` opt-out. None of them can make the layer retry what the table does not.

use std::sync::{Arc, Mutex};

use http::{Method, Request};
use reason_code::{Code, Outcome};
use retry_layer::{NoRetry, RetryLayer, RetryPolicy};
use tower::ServiceExt;

use crate::wire::*;

/// Declines every retry of `/quota`; leaves the others to the table.
fn declining_quota() -> RetryLayer {
    RetryLayer::new(
        RetryPolicy::builder()
            .retry_if(|c| c.request.uri.path() != "/quota")
            .build()
            .unwrap(),
    )
}

/// A 503 of a path the predicate declines is the answer after one attempt, and it is counted
/// as declined; another path on the same layer is retried as the table says.
#[tokio::test]
async fn a_declined_retry_answers_after_one_attempt() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n == 0 { status(503) } else { status(200) }).await;
        let layer = declining_quota();
        let get = |path: &str| Request::get(server.url(path)).body(full("")).unwrap();

        let res = bounded(
            "the declined call",
            client(&layer, proto).oneshot(get("/quota")),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}: the attempt's answer");
        let res = bounded(
            "the allowed call",
            client(&layer, proto).oneshot(get("/books")),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}: retried");

        assert_eq!(server.seen().len(), 3, "{proto:?}: one attempt, then two");
        let stats = layer.stats();
        assert_eq!(
            (stats.declined, stats.retries),
            (1, 1),
            "{proto:?}: {stats:?}"
        );
    }
}

/// A predicate that answers `true` to everything cannot make the layer resend a write without
/// a key: the table says it may have executed.
#[tokio::test]
async fn a_predicate_cannot_retry_a_write_without_a_key() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| status(503)).await;
        let layer = RetryLayer::new(RetryPolicy::builder().retry_if(|_| true).build().unwrap());
        let req = Request::post(server.url("/orders"))
            .body(full("{\"qty\":1}"))
            .unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(server.seen().len(), 1, "{proto:?}: sent once");
        let stats = layer.stats();
        assert_eq!(
            (stats.attempts, stats.declined),
            (1, 0),
            "{proto:?}: {stats:?}"
        );
    }
}

/// The callback hears each retry before its wait: the attempt that ended, its outcome, the
/// delay and the request; the call's answer is the last attempt's.
#[tokio::test]
async fn on_retry_hears_each_retry() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n < 2 { status(503) } else { status(200) }).await;
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let layer = RetryLayer::new(
            RetryPolicy::builder()
                .on_retry(move |e| {
                    h.lock().unwrap().push((
                        e.attempt,
                        e.outcome,
                        e.code,
                        e.request.method.clone(),
                        e.request.uri.path().to_owned(),
                        e.delay > std::time::Duration::ZERO,
                        e.rebuild,
                    ))
                })
                .build()
                .unwrap(),
        );
        let req = Request::put(server.url("/books/1"))
            .body(full("v2"))
            .unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        let unavailable = Outcome::Status(Code::Unavailable);
        let expected: Vec<_> = [1, 2]
            .into_iter()
            .map(|attempt| {
                (
                    attempt,
                    unavailable,
                    Code::Unavailable,
                    Method::PUT,
                    "/books/1".to_owned(),
                    true,
                    false,
                )
            })
            .collect();
        assert_eq!(*heard.lock().unwrap(), expected, "{proto:?}");
    }
}

/// A callback that panics is logged, and the retry goes on.
#[tokio::test]
async fn a_panicking_callback_does_not_stop_the_retry() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n == 0 { status(503) } else { status(200) }).await;
        let layer = RetryLayer::new(
            RetryPolicy::builder()
                .on_retry(|_| panic!("a bug in the caller's callback"))
                .build()
                .unwrap(),
        );
        let req = Request::get(server.url("/books/1")).body(full("")).unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        assert_eq!(server.seen().len(), 2, "{proto:?}");
    }
}

/// `NoRetry` on a request: a keyed write the table would retry is sent once, and the 503 is
/// the answer; the next request, without it, is retried by the same layer.
#[tokio::test]
async fn no_retry_on_a_request_sends_it_once() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n % 2 == 0 { status(503) } else { status(201) }).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let write = |opt_out: bool| {
            let mut req = Request::post(server.url("/orders"))
                .header("x-idempotency-key", "order-1")
                .body(full("{\"qty\":1}"))
                .unwrap();
            if opt_out {
                req.extensions_mut().insert(NoRetry);
            }
            req
        };
        let res = bounded(
            "the opted-out call",
            client(&layer, proto).oneshot(write(true)),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}: sent once");
        assert_eq!(server.seen().len(), 1, "{proto:?}");
        assert_eq!(layer.stats().declined, 1, "{proto:?}");

        // Answered 201 on its first attempt (the server's second request): no retry either way.
        let _ = bounded(
            "a call between",
            client(&layer, proto).oneshot(write(false)),
        )
        .await;
        // The server answers 503 again: this one is retried.
        let res = bounded(
            "the retried call",
            client(&layer, proto).oneshot(write(false)),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}: retried");
        assert_eq!(server.seen().len(), 4, "{proto:?}");
    }
}

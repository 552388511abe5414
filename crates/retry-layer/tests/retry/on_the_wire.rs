//! Retries over real sockets: hyper-util's client over HTTP/1.1 and h2c against a hyper server
//! of the test's own. Each test runs once per protocol.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use reason_code::BoxError;
use reason_code::Code;
use retry_layer::{Conflict, RetryError, RetryInfo, RetryLayer, RetryPolicy, RetryPolicyBuilder};
use tower::ServiceExt;

use crate::wire::*;

/// A layer whose policy generates a key for keyless writes (so they may be retried), tuned
/// further by `tune`.
fn keyed_layer(tune: impl FnOnce(RetryPolicyBuilder) -> RetryPolicyBuilder) -> RetryLayer {
    RetryLayer::new(
        tune(RetryPolicy::builder().ensure_idempotency_key())
            .build()
            .unwrap(),
    )
}

/// A 409 STOCK_CONFLICT reaches the rebuild hook over a real transport (before,
/// hyper stopped at `is_end_stream()` and the hook never ran), with a body that streams in
/// chunks and has trailers. The hook builds a fresh POST without the key; the rebuilt write
/// keeps the intent's key, so the ambiguous failure that follows is retried with it.
#[tokio::test]
async fn conflict_409_is_rebuilt_by_the_hook_and_keeps_the_intents_key() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| match n {
            0 => Act::Status(409, vec![("x-reason-code", "STOCK_CONFLICT")]),
            1 => Act::Close,
            _ => status(201),
        })
        .await;
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let url = server.url("/orders");
        let policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .rebuild_on_conflict(move |conflict: Conflict| {
                c.fetch_add(1, Ordering::SeqCst);
                let url = url.clone();
                async move {
                    assert_eq!(conflict.code, Code::Aborted);
                    assert_eq!(conflict.request.body(), "{\"sku\":\"b1\",\"qty\":1}");
                    // A fresh request, as a caller re-reading the stock would build it: no key.
                    Some(
                        Request::post(url)
                            .body(Bytes::from_static(b"{\"sku\":\"b1\",\"qty\":1,\"v\":2}"))
                            .unwrap(),
                    )
                }
            })
            .build()
            .unwrap();
        let layer = RetryLayer::new(policy);
        let req = streaming_request(
            Method::POST,
            server.url("/orders"),
            &["{\"sku\":", "\"b1\",", "\"qty\":1}"],
        );
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "{proto:?}: the hook ran once"
        );
        let seen = server.seen();
        assert_eq!(seen.len(), 3, "{proto:?}");
        assert_eq!(seen[0].body, "{\"sku\":\"b1\",\"qty\":1}");
        assert_eq!(seen[0].trailers, Some(checksum_trailers()), "{proto:?}");
        assert_eq!(seen[1].body, "{\"sku\":\"b1\",\"qty\":1,\"v\":2}");
        assert_eq!(seen[2].body, seen[1].body);
        let key = RetryInfo::of(&res)
            .unwrap()
            .idempotency_key
            .clone()
            .unwrap();
        for (i, s) in seen.iter().enumerate() {
            assert_eq!(
                s.headers.get("x-idempotency-key"),
                Some(&key),
                "{proto:?}: attempt {} carries the intent's key",
                i + 1
            );
        }
        assert_eq!(layer.stats().retries, 2);
    }
}

/// A body that streams in chunks and ends with trailers is replayed whole, trailers
/// included (before, the retry went out without them).
#[tokio::test]
async fn a_chunked_body_with_trailers_is_replayed_with_its_trailers() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n == 0 { status(503) } else { status(200) }).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let req = streaming_request(Method::PUT, server.url("/blobs/1"), &["part-1 ", "part-2"]);
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        let seen = server.seen();
        assert_eq!(seen.len(), 2, "{proto:?}");
        for s in &seen {
            assert_eq!(s.body, "part-1 part-2", "{proto:?}");
            assert_eq!(s.trailers, Some(checksum_trailers()), "{proto:?}");
        }
    }
}

/// The connection closes after every request was read (it may have executed). The
/// layer gives up, and its error tells the caller the attempts and the generated key, so a
/// retry of the caller's own is the same intent.
#[tokio::test]
async fn close_after_read_gives_an_error_that_carries_the_key() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| Act::Close).await;
        let layer = keyed_layer(|p| p);
        let req = Request::post(server.url("/orders"))
            .body(full("{\"qty\":1}"))
            .unwrap();
        let err = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert_eq!(err.attempts(), 3, "{proto:?}: {err}");
        assert_eq!(
            err.kind(),
            retry_layer::RetryErrorKind::Ambiguous,
            "{proto:?}"
        );
        assert!(err.may_have_executed(), "{proto:?}: the server read it");
        let key = err.idempotency_key().expect("the generated key");
        let seen = server.seen();
        assert_eq!(seen.len(), 3, "{proto:?}");
        assert!(seen
            .iter()
            .all(|s| s.headers.get("x-idempotency-key") == Some(key)));
        assert!(err.to_string().contains(key.to_str().unwrap()), "{err}");
        assert!(std::error::Error::source(err).is_some());
    }
}

/// The server answers 503 after the first chunk while the client is still streaming.
/// The first attempt's transport may keep reading; the retry must get every chunk, woken as
/// they arrive.
#[tokio::test]
async fn an_early_503_while_the_body_streams_is_retried_with_the_whole_body() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| {
            if n == 0 {
                Act::AfterFirstFrame(503)
            } else {
                status(200)
            }
        })
        .await;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Frame<Bytes>, BoxError>>();
        let mut rx = rx;
        let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
        let req = Request::put(server.url("/blobs/2"))
            .body(body.boxed())
            .unwrap();
        let layer = RetryLayer::new(RetryPolicy::default());
        tx.send(Ok(Frame::data(Bytes::from_static(b"one "))))
            .unwrap();
        let call = tokio::spawn(client(&layer, proto).oneshot(req));
        // Stream the rest once the first attempt was answered and the retry started.
        bounded("the first answer", async {
            while layer.stats().attempts < 2 {
                tokio::time::sleep(tokio::time::Duration::from_millis(5)).await;
            }
        })
        .await;
        for c in ["two ", "three ", "four"] {
            tx.send(Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
                .unwrap();
            tokio::task::yield_now().await;
        }
        drop(tx);
        let res = bounded("the retry", call).await.unwrap().unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        let seen = server.seen();
        assert_eq!(server.hits(), 2, "{proto:?}");
        assert_eq!(seen.len(), 1, "{proto:?}: only the retry was read whole");
        assert_eq!(seen[0].body, "one two three four", "{proto:?}");
    }
}

/// Conflicts without a hook are not failures the policy could retry, so they do not
/// drain a gRFC A6 token bucket; the 503 that follows is still retried.
#[tokio::test]
async fn conflicts_without_a_hook_leave_the_token_bucket_alone() {
    for proto in Transport::BOTH {
        let server = serve(|path, n| match path {
            "/orders" => Act::Status(409, vec![("x-reason-code", "STOCK_CONFLICT")]),
            _ if n == 0 => status(503),
            _ => status(200),
        })
        .await;
        let layer = RetryLayer::new(
            RetryPolicy::builder()
                .budget(retry_layer::budget::RetryBudget::token_bucket(10, 0.1))
                .build()
                .unwrap(),
        );
        for _ in 0..10 {
            let req = Request::post(server.url("/orders"))
                .body(full("{}"))
                .unwrap();
            let res = bounded("a conflict", client(&layer, proto).oneshot(req))
                .await
                .unwrap();
            assert_eq!(res.status(), 409);
        }
        let req = Request::get(server.url("/books/b1"))
            .body(full(""))
            .unwrap();
        let res = bounded("the read", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}: the 503 was retried");
        assert_eq!(layer.stats().budget_refusals, 0, "{proto:?}");
    }
}

/// 421 Misdirected Request and 425 Too Early were not processed: retried for a POST
/// without a key.
#[tokio::test]
async fn misdirected_and_too_early_are_retried_for_any_method() {
    for proto in Transport::BOTH {
        for code in [421, 425] {
            let server = serve(move |_, n| if n == 0 { status(code) } else { status(201) }).await;
            let layer = RetryLayer::new(RetryPolicy::default());
            let req = Request::post(server.url("/orders"))
                .body(full("{}"))
                .unwrap();
            let res = bounded("the call", client(&layer, proto).oneshot(req))
                .await
                .unwrap();
            assert_eq!(res.status(), 201, "{proto:?} {code}");
            assert_eq!(server.seen().len(), 2, "{proto:?} {code}");
        }
    }
}

/// A body whose bytes are all at hand (`Full`, exact size) is taken once when the request is
/// wrapped and sent whole by every attempt, over HTTP/1.1 and h2; with one attempt allowed
/// (nothing of the body kept), the one attempt still carries it whole.
#[tokio::test]
async fn a_whole_body_is_sent_whole_by_every_attempt() {
    const BODY: &str = "{\"sku\":\"b1\",\"qty\":3}";
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n < 2 { status(503) } else { status(201) }).await;
        let layer = keyed_layer(|p| p);
        let req = Request::post(server.url("/orders"))
            .body(full(BODY))
            .unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}");
        let seen = server.seen();
        assert_eq!(seen.len(), 3, "{proto:?}");
        for s in &seen {
            assert_eq!(
                s.body, BODY,
                "{proto:?}: every attempt carries the whole body"
            );
            assert_eq!(
                s.headers.get("content-length").map(|v| v.as_bytes()),
                Some(BODY.len().to_string().as_bytes()),
                "{proto:?}: the exact length is declared"
            );
        }

        let once = serve(|_, _| status(503)).await;
        let layer = keyed_layer(|p| p.max_attempts(1));
        let req = Request::post(once.url("/orders")).body(full(BODY)).unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}");
        let seen = once.seen();
        assert_eq!(seen.len(), 1, "{proto:?}");
        assert_eq!(seen[0].body, BODY, "{proto:?}");
    }
}

/// A streaming body with no size hint whose frames are all at hand when the request is sent
/// (a tonic unary request is one) is read whole when it is wrapped: every attempt carries the
/// whole body, now with its exact length declared (Content-Length on HTTP/1.1, not chunked),
/// over HTTP/1.1 and h2.
#[tokio::test]
async fn a_streaming_body_at_hand_is_sent_whole_by_every_attempt() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n < 2 { status(503) } else { status(201) }).await;
        let layer = keyed_layer(|p| p);
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = ["{\"sku\":", "\"b1\"}"]
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(frames));
        assert!(http_body::Body::size_hint(&body).exact().is_none());
        let req = Request::post(server.url("/orders"))
            .body(body.boxed())
            .unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}");
        let seen = server.seen();
        assert_eq!(seen.len(), 3, "{proto:?}");
        for s in &seen {
            assert_eq!(s.body, "{\"sku\":\"b1\"}", "{proto:?}");
            assert_eq!(
                s.headers.get("content-length").map(|v| v.as_bytes()),
                Some(&b"12"[..]),
                "{proto:?}: the exact length is declared"
            );
            assert!(s.headers.get("transfer-encoding").is_none(), "{proto:?}");
        }
    }
}

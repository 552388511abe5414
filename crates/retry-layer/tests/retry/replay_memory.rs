//! Copies kept for replay end with the call, and all calls of a layer keep at
//! most `max_replay_bytes_total` at once.

use bytes::Bytes;
use http::Request;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use reason_code::BoxError;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{Service, ServiceExt};

use crate::support::{backend, status, within_a_day, Reply};
use crate::wire::{bounded, client, serve, Act, Transport};

/// A client stream answered before it ends (a transport keeps sending it: h2 streams on, HTTP/1
/// keeps writing): once the call has its answer, nothing of the body is kept any more. Before,
/// the copy grew to `max_replay_bytes` and lived as long as the stream.
#[tokio::test]
async fn a_body_still_streaming_after_the_answer_is_not_kept() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| Act::AfterFirstFrame(200)).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
        let req = Request::put(server.url("/blobs/1"))
            .body(body.boxed())
            .unwrap();
        let call = tokio::spawn(client(&layer, proto).oneshot(req));
        let chunk = || Ok(Frame::data(Bytes::from(vec![b'x'; 8 * 1024])));
        tx.send(chunk()).await.unwrap();
        let res = bounded("the answer", call).await.unwrap().unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        drop(res);
        for _ in 0..4 {
            bounded("the transport reads on", tx.send(chunk()))
                .await
                .unwrap();
        }
        // The slot is free again once the transport has taken the last chunk.
        drop(bounded("the last chunk read", tx.reserve()).await.unwrap());
        assert_eq!(
            layer.stats().replay_bytes,
            0,
            "{proto:?}: the call has its answer, so its copy is gone"
        );
    }
}

fn put(len: usize) -> Request<Full<Bytes>> {
    Request::put("http://svc/blobs/1")
        .body(Full::new(Bytes::from(vec![b'x'; len])))
        .unwrap()
}

/// The layer's bound on what all its calls keep: a call whose copy does not fit is sent
/// without one, so its 503 is not retried; once the call holding the room ends, the next one
/// is retried again.
#[tokio::test(start_paused = true)]
async fn calls_keep_at_most_max_replay_bytes_total_together() {
    let (svc, script) =
        backend::<Full<Bytes>>(vec![Reply::Never, status(503), status(503), status(200)]);
    let layer = RetryLayer::new(
        RetryPolicy::builder()
            .max_replay_bytes_total(10 * 1024)
            .build()
            .unwrap(),
    );
    let mut retry = tower::Layer::layer(&layer, svc);

    // A holds 6 KiB while its server does not answer.
    let mut a = Box::pin(retry.ready().await.unwrap().call(put(6 * 1024)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(std::future::Future::poll(a.as_mut(), &mut cx).is_pending());
    assert_eq!(layer.stats().replay_bytes, 6 * 1024);

    // B's 6 KiB do not fit beside it: sent once, its 503 returned.
    let b = within_a_day("B", retry.ready().await.unwrap().call(put(6 * 1024)))
        .await
        .unwrap();
    assert_eq!(b.status(), 503);
    assert_eq!(script.attempts(), 2);
    assert_eq!(layer.stats().retries, 0);

    // A ends; C is retried.
    drop(a);
    assert_eq!(layer.stats().replay_bytes, 0);
    let c = within_a_day("C", retry.ready().await.unwrap().call(put(6 * 1024)))
        .await
        .unwrap();
    assert_eq!(c.status(), 200);
    assert_eq!(script.attempts(), 4);
    assert_eq!(layer.stats().retries, 1);
    assert_eq!(layer.stats().replay_bytes, 0, "C's copy is gone with C");
}

/// A request that was never sent (here: connection refused) is retried even when the layer's
/// memory could not hold a copy of its body: the body read whole is kept until the attempt's
/// outcome is known, and resent byte for byte. After an outcome that may have run (a reset),
/// it is gone and the request is not retried. Before, the first refusal was the answer.
#[tokio::test(start_paused = true)]
async fn a_body_the_memory_cannot_hold_is_resent_when_nothing_was_sent() {
    use std::io::ErrorKind::{ConnectionRefused, ConnectionReset};

    let policy = || {
        RetryPolicy::builder()
            .max_replay_bytes_total(1024)
            .build()
            .unwrap()
    };
    let body = Bytes::from(vec![b'x'; 4 * 1024]);
    let req = |method: http::Method| {
        Request::builder()
            .method(method)
            .uri("http://svc/orders")
            .body(Full::new(body.clone()))
            .unwrap()
    };

    // A POST: nothing ran, so it is resent, whatever its method.
    let replies = vec![Reply::Io(ConnectionRefused), status(201)];
    let (res, script, layer) =
        crate::support::call_scripted(policy(), req(http::Method::POST), replies).await;
    assert_eq!(res.unwrap().status(), 201);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.body == body), "the same bytes");
    assert_eq!(layer.stats().retries, 1);
    assert_eq!(layer.stats().replay_bytes, 0, "never counted as kept");

    // A PUT refused, then reset: the reset attempt may have run, and the body is not kept.
    let replies = vec![
        Reply::Io(ConnectionRefused),
        Reply::Io(ConnectionReset),
        status(200),
    ];
    let (res, script, layer) =
        crate::support::call_scripted(policy(), req(http::Method::PUT), replies).await;
    let err = res.unwrap_err();
    let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.attempts(), 2, "{err}");
    assert_eq!(script.attempts(), 2);
    assert_eq!(layer.stats().retries, 1);
}

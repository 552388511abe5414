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

/// Every byte the layer keeps is counted: a body whose copy the layer's memory cannot hold is
/// sent without replay, and no retry carries it, not even the retry of an attempt that was
/// never sent (here: connection refused). Nothing is held uncounted for it. (Before: the body
/// was held outside `max_replay_bytes_total`, invisible in `stats()`, until the attempt's
/// outcome was known.)
#[tokio::test(start_paused = true)]
async fn a_body_the_memory_cannot_hold_is_never_held_uncounted() {
    use std::io::ErrorKind::ConnectionRefused;

    let policy = RetryPolicy::builder()
        .max_replay_bytes_total(1024)
        .build()
        .unwrap();
    let body = Bytes::from(vec![b'x'; 4 * 1024]);
    let req = Request::post("http://svc/orders")
        .body(Full::new(body.clone()))
        .unwrap();
    let (svc, script) =
        crate::support::backend::<Full<Bytes>>(vec![Reply::Io(ConnectionRefused), status(201)]);
    let layer = retry_layer::RetryLayer::new(policy);
    let mut retry = tower::Layer::layer(&layer, svc);
    let call = retry.ready().await.unwrap().call(req);
    assert_eq!(
        layer.stats().replay_bytes,
        0,
        "nothing kept, nothing counted"
    );
    let err = within_a_day("the call", call).await.unwrap_err();
    let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.attempts(), 1, "not retried: {err}");
    assert_eq!(script.attempts(), 1);
    assert_eq!(
        script.seen()[0].body,
        body,
        "the first attempt sent it whole"
    );
    assert_eq!(layer.stats().retries, 0);
}

type Chunk = Result<Frame<Bytes>, BoxError>;

/// A streamed body, whole once its two chunks have come: `(body, sender)`.
fn two_chunk_body() -> (
    StreamBody<impl futures_util::Stream<Item = Chunk>>,
    tokio::sync::mpsc::Sender<Chunk>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Chunk>(2);
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    (body, tx)
}

/// A hedge of a body kept in two chunks sends one copy of it in one piece: made once, and
/// counted against the layer's memory like the chunks (while the call is in flight, the layer
/// keeps twice the body, and says so); when that copy does not fit, no hedge is sent. (Before:
/// the copy was uncounted, and made again at each wake of a hedge waiting for readiness.)
#[tokio::test(start_paused = true)]
async fn a_hedges_copy_of_the_body_is_counted() {
    use retry_layer::hedge::HedgePolicy;

    let chunk = Bytes::from(vec![b'x'; 1024]);
    for (total, hedged) in [(4 * 1024, true), (3 * 1024, false)] {
        let retries = RetryLayer::new(
            RetryPolicy::builder()
                .max_replay_bytes_total(total)
                .build()
                .unwrap(),
        );
        let hedging = HedgePolicy::builder()
            .max_attempts(2)
            .hedging_delay(std::time::Duration::from_millis(50))
            .hedge_writes()
            .build()
            .unwrap();
        let (svc, script) = backend(vec![Reply::Slow(std::time::Duration::from_secs(1), 200)]);
        let hedge_layer = retries.hedge_layer(hedging);
        let mut hedge = tower::Layer::layer(&hedge_layer, svc);
        let (body, tx) = two_chunk_body();
        let req = Request::put("http://svc/blobs/1")
            .header("x-idempotency-key", "blob-1")
            .body(body)
            .unwrap();
        tx.send(Ok(Frame::data(chunk.clone()))).await.unwrap();
        let call = tokio::spawn(hedge.ready().await.unwrap().call(req));
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        tx.send(Ok(Frame::data(chunk.clone()))).await.unwrap();
        drop(tx);
        // Past the hedging delay: the hedge is sent, or not.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let expected = if hedged { 4 * 1024 } else { 2 * 1024 };
        assert_eq!(
            retries.stats().replay_bytes,
            expected,
            "{total}: the chunks, and the copy in one piece if it fits"
        );
        assert_eq!(
            hedge_layer.stats().replay_bytes,
            expected,
            "{total}: the hedge layer shows the memory it shares"
        );
        let res = within_a_day("the call", call).await.unwrap().unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(script.attempts(), if hedged { 2 } else { 1 }, "{total}");
        for seen in script.seen() {
            assert_eq!(seen.body.len(), 2 * 1024, "{total}: the whole body");
        }
        assert_eq!(retries.stats().replay_bytes, 0, "{total}: all given back");
        assert_eq!(hedge_layer.stats().replay_bytes, 0, "{total}");
    }
}

/// A frame's bytes that count themselves while alive (wherever a clone of them is).
struct Counted(Vec<u8>, std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.1
            .fetch_sub(self.0.len(), std::sync::atomic::Ordering::SeqCst);
    }
}

/// The same for a streamed body whose first frame the layer read when it wrapped the body (it
/// was at hand) and whose copy the layer's memory cannot hold, over sockets (HTTP/1.1 and h2c):
/// the first attempt goes to a port nothing listens on (refused: never sent). That frame is
/// held for the first attempt only and never counted, so no retry carries the body: the call
/// ends at once with the refusal, the server sees nothing, and the frame is let go with the
/// call. (Before: the retry of the refused attempt kept the frame through its backoff, outside
/// `max_replay_bytes_total`; simulator seeds 4100379, 4101394, 4102246.)
#[tokio::test]
async fn a_frame_read_at_wrap_time_the_memory_cannot_hold_is_never_kept_for_a_retry() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    for proto in [Transport::Http1, Transport::Http2] {
        let server = serve(|_, _| crate::wire::status(201)).await;
        let closed = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let live = Arc::new(AtomicUsize::new(0));
        let (body, tx) = two_chunk_body();
        live.fetch_add(2048, Ordering::SeqCst);
        let first = Bytes::from_owner(Counted(vec![b'x'; 2048], live.clone()));
        tx.try_send(Ok(Frame::data(first))).unwrap();
        let req = Request::post(server.url("/orders"))
            .body(BodyExt::boxed(body))
            .unwrap();
        let layer = RetryLayer::new(
            RetryPolicy::builder()
                .max_replay_bytes_total(1024)
                .build()
                .unwrap(),
        );
        // The first attempt goes to the closed port, and the rest of the body comes then: a
        // retry, if there were one, would reach the server with the whole body.
        let client = proto.client::<retry_layer::ReplayBody<crate::wire::TestBody>>();
        let rest = Arc::new(Mutex::new(Some(tx)));
        let sent = Arc::new(AtomicUsize::new(0));
        let router = tower::service_fn(move |mut req: Request<_>| {
            if sent.fetch_add(1, Ordering::SeqCst) == 0 {
                *req.uri_mut() = format!("http://{closed}/orders").parse().unwrap();
                if let Some(tx) = rest.lock().unwrap().take() {
                    tx.try_send(Ok(Frame::data(Bytes::from_static(b"y"))))
                        .unwrap();
                }
            }
            client.request(req)
        });
        let retry = tower::Layer::layer(&layer, router);
        let err = bounded("the call", retry.oneshot(req)).await.unwrap_err();
        let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
        assert_eq!(err.attempts(), 1, "{proto:?}: not retried: {err}");
        assert_eq!(server.hits(), 0, "{proto:?}");
        assert_eq!(layer.stats().retries, 0, "{proto:?}");
        assert_eq!(layer.stats().replay_bytes, 0, "{proto:?}");
        assert_eq!(
            live.load(Ordering::SeqCst),
            0,
            "{proto:?}: the frame went with the call"
        );
    }
}

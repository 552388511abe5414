//! Over real sockets (HTTP/1.1 and h2c): what the layer's read of a request body at wrap
//! time may and may not do. It polls before any transport does: the waker it
//! polls with must lead to the transport's, and an error it meets must end the call before
//! anything is sent.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use reason_code::BoxError;
use retry_layer::{RetryError, RetryLayer, RetryPolicy};
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::wire::*;

/// A body whose one chunk arrives later, and which keeps the first waker it is polled with (as
/// a body built on a one-shot registration does).
#[derive(Clone, Default)]
struct FirstWaker {
    data: Arc<Mutex<Option<Bytes>>>,
    waker: Arc<Mutex<Option<Waker>>>,
    /// Polls so far, and a notification at each.
    polls: Arc<Mutex<usize>>,
    polled: Arc<Notify>,
}

impl FirstWaker {
    /// Hands the chunk over and wakes whoever registered first.
    fn feed(&self, chunk: &'static str) {
        *self.data.lock().unwrap() = Some(Bytes::from_static(chunk.as_bytes()));
        if let Some(w) = self.waker.lock().unwrap().take() {
            w.wake();
        }
    }

    /// Waits until the body was polled at least `n` times.
    async fn polled_at_least(&self, n: usize) {
        loop {
            let notified = self.polled.notified();
            if *self.polls.lock().unwrap() >= n {
                return;
            }
            notified.await;
        }
    }
}

struct FirstWakerBody {
    shared: FirstWaker,
    done: bool,
}

impl Body for FirstWakerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        *self.shared.polls.lock().unwrap() += 1;
        self.shared.polled.notify_waiters();
        if self.done {
            return Poll::Ready(None);
        }
        let chunk = self.shared.data.lock().unwrap().take();
        if let Some(chunk) = chunk {
            self.done = true;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        self.shared
            .waker
            .lock()
            .unwrap()
            .get_or_insert_with(|| cx.waker().clone());
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// The read at wrap time polled with a no-op waker: a body that keeps its first waker then
/// woke nothing when its data came, and the request stalled forever after its head. Now that
/// waker leads to the transport's.
#[tokio::test]
async fn a_body_woken_after_the_transports_first_poll_reaches_the_server() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| status(201)).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let body = FirstWaker::default();
        let req = Request::post(server.url("/uploads"))
            .header("x-idempotency-key", "upload-0001")
            .body(
                FirstWakerBody {
                    shared: body.clone(),
                    done: false,
                }
                .boxed(),
            )
            .unwrap();
        let call = tokio::spawn(client(&layer, proto).oneshot(req));
        // Polled once at wrap time, then by the transport: only then does the data come.
        bounded("the transport's first poll", body.polled_at_least(2)).await;
        body.feed("chunk");
        let res = bounded("the upload", call).await.unwrap().unwrap();
        assert_eq!(res.status(), 201, "{proto:?}");
        assert_eq!(server.seen()[0].body, "chunk", "{proto:?}");
    }
}

/// A body that fails at once: the call ends with its error, and nothing reaches the server
/// (before, the head went out and the body's error cut the request mid-way: a request the
/// server saw start).
#[tokio::test]
async fn a_body_that_failed_before_any_byte_sends_nothing() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| status(201)).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let failing = http_body_util::StreamBody::new(futures_util::stream::iter([Err::<
            Frame<Bytes>,
            BoxError,
        >(
            "the upload's file is gone".into(),
        )]));
        let req = Request::post(server.url("/uploads"))
            .body(failing.boxed())
            .unwrap();
        let err = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert_eq!(err.inner().to_string(), "the upload's file is gone");
        assert_eq!(err.attempts(), 0, "{proto:?}");
        assert_eq!(server.hits(), 0, "{proto:?}: nothing was sent");
        assert_eq!(layer.stats().attempts, 0);
    }
}

/// A body that hands over its first bytes, then fails, all at once (an upload whose source
/// broke after its first read): the call ends with its error, and the server never gets a
/// request, let alone one whose body is those first bytes alone. Before, the layer announced
/// what it had read as the whole body (an exact size: a `Content-Length` of the bytes read)
/// and HTTP/1.1 sent a well-formed, truncated request that the server ran (simulator seed 832).
#[tokio::test]
async fn a_body_that_failed_after_its_first_bytes_sends_nothing() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| status(201)).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let failing = http_body_util::StreamBody::new(futures_util::stream::iter([
            Ok(Frame::data(Bytes::from_static(b"the first half"))),
            Err::<Frame<Bytes>, BoxError>("the upload's file is gone".into()),
        ]));
        let req = Request::post(server.url("/uploads"))
            .header("x-idempotency-key", "upload-0002")
            .body(failing.boxed())
            .unwrap();
        let err = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert_eq!(err.inner().to_string(), "the upload's file is gone");
        assert_eq!(err.attempts(), 0, "{proto:?}");
        assert_eq!(server.hits(), 0, "{proto:?}: nothing was sent");
        assert!(server.seen().is_empty(), "{proto:?}: {:?}", server.seen());
    }
}

//! [`Drain`]: a failed attempt's response body, read to its end and discarded while the call
//! waits for its retry, so that its connection is free for the retry: an HTTP/1 connection is
//! ready for its next request only once the body before it is read (dropped unread, all but a
//! body already received closes it), and an HTTP/2 connection's flow-control window is given
//! back as its frames are read (an unread body keeps it from every other stream).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Buf;
use http_body::Body;

/// The most of a failed response's body read to free its connection: past it, the body is
/// dropped unread (an HTTP/1 connection then closes; a pool opens another).
pub(crate) const DRAIN_LIMIT: usize = 64 * 1024;

/// A failed response's body, type-erased: what the response future polls while it waits.
pub(crate) type Draining = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Reads a body to its end (or to its first error, or past `left` bytes) and discards it.
struct Drain<R> {
    body: Pin<Box<R>>,
    left: usize,
}

/// Starts draining `body`.
pub(crate) fn drain<R>(body: R) -> Draining
where
    R: Body + Send + 'static,
{
    Box::pin(Drain {
        body: Box::pin(body),
        left: DRAIN_LIMIT,
    })
}

impl<R: Body> Future for Drain<R> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            match this.body.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) | Poll::Ready(Some(Err(_))) => return Poll::Ready(()),
                Poll::Ready(Some(Ok(frame))) => {
                    let n = frame.data_ref().map_or(0, Buf::remaining);
                    if n > this.left {
                        return Poll::Ready(());
                    }
                    this.left -= n;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use bytes::Bytes;
    use futures_util::StreamExt;
    use http_body::Frame;
    use http_body_util::StreamBody;

    use super::*;

    type Item = Result<Frame<Bytes>, std::io::Error>;

    fn frame(n: usize) -> Item {
        Ok(Frame::data(Bytes::from(vec![b'x'; n])))
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_is_read_to_its_end() {
        let ended = Arc::new(AtomicBool::new(false));
        let e = ended.clone();
        let frames = futures_util::stream::iter(vec![frame(10), frame(DRAIN_LIMIT - 10)]).chain(
            futures_util::stream::poll_fn(move |_| {
                e.store(true, Ordering::SeqCst);
                Poll::<Option<Item>>::Ready(None)
            }),
        );
        let drained = tokio::time::timeout(Duration::from_secs(1), drain(StreamBody::new(frames)));
        assert!(drained.await.is_ok());
        assert!(ended.load(Ordering::SeqCst), "read to its end");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_longer_than_the_limit_is_let_go() {
        // Past the limit, and then never ending: let go at the limit instead of read on.
        let frames = futures_util::stream::iter(vec![frame(DRAIN_LIMIT), frame(1)])
            .chain(futures_util::stream::pending::<Item>());
        let drained = tokio::time::timeout(Duration::from_secs(1), drain(StreamBody::new(frames)));
        assert!(drained.await.is_ok(), "let go at the limit");
    }

    use std::time::Duration;
}

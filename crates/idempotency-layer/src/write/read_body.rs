//! Reading a write's request body whole, within its size limit and its deadline, before it is
//! fingerprinted.

use std::fmt;
use std::future::Future;
use std::task::Poll;

use bytes::Bytes;
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;

use reason_code::BoxError;

/// The request body's data, at most `limit` bytes (else a
/// [`LengthLimitError`](http_body_util::LengthLimitError)), received by
/// `deadline` (else [`BodyTimedOut`]); trailers are read and left out. A body of one data frame,
/// the common case, is that frame's bytes as they are: no copy and no queue of frames
/// (`Collected` allocates one per body). A body already at hand is read without a timer.
///
/// `on_wait` is called once, when the body is not at hand at the first poll (before the read
/// waits for it): the write gives back the capacity its service reserved then.
///
/// A plain function returning an `async move` block, so that `on_wait` is held once.
pub(super) fn read_whole<B>(
    body: B,
    limit: usize,
    deadline: Option<Instant>,
    on_wait: impl FnOnce(),
) -> impl Future<Output = Result<Bytes, BoxError>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut on_wait = Some(on_wait);
    async move {
        let mut read = std::pin::pin!(read_frames(body, limit));
        // Boxed, and made only when the body is not at hand at the first poll: a timer is as
        // large as the rest of the write's future.
        let mut timer = None;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = read.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            if let Some(on_wait) = on_wait.take() {
                on_wait();
            }
            let Some(deadline) = deadline else {
                return Poll::Pending;
            };
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            match timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(Box::new(BodyTimedOut) as BoxError)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

pub(super) async fn read_frames<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut first = Bytes::new();
    let mut more: Option<bytes::BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        match &mut more {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut buf = bytes::BytesMut::with_capacity(first.len() + data.len());
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                more = Some(buf);
            }
        }
    }
    Ok(more.map_or(first, bytes::BytesMut::freeze))
}

/// A write's request body did not arrive within `request_body_timeout`.
#[derive(Debug)]
pub(super) struct BodyTimedOut;

impl fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request body not received in time")
    }
}

impl std::error::Error for BodyTimedOut {}

//! Replayable request bodies: any body type, streamed, replayed byte for byte, never truncated.

use bytes::Bytes;
use futures_util::stream;
use http::Request;
use http_body::Frame;
use http_body_util::StreamBody;
use reason_code::BoxError;
use retry_layer::{Retry, RetryLayer, RetryPolicy};
use tower::{Service, ServiceExt};

use crate::support::*;

type Chunks = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>>;

/// A streaming body that is not `Clone`: the case tower::retry cannot handle.
fn streaming(chunks: &[&'static [u8]]) -> Chunks {
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
        .iter()
        .map(|c| Ok(Frame::data(Bytes::from_static(c))))
        .collect();
    StreamBody::new(stream::iter(frames))
}

async fn send(policy: RetryPolicy, body: Chunks, replies: Vec<Reply>) -> Vec<Seen> {
    let (svc, script) = backend::<Chunks>(replies);
    let mut retry: Retry<_> = tower::Layer::layer(&RetryLayer::new(policy), svc);
    let req = Request::put("http://svc/blobs/1").body(body).unwrap();
    let _ = within_a_day("the call", async {
        retry.ready().await.unwrap().call(req).await
    })
    .await;
    script.seen()
}

#[tokio::test(start_paused = true)]
async fn a_streaming_body_under_the_limit_is_replayed_byte_identically() {
    let chunks: &[&[u8]] = &[
        b"first chunk, ",
        b"second chunk, ",
        &[0, 159, 146, 150],
        b"end",
    ];
    let seen = send(
        RetryPolicy::default(),
        streaming(chunks),
        vec![status(503), status(503), status(200)],
    )
    .await;
    assert_eq!(seen.len(), 3);
    let whole: Vec<u8> = chunks.concat();
    for s in &seen {
        assert_eq!(s.body, whole);
    }
}

#[tokio::test(start_paused = true)]
async fn over_the_limit_the_request_goes_out_once_and_its_outcome_is_returned() {
    let policy = RetryPolicy::builder().max_replay_bytes(16).build().unwrap();
    let chunks: &[&[u8]] = &[b"0123456789", b"0123456789", b"tail"];
    let (svc, script) = backend::<Chunks>(vec![status(503)]);
    let mut retry: Retry<_> = tower::Layer::layer(&RetryLayer::new(policy), svc);
    let req = Request::put("http://svc/blobs/1")
        .body(streaming(chunks))
        .unwrap();
    let res = within_a_day("the call", async {
        retry.ready().await.unwrap().call(req).await
    })
    .await
    .unwrap();
    assert_eq!(res.status(), 503, "the first outcome is returned as is");
    let seen = script.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, chunks.concat(), "never truncated");
}

#[tokio::test(start_paused = true)]
async fn exactly_at_the_limit_is_still_replayed() {
    let policy = RetryPolicy::builder().max_replay_bytes(20).build().unwrap();
    let chunks: &[&[u8]] = &[b"0123456789", b"0123456789"];
    let seen = send(policy, streaming(chunks), vec![status(503), status(200)]).await;
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, chunks.concat());
}

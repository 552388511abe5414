//! Back-pressure with `tower_test::mock`: the layer never calls the inner service before it is
//! ready, the first attempt and a retry wait for it in the response future, and an error of its
//! `poll_ready` passes through.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retry_layer::{ReplayBody, RetryInfo, RetryLayer, RetryPolicy};
use tokio::time::Duration;
use tower_test::mock;

use crate::support::get;

type Mocked = Request<ReplayBody<Full<Bytes>>>;
type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode) -> Answer {
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// A slow inner service is never pending (nor an error) in the layer's `poll_ready`: the call
/// takes the service that was polled and waits for it in its response future; nothing is
/// called before the inner service is ready, and its wake-up reaches the call.
#[tokio::test(start_paused = true)]
async fn a_call_waits_for_the_inner_service_in_its_future() {
    let layer = RetryLayer::new(RetryPolicy::default());
    let (mut svc, mut handle) = mock::spawn_layer::<Mocked, Answer, _>(layer.clone());

    handle.allow(0);
    assert!(
        svc.poll_ready::<Request<Full<Bytes>>>().is_ready(),
        "ready at once: the wait is the call's"
    );
    let call = tokio::spawn(svc.call(get("/books/b1")));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        handle.poll_request().is_pending(),
        "nothing is called before the inner service is ready"
    );
    assert!(!call.is_finished());

    handle.allow(1);
    let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the call, once the service is ready")
        .expect("a request");
    assert_eq!(req.uri().path(), "/books/b1");
    send.send_response(answer(StatusCode::OK));
    let res = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call ends")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(layer.stats().attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_retry_waits_for_the_inner_service_to_be_ready() {
    let layer = RetryLayer::new(RetryPolicy::default());
    let (mut svc, mut handle) = mock::spawn_layer::<Mocked, Answer, _>(layer.clone());

    handle.allow(1);
    assert!(svc.poll_ready::<Request<Full<Bytes>>>().is_ready());
    let call = tokio::spawn(svc.call(get("/books/b1")));
    let (first, send) = handle.next_request().await.expect("the first attempt");
    assert!(!first.headers().contains_key("x-previous-attempts"));
    send.send_response(answer(StatusCode::SERVICE_UNAVAILABLE));

    // The backoff (tens of milliseconds) passes many times over; the inner service is not
    // ready, so the retry is not sent.
    let early = tokio::time::timeout(Duration::from_secs(5), handle.next_request()).await;
    assert!(
        early.is_err(),
        "a retry was sent to a service that was not ready"
    );
    assert_eq!(layer.stats().attempts, 1);
    assert!(
        !call.is_finished(),
        "without a deadline, the retry waits for readiness"
    );

    handle.allow(1);
    let (retry, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the retry, once the service is ready")
        .expect("a request");
    assert_eq!(retry.headers()["x-previous-attempts"], "1");
    send.send_response(answer(StatusCode::OK));
    let res = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call ends")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(RetryInfo::attempts_of(&res), 2);
    assert_eq!(layer.stats().retries, 1);
}

#[tokio::test(start_paused = true)]
async fn an_inner_service_that_fails_readiness_fails_the_call() {
    let layer = RetryLayer::new(RetryPolicy::default());
    let (mut svc, mut handle) = mock::spawn_layer::<Mocked, Answer, _>(layer.clone());
    handle.send_error("the backend is gone");
    let err = match svc.poll_ready::<Request<Full<Bytes>>>() {
        std::task::Poll::Ready(Err(e)) => e,
        other => panic!("expected a readiness error, got {other:?}"),
    };
    let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.attempts(), 0, "nothing was sent");
    assert_eq!(err.inner().to_string(), "the backend is gone");
    assert_eq!(layer.stats().attempts, 0);
}

//! Every wait has a bound: what bounds a call whose server never answers, and how
//! the deadline sources combine. Paused time: the bounds are the subject.

use bytes::Bytes;
use http_body_util::Full;
use reason_code::parse_grpc_timeout;
use retry_layer::{
    Deadline, DeadlineExceeded, ResponseHeadTimedOut, RetryError, RetryLayer, RetryPolicy,
};
use tokio::time::{Duration, Instant};
use tower::{Service, ServiceExt};

use crate::support::*;

/// A call to a server that never answers ends, with the default policy, in a classified
/// error: each attempt waits at most `response_head_timeout` (60 s) for the head. A GET is
/// idempotent, so its three attempts each wait that long; a POST without key is not retried
/// after a timeout (it may have executed). Before: still waiting after ten virtual minutes.
#[tokio::test(start_paused = true)]
async fn the_default_policy_never_waits_forever_for_a_response_head() {
    let head = RetryPolicy::default().response_head_timeout();
    assert_eq!(head, Duration::from_secs(60), "the documented default");
    for (req, attempts) in [(get("/books/b1"), 3), (post("/orders"), 1)] {
        let (svc, script) = backend::<Full<Bytes>>(vec![Reply::Never]);
        let layer = RetryLayer::new(RetryPolicy::default());
        let started = Instant::now();
        let err = within(
            Duration::from_secs(600),
            "a call to a server that never answers",
            tower::Layer::layer(&layer, svc).oneshot(req),
        )
        .await
        .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        let timed_out = err
            .downcast_ref::<ResponseHeadTimedOut>()
            .unwrap_or_else(|| panic!("a response head timeout, got {err}"));
        assert_eq!(timed_out.timeout(), head);
        assert!(err.to_string().contains("response_head_timeout"), "{err}");
        assert_eq!(err.attempts(), attempts);
        assert_eq!(script.attempts(), attempts as usize);
        let took = started.elapsed();
        assert!(took >= head * attempts, "{took:?}");
        assert!(took < head * attempts + Duration::from_secs(1), "{took:?}");
    }
}

/// The head bound is the client's own: it is not sent as `grpc-timeout` (a server
/// streaming for longer than it is not cut off), and a response whose head came in time is the
/// answer however long its body then streams.
#[tokio::test(start_paused = true)]
async fn the_head_bound_is_not_sent_to_the_server() {
    let req = keyed(grpc_req("/lib.Library/WatchOrders"));
    let (res, script, _) = call_scripted(RetryPolicy::default(), req, vec![grpc("0")]).await;
    assert_eq!(res.unwrap().status(), 200);
    assert!(
        !script.seen()[0].headers.contains_key("grpc-timeout"),
        "no deadline was set: no grpc-timeout may be invented"
    );
    // With a deadline, grpc-timeout is the deadline's, not the head bound's.
    let mut req = keyed(grpc_req("/lib.Library/WatchOrders"));
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_secs(300)));
    let (_, script, _) = call_scripted(RetryPolicy::default(), req, vec![grpc("0")]).await;
    let sent = parse_grpc_timeout(&script.seen()[0].headers["grpc-timeout"]).unwrap();
    assert!(sent > Duration::from_secs(299), "{sent:?}");
}

/// The head bound is a setting of its own, validated like the other durations.
#[test]
fn the_head_bound_is_configurable_and_validated() {
    let p = RetryPolicy::builder()
        .response_head_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    assert_eq!(p.response_head_timeout(), Duration::from_secs(5));
    let e = RetryPolicy::builder()
        .response_head_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("response_head_timeout"), "{e}");
    assert!(RetryPolicy::builder()
        .response_head_timeout(Duration::from_secs(86_401))
        .build()
        .is_err());
}

/// A `Deadline` extension never extends a shorter inbound `grpc-timeout`.
#[tokio::test(start_paused = true)]
async fn a_deadline_extension_never_extends_a_shorter_grpc_timeout() {
    let mut req = keyed(grpc_req("/lib.Library/CreateOrder"));
    req.headers_mut()
        .insert("grpc-timeout", "1S".parse().unwrap());
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_secs(10)));
    let (_, script, _) = call_scripted(RetryPolicy::default(), req, vec![grpc("0")]).await;
    let sent = parse_grpc_timeout(&script.seen()[0].headers["grpc-timeout"]).unwrap();
    assert!(sent <= Duration::from_secs(1), "{sent:?}");
}

/// `total_timeout` bounds a call whose `grpc-timeout` is longer.
#[tokio::test(start_paused = true)]
async fn total_timeout_bounds_a_call_with_a_longer_grpc_timeout() {
    let mut req = keyed(grpc_req("/lib.Library/CreateOrder"));
    req.headers_mut()
        .insert("grpc-timeout", "10S".parse().unwrap());
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(policy, req, vec![grpc("0")]).await;
    let sent = parse_grpc_timeout(&script.seen()[0].headers["grpc-timeout"]).unwrap();
    assert!(sent <= Duration::from_secs(1), "{sent:?}");
}

/// A call whose deadline has already passed sends nothing and says so.
#[tokio::test(start_paused = true)]
async fn a_call_whose_deadline_has_passed_sends_nothing() {
    let mut req = get("/books/b1");
    req.extensions_mut().insert(Deadline(Instant::now()));
    let (svc, script) = backend::<Full<Bytes>>(vec![status(200)]);
    let layer = RetryLayer::new(RetryPolicy::default());
    let mut retry = tower::Layer::layer(&layer, svc);
    let err = within_a_day("the call", async {
        retry.ready().await.unwrap().call(req).await
    })
    .await
    .unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    assert_eq!(err.attempts(), 0);
    assert_eq!(script.attempts(), 0, "nothing was sent");
    assert_eq!(layer.stats().attempts, 0);
}

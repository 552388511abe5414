//! The deadline budget: no retry that cannot finish; `grpc-timeout` says what is really left.

use reason_code::parse_grpc_timeout;
use retry_layer::{Deadline, DeadlineExceeded, RetryError, RetryPolicy};
use tokio::time::Duration;

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn no_retry_when_the_deadline_cannot_fit_delay_plus_min_budget() {
    // Attempt 1 fails at t=0; delay ~20 ms; 90 ms left >= 24 + 50: retried.
    // Attempt 2 fails at ~20 ms; delay ~40 ms; at most 74 ms left < 32 + 50: not retried, whatever the jitter.
    let policy = RetryPolicy::builder().jitter_seed(1).build().unwrap();
    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(90)));
    let (res, script, layer) = call_scripted(policy, req, vec![status(503)]).await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(script.attempts(), 2);
    assert_eq!(layer.stats().deadline_stops, 1);
}

#[tokio::test(start_paused = true)]
async fn total_timeout_is_the_fallback_deadline() {
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_millis(60))
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(policy, get("/books/b1"), vec![status(503)]).await;
    assert_eq!(script.attempts(), 1, "60 ms cannot fit ~20 ms + 50 ms");
}

#[tokio::test(start_paused = true)]
async fn an_attempt_running_past_the_deadline_ends_the_call() {
    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(200)));
    let (res, script, _) = call_scripted(
        RetryPolicy::default(),
        req,
        vec![Reply::Slow(Duration::from_secs(10), 200)],
    )
    .await;
    let err = res.unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert!(err.is::<DeadlineExceeded>(), "{err}");
    assert_eq!(err.attempts(), 1);
    assert_eq!(script.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn attempt_timeout_is_ambiguous_and_retried_only_when_idempotent() {
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let slow = || vec![Reply::Slow(Duration::from_secs(10), 200)];
    let (res, script, _) = call_scripted(policy.clone(), get("/books/b1"), slow()).await;
    let err = res.unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert!(err.is::<retry_layer::AttemptTimedOut>(), "{err}");
    assert_eq!(err.kind(), retry_layer::RetryErrorKind::TimedOut);
    assert!(err.may_have_executed());
    assert_eq!(err.attempts(), 3);
    assert_eq!(script.attempts(), 3);
    let (_, script, _) = call_scripted(policy, post("/orders"), slow()).await;
    assert_eq!(
        script.attempts(),
        1,
        "a POST that timed out may have executed"
    );
}

#[tokio::test(start_paused = true)]
async fn grpc_timeout_shrinks_across_attempts() {
    let mut req = keyed(grpc_req("/lib.Library/CreateOrder"));
    req.headers_mut()
        .insert("grpc-timeout", "2S".parse().unwrap());
    let replies = vec![Reply::Slow(Duration::from_millis(300), 503)];
    let (_, script, _) = call_scripted(RetryPolicy::default(), req, replies).await;
    let timeouts: Vec<Duration> = script
        .seen()
        .iter()
        .map(|s| parse_grpc_timeout(&s.headers["grpc-timeout"]).unwrap())
        .collect();
    assert_eq!(timeouts.len(), 3);
    assert!(timeouts[0] <= Duration::from_secs(2));
    // Each attempt took 300 ms plus a backoff delay: the budget left shrinks by at least that.
    assert!(
        timeouts[1] <= timeouts[0] - Duration::from_millis(300),
        "{timeouts:?}"
    );
    assert!(
        timeouts[2] <= timeouts[1] - Duration::from_millis(300),
        "{timeouts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_extension_wins_over_grpc_timeout() {
    let mut req = keyed(grpc_req("/lib.Library/CreateOrder"));
    req.headers_mut()
        .insert("grpc-timeout", "10S".parse().unwrap());
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(500)));
    let (_, script, _) = call_scripted(RetryPolicy::default(), req, vec![grpc("0")]).await;
    let sent = parse_grpc_timeout(&script.seen()[0].headers["grpc-timeout"]).unwrap();
    assert!(sent <= Duration::from_millis(500), "{sent:?}");
}

/// Whether a hop's give-up on a deadline is "do not retry" depends on whose
/// deadline it was: the inbound request's (spent: its caller cannot fit another attempt
/// either) or the hop's own `total_timeout` (a local choice: "retried below").
#[tokio::test(start_paused = true)]
async fn a_hop_gives_up_only_on_the_inbound_deadline() {
    use std::sync::Arc;

    use reason_code::Hop;

    let inbound = |timeout: &'static str| {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-timeout", timeout.parse().unwrap());
        Arc::new(Hop::from_request_headers(&h))
    };
    // The handler passes its inbound deadline on: 60 ms cannot fit ~20 ms + 50 ms.
    let hop = inbound("60m");
    let mut req = get("/c");
    req.extensions_mut()
        .insert(Deadline(hop.inbound_deadline().unwrap()));
    let (res, _, layer) = hop
        .clone()
        .scope(call_scripted(
            RetryPolicy::default(),
            req,
            vec![status(503)],
        ))
        .await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(layer.stats().deadline_stops, 1);
    assert!(hop.gave_up(), "the caller's own deadline is spent");

    // The hop's own 60 ms, under an inbound deadline of 10 s: the caller may still retry.
    let hop = inbound("10S");
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_millis(60))
        .build()
        .unwrap();
    let (_, _, layer) = hop
        .clone()
        .scope(call_scripted(policy, get("/c"), vec![status(503)]))
        .await;
    assert_eq!(layer.stats().deadline_stops, 1);
    assert!(hop.deferred() && !hop.gave_up(), "a local choice");
}

/// A service that, once its first attempt was sent, is not ready again for `busy` (a pool
/// whose connections are all taken): the wait for readiness eats into the deadline.
struct BusyAfterFirstCall<S> {
    inner: S,
    busy: Duration,
    ready_at: std::sync::Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S: Clone> Clone for BusyAfterFirstCall<S> {
    fn clone(&self) -> Self {
        BusyAfterFirstCall {
            inner: self.inner.clone(),
            busy: self.busy,
            ready_at: self.ready_at.clone(),
            sleep: None,
        }
    }
}

impl<S> BusyAfterFirstCall<S> {
    fn new(inner: S, busy: Duration) -> Self {
        BusyAfterFirstCall {
            inner,
            busy,
            ready_at: Default::default(),
            sleep: None,
        }
    }
}

impl<S, Req> tower::Service<Req> for BusyAfterFirstCall<S>
where
    S: tower::Service<Req>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        let ready_at = *self.ready_at.lock().unwrap();
        if let Some(at) = ready_at {
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
            if std::future::Future::poll(sleep.as_mut(), cx).is_pending() {
                return std::task::Poll::Pending;
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> S::Future {
        self.ready_at
            .lock()
            .unwrap()
            .get_or_insert_with(|| tokio::time::Instant::now() + self.busy);
        self.inner.call(req)
    }
}

/// The deadline is checked again once the service is ready for a retry: a wait for readiness
/// that leaves less than `min_attempt_time` sends nothing more, and the call answers
/// `DeadlineExceeded` (the last attempt's response was let go before the wait: it held its
/// connection), counted as a deadline stop (and, under an inbound deadline that is spent, the
/// hop gives up). Before, the retry was sent with 20 ms left.
#[tokio::test(start_paused = true)]
async fn a_retry_is_not_sent_when_readiness_leaves_less_than_min_attempt_time() {
    use std::sync::Arc;

    use reason_code::Hop;
    use tower::{Service, ServiceExt};

    let mut inbound = http::HeaderMap::new();
    inbound.insert("grpc-timeout", "200m".parse().unwrap());
    let hop = Arc::new(Hop::from_request_headers(&inbound));
    // Attempt 1 fails at t=0; the decision sees 200 ms left >= ~20 ms + 50 ms and retries; the
    // service is then not ready before t=180 ms: 20 ms left.
    let (svc, script) = backend::<http_body_util::Full<bytes::Bytes>>(vec![status(503)]);
    let layer = retry_layer::RetryLayer::new(RetryPolicy::default());
    let mut retry = tower::Layer::layer(
        &layer,
        BusyAfterFirstCall::new(svc, Duration::from_millis(180)),
    );
    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(Deadline(hop.inbound_deadline().unwrap()));
    let started = tokio::time::Instant::now();
    let res = hop
        .clone()
        .scope(within_a_day("the call", async {
            retry.ready().await.unwrap().call(req).await
        }))
        .await;
    let e = res.expect_err("the deadline leaves no attempt");
    let e = retry_layer::RetryError::of(&*e).expect("a RetryError");
    assert!(e.is::<retry_layer::DeadlineExceeded>(), "{e}");
    assert_eq!(e.attempts(), 1);
    assert_eq!(started.elapsed(), Duration::from_millis(180));
    assert_eq!(script.attempts(), 1, "no retry with 20 ms left");
    let stats = layer.stats();
    assert_eq!((stats.attempts, stats.deadline_stops), (1, 1));
    assert!(hop.gave_up(), "the caller's own deadline is spent");
}

/// A deadline that ends a call (before its first attempt, during an attempt, while a retry
/// waits for the service to be ready, or while the rebuild hook thinks) is a deadline stop like
/// one the decision makes: counted in `deadline_stops`, and the hop the call is made from gives
/// up when the deadline was its inbound request's (its caller cannot fit another attempt
/// either), or says it retried below when it was a local `total_timeout`. Before, such a call
/// ended with `DeadlineExceeded` and nothing counted or told the hop.
#[tokio::test(start_paused = true)]
async fn a_deadline_that_ends_the_call_is_a_deadline_stop() {
    use std::sync::Arc;

    use reason_code::Hop;
    use retry_layer::Conflict;
    use tower::{Service, ServiceExt};

    let hop_with = |timeout: &'static str| {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-timeout", timeout.parse().unwrap());
        Arc::new(Hop::from_request_headers(&h))
    };
    let conflict = || Reply::Status(409, vec![("x-reason-code", "STOCK_CONFLICT")]);
    let never_rebuilds = || {
        RetryPolicy::builder()
            .rebuild_on_conflict(|_c: Conflict| std::future::pending())
            .build()
            .unwrap()
    };
    // (what, policy, replies, service busy after its first call, inbound grpc-timeout)
    let cases = [
        (
            "before the first attempt",
            RetryPolicy::default(),
            vec![status(200)],
            None,
            "0m",
        ),
        (
            "during an attempt",
            RetryPolicy::default(),
            vec![Reply::Never],
            None,
            "200m",
        ),
        (
            "waiting for readiness",
            RetryPolicy::default(),
            vec![status(503)],
            Some(Duration::from_secs(10)),
            "200m",
        ),
        (
            "waiting for the rebuild hook",
            never_rebuilds(),
            vec![conflict()],
            None,
            "200m",
        ),
    ];
    for (what, policy, replies, busy, timeout) in cases {
        // The handler passes its inbound deadline on.
        let hop = hop_with(timeout);
        let (svc, _) = backend::<http_body_util::Full<bytes::Bytes>>(replies);
        let layer = retry_layer::RetryLayer::new(policy);
        let svc = BusyAfterFirstCall::new(svc, busy.unwrap_or(Duration::ZERO));
        let mut retry = tower::Layer::layer(&layer, svc);
        let mut req = keyed(get("/books/b1"));
        req.extensions_mut()
            .insert(Deadline(hop.inbound_deadline().unwrap()));
        let err = hop
            .clone()
            .scope(within_a_day(what, async {
                retry.ready().await.unwrap().call(req).await
            }))
            .await
            .unwrap_err();
        let err = RetryError::of(&*err).expect("a RetryError");
        assert!(err.is::<DeadlineExceeded>(), "{what}: {err}");
        assert_eq!(layer.stats().deadline_stops, 1, "{what}");
        assert!(hop.gave_up(), "{what}: the inbound deadline is spent");
    }

    // The hop's own 200 ms, under an inbound deadline of 10 s: a local choice.
    let hop = hop_with("10S");
    let policy = RetryPolicy::builder()
        .total_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let (_, _, layer) = hop
        .clone()
        .scope(call_scripted(policy, get("/books/b1"), vec![Reply::Never]))
        .await;
    assert_eq!(layer.stats().deadline_stops, 1);
    assert!(hop.deferred() && !hop.gave_up(), "a local choice");
}

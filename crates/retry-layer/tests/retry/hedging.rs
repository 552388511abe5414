//! Hedged requests: scripted backends on tokio's paused clock (exact delays), and real sockets
//! over HTTP/1.1 and h2c (the slow attempt is cancelled on the wire).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use reason_code::BoxError;
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use retry_layer::{RetryLayer, RetryPolicy};
use tokio::time::{Duration, Instant};
use tower::{Layer, Service, ServiceExt};

use crate::support::{
    backend, get, grpc, grpc_req, keyed, post, status, within, within_a_day, Reply, Script,
};

const MS: Duration = Duration::from_millis(1);

fn policy(max_attempts: u32, delay: Duration) -> HedgePolicy {
    HedgePolicy::builder()
        .max_attempts(max_attempts)
        .hedging_delay(delay)
        .build()
        .unwrap()
}

/// Sends `req` through a `HedgeLayer` over a scripted backend; returns the answer, when it came
/// (from the start), the script and the layer.
async fn hedged(
    layer: HedgeLayer,
    req: Request<Full<Bytes>>,
    replies: Vec<Reply>,
) -> (
    Result<Response<Full<Bytes>>, BoxError>,
    Duration,
    Arc<Script>,
    HedgeLayer,
) {
    let (svc, script) = backend::<Full<Bytes>>(replies);
    let mut svc = layer.layer(svc);
    let started = Instant::now();
    let result = within_a_day("the hedged call", async {
        svc.ready().await.unwrap().call(req).await
    })
    .await;
    (result, started.elapsed(), script, layer)
}

fn code(r: &Result<Response<Full<Bytes>>, BoxError>) -> u16 {
    r.as_ref().expect("a response").status().as_u16()
}

#[tokio::test(start_paused = true)]
async fn a_slow_first_attempt_is_hedged_and_the_hedge_wins() {
    let (r, took, script, layer) = hedged(
        HedgeLayer::new(policy(2, 50 * MS)),
        get("/books/b1"),
        vec![Reply::Slow(Duration::from_secs(10), 200), status(203)],
    )
    .await;
    assert_eq!(code(&r), 203, "the hedge's answer");
    assert_eq!(
        took,
        50 * MS,
        "answered as soon as the hedge was, not after 10 s"
    );
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1].at - seen[0].at,
        50 * MS,
        "the hedge waited hedging_delay"
    );
    assert_eq!(seen[1].headers["x-previous-attempts"], "1");
    let stats = layer.stats();
    assert_eq!(
        (stats.requests, stats.hedges, stats.won_by_hedge),
        (1, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_fast_answer_sends_no_hedge() {
    let (r, took, script, layer) = hedged(
        HedgeLayer::new(policy(3, 50 * MS)),
        get("/books/b1"),
        vec![Reply::Slow(49 * MS, 200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    assert_eq!(took, 49 * MS);
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().hedges, 0);
}

/// A read that carries `NoRetry` is sent once: the caller's opt-out covers hedges too.
#[tokio::test(start_paused = true)]
async fn a_request_that_opted_out_is_not_hedged() {
    let mut req = get("/books/b1");
    req.extensions_mut().insert(retry_layer::NoRetry);
    let (r, took, script, layer) = hedged(
        HedgeLayer::new(policy(3, 50 * MS)),
        req,
        vec![Reply::Slow(200 * MS, 200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    assert_eq!(took, 200 * MS, "the one attempt's answer");
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().hedges, 0);
}

/// Only reads are hedged by default (GET, HEAD, OPTIONS, TRACE, declared gRPC
/// methods): a hedge of a write is a concurrent duplicate, which even a keyed write with
/// `IdempotencyLayer` on the server pays for in load. Idempotent and keyed writes are hedged
/// when asked for (`hedge_writes`); a write without a key never is. Before, keyed writes (and
/// PUT, DELETE) were hedged by default, though the docs said writes never are.
#[tokio::test(start_paused = true)]
async fn writes_are_hedged_only_when_asked_and_never_without_a_key() {
    let slow = || vec![Reply::Slow(Duration::from_secs(1), 201), status(201)];
    let put = || {
        Request::put("http://svc/books/b1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    for (what, req) in [
        ("a POST without key", post("/orders")),
        ("a keyed POST", keyed(post("/orders"))),
        ("a PUT", put()),
    ] {
        let (r, took, script, _) = hedged(HedgeLayer::new(policy(2, 50 * MS)), req, slow()).await;
        assert_eq!(code(&r), 201, "{what}");
        assert_eq!(
            took,
            Duration::from_secs(1),
            "{what}: waited for its only attempt"
        );
        assert_eq!(script.attempts(), 1, "{what}");
    }

    let asked = || {
        HedgePolicy::builder()
            .max_attempts(2)
            .hedging_delay(50 * MS)
            .hedge_writes()
            .build()
            .unwrap()
    };
    let (_, _, script, _) = hedged(HedgeLayer::new(asked()), post("/orders"), slow()).await;
    assert_eq!(script.attempts(), 1, "a write without key is never hedged");
    for (what, req) in [("a keyed POST", keyed(post("/orders"))), ("a PUT", put())] {
        let (r, took, script, _) = hedged(HedgeLayer::new(asked()), req, slow()).await;
        assert_eq!(code(&r), 201, "{what}");
        assert_eq!(took, 50 * MS, "{what}");
        let seen = script.seen();
        assert_eq!(seen.len(), 2, "{what}");
        assert_eq!(
            seen[1].body, seen[0].body,
            "the hedge carries the whole body"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_failure_sends_the_next_hedge_at_once() {
    let (r, took, script, _) = hedged(
        HedgeLayer::new(policy(3, Duration::from_secs(1))),
        get("/books/b1"),
        vec![status(503), status(200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    assert_eq!(
        took,
        Duration::ZERO,
        "no hedging_delay after a non-fatal failure"
    );
    assert_eq!(script.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn when_every_attempt_fails_non_fatally_the_last_failure_is_the_answer() {
    let (r, _, script, layer) = hedged(
        HedgeLayer::new(policy(3, 10 * MS)),
        get("/books/b1"),
        vec![status(503)],
    )
    .await;
    assert_eq!(code(&r), 503);
    assert_eq!(script.attempts(), 3, "max_attempts");
    assert_eq!(layer.stats().hedges, 2);
}

/// An answer replayed from the server's record (`idempotent-replayed: true`) is final, whatever
/// its status: every hedge with the same key would get the same replay.
#[tokio::test(start_paused = true)]
async fn a_replayed_answer_is_final() {
    let replayed = Reply::Status(503, vec![("idempotent-replayed", "true")]);
    let (r, _, script, layer) = hedged(
        HedgeLayer::new(policy(3, 10 * MS)),
        get("/books/b1"),
        vec![replayed, status(200)],
    )
    .await;
    assert_eq!(code(&r), 503);
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().hedges, 0);
}

#[tokio::test(start_paused = true)]
async fn a_fatal_answer_wins_over_attempts_still_in_flight() {
    let (r, took, script, _) = hedged(
        HedgeLayer::new(policy(2, 50 * MS)),
        get("/books/b1"),
        vec![Reply::Slow(Duration::from_secs(1), 200), status(404)],
    )
    .await;
    assert_eq!(code(&r), 404, "NOT_FOUND is not non-fatal: it commits");
    assert_eq!(took, 50 * MS);
    assert_eq!(script.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn pushback_stops_further_hedges() {
    let stop = Reply::Status(503, vec![("x-reason-code", "DO_NOT_RETRY")]);
    let (r, _, script, _) = hedged(
        HedgeLayer::new(policy(3, 10 * MS)),
        get("/books/b1"),
        vec![stop],
    )
    .await;
    assert_eq!(code(&r), 503);
    assert_eq!(script.attempts(), 1);

    let (r, _, script, _) = hedged(
        HedgeLayer::new(policy(3, 10 * MS)),
        grpc_req("/pkg.Svc/Get"),
        vec![Reply::Status(
            200,
            vec![
                ("content-type", "application/grpc"),
                ("grpc-status", "14"),
                ("grpc-retry-pushback-ms", "-1"),
            ],
        )],
    )
    .await;
    // Not declared idempotent: sent once anyway; declared, the pushback stops it.
    assert_eq!(code(&r), 200);
    assert_eq!(script.attempts(), 1);
    let declared = HedgePolicy::builder()
        .max_attempts(3)
        .hedging_delay(10 * MS)
        .idempotent_grpc_methods(retry_layer::GrpcMethods::new(["/pkg.Svc/Get"]).unwrap())
        .build()
        .unwrap();
    let (_, _, script, _) = hedged(
        HedgeLayer::new(declared.clone()),
        grpc_req("/pkg.Svc/Get"),
        vec![Reply::Status(
            200,
            vec![
                ("content-type", "application/grpc"),
                ("grpc-status", "14"),
                ("grpc-retry-pushback-ms", "-1"),
            ],
        )],
    )
    .await;
    assert_eq!(script.attempts(), 1, "a negative pushback stops hedging");
    let (_, _, script, _) = hedged(
        HedgeLayer::new(declared),
        grpc_req("/pkg.Svc/Get"),
        vec![grpc("14")],
    )
    .await;
    assert_eq!(
        script.attempts(),
        3,
        "UNAVAILABLE without pushback is hedged"
    );
}

#[tokio::test(start_paused = true)]
async fn hedges_draw_on_the_retry_budget() {
    // A retry budget with no floor and no ratio grants nothing: no hedge is sent.
    let retries = RetryLayer::new(
        RetryPolicy::builder()
            .budget(retry_layer::budget::RetryBudget::sliding_window(
                Duration::from_secs(10),
                0,
                0.0,
            ))
            .build()
            .unwrap(),
    );
    let (r, took, script, layer) = hedged(
        retries.hedge_layer(policy(2, 50 * MS)),
        get("/books/b1"),
        vec![Reply::Slow(Duration::from_secs(1), 200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    assert_eq!(took, Duration::from_secs(1));
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().budget_refusals, 1);
}

#[test]
fn a_service_config_chooses_hedging_per_method() {
    let policy = HedgePolicy::from_grpc_service_config(
        r#"{"methodConfig": [{
            "name": [{"service": "pkg.Svc", "method": "Get"}],
            "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.02s", "nonFatalStatusCodes": ["UNAVAILABLE"]}
        }]}"#,
    )
    .unwrap();
    // The policy's own settings (for methods the config does not name) stay the builder's
    // defaults; what it does per method is checked on the wire below.
    assert_eq!(
        policy.max_attempts(),
        HedgePolicy::builder().build().unwrap().max_attempts()
    );
    // Each refusal says what is wrong and where.
    for (bad, says) in [
        (
            r#"{"methodConfig": [{"name": [{"service": "pkg.Svc"}], "hedgingPolicy": {"maxAttempts": 1}}]}"#,
            "methodConfig[0].hedgingPolicy: maxAttempts must be at least 2, got 1",
        ),
        (
            r#"{"methodConfig": [{"name": [], "hedgingPolicy": {"maxAttempts": 2}}]}"#,
            "methodConfig[0] has no name",
        ),
        (
            r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "soon"}}]}"#,
            r#""soon" is not a duration"#,
        ),
        ("not json", "service config:"),
    ] {
        let e = HedgePolicy::from_grpc_service_config(bad).unwrap_err();
        assert!(e.to_string().contains(says), "{bad}: {e}");
    }
    assert!(HedgePolicy::builder().max_attempts(6).build().is_err());
    assert!(HedgePolicy::builder().max_attempts(0).build().is_err());
}

#[tokio::test(start_paused = true)]
async fn a_service_config_hedges_the_methods_it_names_only() {
    let policy = HedgePolicy::from_grpc_service_config(
        r#"{"methodConfig": [{
            "name": [{"service": "pkg.Svc", "method": "Get"}],
            "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.02s", "nonFatalStatusCodes": ["UNAVAILABLE"]}
        }]}"#,
    )
    .unwrap()
    .to_builder()
    .idempotent_grpc_methods(
        retry_layer::GrpcMethods::new(["/pkg.Svc/Get", "/pkg.Svc/List"]).unwrap(),
    )
    .build()
    .unwrap();
    let (_, took, script, _) = hedged(
        HedgeLayer::new(policy.clone()),
        grpc_req("/pkg.Svc/Get"),
        vec![grpc("14")],
    )
    .await;
    assert_eq!(script.attempts(), 3);
    assert_eq!(took, Duration::ZERO, "non-fatal: each next hedge at once");
    let (_, _, script, _) = hedged(
        HedgeLayer::new(policy),
        grpc_req("/pkg.Svc/List"),
        vec![Reply::Slow(Duration::from_secs(1), 200)],
    )
    .await;
    assert_eq!(script.attempts(), 1, "no hedgingPolicy for List");
}

/// Over real sockets: the first attempt is held by the server until the test ends; the hedge
/// is answered at once. The caller gets the hedge's answer, and the held attempt is cancelled
/// on the wire (its handler is dropped by the server).
#[tokio::test]
async fn on_the_wire_the_hedge_answers_and_the_slow_attempt_is_cancelled() {
    for h2 in [false, true] {
        let hits = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (h, d) = (hits.clone(), dropped.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (h, d) = (h.clone(), d.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |_req| {
                        let n = h.fetch_add(1, Ordering::SeqCst);
                        let d = d.clone();
                        async move {
                            if n == 0 {
                                struct Guard(Arc<AtomicUsize>);
                                impl Drop for Guard {
                                    fn drop(&mut self) {
                                        self.0.fetch_add(1, Ordering::SeqCst);
                                    }
                                }
                                let _guard = Guard(d);
                                std::future::pending::<()>().await;
                            }
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("fast"))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
                });
            }
        });
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(h2)
                .build_http::<retry_layer::ReplayBody<Full<Bytes>>>();
        let layer = HedgeLayer::new(policy(2, 20 * MS));
        let req = Request::get(format!("http://{addr}/books/b1"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = crate::wire::bounded("the hedged GET", layer.layer(client).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "h2 {h2}");
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "fast");
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        crate::wire::bounded("the slow attempt's cancellation", async {
            while dropped.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert_eq!(layer.stats().won_by_hedge, 1);
    }
}

/// The hedge owns the attempt headers too: a forwarded one is not sent on the
/// first attempt, and each hedge carries its own count.
#[tokio::test(start_paused = true)]
async fn forwarded_attempt_headers_are_not_sent_on_the_first_attempt() {
    let mut req = get("/books/b1");
    req.headers_mut()
        .insert("x-previous-attempts", "3".parse().unwrap());
    req.headers_mut()
        .insert("grpc-previous-rpc-attempts", "3".parse().unwrap());
    let (r, _, script, _) = hedged(
        HedgeLayer::new(policy(2, 50 * MS)),
        req,
        vec![Reply::Slow(Duration::from_secs(1), 200), status(200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen[0].headers.get("x-previous-attempts").is_none());
    assert!(seen[0].headers.get("grpc-previous-rpc-attempts").is_none());
    assert_eq!(seen[1].headers["x-previous-attempts"], "1");
    assert!(seen[1].headers.get("grpc-previous-rpc-attempts").is_none());
}

/// A hedge's attempt header does not count an attempt that provably never left the client:
/// after a refused first attempt, the next hedge is a first attempt to the server.
#[tokio::test(start_paused = true)]
async fn a_hedge_does_not_count_an_attempt_that_was_never_sent() {
    let (r, _, script, _) = hedged(
        HedgeLayer::new(policy(3, 50 * MS)),
        get("/books/b1"),
        vec![
            Reply::Io(std::io::ErrorKind::ConnectionRefused),
            Reply::Slow(Duration::from_secs(1), 200),
            status(203),
        ],
    )
    .await;
    assert_eq!(code(&r), 203);
    let previous: Vec<_> = script
        .seen()
        .iter()
        .map(|s| s.headers.get("x-previous-attempts").cloned())
        .collect();
    assert_eq!(previous, [None, None, Some("1".parse().unwrap())]);
}

/// A hedge answered with a pushback longer than `max_pushback`, or one its
/// deadline cannot wait for, sends no more hedges: the pushback's answer is returned at once.
/// Before, the next hedge was scheduled an hour (or up to a day) ahead and nothing else woke the
/// call.
#[tokio::test(start_paused = true)]
async fn a_hedged_read_honours_max_pushback_and_its_deadline() {
    for (retry_after, deadline) in [("3600", None), ("10", Some(Duration::from_secs(5)))] {
        let mut req = get("/books/b1");
        if let Some(d) = deadline {
            req.extensions_mut().insert(retry_layer::Deadline::after(d));
        }
        let (r, took, script, _) = within(
            Duration::from_secs(60),
            "the hedged call",
            hedged(
                HedgeLayer::new(policy(3, 50 * MS)),
                req,
                vec![
                    Reply::Status(503, vec![("retry-after", retry_after)]),
                    status(200),
                ],
            ),
        )
        .await;
        assert_eq!(code(&r), 503, "Retry-After {retry_after}");
        assert_eq!(took, Duration::ZERO, "Retry-After {retry_after}");
        assert_eq!(script.attempts(), 1, "Retry-After {retry_after}");
    }
}

/// A hedged call ends at its deadline even when no attempt answers.
#[tokio::test(start_paused = true)]
async fn a_hedged_read_ends_at_its_deadline() {
    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(retry_layer::Deadline::after(Duration::from_secs(5)));
    let (r, took, script, _) = within(
        Duration::from_secs(60),
        "the hedged call",
        hedged(HedgeLayer::new(policy(2, 50 * MS)), req, vec![Reply::Never]),
    )
    .await;
    let err = r.unwrap_err();
    assert!(err.is::<retry_layer::DeadlineExceeded>(), "{err}");
    assert_eq!(took, Duration::from_secs(5));
    assert_eq!(script.attempts(), 2);
}

/// Without a deadline, each attempt waits `response_head_timeout` for
/// its head (60 s by default), so a hedged call to a server that never answers ends.
#[tokio::test(start_paused = true)]
async fn a_hedged_read_to_a_server_that_never_answers_ends() {
    let (r, took, script, _) = within(
        Duration::from_secs(600),
        "the hedged call",
        hedged(
            HedgeLayer::new(policy(2, 50 * MS)),
            get("/books/b1"),
            vec![Reply::Never],
        ),
    )
    .await;
    let err = r.unwrap_err();
    assert!(err.is::<retry_layer::ResponseHeadTimedOut>(), "{err}");
    assert_eq!(
        took,
        Duration::from_secs(60) + 50 * MS,
        "the last attempt's 60 s"
    );
    assert_eq!(script.attempts(), 2);
}

/// Answers its first call with `first` (a 503, or a transport error), then is never ready
/// again; counts its calls.
#[derive(Clone)]
struct OnceThenStuck {
    calls: Arc<AtomicUsize>,
    fail: bool,
}

impl Service<Request<retry_layer::ReplayBody<Full<Bytes>>>> for OnceThenStuck {
    type Response = Response<Full<Bytes>>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, std::io::Error>>;
    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::io::Error>> {
        if self.calls.load(Ordering::SeqCst) == 0 {
            std::task::Poll::Ready(Ok(()))
        } else {
            std::task::Poll::Pending
        }
    }
    fn call(&mut self, _req: Request<retry_layer::ReplayBody<Full<Bytes>>>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail {
            return std::future::ready(Err(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            )));
        }
        let mut res = Response::new(Full::new(Bytes::new()));
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        std::future::ready(Ok(res))
    }
}

/// A hedged GET to a [`OnceThenStuck`] whose first answer fails (`fail`) or is a 503: the
/// answer, how long it took, and the calls the service got.
async fn once_then_stuck(fail: bool) -> (Result<Response<Full<Bytes>>, BoxError>, Duration, usize) {
    let svc = OnceThenStuck {
        calls: Arc::default(),
        fail,
    };
    let hedge = HedgeLayer::new(policy(2, Duration::from_millis(50))).layer(svc.clone());
    let started = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(600),
        hedge.oneshot(
            Request::get("http://backend/books")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    )
    .await
    .expect("the call ends");
    (answer, started.elapsed(), svc.calls.load(Ordering::SeqCst))
}

/// A hedge whose first attempt failed in transport, on a service that then stops being ready:
/// the hedge due after it waits for readiness at most `response_head_timeout`, even with no
/// deadline and nothing in flight (no other timer is set then), and the call ends with that
/// failure. (Before: it waited forever.)
#[tokio::test(start_paused = true)]
async fn a_hedge_waiting_for_a_service_that_stopped_being_ready_ends_at_the_head_timeout() {
    let (answer, took, calls) = once_then_stuck(true).await;
    let e = answer.expect_err("the first attempt's failure as the answer");
    assert!(e.to_string().contains("reset"), "{e}");
    assert_eq!(took, Duration::from_secs(60));
    assert_eq!(calls, 1, "one attempt sent");
}

/// The same with a 503 in hand: the hedge does not wait for the service at all (held while it
/// waited, an answer's unread body may be what keeps the service busy, as on one HTTP/1.1
/// connection): the 503 is the answer at once.
#[tokio::test(start_paused = true)]
async fn a_hedge_with_a_failed_answer_in_hand_does_not_wait_for_a_service_that_is_not_ready() {
    let (answer, took, calls) = once_then_stuck(false).await;
    let answer = answer.expect("the 503 as the answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(took, Duration::ZERO);
    assert_eq!(calls, 1, "one attempt sent");
}

/// A hedge answered that its key is in flight at the server (409 `IDEMPOTENCY_IN_FLIGHT`): every
/// later hedge says so (`idempotency-seen-in-flight: ?1`), so that a server that fails open
/// never runs it beside that write; the attempts before it, and a call never told, do not.
#[tokio::test(start_paused = true)]
async fn a_hedge_told_its_key_is_in_flight_says_so_on_the_next() {
    let in_flight = Reply::Status(409, vec![("x-reason-code", "IDEMPOTENCY_IN_FLIGHT")]);
    let (r, _, script, _) = hedged(
        HedgeLayer::new(policy(3, Duration::from_secs(1))),
        keyed(get("/books/b1")),
        vec![in_flight, status(503), status(200)],
    )
    .await;
    assert_eq!(code(&r), 200);
    let said: Vec<bool> = script
        .seen()
        .iter()
        .map(|s| reason_code::says_seen_in_flight(&s.headers))
        .collect();
    assert_eq!(said, [false, true, true]);

    let (_, _, script, _) = hedged(
        HedgeLayer::new(policy(3, Duration::from_secs(1))),
        keyed(get("/books/b1")),
        vec![status(503), status(200)],
    )
    .await;
    assert!(script
        .seen()
        .iter()
        .all(|s| !reason_code::says_seen_in_flight(&s.headers)));
}

/// A `RetryLayer` over a `HedgeLayer`: one hedge is told its key is in flight at the server
/// (409 `IDEMPOTENCY_IN_FLIGHT`), another then answers a plain 503 that the hedge returns: the
/// retry layer's next attempt still says the call was told (`idempotency-seen-in-flight: ?1`),
/// so that a server that fails open never runs it beside that write. (The hedge put it on its
/// own later hedges only; the retry layer, which saw the 503, sent its retries without it, and
/// a server failing open ran the write beside the one in flight: sim seed 407964.)
#[tokio::test(start_paused = true)]
async fn a_retry_above_a_hedge_told_its_key_is_in_flight_says_so() {
    let in_flight = Reply::Status(409, vec![("x-reason-code", "IDEMPOTENCY_IN_FLIGHT")]);
    let (svc, script) = crate::support::backend::<retry_layer::ReplayBody<Full<Bytes>>>(vec![
        in_flight,
        status(503),
        status(503),
        status(200),
    ]);
    let hedged = HedgeLayer::new(policy(2, Duration::from_secs(1))).layer(svc);
    let mut retry = RetryLayer::new(RetryPolicy::default()).layer(hedged);
    let r = within_a_day("the call", async {
        retry
            .ready()
            .await
            .unwrap()
            .call(keyed(get("/books/b1")))
            .await
    })
    .await;
    assert_eq!(code(&r), 200);
    let said: Vec<bool> = script
        .seen()
        .iter()
        .map(|s| reason_code::says_seen_in_flight(&s.headers))
        .collect();
    assert_eq!(
        said,
        [false, true, true, true],
        "every request after the 409 says so"
    );
}

/// A hedge reads the hop it is made from, as `Retry` does: a request served as a retry of the
/// hop above is sent once, not hedged (the hop above retries; hedging here too multiplies its
/// attempts), and a failure it could have hedged tells the hop it deferred (its caller retries
/// within its adaptive budget only). (Before: hedged under an inbound retry, and the hop was
/// never told.)
#[tokio::test(start_paused = true)]
async fn a_hedge_under_an_inbound_retry_sends_once_and_defers() {
    let hop = Arc::new(reason_code::Hop::new(1));
    assert!(hop.arrived_as_retry());
    let (r, _, script, _) = hop
        .clone()
        .scope(hedged(
            HedgeLayer::new(policy(3, 50 * MS)),
            get("/books/b1"),
            vec![Reply::Slow(Duration::from_secs(1), 503)],
        ))
        .await;
    assert_eq!(code(&r), 503);
    assert_eq!(script.attempts(), 1, "not hedged under an inbound retry");
    assert!(hop.deferred(), "the hop is told the failure was deferred");
    assert!(!hop.gave_up());

    // Not under a retry: hedged, and a failure of every attempt is deferred too.
    let hop = Arc::new(reason_code::Hop::new(0));
    let (r, _, script, _) = hop
        .clone()
        .scope(hedged(
            HedgeLayer::new(policy(2, 50 * MS)),
            get("/books/b1"),
            vec![status(503)],
        ))
        .await;
    assert_eq!(code(&r), 503);
    assert_eq!(script.attempts(), 2, "hedged");
    assert!(hop.deferred());
}

/// A GET through `Retry` (2 attempts) over `Hedge` (2 attempts, 50 ms) over a backend answering
/// `replies`: answered 200, and the `x-previous-attempts` each request the backend saw carried.
async fn previous_attempts_under_retry(replies: Vec<Reply>) -> Vec<Option<String>> {
    let (svc, script) = backend::<retry_layer::ReplayBody<Full<Bytes>>>(replies);
    let retry = RetryLayer::new(RetryPolicy::builder().max_attempts(2).build().unwrap());
    let stack = retry.layer(HedgeLayer::new(policy(2, 50 * MS)).layer(svc));
    let res = within_a_day("the call", stack.oneshot(get("/books/b1")))
        .await
        .expect("an answer");
    assert_eq!(res.status(), StatusCode::OK);
    script
        .seen()
        .iter()
        .map(|s| previous_attempts(&s.headers))
        .collect()
}

/// The `x-previous-attempts` a request carried.
fn previous_attempts(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("x-previous-attempts")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// A hedge whose first attempt was answered (a 503: it reached the server) and whose next
/// hedge provably never left answers with the 503, not with "never sent": the retry layer above
/// counts its attempt as sent, and its retry tells the server it is one (the hop serving it
/// then sends its own downstream writes once). Before, the unsent hedge's error replaced the
/// answer, and the retry went out saying it was a first attempt (simulator seed 4100043).
#[tokio::test(start_paused = true)]
async fn a_hedge_answers_what_was_sent_not_the_hedge_that_never_left() {
    let previous = previous_attempts_under_retry(vec![
        status(503),
        Reply::Io(std::io::ErrorKind::ConnectionRefused),
        status(200),
    ])
    .await;
    assert_eq!(
        previous,
        [None, Some("1".into()), Some("1".into())],
        "the retry says it is one: the first attempt reached the server"
    );
}

/// The same over sockets, HTTP/1.1 and h2c: the first attempt reaches a real server and is
/// answered 503; the hedge goes to a port nothing listens on (refused: provably never sent); the
/// retry above reaches the server again and says it is a retry.
#[tokio::test]
async fn a_hedge_answers_what_was_sent_not_the_hedge_that_never_left_on_the_wire() {
    use crate::wire::{serve, status as act, Transport};
    for proto in [Transport::Http1, Transport::Http2] {
        let server = serve(|_, n| if n == 0 { act(503) } else { act(200) }).await;
        let closed = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let client =
            proto.client::<retry_layer::ReplayBody<retry_layer::ReplayBody<Full<Bytes>>>>();
        // The second attempt (the hedge) goes to the closed port; every other to the server.
        let sent = Arc::new(AtomicUsize::new(0));
        let router = tower::service_fn(move |mut req: Request<_>| {
            if sent.fetch_add(1, Ordering::SeqCst) == 1 {
                *req.uri_mut() = format!("http://{closed}/books/b1").parse().unwrap();
            }
            client.request(req)
        });
        let retry = RetryLayer::new(RetryPolicy::builder().max_attempts(2).build().unwrap());
        let stack = retry.layer(HedgeLayer::new(policy(2, 50 * MS)).layer(router));
        let req = Request::get(server.url("/books/b1"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = crate::wire::bounded("the call", stack.oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{proto:?}");
        let previous: Vec<_> = server
            .seen()
            .iter()
            .map(|s| previous_attempts(&s.headers))
            .collect();
        assert_eq!(
            previous,
            [None, Some("1".into())],
            "{proto:?}: the retry says it is one"
        );
    }
}

/// Sent once under an inbound retry, an attempt that fails on the way (reset, or no head in
/// time) tells the hop it deferred, as a 503 does: a failure any hedge could have tried again.
/// Before, only a retryable status told it, and the hop answered its caller a bare 503 (simulator
/// seed 4100061: a handler's downstream write cut by a partition).
#[tokio::test(start_paused = true)]
async fn a_hedge_sent_once_under_an_inbound_retry_tells_the_hop_of_a_transport_failure() {
    for (what, reply) in [
        ("reset", Reply::Io(std::io::ErrorKind::ConnectionReset)),
        (
            "no head in time",
            Reply::Slow(Duration::from_secs(3600), 200),
        ),
    ] {
        let hop = Arc::new(reason_code::Hop::new(1));
        let (r, _, script, _) = hop
            .clone()
            .scope(hedged(
                HedgeLayer::new(policy(3, 50 * MS)),
                get("/books/b1"),
                vec![reply],
            ))
            .await;
        assert!(r.is_err(), "{what}: the failure is the answer");
        assert_eq!(script.attempts(), 1, "{what}: sent once");
        assert!(hop.deferred(), "{what}: the hop is told it deferred");
    }
}

/// Under `Retry`, a hedge keeps the attempt header the retry wrote on its retry, and its own
/// hedges count on from it. (Before: it stripped the header, and the server took the retry for
/// a first attempt.) A forwarded header, on a request `Retry` did not mark, is still dropped.
#[tokio::test(start_paused = true)]
async fn a_hedge_under_retry_keeps_the_attempt_header_it_was_given() {
    let previous =
        previous_attempts_under_retry(vec![status(503), status(503), status(503), status(200)])
            .await;
    assert_eq!(
        previous,
        [None, Some("1".into()), Some("1".into()), Some("2".into())],
        "the retry's header kept, the hedges counting on"
    );
}

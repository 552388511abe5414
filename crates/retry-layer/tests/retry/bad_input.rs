//! Garbage from the server or the caller: no panic, treated as absent, a warning logged.

use std::cell::RefCell;
use std::io;
use std::sync::Once;

use http::HeaderValue;
use retry_layer::RetryPolicy;

use crate::support::*;

thread_local! {
    /// The events logged on this thread since its test called [`capture`].
    static LOGS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Writes into the logging thread's [`LOGS`].
struct ThreadLogs;

impl io::Write for ThreadLogs {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        LOGS.with(|logs| logs.borrow_mut().extend_from_slice(buf));
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What this thread logged since [`capture`].
struct Captured;

impl Captured {
    fn text(&self) -> String {
        LOGS.with(|logs| String::from_utf8_lossy(&logs.borrow()).into_owned())
    }
}

/// Captures the WARN events of the calling test. The subscriber is the process's, set once, not
/// a thread's: with a thread-local one (`set_default`), tests of this binary running on other
/// threads raced tracing's per-callsite interest cache, and a warning was sometimes missed
/// (seen once in three runs). Each event goes to the buffer of the thread that logs it: these
/// tests run their calls on their own thread (a current-thread runtime), so each reads its own.
fn capture() -> Captured {
    static SUBSCRIBER: Once = Once::new();
    SUBSCRIBER.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_writer(|| ThreadLogs)
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other test of this binary sets a subscriber");
    });
    LOGS.with(|logs| logs.borrow_mut().clear());
    Captured
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn garbage_retry_after_is_ignored_with_a_warning() {
    let logs = capture();
    let (res, script, _) = call_scripted(
        RetryPolicy::default(),
        get("/books/b1"),
        vec![
            Reply::Status(503, vec![("retry-after", "in a while")]),
            status(200),
        ],
    )
    .await;
    assert_eq!(res.unwrap().status(), 200);
    assert_eq!(script.attempts(), 2, "retried on the computed backoff");
    assert!(
        logs.text().contains("malformed Retry-After"),
        "{}",
        logs.text()
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn non_ascii_retry_after_is_ignored() {
    let (svc, script) = backend::<http_body_util::Full<bytes::Bytes>>(vec![status(200)]);
    // Build the reply by hand: a header value with a non-ASCII byte.
    let svc = tower::ServiceExt::map_response(svc, |mut res: http::Response<_>| {
        if res.status() == 200 {
            *res.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
            res.headers_mut().insert(
                "retry-after",
                HeaderValue::from_bytes(b"\xff\xfe5").unwrap(),
            );
        }
        res
    });
    let mut retry = retry_layer::Retry::new(svc, RetryPolicy::default());
    let res = within_a_day(
        "the call",
        tower::ServiceExt::oneshot(&mut retry, get("/books/b1")),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(
        script.attempts(),
        3,
        "ignored: the computed backoff applies"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn garbage_grpc_status_is_unknown_and_final() {
    let logs = capture();
    let reply = Reply::Status(
        200,
        vec![
            ("content-type", "application/grpc"),
            ("grpc-status", "fourteen"),
        ],
    );
    let (res, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/GetBook")),
        vec![reply],
    )
    .await;
    assert_eq!(res.unwrap().status(), 200);
    assert_eq!(script.attempts(), 1, "UNKNOWN is not retried");
    assert!(
        logs.text().contains("malformed grpc-status"),
        "{}",
        logs.text()
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn garbage_grpc_timeout_is_ignored_with_a_warning() {
    let logs = capture();
    let mut req = keyed(grpc_req("/lib.Library/GetBook"));
    req.headers_mut()
        .insert("grpc-timeout", "soon".parse().unwrap());
    let (_, script, _) = call_scripted(RetryPolicy::default(), req, vec![grpc("14")]).await;
    assert_eq!(script.attempts(), 3, "no deadline: the attempts decide");
    assert_eq!(
        script.seen()[0].headers["grpc-timeout"],
        "soon",
        "passed through untouched"
    );
    assert!(
        logs.text().contains("malformed grpc-timeout"),
        "{}",
        logs.text()
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn garbage_pushback_stops_retries() {
    let reply = Reply::Status(
        200,
        vec![
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("grpc-retry-pushback-ms", "1e3"),
        ],
    );
    let (_, script, layer) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/GetBook")),
        vec![reply],
    )
    .await;
    assert_eq!(
        script.attempts(),
        1,
        "gRFC A6: malformed pushback means do not retry"
    );
    assert_eq!(layer.stats().pushback_stops, 1);
}

/// Every builder duration is validated, so no deadline or timer computed from it can
/// overflow the clock (before, `total_timeout(Duration::MAX)` built, then panicked on a call).
#[test]
fn out_of_range_durations_are_rejected_with_a_message() {
    use std::time::Duration;
    type Setter = fn(retry_layer::RetryPolicyBuilder, Duration) -> retry_layer::RetryPolicyBuilder;
    let setters: [(&str, Setter); 6] = [
        ("total_timeout", |b, d| b.total_timeout(d)),
        ("attempt_timeout", |b, d| b.attempt_timeout(d)),
        ("max_pushback", |b, d| b.max_pushback(d)),
        ("base_delay", |b, d| b.base_delay(d)),
        ("max_delay", |b, d| b.max_delay(d)),
        ("min_attempt_time", |b, d| b.min_attempt_time(d)),
    ];
    for (name, set) in setters {
        for d in [
            Duration::MAX,
            retry_layer::RetryPolicy::MAX_DURATION + Duration::from_secs(1),
        ] {
            let err = set(RetryPolicy::builder(), d).build().unwrap_err();
            assert!(err.to_string().contains(name), "{err}");
        }
        assert!(set(
            RetryPolicy::builder(),
            retry_layer::RetryPolicy::MAX_DURATION
        )
        .build()
        .is_ok());
    }
    for zero in [
        RetryPolicy::builder().total_timeout(Duration::ZERO),
        RetryPolicy::builder().attempt_timeout(Duration::ZERO),
    ] {
        assert!(zero
            .build()
            .unwrap_err()
            .to_string()
            .contains("greater than zero"));
    }
    let err = RetryPolicy::builder()
        .max_unsent_retries(u32::MAX)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max_unsent_retries"), "{err}");
}

/// Huge values from the caller or the server never panic.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn huge_deadlines_and_pushbacks_do_not_panic() {
    use std::time::Duration;
    let mut req = get("/books/b1");
    req.extensions_mut()
        .insert(retry_layer::Deadline::after(Duration::MAX));
    let (res, script, _) =
        call_scripted(RetryPolicy::default(), req, vec![status(503), status(200)]).await;
    assert_eq!(res.unwrap().status(), 200);
    assert_eq!(script.attempts(), 2);

    // The largest pushback allowed, and a Retry-After far beyond it.
    let policy = RetryPolicy::builder()
        .max_pushback(retry_layer::RetryPolicy::MAX_DURATION)
        .build()
        .unwrap();
    let (res, script, layer) = call_scripted(
        policy,
        get("/books/b1"),
        vec![Reply::Status(
            503,
            vec![("retry-after", "18446744073709551615")],
        )],
    )
    .await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().pushback_stops + layer.stats().exhausted, 1);

    // The largest grpc-timeout the format can say (99999999 hours).
    let mut req = keyed(grpc_req("/lib.Library/GetBook"));
    req.headers_mut()
        .insert("grpc-timeout", "99999999H".parse().unwrap());
    let (_, script, _) =
        call_scripted(RetryPolicy::default(), req, vec![grpc("14"), grpc("0")]).await;
    assert_eq!(script.attempts(), 2);
}

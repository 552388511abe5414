//! One test per row of the design table, HTTP and gRPC forms: retried or not, how many attempts.

use std::io::ErrorKind;

use bytes::Bytes;
use http::Request;
use reason_code::{ClientRule, Code, RetryTable};
use retry_layer::{Conflict, RetryError, RetryPolicy};

use tokio::time::Duration;

use crate::support::*;

macro_rules! rows {
    ($($name:ident: $req:expr, [$($reply:expr),+] => $attempts:expr;)*) => {$(
        #[tokio::test(start_paused = true)]
        async fn $name() {
            let replies = vec![$($reply),+];
            let (res, script, layer) =
                call_scripted(RetryPolicy::default(), $req, replies.clone()).await;
            assert_eq!(script.attempts(), $attempts, "attempts");
            assert_eq!(layer.stats().attempts, $attempts as u64);
            // What the caller gets is the last attempt's answer, as it was.
            let last = replies[($attempts - 1).min(replies.len() - 1)].clone();
            is_the_answer_to(&res, &last);
        }
    )*};
}

/// `res` is what the backend answered with `reply`: its status and `grpc-status`, or its
/// transport error (down the error's sources).
fn is_the_answer_to(
    res: &Result<http::Response<http_body_util::Full<Bytes>>, reason_code::BoxError>,
    reply: &Reply,
) {
    match (reply, res) {
        (Reply::Status(code, headers), Ok(r)) => {
            assert_eq!(r.status().as_u16(), *code, "the last attempt's status");
            for (name, value) in headers {
                assert_eq!(r.headers()[*name], *value, "the last attempt's {name}");
            }
        }
        (Reply::Io(kind), Err(e)) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&**e);
            let mut found = None;
            while let Some(s) = source {
                if let Some(io) = s.downcast_ref::<std::io::Error>() {
                    found = Some(io.kind());
                }
                source = s.source();
            }
            assert_eq!(
                found,
                Some(*kind),
                "the last attempt's transport error: {e}"
            );
        }
        (Reply::Status(code, _), Err(e)) => panic!("expected the last attempt's {code}, got {e}"),
        (Reply::Io(kind), Ok(r)) => panic!("expected {kind:?}, got {}", r.status()),
        _ => panic!("rows script statuses and transport errors only"),
    }
}

rows! {
    // OK: a success is never retried.
    http_200_post: post("/orders"), [status(201)] => 1;
    grpc_ok: grpc_req("/lib.Library/CreateOrder"), [grpc("0")] => 1;

    // Unsent: retried for any request, with transparent retries beyond max_attempts (3 + 2).
    unsent_post_without_key: post("/orders"), [Reply::Io(ErrorKind::ConnectionRefused)] => 5;
    unsent_then_ok: post("/orders"), [Reply::Io(ErrorKind::ConnectionRefused), status(201)] => 2;

    // Ambiguous: only idempotent or keyed.
    lost_after_send_post_without_key: post("/orders"), [Reply::Io(ErrorKind::ConnectionReset)] => 1;
    lost_after_send_get: get("/books/b1"), [Reply::Io(ErrorKind::ConnectionReset)] => 3;
    lost_after_send_keyed_post: keyed(post("/orders")), [Reply::Io(ErrorKind::ConnectionReset)] => 3;

    // 502, 503, UNAVAILABLE: idempotent or keyed.
    http_503_post_without_key: post("/orders"), [status(503)] => 1;
    http_503_put: Request::put("http://svc/books/b1").body(Default::default()).unwrap(), [status(503)] => 3;
    http_503_delete: Request::delete("http://svc/books/b1").body(Default::default()).unwrap(), [status(503)] => 3;
    http_502_get: get("/books/b1"), [status(502)] => 3;
    http_503_keyed_post: keyed(post("/orders")), [status(503)] => 3;
    http_503_then_ok: keyed(post("/orders")), [status(503), status(201)] => 2;
    grpc_unavailable_not_declared: grpc_req("/lib.Library/CreateOrder"), [grpc("14")] => 1;
    grpc_unavailable_keyed: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("14")] => 3;

    // 429, RESOURCE_EXHAUSTED: any request.
    http_429_post: post("/orders"), [status(429)] => 3;
    grpc_resource_exhausted: grpc_req("/lib.Library/CreateOrder"), [grpc("8")] => 3;

    // 504, DEADLINE_EXCEEDED: idempotent or keyed (no deadline set here, so it fits).
    http_504_get: get("/books/b1"), [status(504)] => 3;
    http_504_post_without_key: post("/orders"), [status(504)] => 1;
    grpc_deadline_exceeded_keyed: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("4")] => 3;

    // 409, ABORTED: not without a rebuild hook.
    http_409_get: get("/books/b1"), [status(409)] => 1;
    grpc_aborted: keyed(grpc_req("/lib.Library/DeductStock")), [grpc("10")] => 1;

    // 500, INTERNAL, UNKNOWN: not by default.
    http_500_get: get("/books/b1"), [status(500)] => 1;
    grpc_internal: keyed(grpc_req("/lib.Library/GetBook")), [grpc("13")] => 1;
    grpc_unknown: keyed(grpc_req("/lib.Library/GetBook")), [grpc("2")] => 1;

    // Permanent failures.
    http_400: keyed(post("/orders")), [status(400)] => 1;
    http_401: get("/books/b1"), [status(401)] => 1;
    http_403: get("/books/b1"), [status(403)] => 1;
    http_404: get("/books/b1"), [status(404)] => 1;
    grpc_invalid_argument: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("3")] => 1;
    grpc_already_exists: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("6")] => 1;
    grpc_out_of_range: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("11")] => 1;
    http_412: get("/books/b1"), [status(412)] => 1;
    http_501: get("/books/b1"), [status(501)] => 1;
    grpc_failed_precondition: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("9")] => 1;
    grpc_unimplemented: keyed(grpc_req("/lib.Library/CreateOrder")), [grpc("12")] => 1;

    // DATA_LOSS: never.
    grpc_data_loss: keyed(grpc_req("/lib.Library/GetBook")), [grpc("15")] => 1;

    // A business reason code refines a failure's status, never a success.
    reason_code_upstream_unavailable: get("/books/b1"),
        [Reply::Status(409, vec![("x-reason-code", "UPSTREAM_UNAVAILABLE")])] => 3;
    reason_code_stock_conflict_on_503: keyed(post("/orders")),
        [Reply::Status(503, vec![("x-reason-code", "STOCK_CONFLICT")])] => 1;
    reason_code_on_a_success: keyed(post("/orders")),
        [Reply::Status(201, vec![("x-reason-code", "RATE_LIMITED")])] => 1;

    // A gRPC response that sent headers without a status is committed.
    grpc_committed_response: keyed(grpc_req("/lib.Library/GetBook")),
        [Reply::Status(200, vec![("content-type", "application/grpc")])] => 1;

    // A replay of a recorded outcome is final, whatever its status: it will not change.
    replayed_http_503: keyed(post("/orders")),
        [Reply::Status(503, vec![("idempotent-replayed", "true")]), status(201)] => 1;
    replayed_http_429: keyed(post("/orders")),
        [Reply::Status(429, vec![("idempotent-replayed", "true")]), status(201)] => 1;
    replayed_grpc_unavailable: keyed(grpc_req("/lib.Library/CreateOrder")),
        [Reply::Status(200, vec![
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("idempotent-replayed", "true"),
        ]), grpc("0")] => 1;
}

#[tokio::test(start_paused = true)]
async fn grpc_declared_idempotent_method_is_retried() {
    let policy = RetryPolicy::builder()
        .idempotent_grpc_methods(retry_layer::GrpcMethods::new(["/lib.Library/GetBook"]).unwrap())
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(
        policy.clone(),
        grpc_req("/lib.Library/GetBook"),
        vec![grpc("14")],
    )
    .await;
    assert_eq!(script.attempts(), 3);
    let (_, script, _) = call_scripted(
        policy,
        grpc_req("/lib.Library/CreateOrder"),
        vec![grpc("14")],
    )
    .await;
    assert_eq!(script.attempts(), 1);
    // A whole service.
    let policy = RetryPolicy::builder()
        .idempotent_grpc_methods(retry_layer::GrpcMethods::new(["/lib.Library/"]).unwrap())
        .build()
        .unwrap();
    let (_, script, _) =
        call_scripted(policy, grpc_req("/lib.Library/Anything"), vec![grpc("14")]).await;
    assert_eq!(script.attempts(), 3);
}

#[tokio::test(start_paused = true)]
async fn internal_is_retried_when_opted_in() {
    let policy = RetryPolicy::builder()
        .table(RetryTable::default().with_client_rule(Code::Internal, ClientRule::IfIdempotent))
        .build()
        .unwrap();
    let (res, script, _) =
        call_scripted(policy, get("/books/b1"), vec![status(500), status(200)]).await;
    assert_eq!(res.unwrap().status(), 200);
    assert_eq!(script.attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn conflict_is_rebuilt_through_the_hook() {
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(|c: Conflict| async move {
            assert_eq!(c.code, Code::Aborted);
            assert_eq!(c.response.status, 409);
            let (parts, body) = c.request.into_parts();
            assert_eq!(body, "{\"book_id\":\"b1\"}");
            Some(Request::from_parts(
                parts,
                Bytes::from_static(b"{\"book_id\":\"b1\",\"v\":2}"),
            ))
        })
        .build()
        .unwrap();
    let replies = vec![
        Reply::Status(409, vec![("x-reason-code", "STOCK_CONFLICT")]),
        status(201),
    ];
    let (res, script, _) = call_scripted(policy, keyed(post("/books/b1/deduct")), replies).await;
    assert_eq!(res.unwrap().status(), 201);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, "{\"book_id\":\"b1\",\"v\":2}");
}

/// The same request, rebuilt with its own body.
async fn same_again(c: Conflict) -> Option<Request<Bytes>> {
    Some(c.request)
}

/// A conflict answered with a pushback is rebuilt, then sent after that
/// pushback (before, the rebuilt request was sent as soon as the hook answered).
#[tokio::test(start_paused = true)]
async fn a_rebuild_waits_for_the_servers_pushback() {
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(same_again)
        .build()
        .unwrap();
    let replies = vec![
        Reply::Status(
            409,
            vec![("x-reason-code", "STOCK_CONFLICT"), ("retry-after", "2")],
        ),
        status(201),
    ];
    let (res, script, _) = call_scripted(policy, keyed(post("/books/b1/deduct")), replies).await;
    assert_eq!(res.unwrap().status(), 201);
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(gap >= Duration::from_secs(2), "sent {gap:?} after the 409");
    assert!(
        gap < Duration::from_millis(2_100),
        "sent {gap:?} after the 409"
    );
}

/// The deadline is checked again once the hook has answered: a hook that took
/// most of what was left gets the conflict back instead of an attempt with no time to run.
#[tokio::test(start_paused = true)]
async fn a_rebuild_that_leaves_no_time_for_an_attempt_is_not_sent() {
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(|c: Conflict| async move {
            tokio::time::sleep(Duration::from_millis(980)).await;
            Some(c.request)
        })
        .build()
        .unwrap();
    let mut req = keyed(post("/books/b1/deduct"));
    req.extensions_mut()
        .insert(retry_layer::Deadline::after(Duration::from_secs(1)));
    let replies = vec![status(409), status(201)];
    let (res, script, layer) = call_scripted(policy, req, replies).await;
    assert_eq!(res.unwrap().status(), 409, "the conflict is the answer");
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().deadline_stops, 1);
    assert_eq!(layer.stats().retries, 0);
}

#[tokio::test(start_paused = true)]
async fn a_declining_hook_returns_the_conflict_response() {
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(|_c: Conflict| async move { None })
        .build()
        .unwrap();
    let (res, script, _) = call_scripted(policy, keyed(post("/orders")), vec![status(409)]).await;
    assert_eq!(res.unwrap().status(), 409);
    assert_eq!(script.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn ensure_idempotency_key_adds_one_key_and_keeps_callers() {
    let policy = RetryPolicy::builder()
        .ensure_idempotency_key()
        .build()
        .unwrap();
    let (res, script, _) = call_scripted(policy.clone(), post("/orders"), vec![status(503)]).await;
    let info = retry_layer::RetryInfo::of(res.as_ref().unwrap())
        .unwrap()
        .clone();
    assert_eq!(info.attempts, 3);
    assert_eq!(
        info.idempotency_key.unwrap(),
        script.seen()[0].headers["x-idempotency-key"]
    );
    let keys: Vec<_> = script
        .seen()
        .iter()
        .map(|s| s.headers["x-idempotency-key"].clone())
        .collect();
    assert_eq!(keys.len(), 3, "the generated key makes the POST retryable");
    assert!(
        keys.iter().all(|k| *k == keys[0]),
        "one key on every attempt"
    );
    assert_eq!(keys[0].len(), 36, "a UUID");

    let (_, script, _) =
        call_scripted(policy.clone(), keyed(post("/orders")), vec![status(503)]).await;
    assert!(script
        .seen()
        .iter()
        .all(|s| s.headers["x-idempotency-key"] == "order-7f3a9c21"));

    // The IETF header counts as a key: nothing is added.
    let mut req = post("/orders");
    req.headers_mut()
        .insert("idempotency-key", "\"abc12345\"".parse().unwrap());
    let (_, script, _) = call_scripted(policy.clone(), req, vec![status(201)]).await;
    assert!(!script.seen()[0].headers.contains_key("x-idempotency-key"));

    // Reads get no key, and a first-time success carries no RetryInfo.
    let (res, script, _) = call_scripted(policy, get("/books/b1"), vec![status(200)]).await;
    assert!(!script.seen()[0].headers.contains_key("x-idempotency-key"));
    assert!(retry_layer::RetryInfo::of(&res.unwrap()).is_none());
}

#[tokio::test(start_paused = true)]
async fn retries_carry_the_attempt_header() {
    let (_, script, _) =
        call_scripted(RetryPolicy::default(), get("/books/b1"), vec![status(503)]).await;
    let seen = script.seen();
    assert!(!seen[0].headers.contains_key("x-previous-attempts"));
    assert_eq!(seen[1].headers["x-previous-attempts"], "1");
    assert_eq!(seen[2].headers["x-previous-attempts"], "2");

    let (_, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/GetBook")),
        vec![grpc("14")],
    )
    .await;
    let seen = script.seen();
    assert!(!seen[0].headers.contains_key("grpc-previous-rpc-attempts"));
    assert_eq!(seen[2].headers["grpc-previous-rpc-attempts"], "2");
}

/// A call answered that its key is in flight at the server (409 `IDEMPOTENCY_IN_FLIGHT`, or
/// ABORTED with that reason over gRPC) says so on every later attempt
/// (`idempotency-seen-in-flight: ?1`): a server that fails open then never runs it beside that
/// write. Attempts before it, and a call never told, do not say it.
#[tokio::test(start_paused = true)]
async fn a_call_told_its_key_is_in_flight_says_so_on_later_attempts() {
    let said = |script: &crate::support::Script| -> Vec<bool> {
        script
            .seen()
            .iter()
            .map(|s| reason_code::says_seen_in_flight(&s.headers))
            .collect()
    };
    let in_flight = Reply::Status(409, vec![("x-reason-code", "IDEMPOTENCY_IN_FLIGHT")]);
    let (_, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(post("/orders")),
        vec![status(503), in_flight, status(503)],
    )
    .await;
    assert_eq!(said(&script), [false, false, true]);

    let grpc_in_flight = Reply::Status(
        200,
        vec![
            ("content-type", "application/grpc"),
            ("grpc-status", "10"),
            ("x-reason-code", "IDEMPOTENCY_IN_FLIGHT"),
        ],
    );
    let (_, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/CreateBook")),
        vec![grpc_in_flight, grpc("14")],
    )
    .await;
    assert_eq!(said(&script), [false, true, true]);

    let (_, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(post("/orders")),
        vec![status(503)],
    )
    .await;
    assert_eq!(
        said(&script),
        [false, false, false],
        "never told, never said"
    );
}

/// The attempt header counts only attempts that may have reached the server: one that
/// provably never left the client (connection refused) is not a previous attempt, and a retry
/// after nothing but such attempts is a first attempt to the server. Before, every attempt made
/// counted, and a `HopLayer` below served the first request it ever saw as a retry.
#[tokio::test(start_paused = true)]
async fn the_attempt_header_counts_only_attempts_that_were_sent() {
    let refused = || Reply::Io(ErrorKind::ConnectionRefused);
    let replies = vec![refused(), status(503), refused(), status(200)];
    let (res, script, _) = call_scripted(RetryPolicy::default(), get("/books/b1"), replies).await;
    assert_eq!(res.unwrap().status(), 200);
    let previous: Vec<_> = script
        .seen()
        .iter()
        .map(|s| s.headers.get("x-previous-attempts").cloned())
        .collect();
    assert_eq!(
        previous,
        [
            None,
            None,
            Some("1".parse().unwrap()),
            Some("1".parse().unwrap())
        ]
    );

    let req = keyed(grpc_req("/lib.Library/CreateOrder"));
    let (_, script, _) =
        call_scripted(RetryPolicy::default(), req, vec![refused(), grpc("0")]).await;
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    assert!(!seen[1].headers.contains_key("grpc-previous-rpc-attempts"));
}

#[tokio::test(start_paused = true)]
async fn the_last_outcome_is_returned_when_attempts_run_out() {
    let (res, _, layer) =
        call_scripted(RetryPolicy::default(), get("/books/b1"), vec![status(503)]).await;
    assert_eq!(res.unwrap().status(), 503);
    let stats = layer.stats();
    assert_eq!((stats.requests, stats.retries, stats.exhausted), (1, 2, 1));

    let (res, _, _) = call_scripted(
        RetryPolicy::default(),
        get("/books/b1"),
        vec![Reply::Io(ErrorKind::ConnectionReset)],
    )
    .await;
    let err = res.unwrap_err();
    let err = retry_layer::RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.attempts(), 3);
    assert_eq!(
        err.downcast_ref::<std::io::Error>().map(|e| e.kind()),
        Some(ErrorKind::ConnectionReset)
    );
}

/// A hook that sets a key of its own keeps it; a rebuilt read gets no key; a rebuilt
/// write without any key (no intent key, no ensure) is not retried after an ambiguous failure.
#[tokio::test(start_paused = true)]
async fn a_rebuilt_request_is_judged_afresh() {
    // The hook sets another key: that one is sent.
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(|c: Conflict| async move {
            let (mut parts, body) = c.request.into_parts();
            parts
                .headers
                .insert("x-idempotency-key", "order-second-try".parse().unwrap());
            Some(Request::from_parts(parts, body))
        })
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(
        policy,
        keyed(post("/orders")),
        vec![
            status(409),
            Reply::Io(ErrorKind::ConnectionReset),
            status(201),
        ],
    )
    .await;
    let keys: Vec<_> = script
        .seen()
        .iter()
        .map(|s| s.headers["x-idempotency-key"].clone())
        .collect();
    assert_eq!(
        keys,
        ["order-7f3a9c21", "order-second-try", "order-second-try"]
    );

    // A GET rebuilt as a POST without a key: the POST is not idempotent, and there is no
    // intent key to keep, so the ambiguous failure is final.
    let policy = RetryPolicy::builder()
        .rebuild_on_conflict(|_c: Conflict| async move {
            Some(
                Request::post("http://svc/orders")
                    .body(Bytes::from_static(b"{}"))
                    .unwrap(),
            )
        })
        .build()
        .unwrap();
    let (res, script, _) = call_scripted(
        policy,
        get("/books/b1"),
        vec![status(409), Reply::Io(ErrorKind::ConnectionReset)],
    )
    .await;
    let err = res.unwrap_err();
    let err = RetryError::of(&*err).expect("a RetryError");
    assert_eq!(err.attempts(), 2, "{err}");
    assert_eq!(
        err.downcast_ref::<std::io::Error>().map(|e| e.kind()),
        Some(ErrorKind::ConnectionReset),
        "{err}"
    );
    assert_eq!(
        script.attempts(),
        2,
        "the rebuilt POST may have run: not resent"
    );
    assert!(!script.seen()[1].headers.contains_key("x-idempotency-key"));
}

//! The two halves as one product: every answer `IdempotencyLayer` makes itself, sent over a real
//! socket to a client with the real `RetryLayer` in front, gets the verdict the one table
//! promises: retried exactly when nothing ran and a later attempt can succeed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use axum_orders::inventory::Inventory;
use bytes::Bytes;
use e2e::servers::{start_library, start_library_gated};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::conformance::{Fault, FaultStore, Op, Rule};
use idempotency_layer::{IdempotencyLayer, InFlight, MemoryStore, RejectReason};
use retry_layer::{RetryLayer, RetryPolicy};
use test_support::faults::Unavailable;
use test_support::gate::Gate;
use test_support::wait;
use tower::{Service, ServiceBuilder, ServiceExt};

/// One route per answer of the layer, each counting the attempts that reach the server.
struct Server {
    addr: SocketAddr,
    attempts: Arc<AtomicUsize>,
    executions: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
    /// The layer of `/in-flight` (its counters).
    in_flight: IdempotencyLayer<MemoryStore>,
}

async fn server() -> Server {
    let attempts = Arc::new(AtomicUsize::new(0));
    let executions = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handler = {
        let (executions, gate) = (executions.clone(), gate.clone());
        move |uri: http::Uri| {
            let (executions, gate) = (executions.clone(), gate.clone());
            async move {
                executions.fetch_add(1, Ordering::SeqCst);
                if uri.path() == "/panic" {
                    panic!("the handler failed (test)");
                }
                if uri.path() == "/in-flight" {
                    gate.acquire().await.unwrap().forget();
                }
                // A success that carries a business reason code (say, "created, but you are
                // close to your rate limit"): still a success on both halves.
                let reason = (uri.path() == "/success-with-reason")
                    .then_some([("x-reason-code", "RATE_LIMITED")]);
                (
                    StatusCode::CREATED,
                    axum::response::AppendHeaders(reason.into_iter().flatten()),
                    "created",
                )
            }
        }
    };
    let base = || {
        IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
    };
    let counting = {
        let attempts = attempts.clone();
        tower::util::MapRequestLayer::new(move |req: Request<axum::body::Body>| {
            attempts.fetch_add(1, Ordering::SeqCst);
            req
        })
    };
    // The store is unreachable for the first claim.
    let store = FaultStore::new(MemoryStore::new());
    store.inject(Rule::new(Op::Begin, Fault::Fail).times(1));
    let in_flight = base().in_flight(InFlight::Reject);
    let app = Router::new()
        .route("/plain", post(handler.clone()).layer(base()))
        .route(
            "/tenant",
            post(handler.clone()).layer(IdempotencyLayer::new(MemoryStore::new())),
        )
        .route(
            "/small",
            post(handler.clone()).layer(base().max_request_bytes(16)),
        )
        .route("/panic", post(handler.clone()).layer(base()))
        .route("/success-with-reason", post(handler.clone()).layer(base()))
        .route("/in-flight", post(handler.clone()).layer(in_flight.clone()))
        .route(
            "/store-down",
            post(handler).layer(
                IdempotencyLayer::new(store).tenant(idempotency_layer::TenantSource::fixed("t")),
            ),
        )
        .layer(counting);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        addr,
        attempts,
        executions,
        gate,
        in_flight,
    }
}

fn request(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: &'static str,
) -> Request<Full<Bytes>> {
    let mut b =
        Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("x-idempotency-key", key);
    }
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// Sends through `RetryLayer` (default policy) and returns the final status and the attempts the
/// server saw for this call.
async fn through_retry(server: &Server, req: Request<Full<Bytes>>) -> (StatusCode, usize) {
    let before = server.attempts.load(Ordering::SeqCst);
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(Client::builder(TokioExecutor::new()).build_http());
    let res = tokio::time::timeout(
        Duration::from_secs(20),
        client.ready().await.unwrap().call(req),
    )
    .await
    .expect("an answer within 20 s")
    .expect("a response");
    let status = res.status();
    let _ = res.into_body().collect().await;
    (status, server.attempts.load(Ordering::SeqCst) - before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_over_http_gets_the_verdict_the_table_promises() {
    let s = server().await;
    let key = Some("order-pair-0001");

    // Final answers: the request can never succeed as it is, or the handler ran.
    let finals = [
        (
            "missing key",
            request(s.addr, "/plain", None, "{}"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "invalid key",
            request(s.addr, "/plain", Some("bad key!"), "{}"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "no tenant",
            request(s.addr, "/tenant", key, "{}"),
            StatusCode::UNAUTHORIZED,
        ),
        (
            "too large",
            request(s.addr, "/small", key, "{\"a\":\"0123456789abcdef\"}"),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
        (
            "handler panicked",
            request(s.addr, "/panic", key, "{}"),
            StatusCode::INTERNAL_SERVER_ERROR,
        ),
    ];
    for (what, req, expected) in finals {
        let (status, attempts) = through_retry(&s, req).await;
        assert_eq!(status, expected, "{what}");
        assert_eq!(attempts, 1, "{what}: a final answer is not retried");
    }

    // A 201 carrying a reason code is a success: recorded by the server, not retried by the
    // client, so the handler runs once; the same key again is the replay.
    let executed = s.executions.load(Ordering::SeqCst);
    let created = request(
        s.addr,
        "/success-with-reason",
        Some("order-pair-0003"),
        "{}",
    );
    let (status, attempts) = through_retry(&s, created).await;
    assert_eq!(
        (status, attempts),
        (StatusCode::CREATED, 1),
        "a success is final"
    );
    let again = request(
        s.addr,
        "/success-with-reason",
        Some("order-pair-0003"),
        "{}",
    );
    let (status, attempts) = through_retry(&s, again).await;
    assert_eq!((status, attempts), (StatusCode::CREATED, 1));
    assert_eq!(
        s.executions.load(Ordering::SeqCst),
        executed + 1,
        "the success was recorded: the second call is its replay"
    );

    // The same key with another request: 422, not retried.
    let (status, _) =
        through_retry(&s, request(s.addr, "/plain", Some("order-pair-0002"), "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, attempts) = through_retry(
        &s,
        request(s.addr, "/plain", Some("order-pair-0002"), "{\"x\":1}"),
    )
    .await;
    assert_eq!((status, attempts), (StatusCode::UNPROCESSABLE_ENTITY, 1));

    // Store unavailable: nothing ran; the retry (after Retry-After) executes once.
    let executed = s.executions.load(Ordering::SeqCst);
    let (status, attempts) = through_retry(&s, request(s.addr, "/store-down", key, "{}")).await;
    assert_eq!(
        (status, attempts),
        (StatusCode::CREATED, 2),
        "503 then the write"
    );
    assert_eq!(s.executions.load(Ordering::SeqCst), executed + 1);

    // In flight: the first attempt of a keyed write is still running (say the client timed it
    // out and retried). The retry's 409 IDEMPOTENCY_IN_FLIGHT is retried unchanged after the
    // pushback and gets the first attempt's outcome: one execution, success at the caller.
    let executed = s.executions.load(Ordering::SeqCst);
    let plain = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let first = tokio::spawn(plain.request(request(s.addr, "/in-flight", key, "{}")));
    wait::until("the first attempt runs", || {
        s.executions.load(Ordering::SeqCst) > executed
    })
    .await;
    // The gate opens once the retry's first attempt was turned away (409): the retries after it
    // get the first attempt's outcome.
    let open = async {
        wait::until("the retried call is turned away while in flight", || {
            s.in_flight.stats().rejected(RejectReason::InFlight) >= 1
        })
        .await;
        s.gate.add_permits(1);
    };
    let ((status, attempts), ()) = tokio::join!(
        through_retry(&s, request(s.addr, "/in-flight", key, "{}")),
        open
    );
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the in-flight answer is retried, then replayed"
    );
    assert!(
        attempts >= 2,
        "retried after the pushback: {attempts} attempts"
    );
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    assert_eq!(
        s.executions.load(Ordering::SeqCst),
        executed + 1,
        "one execution"
    );
}

/// Over gRPC the too-large answer is RESOURCE_EXHAUSTED, which alone would be retried as a rate
/// limit; its reason code makes it final. The in-flight answer (ABORTED) is retried after the
/// pushback and gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_grpc_answers_get_the_verdict_the_table_promises() {
    use tonic_library::client::{connect_lazy, policy};
    use tonic_library::{idempotency, pb};

    let small = start_library(
        Inventory::seeded(Duration::ZERO),
        idempotency(MemoryStore::new()).max_request_bytes(4),
        Unavailable::first_attempts(0.0, 1),
    )
    .await;
    let (mut client, layer) = connect_lazy(&format!("http://{small}"), policy()).unwrap();
    let status = client
        .create_order(pb::CreateOrderRequest {
            book_id: "b1-with-a-long-name".into(),
            quantity: 1,
        })
        .await
        .expect_err("too large");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        layer.stats().retries,
        0,
        "a request that can never fit is not retried"
    );

    // In flight: a handler held at a gate, and InFlight::Reject.
    let inventory = Inventory::seeded(Duration::ZERO);
    let gate = Gate::new();
    let layer_in_flight = idempotency(MemoryStore::new()).in_flight(InFlight::Reject);
    let server = start_library_gated(
        inventory.clone(),
        layer_in_flight.clone(),
        Unavailable::first_attempts(0.0, 1),
        gate.clone(),
    )
    .await;
    let url = format!("http://{server}");
    let keyed = || {
        let mut req = tonic::Request::new(pb::CreateOrderRequest {
            book_id: "b1".into(),
            quantity: 1,
        });
        req.metadata_mut()
            .insert("x-idempotency-key", "order-grpc-in-flight".parse().unwrap());
        req
    };
    let (mut first_client, _) = connect_lazy(&url, policy()).unwrap();
    let first = tokio::spawn(async move { first_client.create_order(keyed()).await });
    wait::until("the first call holds the claim, at the gate", || {
        gate.waiting() == 1
    })
    .await;
    let (mut client, layer) = connect_lazy(&url, policy()).unwrap();
    // The gate opens once the second call was turned away (ABORTED).
    let open = async {
        wait::until("the second call is turned away while in flight", || {
            layer_in_flight.stats().rejected(RejectReason::InFlight) >= 1
        })
        .await;
        gate.open_wide();
    };
    let (second, ()) = tokio::join!(client.create_order(keyed()), open);
    let second = second.expect("retried after the pushback");
    let first = first.await.unwrap().expect("the first call succeeds");
    assert_eq!(
        second.get_ref(),
        first.get_ref(),
        "the retry got the first outcome"
    );
    assert!(layer.stats().retries >= 1);
    assert_eq!(inventory.stats().orders_created, 1, "one execution");
}

/// With `fail_open`, a call that was told its key is in flight never has a later attempt run
/// unprotected: two instances share a store; the leader runs on the first (held at a gate); the
/// client's call goes to the second (`InFlight::Reject`, `fail_open`), is told 409
/// `IDEMPOTENCY_IN_FLIGHT`, and retries it; meanwhile the second instance's store fails. The
/// retry layer says the call was told (`idempotency-seen-in-flight: ?1`), and the server refuses
/// (503) rather than run the write beside the one in flight. The handler runs once. (The retry
/// ran unprotected: the server could not know what an earlier attempt of the call was told.)
/// Over HTTP/1.1 and HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_told_its_key_is_in_flight_never_runs_unprotected() {
    for transport in test_support::net::Transport::BOTH {
        let shared = MemoryStore::new();
        let executions = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let orders = {
            let (executions, gate) = (executions.clone(), gate.clone());
            Router::new().route(
                "/orders",
                post(move || {
                    let (executions, gate) = (executions.clone(), gate.clone());
                    async move {
                        executions.fetch_add(1, Ordering::SeqCst);
                        gate.acquire().await.unwrap().forget();
                        (StatusCode::CREATED, "created")
                    }
                }),
            )
        };
        let leader_instance = test_support::net::serve(
            orders.clone().layer(
                IdempotencyLayer::new(shared.clone())
                    .tenant(idempotency_layer::TenantSource::fixed("t")),
            ),
        )
        .await;
        let store = FaultStore::new(shared.clone());
        let failing_open = test_support::net::serve(
            orders.layer(
                IdempotencyLayer::new(store.clone())
                    .tenant(idempotency_layer::TenantSource::fixed("t"))
                    .in_flight(InFlight::Reject)
                    .fail_open(true),
            ),
        )
        .await;
        let key = Some("order-seen-in-flight");
        let leader = {
            let client = transport.client();
            let req = request(leader_instance, "/orders", key, "{}");
            tokio::spawn(async move { client.request(req).await.map(|r| r.status()) })
        };
        wait::until("the leader runs", || executions.load(Ordering::SeqCst) == 1).await;

        let mut client = ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default()))
            .service(transport.client());
        let call = {
            let req = request(failing_open, "/orders", key, "{}");
            tokio::spawn(async move { client.ready().await.unwrap().call(req).await })
        };
        // Told it is in flight; the store fails from the next claim on.
        store
            .until(Duration::from_secs(20), "the first attempt's claim", |s| {
                !s.answers(Op::Begin).is_empty()
            })
            .await;
        store.inject(Rule::new(Op::Begin, Fault::Fail));
        let answer = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("an answer within 30 s")
            .unwrap()
            .expect("a response");
        assert_eq!(
            answer.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{transport:?}: refused, not run"
        );
        assert!(
            store.calls(Op::Begin).made >= 2,
            "{transport:?}: the call was retried after the 409"
        );
        assert_eq!(
            executions.load(Ordering::SeqCst),
            1,
            "{transport:?}: the handler ran once"
        );
        gate.add_permits(1);
        assert_eq!(leader.await.unwrap().unwrap(), StatusCode::CREATED);
    }
}

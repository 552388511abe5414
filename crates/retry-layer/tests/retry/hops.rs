//! One-tier retries over real sockets: a client, a hop A (axum with `HopLayer`, calling C
//! through a hyper-util client with `RetryLayer`) and a bottom service C, over HTTP/1.1 and
//! h2c. A hop that ran out of retries says "retried below", a request that arrived as a retry
//! is sent once underneath, and a stop below is a stop above.

use std::net::SocketAddr;

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use retry_layer::hop::HopLayer;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::ServiceExt;

use crate::wire::*;

/// Hop A: answers `/call` with the status its call to C got (a plain answer: the hop's
/// marking is all `HopLayer`'s).
struct HopA {
    addr: SocketAddr,
    outbound: RetryLayer,
}

async fn hop_a(c: &Server, proto: Transport, with_hop_layer: bool) -> HopA {
    hop_with(c, proto, with_hop_layer, RetryPolicy::default()).await
}

/// Hop A with its own outbound policy.
async fn hop_with(c: &Server, proto: Transport, with_hop_layer: bool, policy: RetryPolicy) -> HopA {
    let outbound = RetryLayer::new(policy);
    // A `Full` body: the handler's future must be `Send` for axum, which rustc cannot prove
    // through a boxed body's `dyn Error` lifetimes.
    let client = tower::Layer::layer(
        &outbound,
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(proto == Transport::Http2)
            .build_http::<retry_layer::ReplayBody<Full<Bytes>>>(),
    );
    let url = c.url("/c");
    type Outbound = retry_layer::Retry<
        hyper_util::client::legacy::Client<
            hyper_util::client::legacy::connect::HttpConnector,
            retry_layer::ReplayBody<Full<Bytes>>,
        >,
    >;
    let handler = |State((client, url)): State<(Outbound, String)>| async move {
        let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        match tower::ServiceExt::<Request<Full<Bytes>>>::oneshot(client, req).await {
            Ok::<http::Response<_>, reason_code::BoxError>(res) => res.status(),
            Err(_) => StatusCode::BAD_GATEWAY,
        }
    };
    let mut app = Router::new()
        .route("/call", get(handler))
        .with_state((client, url));
    if with_hop_layer {
        app = app.layer(HopLayer::new());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    HopA { addr, outbound }
}

/// Calls A directly (no retry layer), with `previous` attempts before this one.
async fn call_a(a: &HopA, proto: Transport, previous: Option<&'static str>) -> http::Response<()> {
    let plain = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(proto == Transport::Http2)
        .build_http::<TestBody>();
    let mut req = Request::get(format!("http://{}/call", a.addr));
    if let Some(p) = previous {
        req = req.header("x-previous-attempts", p);
    }
    let res = bounded("the call to A", plain.request(req.body(full("")).unwrap()))
        .await
        .unwrap();
    let (head, body) = res.into_parts();
    body.collect().await.unwrap();
    http::Response::from_parts(head, ())
}

fn reason(res: &http::Response<()>) -> Option<&str> {
    res.headers()
        .get("x-reason-code")
        .map(|v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_hop_that_ran_out_of_retries_says_it_retried_below() {
    for proto in Transport::BOTH {
        let c = serve(|_, _| status(503)).await;
        let a = hop_a(&c, proto, true).await;
        let res = call_a(&a, proto, None).await;
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(reason(&res), Some("RETRIES_DEFERRED"), "{proto:?}");
        assert_eq!(c.hits(), 3, "{proto:?}: A retried C as its policy allows");
    }
}

#[tokio::test]
async fn a_request_that_arrived_as_a_retry_is_sent_once_underneath() {
    for proto in Transport::BOTH {
        let c = serve(|_, _| status(503)).await;
        let a = hop_a(&c, proto, true).await;
        let res = call_a(&a, proto, Some("1")).await;
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(reason(&res), Some("RETRIES_DEFERRED"), "{proto:?}");
        assert_eq!(c.hits(), 1, "{proto:?}: the hop above is the one retrying");
        assert_eq!(a.outbound.stats().inbound_retry_stops, 1);

        // A malformed attempt header is a first attempt (with a warning), not a refusal.
        let res = call_a(&a, proto, Some("many")).await;
        assert_eq!(res.status(), 503);
        assert_eq!(c.hits(), 4, "{proto:?}: retried as a first attempt");
    }
}

#[tokio::test]
async fn a_stop_below_is_a_stop_above() {
    for proto in Transport::BOTH {
        let c = serve(|_, _| Act::Status(503, vec![("x-reason-code", "DO_NOT_RETRY")])).await;
        let a = hop_a(&c, proto, true).await;
        let client_layer = RetryLayer::new(RetryPolicy::default());
        let req = Request::get(format!("http://{}/call", a.addr))
            .body(full(""))
            .unwrap();
        let res = bounded("the call", client(&client_layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(
            res.headers()["x-reason-code"],
            "DO_NOT_RETRY",
            "{proto:?}: the stop travels up"
        );
        assert_eq!(c.hits(), 1, "{proto:?}");
        assert_eq!(a.outbound.stats().pushback_stops, 1);
        assert_eq!(client_layer.stats().pushback_stops, 1);
        assert_eq!(client_layer.stats().attempts, 1, "the client did not retry");
    }
}

/// The pair end to end: client (`RetryLayer`) -> A (`HopLayer`, `RetryLayer`) -> C, C down.
/// Without `HopLayer` C sees 3 x 3 = 9 attempts for one request; with it, A's 3 and one per
/// retry of the client's (A sends those once): 5.
#[tokio::test]
async fn client_hop_and_bottom_together_multiply_no_more() {
    for proto in Transport::BOTH {
        for (with_hop_layer, expected) in [(false, 9), (true, 5)] {
            let c = serve(|_, _| status(503)).await;
            let a = hop_a(&c, proto, with_hop_layer).await;
            let client_layer = RetryLayer::new(RetryPolicy::default());
            let req = Request::get(format!("http://{}/call", a.addr))
                .body(full(""))
                .unwrap();
            let res = bounded("the call", client(&client_layer, proto).oneshot(req))
                .await
                .unwrap();
            assert_eq!(res.status(), 503);
            assert_eq!(
                c.hits(),
                expected,
                "{proto:?}, HopLayer {with_hop_layer}: attempts at C"
            );
            assert_eq!(client_layer.stats().attempts, 3);
        }
    }
}

/// A gateway that forwards its inbound metadata forwards its caller's attempt
/// headers too. The layer owns them on every attempt, the first included: the hop below sees
/// this hop's own count (before, the first attempt carried the caller's "2", and a `HopLayer`
/// below served it as a retry, sending once underneath).
#[tokio::test]
async fn forwarded_attempt_headers_are_rewritten_on_every_attempt() {
    for proto in Transport::BOTH {
        let c = serve(|_, n| if n == 0 { status(503) } else { status(200) }).await;
        let layer = RetryLayer::new(RetryPolicy::default());
        let req = Request::get(c.url("/c"))
            .header("x-previous-attempts", "2")
            .header("grpc-previous-rpc-attempts", "2")
            .body(full(""))
            .unwrap();
        let res = bounded("the call", client(&layer, proto).oneshot(req))
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{proto:?}");
        let seen = c.seen();
        assert_eq!(seen.len(), 2, "{proto:?}");
        for name in ["x-previous-attempts", "grpc-previous-rpc-attempts"] {
            assert!(
                seen[0].headers.get(name).is_none(),
                "{proto:?}: the first attempt carries no {name}"
            );
        }
        assert_eq!(seen[1].headers["x-previous-attempts"], "1", "{proto:?}");
        assert!(seen[1].headers.get("grpc-previous-rpc-attempts").is_none());
    }
}

/// A hop that stops on a choice of its own (its short `total_timeout`, its
/// `max_pushback`) says "retried below", not "do not retry": the caller, whose own deadline and
/// pushback limit may well allow another attempt, still retries. Before, B's give-up on its own
/// 60 ms deadline answered DO_NOT_RETRY and A sent once.
#[tokio::test]
async fn a_hops_local_give_up_does_not_stop_the_callers_retries() {
    let short_deadline = || {
        RetryPolicy::builder()
            .total_timeout(std::time::Duration::from_millis(60))
            .build()
            .unwrap()
    };
    let short_pushback = || {
        RetryPolicy::builder()
            .max_pushback(std::time::Duration::from_secs(1))
            .build()
            .unwrap()
    };
    for proto in Transport::BOTH {
        for (what, policy, c_answer) in [
            ("total_timeout(60ms)", short_deadline(), status(503)),
            (
                "max_pushback(1s)",
                short_pushback(),
                Act::Status(503, vec![("retry-after", "60")]),
            ),
        ] {
            let c = serve(move |_, _| c_answer.clone()).await;
            let b = hop_with(&c, proto, true, policy).await;
            let client_layer = RetryLayer::new(RetryPolicy::default());
            let req = Request::get(format!("http://{}/call", b.addr))
                .body(full(""))
                .unwrap();
            let res = bounded("the call", client(&client_layer, proto).oneshot(req))
                .await
                .unwrap();
            assert_eq!(res.status(), 503, "{proto:?}, {what}");
            assert_eq!(
                res.headers()["x-reason-code"],
                "RETRIES_DEFERRED",
                "{proto:?}, {what}: a local give-up"
            );
            assert_eq!(
                client_layer.stats().attempts,
                3,
                "{proto:?}, {what}: the client still retries"
            );
            assert_eq!(c.hits(), 3, "{proto:?}, {what}: B sends each attempt once");
        }
    }
}

//! The reqwest middleware over real sockets, against the same recording hyper server as the
//! tower layer's wire tests (HTTP/1.1 keep-alive and h2c): retries of 503, pushback, keys,
//! lost responses and refused connections get the verdicts the tower layer gives them.

use std::time::{Duration, Instant};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use retry_layer::reqwest::{reqwest_error, RetryMiddleware};
use retry_layer::{RetryError, RetryInfo, RetryLayer, RetryPolicy};

use crate::wire::*;

/// A reqwest client with `middleware`, speaking `proto`.
fn client(middleware: RetryMiddleware, proto: Transport) -> ClientWithMiddleware {
    let mut builder = reqwest::Client::builder();
    if proto == Transport::Http2 {
        builder = builder.http2_prior_knowledge();
    }
    ClientBuilder::new(builder.build().unwrap())
        .with(middleware)
        .build()
}

fn keyed() -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .build()
        .unwrap()
}

fn key_of(seen: &Seen) -> Option<&str> {
    seen.headers
        .get("x-idempotency-key")
        .map(|v| v.to_str().unwrap())
}

/// The middleware's error is a `RetryError`, as the tower layer's is.
fn retry_error(err: &reqwest_middleware::Error) -> &RetryError {
    match err {
        reqwest_middleware::Error::Middleware(e) => e
            .downcast_ref::<RetryError>()
            .unwrap_or_else(|| panic!("a RetryError, got {e:?}")),
        other => panic!("a middleware error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_post_answered_503_twice_is_retried_with_its_body_and_one_key() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n < 2 { status(503) } else { status(201) }).await;
        let middleware = RetryMiddleware::new(keyed());
        let http = client(middleware.clone(), proto);
        let url = server.url("/orders");
        let res = bounded("the POST", http.post(&url).body("{\"quantity\":1}").send())
            .await
            .unwrap();

        assert_eq!(res.status(), 201, "{proto:?}");
        assert_eq!(res.url().as_str(), url, "the URL survives the middleware");
        let info = res.extensions().get::<RetryInfo>().expect("RetryInfo");
        assert_eq!(info.attempts, 3);
        let key = info.idempotency_key.clone().expect("the generated key");
        assert_eq!(res.text().await.unwrap(), "answer");

        let seen = server.seen();
        assert_eq!(seen.len(), 3, "{proto:?}");
        for (i, s) in seen.iter().enumerate() {
            assert_eq!(s.body, "{\"quantity\":1}", "attempt {i} carries the body");
            assert_eq!(key_of(s), Some(key.to_str().unwrap()), "attempt {i}'s key");
            let previous = s.headers.get("x-previous-attempts");
            if i == 0 {
                assert_eq!(previous, None);
            } else {
                assert_eq!(previous.unwrap(), &i.to_string());
            }
        }
        let stats = middleware.stats();
        assert_eq!((stats.attempts, stats.retries), (3, 2), "{proto:?}");
    }
}

#[tokio::test]
async fn a_post_without_key_is_not_retried_after_a_503() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| status(503)).await;
        let http = client(RetryMiddleware::new(RetryPolicy::default()), proto);
        let res = bounded("the POST", http.post(server.url("/orders")).send())
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(
            server.hits(),
            1,
            "{proto:?}: it may have run, and has no key"
        );
        assert!(res.extensions().get::<RetryInfo>().is_none());
    }
}

#[tokio::test]
async fn a_key_the_caller_set_is_kept_on_every_attempt() {
    for proto in Transport::BOTH {
        let server = serve(|_, n| if n == 0 { status(503) } else { status(201) }).await;
        let http = client(RetryMiddleware::new(RetryPolicy::default()), proto);
        let res = bounded(
            "the POST",
            http.post(server.url("/orders"))
                .header("idempotency-key", "\"order-7\"")
                .body("{}")
                .send(),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}: a keyed write is retried");
        let seen = server.seen();
        assert_eq!(seen.len(), 2);
        for s in &seen {
            assert_eq!(s.headers.get("idempotency-key").unwrap(), "\"order-7\"");
            assert!(
                s.headers.get("x-idempotency-key").is_none(),
                "no second key is generated"
            );
        }
    }
}

#[tokio::test]
async fn a_pushback_longer_than_max_pushback_stops_and_a_short_one_is_waited_for() {
    for proto in Transport::BOTH {
        // Retry-After: 1 with a max_pushback of 500 ms: the server asks for more than the
        // client will wait, so the answer is returned.
        let server = serve(|_, _| Act::Status(503, vec![("retry-after", "1")])).await;
        let policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .max_pushback(Duration::from_millis(500))
            .build()
            .unwrap();
        let middleware = RetryMiddleware::new(policy);
        let http = client(middleware.clone(), proto);
        let res = bounded("the POST", http.post(server.url("/orders")).send())
            .await
            .unwrap();
        assert_eq!(res.status(), 503, "{proto:?}");
        assert_eq!(server.hits(), 1, "{proto:?}");
        assert_eq!(middleware.stats().pushback_stops, 1);

        // Retry-After: 1 within max_pushback: the retry waits the second it asked for (the
        // computed backoff alone would be tens of milliseconds).
        let server = serve(|_, n| {
            if n == 0 {
                Act::Status(429, vec![("retry-after", "1")])
            } else {
                status(201)
            }
        })
        .await;
        let http = client(RetryMiddleware::new(keyed()), proto);
        let started = Instant::now();
        let res = bounded("the POST", http.post(server.url("/orders")).send())
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{proto:?}");
        assert_eq!(server.hits(), 2);
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "the retry did not wait for the pushback"
        );
    }
}

#[tokio::test]
async fn a_lost_response_is_retried_only_when_keyed_or_idempotent() {
    for proto in Transport::BOTH {
        let server = serve(|_, _| Act::Close).await;

        // A POST without key may have run: one attempt, and the transport error is there.
        let http = client(RetryMiddleware::new(RetryPolicy::default()), proto);
        let err = bounded("the POST", http.post(server.url("/a")).body("x").send())
            .await
            .unwrap_err();
        assert_eq!(retry_error(&err).attempts(), 1, "{proto:?}: {err}");
        let transport = reqwest_error(&err).expect("the reqwest error");
        assert!(!transport.is_connect(), "it was sent: {transport:?}");

        // With a generated key: every attempt, and the error names the key.
        let http = client(RetryMiddleware::new(keyed()), proto);
        let err = bounded(
            "the keyed POST",
            http.post(server.url("/b")).body("x").send(),
        )
        .await
        .unwrap_err();
        let retry = retry_error(&err);
        assert_eq!(retry.attempts(), 3, "{proto:?}: {err}");
        let key = retry.idempotency_key().expect("the generated key").clone();
        assert!(err.to_string().contains(key.to_str().unwrap()), "{err}");
        let seen = server.seen();
        let keyed: Vec<_> = seen.iter().filter_map(key_of).collect();
        assert_eq!(keyed, vec![key.to_str().unwrap(); 3], "{proto:?}");

        // A GET is idempotent.
        let err = bounded("the GET", http.get(server.url("/c")).send())
            .await
            .unwrap_err();
        assert_eq!(retry_error(&err).attempts(), 3, "{proto:?}");
    }
}

#[tokio::test]
async fn a_refused_connection_is_retried_even_for_a_post_without_key() {
    let addr = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let middleware = RetryMiddleware::new(RetryPolicy::default());
    let http = client(middleware.clone(), Transport::Http1);
    let err = bounded(
        "the POST",
        http.post(format!("http://{addr}/orders")).send(),
    )
    .await
    .unwrap_err();
    assert!(reqwest_error(&err).expect("the reqwest error").is_connect());
    // 3 attempts plus 2 transparent retries: nothing was ever sent.
    assert_eq!(middleware.stats().attempts, 5);
    assert_eq!(retry_error(&err).attempts(), 5);
}

#[tokio::test]
async fn the_middleware_and_the_tower_layer_share_one_budget() {
    let server = serve(|_, _| status(503)).await;
    let policy = RetryPolicy::builder()
        .ensure_idempotency_key()
        // A budget with no floor and no ratio: no retry is ever granted.
        .budget(retry_layer::budget::RetryBudget::sliding_window(
            Duration::from_secs(10),
            0,
            0.0,
        ))
        .build()
        .unwrap();
    let layer = RetryLayer::new(policy);
    let middleware = RetryMiddleware::from(&layer);
    let http = client(middleware, Transport::Http1);
    let res = bounded("the POST", http.post(server.url("/orders")).send())
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(server.hits(), 1);
    assert_eq!(
        layer.stats().budget_refusals,
        1,
        "the layer counts the middleware's refusal"
    );
}

/// A POST answered 307 (or 308) is followed by reqwest with its body, as it
/// is without the middleware: a whole body goes to reqwest as one it can send again. Before,
/// every body became a stream reqwest cannot resend, and the 307 was returned.
#[tokio::test]
async fn a_post_follows_a_307_and_a_308_with_its_body() {
    for redirect in [307, 308] {
        for proto in Transport::BOTH {
            let server = serve(move |path, _| match path {
                "/orders" => Act::Status(redirect, vec![("location", "/v2/orders")]),
                _ => status(201),
            })
            .await;
            let http = client(RetryMiddleware::new(keyed()), proto);
            let res = bounded(
                "the POST",
                http.post(server.url("/orders"))
                    .body("{\"quantity\":1}")
                    .send(),
            )
            .await
            .unwrap();
            assert_eq!(res.status(), 201, "{redirect} {proto:?}");
            assert_eq!(res.url().path(), "/v2/orders");
            let seen = server.seen();
            assert_eq!(seen.len(), 2, "{redirect} {proto:?}");
            assert_eq!(
                seen[1].body, "{\"quantity\":1}",
                "the body follows the redirect"
            );
        }
    }
}

//! The retry budget bounds amplification across requests.

use futures_util::future::join_all;
use retry_layer::{Retry, RetryLayer, RetryPolicy};
use tower::{Service, ServiceExt};

use crate::support::*;

async fn storm(policy: RetryPolicy, requests: usize) -> (usize, retry_layer::RetryStats) {
    let (svc, script) = backend::<http_body_util::Full<bytes::Bytes>>(vec![status(503)]);
    let layer = RetryLayer::new(policy);
    let calls = (0..requests).map(|_| {
        let mut retry: Retry<_> = tower::Layer::layer(&layer, svc.clone());
        async move { retry.ready().await.unwrap().call(get("/books/b1")).await }
    });
    let results = within_a_day("the storm", join_all(calls)).await;
    assert!(results.iter().all(|r| r.as_ref().unwrap().status() == 503));
    (script.attempts(), layer.stats())
}

#[tokio::test(start_paused = true)]
async fn an_always_503_backend_sees_at_most_1_1x_plus_the_floor() {
    let started = tokio::time::Instant::now();
    let (attempts, stats) = storm(RetryPolicy::default(), 10_000).await;
    let secs = started.elapsed().as_secs() + 1;
    // 10 % of requests plus the floor of 10 retries per second of the window used.
    let bound = 11_000 + 10 * secs as usize;
    assert!(attempts <= bound, "{attempts} attempts > {bound}");
    assert!(attempts > 10_000, "the budget still allows some retries");
    assert_eq!(stats.requests, 10_000);
    assert!(stats.budget_refusals > 0);
}

#[tokio::test(start_paused = true)]
async fn without_a_budget_the_same_storm_triples_the_load() {
    let policy = RetryPolicy::builder()
        .budget(retry_layer::budget::RetryBudget::unlimited())
        .build()
        .unwrap();
    let (attempts, _) = storm(policy, 1_000).await;
    assert_eq!(attempts, 3_000);
}

#[tokio::test(start_paused = true)]
async fn token_bucket_throttles_once_half_empty() {
    let policy = RetryPolicy::builder()
        .budget(retry_layer::budget::RetryBudget::token_bucket(10, 0.1))
        .build()
        .unwrap();
    let (attempts, stats) = storm(policy, 100).await;
    // Every failure takes a token and retries stop once half of the 10 are gone: the first
    // four failures are retried (10 -> 6 tokens), the fifth leaves 5 and nothing more is. On
    // paused time the count is exact.
    assert_eq!(attempts, 104);
    assert_eq!(stats.budget_refusals, 100);
}

/// One client (hyper-util or reqwest) shared by the calls to two hosts. A
/// dead host drains the layer's budget (gRFC A6 throttling: retries stop once half the 10
/// tokens are gone), and then the healthy host's one 503 is not retried either. With a budget
/// per authority, the healthy host keeps its own.
#[tokio::test]
async fn a_budget_per_authority_keeps_a_dead_host_from_draining_the_others() {
    use crate::wire::{bounded, serve, status as answer};

    for per_authority in [false, true] {
        let dead = serve(|_, _| answer(503)).await;
        let healthy = serve(|_, n| if n == 0 { answer(503) } else { answer(200) }).await;
        let mut builder =
            RetryPolicy::builder().budget(retry_layer::budget::RetryBudget::token_bucket(10, 0.1));
        if per_authority {
            builder = builder.budget_per_authority();
        }
        let policy = builder.build().unwrap();
        let get = |url: String| {
            http::Request::get(url)
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap()
        };

        // hyper-util
        let layer = RetryLayer::new(policy.clone());
        let client = tower::Layer::layer(
            &layer,
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<retry_layer::ReplayBody<http_body_util::Full<bytes::Bytes>>>(),
        );
        for _ in 0..5 {
            let res = bounded(
                "a call to the dead host",
                client.clone().oneshot(get(dead.url("/x"))),
            )
            .await
            .unwrap();
            assert_eq!(res.status(), 503);
        }
        let res = bounded(
            "the healthy host",
            client.clone().oneshot(get(healthy.url("/x"))),
        )
        .await
        .unwrap();
        let expected = if per_authority { 200 } else { 503 };
        assert_eq!(
            res.status(),
            expected,
            "hyper-util, per authority: {per_authority}"
        );

        // reqwest, through the middleware, the same way.
        #[cfg(feature = "reqwest")]
        {
            let dead = serve(|_, _| answer(503)).await;
            let healthy = serve(|_, n| if n == 0 { answer(503) } else { answer(200) }).await;
            let http = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
                .with(retry_layer::reqwest::RetryMiddleware::new(policy))
                .build();
            for _ in 0..5 {
                let res = bounded("a call to the dead host", http.get(dead.url("/x")).send())
                    .await
                    .unwrap();
                assert_eq!(res.status(), 503);
            }
            let res = bounded("the healthy host", http.get(healthy.url("/x")).send())
                .await
                .unwrap();
            assert_eq!(
                res.status(),
                expected,
                "reqwest, per authority: {per_authority}"
            );
        }
    }
}

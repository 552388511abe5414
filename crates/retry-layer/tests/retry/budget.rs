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
    let policy = RetryPolicy::builder().no_budget().build().unwrap();
    let (attempts, _) = storm(policy, 1_000).await;
    assert_eq!(attempts, 3_000);
}

#[tokio::test(start_paused = true)]
async fn token_bucket_throttles_once_half_empty() {
    let policy = RetryPolicy::builder()
        .token_bucket(10, 0.1)
        .build()
        .unwrap();
    let (attempts, stats) = storm(policy, 100).await;
    // Every failure takes a token; retries stop once 5 of 10 are gone.
    assert!(attempts < 110, "{attempts}");
    assert!(stats.budget_refusals > 0);
}

//! The scenario the HTTP tests share: many logical orders through retries and faults.

use std::time::Duration;

use axum_orders::client::{OrderLine, OrdersClient};
use futures_util::stream::{self, StreamExt};
use retry_layer::RetryPolicy;

/// The client policy of the fault tests: the default classification, more attempts and a
/// roomier budget, because the faults injected here (about 30 % of attempts) are far above what
/// the default 10 % budget is sized for, and every order must get through.
pub fn fault_tolerant_policy() -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .max_attempts(10)
        .base_delay(Duration::from_millis(2))
        .max_delay(Duration::from_millis(50))
        .budget(retry_layer::budget::RetryBudget::sliding_window(
            Duration::from_secs(10),
            1_000,
            1.0,
        ))
        .build()
        .expect("a valid policy")
}

/// Places `n` orders (books b1..b5 in turn), 16 at a time; returns each order's book and the
/// client's line. Panics if an order cannot get through.
pub async fn place_orders(client: &OrdersClient, n: usize) -> Vec<(String, OrderLine)> {
    stream::iter(0..n)
        .map(|i| {
            let client = client.clone();
            async move {
                let book = format!("b{}", i % 5 + 1);
                let line = client
                    .create_order(&book, 1, None)
                    .await
                    .expect("the order gets through");
                (book, line)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await
}

/// The URL in `var`, or `None` after printing why the test skips (outside CI).
pub use test_support::env::env_url;

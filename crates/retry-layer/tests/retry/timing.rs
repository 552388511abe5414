//! Paused-time tests: with a seeded generator the delays are exactly the documented ones.

use retry_layer::backoff::{Backoff, Jitter};
use retry_layer::RetryPolicy;
use tokio::time::Duration;

use crate::support::*;

/// The delays the default policy must use for `seed`: `min(20 ms * 2^(n-1), 1 s) * (0.8 + 0.4u)`
/// with `u` drawn from the seeded generator in order.
fn expected(seed: u64, n: u32) -> Vec<Duration> {
    let mut rng = fastrand_like(seed);
    (1..=n)
        .map(|i| {
            let ceiling = Duration::from_millis(20 * 2u64.pow(i - 1)).min(Duration::from_secs(1));
            ceiling.mul_f64(0.8 + 0.4 * rng())
        })
        .collect()
}

fn fastrand_like(seed: u64) -> impl FnMut() -> f64 {
    // The layer draws from fastrand::Rng::with_seed(seed); fastrand is deterministic per seed.
    let mut rng = fastrand::Rng::with_seed(seed);
    move || rng.f64()
}

#[tokio::test(start_paused = true)]
async fn seeded_delays_are_the_documented_ones() {
    let policy = RetryPolicy::builder()
        .max_attempts(8)
        .jitter_seed(42)
        .budget(retry_layer::budget::RetryBudget::unlimited())
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(policy, get("/books/b1"), vec![status(503)]).await;
    let seen = script.seen();
    assert_eq!(seen.len(), 8);
    let gaps: Vec<Duration> = seen.windows(2).map(|w| w[1].at - w[0].at).collect();
    for (i, (gap, want)) in gaps.iter().zip(expected(42, 7)).enumerate() {
        // tokio's timer has millisecond resolution and rounds a deadline up.
        assert!(
            *gap >= want && *gap <= want + Duration::from_millis(1),
            "delay {}: {gap:?}, expected {want:?}",
            i + 1
        );
    }
    // The schedule grew and was capped: the 7th delay is about 1 s.
    assert!(gaps[6] >= Duration::from_millis(800));
}

#[tokio::test(start_paused = true)]
async fn full_jitter_never_waits_longer_than_the_ceiling() {
    let policy = RetryPolicy::builder()
        .max_attempts(6)
        .jitter(Jitter::Full)
        .budget(retry_layer::budget::RetryBudget::unlimited())
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(policy, get("/books/b1"), vec![status(503)]).await;
    let b = Backoff::default();
    for (i, w) in script.seen().windows(2).enumerate() {
        assert!(w[1].at - w[0].at <= b.ceiling(i as u32 + 1) + Duration::from_millis(1));
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_replaces_the_backoff() {
    let (res, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(post("/orders")),
        vec![Reply::Status(429, vec![("retry-after", "3")]), status(201)],
    )
    .await;
    assert_eq!(res.unwrap().status(), 201);
    let seen = script.seen();
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(3) && gap <= Duration::from_millis(3001),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_replaces_the_backoff_and_negative_stops() {
    let pushback = |ms: &'static str| {
        Reply::Status(
            200,
            vec![
                ("content-type", "application/grpc"),
                ("grpc-status", "14"),
                ("grpc-retry-pushback-ms", ms),
            ],
        )
    };
    let (_, script, _) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/CreateOrder")),
        vec![pushback("250"), grpc("0")],
    )
    .await;
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_millis(250) && gap <= Duration::from_millis(251),
        "{gap:?}"
    );

    let (_, script, layer) = call_scripted(
        RetryPolicy::default(),
        keyed(grpc_req("/lib.Library/CreateOrder")),
        vec![pushback("-1")],
    )
    .await;
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().pushback_stops, 1);
}

#[tokio::test(start_paused = true)]
async fn pushback_longer_than_the_maximum_stops() {
    let policy = RetryPolicy::builder()
        .max_pushback(Duration::from_secs(5))
        .build()
        .unwrap();
    let (res, script, layer) = call_scripted(
        policy,
        get("/books/b1"),
        vec![Reply::Status(503, vec![("retry-after", "3600")])],
    )
    .await;
    assert_eq!(res.unwrap().status(), 503);
    assert_eq!(script.attempts(), 1);
    assert_eq!(layer.stats().pushback_stops, 1);
}

/// After a server pushback the backoff restarts from its base (gRFC A6, grpc-java).
#[tokio::test(start_paused = true)]
async fn backoff_restarts_from_the_base_after_a_pushback() {
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .base_delay(Duration::from_millis(100))
        .jitter(Jitter::None)
        .budget(retry_layer::budget::RetryBudget::unlimited())
        .build()
        .unwrap();
    let (_, script, _) = call_scripted(
        policy,
        get("/books/b1"),
        vec![
            status(503),
            status(503),
            Reply::Status(503, vec![("retry-after", "1")]),
            status(503),
            status(200),
        ],
    )
    .await;
    let seen = script.seen();
    assert_eq!(seen.len(), 5);
    let gaps: Vec<u128> = seen
        .windows(2)
        .map(|w| (w[1].at - w[0].at).as_millis())
        .collect();
    // 100, 200, the 1 s pushback, then the base again (before: 800, as if never reset).
    assert_eq!(gaps, [100, 200, 1000, 100], "{gaps:?}");
}

/// `google.rpc.Status { code: 8, message: "slow down", details: [RetryInfo { retry_delay:
/// 2 s }] }`, serialized.
fn status_with_retry_info_2s() -> Vec<u8> {
    let tu = b"type.googleapis.com/google.rpc.RetryInfo";
    let mut any = vec![0x0a, tu.len() as u8];
    any.extend_from_slice(tu);
    any.extend_from_slice(&[0x12, 4, 0x0a, 2, 0x08, 2]);
    let mut status = vec![0x08, 8, 0x12, 9];
    status.extend_from_slice(b"slow down");
    status.extend_from_slice(&[0x1a, any.len() as u8]);
    status.extend_from_slice(&any);
    status
}

/// A RESOURCE_EXHAUSTED whose `grpc-status-details-bin` carries a
/// `google.rpc.RetryInfo` is retried after that delay (as tonic writes the header), not after
/// the computed backoff.
#[tokio::test(start_paused = true)]
async fn retry_info_in_the_status_details_is_the_pushback() {
    let status = tonic::Status::with_details(
        tonic::Code::ResourceExhausted,
        "slow down",
        bytes::Bytes::from(status_with_retry_info_2s()),
    );
    let head = status.into_http::<()>();
    let details: &'static str = head.headers()["grpc-status-details-bin"]
        .to_str()
        .unwrap()
        .to_owned()
        .leak();
    let replies = vec![
        Reply::Status(
            200,
            vec![
                ("content-type", "application/grpc"),
                ("grpc-status", "8"),
                ("grpc-status-details-bin", details),
            ],
        ),
        grpc("0"),
    ];
    let req = keyed(grpc_req("/lib.Library/CreateOrder"));
    let (res, script, _) = call_scripted(RetryPolicy::default(), req, replies).await;
    assert_eq!(res.unwrap().headers()["grpc-status"], "0");
    let seen = script.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_secs(2) && gap <= Duration::from_millis(2_001),
        "retried {gap:?} after the RESOURCE_EXHAUSTED, not after the 2 s it asked for"
    );
}

//! The three-tier retry storm on tokio's paused clock: with the default budget every hop stays
//! within 1.1x its incoming requests plus the floor (10 retries/s); without budgets the bottom
//! sees 27x; with retries at the outer hop only, 1.1x plus the floor end to end.

use chaos::storm::{storm, Budgets};

const REQUESTS: usize = 2_000;
const FLOOR_PER_SEC: f64 = 10.0;

/// What a hop with the default budget may send for `incoming` requests over `secs`.
fn bound(incoming: usize, secs: f64) -> f64 {
    1.1 * incoming as f64 + FLOOR_PER_SEC * (secs.ceil() + 1.0)
}

#[tokio::test(start_paused = true)]
async fn default_budget_holds_every_hop_to_1_1x_plus_the_floor() {
    let s = storm(Budgets::Default, REQUESTS, 100).await;
    println!("{s}");
    let incoming = [REQUESTS, s.reached[0], s.reached[1]];
    for (hop, (&sent, &got)) in s.reached.iter().zip(&incoming).enumerate() {
        assert!(
            sent as f64 <= bound(got, s.secs),
            "hop {hop}: {sent} attempts for {got} requests over {} s",
            s.secs
        );
        assert!(sent > got, "hop {hop}: some retries are still allowed");
    }
    assert!(s.amplification() < 2.0, "{s}");
}

#[tokio::test(start_paused = true)]
async fn without_budgets_the_bottom_sees_27x() {
    let s = storm(Budgets::Disabled, 200, 100).await;
    println!("{s}");
    assert_eq!(s.reached, [600, 1_800, 5_400]);
    assert_eq!(s.amplification(), 27.0);
}

#[tokio::test(start_paused = true)]
async fn retries_at_the_outer_hop_only_stay_within_1_1x_end_to_end() {
    let s = storm(Budgets::OuterOnly, REQUESTS, 100).await;
    println!("{s}");
    assert_eq!(s.reached[0], s.reached[2]);
    assert_eq!(s.reached[1], s.reached[2]);
    assert!(s.reached[2] as f64 <= bound(REQUESTS, s.secs), "{s}");
}

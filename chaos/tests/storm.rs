//! The retry storm on tokio's paused clock: with the default budget every hop stays within 1.1x
//! its incoming requests plus the floor (10 retries/s); without budgets the bottom sees 3^tiers;
//! with retries at the outer hop only, 1.1x plus the floor end to end; and with one-tier
//! retries (`HopLayer` on every hop, the default policy everywhere) the bottom sees one hop's
//! budget at any depth, while a bottom that fails a share of requests is retried as well as
//! today.

use chaos::storm::{storm, Budgets, Failure, Setup};

const REQUESTS: usize = 2_000;
const FLOOR_PER_SEC: f64 = 10.0;
/// What the adaptive budget of a hop above the bottom one lets through before a dead backend
/// drains it (20 tokens, refusing at half): a constant per hop, not a share of the load.
const DRAIN_PER_HOP: f64 = 10.0;

/// What a hop with the default budget may send for `incoming` requests over `secs`.
fn bound(incoming: usize, secs: f64) -> f64 {
    1.1 * incoming as f64 + FLOOR_PER_SEC * (secs.ceil() + 1.0)
}

#[tokio::test(start_paused = true)]
async fn default_budget_holds_every_hop_to_1_1x_plus_the_floor() {
    let s = storm(Setup::new(Budgets::Default)).await;
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
    let s = storm(Setup {
        requests: 200,
        ..Setup::new(Budgets::Disabled)
    })
    .await;
    println!("{s}");
    assert_eq!(s.reached, [600, 1_800, 5_400]);
    assert_eq!(s.amplification(), 27.0);
}

#[tokio::test(start_paused = true)]
async fn retries_at_the_outer_hop_only_stay_within_1_1x_end_to_end() {
    let s = storm(Setup::new(Budgets::OuterOnly)).await;
    println!("{s}");
    assert_eq!(s.reached[0], s.reached[2]);
    assert_eq!(s.reached[1], s.reached[2]);
    assert!(s.reached[2] as f64 <= bound(REQUESTS, s.secs), "{s}");
}

/// With the default policy at every hop and `HopLayer` on every hop's server, a dead
/// bottom sees what one hop's budget allows (as with retries at the outer hop only), at 3 and
/// at 5 tiers; the hops above it send each request about once.
#[tokio::test(start_paused = true)]
async fn one_tier_retries_hold_the_bottom_to_one_hops_budget_at_any_depth() {
    for tiers in [3, 5] {
        let s = storm(Setup {
            tiers,
            ..Setup::new(Budgets::OneTier)
        })
        .await;
        println!("{s}");
        let upper_hops = (tiers - 1) as f64;
        let bottom = s.reached[tiers - 1] as f64;
        assert!(
            bottom <= bound(REQUESTS, s.secs) + DRAIN_PER_HOP * upper_hops,
            "{tiers} tiers: {s}"
        );
        for (i, &n) in s.reached[..tiers - 1].iter().enumerate() {
            assert!(
                n as f64 <= REQUESTS as f64 + DRAIN_PER_HOP * (i + 1) as f64,
                "tier {}: {n} attempts, {s}",
                i + 1
            );
        }
        let default = storm(Setup {
            tiers,
            ..Setup::new(Budgets::Default)
        })
        .await;
        assert!(
            bottom < 0.8 * default.reached[tiers - 1] as f64,
            "{tiers} tiers: one tier {bottom}, every hop {}",
            default.reached[tiers - 1]
        );
    }
}

/// With 20 % of requests failing at random at the bottom, one-tier retries succeed as often as
/// retries at every hop: the hop next to the failure retries within its budget, and the hops
/// above retry what it could not within their adaptive budgets.
#[tokio::test(start_paused = true)]
async fn one_tier_retries_lose_no_success_when_failures_are_transient() {
    for tiers in [3, 5] {
        let setup = |budgets| Setup {
            tiers,
            failure: Failure::Transient(0.2),
            ..Setup::new(budgets)
        };
        let one_tier = storm(setup(Budgets::OneTier)).await;
        let default = storm(setup(Budgets::Default)).await;
        println!("{one_tier}\n{default}");
        // Equal up to chance: a request fails only when every one of its attempts drew a 503
        // (about one in several thousand here, in either configuration).
        assert!(
            one_tier.succeeded + REQUESTS / 1000 >= default.succeeded,
            "{tiers} tiers: one tier {} successes, every hop {}",
            one_tier.succeeded,
            default.succeeded
        );
        assert!(one_tier.success_rate() > 0.99, "{one_tier}");
    }
}

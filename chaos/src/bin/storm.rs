//! `cargo run --release -p chaos --bin storm`: the retry storm, printed.

use chaos::storm::{storm, Budgets, Failure, Setup};
use clap::Parser;

/// client -> T1 -> ... -> bottom, each hop calling the next through its own `RetryLayer`: how
/// many attempts reach each tier per client request, and how many client requests succeed, when
/// the bottom is dead (503 to everything) and when it fails a share of requests at random; with
/// the default policy at every hop, with no budget, with retries at the outer hop only, and with
/// one-tier retries (`HopLayer` on every hop). Runs on tokio's paused clock, so it takes
/// seconds, not minutes.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Client requests to send per storm.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Client requests per second (of tokio time).
    #[arg(long, default_value_t = 100)]
    per_sec: u32,
    /// Chain depths to run (tiers behind the client).
    #[arg(long, value_delimiter = ',', default_values_t = [3, 5])]
    tiers: Vec<usize>,
    /// The share of requests the bottom fails in the transient storms.
    #[arg(long, default_value_t = 0.2)]
    transient: f64,
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    let args = Args::parse();
    println!(
        "{} client requests per storm at {}/s (tokio time)",
        args.requests, args.per_sec
    );
    for &tiers in &args.tiers {
        for failure in [Failure::Always, Failure::Transient(args.transient)] {
            for budgets in [
                Budgets::Default,
                Budgets::Disabled,
                Budgets::OuterOnly,
                Budgets::OneTier,
            ] {
                let setup = Setup {
                    budgets,
                    tiers,
                    failure,
                    requests: args.requests,
                    per_sec: args.per_sec,
                };
                println!("{}", storm(setup).await);
            }
        }
    }
}

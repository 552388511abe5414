//! `cargo run --release -p chaos --bin storm`: the three-tier retry storm, printed.

use chaos::storm::{storm, Budgets};
use clap::Parser;

/// client -> A -> B -> C, where C answers 503 to everything: how many attempts reach C per
/// client request, with the default retry budget at every hop, with no budget, and with retries
/// at the outer hop only. Runs on tokio's paused clock, so it takes seconds, not minutes.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Client requests to send.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Client requests per second (of tokio time).
    #[arg(long, default_value_t = 100)]
    per_sec: u32,
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    let args = Args::parse();
    println!(
        "client -> A -> B -> C, C answers 503 to everything; {} client requests/s (tokio time)",
        args.per_sec
    );
    for budgets in [Budgets::Default, Budgets::Disabled, Budgets::OuterOnly] {
        let s = storm(budgets, args.requests, args.per_sec).await;
        println!("{s}");
    }
}

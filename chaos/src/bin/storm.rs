//! `cargo run --release -p chaos --bin storm`: the three-tier retry storm, printed.

use chaos::storm::{storm, Budgets};

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    let requests = 10_000;
    println!(
        "client -> A -> B -> C, C answers 503 to everything; 100 client requests/s (tokio time)"
    );
    for budgets in [Budgets::Default, Budgets::Disabled, Budgets::OuterOnly] {
        let s = storm(budgets, requests, 100).await;
        println!("{s}");
    }
}

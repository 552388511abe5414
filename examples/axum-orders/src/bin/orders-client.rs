//! `orders-client --url URL [--tenant T] [--key K] [--count N] [--concurrency C] create --book ID --quantity Q`
//!
//! Sends CreateOrder through `RetryLayer` (default policy, `ensure_idempotency_key`) and prints
//! one JSON line per order: `{"status":201,"order_id":"...","attempts":k,"key":"..."}`. Exits 0
//! when every order succeeded.

use std::process::ExitCode;

use axum_orders::cli::{init_tracing, ClientOpts};
use axum_orders::client::OrdersClient;
use clap::{Parser, Subcommand};

/// A client of the orders service that retries safely.
#[derive(Debug, Parser)]
#[command(name = "orders-client", version)]
struct Args {
    /// The service's base URL.
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    url: String,
    #[command(flatten)]
    opts: ClientOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create an order.
    Create {
        /// The book's id.
        #[arg(long)]
        book: String,
        /// How many copies.
        #[arg(long)]
        quantity: i64,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    init_tracing();
    let args = Args::parse();
    let client = OrdersClient::new(&args.url, &args.opts.tenant);
    let Command::Create { book, quantity } = &args.command;
    let key = args.opts.key.as_deref();
    args.opts
        .make_calls(|| async {
            match client.create_order(book, *quantity, key).await {
                Ok(line) => {
                    println!("{}", serde_json::to_string(&line).expect("serializable"));
                    line.status == 201
                }
                Err(e) => {
                    println!(
                        "{}",
                        serde_json::json!({"status": 0, "error": e.to_string()})
                    );
                    false
                }
            }
        })
        .await
}

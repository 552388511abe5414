//! `orders-client --url URL [--tenant T] [--key K] [--count N] [--concurrency C] create --book ID --quantity Q`
//!
//! Sends CreateOrder through `RetryLayer` (default policy, `ensure_idempotency_key`) and prints
//! one JSON line per order: `{"status":201,"order_id":"...","attempts":k,"key":"..."}`. Exits 0
//! when every order succeeded.

use std::process::ExitCode;

use axum_orders::client::OrdersClient;
use clap::{Parser, Subcommand};
use futures_util::stream::{self, StreamExt};

/// A client of the orders service that retries safely.
#[derive(Debug, Parser)]
#[command(name = "orders-client", version)]
struct Args {
    /// The service's base URL.
    #[arg(long, default_value = "http://127.0.0.1:3000")]
    url: String,
    /// The tenant (sent as x-tenant-id to the demo auth layer).
    #[arg(long, default_value = "public")]
    tenant: String,
    /// Use this idempotency key for every order (to demonstrate duplicates).
    #[arg(long)]
    key: Option<String>,
    /// How many orders to send.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// How many to send at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let client = OrdersClient::new(&args.url, &args.tenant);
    let Command::Create { book, quantity } = &args.command;
    let results: Vec<bool> = stream::iter(0..args.count)
        .map(|_| {
            let client = client.clone();
            let key = args.key.clone();
            async move {
                match client.create_order(book, *quantity, key.as_deref()).await {
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
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect()
        .await;
    if results.iter().all(|ok| *ok) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

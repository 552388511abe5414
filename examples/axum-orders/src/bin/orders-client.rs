//! `orders-client --url URL [--tenant T] [--key K] [--count N] [--concurrency C] COMMAND`
//!
//! - `create --book ID --quantity Q`: CreateOrder; prints
//!   `{"status":201,"order_id":"...","attempts":k,"key":"..."}` per order.
//! - `deduct --book ID --quantity Q [--expected-version V]`: DeductStock, computed from the
//!   book's version (read first unless given); on `STOCK_CONFLICT` the client re-reads the book
//!   and rebuilds the deduction. Prints
//!   `{"status":200,"remaining":n,"version":v,"attempts":k,"key":"..."}` per deduction.
//! - `stats`: how many orders and deductions really executed.
//!
//! Every call goes through `RetryLayer` (default policy, `ensure_idempotency_key`, a 10 s
//! deadline). Exits 0 when every call succeeded.

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
    /// Deduct stock from a book.
    Deduct {
        /// The book's id.
        #[arg(long)]
        book: String,
        /// How many copies.
        #[arg(long)]
        quantity: i64,
        /// The book's version the deduction is computed from (default: read it first). A stale
        /// one shows the conflict and its rebuild.
        #[arg(long)]
        expected_version: Option<u64>,
    },
    /// Print how many orders and deductions the server really executed.
    Stats,
}

fn print_line(line: &impl serde::Serialize) {
    println!("{}", serde_json::to_string(line).expect("serializable"));
}

fn print_error(e: &reason_code::BoxError) {
    println!(
        "{}",
        serde_json::json!({"status": 0, "error": e.to_string()})
    );
}

#[tokio::main]
async fn main() -> ExitCode {
    init_tracing();
    let args = Args::parse();
    let client = OrdersClient::new(&args.url, &args.opts.tenant);
    let key = args.opts.key.as_deref();
    let command = &args.command;
    args.opts
        .make_calls(|| async {
            match command {
                Command::Create { book, quantity } => {
                    match client.create_order(book, *quantity, key).await {
                        Ok(line) => {
                            print_line(&line);
                            line.status == 201
                        }
                        Err(e) => {
                            print_error(&e);
                            false
                        }
                    }
                }
                Command::Deduct {
                    book,
                    quantity,
                    expected_version,
                } => match client.deduct(book, *quantity, *expected_version, key).await {
                    Ok(line) => {
                        print_line(&line);
                        line.status == 200
                    }
                    Err(e) => {
                        print_error(&e);
                        false
                    }
                },
                Command::Stats => match client.stats().await {
                    Ok(stats) => {
                        print_line(&stats);
                        true
                    }
                    Err(e) => {
                        print_error(&e);
                        false
                    }
                },
            }
        })
        .await
}

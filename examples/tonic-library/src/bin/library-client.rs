//! `library-client --url URL [--tenant T] [--key K] [--count N] [--concurrency C] create-order --book ID --quantity Q`
//! (and `get-book --book ID`)
//!
//! A tonic `Channel` wrapped in `RetryLayer`. Prints one JSON line per call, like
//! `orders-client`: `{"status":0,"order_id":"...","attempts":k,"key":"..."}` where `status` is
//! the gRPC code (0 = OK). Exits 0 when every call succeeded.

use std::process::ExitCode;

use axum_orders::client::OrderLine;
use clap::{Parser, Subcommand};
use futures_util::stream::{self, StreamExt};
use retry_layer::RetryInfo;
use serde_json::json;
use tonic_library::client::{connect_lazy, policy};
use tonic_library::pb;

/// A client of the Library service that retries safely.
#[derive(Debug, Parser)]
#[command(name = "library-client", version)]
struct Args {
    /// The service's URL.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    url: String,
    /// The tenant (x-tenant-id metadata, read by the demo auth layer).
    #[arg(long, default_value = "public")]
    tenant: String,
    /// Use this idempotency key for every call (to demonstrate duplicates).
    #[arg(long)]
    key: Option<String>,
    /// How many calls to make.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// How many at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Subcommand)]
enum Command {
    /// CreateOrder.
    CreateOrder {
        /// The book's id.
        #[arg(long)]
        book: String,
        /// How many copies.
        #[arg(long)]
        quantity: i32,
    },
    /// GetBook.
    GetBook {
        /// The book's id.
        #[arg(long)]
        book: String,
    },
}

fn request<T>(msg: T, tenant: &str, key: Option<&str>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(t) = tenant.parse() {
        req.metadata_mut().insert("x-tenant-id", t);
    }
    if let Some(Ok(k)) = key.map(str::parse) {
        req.metadata_mut().insert("x-idempotency-key", k);
    }
    req
}

fn key_of<T>(res: &tonic::Response<T>, given: Option<&str>) -> String {
    match given {
        Some(k) => k.to_owned(),
        None => res
            .extensions()
            .get::<RetryInfo>()
            .and_then(|i| i.idempotency_key.as_ref())
            .and_then(|k| k.to_str().ok())
            .unwrap_or_default()
            .to_owned(),
    }
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
    let (client, _layer) = match connect_lazy(&args.url, policy()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("library-client: {e}");
            return ExitCode::FAILURE;
        }
    };
    let results: Vec<bool> = stream::iter(0..args.count)
        .map(|_| {
            let mut client = client.clone();
            let (tenant, key, command) = (args.tenant.clone(), args.key.clone(), args.command.clone());
            async move {
                let (ok, line) = match command {
                    Command::CreateOrder { book, quantity } => {
                        let msg = pb::CreateOrderRequest { book_id: book, quantity };
                        match client.create_order(request(msg, &tenant, key.as_deref())).await {
                            Ok(res) => {
                                let attempts = res.extensions().get::<RetryInfo>().map_or(1, |i| i.attempts);
                                let key = key_of(&res, key.as_deref());
                                let order = res.into_inner();
                                let line = OrderLine { status: 0, order_id: order.order_id, attempts, key };
                                (true, serde_json::to_string(&line).expect("serializable"))
                            }
                            Err(s) => (false, json!({"status": s.code() as i32, "error": s.message()}).to_string()),
                        }
                    }
                    Command::GetBook { book } => {
                        let msg = pb::GetBookRequest { book_id: book };
                        match client.get_book(request(msg, &tenant, key.as_deref())).await {
                            Ok(res) => {
                                let attempts = res.extensions().get::<RetryInfo>().map_or(1, |i| i.attempts);
                                let b = res.into_inner();
                                (true, json!({"status": 0, "book_id": b.book_id, "title": b.title, "stock": b.stock, "attempts": attempts}).to_string())
                            }
                            Err(s) => (false, json!({"status": s.code() as i32, "error": s.message()}).to_string()),
                        }
                    }
                };
                println!("{line}");
                ok
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

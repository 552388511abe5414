//! `orders-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]`
//!
//! Prints exactly one line on stdout when ready: `listening on http://IP:PORT`.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::inventory::Inventory;
use axum_orders::server::{app, bind, serve};
use axum_orders::store::StoreArg;
use clap::Parser;
use idempotency_layer::{IdempotencyLayer, MemoryStore};
use reason_code::RetryTable;

/// The orders service: writes run once per tenant + method + idempotency key.
#[derive(Debug, Parser)]
#[command(name = "orders-server", version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The idempotency store: memory, redis://HOST:PORT or postgres://USER@HOST/DB.
    #[arg(long, default_value = "memory")]
    store: StoreArg,
    /// Make each write take this many milliseconds (to show duplicates waiting).
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Record permanent failures (400, 404, ...) too, so their duplicates get the replay.
    #[arg(long)]
    record_permanent_failures: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let inventory = Inventory::seeded(Duration::from_millis(args.work_ms));
    let (listener, addr) = bind(args.listen).await?;
    let router = match args.store {
        StoreArg::Memory => {
            let layer = IdempotencyLayer::new(MemoryStore::new()).table(
                RetryTable::default().record_permanent_failures(args.record_permanent_failures),
            );
            app(inventory, layer)
        }
        other => {
            return Err(format!("store {other:?} is not available in this build yet").into());
        }
    };
    println!("listening on http://{addr}");
    serve(listener, router).await?;
    Ok(())
}

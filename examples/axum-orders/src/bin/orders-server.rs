//! `orders-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]`
//!
//! Prints exactly one line on stdout when ready: `listening on http://IP:PORT`. `GET /metrics`
//! serves both layers' metrics in the Prometheus text format.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::cli::{init_tracing, ServerOpts};
use axum_orders::inventory::Inventory;
use axum_orders::metrics;
use axum_orders::server::{app, bind, serve};
use axum_orders::store;
use clap::Parser;
use idempotency_layer::IdempotencyLayer;
use reason_code::RetryTable;

/// The orders service: writes run once per tenant + method + idempotency key.
#[derive(Debug, Parser)]
#[command(name = "orders-server", version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    #[command(flatten)]
    opts: ServerOpts,
    /// Record permanent failures (400, 404, ...) too, so their duplicates get the replay.
    #[arg(long)]
    record_permanent_failures: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    init_tracing();
    let metrics = metrics::install()?;
    let args = Args::parse();
    let inventory = Inventory::seeded(Duration::from_millis(args.opts.work_ms));
    let (listener, addr) = bind(args.listen).await?;
    let store = store::open(&args.opts.store).await?;
    let table = RetryTable::default().record_permanent_failures(args.record_permanent_failures);
    let layer = IdempotencyLayer::new(store).table(table);
    println!("listening on http://{addr}");
    serve(
        listener,
        app(inventory, layer).merge(metrics::routes(metrics)),
    )
    .await?;
    Ok(())
}

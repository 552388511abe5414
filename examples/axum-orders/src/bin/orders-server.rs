//! `orders-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]
//! [--lease-ms N] [--record-after-commit] [--orders-db postgres://...]`
//!
//! Prints exactly one line on stdout when ready: `listening on http://IP:PORT`. `GET /metrics`
//! serves both layers' metrics in the Prometheus text format.
//!
//! With `--store postgres://...`, orders go to an `orders` table in that database (created at
//! start), each committed in one transaction with its idempotency record; the environment
//! variable `ORDERS_FAILPOINT=abort-after-commit` makes the server abort right after an order
//! commits, before its response leaves (the crash tests use it); `abort-after-commit:0.02` does
//! so for 2 % of the orders (the kill-chaos soak uses it). With another store, `--orders-db
//! postgres://...` keeps orders in PostgreSQL all the same, the record in the store.

use axum_orders::orders_server::{run_orders_server, OrdersServerArgs};
use clap::Parser;

/// The orders service: writes run once per tenant + method + idempotency key.
#[derive(Debug, Parser)]
#[command(name = "orders-server", version)]
struct Args {
    #[command(flatten)]
    server: OrdersServerArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    run_orders_server(Args::parse().server).await
}

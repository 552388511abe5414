//! `orders-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]
//! [--lease-ms N] [--record-after-commit]`
//!
//! Prints exactly one line on stdout when ready: `listening on http://IP:PORT`. `GET /metrics`
//! serves both layers' metrics in the Prometheus text format.
//!
//! With `--store postgres://...`, orders go to an `orders` table in that database (created at
//! start), each committed in one transaction with its idempotency record; the environment
//! variable `ORDERS_FAILPOINT=abort-after-commit` makes the server abort right after an order
//! commits, before its response leaves (the crash tests use it).

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::cli::{init_tracing, ServerOpts};
use axum_orders::inventory::Inventory;
use axum_orders::metrics;
use axum_orders::server::{app_with, bind, serve, OrderBook};
use axum_orders::store::{self, AnyStore};
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
    /// The lease of an idempotency claim, in milliseconds: the claim of a server that died
    /// mid-request is taken over after it.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// With --store postgres://: commit each order alone and let the idempotency layer record
    /// the response afterwards (as with other stores), instead of in the order's transaction.
    /// Reopens the crash window between the two; for demonstrations.
    #[arg(long)]
    record_after_commit: bool,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    init_tracing();
    let metrics = metrics::install()?;
    let args = Args::parse();
    let inventory = Inventory::seeded(Duration::from_millis(args.opts.work_ms));
    let (listener, addr) = bind(args.listen).await?;
    let store = store::open(&args.opts.store).await?;
    let orders = order_book(&store, args.record_after_commit).await?;
    let table = RetryTable::default().record_permanent_failures(args.record_permanent_failures);
    let layer = IdempotencyLayer::new(store)
        .table(table)
        .lease(Duration::from_millis(args.lease_ms));
    println!("listening on http://{addr}");
    serve(
        listener,
        app_with(inventory, orders, layer).merge(metrics::routes(metrics)),
    )
    .await?;
    Ok(())
}

/// Where orders go: the `orders` table of a PostgreSQL store's database, else the inventory.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
async fn order_book(store: &AnyStore, record_after_commit: bool) -> Result<OrderBook, BoxError> {
    #[cfg(feature = "postgres")]
    {
        use axum_orders::pg_orders::{Failpoint, PgOrders, Recording, FAILPOINT_VAR};

        let failpoint = Failpoint::from_env()?;
        if let AnyStore::Postgres(pg) = store {
            let recording = if record_after_commit {
                Recording::AfterCommit
            } else {
                Recording::InTransaction
            };
            let orders = PgOrders::open(pg.clone(), recording, failpoint).await?;
            return Ok(OrderBook::Postgres(orders));
        }
        if failpoint.is_some() {
            return Err(format!("{FAILPOINT_VAR} needs --store postgres://...").into());
        }
    }
    if record_after_commit {
        return Err("--record-after-commit needs --store postgres://...".into());
    }
    Ok(OrderBook::Memory)
}

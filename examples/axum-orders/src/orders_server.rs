//! The `orders-server` program as a library: its options ([`OrdersServerArgs`]) and its main
//! ([`run_orders_server`]), so that other programs can run the same server as a child process
//! of their own (the kill-chaos soak re-executes itself as one).

use std::net::SocketAddr;
use std::time::Duration;

use idempotency_layer::IdempotencyLayer;
use reason_code::RetryTable;

use crate::cli::{init_tracing, ServerOpts};
use crate::inventory::Inventory;
use crate::metrics;
use crate::server::{app_with, bind, serve_until_sigterm, OrderBook};
use crate::stock::{InventoryClient, Stock};
use crate::store::{self, AnyStore};

/// The options of `orders-server`.
#[derive(Debug, Clone, clap::Args)]
pub struct OrdersServerArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    pub listen: SocketAddr,
    /// The store and the work time.
    #[command(flatten)]
    pub opts: ServerOpts,
    /// Record permanent failures (400, 404, ...) too, so their duplicates get the replay.
    #[arg(long)]
    pub record_permanent_failures: bool,
    /// The lease of an idempotency claim, in milliseconds: the claim of a server that died
    /// mid-request is taken over after it.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// With --store postgres://: commit each order alone and let the idempotency layer record
    /// the response afterwards (as with other stores), instead of in the order's transaction.
    /// Reopens the crash window between the two; for demonstrations.
    #[arg(long)]
    pub record_after_commit: bool,
    /// On SIGTERM (or Ctrl-C), how long the writes in flight get to finish and store their
    /// records before the process exits, in milliseconds (new writes are refused at once).
    #[arg(long, default_value_t = 30_000)]
    pub shutdown_grace_ms: u64,
    /// The PostgreSQL client of the order handler's transactions, wherever orders go to
    /// PostgreSQL: tokio-postgres on the store's own pool (`TxCompletion::complete_in`), or sqlx
    /// on a `PgPool` of the same database (`TxCompletion::complete_in_sqlx`; feature `sqlx`).
    #[arg(long, value_enum, default_value_t = OrdersDriver::TokioPostgres)]
    pub orders_driver: OrdersDriver,
    /// With a store other than PostgreSQL (memory, redis://): keep orders in the `orders` table
    /// of this PostgreSQL database all the same. The idempotency record is then written by the
    /// layer after the order commits, in the other store: the crash window is open, as with
    /// --record-after-commit.
    #[arg(long, value_name = "postgres://...")]
    pub orders_db: Option<String>,
    /// Take each order's stock from the inventory of another orders-server at this URL
    /// (`POST /books/{id}/deduct`, with the order's tenant and key), through a `RetryLayer`
    /// that derives each deduction's idempotency key from the order: an order run twice
    /// deducts once.
    #[arg(long, value_name = "http://HOST:PORT")]
    pub inventory_url: Option<String>,
    /// With --inventory-url: the secret the deductions' keys are derived with, the same on
    /// every instance (default: the environment variable DERIVED_KEYS_SECRET).
    #[arg(long, value_name = "SECRET")]
    pub derived_keys_secret: Option<String>,
    /// With --inventory-url: give each deduction a fresh key instead of a derived one, so an
    /// order run twice deducts twice (for comparisons).
    #[arg(long)]
    pub no_derived_keys: bool,
}

/// The environment variable of the derived-key secret (`--derived-keys-secret`).
pub const DERIVED_KEYS_SECRET_VAR: &str = "DERIVED_KEYS_SECRET";

/// The PostgreSQL client of the order handler's transactions (`--orders-driver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OrdersDriver {
    /// tokio-postgres, on the `PostgresStore`'s pool.
    #[default]
    TokioPostgres,
    /// sqlx, on a `PgPool` of the same database (feature `sqlx`).
    Sqlx,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Runs `orders-server` with `args` until SIGTERM: logs to stderr, binds, opens the store,
/// prints `listening on http://IP:PORT` on stdout, serves; on SIGTERM (or Ctrl-C) drains the
/// writes in flight ([`serve_until_sigterm`]) and returns.
pub async fn run_orders_server(args: OrdersServerArgs) -> Result<(), BoxError> {
    init_tracing();
    let metrics = metrics::install()?;
    let inventory = Inventory::seeded(Duration::from_millis(args.opts.work_ms));
    let (listener, addr) = bind(args.listen).await?;
    let store = store::open(&args.opts.store).await?;
    let orders = order_book(&store, &args).await?;
    let stock = stock(&args)?;
    let table = RetryTable::default().record_permanent_failures(args.record_permanent_failures);
    let layer = IdempotencyLayer::new(store)
        .table(table)
        .lease(Duration::from_millis(args.lease_ms));
    println!("listening on http://{addr}");
    let app = app_with(inventory, orders, stock, layer.clone()).merge(metrics::routes(metrics));
    let grace = Duration::from_millis(args.shutdown_grace_ms);
    serve_until_sigterm(listener, app, layer, grace).await?;
    Ok(())
}

/// Where an order's stock comes from: this server's inventory, or `--inventory-url`'s.
fn stock(args: &OrdersServerArgs) -> Result<Stock, BoxError> {
    let Some(url) = &args.inventory_url else {
        if args.derived_keys_secret.is_some() || args.no_derived_keys {
            return Err(
                "--derived-keys-secret and --no-derived-keys are for --inventory-url".into(),
            );
        }
        return Ok(Stock::Local);
    };
    if args.no_derived_keys {
        let client = InventoryClient::new(url.as_str(), None);
        return Ok(Stock::Remote(Box::new(client)));
    }
    let secret = match &args.derived_keys_secret {
        Some(secret) => secret.clone(),
        None => std::env::var(DERIVED_KEYS_SECRET_VAR).map_err(|_| {
            format!(
                "--inventory-url derives the deductions' keys from a secret shared by every \
                 instance: give --derived-keys-secret or {DERIVED_KEYS_SECRET_VAR}, or \
                 --no-derived-keys"
            )
        })?,
    };
    if secret.is_empty() {
        return Err("the derived-key secret is empty".into());
    }
    let client = InventoryClient::new(url.as_str(), Some(&secret));
    Ok(Stock::Remote(Box::new(client)))
}

/// Where orders go: the `orders` table of a PostgreSQL store's database, or of `--orders-db`,
/// else the inventory.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
async fn order_book(store: &AnyStore, args: &OrdersServerArgs) -> Result<OrderBook, BoxError> {
    #[cfg(feature = "postgres")]
    {
        use crate::pg_orders::{Failpoint, PgOrders, Recording, FAILPOINT_VAR};
        use idempotency_layer::PostgresStore;

        let failpoint = Failpoint::from_env()?;
        let recording = if args.record_after_commit {
            Recording::AfterCommit
        } else {
            Recording::InTransaction
        };
        match (store, &args.orders_db) {
            (AnyStore::Postgres(_), Some(_)) => {
                return Err(
                    "--orders-db is for other stores: with --store postgres://, \
                            orders go to the store's database"
                        .into(),
                )
            }
            (AnyStore::Postgres(pg), None) => {
                let orders = match args.orders_driver {
                    OrdersDriver::TokioPostgres => {
                        PgOrders::open(pg.clone(), recording, failpoint).await?
                    }
                    OrdersDriver::Sqlx => {
                        sqlx_orders(&args.opts.store.0, recording, failpoint).await?
                    }
                };
                return Ok(OrderBook::Postgres(orders));
            }
            (_, Some(url)) => {
                // The layer offers no transactional completion for this store: it records.
                let orders = match args.orders_driver {
                    OrdersDriver::TokioPostgres => {
                        // Only the pool is used (no idempotency table here, so no cleanup).
                        let db = PostgresStore::builder(url.as_str())
                            .cleanup_interval(Duration::ZERO)
                            .connect()
                            .await?;
                        PgOrders::open(db, Recording::AfterCommit, failpoint).await?
                    }
                    OrdersDriver::Sqlx => {
                        sqlx_orders(url, Recording::AfterCommit, failpoint).await?
                    }
                };
                return Ok(OrderBook::Postgres(orders));
            }
            (_, None) if failpoint.is_some() => {
                return Err(format!(
                    "{FAILPOINT_VAR} needs orders in PostgreSQL: --store postgres://... or \
                     --orders-db postgres://..."
                )
                .into())
            }
            (_, None) => {}
        }
    }
    if args.orders_driver == OrdersDriver::Sqlx {
        return Err(
            "--orders-driver sqlx is for orders in PostgreSQL: --store postgres://... or \
             --orders-db postgres://..."
                .into(),
        );
    }
    #[cfg(not(feature = "postgres"))]
    if args.orders_db.is_some() {
        return Err("--orders-db needs the feature `postgres`".into());
    }
    if args.record_after_commit {
        return Err("--record-after-commit needs --store postgres://...".into());
    }
    Ok(OrderBook::Memory)
}

/// Orders on a sqlx pool of `url`'s database (`--orders-driver sqlx`).
#[cfg(feature = "postgres")]
async fn sqlx_orders(
    url: &str,
    recording: crate::pg_orders::Recording,
    failpoint: Option<crate::pg_orders::Failpoint>,
) -> Result<crate::pg_orders::PgOrders, BoxError> {
    #[cfg(feature = "sqlx")]
    return crate::pg_orders::PgOrders::open_sqlx(url, recording, failpoint).await;
    #[cfg(not(feature = "sqlx"))]
    {
        let _ = (url, recording, failpoint);
        Err("--orders-driver sqlx needs the feature `sqlx` of axum-orders".into())
    }
}

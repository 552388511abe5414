//! `cargo run --release -p chaos --bin kill -- --minutes 3 --store postgres
//! [--record-after-commit] [--orders-driver sqlx] [--chain [--no-derived-keys]]`: kill chaos,
//! printed; exits with status 1 if a check fails.

use std::time::Duration;

use axum_orders::orders_server::{run_orders_server, OrdersServerArgs};
use chaos::kill::{run_kill, ChainKeys, KillOptions, OrdersDriver, ServerCommand};
use chaos::StoreKind;
use clap::{Parser, Subcommand};

/// Kill chaos: two orders-server processes sharing a store (one with --store memory) are
/// SIGKILLed at random moments and abort between an order's commit and its response (the
/// failpoint ORDERS_FAILPOINT=abort-after-commit:P), and are restarted at once on the same port,
/// while clients with RetryLayer place orders through the fault proxy. Orders go to a
/// PostgreSQL `orders` table (DATABASE_URL; the run creates a database of its own and drops it);
/// at the end every key's rows are counted: 2 or more is a duplicate side effect, a succeeded
/// order without its row a lost write.
///
/// With --chain, the killed instances are the middle tier of a chain: they take each order's
/// stock from an inventory tier of orders-server instances that are never killed (same store
/// kind, `--inventory-url`), with deduction keys derived from the order (or fresh, with
/// --no-derived-keys), and the failpoint aborts right after the inventory answered, before the
/// order's transaction (abort-after-side-effect:P). Every executed deduction is a row of a
/// `deductions` table carrying its order's key: an order deducted twice is a duplicate
/// downstream execution (none allowed with derived keys; counted with fresh ones).
///
/// The servers are this program re-executed (`kill serve ...`, the orders-server options), so
/// nothing but this binary needs to be built.
#[derive(Debug, Parser)]
#[command(name = "kill", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    serve: Option<Serve>,
    #[command(flatten)]
    run: Args,
}

#[derive(Debug, Subcommand)]
enum Serve {
    /// Runs one orders-server (what the run starts as its instances).
    #[command(hide = true)]
    Serve(OrdersServerArgs),
}

#[derive(Debug, clap::Args)]
struct Args {
    /// How long clients start new orders, in minutes.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Where the idempotency records live (Redis: REDIS_URL); orders are in PostgreSQL
    /// (DATABASE_URL) whatever the store.
    #[arg(long, value_enum, default_value_t = StoreKind::Postgres)]
    store: StoreKind,
    /// With --store postgres: the layer records each response after the order's commit,
    /// instead of in the order's transaction (reopens the crash window).
    #[arg(long)]
    record_after_commit: bool,
    /// The PostgreSQL client of the servers' order transactions: tokio-postgres (the store's
    /// pool, `TxCompletion::complete_in`) or sqlx (a `PgPool` of the same database,
    /// `TxCompletion::complete_in_sqlx`).
    #[arg(long, value_enum, default_value_t = OrdersDriver::TokioPostgres)]
    orders_driver: OrdersDriver,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Least seconds between two SIGKILLs.
    #[arg(long, default_value_t = 2.0)]
    kill_min: f64,
    /// Most seconds between two SIGKILLs (0: no SIGKILL).
    #[arg(long, default_value_t = 5.0)]
    kill_max: f64,
    /// Probability that an order aborts its server after its commit, before its response
    /// (0: the failpoint is off).
    #[arg(long, default_value_t = 0.02)]
    abort_p: f64,
    /// The claims' lease in milliseconds: how soon a killed server's claims are taken over.
    #[arg(long, default_value_t = 1500)]
    lease_ms: u64,
    /// Seed of the kills and of the proxy's faults.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Show the servers' stderr.
    #[arg(long)]
    server_logs: bool,
    /// Chain mode: the killed instances deduct each order's stock on an inventory tier that is
    /// not killed, and abort after the deduction instead of after the commit.
    #[arg(long)]
    chain: bool,
    /// With --chain: the killed tier gives each deduction a fresh key instead of one derived
    /// from the order (the comparison: an order run twice deducts twice).
    #[arg(long, requires = "chain")]
    no_derived_keys: bool,
}

fn main() {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    if let Some(Serve::Serve(server)) = cli.serve {
        if let Err(e) = runtime.block_on(run_orders_server(server)) {
            eprintln!("orders-server: {e}");
            std::process::exit(1);
        }
        return;
    }
    let args = cli.run;
    if args.record_after_commit && args.store != StoreKind::Postgres {
        eprintln!("--record-after-commit is for --store postgres: other stores always record after the commit");
        std::process::exit(2);
    }
    if !(0.0..=1.0).contains(&args.abort_p) {
        eprintln!("--abort-p must be in [0, 1]");
        std::process::exit(2);
    }
    let program = std::env::current_exe().unwrap_or_else(|e| {
        eprintln!("cannot find this program to re-execute it: {e}");
        std::process::exit(2)
    });
    let server = ServerCommand {
        program,
        args: vec!["serve".into()],
    };
    let mut opts = KillOptions::new(
        args.store,
        env("DATABASE_URL"),
        server,
        Duration::from_secs_f64(args.minutes * 60.0),
    );
    if args.store == StoreKind::Redis {
        opts.redis_url = Some(env("REDIS_URL"));
    }
    opts.transactional = !args.record_after_commit;
    opts.orders_driver = args.orders_driver;
    opts.clients = args.clients;
    opts.kill_every = (args.kill_max > 0.0).then(|| {
        (
            Duration::from_secs_f64(args.kill_min.min(args.kill_max)),
            Duration::from_secs_f64(args.kill_max),
        )
    });
    opts.abort_p = args.abort_p;
    opts.lease = Duration::from_millis(args.lease_ms);
    opts.seed = args.seed;
    opts.server_stderr = args.server_logs;
    opts.chain = args.chain.then_some(if args.no_derived_keys {
        ChainKeys::Fresh
    } else {
        ChainKeys::Derived
    });
    let report = runtime.block_on(run_kill(opts));
    println!("{report}");
    if !report.problems().is_empty() {
        std::process::exit(1);
    }
}

fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        eprintln!("{var} is not set: set it to the server's URL");
        std::process::exit(2)
    })
}

//! `cargo run --release -p chaos -- --minutes 5 --store redis`: the chaos soak, printed; exits
//! with status 1 if a check fails. Clients speak HTTP/1.1, HTTP/2 and gRPC, each with the tuned
//! and the default retry policy, unless `--wire` and `--policy` choose fewer.

use std::time::Duration;

use chaos::{run, Options, Policy, StoreKind, Wire};
use clap::Parser;

/// The chaos soak of the effectively-once workspace.
#[derive(Debug, Parser)]
struct Args {
    /// How long clients start new operations, in minutes.
    #[arg(long, default_value_t = 5.0)]
    minutes: f64,
    /// The store the instances share (Redis: REDIS_URL, PostgreSQL: DATABASE_URL).
    #[arg(long, value_enum, default_value_t = StoreKind::Memory)]
    store: StoreKind,
    /// Concurrent clients, spread over the groups (every wire with every policy).
    #[arg(long, default_value_t = 36)]
    clients: usize,
    /// The wires clients speak (repeat or separate with commas; default: all).
    #[arg(long = "wire", value_enum, value_delimiter = ',')]
    wires: Vec<Wire>,
    /// The retry policies clients run (repeat or separate with commas; default: both).
    #[arg(long = "policy", value_enum, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// Seconds between two faults of the store's link (latency, replies held after the
    /// request ran, a slow reader, a reset, connections left half-open, a cut: each in turn).
    #[arg(long, default_value_t = 20.0)]
    store_fault_every: f64,
    /// Seconds each store link fault lasts (a reset or a half-open acts at once).
    #[arg(long, default_value_t = 2.0)]
    store_fault_for: f64,
    /// Seed of the fault choices.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The claims' lease in seconds (the layer's default: 30).
    #[arg(long, default_value_t = 30.0)]
    lease: f64,
    /// Turn HTTP/2 keep-alive off on the HTTP/2 and gRPC clients (on by default: PING every
    /// 10 s).
    #[arg(long)]
    no_h2_keep_alive: bool,
    /// With the memory store: `MemoryStore::new()` as it ships, instead of a store sized for
    /// the run.
    #[arg(long)]
    memory_defaults: bool,
    /// The store's URL, instead of REDIS_URL or DATABASE_URL: PgBouncer's, say
    /// (`postgres://postgres@127.0.0.1:6432/test?pooling=transaction`, with `--ledger-url`).
    #[arg(long)]
    store_url: Option<String>,
    /// PostgreSQL: where the ledger lives, when the store goes through a transaction pooler
    /// (default: the store's URL).
    #[arg(long)]
    ledger_url: Option<String>,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let url = match args.store {
        StoreKind::Memory => None,
        StoreKind::Redis => Some(args.store_url.clone().unwrap_or_else(|| env("REDIS_URL"))),
        StoreKind::Postgres => Some(
            args.store_url
                .clone()
                .unwrap_or_else(|| env("DATABASE_URL")),
        ),
    };
    let mut opts = Options::new(
        args.store,
        url,
        Duration::from_secs_f64(args.minutes * 60.0),
    );
    opts.clients = args.clients;
    opts.ledger_url = args.ledger_url;
    if !args.wires.is_empty() {
        opts.wires = args.wires;
    }
    if !args.policies.is_empty() {
        opts.policies = args.policies;
    }
    opts.store_fault_every = Duration::from_secs_f64(args.store_fault_every);
    opts.store_fault_for = Duration::from_secs_f64(args.store_fault_for);
    opts.seed = args.seed;
    opts.lease = Duration::from_secs_f64(args.lease);
    opts.h2_keep_alive = !args.no_h2_keep_alive;
    opts.memory_defaults = args.memory_defaults;
    let report = run(opts).await;
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

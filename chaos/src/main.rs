//! `cargo run --release -p chaos -- --minutes 5 --store redis`: the chaos soak, printed; exits
//! with status 1 if a check fails.

use std::time::Duration;

use chaos::{run, Options, StoreKind};
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
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Seconds between store cuts.
    #[arg(long, default_value_t = 20.0)]
    cut_every: f64,
    /// Seconds each store cut lasts.
    #[arg(long, default_value_t = 2.0)]
    cut_for: f64,
    /// Seed of the fault choices.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The claims' lease in seconds (the layer's default: 30).
    #[arg(long, default_value_t = 30.0)]
    lease: f64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let url = match args.store {
        StoreKind::Memory => None,
        StoreKind::Redis => Some(env("REDIS_URL")),
        StoreKind::Postgres => Some(env("DATABASE_URL")),
    };
    let mut opts = Options::new(
        args.store,
        url,
        Duration::from_secs_f64(args.minutes * 60.0),
    );
    opts.clients = args.clients;
    opts.cut_every = Duration::from_secs_f64(args.cut_every);
    opts.cut_for = Duration::from_secs_f64(args.cut_for);
    opts.seed = args.seed;
    opts.lease = Duration::from_secs_f64(args.lease);
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

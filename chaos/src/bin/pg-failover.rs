//! `cargo run --release -p chaos --bin pg-failover -- --failovers 3 --how crash`: PostgreSQL
//! failover chaos, printed; exits with status 1 if a record acknowledged with a synchronous
//! standby was lost.

use std::path::PathBuf;
use std::time::Duration;

use chaos::pg_failover::{run_pg_failover, PgFailoverOptions, PgHow};
use clap::Parser;

/// PostgreSQL failover chaos: concurrent begin + complete through a PostgresStore on a primary
/// with one streaming standby (PG_REPLICA_URL, as `.ci/postgres-replica.sh` prints: both hosts,
/// `target_session_attrs=read-write`), while the run stops the primary and promotes the
/// standby. Counts the records a `complete` acknowledged that are missing on the final primary.
/// Run it from the workspace root on the machine of the nodes (it signals their processes).
#[derive(Debug, Parser)]
#[command(name = "pg-failover", version)]
struct Args {
    /// Failovers to force.
    #[arg(long, default_value_t = 3)]
    failovers: usize,
    /// How the primary stops: `crash` (immediate shutdown: no last WAL sent) or `switchover`
    /// (fast shutdown: the standby receives all WAL first).
    #[arg(long, value_enum, default_value_t = PgHow::Crash)]
    how: PgHow,
    /// The standby's WAL receiver is stopped this many milliseconds before each stop of the
    /// primary (the writes of that stretch reach the primary alone; 0: none).
    #[arg(long, default_value_t = 0)]
    cut_replica_ms: u64,
    /// The standby's replication link runs through a fault proxy left half-open this many
    /// milliseconds before each stop of the primary: nothing of that stretch reaches the
    /// standby, not even from the socket buffers (0: no proxy).
    #[arg(long, default_value_t = 0)]
    stall_replication_ms: u64,
    /// The store reaches both nodes through fault proxies whose links suffer a fault every
    /// this many seconds (latency, held replies, a slow reader, a reset, half-open, a cut; in
    /// turn, each for half that long; 0: direct links).
    #[arg(long, default_value_t = 0.0)]
    store_faults_secs: f64,
    /// A synchronous standby (`synchronous_standby_names = '*'`) rather than asynchronous
    /// replication.
    #[arg(long)]
    synchronous: bool,
    /// Seconds of load before each failover (and after the last).
    #[arg(long, default_value_t = 5.0)]
    between: f64,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// At most this many begin + complete per second (0: flat out).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// The store's timeout, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// The nodes' ports on 127.0.0.1.
    #[arg(long, value_delimiter = ',', default_value = "5433,5434")]
    ports: Vec<u16>,
    /// Before the failovers, stop the standby's WAL receiver this many seconds under load (0:
    /// not); with `--synchronous`, every commit waits for it meanwhile. Checks that the primary
    /// keeps accepting connections, that the store's backends stay within its pool, and that
    /// none still waits for the standby once it is back.
    #[arg(long, default_value_t = 0.0)]
    standby_away_secs: f64,
    /// Brings the old primary back as a standby and waits for it to stream.
    #[arg(long, default_value = ".ci/postgres-replica.sh")]
    restore: PathBuf,
}

fn main() {
    let args = Args::parse();
    let url = std::env::var("PG_REPLICA_URL").unwrap_or_else(|_| {
        eprintln!("PG_REPLICA_URL is not set: export PG_REPLICA_URL=$(.ci/postgres-replica.sh)");
        std::process::exit(2)
    });
    let [a, b] = args.ports[..] else {
        eprintln!("--ports takes two ports");
        std::process::exit(2)
    };
    let opts = PgFailoverOptions {
        url,
        ports: [a, b],
        failovers: args.failovers,
        how: args.how,
        cut_replica: Duration::from_millis(args.cut_replica_ms),
        stall_replication: Duration::from_millis(args.stall_replication_ms),
        store_faults: Duration::from_secs_f64(args.store_faults_secs),
        synchronous: args.synchronous,
        between: Duration::from_secs_f64(args.between),
        concurrency: args.concurrency.max(1),
        rate: args.rate,
        timeout: Duration::from_millis(args.timeout_ms),
        restore: args.restore,
        standby_away: Duration::from_secs_f64(args.standby_away_secs),
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let report = runtime.block_on(run_pg_failover(opts));
    println!("{report}");
    if !report.problems().is_empty() {
        std::process::exit(1);
    }
}

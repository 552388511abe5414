//! `cargo run --release -p chaos --bin failover -- --failovers 3 --how sentinel`: Redis failover
//! chaos, printed; exits with status 1 if a record acknowledged with `wait_for_replicas` was
//! lost.

use std::path::PathBuf;
use std::time::Duration;

use chaos::failover::{run_failover, FailoverOptions, How};
use clap::Parser;

/// Redis failover chaos: concurrent begin + complete through two RedisStores on the primary a
/// Redis Sentinel names (REDIS_SENTINEL_URL, `redis+sentinel://HOST:PORT/MASTER`, as
/// `.ci/redis-sentinel.sh` prints), one plain and one with `wait_for_replicas`, while the run
/// forces failovers. Counts the records a `complete` acknowledged that are missing on the final
/// primary, for each store; and, first, on the healthy pair, what `wait_for_replicas` costs
/// (ops/s, p50/p99 of begin + complete, both stores measured in alternating slices of the same
/// run). Run it from the workspace root on the machine of the Redis nodes: a killed node is
/// restarted as a replica by `--restore` (it must be able to send the nodes DEBUG).
#[derive(Debug, Parser)]
#[command(name = "failover", version)]
struct Args {
    /// Failovers to force.
    #[arg(long, default_value_t = 3)]
    failovers: usize,
    /// How: `sentinel` (SENTINEL FAILOVER; the old primary accepts writes until it is demoted)
    /// or `kill` (SIGKILL of the primary; the killed node is restarted as a replica).
    #[arg(long, value_enum, default_value_t = How::Sentinel)]
    how: How,
    /// With --how kill: the replica drops its link and sleeps this many milliseconds, from half
    /// of it before each kill (the writes of that half reach the primary alone; 0: none).
    #[arg(long, default_value_t = 0)]
    cut_replica_ms: u64,
    /// Seconds of load before each failover (and after the last).
    #[arg(long, default_value_t = 5.0)]
    between: f64,
    /// Concurrent tasks per store.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// During the failovers, at most this many begin + complete per second per store (0: flat
    /// out; a large data set makes each failover's resync slow). The cost figures are always
    /// measured flat out.
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// The waiting store's `wait_for_replicas(N, ..)`.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The waiting store's `wait_for_replicas(.., TIMEOUT)`, in milliseconds.
    #[arg(long, default_value_t = 100)]
    wait_timeout_ms: u64,
    /// Seconds each store is measured for the cost figures, on the healthy pair before the
    /// failovers (0: skip).
    #[arg(long, default_value_t = 10.0)]
    cost_secs: f64,
    /// The stores reach the Sentinels through fault proxies whose links suffer a fault every
    /// this many seconds during the failovers (latency, held replies, a slow reader, a reset,
    /// half-open, a cut; in turn, each for half that long; 0: direct links).
    #[arg(long, default_value_t = 0.0)]
    sentinel_faults_secs: f64,
    /// Restarts a killed node as a replica and waits for a healthy primary + replica.
    #[arg(long, default_value = ".ci/redis-sentinel.sh")]
    restore: PathBuf,
}

fn main() {
    let args = Args::parse();
    let url = std::env::var("REDIS_SENTINEL_URL").unwrap_or_else(|_| {
        eprintln!(
            "REDIS_SENTINEL_URL is not set: export REDIS_SENTINEL_URL=$(.ci/redis-sentinel.sh)"
        );
        std::process::exit(2)
    });
    let Some((sentinels, master)) = test_support::env::sentinel_parts(&url) else {
        eprintln!("REDIS_SENTINEL_URL={url} is not redis+sentinel://HOST:PORT/MASTER");
        std::process::exit(2)
    };
    let opts = FailoverOptions {
        sentinels,
        master,
        failovers: args.failovers,
        how: args.how,
        cut_replica: Duration::from_millis(args.cut_replica_ms),
        between: Duration::from_secs_f64(args.between),
        concurrency: args.concurrency.max(1),
        rate: args.rate,
        replicas: args.replicas,
        wait_timeout: Duration::from_millis(args.wait_timeout_ms),
        cost: Duration::from_secs_f64(args.cost_secs),
        restore: args.restore,
        sentinel_faults: Duration::from_secs_f64(args.sentinel_faults_secs),
    };
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let report = runtime.block_on(run_failover(opts));
    println!("{report}");
    if !report.problems().is_empty() {
        std::process::exit(1);
    }
}

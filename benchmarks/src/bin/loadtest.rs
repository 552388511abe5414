//! Load benchmark: an axum server and a tonic server on 127.0.0.1, and clients with C
//! connections for T seconds per scenario, printing requests/s, p50 and p99 per scenario and
//! the ratio to the baseline scenario of its protocol (`no_layers`, `grpc/no_layers`) of the
//! same run. Then, for Redis and PostgreSQL, the round trips and statements per request read
//! from the servers' own statistics (`INFO commandstats`, `pg_stat_statements`), and first of
//! all the resident memory a record of a 200-byte response costs in `MemoryStore`.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//! REDIS_CLUSTER_URLS=$(.ci/redis-cluster.sh) \
//!     cargo run --release -p benchmarks --bin loadtest -- --connections 16 --rounds 3 --seconds 1.5
//! ```
//!
//! The machinery is `benchmarks::load` and `benchmarks::grpc`, shared with the `targets`
//! binary. See `BENCHMARKS.md` for what each number means.

use benchmarks::load::{
    in_process_scenarios, memory_per_record, postgres_section, redis_section, LoadConfig,
    RedisTarget,
};
use benchmarks::RESPONSE_200;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Load benchmark of retry-layer and idempotency-layer over real sockets")]
struct Args {
    /// Concurrent connections (one request in flight on each).
    #[arg(long, short = 'c', default_value_t = 16)]
    connections: usize,
    /// Measured seconds per scenario and round.
    #[arg(long, short = 't', default_value_t = 1.5)]
    seconds: f64,
    /// Unmeasured warm-up seconds before each scenario and round.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Rounds: every scenario runs once per round, the scenarios interleaved, and the medians
    /// over the rounds are printed (so a burst of noise from elsewhere hits one round of every
    /// scenario rather than all of one).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Records to fill MemoryStore with for the memory cost (0: skip).
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    /// Only these scenarios (comma separated names as printed, or prefixes such as `grpc` or
    /// `memory`); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Redis URL (default: the REDIS_URL environment variable; unset: skipped).
    #[arg(long, env = "REDIS_URL")]
    redis: Option<String>,
    /// Redis Cluster node URLs, comma separated (default: the REDIS_CLUSTER_URLS environment
    /// variable, as `.ci/redis-cluster.sh` prints; unset: skipped): the Redis scenarios again,
    /// as `redis-cluster/...`, on the cluster.
    #[arg(long, env = "REDIS_CLUSTER_URLS", value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// PostgreSQL URL (default: the DATABASE_URL environment variable; unset: skipped).
    #[arg(long, env = "DATABASE_URL")]
    postgres: Option<String>,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let cfg = LoadConfig {
        connections: args.connections,
        seconds: args.seconds,
        warmup: args.warmup,
        rounds: args.rounds,
        only: args.only.clone(),
    };
    println!(
        "loadtest: {} connections, {} rounds of {} s warm-up + {} s measured per scenario, {} cores, {} allocator",
        cfg.connections,
        cfg.rounds,
        cfg.warmup,
        cfg.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        benchmarks::ALLOCATOR
    );
    if args.records > 0 {
        let n = args.records;
        match memory_per_record(n).await {
            Some(per) => {
                let payload = RESPONSE_200.len() as f64;
                println!(
                    "memory: {n} records of a {}-byte response: {:.1} MiB resident, {per:.0} bytes/record \
                     ({:.0} bytes over the payload; target <= 2 x payload + 256 = {:.0} bytes)",
                    RESPONSE_200.len(),
                    per * n as f64 / (1 << 20) as f64,
                    per - payload,
                    2.0 * payload + 256.0
                );
            }
            None => println!("memory: /proc/self/status unreadable; skipped"),
        }
    }
    let mut report = in_process_scenarios(&cfg, &format!("m{}", std::process::id())).await;
    match &args.redis {
        Some(url) => {
            let target = RedisTarget {
                urls: vec![url.clone()],
                cluster: false,
            };
            report.extend(redis_section(&target, &cfg).await);
        }
        None => report
            .notes
            .push("redis: skipped (REDIS_URL unset)".to_owned()),
    }
    if args.redis_cluster.is_empty() {
        report
            .notes
            .push("redis-cluster: skipped (REDIS_CLUSTER_URLS unset)".to_owned());
    } else {
        let target = RedisTarget {
            urls: args.redis_cluster.clone(),
            cluster: true,
        };
        report.extend(redis_section(&target, &cfg).await);
    }
    match &args.postgres {
        Some(url) => report.extend(postgres_section(url, &cfg).await),
        None => report
            .notes
            .push("postgres: skipped (DATABASE_URL unset)".to_owned()),
    }
    report.print();
}

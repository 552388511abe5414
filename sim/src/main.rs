//! `cargo run --release -p sim -- --seeds N`: runs N seeds from `--from`, with a progress
//! line and a summary table (seeds, faults injected by kind, violations and exceptions by
//! cause); `--seed S` runs one seed and prints its schedule, verdict and trace.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::Instant;

use clap::Parser;

/// Runs the simulation over many seeds, or one.
#[derive(Parser, Debug)]
#[command(name = "sim", about)]
struct Args {
    /// How many seeds to run.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// The first seed, or `commit`: a seed derived from the current commit (`GITHUB_SHA` or
    /// `git rev-parse HEAD`), so that each landing tries new schedules.
    #[arg(long, default_value = "0")]
    from: String,
    /// Run only this seed, and print its schedule and trace.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop at the first failing seed.
    #[arg(long)]
    fail_fast: bool,
}

struct Resolved {
    seeds: u64,
    from: u64,
    fail_fast: bool,
}

fn main() {
    let args = Args::parse();
    // `SIM_LOG=debug` (an env-filter) logs what the layers say, for one seed.
    if let Ok(filter) = std::env::var("SIM_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .without_time()
            .init();
    }
    if let Some(seed) = args.seed {
        let report = sim::run_seed(seed);
        print!("{}", report.explain());
        if report.verdict.violations.is_empty() {
            println!("seed {seed}: every promise held");
        } else {
            std::process::exit(1);
        }
        return;
    }
    let from: u64 = if args.from == "commit" {
        sim::commit_seed()
    } else {
        args.from.parse().expect("--from: a seed, or `commit`")
    };
    let args = Resolved {
        seeds: args.seeds,
        from,
        fail_fast: args.fail_fast,
    };
    eprintln!("seeds {}..{}", args.from, args.from + args.seeds);
    let started = Instant::now();
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut violations: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut exceptions: BTreeMap<String, u64> = BTreeMap::new();
    let mut failing = Vec::new();
    let mut calls = 0u64;
    for (n, seed) in (args.from..args.from + args.seeds).enumerate() {
        let report = sim::run_seed(seed);
        calls += report.run.observed.calls.len() as u64;
        for (kind, k) in report.faults() {
            *faults.entry(kind).or_default() += k;
        }
        for (e, k) in &report.verdict.exceptions {
            *exceptions.entry(format!("{e:?}")).or_default() += k;
        }
        for v in &report.verdict.violations {
            violations
                .entry(format!("promise {}: {}", v.promise, v.cause))
                .or_insert((seed, 0))
                .1 += 1;
        }
        if !report.verdict.violations.is_empty() {
            failing.push(seed);
            if std::env::var_os("SIM_LIST").is_some() {
                let causes: std::collections::BTreeSet<&str> =
                    report.verdict.violations.iter().map(|v| v.cause).collect();
                println!("failing seed {seed}: {causes:?}");
            }
            if args.fail_fast {
                eprintln!();
                print!("{}", report.explain());
                break;
            }
        }
        let done = n as u64 + 1;
        if done.is_multiple_of(10) || done == args.seeds {
            let secs = started.elapsed().as_secs_f64();
            eprint!(
                "\r[{:<40}] {done}/{} seeds, {} failing, {:.0} seeds/s   ",
                "#".repeat((40 * done / args.seeds.max(1)) as usize),
                args.seeds,
                failing.len(),
                done as f64 / secs.max(1e-9)
            );
            let _ = std::io::stderr().flush();
        }
    }
    eprintln!();
    println!(
        "seeds {}..{}: {} run in {:.1} s, {calls} calls, {} failing",
        args.from,
        args.from + args.seeds,
        args.seeds,
        started.elapsed().as_secs_f64(),
        failing.len()
    );
    println!("\n| faults injected | count |\n|---|---|");
    for (k, n) in &faults {
        println!("| {k} | {n} |");
    }
    println!("\n| violations | seeds | first seed |\n|---|---|---|");
    for (k, (first, n)) in &violations {
        println!("| {k} | {n} | {first} |");
    }
    println!("\n| allowed second executions | count |\n|---|---|");
    for (k, n) in &exceptions {
        println!("| {k} | {n} |");
    }
    if !failing.is_empty() {
        let shown: Vec<String> = failing.iter().take(20).map(u64::to_string).collect();
        println!("\nfailing seeds: {}", shown.join(" "));
        std::process::exit(1);
    }
}

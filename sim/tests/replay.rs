//! A seed replays exactly. A binary of its own: tokio numbers tasks with one counter for the
//! whole process, and the order a crashed host's tasks are dropped in follows those numbers;
//! the simulator aligns the counter before each seed, which makes a seed's run the same
//! whatever ran before it, as long as no other thread spawns tasks meanwhile (as the test
//! harness's parallel tests would). `cargo run -p sim` runs its seeds on one thread.

use sim::run_seed;

/// The same seed gives the same run, whatever ran before it in the process: the same calls
/// ending the same way at the same times, the same executions, the same trace. (Seed 108122
/// crashes a server: the order its tasks are dropped in followed tokio's process-wide task
/// numbering, and the seed ran differently after seed 108121 until the numbering was aligned
/// before each seed.)
#[test]
fn a_seed_replays_exactly() {
    for (seed, before) in [(7, 8), (20, 21), (103, 104), (108122, 108121)] {
        let a = run_seed(seed);
        let _ = run_seed(before);
        let b = run_seed(seed);
        let fingerprint = |r: &sim::SeedReport| {
            format!(
                "{:?}\n{:?}\n{:?}",
                r.run.observed.calls, r.run.observed.executions, r.run.observed.trace
            )
        };
        assert_eq!(
            fingerprint(&a),
            fingerprint(&b),
            "seed {seed} ran differently twice"
        );
    }
}

//! The store benchmark's loop (`begin` on a new scope, then `complete` with a 200-byte record,
//! one thread by default) as one run, for instruction counts under callgrind: a case of
//! `benchmarks::store_pairs::CASES`, such as `memory` (`MemoryStore`) or `mutex` (the
//! `Mutex<HashMap>` baseline) from an empty store, or `memory-steady` and `mutex-steady` in the
//! steady state (each pair also forgets the record 4 096 pairs back):
//!
//! ```text
//! cargo build --profile bench -p benchmarks --bin store_profile
//! for s in memory mutex; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$s target/release/store_profile $s 50000
//! done
//! callgrind_annotate cg.memory | head -40
//! ```
//!
//! Instructions per pair = total / pairs (the runtime's start-up is the same for both and small
//! against 50 000 pairs); see BENCHMARKS.md.

use benchmarks::store_pairs::{case, CASES};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let pairs: u64 = std::env::args()
        .nth(2)
        .map(|s| s.parse().expect("pairs: a number"))
        .unwrap_or(50_000);
    let threads: usize = std::env::args()
        .nth(3)
        .map(|s| s.parse().expect("threads: a number"))
        .unwrap_or(1);
    assert!(
        CASES.contains(&which.as_str()),
        "usage: store_profile <case> [pairs [threads]], case one of {CASES:?}, not {which:?}"
    );
    let took = case(&which, threads, pairs);
    eprintln!("{which}: {pairs} pairs on each of {threads} threads in {took:?}");
}

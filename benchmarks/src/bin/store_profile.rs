//! The store benchmark's loop (`begin` on a new scope, then `complete` with a 200-byte record,
//! one thread, from an empty store) as one run, for instruction counts under callgrind:
//! `memory` (`MemoryStore`) or `mutex` (the `Mutex<HashMap>` baseline):
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

use benchmarks::baseline::MutexStore;
use benchmarks::store_pairs::{contended, unbounded_memory_store};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let pairs: u64 = std::env::args()
        .nth(2)
        .map(|s| s.parse().expect("pairs: a number"))
        .unwrap_or(50_000);
    let took = match which.as_str() {
        "memory" => contended(1, pairs, unbounded_memory_store),
        "mutex" => contended(1, pairs, MutexStore::default),
        other => panic!("store_profile memory|mutex [pairs], not {other:?}"),
    };
    eprintln!("{which}: {pairs} pairs in {took:?}");
}

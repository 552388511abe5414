//! `MemoryStore` against a hand-rolled `Mutex<HashMap>` store ([`MutexStore`]) doing the same
//! claim/record work: `begin` on a new scope (claim it) then `complete` (replace the claim by a
//! 200-byte record), on 1 and 2 threads sharing one store. Every sample starts from an empty
//! store (large enough never to evict), so both do the same inserts. The work is
//! `benchmarks::store_pairs`, shared with the `targets` binary.
//!
//! The time reported is per begin+complete per thread (wall time of `iters` pairs on every
//! thread at once): with 2 threads, throughput is 2 / that.
//!
//! `store_steady_state` does the same pairs in a steady state: each pair also forgets the record
//! `WINDOW` pairs back, so the store holds a constant number of records and reuses the memory
//! it frees (from empty, both stores spend much of their time growing: the allocator's slow
//! path and the kernel's page faults; see BENCHMARKS.md).
//!
//! `cargo bench -p benchmarks --bench store`

use std::time::Duration;

use benchmarks::baseline::MutexStore;
use benchmarks::store_pairs::{contended, unbounded_memory_store, Mode};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

fn store(c: &mut Criterion) {
    for (name, mode) in [
        ("store_begin_complete", Mode::FromEmpty),
        ("store_steady_state", Mode::Steady),
    ] {
        let mut group = c.benchmark_group(name);
        for threads in [1usize, 2] {
            group.bench_function(BenchmarkId::new("memory_store", threads), |b| {
                b.iter_custom(|iters| contended(threads, iters, mode, unbounded_memory_store))
            });
            group.bench_function(BenchmarkId::new("mutex_hashmap", threads), |b| {
                b.iter_custom(|iters| contended(threads, iters, mode, MutexStore::default))
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = store
}
criterion_main!(benches);

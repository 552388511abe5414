//! The retry budget under contention: one budget shared by 1 and 2 threads, each calling what a
//! request costs it. Ours (`retry_layer::budget::TpsBudget`, lock-free slots) against
//! `tower::retry::budget::TpsBudget` (the one `tower::retry` users reach for), same window
//! (10 s), floor (10/s) and ratio (10 %).
//!
//! - `success`: what every request costs (ours: `deposit` + `record(false)`; tower: `deposit`).
//! - `failure`: a retryable failure asking for a retry (ours: `deposit` + `record(true)` +
//!   `withdraw`; tower: `deposit` + `withdraw`).
//!
//! The time reported is per operation per thread (wall time of `iters` operations on every
//! thread at once).
//!
//! `cargo bench -p benchmarks --bench retry_budget`

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use retry_layer::budget::{Budget, TpsBudget};
use tower::retry::budget::Budget as _;

fn contended<T: Send + Sync + 'static>(
    threads: usize,
    iters: u64,
    make: impl Fn() -> T,
    op: fn(&T),
) -> Duration {
    let shared = Arc::new(make());
    benchmarks::timed_threads(threads, |_| {
        let shared = shared.clone();
        move || {
            for _ in 0..iters {
                op(std::hint::black_box(&shared));
            }
        }
    })
}

fn ours() -> TpsBudget {
    TpsBudget::new(Duration::from_secs(10), 10, 0.1).expect("valid budget")
}

fn tower() -> tower::retry::budget::TpsBudget {
    tower::retry::budget::TpsBudget::new(Duration::from_secs(10), 10, 0.1)
}

fn budget(c: &mut Criterion) {
    // The budgets read the tokio clock outside a runtime too (std time).
    let mut group = c.benchmark_group("retry_budget");
    for threads in [1usize, 2] {
        group.bench_function(BenchmarkId::new("success/ours", threads), |b| {
            b.iter_custom(|iters| {
                contended(threads, iters, ours, |b| {
                    b.deposit();
                    b.record(false);
                })
            })
        });
        group.bench_function(BenchmarkId::new("success/tower", threads), |b| {
            b.iter_custom(|iters| contended(threads, iters, tower, |b| b.deposit()))
        });
        group.bench_function(BenchmarkId::new("failure/ours", threads), |b| {
            b.iter_custom(|iters| {
                contended(threads, iters, ours, |b| {
                    b.deposit();
                    b.record(true);
                    std::hint::black_box(b.withdraw());
                })
            })
        });
        group.bench_function(BenchmarkId::new("failure/tower", threads), |b| {
            b.iter_custom(|iters| {
                contended(threads, iters, tower, |b| {
                    b.deposit();
                    std::hint::black_box(b.withdraw());
                })
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = budget
}
criterion_main!(benches);

//! The store benchmark's work, shared by `benches/store.rs` and the `targets` binary: `begin`
//! on a new scope (claim it) then `complete` (replace the claim by a 200-byte record), on
//! several threads sharing one store, every measurement from an empty store; and the same in a
//! steady state, where each pair also forgets the record [`WINDOW`] pairs back, so the store
//! holds a constant number of records and reuses the memory it frees (as a server's store does
//! once its records start to expire).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey};
use idempotency_layer::{IdempotencyStore, MemoryStore};

use crate::RESPONSE_200;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// The record every `complete` stores: 201, a content type, [`RESPONSE_200`].
pub fn record() -> Record {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    Record::new(
        Fingerprint([7; 32]),
        StatusCode::CREATED,
        headers,
        Bytes::from_static(RESPONSE_200),
    )
}

/// A well-spread scope for operation `i` of thread `t` (splitmix64 of the counter).
pub fn scope(t: u8, i: u64) -> ScopeKey {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&z.to_le_bytes());
    k[8] = t;
    ScopeKey(k)
}

/// Records each thread keeps in the steady state: pair `i` forgets the record of pair
/// `i - WINDOW`.
pub const WINDOW: u64 = 4096;

/// The records' time to live in the steady state: longer than a window of pairs takes (the
/// forget always finds its record), short enough that `MemoryStore`'s expiry queue, which
/// still holds the forgotten records' deadlines, is emptied as it goes (its incremental
/// cleanup pops them) instead of growing through the measurement.
const STEADY_TTL: Duration = Duration::from_millis(10);

/// How the pairs treat the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every record is kept: the store grows from empty.
    FromEmpty,
    /// Each pair also forgets the record [`WINDOW`] pairs back: the store holds a constant
    /// number of records and reuses the memory it frees.
    Steady,
}

/// `iters` begin+complete pairs of thread `t` on `store` (each followed by a `forget` in the
/// steady state).
pub async fn pairs<S: IdempotencyStore>(store: &S, t: u8, iters: u64, rec: &Record, mode: Mode) {
    let ttl = match mode {
        Mode::FromEmpty => TTL,
        Mode::Steady => STEADY_TTL,
    };
    for i in 0..iters {
        let s = scope(t, i);
        let Ok(Begin::New(token)) = store.begin(s, rec.fingerprint(), LEASE).await else {
            panic!("a new scope is free");
        };
        store
            .complete(s, token, rec.clone().into(), ttl)
            .await
            .expect("the claim holds");
        if let (Mode::Steady, Some(old)) = (mode, i.checked_sub(WINDOW)) {
            store.forget(scope(t, old)).await.expect("forget");
        }
    }
}

/// Wall time of `iters` pairs (in `mode`) on each of `threads` threads (each with its own
/// current-thread runtime) on one store made by `make`, all started at once: the time per pair
/// per thread is this divided by `iters`.
pub fn contended<S: IdempotencyStore>(
    threads: usize,
    iters: u64,
    mode: Mode,
    make: impl Fn() -> S,
) -> Duration {
    let store = make();
    on_threads(threads, iters, mode, |_| store.clone())
}

/// Like [`contended`] from empty, but every thread on a store of its own made by `make`: nothing shared
/// between the threads (no lock, no cache line), so against [`contended`] on the same number of
/// threads it shows what sharing one store costs on this machine.
pub fn independent<S: IdempotencyStore>(
    threads: usize,
    iters: u64,
    make: impl Fn() -> S,
) -> Duration {
    on_threads(threads, iters, Mode::FromEmpty, |_| make())
}

/// The store cases by name, as `targets` and `store_profile` run them: `MemoryStore` or the
/// `Mutex<HashMap>` baseline, from empty or in the steady state, and one `MemoryStore` per
/// thread.
pub const CASES: [&str; 5] = [
    "memory",
    "mutex",
    "memory-steady",
    "mutex-steady",
    "memory-per-thread",
];

/// Wall time of store case `name` (one of [`CASES`]): `iters` pairs on each of `threads`
/// threads.
pub fn case(name: &str, threads: usize, iters: u64) -> Duration {
    use crate::baseline::MutexStore;
    match name {
        "memory" => contended(threads, iters, Mode::FromEmpty, unbounded_memory_store),
        "mutex" => contended(threads, iters, Mode::FromEmpty, MutexStore::default),
        "memory-steady" => contended(threads, iters, Mode::Steady, unbounded_memory_store),
        "mutex-steady" => contended(threads, iters, Mode::Steady, MutexStore::default),
        "memory-per-thread" => independent(threads, iters, unbounded_memory_store),
        other => panic!("no store case {other:?}: one of {CASES:?}"),
    }
}

/// Wall time of `iters` pairs on each of `threads` threads, thread `t` on `store_of(t)`.
fn on_threads<S: IdempotencyStore>(
    threads: usize,
    iters: u64,
    mode: Mode,
    store_of: impl Fn(usize) -> S,
) -> Duration {
    crate::timed_threads(threads, |t| {
        let store = store_of(t);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let rec = record();
        move || {
            rt.block_on(pairs(&store, t as u8, iters, &rec, mode));
            // Dropped once the clock has stopped (a store of its own is emptied then).
            (store, rt)
        }
    })
}

/// The `MemoryStore` the store benchmark measures: unbounded, like the baseline (the default
/// byte bound would refuse claims once a long measurement filled 128 MiB).
pub fn unbounded_memory_store() -> MemoryStore {
    MemoryStore::builder()
        .max_entries(usize::MAX / 2)
        .max_bytes(usize::MAX / 2)
        .build()
        .expect("valid MemoryStore settings")
}

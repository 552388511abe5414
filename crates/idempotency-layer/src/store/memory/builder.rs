//! [`MemoryStoreBuilder`]: a [`MemoryStore`]'s bounds.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::FOREVER;

use super::shard::{Inner, Limits, Tenants};
use super::{MemoryStore, ENTRY_OVERHEAD};

/// Builds a [`MemoryStore`]: [`MemoryStore::builder`].
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    pub(super) entries: usize,
    pub(super) bytes: usize,
    pub(super) shards: usize,
    pub(super) tenant_share: u8,
    pub(super) min_retention: Duration,
}

impl MemoryStoreBuilder {
    /// The most entries (claims and records) held, store-wide (default
    /// [`DEFAULT_CAPACITY`](MemoryStore::DEFAULT_CAPACITY)); at least one.
    pub fn max_entries(mut self, entries: usize) -> Self {
        self.entries = entries.max(1);
        self
    }

    /// The most bytes the entries may cost, store-wide (default
    /// [`DEFAULT_MAX_BYTES`](MemoryStore::DEFAULT_MAX_BYTES)); at least one entry's overhead.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.bytes = bytes.max(ENTRY_OVERHEAD);
        self
    }

    /// The number of shards the entries are spread over (default
    /// [`DEFAULT_SHARDS`](MemoryStore::DEFAULT_SHARDS)), lowered to the entry bound when that
    /// is smaller. More shards, less contention between threads; the bounds are the store's,
    /// whatever the number.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// The largest share of the entries and bytes one tenant may hold while other tenants hold
    /// entries too, in percent (default 50, clamped to 1..=100). A tenant alone in the store has
    /// all of it; 100 turns the bound off. Claims made with a plain
    /// [`begin`](crate::store::IdempotencyStore::begin) (no tenant known) are bound by the store's own bounds
    /// only.
    pub fn tenant_share_percent(mut self, percent: u8) -> Self {
        self.tenant_share = percent.clamp(1, 100);
        self
    }

    /// How long a record is kept at least, whatever the store's room (default
    /// [`DEFAULT_MIN_RETENTION`](MemoryStore::DEFAULT_MIN_RETENTION), 15 minutes; at most the
    /// record's TTL, which ends it anyway): set it to the longest any of your clients retries a
    /// call, so a retry always finds its record. When the store is full, records older than
    /// this make room for new claims, the oldest first, counted and logged; if none is, the
    /// claim is refused. `Duration::MAX` never evicts.
    pub fn min_retention(mut self, retention: Duration) -> Self {
        self.min_retention = retention.min(FOREVER);
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.clamp(1, self.entries);
        let share = |n: usize| (n * usize::from(self.tenant_share) / 100).max(1);
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Mutex::default()).collect(),
                entries: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                tenants: Tenants::default(),
                limits: Limits {
                    entries: self.entries,
                    bytes: self.bytes,
                    tenant_entries: share(self.entries),
                    tenant_bytes: share(self.bytes).max(ENTRY_OVERHEAD),
                    min_retention: self.min_retention,
                },
                origin: Instant::now(),
                refused: AtomicU64::new(0),
                evicted: AtomicU64::new(0),
                bodies_dropped: AtomicU64::new(0),
                nearly_full: AtomicBool::new(false),
                nearly_full_times: AtomicU64::new(0),
                eviction_warned: AtomicU64::new(0),
            }),
        }
    }
}

//! [`MemoryStoreBuilder`]: a [`MemoryStore`]'s bounds.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{StoreError, FOREVER};

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
    /// [`DEFAULT_CAPACITY`](MemoryStore::DEFAULT_CAPACITY)); at least one, else
    /// [`build`](Self::build) refuses it.
    pub fn max_entries(mut self, entries: usize) -> Self {
        self.entries = entries;
        self
    }

    /// The most bytes the entries may cost, store-wide (default
    /// [`DEFAULT_MAX_BYTES`](MemoryStore::DEFAULT_MAX_BYTES)); at least one entry's overhead
    /// ([`ENTRY_OVERHEAD`](MemoryStore::ENTRY_OVERHEAD)), else [`build`](Self::build) refuses
    /// it.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.bytes = bytes;
        self
    }

    /// The number of shards the entries are spread over (default
    /// [`DEFAULT_SHARDS`](MemoryStore::DEFAULT_SHARDS)), lowered to the entry bound when that
    /// is smaller. More shards, less contention between threads; the bounds are the store's,
    /// whatever the number. At least one, else [`build`](Self::build) refuses it.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// The largest share of the entries and bytes one tenant may hold while other tenants hold
    /// entries too, in percent (default 50; 1 to 100, else [`build`](Self::build) refuses it).
    /// A tenant alone in the store has
    /// all of it; 100 turns the bound off. Claims made with a plain
    /// [`begin`](crate::store::IdempotencyStore::begin) (no tenant known) are bound by the store's own bounds
    /// only.
    pub fn tenant_share_percent(mut self, percent: u8) -> Self {
        self.tenant_share = percent;
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

    /// The store, or [`StoreError::Config`] naming the first setting out of its range.
    pub fn build(self) -> Result<MemoryStore, StoreError> {
        let refuse = |what: String| Err(StoreError::Config(what));
        if self.entries == 0 {
            return refuse("max_entries must be at least 1".into());
        }
        if self.bytes < ENTRY_OVERHEAD {
            return refuse(format!(
                "max_bytes must be at least one entry's overhead, {ENTRY_OVERHEAD} bytes, got {}",
                self.bytes
            ));
        }
        if self.shards == 0 {
            return refuse("shards must be at least 1".into());
        }
        if !(1..=100).contains(&self.tenant_share) {
            return refuse(format!(
                "tenant_share_percent must be 1 to 100 (100: no per-tenant bound), got {}",
                self.tenant_share
            ));
        }
        let shards = self.shards.min(self.entries);
        let share = |n: usize| (n * usize::from(self.tenant_share) / 100).max(1);
        Ok(MemoryStore {
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
                scope_key_kinds: AtomicU8::new(0),
            }),
        })
    }
}

//! The embedded store: sharded maps in this process, bounded as a whole.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    Begin, FastMap, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, TenantKey, Token,
    FOREVER,
};

/// How many expired records one operation on a shard removes at most, so cleanup is incremental
/// and bounded.
const CLEANUP_PER_OP: usize = 8;

/// How many records from the front of a shard's expiry queue one eviction looks at, at most.
const EVICTION_SCAN: usize = 256;

/// How many boxes of completed claims a shard keeps for its next claims.
const SPARE_CLAIMS: usize = 4;

/// The bytes an entry costs besides its record: its map slot, expiry index slot, token,
/// fingerprint and the record's fixed fields (an estimate, on the high side).
pub(crate) const ENTRY_OVERHEAD: usize = 256;
/// The bytes a header costs besides its name and value.
const HEADER_OVERHEAD: usize = 32;

/// The in-memory store: the default, for one process.
///
/// - **Sharded**: entries are spread over shards by scope hash; each shard is a
///   `Mutex<HashMap>` held only for a few map operations, never across an `.await`.
/// - **TTL**: records expire after the layer's `ttl`, on [`tokio::time::Instant`] (so paused-time
///   tests work). An expired record is ignored at once and removed incrementally: every
///   operation on a shard removes up to a few expired records from the front of that shard's
///   expiry index, so no request scans the whole map; a store that needs room removes every
///   expired record of a shard before it evicts anything there.
/// - **Bounded in entries and in bytes, as a whole** (not per shard), and it counts what it
///   holds ([`stats`](MemoryStore::stats)): each entry costs its record's body, headers and
///   trailers plus a fixed [overhead](MemoryStore::ENTRY_OVERHEAD).
/// - **A minimum retention.** A record younger than
///   [`min_retention`](MemoryStoreBuilder::min_retention) (default 1 hour: longer than any
///   client retries one call) is never dropped before its TTL. When the store is full, records
///   older than that make room, the oldest first (the nearest expiry of the shard of the new
///   claim, else of another shard), counted ([`MemoryStats::evicted`]) and logged (at `WARN` at
///   most once a minute); if there is none, `begin` answers
///   [`StoreError::Full`] and nothing is claimed: the layer answers 503 / UNAVAILABLE with
///   `Retry-After`, nothing executes, and the refusal is counted ([`MemoryStats::refused`]). A
///   record that does not fit when its claim completes (the handler has already run, so it must
///   be kept) is kept without its body, as for a response over the layer's
///   `max_record_bytes`: a retry gets the status and headers, never a second execution; counted
///   in [`MemoryStats::bodies_dropped`] and logged. Claims in flight are never evicted.
/// - **Per-tenant share, between the tenants present**: while other tenants hold entries, one
///   tenant may hold at most [`tenant_share_percent`](MemoryStoreBuilder::tenant_share_percent)
///   of the entries and bytes (default 50 %), so one tenant's flood is refused (or makes room
///   from its own old records) while the room left stays for the others. A tenant alone in the
///   store (a single-tenant service) has all of it; a tenant arriving in a store another one
///   filled gets room as that one's records pass `min_retention` (the first is held to its
///   share from then on). The tenant is the one the layer scoped the key with
///   ([`IdempotencyStore::begin_for_tenant`]).
/// - **A warning when it passes 80 %** of its entries or bytes: logged at `WARN` and counted
///   ([`MemoryStats::nearly_full`], and `idempotency_layer_memory_store_nearly_full_total` with
///   the `metrics` feature), once each time it passes (again after it fell below 70 %).
/// - **Waiters** are woken by a [`tokio::sync::Notify`] per claim, made only when a duplicate
///   waits (a claim nobody waits for allocates nothing for waking), not by polling.
/// - **Tokens** come from a counter per shard, taken under the shard's lock: no counter is
///   shared between threads.
///
/// Records are lost when the process stops, and a second instance has its own: see
/// "Choosing a store" in the [crate docs](crate#choosing-a-store).
///
/// # Deploying
///
/// - **Sizing**: the defaults (100 000 entries, 128 MiB, records kept at least an hour) serve a
///   service writing up to about 25 new keys a second around the clock without a refusal
///   (100 000 records younger than an hour), with the layer's default 24 h TTL: past 100 000
///   records the oldest make room, so a retry within the hour always gets its replay and one a
///   day later may not. Size it for your rate times the longest a client retries
///   (`max_entries`, `max_bytes`, `min_retention`), or use a shared store to keep every record
///   for its TTL. Watch [`MemoryStats::refused`] (a refusal is a 503 your clients retry) and
///   [`MemoryStats::evicted`].
/// - **Eviction** of records younger than `min_retention` never happens, unless
///   [`evict_when_full`](MemoryStoreBuilder::evict_when_full) asks for it.
/// - **Failover, restarts, several instances**: records live in this process only; a restart
///   forgets them and instances do not share them. Use `RedisStore` or `PostgresStore` then.
///
/// ```
/// use std::time::Duration;
/// use idempotency_layer::MemoryStore;
///
/// let store = MemoryStore::builder()
///     .max_entries(10_000)
///     .max_bytes(32 << 20)
///     .tenant_share_percent(25)
///     .min_retention(Duration::from_secs(2 * 3600))
///     .build();
/// assert!(store.is_empty());
/// assert_eq!(store.stats().refused, 0);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// What the whole store holds: its bounds are checked against these.
    entries: AtomicUsize,
    bytes: AtomicUsize,
    /// What each tenant holds, store-wide.
    tenants: Tenants,
    limits: Limits,
    /// Completion times are kept as whole seconds since this instant.
    origin: Instant,
    refused: AtomicU64,
    evicted: AtomicU64,
    bodies_dropped: AtomicU64,
    /// Over 80 % now (cleared below 70 %), and how many times it passed 80 %.
    nearly_full: AtomicBool,
    nearly_full_times: AtomicU64,
    /// When (seconds since `origin`, plus one) an eviction was last logged at `WARN`.
    eviction_warned: AtomicU64,
}

/// The bounds of the store.
#[derive(Clone, Copy, Debug)]
struct Limits {
    entries: usize,
    bytes: usize,
    /// One tenant's bounds while others are present.
    tenant_entries: usize,
    tenant_bytes: usize,
    /// Records younger than this are never evicted.
    min_retention: Duration,
}

/// What one tenant holds.
#[derive(Default, Clone, Copy, Debug)]
struct Usage {
    entries: usize,
    bytes: usize,
}

const TENANT_SHARDS: usize = 16;

/// What each tenant holds, store-wide; and how many tenants hold something.
#[derive(Default)]
struct Tenants {
    shards: [Mutex<FastMap<TenantKey, Usage>>; TENANT_SHARDS],
    present: AtomicUsize,
}

#[derive(Default)]
struct Shard {
    /// The last token number handed out by this shard.
    next: u64,
    map: FastMap<ScopeKey, Entry>,
    /// Completed records' expiries, sorted by expiry (ties in the order they completed): the
    /// front expires first. A record removed before it expires (forgotten, evicted, replaced)
    /// leaves its element behind, skipped when it reaches the front and dropped when the queue
    /// is compacted (see [`Shard::push_expiry`]). With one TTL per layer, completions arrive in
    /// expiry order and each is a push at the back: a queue costs a fraction of a sorted map's
    /// memory and time per record.
    expiry: VecDeque<(Instant, ScopeKey)>,
    /// The completed records held: the live elements of `expiry`.
    records: usize,
    /// The boxes of claims that completed, reused by the next claims (at most
    /// [`SPARE_CLAIMS`]): a first execution then allocates no claim of its own.
    #[expect(
        clippy::vec_box,
        reason = "the boxes themselves are what is reused, moved into the map's entries"
    )]
    spare: Vec<Box<Claim>>,
}

enum Entry {
    /// Boxed: a claim lasts as long as its handler, a record for its TTL, so the map's slots
    /// are sized for records (48 bytes for the entry instead of 96, about 60 bytes less per
    /// record held).
    InFlight(Box<Claim>),
    Completed {
        tenant: TenantKey,
        record: Arc<Record>,
        expires: Instant,
        /// The bytes this entry costs (a record is at most 4 GiB: bounded by the layer's
        /// `max_record_bytes` and this store's `max_bytes`).
        size: u32,
        /// When it completed, in whole seconds since the store's origin.
        completed: u32,
    },
}

/// A claim in flight.
struct Claim {
    tenant: TenantKey,
    token: Token,
    fingerprint: Fingerprint,
    lease_until: Instant,
    /// Wakes the waiters when the claim ends (the entry is replaced or removed).
    wake: Wake,
}

impl Entry {
    fn size(&self) -> usize {
        match self {
            Entry::InFlight(_) => ENTRY_OVERHEAD,
            Entry::Completed { size, .. } => *size as usize,
        }
    }

    fn tenant(&self) -> TenantKey {
        match self {
            Entry::InFlight(claim) => claim.tenant,
            Entry::Completed { tenant, .. } => *tenant,
        }
    }
}

/// What a [`MemoryStore`] holds and what it refused, at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Entries held (claims and records, including expired records not yet removed).
    pub entries: usize,
    /// Bytes the entries cost (records' bodies, headers and trailers plus a fixed overhead
    /// each).
    pub bytes: usize,
    /// Tenants holding at least one entry.
    pub tenants: usize,
    /// Claims refused because the store (or the tenant's share of it) was full and no record
    /// was old enough to make room: each was a retryable 503 / UNAVAILABLE and nothing
    /// executed.
    pub refused: u64,
    /// Records evicted before their TTL to make room: older than
    /// [`min_retention`](MemoryStoreBuilder::min_retention) (any record, with
    /// [`evict_when_full`](MemoryStoreBuilder::evict_when_full)).
    pub evicted: u64,
    /// Records kept without their body because it did not fit.
    pub bodies_dropped: u64,
    /// Times the store passed 80 % of its entries or bytes.
    pub nearly_full: u64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("limits", &self.inner.limits)
            .field("entries", &self.inner.entries.load(Ordering::Relaxed))
            .field("bytes", &self.inner.bytes.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

/// Builds a [`MemoryStore`]: [`MemoryStore::builder`].
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    entries: usize,
    bytes: usize,
    shards: usize,
    tenant_share: u8,
    min_retention: Duration,
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
    /// [`begin`](IdempotencyStore::begin) (no tenant known) are bound by the store's own bounds
    /// only.
    pub fn tenant_share_percent(mut self, percent: u8) -> Self {
        self.tenant_share = percent.clamp(1, 100);
        self
    }

    /// How long a record is kept at least, whatever the store's room (default
    /// [`DEFAULT_MIN_RETENTION`](MemoryStore::DEFAULT_MIN_RETENTION), 1 hour; at most the
    /// record's TTL, which ends it anyway): set it to the longest any of your clients retries a
    /// call, so a retry always finds its record. When the store is full, records older than
    /// this make room for new claims, the oldest first, counted and logged; if none is, the
    /// claim is refused. `Duration::MAX` never evicts.
    pub fn min_retention(mut self, retention: Duration) -> Self {
        self.min_retention = retention.min(FOREVER);
        self
    }

    /// `true`: when the store is full, any record may make room, however young (its retry
    /// executes again): `min_retention(Duration::ZERO)`. `false`: none ever does, the store
    /// refuses instead: `min_retention(Duration::MAX)`.
    pub fn evict_when_full(self, evict: bool) -> Self {
        self.min_retention(if evict { Duration::ZERO } else { Duration::MAX })
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

impl MemoryStore {
    /// The default entry bound: 100 000 entries.
    pub const DEFAULT_CAPACITY: usize = 100_000;
    /// The default byte bound: 128 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 128 << 20;
    /// The default number of shards.
    pub const DEFAULT_SHARDS: usize = 32;
    /// The default share of one tenant while others are present, in percent.
    pub const DEFAULT_TENANT_SHARE_PERCENT: u8 = 50;
    /// The default of [`min_retention`](MemoryStoreBuilder::min_retention): 1 hour.
    pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(3600);
    /// The bytes each entry is counted for besides its record's body, headers and trailers.
    pub const ENTRY_OVERHEAD: usize = ENTRY_OVERHEAD;

    /// A store with the defaults.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// A builder with the defaults: [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) entries,
    /// [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES), [`DEFAULT_SHARDS`](Self::DEFAULT_SHARDS)
    /// shards, [`DEFAULT_TENANT_SHARE_PERCENT`](Self::DEFAULT_TENANT_SHARE_PERCENT) per tenant
    /// while others are present, records kept at least
    /// [`DEFAULT_MIN_RETENTION`](Self::DEFAULT_MIN_RETENTION).
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            entries: Self::DEFAULT_CAPACITY,
            bytes: Self::DEFAULT_MAX_BYTES,
            shards: Self::DEFAULT_SHARDS,
            tenant_share: Self::DEFAULT_TENANT_SHARE_PERCENT,
            min_retention: Self::DEFAULT_MIN_RETENTION,
        }
    }

    /// A store that keeps at most `capacity` entries (at least one), the other settings at
    /// their defaults.
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryStore::builder().max_entries(capacity).build()
    }

    /// A store that keeps at most `capacity` entries spread over `shards` shards. Both are
    /// raised to at least one; the shard count is lowered to the capacity when it is larger.
    pub fn with_capacity_and_shards(capacity: usize, shards: usize) -> Self {
        MemoryStore::builder()
            .max_entries(capacity)
            .shards(shards)
            .build()
    }

    /// The most entries this store keeps.
    pub fn capacity(&self) -> usize {
        self.inner.limits.entries
    }

    /// The most bytes this store's entries may cost.
    pub fn max_bytes(&self) -> usize {
        self.inner.limits.bytes
    }

    /// The number of entries held (claims and records, including expired records not yet
    /// removed).
    pub fn len(&self) -> usize {
        self.inner.entries.load(Ordering::Relaxed)
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the store holds and what it refused, evicted or kept without a body so far
    /// (export these to your metrics).
    pub fn stats(&self) -> MemoryStats {
        let inner = &*self.inner;
        MemoryStats {
            entries: inner.entries.load(Ordering::Relaxed),
            bytes: inner.bytes.load(Ordering::Relaxed),
            tenants: inner.tenants.present.load(Ordering::Relaxed),
            refused: inner.refused.load(Ordering::Relaxed),
            evicted: inner.evicted.load(Ordering::Relaxed),
            bodies_dropped: inner.bodies_dropped.load(Ordering::Relaxed),
            nearly_full: inner.nearly_full_times.load(Ordering::Relaxed),
        }
    }

    fn shard(&self, scope: &ScopeKey) -> MutexGuard<'_, Shard> {
        self.shard_at(scope).1
    }

    fn shard_index(&self, scope: &ScopeKey) -> usize {
        let mut b = [0u8; 8];
        b.copy_from_slice(&scope.0[..8]);
        (u64::from_le_bytes(b) % self.inner.shards.len() as u64) as usize
    }

    fn shard_at(&self, scope: &ScopeKey) -> (usize, MutexGuard<'_, Shard>) {
        let i = self.shard_index(scope);
        (i, lock(&self.inner.shards[i]))
    }

    /// Evicts one record (as [`Shard::evict_one`]) from a shard other than `held`'s, whose lock
    /// the caller holds: the bounds are the store's, and the shard a claim lands in may hold no
    /// record old enough while another does. Shards busy now are skipped (waiting for one while
    /// holding another could deadlock).
    fn evict_elsewhere(&self, held: usize, now: Instant, tenant: TenantKey, why: NoRoom) -> bool {
        let shards = &self.inner.shards;
        (1..shards.len()).any(|k| {
            let other = &shards[(held + k) % shards.len()];
            match other.try_lock() {
                Ok(mut shard) => shard.evict_one(&self.inner, now, tenant, why),
                Err(std::sync::TryLockError::Poisoned(e)) => {
                    e.into_inner().evict_one(&self.inner, now, tenant, why)
                }
                Err(std::sync::TryLockError::WouldBlock) => false,
            }
        })
    }
}

/// The bytes a record costs in the store: its body, headers and trailers, plus the overhead.
fn record_size(record: &Record) -> usize {
    let headers = |h: &http::HeaderMap| {
        h.iter()
            .map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD)
            .sum::<usize>()
    };
    ENTRY_OVERHEAD
        + record.body.len()
        + headers(&record.headers)
        + record.trailers.as_deref().map_or(0, headers)
}

/// The waiters of one claim: a [`Notify`] made by the first waiter, notified when the claim's
/// entry is dropped (replaced by its record, released, taken over or forgotten).
#[derive(Default)]
struct Wake(Option<Arc<Notify>>);

impl Drop for Wake {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.notify_waiters();
        }
    }
}

/// The completed record `map` holds for `scope` if it expires at `at`: then the expiry queue's
/// element `(at, scope)` is that record's, not a stale one (its tenant and completion time).
/// (Two elements can match only if the scope completed twice with the same expiry: either one
/// removes it when due.)
fn live_record(
    map: &FastMap<ScopeKey, Entry>,
    at: Instant,
    scope: &ScopeKey,
) -> Option<(TenantKey, u32)> {
    match map.get(scope) {
        Some(Entry::Completed {
            expires,
            tenant,
            completed,
            ..
        }) if *expires == at => Some((*tenant, *completed)),
        _ => None,
    }
}

/// Locks a shard; a poisoned lock is still usable (every critical section leaves the map
/// consistent before it can panic).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why there was no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NoRoom {
    /// The store is full.
    Store,
    /// The tenant holds its share, and other tenants are present.
    TenantShare,
}

impl Inner {
    /// Seconds since the store's origin, now.
    fn secs(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.origin).as_secs()).unwrap_or(u32::MAX)
    }

    /// Charges `tenant` `entries` more entries and `bytes` more bytes if the tenant's share and
    /// the store's bounds allow it (the share is checked first: a tenant over it makes room
    /// from its own records only).
    fn reserve(&self, tenant: TenantKey, entries: usize, bytes: usize) -> Result<(), NoRoom> {
        let limits = &self.limits;
        let known = tenant != TenantKey::default();
        let mut tenants = known.then(|| self.tenants.shard(tenant));
        if let Some(map) = &tenants {
            let u = map.get(&tenant).copied().unwrap_or_default();
            let others = self.tenants.present.load(Ordering::Relaxed) - usize::from(u.entries > 0);
            if others > 0
                && (u.entries + entries > limits.tenant_entries
                    || u.bytes + bytes > limits.tenant_bytes)
            {
                return Err(NoRoom::TenantShare);
            }
        }
        if self.entries.fetch_add(entries, Ordering::Relaxed) + entries > limits.entries {
            self.entries.fetch_sub(entries, Ordering::Relaxed);
            return Err(NoRoom::Store);
        }
        if self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes > limits.bytes {
            self.entries.fetch_sub(entries, Ordering::Relaxed);
            self.bytes.fetch_sub(bytes, Ordering::Relaxed);
            return Err(NoRoom::Store);
        }
        if let Some(map) = &mut tenants {
            let u = map.entry(tenant).or_default();
            if u.entries == 0 && entries > 0 {
                self.tenants.present.fetch_add(1, Ordering::Relaxed);
            }
            u.entries += entries;
            u.bytes += bytes;
        }
        drop(tenants);
        self.watch_fill();
        Ok(())
    }

    /// Charges `tenant` `bytes` more bytes whatever the bounds (a record kept without its body
    /// must be kept).
    fn force(&self, tenant: TenantKey, bytes: usize) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if tenant != TenantKey::default() {
            self.tenants.shard(tenant).entry(tenant).or_default().bytes += bytes;
        }
        self.watch_fill();
    }

    /// Gives back what an entry of `tenant` cost.
    fn refund(&self, tenant: TenantKey, entries: usize, bytes: usize) {
        self.entries.fetch_sub(entries, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        if tenant != TenantKey::default() {
            let mut map = self.tenants.shard(tenant);
            if let Some(u) = map.get_mut(&tenant) {
                u.entries -= entries;
                u.bytes -= bytes;
                if u.entries == 0 {
                    map.remove(&tenant);
                    self.tenants.present.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        if self.nearly_full.load(Ordering::Relaxed) && !self.over_percent(70) {
            self.nearly_full.store(false, Ordering::Relaxed);
        }
    }

    fn over_percent(&self, percent: usize) -> bool {
        let limits = &self.limits;
        self.entries.load(Ordering::Relaxed) * 100 >= limits.entries * percent
            || self.bytes.load(Ordering::Relaxed) * 100 >= limits.bytes * percent
    }

    /// Warns (once each time) when the store passes 80 % of its entries or bytes.
    fn watch_fill(&self) {
        if self.nearly_full.load(Ordering::Relaxed) || !self.over_percent(80) {
            return;
        }
        if !self.nearly_full.swap(true, Ordering::Relaxed) {
            self.nearly_full_times.fetch_add(1, Ordering::Relaxed);
            crate::observe::memory_store_nearly_full();
            tracing::warn!(
                entries = self.entries.load(Ordering::Relaxed),
                max_entries = self.limits.entries,
                bytes = self.bytes.load(Ordering::Relaxed),
                max_bytes = self.limits.bytes,
                "idempotency: the memory store passed 80 % of its bounds; when full, records \
                 older than min_retention make room and younger ones refuse new claims: raise \
                 max_entries / max_bytes, or use a shared store"
            );
        }
    }

    /// Logs an eviction: at `WARN` at most once a minute, else at `DEBUG`.
    fn log_eviction(&self, now: Instant, scope: &ScopeKey) {
        let at = u64::from(self.secs(now)) + 1;
        let last = self.eviction_warned.load(Ordering::Relaxed);
        if (last == 0 || at >= last + 60)
            && self
                .eviction_warned
                .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                ?scope,
                evicted = self.evicted.load(Ordering::Relaxed),
                "idempotency: memory store full; records older than min_retention make room \
                 (a retry of an evicted key executes again): raise max_entries / max_bytes if \
                 your clients retry that late"
            );
        } else {
            tracing::debug!(
                ?scope,
                "idempotency: memory store full; evicted an old record"
            );
        }
    }
}

impl Tenants {
    fn shard(&self, tenant: TenantKey) -> MutexGuard<'_, FastMap<TenantKey, Usage>> {
        lock(&self.shards[(tenant.0 % TENANT_SHARDS as u64) as usize])
    }
}

impl Shard {
    /// A token unique in the store: this shard's next number, tagged with the shard's index.
    fn token(&mut self, shard: usize) -> Token {
        self.next += 1;
        Token((u128::from(self.next) << 64) | shard as u128)
    }

    /// Replaces the claim `scope` holds (checked by the caller, and charged the record's size
    /// by it) by its record, in its slot: one lookup, where a removal and an insertion would
    /// hash the scope twice more. The claim's box is kept for a next claim; returns its
    /// waiters, whose drop wakes them (`None`, and nothing changed, if `scope` holds no claim).
    fn complete_claim(
        &mut self,
        scope: &ScopeKey,
        record: Arc<Record>,
        expires: Instant,
        size: usize,
        completed: u32,
    ) -> Option<Wake> {
        let slot = self.map.get_mut(scope)?;
        let Entry::InFlight(claim) = slot else {
            return None;
        };
        let tenant = claim.tenant;
        let waiters = std::mem::take(&mut claim.wake);
        let completed = Entry::Completed {
            tenant,
            record,
            expires,
            size: u32::try_from(size).unwrap_or(u32::MAX),
            completed,
        };
        if let Entry::InFlight(claim) = std::mem::replace(slot, completed) {
            if self.spare.len() < SPARE_CLAIMS {
                self.spare.push(claim);
            }
        }
        self.records += 1;
        self.push_expiry(expires, *scope);
        Some(waiters)
    }

    /// Removes what `scope` holds, refunding its tenant.
    fn remove(&mut self, inner: &Inner, scope: &ScopeKey) -> Option<Entry> {
        let entry = self.map.remove(scope)?;
        if let Entry::Completed { .. } = &entry {
            // Its element in `expiry` stays, stale, until it is popped or compacted away.
            self.records -= 1;
        }
        inner.refund(entry.tenant(), 1, entry.size());
        Some(entry)
    }

    /// Queues the expiry of a record completing now. Compacts the queue first when stale
    /// elements outnumber the live ones (plus some slack), so it stays within about twice the
    /// records held, whatever is forgotten; each compaction follows at least as many pushes as
    /// it visits elements, so a push costs O(1) amortized.
    fn push_expiry(&mut self, expires: Instant, scope: ScopeKey) {
        if self.expiry.len() >= 2 * self.records + 32 {
            let map = &self.map;
            self.expiry
                .retain(|(at, s)| live_record(map, *at, s).is_some());
            if self.expiry.capacity() > 4 * self.expiry.len() + 64 {
                self.expiry.shrink_to(2 * self.expiry.len() + 32);
            }
        }
        match self.expiry.back() {
            // A shorter TTL than the last record's (layers with different TTLs sharing the
            // store): keep the queue sorted.
            Some(&(last, _)) if last > expires => {
                let i = self.expiry.partition_point(|&(at, _)| at <= expires);
                self.expiry.insert(i, (expires, scope));
            }
            _ => self.expiry.push_back((expires, scope)),
        }
    }

    /// Removes up to `n` expired records (or stale elements) from the front of the expiry
    /// queue.
    fn clean(&mut self, inner: &Inner, now: Instant, n: usize) {
        for _ in 0..n {
            match self.expiry.front() {
                Some(&(at, scope)) if at <= now => {
                    self.expiry.pop_front();
                    if live_record(&self.map, at, &scope).is_some() {
                        self.remove(inner, &scope);
                    }
                }
                _ => break,
            }
        }
    }

    /// Makes room for `tenant`: removes this shard's expired records, if any; else evicts one
    /// record before its TTL: the nearest expiry (the oldest, with one TTL) among the records
    /// older than the minimum retention, of `tenant` itself when it is over its share. False
    /// when there is none.
    fn evict_one(&mut self, inner: &Inner, now: Instant, tenant: TenantKey, why: NoRoom) -> bool {
        let records = self.records;
        self.clean(inner, now, usize::MAX);
        if self.records < records {
            return true;
        }
        let retention = inner.limits.min_retention;
        let now_secs = inner.secs(now);
        let old_enough = |completed: u32| {
            Duration::from_secs(u64::from(now_secs.saturating_sub(completed))) >= retention
        };
        // The elements of records evicted (or forgotten) before are dropped from the front, so
        // the scan below sees records.
        while let Some(&(at, s)) = self.expiry.front() {
            if live_record(&self.map, at, &s).is_some() {
                break;
            }
            self.expiry.pop_front();
        }
        let victim = self
            .expiry
            .iter()
            .take(EVICTION_SCAN)
            .filter_map(|(at, s)| Some((*s, live_record(&self.map, *at, s)?)))
            .find(|(_, (t, completed))| {
                old_enough(*completed) && (why == NoRoom::Store || *t == tenant)
            })
            .map(|(s, _)| s);
        let Some(scope) = victim else {
            return false;
        };
        self.remove(inner, &scope);
        inner.evicted.fetch_add(1, Ordering::Relaxed);
        crate::observe::memory_store_evicted();
        inner.log_eviction(now, &scope);
        true
    }

    /// The claim `token` on `scope`, if it still holds.
    fn holds(&mut self, scope: &ScopeKey, token: Token) -> bool {
        matches!(self.map.get(scope), Some(Entry::InFlight(c)) if c.token == token)
    }
}

impl IdempotencyStore for MemoryStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        self.begin_for_tenant(TenantKey::default(), scope, fingerprint, lease)
            .await
    }

    async fn begin_for_tenant(
        &self,
        tenant: TenantKey,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let inner = &*self.inner;
        let (index, mut shard) = self.shard_at(&scope);
        shard.clean(inner, now, CLEANUP_PER_OP);
        match shard.map.get(&scope) {
            Some(Entry::Completed {
                record, expires, ..
            }) if *expires > now => return Ok(Begin::Completed(record.clone())),
            Some(Entry::InFlight(claim)) if claim.lease_until > now => {
                return Ok(Begin::InFlight {
                    token: claim.token,
                    fingerprint: claim.fingerprint,
                })
            }
            // Expired record or lapsed lease: take the scope over (dropping the old entry wakes
            // its waiters; the old leader is fenced). The tenant's room for it is freed with it.
            Some(_) => {
                shard.remove(inner, &scope);
            }
            None => {}
        }
        while let Err(why) = inner.reserve(tenant, 1, ENTRY_OVERHEAD) {
            // Out of room: expired records go first, then records past the minimum retention,
            // in this shard, then in the others.
            if !shard.evict_one(inner, now, tenant, why)
                && !self.evict_elsewhere(index, now, tenant, why)
            {
                inner.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    ?scope,
                    ?why,
                    "idempotency: memory store (or this tenant's share of it) is full and no \
                     record is past min_retention; claim refused, nothing executes"
                );
                return Err(StoreError::Full);
            }
        }
        let token = shard.token(index);
        let claim = Claim {
            tenant,
            token,
            fingerprint,
            lease_until: now + lease.min(FOREVER),
            wake: Wake::default(),
        };
        let claim = match shard.spare.pop() {
            Some(mut spare) => {
                *spare = claim;
                spare
            }
            None => Box::new(claim),
        };
        shard.map.insert(scope, Entry::InFlight(claim));
        Ok(Begin::New(token))
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        mut record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let inner = &*self.inner;
        let mut shard = self.shard(&scope);
        let index = self.shard_index(&scope);
        let tenant = match shard.map.get(&scope) {
            Some(Entry::InFlight(claim)) if claim.token == token => claim.tenant,
            _ => return Err(StoreError::Fenced),
        };
        // The handler has run: the record is kept whatever happens, in full if it fits. The
        // claim was charged one entry of `ENTRY_OVERHEAD` bytes; the record costs `size`.
        let mut size = record_size(&record);
        while let Err(why) = inner.reserve(tenant, 0, size - ENTRY_OVERHEAD) {
            if shard.evict_one(inner, now, tenant, why)
                || self.evict_elsewhere(index, now, tenant, why)
            {
                continue;
            }
            if !record.body.is_empty() {
                tracing::warn!(
                    ?scope,
                    body_bytes = record.body.len(),
                    "idempotency: memory store (or this tenant's share of it) has no room for \
                     this response body; recorded without it (a retry gets status and headers)"
                );
                inner.bodies_dropped.fetch_add(1, Ordering::Relaxed);
                // Rare: the copy without its body (the caller may hold the record to retry).
                let trimmed = Arc::make_mut(&mut record);
                trimmed.body = bytes::Bytes::new();
                trimmed.body_omitted = true;
            }
            size = record_size(&record);
            inner.force(tenant, size - ENTRY_OVERHEAD);
            break;
        }
        // Dropping the claim's `Wake` wakes its waiters (they run once the shard is unlocked).
        // The claim was checked above, under this lock, which only expired records' removal and
        // evictions (never a claim's) have released since.
        let completed = inner.secs(now);
        match shard.complete_claim(&scope, record, now + ttl.min(FOREVER), size, completed) {
            Some(waiters) => drop(waiters),
            None => {
                inner.refund(tenant, 0, size - ENTRY_OVERHEAD);
                return Err(StoreError::Fenced);
            }
        }
        shard.clean(inner, now, CLEANUP_PER_OP);
        Ok(())
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let mut shard = self.shard(&scope);
        if !shard.holds(&scope, token) {
            return Err(StoreError::Fenced);
        }
        shard.remove(&self.inner, &scope);
        Ok(())
    }

    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(&scope);
        match shard.map.get_mut(&scope) {
            Some(Entry::InFlight(claim)) if claim.token == token => {
                claim.lease_until = now + lease.min(FOREVER);
                Ok(())
            }
            _ => Err(StoreError::Fenced),
        }
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        let (notified, until) = {
            let mut shard = self.shard(&scope);
            let (notify, until) = match shard.map.get_mut(&scope) {
                Some(Entry::InFlight(claim)) if claim.token == observed => (
                    claim.wake.0.get_or_insert_with(Default::default).clone(),
                    claim.lease_until,
                ),
                _ => return Ok(()),
            };
            // Registered before the shard is unlocked, so the end of the claim is not missed.
            let mut notified = Box::pin(notify.notified_owned());
            notified.as_mut().enable();
            (notified, until)
        };
        // The lease bound lets the caller take over a claim whose leader stopped renewing.
        let _ = tokio::time::timeout_at(until, notified).await;
        Ok(())
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        Ok(self.shard(&scope).remove(&self.inner, &scope).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    fn scope(i: u64) -> ScopeKey {
        ScopeKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    fn record() -> Record {
        Record {
            fingerprint: Fingerprint([1; 32]),
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from_static(b"ok"),
            body_omitted: false,
            trailers: None,
        }
    }

    /// The map's slots are sized for records: a claim's fields are boxed, a record's are not.
    #[test]
    fn an_entry_is_no_larger_than_a_records_fields() {
        assert!(
            std::mem::size_of::<Entry>() <= 48,
            "{} bytes",
            std::mem::size_of::<Entry>()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn conformance() {
        crate::conformance::run_all(MemoryStore::new).await;
        crate::conformance::run_all(|| MemoryStore::with_capacity_and_shards(1000, 1)).await;
    }

    fn tenant_scope(tenant: &str, i: u64) -> (TenantKey, ScopeKey) {
        (
            TenantKey::of(tenant),
            crate::Scope::new(tenant, "POST /orders", &format!("key-{i}")).key(),
        )
    }

    impl From<ScopeKey> for (TenantKey, ScopeKey) {
        fn from(scope: ScopeKey) -> Self {
            (TenantKey::default(), scope)
        }
    }

    fn record_of(body: usize) -> Record {
        Record {
            body: Bytes::from(vec![b'x'; body]),
            ..record()
        }
    }

    /// Claims and completes `scope` with a record of `body` bytes; `Err(Full)` if refused.
    async fn write(
        store: &MemoryStore,
        scope: impl Into<(TenantKey, ScopeKey)>,
        body: usize,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (tenant, scope) = scope.into();
        let lease = Duration::from_secs(60);
        match store
            .begin_for_tenant(tenant, scope, Fingerprint([1; 32]), lease)
            .await?
        {
            Begin::New(t) => store.complete(scope, t, record_of(body).into(), ttl).await,
            other => panic!("fresh scope: {other:?}"),
        }
    }

    async fn is_recorded(store: &MemoryStore, scope: impl Into<(TenantKey, ScopeKey)>) -> bool {
        let (_, scope) = scope.into();
        matches!(
            store
                .begin(scope, Fingerprint([1; 32]), Duration::from_secs(60))
                .await,
            Ok(Begin::Completed(_))
        )
    }

    /// Ten times the capacity in keys, ten claims in flight all along: the store never holds
    /// more than its capacity, refuses (and counts) what does not fit, and never drops an
    /// unexpired record; once records expire, claims are accepted again.
    #[tokio::test(start_paused = true)]
    async fn a_full_store_refuses_and_counts_and_never_drops_a_record_early() {
        let store = MemoryStore::builder()
            .max_entries(100)
            .shards(4)
            .tenant_share_percent(100)
            .build();
        assert_eq!(store.capacity(), 100);
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        let ttl = Duration::from_secs(3600);
        let mut held = Vec::new();
        for i in 0..10 {
            match store.begin(scope(i), fp, lease).await.unwrap() {
                Begin::New(t) => held.push((scope(i), t)),
                other => panic!("{other:?}"),
            }
        }
        let mut recorded = Vec::new();
        let mut refused = 0;
        for i in 10..1000 {
            match write(&store, scope(i), 10, ttl).await {
                Ok(()) => recorded.push(scope(i)),
                Err(StoreError::Full) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            assert!(store.len() <= 100, "len {} at {i}", store.len());
        }
        assert!(
            refused > 0 && recorded.len() >= 80,
            "{refused} refused, {} recorded",
            recorded.len()
        );
        assert_eq!(store.stats().refused, refused);
        assert_eq!(store.stats().evicted, 0);
        for s in &recorded {
            assert!(
                is_recorded(&store, *s).await,
                "a record was dropped before its TTL"
            );
        }
        for (s, t) in held {
            assert!(matches!(
                store.begin(s, fp, lease).await.unwrap(),
                Begin::InFlight { token, .. } if token == t
            ));
            store.complete(s, t, record().into(), ttl).await.unwrap();
        }
        tokio::time::advance(ttl + Duration::from_secs(1)).await;
        for i in 2000..2050 {
            write(&store, scope(i), 10, ttl)
                .await
                .expect("room again once records expired");
        }
    }

    /// A completed claim's box is reused by the next claim: the reused claim is the new one in
    /// everything (token, fingerprint, lease, waiters), the old claim's waiters were woken when
    /// it completed, and the new one's wait until it ends.
    #[tokio::test(start_paused = true)]
    async fn a_reused_claim_is_a_new_claim() {
        let store = MemoryStore::with_capacity_and_shards(100, 1);
        let lease = Duration::from_secs(60);
        let ttl = Duration::from_secs(3600);
        let (a, b) = (scope(1), scope(2));
        let Begin::New(ta) = store.begin(a, Fingerprint([1; 32]), lease).await.unwrap() else {
            panic!("a is free");
        };
        let waiter = tokio::spawn({
            let store = store.clone();
            async move { store.wait(a, ta).await }
        });
        tokio::task::yield_now().await;
        store.complete(a, ta, record().into(), ttl).await.unwrap();
        waiter.await.unwrap().unwrap();
        let Begin::New(tb) = store.begin(b, Fingerprint([2; 32]), lease).await.unwrap() else {
            panic!("b is free");
        };
        assert_ne!(ta, tb);
        assert!(matches!(
            store.begin(b, Fingerprint([2; 32]), lease).await.unwrap(),
            Begin::InFlight { token, fingerprint } if token == tb && fingerprint == Fingerprint([2; 32])
        ));
        // A wait on the old claim's token returns at once; one on the new claim waits for it.
        store.wait(a, ta).await.unwrap();
        let waiter = tokio::spawn({
            let store = store.clone();
            async move { store.wait(b, tb).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        assert!(matches!(
            store.complete(b, ta, record().into(), ttl).await,
            Err(StoreError::Fenced)
        ));
        store.complete(b, tb, record().into(), ttl).await.unwrap();
        waiter.await.unwrap().unwrap();
        assert_eq!(store.stats().entries, 2);
        assert_eq!(store.stats().bytes, 2 * record_size(&record()));
        // The new claim's lease is its own: it lapses a lease after it was taken, not before.
        let Begin::New(tc) = store
            .begin(scope(3), Fingerprint([3; 32]), lease)
            .await
            .unwrap()
        else {
            panic!("c is free");
        };
        tokio::time::advance(lease - Duration::from_secs(1)).await;
        assert!(matches!(
            store.begin(scope(3), Fingerprint([3; 32]), lease).await.unwrap(),
            Begin::InFlight { token, .. } if token == tc
        ));
    }

    /// The byte bound holds whatever the entry count, and the store counts what it holds.
    #[tokio::test(start_paused = true)]
    async fn bytes_are_bounded_and_counted() {
        let store = MemoryStore::builder()
            .max_entries(100_000)
            .max_bytes(64 * 1024)
            .shards(2)
            .tenant_share_percent(100)
            .build();
        let ttl = Duration::from_secs(3600);
        let mut ok = 0;
        let mut refused = 0;
        for i in 0..1000 {
            match write(&store, scope(i), 1024, ttl).await {
                Ok(()) => ok += 1,
                Err(StoreError::Full) => refused += 1,
                Err(e) => panic!("{e}"),
            }
            let stats = store.stats();
            assert!(
                stats.bytes <= store.max_bytes(),
                "{} bytes held, bound {}",
                stats.bytes,
                store.max_bytes()
            );
        }
        let stats = store.stats();
        assert!(ok > 20 && refused > 0, "{ok} ok, {refused} refused");
        assert_eq!(stats.entries, ok);
        assert!(stats.bytes >= ok * 1024, "{stats:?}");
        // Forgetting gives the bytes back.
        for i in 0..1000 {
            store.forget(scope(i)).await.unwrap();
        }
        assert_eq!(store.stats().bytes, 0);
        assert_eq!(store.stats().entries, 0);
    }

    /// A response that does not fit when its claim completes is kept without its body (the
    /// handler ran: a retry must replay, not execute again), counted.
    #[tokio::test(start_paused = true)]
    async fn a_record_too_big_for_the_room_left_is_kept_without_its_body() {
        let store = MemoryStore::builder()
            .max_bytes(16 * 1024)
            .shards(1)
            .tenant_share_percent(100)
            .build();
        write(&store, scope(1), 100_000, Duration::from_secs(60))
            .await
            .unwrap();
        match store
            .begin(scope(1), Fingerprint([1; 32]), Duration::from_secs(60))
            .await
        {
            Ok(Begin::Completed(r)) => {
                assert!(r.body_omitted && r.body.is_empty());
                assert_eq!(r.status, StatusCode::OK);
            }
            other => panic!("the record is kept: {other:?}"),
        }
        assert_eq!(store.stats().bodies_dropped, 1);
        assert!(store.stats().bytes <= store.max_bytes());
    }

    /// One tenant floods while another is present: it is refused once it holds its share, and
    /// the other tenant still writes (and keeps every record).
    #[tokio::test(start_paused = true)]
    async fn one_tenants_flood_cannot_refuse_another_tenants_writes() {
        let store = MemoryStore::builder()
            .max_entries(1000)
            .shards(4)
            .tenant_share_percent(50)
            .build();
        let ttl = Duration::from_secs(3600);
        write(&store, tenant_scope("quiet", 1000), 10, ttl)
            .await
            .unwrap();
        let mut flood_ok = 0;
        for i in 0..5000 {
            match write(&store, tenant_scope("flooder", i), 10, ttl).await {
                Ok(()) => flood_ok += 1,
                Err(StoreError::Full) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(flood_ok, 500, "the flooder holds exactly its share");
        assert_eq!(store.stats().refused, 4500);
        assert_eq!(store.stats().tenants, 2);
        // The other tenant: 300 writes (well within what its share leaves).
        for i in 0..300 {
            write(&store, tenant_scope("quiet", i), 10, ttl)
                .await
                .unwrap_or_else(|e| panic!("the quiet tenant was refused at {i}: {e}"));
        }
        for i in 0..300 {
            assert!(is_recorded(&store, tenant_scope("quiet", i)).await);
        }
    }

    /// With eviction opted in, a full store evicts (counted) instead of refusing; a flooding
    /// tenant evicts its own records, never another tenant's.
    #[tokio::test(start_paused = true)]
    async fn evict_when_full_evicts_the_flooders_own_records_and_counts() {
        let store = MemoryStore::builder()
            .max_entries(400)
            .shards(2)
            .tenant_share_percent(50)
            .evict_when_full(true)
            .build();
        let ttl = Duration::from_secs(3600);
        for i in 0..100 {
            write(&store, tenant_scope("quiet", i), 10, ttl)
                .await
                .unwrap();
        }
        for i in 0..2000 {
            write(&store, tenant_scope("flooder", i), 10, ttl)
                .await
                .expect("evicting, not refusing");
        }
        let stats = store.stats();
        assert_eq!(stats.refused, 0);
        assert!(stats.evicted >= 1500, "{stats:?}");
        for i in 0..100 {
            assert!(
                is_recorded(&store, tenant_scope("quiet", i)).await,
                "the flood evicted another tenant's record"
            );
        }
        assert!(is_recorded(&store, tenant_scope("flooder", 1999)).await);
        assert!(!is_recorded(&store, tenant_scope("flooder", 0)).await);
    }

    /// A tenant alone in the store has all of it, whatever the shards: 32 shards and 1 000
    /// entries take exactly 1 000 writes (split per shard, a shard filled early and refused
    /// before the bound), then refuse while every record is younger than `min_retention`.
    #[tokio::test(start_paused = true)]
    async fn a_tenant_alone_has_the_whole_store_across_shards() {
        let store = MemoryStore::builder().max_entries(1000).shards(32).build();
        let ttl = Duration::from_secs(24 * 3600);
        for i in 0..1000 {
            write(&store, tenant_scope("shop", i), 10, ttl)
                .await
                .unwrap_or_else(|e| panic!("refused at write {i}: {e}"));
        }
        assert_eq!(store.len(), 1000);
        assert!(matches!(
            write(&store, tenant_scope("shop", 1000), 10, ttl).await,
            Err(StoreError::Full)
        ));
        let stats = store.stats();
        assert_eq!((stats.refused, stats.evicted, stats.tenants), (1, 0, 1));
    }

    /// When the store is full, records older than `min_retention` make room, the oldest first
    /// (counted); younger ones never do: a claim is refused instead.
    #[tokio::test(start_paused = true)]
    async fn records_past_min_retention_make_room_oldest_first() {
        let retention = Duration::from_secs(600);
        let store = MemoryStore::builder()
            .max_entries(100)
            .shards(1)
            .min_retention(retention)
            .build();
        let ttl = Duration::from_secs(24 * 3600);
        for i in 0..100 {
            write(&store, tenant_scope("shop", i), 10, ttl)
                .await
                .unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        // Now the first record is 100 s old: nothing is past the retention yet.
        assert!(matches!(
            write(&store, tenant_scope("shop", 100), 10, ttl).await,
            Err(StoreError::Full)
        ));
        // 10 records pass the retention (those of seconds 0 to 9): exactly those make room,
        // oldest first.
        tokio::time::advance(retention - Duration::from_secs(91)).await;
        for i in 101..111 {
            write(&store, tenant_scope("shop", i), 10, ttl)
                .await
                .unwrap_or_else(|e| panic!("an old record makes room for {i}: {e}"));
        }
        assert!(matches!(
            write(&store, tenant_scope("shop", 111), 10, ttl).await,
            Err(StoreError::Full)
        ));
        let stats = store.stats();
        assert_eq!((stats.evicted, stats.refused), (10, 2));
        for i in 10..100 {
            assert!(
                is_recorded(&store, tenant_scope("shop", i)).await,
                "{i} kept"
            );
        }
        for i in 0..10 {
            assert!(
                !is_recorded(&store, tenant_scope("shop", i)).await,
                "{i} evicted"
            );
        }
    }

    /// Passing 80 % of the entries is counted once; again only after falling below 70 %.
    #[tokio::test(start_paused = true)]
    async fn passing_80_percent_is_counted_once_each_time() {
        let store = MemoryStore::builder().max_entries(10).shards(1).build();
        let ttl = Duration::from_secs(3600);
        for i in 0..7 {
            write(&store, scope(i), 10, ttl).await.unwrap();
        }
        assert_eq!(store.stats().nearly_full, 0);
        write(&store, scope(7), 10, ttl).await.unwrap();
        assert_eq!(store.stats().nearly_full, 1, "8 of 10");
        write(&store, scope(8), 10, ttl).await.unwrap();
        store.forget(scope(8)).await.unwrap();
        write(&store, scope(8), 10, ttl).await.unwrap();
        assert_eq!(store.stats().nearly_full, 1, "still over 70 % in between");
        for i in 2..9 {
            store.forget(scope(i)).await.unwrap();
        }
        for i in 2..8 {
            write(&store, scope(i), 10, ttl).await.unwrap();
        }
        assert_eq!(
            store.stats().nearly_full,
            2,
            "fell below 70 %, passed 80 % again"
        );
    }

    /// The default store, as it ships, serves a single-tenant service writing 10 new keys a
    /// second around the clock: 25 hours (900 000 writes) with the default 24 h TTL and no
    /// refusal, and a retry of any key younger than `min_retention` (here at 1 minute and at 59
    /// minutes) is always its replay. Past 100 000 records, the oldest make room.
    #[tokio::test(start_paused = true)]
    async fn the_default_store_serves_ten_keys_a_second_around_the_clock() {
        let store = MemoryStore::new();
        let ttl = Duration::from_secs(24 * 3600);
        let per_second = 10u64;
        let seconds = 25 * 3600u64;
        for second in 0..seconds {
            for k in 0..per_second {
                let i = second * per_second + k;
                write(&store, tenant_scope("shop", i), 200, ttl)
                    .await
                    .unwrap_or_else(|e| panic!("write {i} refused: {e}"));
            }
            for age in [60, 59 * 60] {
                if second >= age {
                    let i = (second - age) * per_second;
                    assert!(
                        is_recorded(&store, tenant_scope("shop", i)).await,
                        "the retry of a key {age} s old at {second} s executed again"
                    );
                }
            }
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        let stats = store.stats();
        assert_eq!(stats.refused, 0);
        assert!(stats.entries <= MemoryStore::DEFAULT_CAPACITY, "{stats:?}");
        assert!(stats.evicted > 700_000, "the oldest made room: {stats:?}");
        assert_eq!(stats.nearly_full, 1, "{stats:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_shard_full_of_claims_in_flight_says_full() {
        let store = MemoryStore::with_capacity_and_shards(2, 1);
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        assert!(matches!(
            store.begin(scope(1), fp, lease).await,
            Ok(Begin::New(_))
        ));
        assert!(matches!(
            store.begin(scope(2), fp, lease).await,
            Ok(Begin::New(_))
        ));
        assert!(matches!(
            store.begin(scope(3), fp, lease).await,
            Err(StoreError::Full)
        ));
        assert_eq!(store.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_are_removed_incrementally() {
        let store = MemoryStore::with_capacity_and_shards(10_000, 1);
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        for i in 0..100 {
            let Begin::New(t) = store.begin(scope(i), fp, lease).await.unwrap() else {
                panic!("fresh scope")
            };
            store
                .complete(scope(i), t, record().into(), Duration::from_secs(10))
                .await
                .unwrap();
        }
        assert_eq!(store.len(), 100);
        tokio::time::advance(Duration::from_secs(11)).await;
        // One operation removes a bounded number, not all.
        let _ = store.begin(scope(1000), fp, lease).await.unwrap();
        assert_eq!(store.len(), 100 - CLEANUP_PER_OP + 1);
        for i in 1001..1020 {
            let _ = store.begin(scope(i), fp, lease).await.unwrap();
        }
        assert_eq!(
            store.len(),
            20,
            "every expired record is gone after enough operations"
        );
    }

    /// Records forgotten (or evicted, or replaced) before they expire leave stale elements in
    /// the expiry queue; compaction keeps the queue within about twice the records held, so a
    /// client that writes and forgets keys forever does not grow the store.
    #[tokio::test(start_paused = true)]
    async fn forgotten_records_do_not_grow_the_expiry_queue() {
        let store = MemoryStore::with_capacity_and_shards(1000, 1);
        let day = Duration::from_secs(86_400);
        for i in 0..100 {
            write(&store, scope(i), 10, day).await.unwrap();
        }
        for i in 100..20_100 {
            write(&store, scope(i), 10, day).await.unwrap();
            assert!(store.forget(scope(i)).await.unwrap());
            let shard = lock(&store.inner.shards[0]);
            assert_eq!(shard.records, 100);
            assert!(
                shard.expiry.len() <= 2 * 101 + 32,
                "queue of {} elements for 100 records at {i}",
                shard.expiry.len()
            );
        }
        for i in 0..100 {
            assert!(is_recorded(&store, scope(i)).await, "record {i} kept");
        }
        assert_eq!(store.len(), 100);
    }

    /// Layers with different TTLs on one store: the queue stays sorted by expiry, so a shorter
    /// TTL that completes later is still removed when it expires, and the longer ones are kept.
    #[tokio::test(start_paused = true)]
    async fn a_shorter_ttl_completed_later_expires_first() {
        let store = MemoryStore::with_capacity_and_shards(1000, 1);
        let secs = Duration::from_secs;
        write(&store, scope(1), 10, secs(60)).await.unwrap();
        write(&store, scope(2), 10, secs(10)).await.unwrap();
        write(&store, scope(3), 10, secs(30)).await.unwrap();
        write(&store, scope(4), 10, secs(10)).await.unwrap();
        {
            let shard = lock(&store.inner.shards[0]);
            let order: Vec<_> = shard.expiry.iter().map(|(_, s)| *s).collect();
            assert_eq!(order, [scope(2), scope(4), scope(3), scope(1)]);
        }
        tokio::time::advance(secs(11)).await;
        write(&store, scope(5), 10, secs(60)).await.unwrap();
        assert_eq!(
            store.len(),
            3,
            "the two 10 s records are removed, nothing else"
        );
        assert!(is_recorded(&store, scope(1)).await);
        assert!(is_recorded(&store, scope(3)).await);
        tokio::time::advance(secs(20)).await;
        write(&store, scope(6), 10, secs(60)).await.unwrap();
        assert!(
            !is_recorded(&store, scope(3)).await,
            "the 30 s record expired"
        );
        assert!(is_recorded(&store, scope(1)).await);
        assert!(is_recorded(&store, scope(5)).await);
    }

    /// A record forgotten and written again with the same expiry (paused time): the stale and
    /// the live element both name it; the record is removed when due, exactly once.
    #[tokio::test(start_paused = true)]
    async fn a_record_written_again_with_the_same_expiry_expires_once() {
        let store = MemoryStore::with_capacity_and_shards(1000, 1);
        let ttl = Duration::from_secs(10);
        write(&store, scope(1), 10, ttl).await.unwrap();
        assert!(store.forget(scope(1)).await.unwrap());
        write(&store, scope(1), 10, ttl).await.unwrap();
        assert!(is_recorded(&store, scope(1)).await);
        tokio::time::advance(ttl).await;
        write(&store, scope(2), 10, ttl).await.unwrap();
        assert!(!is_recorded(&store, scope(1)).await);
        let stats = store.stats();
        assert_eq!(
            stats.entries, 2,
            "scope 2 and the claim the check just made: {stats:?}"
        );
        assert_eq!(lock(&store.inner.shards[0]).records, 1);
    }
}

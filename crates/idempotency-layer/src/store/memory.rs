//! The embedded store: sharded maps in this process.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
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
///   expiry index, so no request scans the whole map; a shard that runs out of room removes
///   every expired record before it refuses anything.
/// - **Bounded in entries and in bytes**, and it counts what it holds
///   ([`stats`](MemoryStore::stats)): each entry costs its record's body, headers and trailers
///   plus a fixed [overhead](MemoryStore::ENTRY_OVERHEAD). The bounds are split evenly over the
///   shards.
/// - **Never drops an unexpired record silently.** When a shard has no room for a new claim,
///   `begin` answers [`StoreError::Full`] and nothing is claimed: the layer answers 503 /
///   UNAVAILABLE with `Retry-After`, nothing executes, and the refusal is counted
///   ([`MemoryStats::refused`]). A record that does not fit when its claim completes (the
///   handler has already run, so it must be kept) is kept without its body, as for a response
///   over the layer's `max_record_bytes`: a retry gets the status and headers, never a second
///   execution; counted in [`MemoryStats::bodies_dropped`] and logged. Only with
///   [`evict_when_full`](MemoryStoreBuilder::evict_when_full) does a full shard evict records
///   before their TTL instead (the one nearest expiry of the tenant holding most), counted in
///   [`MemoryStats::evicted`] and logged. Claims in flight are never evicted.
/// - **Per-tenant share**: one tenant may hold at most
///   [`tenant_share_percent`](MemoryStoreBuilder::tenant_share_percent) of the entries and
///   bytes (default 50 %), so one tenant's flood is refused (or evicts its own records) while
///   the room left stays for the others. The tenant is the one the layer scoped the key with
///   ([`IdempotencyStore::begin_for_tenant`]); a service with a single tenant may raise the
///   share to 100.
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
/// - **Sizing**: it holds about `writes per second x TTL` records. The defaults (100 000
///   entries, 128 MiB, 50 % per tenant, TTL 24 h) hold about 0.5 new keys per second per
///   tenant for a day. Size it for your rate (`max_entries`, `max_bytes`), shorten the layer's
///   [`ttl`](crate::IdempotencyLayer::ttl) to the longest time a client really retries, or use a
///   shared store. Watch [`MemoryStats::refused`]: a refusal is a 503 your clients retry.
/// - **Eviction**: off by default (a full store refuses, retryably). Turn it on only if a
///   second execution of an old key is acceptable to you.
/// - **Failover, restarts, several instances**: records live in this process only; a restart
///   forgets them and instances do not share them. Use `RedisStore` or `PostgresStore` then.
///
/// ```
/// use idempotency_layer::MemoryStore;
///
/// let store = MemoryStore::builder()
///     .max_entries(10_000)
///     .max_bytes(32 << 20)
///     .tenant_share_percent(25)
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
    limits: Limits,
    refused: AtomicU64,
    evicted: AtomicU64,
    bodies_dropped: AtomicU64,
}

/// The bounds of one shard.
#[derive(Clone, Copy, Debug)]
struct Limits {
    entries: usize,
    bytes: usize,
    tenant_entries: usize,
    tenant_bytes: usize,
    evict: bool,
}

/// What one tenant holds in one shard.
#[derive(Default, Clone, Copy)]
struct Usage {
    entries: usize,
    bytes: usize,
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
    /// The bytes all entries cost.
    bytes: usize,
    /// What each tenant holds (tenants holding nothing are removed).
    tenants: FastMap<TenantKey, Usage>,
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
        /// The bytes this entry costs.
        size: usize,
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
            Entry::Completed { size, .. } => *size,
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
    /// Claims refused because the shard (or the tenant's share of it) was full: each was a
    /// retryable 503 / UNAVAILABLE and nothing executed.
    pub refused: u64,
    /// Records evicted before their TTL (only with
    /// [`evict_when_full`](MemoryStoreBuilder::evict_when_full)).
    pub evicted: u64,
    /// Records kept without their body because it did not fit.
    pub bodies_dropped: u64,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("capacity", &self.capacity())
            .field("max_bytes", &self.max_bytes())
            .field("limits", &self.inner.limits)
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
    evict: bool,
}

impl MemoryStoreBuilder {
    /// The most entries (claims and records) held (default
    /// [`DEFAULT_CAPACITY`](MemoryStore::DEFAULT_CAPACITY)); at least one per shard.
    pub fn max_entries(mut self, entries: usize) -> Self {
        self.entries = entries.max(1);
        self
    }

    /// The most bytes the entries may cost (default
    /// [`DEFAULT_MAX_BYTES`](MemoryStore::DEFAULT_MAX_BYTES)); at least one entry's overhead
    /// per shard.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.bytes = bytes.max(ENTRY_OVERHEAD);
        self
    }

    /// The number of shards (default [`DEFAULT_SHARDS`](MemoryStore::DEFAULT_SHARDS)),
    /// lowered to the entry bound when that is smaller. Each shard gets an even part of both
    /// bounds.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// The largest share of the entries and bytes one tenant may hold, in percent (default 50,
    /// clamped to 1..=100). 100 turns the per-tenant bound off (a single-tenant service).
    /// Claims made with a plain [`begin`](IdempotencyStore::begin) (no tenant known) are bound
    /// by the store's own bounds only.
    pub fn tenant_share_percent(mut self, percent: u8) -> Self {
        self.tenant_share = percent.clamp(1, 100);
        self
    }

    /// When a shard is full, evict records before their TTL (the one nearest expiry of the
    /// tenant holding most in that shard, counted and logged) instead of refusing new claims.
    /// Off by default: an evicted record's retry executes again.
    pub fn evict_when_full(mut self, evict: bool) -> Self {
        self.evict = evict;
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.clamp(1, self.entries);
        let entries = self.entries / shards;
        let bytes = (self.bytes / shards).max(ENTRY_OVERHEAD);
        let share = |n: usize| (n * usize::from(self.tenant_share) / 100).max(1);
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Mutex::default()).collect(),
                limits: Limits {
                    entries,
                    bytes,
                    tenant_entries: share(entries),
                    tenant_bytes: share(bytes).max(ENTRY_OVERHEAD),
                    evict: self.evict,
                },
                refused: AtomicU64::new(0),
                evicted: AtomicU64::new(0),
                bodies_dropped: AtomicU64::new(0),
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
    /// The default share of one tenant, in percent.
    pub const DEFAULT_TENANT_SHARE_PERCENT: u8 = 50;
    /// The bytes each entry is counted for besides its record's body, headers and trailers.
    pub const ENTRY_OVERHEAD: usize = ENTRY_OVERHEAD;

    /// A store with the defaults.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// A builder with the defaults: [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) entries,
    /// [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES), [`DEFAULT_SHARDS`](Self::DEFAULT_SHARDS)
    /// shards, [`DEFAULT_TENANT_SHARE_PERCENT`](Self::DEFAULT_TENANT_SHARE_PERCENT) per
    /// tenant, refusing (not evicting) when full.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            entries: Self::DEFAULT_CAPACITY,
            bytes: Self::DEFAULT_MAX_BYTES,
            shards: Self::DEFAULT_SHARDS,
            tenant_share: Self::DEFAULT_TENANT_SHARE_PERCENT,
            evict: false,
        }
    }

    /// A store that keeps at most `capacity` entries (at least one), the other settings at
    /// their defaults.
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryStore::builder().max_entries(capacity).build()
    }

    /// A store that keeps at most `capacity` entries spread over `shards` shards. Both are
    /// raised to at least one; the shard count is lowered to the capacity when it is larger, and
    /// the capacity rounded down to a multiple of the shard count.
    pub fn with_capacity_and_shards(capacity: usize, shards: usize) -> Self {
        MemoryStore::builder()
            .max_entries(capacity)
            .shards(shards)
            .build()
    }

    /// The most entries this store keeps.
    pub fn capacity(&self) -> usize {
        self.inner.limits.entries * self.inner.shards.len()
    }

    /// The most bytes this store's entries may cost.
    pub fn max_bytes(&self) -> usize {
        self.inner.limits.bytes * self.inner.shards.len()
    }

    /// The number of entries held (claims and records, including expired records not yet
    /// removed).
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the store holds and what it refused, evicted or kept without a body so far
    /// (export these to your metrics).
    pub fn stats(&self) -> MemoryStats {
        let (mut entries, mut bytes) = (0, 0);
        for s in self.inner.shards.iter() {
            let s = lock(s);
            entries += s.map.len();
            bytes += s.bytes;
        }
        MemoryStats {
            entries,
            bytes,
            refused: self.inner.refused.load(Ordering::Relaxed),
            evicted: self.inner.evicted.load(Ordering::Relaxed),
            bodies_dropped: self.inner.bodies_dropped.load(Ordering::Relaxed),
        }
    }

    fn shard(&self, scope: &ScopeKey) -> MutexGuard<'_, Shard> {
        self.shard_at(scope).1
    }

    fn shard_at(&self, scope: &ScopeKey) -> (usize, MutexGuard<'_, Shard>) {
        let mut b = [0u8; 8];
        b.copy_from_slice(&scope.0[..8]);
        let i = (u64::from_le_bytes(b) % self.inner.shards.len() as u64) as usize;
        (i, lock(&self.inner.shards[i]))
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

/// The tenant of the completed record `map` holds for `scope` if it expires at `at`: then the
/// expiry queue's element `(at, scope)` is that record's, not a stale one. (Two elements can
/// match only if the scope completed twice with the same expiry: either one removes it when
/// due.)
fn live_record(map: &FastMap<ScopeKey, Entry>, at: Instant, scope: &ScopeKey) -> Option<TenantKey> {
    match map.get(scope) {
        Some(Entry::Completed {
            expires, tenant, ..
        }) if *expires == at => Some(*tenant),
        _ => None,
    }
}

/// Locks a shard; a poisoned lock is still usable (every critical section leaves the map
/// consistent before it can panic).
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shard {
    /// A token unique in the store: this shard's next number, tagged with the shard's index.
    fn token(&mut self, shard: usize) -> Token {
        self.next += 1;
        Token((u128::from(self.next) << 64) | shard as u128)
    }

    fn charge(&mut self, tenant: TenantKey, entries: usize, bytes: usize) {
        self.bytes += bytes;
        let u = self.tenants.entry(tenant).or_default();
        u.entries += entries;
        u.bytes += bytes;
    }

    fn refund(&mut self, tenant: TenantKey, entries: usize, bytes: usize) {
        self.bytes -= bytes;
        if let Some(u) = self.tenants.get_mut(&tenant) {
            u.entries -= entries;
            u.bytes -= bytes;
            if u.entries == 0 {
                self.tenants.remove(&tenant);
            }
        }
    }

    fn usage(&self, tenant: TenantKey) -> Usage {
        self.tenants.get(&tenant).copied().unwrap_or_default()
    }

    /// Holds `entry` for `scope` (which holds nothing now), charging its tenant.
    fn insert(&mut self, scope: ScopeKey, entry: Entry) {
        self.charge(entry.tenant(), 1, entry.size());
        if let Entry::Completed { expires, .. } = &entry {
            self.records += 1;
            self.push_expiry(*expires, scope);
        }
        self.map.insert(scope, entry);
    }

    /// Replaces the claim `scope` holds (checked by the caller) by its record, in its slot: one
    /// lookup, and the tenant charged the difference, where a removal and an insertion would
    /// hash the scope twice more and refund then charge the tenant. The claim's box is kept for
    /// a next claim; returns its waiters, whose drop wakes them (`None`, and nothing changed, if
    /// `scope` holds no claim).
    fn complete_claim(
        &mut self,
        scope: &ScopeKey,
        record: Arc<Record>,
        expires: Instant,
        size: usize,
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
            size,
        };
        if let Entry::InFlight(claim) = std::mem::replace(slot, completed) {
            if self.spare.len() < SPARE_CLAIMS {
                self.spare.push(claim);
            }
        }
        // The claim was charged one entry of `ENTRY_OVERHEAD` bytes; the record costs `size`.
        self.bytes = self.bytes + size - ENTRY_OVERHEAD;
        if let Some(u) = self.tenants.get_mut(&tenant) {
            u.bytes = u.bytes + size - ENTRY_OVERHEAD;
        }
        self.records += 1;
        self.push_expiry(expires, *scope);
        Some(waiters)
    }

    /// Removes what `scope` holds, refunding its tenant.
    fn remove(&mut self, scope: &ScopeKey) -> Option<Entry> {
        let entry = self.map.remove(scope)?;
        if let Entry::Completed { .. } = &entry {
            // Its element in `expiry` stays, stale, until it is popped or compacted away.
            self.records -= 1;
        }
        self.refund(entry.tenant(), 1, entry.size());
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
    fn clean(&mut self, now: Instant, n: usize) {
        for _ in 0..n {
            match self.expiry.front() {
                Some(&(at, scope)) if at <= now => {
                    self.expiry.pop_front();
                    if live_record(&self.map, at, &scope).is_some() {
                        self.remove(&scope);
                    }
                }
                _ => break,
            }
        }
    }

    /// The records in expiry order, nearest first.
    fn records_by_expiry(&self) -> impl Iterator<Item = (ScopeKey, TenantKey)> + '_ {
        self.expiry
            .iter()
            .filter_map(|(at, s)| Some((*s, live_record(&self.map, *at, s)?)))
    }

    /// True when `tenant` may add an entry of `bytes` (to a shard already holding it, if
    /// `replacing` frees one of its entries of `freed` bytes).
    fn fits(&self, limits: &Limits, tenant: TenantKey, bytes: usize, freed: Option<usize>) -> bool {
        let (entries, freed) = match freed {
            Some(f) => (0, f),
            None => (1, 0),
        };
        let u = self.usage(tenant);
        // No tenant known (a direct `begin`): only the store's own bounds apply.
        let shared = tenant == TenantKey::default();
        self.map.len() + entries <= limits.entries
            && self.bytes + bytes <= limits.bytes + freed
            && (shared
                || u.entries + entries <= limits.tenant_entries
                    && u.bytes + bytes <= limits.tenant_bytes + freed)
    }

    /// Evicts one record before its TTL to make room for `tenant`: its own nearest expiry when
    /// it is over its share, else the nearest expiry of the tenant holding most bytes. False
    /// when there is no record to evict (everything is in flight).
    fn evict_one(&mut self, limits: &Limits, tenant: TenantKey) -> bool {
        let u = self.usage(tenant);
        let over_share = tenant != TenantKey::default()
            && (u.entries >= limits.tenant_entries
                || u.bytes + ENTRY_OVERHEAD > limits.tenant_bytes);
        let victim_tenant = if over_share {
            tenant
        } else {
            match self.tenants.iter().max_by_key(|(_, u)| u.bytes) {
                Some((t, _)) => *t,
                None => return false,
            }
        };
        let own = self
            .records_by_expiry()
            .find(|(_, t)| *t == victim_tenant)
            .map(|(s, _)| s);
        // A tenant over its share evicts only its own records; one within its share is owed
        // room, from whoever holds a record.
        let victim = match own {
            None if !over_share => self.records_by_expiry().next().map(|(s, _)| s),
            v => v,
        };
        match victim {
            Some(scope) => {
                self.remove(&scope);
                tracing::warn!(
                    ?scope,
                    "idempotency: memory store full; evicted a record before its TTL \
                     (evict_when_full): a retry of its key executes again"
                );
                true
            }
            None => false,
        }
    }

    /// Makes room for a new claim of `tenant`; false (nothing changed but expired records
    /// removed) when there is none.
    fn make_room(
        &mut self,
        now: Instant,
        limits: &Limits,
        tenant: TenantKey,
        evicted: &AtomicU64,
    ) -> bool {
        if self.fits(limits, tenant, ENTRY_OVERHEAD, None) {
            return true;
        }
        // Out of room: every expired record goes first.
        self.clean(now, usize::MAX);
        while !self.fits(limits, tenant, ENTRY_OVERHEAD, None) {
            if !limits.evict || !self.evict_one(limits, tenant) {
                return false;
            }
            evicted.fetch_add(1, Ordering::Relaxed);
        }
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
        let limits = self.inner.limits;
        let (index, mut shard) = self.shard_at(&scope);
        shard.clean(now, CLEANUP_PER_OP);
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
                shard.remove(&scope);
            }
            None => {
                if !shard.make_room(now, &limits, tenant, &self.inner.evicted) {
                    self.inner.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        ?scope,
                        "idempotency: memory store (or this tenant's share of it) is full; \
                         claim refused, nothing executes"
                    );
                    return Err(StoreError::Full);
                }
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
        shard.insert(scope, Entry::InFlight(claim));
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
        let limits = self.inner.limits;
        let mut shard = self.shard(&scope);
        let tenant = match shard.map.get(&scope) {
            Some(Entry::InFlight(claim)) if claim.token == token => claim.tenant,
            _ => return Err(StoreError::Fenced),
        };
        // The handler has run: the record is kept whatever happens, in full if it fits.
        let mut size = record_size(&record);
        if !shard.fits(&limits, tenant, size, Some(ENTRY_OVERHEAD)) {
            shard.clean(now, usize::MAX);
            while limits.evict
                && !shard.fits(&limits, tenant, size, Some(ENTRY_OVERHEAD))
                && shard.evict_one(&limits, tenant)
            {
                self.inner.evicted.fetch_add(1, Ordering::Relaxed);
            }
            if !shard.fits(&limits, tenant, size, Some(ENTRY_OVERHEAD)) && !record.body.is_empty() {
                tracing::warn!(
                    ?scope,
                    body_bytes = record.body.len(),
                    "idempotency: memory store (or this tenant's share of it) has no room for \
                     this response body; recorded without it (a retry gets status and headers)"
                );
                self.inner.bodies_dropped.fetch_add(1, Ordering::Relaxed);
                // Rare: the copy without its body (the caller may hold the record to retry).
                let trimmed = Arc::make_mut(&mut record);
                trimmed.body = bytes::Bytes::new();
                trimmed.body_omitted = true;
                size = record_size(&record);
            }
        }
        // Dropping the claim's `Wake` wakes its waiters (they run once the shard is unlocked).
        // The claim was checked above, under this lock, which only expired records' removal and
        // evictions (never a claim's) have released since.
        match shard.complete_claim(&scope, record, now + ttl.min(FOREVER), size) {
            Some(waiters) => drop(waiters),
            None => return Err(StoreError::Fenced),
        }
        shard.clean(now, CLEANUP_PER_OP);
        Ok(())
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let mut shard = self.shard(&scope);
        if !shard.holds(&scope, token) {
            return Err(StoreError::Fenced);
        }
        shard.remove(&scope);
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
        Ok(self.shard(&scope).remove(&scope).is_some())
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

    /// One tenant floods: it is refused once it holds its share, and another tenant still
    /// writes (and keeps every record).
    #[tokio::test(start_paused = true)]
    async fn one_tenants_flood_cannot_refuse_another_tenants_writes() {
        let store = MemoryStore::builder()
            .max_entries(1000)
            .shards(4)
            .tenant_share_percent(50)
            .build();
        let ttl = Duration::from_secs(3600);
        let mut flood_ok = 0;
        for i in 0..5000 {
            match write(&store, tenant_scope("flooder", i), 10, ttl).await {
                Ok(()) => flood_ok += 1,
                Err(StoreError::Full) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert!(
            flood_ok <= 500,
            "the flooder holds at most its share: {flood_ok}"
        );
        assert!(store.stats().refused >= 4500);
        // The other tenant: 300 writes (well within what its share leaves, even per shard).
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

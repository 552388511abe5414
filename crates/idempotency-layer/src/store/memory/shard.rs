//! What a [`MemoryStore`](super::MemoryStore) holds and how it keeps within its bounds: the
//! shards' maps, the expiry queues, the per-tenant accounting, and eviction.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::HeaderName;
use reason_code::{IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::{FastMap, Fingerprint, Record, ScopeKey, TenantKey, Token};

use super::{ENTRY_OVERHEAD, EVICTION_SCAN, HEADER_OVERHEAD, SPARE_CLAIMS};

pub(super) struct Inner {
    pub(super) shards: Box<[Mutex<Shard>]>,
    /// What the whole store holds: its bounds are checked against these.
    pub(super) entries: AtomicUsize,
    pub(super) bytes: AtomicUsize,
    /// What each tenant holds, store-wide.
    pub(super) tenants: Tenants,
    pub(super) limits: Limits,
    /// Completion times are kept as whole seconds since this instant.
    pub(super) origin: Instant,
    pub(super) refused: AtomicU64,
    pub(super) evicted: AtomicU64,
    pub(super) bodies_dropped: AtomicU64,
    /// Over 80 % now (cleared below 70 %), and how many times it passed 80 %.
    pub(super) nearly_full: AtomicBool,
    pub(super) nearly_full_times: AtomicU64,
    /// When (seconds since `origin`, plus one) an eviction was last logged at `WARN`.
    pub(super) eviction_warned: AtomicU64,
    /// The kinds of scope keys claims were made with: [`PROCESS_KIND`], [`STABLE_KIND`], or
    /// both (a misconfiguration, see `MemoryStats::mixed_scope_keys`).
    pub(super) scope_key_kinds: AtomicU8,
}

pub(super) const PROCESS_KIND: u8 = 1;
pub(super) const STABLE_KIND: u8 = 2;
pub(super) const BOTH_KINDS: u8 = PROCESS_KIND | STABLE_KIND;

impl Inner {
    /// Notes the kind of key a claim is made with; logs at `ERROR` the first time a key of the
    /// other kind than earlier ones arrives. One relaxed load of a line that is only written
    /// twice in the store's life.
    pub(super) fn note_key_kind(&self, scope: &ScopeKey) {
        let kind = if scope.is_of_this_process() {
            PROCESS_KIND
        } else {
            STABLE_KIND
        };
        if self.scope_key_kinds.load(Ordering::Relaxed) & kind != 0 {
            return;
        }
        let before = self.scope_key_kinds.fetch_or(kind, Ordering::Relaxed);
        if before & kind == 0 && before != 0 {
            tracing::error!(
                "idempotency: this MemoryStore is given scope keys of two kinds (keys of this \
                 process and stable keys): two paths reach it that key scopes differently, and \
                 one scope can be claimed twice. A store that wraps a MemoryStore forwards \
                 IdempotencyStore::scope_keys; call its methods with Scope::key_in(&store)"
            );
        }
    }
}

/// The bounds of the store.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) entries: usize,
    pub(super) bytes: usize,
    /// One tenant's bounds while others are present.
    pub(super) tenant_entries: usize,
    pub(super) tenant_bytes: usize,
    /// Records younger than this are never evicted.
    pub(super) min_retention: Duration,
}

/// What one tenant holds.
#[derive(Default, Clone, Copy, Debug)]
pub(super) struct Usage {
    pub(super) entries: usize,
    pub(super) bytes: usize,
}

pub(super) const TENANT_SHARDS: usize = 16;

/// What each tenant holds, store-wide; and how many tenants hold something.
#[derive(Default)]
pub(super) struct Tenants {
    pub(super) shards: [Mutex<FastMap<TenantKey, Usage>>; TENANT_SHARDS],
    pub(super) present: AtomicUsize,
}

#[derive(Default)]
pub(super) struct Shard {
    /// The last token number handed out by this shard.
    pub(super) next: u64,
    pub(super) map: FastMap<ScopeKey, Entry>,
    /// Completed records' expiries, sorted by expiry (ties in the order they completed): the
    /// front expires first. A record removed before it expires (forgotten, evicted, replaced)
    /// leaves its element behind, skipped when it reaches the front and dropped when the queue
    /// is compacted (see [`Shard::push_expiry`]). With one TTL per layer, completions arrive in
    /// expiry order and each is a push at the back: a queue costs a fraction of a sorted map's
    /// memory and time per record.
    pub(super) expiry: VecDeque<(Instant, ScopeKey)>,
    /// The completed records held: the live elements of `expiry`.
    pub(super) records: usize,
    /// The boxes of claims that completed, reused by the next claims (at most
    /// [`SPARE_CLAIMS`]): a first execution then allocates no claim of its own.
    #[expect(
        clippy::vec_box,
        reason = "the boxes themselves are what is reused, moved into the map's entries"
    )]
    pub(super) spare: Vec<Box<Claim>>,
}

pub(super) enum Entry {
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
        /// The number of the token that completed it (its high half: unique in its shard, and a
        /// scope is always in the same shard): the same complete again is answered "completed",
        /// another token's is fenced.
        token: u64,
    },
}

/// A claim in flight.
pub(super) struct Claim {
    pub(super) tenant: TenantKey,
    pub(super) token: Token,
    pub(super) fingerprint: Fingerprint,
    pub(super) lease_until: Instant,
    /// Wakes the waiters when the claim ends (the entry is replaced or removed).
    pub(super) wake: Wake,
}

impl Entry {
    pub(super) fn size(&self) -> usize {
        match self {
            Entry::InFlight(_) => ENTRY_OVERHEAD,
            Entry::Completed { size, .. } => *size as usize,
        }
    }

    pub(super) fn tenant(&self) -> TenantKey {
        match self {
            Entry::InFlight(claim) => claim.tenant,
            Entry::Completed { tenant, .. } => *tenant,
        }
    }
}

/// The bytes a record costs in the store: its body, headers and trailers, the head its
/// replays send (made by the first: its headers again and the layer's markers, charged from
/// the start), plus the overhead.
pub(super) fn record_size(record: &Record) -> usize {
    let mark = |name: HeaderName| name.as_str().len() + "true".len() + HEADER_OVERHEAD;
    let marks = mark(IDEMPOTENT_REPLAYED)
        + if record.body_omitted {
            mark(IDEMPOTENT_BODY_OMITTED)
        } else {
            0
        };
    let headers = |h: &http::HeaderMap| {
        h.iter()
            .map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD)
            .sum::<usize>()
    };
    ENTRY_OVERHEAD
        + record.body.len()
        + 2 * headers(&record.headers)
        + marks
        + record.trailers.as_deref().map_or(0, headers)
}

/// The waiters of one claim: a [`Notify`] made by the first waiter, notified when the claim's
/// entry is dropped (replaced by its record, released, taken over or forgotten).
#[derive(Default)]
pub(super) struct Wake(pub(super) Option<Arc<Notify>>);

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
pub(super) fn live_record(
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
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why there was no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoRoom {
    /// The store is full.
    Store,
    /// The tenant holds its share, and other tenants are present.
    TenantShare,
}

impl Inner {
    /// Seconds since the store's origin, now.
    pub(super) fn secs(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.origin).as_secs()).unwrap_or(u32::MAX)
    }

    /// Charges `tenant` `entries` more entries and `bytes` more bytes if the tenant's share and
    /// the store's bounds allow it (the share is checked first: a tenant over it makes room
    /// from its own records only).
    pub(super) fn reserve(
        &self,
        tenant: TenantKey,
        entries: usize,
        bytes: usize,
    ) -> Result<(), NoRoom> {
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
    pub(super) fn force(&self, tenant: TenantKey, bytes: usize) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if tenant != TenantKey::default() {
            self.tenants.shard(tenant).entry(tenant).or_default().bytes += bytes;
        }
        self.watch_fill();
    }

    /// Gives back what an entry of `tenant` cost.
    pub(super) fn refund(&self, tenant: TenantKey, entries: usize, bytes: usize) {
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

    pub(super) fn over_percent(&self, percent: usize) -> bool {
        let limits = &self.limits;
        self.entries.load(Ordering::Relaxed) * 100 >= limits.entries * percent
            || self.bytes.load(Ordering::Relaxed) * 100 >= limits.bytes * percent
    }

    /// Warns (once each time) when the store passes 80 % of its entries or bytes.
    pub(super) fn watch_fill(&self) {
        if self.nearly_full.load(Ordering::Relaxed) || !self.over_percent(80) {
            return;
        }
        if !self.nearly_full.swap(true, Ordering::Relaxed) {
            self.nearly_full_times.fetch_add(1, Ordering::Relaxed);
            count_nearly_full();
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
    pub(super) fn log_eviction(&self, now: Instant, scope: &ScopeKey) {
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
    pub(super) fn shard(&self, tenant: TenantKey) -> MutexGuard<'_, FastMap<TenantKey, Usage>> {
        lock(&self.shards[(tenant.0 % TENANT_SHARDS as u64) as usize])
    }
}

/// The number a token of shard `shard` carries in its high half (see [`next_token`]); the
/// token of a record completed in that shard is `Token(number << 64 | shard)`.
pub(super) fn token_number(token: Token) -> u64 {
    (token.0 >> 64) as u64
}

/// Whether `token` is the one numbered `number` in shard `shard`.
pub(super) fn is_token(token: Token, number: u64, shard: usize) -> bool {
    token == Token((u128::from(number) << 64) | shard as u128)
}

/// A token unique in the store: the next number of the shard numbered `shard` (its last one is
/// `next`, taken under the shard's lock), tagged with the shard's index. A function of the one
/// field, so that a caller can make it while it holds a slot of the shard's map.
pub(super) fn next_token(next: &mut u64, shard: usize) -> Token {
    *next += 1;
    Token((u128::from(*next) << 64) | shard as u128)
}

/// Puts the record in the slot of the claim it completes (`None`, and nothing changed, if the
/// slot holds no claim); returns the claim's waiters, whose drop wakes them, and its box. The
/// caller keeps the books ([`Shard::completed`]).
pub(super) fn fill_claim_slot(
    slot: &mut Entry,
    record: Arc<Record>,
    expires: Instant,
    size: usize,
    completed: u32,
) -> Option<(Wake, Box<Claim>)> {
    let Entry::InFlight(claim) = slot else {
        return None;
    };
    let tenant = claim.tenant;
    let token = token_number(claim.token);
    let waiters = std::mem::take(&mut claim.wake);
    let completed = Entry::Completed {
        tenant,
        record,
        expires,
        size: u32::try_from(size).unwrap_or(u32::MAX),
        completed,
        token,
    };
    match std::mem::replace(slot, completed) {
        Entry::InFlight(claim) => Some((waiters, claim)),
        Entry::Completed { .. } => unreachable!("the slot held a claim"),
    }
}

impl Shard {
    /// Replaces the claim `scope` holds (checked by the caller, and charged the record's size
    /// by it) by its record, in its slot: one lookup, where a removal and an insertion would
    /// hash the scope twice more. The claim's box is kept for a next claim; returns its
    /// waiters, whose drop wakes them (`None`, and nothing changed, if `scope` holds no claim).
    pub(super) fn complete_claim(
        &mut self,
        scope: &ScopeKey,
        record: Arc<Record>,
        expires: Instant,
        size: usize,
        completed: u32,
    ) -> Option<Wake> {
        let slot = self.map.get_mut(scope)?;
        let (waiters, claim) = fill_claim_slot(slot, record, expires, size, completed)?;
        self.completed(claim, expires, *scope);
        Some(waiters)
    }

    /// Keeps the books of a claim whose slot now holds its record: the record counted, its
    /// expiry queued, the claim's box kept for a next claim.
    pub(super) fn completed(&mut self, claim: Box<Claim>, expires: Instant, scope: ScopeKey) {
        if self.spare.len() < SPARE_CLAIMS {
            self.spare.push(claim);
        }
        self.records += 1;
        self.push_expiry(expires, scope);
    }

    /// Removes what `scope` holds, refunding its tenant.
    pub(super) fn remove(&mut self, inner: &Inner, scope: &ScopeKey) -> Option<Entry> {
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
    pub(super) fn push_expiry(&mut self, expires: Instant, scope: ScopeKey) {
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
    pub(super) fn clean(&mut self, inner: &Inner, now: Instant, n: usize) {
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

    /// Makes room for `tenant`: removes this shard's expired records, if any; else a claim whose
    /// lease lapsed; else evicts one record before its TTL: the nearest expiry (the oldest, with one TTL) among the records
    /// older than the minimum retention, of `tenant` itself when it is over its share. False
    /// when there is none.
    pub(super) fn evict_one(
        &mut self,
        inner: &Inner,
        now: Instant,
        tenant: TenantKey,
        why: NoRoom,
    ) -> bool {
        let records = self.records;
        self.clean(inner, now, usize::MAX);
        if self.records < records {
            return true;
        }
        // A claim whose lease lapsed is nobody's any more (its leader crashed, or never learned
        // of it: a lost `begin` reply): it goes before any record (of `tenant` itself when it is
        // over its share). A scan of the shard's claims, on this rare path only.
        if self.map.len() > self.records {
            let lapsed = self.map.iter().find_map(|(scope, entry)| match entry {
                Entry::InFlight(c)
                    if c.lease_until <= now && (why == NoRoom::Store || c.tenant == tenant) =>
                {
                    Some(*scope)
                }
                _ => None,
            });
            if let Some(scope) = lapsed {
                // Dropping it wakes its waiters; its old leader is fenced, as after a takeover.
                self.remove(inner, &scope);
                return true;
            }
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
        count_evicted();
        inner.log_eviction(now, &scope);
        true
    }

    /// The claim `token` on `scope`, if it still holds.
    pub(super) fn holds(&mut self, scope: &ScopeKey, token: Token) -> bool {
        matches!(self.map.get(scope), Some(Entry::InFlight(c)) if c.token == token)
    }
}

/// `idempotency_layer_memory_store_nearly_full_total` (feature `metrics`).
fn count_nearly_full() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_layer_memory_store_nearly_full_total").increment(1);
}

/// `idempotency_layer_memory_store_evicted_total` (feature `metrics`).
fn count_evicted() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_layer_memory_store_evicted_total").increment(1);
}

//! The embedded store: sharded maps in this process, bounded as a whole.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{
    Backend, Begin, Fingerprint, Held, IdempotencyStore, Record, ScopeKey, ScopeKeys, StoreError,
    TenantKey, Token, FOREVER,
};

mod builder;
mod shard;

pub use self::builder::MemoryStoreBuilder;
use self::shard::*;

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
/// - **Keys of this process** ([`ScopeKeys::Process`]): the layer files each scope under a
///   keyed hash with a secret of this process, cheaper than the stable key a shared store needs.
///   To call the store's methods yourself, key a scope with
///   [`Scope::key_in`](crate::Scope::key_in); a store that wraps this one forwards
///   [`scope_keys`](IdempotencyStore::scope_keys).
/// - **Sharded**: entries are spread over shards by scope hash; each shard is a
///   `Mutex<HashMap>` held only for a few map operations, never across an `.await`.
/// - **TTL**: records expire after the layer's `ttl`, on [`tokio::time::Instant`] (so paused-time
///   tests work). An expired record is ignored at once and removed incrementally: every
///   operation on a shard removes up to a few expired records from the front of that shard's
///   expiry index, so no request scans the whole map; a store that needs room removes every
///   expired record of a shard before it evicts anything there.
/// - **Bounded in entries and in bytes, as a whole** (not per shard), and it counts what it
///   holds ([`stats`](MemoryStore::stats)): each entry costs its record's body, headers (twice:
///   as recorded, and in the head its replays send, with the replay's marker) and trailers,
///   plus a fixed [overhead](MemoryStore::ENTRY_OVERHEAD).
/// - **A minimum retention.** A record younger than
///   [`min_retention`](MemoryStoreBuilder::min_retention) (default 15 minutes: more than twice
///   the longest a default-policy client retries one call) is never dropped before its TTL. When the store is full, records
///   older than that make room, the oldest first (the nearest expiry of the shard of the new
///   claim, else of another shard), counted ([`MemoryStats::evicted`]) and logged (at `WARN` at
///   most once a minute); if there is none, `begin` answers
///   [`StoreError::Full`] and nothing is claimed: the layer answers 503 / UNAVAILABLE with
///   `Retry-After`, nothing executes, and the refusal is counted ([`MemoryStats::refused`]). A
///   record that does not fit when its claim completes (the handler has already run, so it must
///   be kept) is kept without its body, as for a response over the layer's
///   `max_record_bytes`: a retry gets the status and headers, never a second execution; counted
///   in [`MemoryStats::bodies_dropped`] and logged. Claims in flight are never evicted; a claim
///   whose lease lapsed (its leader crashed, or never learned of it) makes room before any
///   record does.
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
/// - **Sizing**: by default the store is bounded by its bytes (128 MiB; an entry costs its
///   record's body, headers twice and trailers plus 256 bytes), and a record is kept at least
///   15 minutes. A record of a 200-byte JSON response costs about 630 bytes, so the store holds
///   about 210 000 of them, and a service can write new keys at up to about 210 000 / 900 s =
///   230 a second, around the clock, without a refusal (a test writes 100 a second for 75 minutes on
///   the defaults: none refused). Past what it holds, the oldest records make room: a retry
///   within 15 minutes always gets its replay, one a day later may not. The arithmetic for
///   yours: new keys a second x the longest any of your clients retries (queues, jobs,
///   batches that resend hours later) x the cost of a record, at most `max_bytes`; set
///   [`min_retention`](MemoryStoreBuilder::min_retention) to that retry window, and
///   `max_bytes` to fit it. Or use a shared store to keep every record for its TTL. Watch
///   [`MemoryStats::refused`] (a refusal is a 503 your clients retry) and
///   [`MemoryStats::evicted`].
/// - **Eviction** of records younger than `min_retention` never happens: set it to zero to let
///   any record make room (its retry then runs again), or to `Duration::MAX` to never evict.
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
///     .build()
///     .expect("valid settings");
/// assert!(store.is_empty());
/// assert_eq!(store.stats().refused, 0);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// What a [`MemoryStore`] holds and what it refused, at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Entries held (claims and records, including expired records not yet removed).
    pub entries: usize,
    /// Bytes the entries cost (records' bodies, headers twice and trailers plus a fixed
    /// overhead each).
    pub bytes: usize,
    /// Tenants holding at least one entry.
    pub tenants: usize,
    /// Claims refused because the store (or the tenant's share of it) was full and no record
    /// was old enough to make room: each was a retryable 503 / UNAVAILABLE and nothing
    /// executed.
    pub refused: u64,
    /// Records evicted before their TTL to make room: older than
    /// [`min_retention`](MemoryStoreBuilder::min_retention).
    pub evicted: u64,
    /// Records kept without their body because it did not fit.
    pub bodies_dropped: u64,
    /// Times the store passed 80 % of its entries or bytes.
    pub nearly_full: u64,
    /// True once the store was given scope keys of both kinds: keys of this process (what a
    /// layer over the store computes, [`ScopeKeys::Process`]) and stable ones
    /// ([`Scope::key`](crate::Scope::key)). Two paths reach the store that key scopes
    /// differently (a store of your own that wraps this one and does not forward
    /// [`scope_keys`](IdempotencyStore::scope_keys), or a direct call with `Scope::key` where
    /// [`Scope::key_in`](crate::Scope::key_in) belongs), and one scope can then be claimed
    /// under two keys. Logged at `ERROR` when first seen.
    pub mixed_scope_keys: bool,
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

impl MemoryStore {
    /// The default entry bound: as many entries as the default byte bound can count (each
    /// entry costs at least [`ENTRY_OVERHEAD`](Self::ENTRY_OVERHEAD) bytes), 524 288: by
    /// default the store is bounded by its bytes.
    pub const DEFAULT_CAPACITY: usize = Self::DEFAULT_MAX_BYTES / ENTRY_OVERHEAD;
    /// The default byte bound: 128 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 128 << 20;
    /// The default number of shards.
    pub const DEFAULT_SHARDS: usize = 32;
    /// The default share of one tenant while others are present, in percent.
    pub const DEFAULT_TENANT_SHARE_PERCENT: u8 = 50;
    /// The default of [`min_retention`](MemoryStoreBuilder::min_retention): 15 minutes, more
    /// than twice the longest a client with `retry-layer`'s `RetryPolicy::default()` goes on
    /// resending one call: its third and last attempt is sent at most 6 minutes after the
    /// first (two attempts of at most 60 s for readiness and 60 s for their head, two waits of
    /// at most `max_pushback`, 30 s, then at most 60 s for readiness again).
    pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(15 * 60);
    /// The bytes each entry is counted for besides its record's body, headers (twice) and
    /// trailers.
    pub const ENTRY_OVERHEAD: usize = ENTRY_OVERHEAD;

    /// A store with the defaults.
    pub fn new() -> Self {
        MemoryStore::builder()
            .build()
            .expect("the defaults are valid")
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
            mixed_scope_keys: inner.scope_key_kinds.load(Ordering::Relaxed) == BOTH_KINDS,
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

/// A claim in a box, reusing `spare` (a completed claim's) when there is one.
fn new_claim(
    spare: Option<Box<Claim>>,
    tenant: TenantKey,
    token: Token,
    fingerprint: Fingerprint,
    now: Instant,
    lease: Duration,
) -> Box<Claim> {
    let claim = Claim {
        tenant,
        token,
        fingerprint,
        lease_until: now + lease.min(FOREVER),
        wake: Wake::default(),
    };
    match spare {
        Some(mut spare) => {
            *spare = claim;
            spare
        }
        None => Box::new(claim),
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
        use std::collections::hash_map::Entry as Slot;
        let now = Instant::now();
        let inner = &*self.inner;
        inner.note_key_kind(&scope);
        let (index, mut guard) = self.shard_at(&scope);
        guard.clean(inner, now, CLEANUP_PER_OP);
        let shard = &mut *guard;
        // One lookup on the way every claim and replay takes: the scope's slot, then the claim
        // made in it when there is room.
        match shard.map.entry(scope) {
            Slot::Occupied(slot) => match slot.get() {
                Entry::Completed {
                    record, expires, ..
                } if *expires > now => return Ok(Begin::Completed(record.clone())),
                Entry::InFlight(claim) if claim.lease_until > now => {
                    return Ok(Begin::InFlight {
                        token: claim.token,
                        fingerprint: claim.fingerprint,
                    })
                }
                // Expired record or lapsed lease: take the scope over (dropping the old entry
                // wakes its waiters; the old leader is fenced). The tenant's room for it is
                // freed with it; the claim is made below.
                _ => {
                    shard.remove(inner, &scope);
                }
            },
            Slot::Vacant(slot) => {
                if inner.reserve(tenant, 1, ENTRY_OVERHEAD).is_ok() {
                    let token = shard::next_token(&mut shard.next, index);
                    let claim = shard.spare.pop();
                    slot.insert(Entry::InFlight(new_claim(
                        claim,
                        tenant,
                        token,
                        fingerprint,
                        now,
                        lease,
                    )));
                    return Ok(Begin::New(token));
                }
            }
        }
        let mut shard = guard;
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
        let token = shard::next_token(&mut shard.next, index);
        let spare = shard.spare.pop();
        let claim = new_claim(spare, tenant, token, fingerprint, now, lease);
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
        let (index, mut shard) = self.shard_at(&scope);
        let expires = now + ttl.min(FOREVER);
        let completed = inner.secs(now);
        let Some(slot) = shard.map.get_mut(&scope) else {
            return Err(StoreError::Fenced);
        };
        let tenant = match slot {
            Entry::InFlight(claim) if claim.token == token => claim.tenant,
            // The same complete again (its caller retried it): done already, nothing changes.
            Entry::Completed {
                token: by, expires, ..
            } if shard::is_token(token, *by, index) && *expires > now => return Ok(()),
            _ => return Err(StoreError::Fenced),
        };
        // The usual way: room for the record at once, which takes the claim's slot (one
        // lookup). Dropping the claim's `Wake` wakes its waiters, who run once the shard is
        // unlocked.
        let size = record_size(&record);
        if inner.reserve(tenant, 0, size - ENTRY_OVERHEAD).is_ok() {
            let (waiters, claim) = fill_claim_slot(slot, record, expires, size, completed)
                .expect("the slot holds this claim");
            shard.completed(claim, expires, scope);
            drop(waiters);
            shard.clean(inner, now, CLEANUP_PER_OP);
            return Ok(());
        }
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
                Arc::make_mut(&mut record).omit_body();
            }
            size = record_size(&record);
            inner.force(tenant, size - ENTRY_OVERHEAD);
            break;
        }
        // Dropping the claim's `Wake` wakes its waiters (they run once the shard is unlocked).
        // The claim was checked above, under this lock, which only expired records' removal and
        // evictions (never a claim's) have released since.
        match shard.complete_claim(&scope, record, expires, size, completed) {
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

    async fn lookup(&self, scope: ScopeKey) -> Result<Option<Held>, StoreError> {
        let now = Instant::now();
        let shard = self.shard(&scope);
        Ok(match shard.map.get(&scope) {
            Some(Entry::InFlight(claim)) if claim.lease_until > now => Some(Held::InFlight {
                token: claim.token,
                fingerprint: claim.fingerprint,
            }),
            Some(Entry::Completed {
                record, expires, ..
            }) if *expires > now => Some(Held::Completed(record.clone())),
            _ => None,
        })
    }
    /// [`ScopeKeys::Process`]: the store lives and dies with its process, so no other process
    /// ever looks a key up, and a keyed SipHash under a secret of the process costs about a
    /// quarter of the stable BLAKE3 key.
    fn scope_keys(&self) -> ScopeKeys {
        ScopeKeys::Process
    }

    fn backend(&self) -> Backend {
        Backend::Memory
    }
}

#[cfg(test)]
mod tests;

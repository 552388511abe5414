//! The one seam between the layer and where records live: [`IdempotencyStore`].
//!
//! A store keeps one entry per scope (a hash of tenant + method + key, see
//! [`Scope`](crate::Scope)). An entry is either *in flight* (claimed by one leader, with a lease
//! and a fencing token) or *completed* (a [`Record`] with a time to live). The layer drives it:
//!
//! 1. [`begin`](IdempotencyStore::begin) atomically claims the scope ([`Begin::New`]), or reports
//!    the current claim ([`Begin::InFlight`]) or record ([`Begin::Completed`]).
//! 2. The leader runs the handler, renewing its lease with
//!    [`renew`](IdempotencyStore::renew) while it runs.
//! 3. The leader either [`complete`](IdempotencyStore::complete)s the claim with a record, or
//!    [`release`](IdempotencyStore::release)s it so a retry executes again. Both are fenced: a
//!    token that no longer holds the claim (the lease lapsed and another leader took over, or the
//!    key was forgotten) gets [`StoreError::Fenced`] and changes nothing.
//! 4. Duplicates that found the scope in flight call [`wait`](IdempotencyStore::wait), which
//!    resolves when that claim ends (or may end: a store may wake early), then `begin` again.
//!
//! The in-memory [`MemoryStore`] is the default; other stores (Redis, PostgreSQL) implement the
//! same trait and run the same [conformance suite](crate#choosing-a-store).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

mod any;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod codec;
pub(crate) mod hashing;
mod memory;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod near_cache;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod orphan;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod types;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod wake;

#[cfg(any(feature = "redis", feature = "postgres"))]
pub use self::near_cache::{NearCache, NearCacheStats};
#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresStore, PostgresStoreBuilder};

/// Encodes a [`Record`] as the shared stores (`RedisStore`, `PostgresStore`) write it:
/// a version byte and a postcard-encoded struct, which [`decode_record`] reads back.
///
/// For tools that inspect or repair store entries, and for other stores that want the same
/// format.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub fn encode_record(record: &Record) -> Result<Vec<u8>, StoreError> {
    codec::encode(record)
}

/// Decodes what [`encode_record`] wrote, in this version or another that shares its encoding
/// (later versions only append fields, which this one leaves). Any other input (truncated,
/// garbage, a later version that changed the encoding, an invalid status or header) is
/// [`StoreError::Corrupt`], never a panic; the shared stores report such an entry as corrupt and
/// the layer executes nothing for its key.
///
/// ```
/// use idempotency_layer::store::{decode_record, StoreError};
///
/// assert!(matches!(decode_record(b"\x01garbage"), Err(StoreError::Corrupt(_))));
/// ```
#[cfg(any(feature = "redis", feature = "postgres"))]
pub fn decode_record(bytes: &[u8]) -> Result<Record, StoreError> {
    codec::decode(bytes)
}
#[cfg(feature = "redis")]
pub use self::redis::{maxmemory_policy_can_evict, RedisStore, RedisStoreBuilder};

/// The longest duration the layer and the stores work with: 100 years, "keep forever". Every
/// duration setting (a TTL, a lease, a timeout) is clamped to it, so a setting of
/// `Duration::MAX` never overflows a clock or a store's arithmetic.
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How long a shared store keeps a claim whose lease lapsed with no takeover: the time a leader
/// that is late (a long GC pause, a slow handler whose renewals failed) still has to complete
/// and store its record. Until then a new `begin` takes the claim over (its lease lapsed), but
/// no cleanup removes it; the same on Redis (the key outlives its lease) and PostgreSQL (the
/// cleanup spares it).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const LATE_COMPLETE_GRACE: Duration = Duration::from_secs(3600);

/// Runs a store operation through a brief store outage: a backend failure is retried with
/// backoff (50 ms doubling to 1 s) for at most `within` (a claim's lease: after that the claim
/// may belong to someone else). Other outcomes (success, fenced, corrupt) return at once.
///
/// Used by a claim's final operation (a record lost to a 2-second outage would leave the key in
/// flight until its lease lapsed, and the client's retry would then execute the write again)
/// and by the release of an orphaned claim.
pub(crate) async fn retry_through_outage<F, Fut, T>(
    within: Duration,
    op_name: &'static str,
    mut op: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let give_up = tokio::time::Instant::now() + within;
    let mut delay = Duration::from_millis(50);
    loop {
        match op().await {
            Err(StoreError::Backend(e)) if tokio::time::Instant::now() + delay < give_up => {
                tracing::debug!(op = op_name, error = %e, retry_in_ms = delay.as_millis() as u64, "idempotency: store operation failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            r => return r,
        }
    }
}

#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) use self::orphan::OrphanGuard;
pub use self::types::{
    Backend, Begin, Fingerprint, Held, Record, ScopeKey, ScopeKeys, StoreError, TenantKey, Token,
};
pub use any::AnyStore;
pub use memory::{MemoryStats, MemoryStore, MemoryStoreBuilder};

/// A map keyed by scope keys, tenant keys or tokens: foldhash, seeded per map, instead of
/// SipHash. The keys are already uniform (BLAKE3 output, random tokens), so the strong but slow
/// default hasher bought nothing but ~250 instructions per lookup, several per request; the
/// per-map random seed still keeps an attacker who chooses idempotency keys from aiming at one
/// bucket.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Where claims and records live. See the [module docs](self) for the protocol.
///
/// Implementations are cheap to clone (a handle to shared state), and every method is atomic on
/// its own: `begin` in particular must never hand [`Begin::New`] to two callers for one scope
/// while the first claim's lease holds.
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// Claims `scope` for a request with `fingerprint`, with a lease of `lease`, or reports who
    /// holds it. An expired record or a lapsed lease counts as free.
    fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// [`begin`](Self::begin) for a scope of `tenant`: what the layer calls. A store that
    /// bounds what one tenant may hold ([`MemoryStore`]) charges the claim and its record to
    /// `tenant`, and may refuse it with [`StoreError::Full`] when the tenant's share is full.
    /// The default ignores the tenant and calls `begin`.
    fn begin_for_tenant(
        &self,
        tenant: TenantKey,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        let _ = tenant;
        self.begin(scope, fingerprint, lease)
    }

    /// Replaces the claim `token` with `record`, kept for `ttl`, and wakes the waiters.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim. Idempotent for its own
    /// token: called again after it succeeded (its reply was lost and the caller retried), it
    /// answers `Ok` and changes nothing.
    ///
    /// The record comes shared: the layer keeps it to call again through a brief store
    /// outage without copying it, and an in-process store keeps this very `Arc` (replays share
    /// it too); a store that needs its own copy makes one (`Arc::unwrap_or_clone`,
    /// `Arc::make_mut`).
    fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Removes the claim `token` so the next `begin` executes again, and wakes the waiters.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
    fn release(
        &self,
        scope: ScopeKey,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the lease of claim `token` to `lease` from now.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
    fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the leases of many claims at once, each `(scope, token, lease)` to its `lease`
    /// from now; one result per claim, in order ([`StoreError::Fenced`] for a claim its token
    /// no longer holds). The layer's renewal task calls this once per tick with every claim it
    /// holds.
    ///
    /// The default renews each claim with [`renew`](Self::renew), concurrently. A store with a
    /// connection pool should override it with one round trip (one statement, one script): a
    /// thousand renewals at once would otherwise queue for the pool's connections, and those
    /// still waiting when the store's timeout ends would fail, and their leases could lapse
    /// under live handlers.
    fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        futures_util::future::join_all(
            claims
                .iter()
                .map(|&(scope, token, lease)| self.renew(scope, token, lease)),
        )
    }

    /// Resolves when the claim `observed` on `scope` has ended (completed, released, forgotten,
    /// taken over) or its lease has lapsed; immediately if it already has. It may resolve early;
    /// the caller calls `begin` again either way. It must not resolve only after a claim ends
    /// when the claim already ended before the call (no lost wake-ups).
    fn wait(
        &self,
        scope: ScopeKey,
        observed: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Removes whatever `scope` holds (record or claim); true if there was something. A claim
    /// that is forgotten is fenced: its leader's `complete` is refused.
    fn forget(&self, scope: ScopeKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// What `scope` holds now, claiming nothing: a claim in flight, a record, or `None` (free,
    /// or its lease or TTL is over). For operators and tools (what did this key answer, is it
    /// running?); the layer itself never calls it. The default answers
    /// [`StoreError::Config`]: a store of your own that does not implement it.
    fn lookup(
        &self,
        scope: ScopeKey,
    ) -> impl Future<Output = Result<Option<Held>, StoreError>> + Send {
        let _ = scope;
        std::future::ready(Err(StoreError::Config(
            "this store does not implement lookup".into(),
        )))
    }

    /// Which key this store files each scope under, and so which key the layer computes for
    /// each write: [`ScopeKeys::Stable`] (the default, [`Scope::key`](crate::Scope::key)) for a
    /// store that other processes share or that outlives its process; [`ScopeKeys::Process`]
    /// (cheaper, known only to this process) for one that lives and dies with it, as
    /// [`MemoryStore`] does. [`Scope::key_in`](crate::Scope::key_in) gives the key this store
    /// answers for, to call its methods yourself.
    ///
    /// A store that wraps another forwards this: every path to one store must compute the same
    /// key for one scope, or one scope could be claimed under two keys. (A `MemoryStore`
    /// reached both ways says so: [`MemoryStats::mixed_scope_keys`], and an `ERROR` log.)
    fn scope_keys(&self) -> ScopeKeys {
        ScopeKeys::Stable
    }

    /// Which kind of store this is: the `store` label of the layer's metrics. The default is
    /// [`Backend::Custom`].
    ///
    /// A store that wraps another (to add metrics, tracing or faults) returns the wrapped
    /// store's, as it forwards `postgres` (feature `postgres`).
    fn backend(&self) -> Backend {
        Backend::Custom
    }

    /// The [`PostgresStore`] this store is, or wraps (feature `postgres`). The default is
    /// `None`.
    ///
    /// When it is `Some`, the layer hands the handler of each request that holds a claim a
    /// [`TxCompletion`](crate::TxCompletion), to record its response in its own transaction on
    /// that database. A store that wraps a `PostgresStore` (to add metrics, say) forwards this,
    /// or its handlers silently lose transactional completion:
    ///
    /// ```
    /// # use idempotency_layer::store::{Begin, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, Token};
    /// # use idempotency_layer::PostgresStore;
    /// # use std::{sync::Arc, time::Duration};
    /// #[derive(Clone)]
    /// struct Counted(PostgresStore);
    /// # let _ = |store: PostgresStore| Counted(store);
    ///
    /// impl IdempotencyStore for Counted {
    ///     fn postgres(&self) -> Option<&PostgresStore> {
    ///         Some(&self.0)
    ///     }
    ///     fn backend(&self) -> idempotency_layer::store::Backend {
    ///         self.0.backend()
    ///     }
    ///     // ... and every operation forwarded to `self.0`, counted:
    /// #   async fn begin(&self, s: ScopeKey, f: Fingerprint, l: Duration) -> Result<Begin, StoreError> { self.0.begin(s, f, l).await }
    /// #   async fn complete(&self, s: ScopeKey, t: Token, r: Arc<Record>, ttl: Duration) -> Result<(), StoreError> { self.0.complete(s, t, r, ttl).await }
    /// #   async fn release(&self, s: ScopeKey, t: Token) -> Result<(), StoreError> { self.0.release(s, t).await }
    /// #   async fn renew(&self, s: ScopeKey, t: Token, l: Duration) -> Result<(), StoreError> { self.0.renew(s, t, l).await }
    /// #   async fn wait(&self, s: ScopeKey, t: Token) -> Result<(), StoreError> { self.0.wait(s, t).await }
    /// #   async fn forget(&self, s: ScopeKey) -> Result<bool, StoreError> { self.0.forget(s).await }
    /// }
    /// ```
    #[cfg(feature = "postgres")]
    fn postgres(&self) -> Option<&PostgresStore> {
        None
    }
}

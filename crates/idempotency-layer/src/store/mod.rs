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

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

mod any;
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) mod codec;
pub(crate) mod hashing;
mod memory;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod near_cache;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
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

/// Decodes what [`encode_record`] wrote. Any other input (truncated, garbage, another encoding
/// version, an invalid status or header) is [`StoreError::Corrupt`], never a panic; the shared
/// stores report such an entry as corrupt and the layer executes nothing for its key.
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

/// The most orphan releases ([`OrphanGuard`]) running at once in this process. During an
/// outage at R requests/s there would otherwise be about R x lease of them, all hitting the
/// recovering store; past the bound an orphan is left to lapse with its lease (logged).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) const MAX_ORPHAN_RELEASES: usize = 1024;

#[cfg(any(feature = "redis", feature = "postgres"))]
type Limiter = &'static std::sync::atomic::AtomicUsize;

/// The orphan releases running in this process, bounded by [`MAX_ORPHAN_RELEASES`].
#[cfg(any(feature = "redis", feature = "postgres"))]
static ORPHAN_RELEASES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Guards a shared store's `begin` whose claim may be written without anyone knowing it.
///
/// The claim is written by the server with a token this process chose; if the reply is lost
/// (the connection dropped or timed out after the server ran the command) or the request that
/// sent it was dropped (its client went away) before the reply, nobody knows they hold that
/// claim, and it would block its key for a whole lease (30 s by default) while every retry
/// waited for it. Armed, the guard releases it in the background when dropped, fenced by its
/// token (so it removes nothing but that orphan), through a brief outage, for at most one
/// lease. If that finds nothing to release, the claim may still be on its way (a statement the
/// server had not run yet, a command queued on a connection): the guard releases once more
/// when it can no longer arrive (`settle` after its sender gave up). [`disarm`](Self::disarm)
/// it once the claim's fate is known: a reply arrived, or the error proves the command was
/// never sent (no connection, pool exhausted).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) struct OrphanGuard<St: IdempotencyStore> {
    armed: Option<Orphan<St>>,
    running: Limiter,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
struct Orphan<St> {
    store: St,
    scope: ScopeKey,
    token: Token,
    lease: Duration,
    settle: Duration,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl<St: IdempotencyStore> OrphanGuard<St> {
    /// `settle`: how long after its sender gave up the claim may still be written (the server
    /// may not have run it yet); past it, it was written or never will be.
    pub(crate) fn new(
        store: &St,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
        settle: Duration,
    ) -> Self {
        OrphanGuard {
            armed: Some(Orphan {
                store: store.clone(),
                scope,
                token,
                lease,
                settle,
            }),
            running: &ORPHAN_RELEASES,
        }
    }

    /// Counts its release in `running` instead of the process's count (tests).
    #[cfg(test)]
    fn counted_in(mut self, running: Limiter) -> Self {
        self.running = running;
        self
    }

    /// The claim's fate is known: nothing to release.
    pub(crate) fn disarm(mut self) {
        self.armed = None;
    }
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl<St: IdempotencyStore> Drop for OrphanGuard<St> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;

        let Some(Orphan {
            store,
            scope,
            token,
            lease,
            settle,
        }) = self.armed.take()
        else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let count = self.running;
        if count.fetch_add(1, Ordering::Relaxed) >= MAX_ORPHAN_RELEASES {
            count.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(
                ?scope,
                "idempotency: too many orphaned claims being released; this one lapses with its lease"
            );
            return;
        }
        /// Counts the release as running until its task ends (or is dropped with its runtime).
        struct Running(Limiter);
        impl Drop for Running {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let running = Running(count);
        runtime.spawn(async move {
            let _running = running;
            let started = tokio::time::Instant::now();
            let first =
                retry_through_outage(lease, "release orphan", || store.release(scope, token)).await;
            // Fenced: nothing held the token yet; once `settle` has passed since its sender gave
            // up, the claim has landed or never will: release once more. (Released, or out of
            // time: done.)
            if let Err(StoreError::Fenced) = first {
                tokio::time::sleep_until(started + settle).await;
                let left = lease.saturating_sub(started.elapsed());
                let _ = retry_through_outage(left, "release orphan (second)", || {
                    store.release(scope, token)
                })
                .await;
            }
        });
    }
}
pub use any::AnyStore;
pub use memory::{MemoryStats, MemoryStore, MemoryStoreBuilder};

/// The boxed error a store wraps from its backend (the workspace's one boxed error).
pub use reason_code::BoxError;

/// A map keyed by scope keys, tenant keys or tokens: foldhash, seeded per map, instead of
/// SipHash. The keys are already uniform (BLAKE3 output, random tokens), so the strong but slow
/// default hasher bought nothing but ~250 instructions per lookup, several per request; the
/// per-map random seed still keeps an attacker who chooses idempotency keys from aiming at one
/// bucket.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The hash of a scope (tenant + method + key), the only identifier a store sees.
///
/// Made with [`Scope::key`](crate::Scope::key): a BLAKE3 hash of an unambiguous, length-prefixed
/// encoding, so no raw tenant or key reaches the store.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ScopeKey(pub [u8; 32]);

/// Hashes the key's first 8 bytes as one `u64`: the key is BLAKE3 output, uniform already, so
/// the other 24 add nothing a hash table can use, and a seeded hasher (the stores' maps use
/// foldhash with a random seed per map) mixes one word far faster than 32 bytes. Equal keys
/// hash equally, as `Hash` requires.
impl std::hash::Hash for ScopeKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let (word, _) = self.0.split_first_chunk::<8>().expect("32 bytes");
        state.write_u64(u64::from_le_bytes(*word));
    }
}

/// The hash of a tenant alone: what a store needs to keep each tenant to its share (see
/// [`IdempotencyStore::begin_for_tenant`]) without learning who the tenant is.
///
/// Equal for every scope of one tenant and, short of a 64-bit collision, different between
/// tenants. [`TenantKey::default`] is "no tenant known" (a direct [`IdempotencyStore::begin`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct TenantKey(pub u64);

impl TenantKey {
    /// The key of `tenant` (the tenant a [`Scope`](crate::Scope) is made with).
    pub fn of(tenant: &str) -> TenantKey {
        let mut h = blake3::Hasher::new();
        h.update(b"idempotency-layer tenant v1\0");
        h.update(tenant.as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&h.finalize().as_bytes()[..8]);
        TenantKey(u64::from_le_bytes(b))
    }
}

impl ScopeKey {
    /// The key as lowercase hex, 64 characters (for stores that need a string key).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({})", &self.to_hex()[..16])
    }
}

/// The hash of what a request asks for: method, path, query, content type and body.
///
/// The same scope with another fingerprint is a different request reusing a key, and is refused.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The layer's own fingerprint of a request: its method, path, query, content type and
    /// `body`, each length-prefixed, hashed with BLAKE3 (a stable encoding: stored records are
    /// checked against it across versions). A
    /// [`fingerprint_fn`](crate::IdempotencyLayer::fingerprint_fn) of your own can call it with
    /// a canonical form of the body.
    pub fn of_request(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
        hashing::fingerprint(parts, body)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &hex(&self.0)[..16])
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A fencing token: names one claim of one scope. Made by the store; unique per store (a shared
/// store must make tokens unique across instances, e.g. random 128-bit values).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Token(pub u128);

/// A recorded response: everything needed to replay it byte for byte.
///
/// Made by the layer when a response is recorded; a store keeps it and hands it back. Build one
/// with [`Record::new`] (stores that decode their own format, tests); read it with the accessors.
///
/// ```
/// use bytes::Bytes;
/// use http::{HeaderMap, StatusCode};
/// use idempotency_layer::store::{Fingerprint, Record};
///
/// let mut trailers = HeaderMap::new();
/// trailers.insert("grpc-status", "0".parse().unwrap());
/// let record = Record::new(Fingerprint([7; 32]), StatusCode::OK, HeaderMap::new(), Bytes::from("hi"))
///     .with_trailers(trailers);
/// assert_eq!(record.body(), "hi");
/// assert_eq!(record.trailers().unwrap()["grpc-status"], "0");
/// assert!(!record.body_omitted());
/// assert!(record.clone().with_body_omitted().body().is_empty());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) body_omitted: bool,
    /// Boxed: trailers are rare (gRPC's status), and every record in memory would otherwise
    /// carry a whole `HeaderMap` for them.
    pub(crate) trailers: Option<Box<HeaderMap>>,
}

impl Record {
    /// A record of a response with this status, headers and whole body, made by a request with
    /// this fingerprint; no trailers.
    pub fn new(
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    ) -> Self {
        Record {
            fingerprint,
            status,
            headers,
            body,
            body_omitted: false,
            trailers: None,
        }
    }

    /// The same record with these trailers (a gRPC response's status lives there).
    pub fn with_trailers(mut self, trailers: HeaderMap) -> Self {
        self.trailers = Some(Box::new(trailers));
        self
    }

    /// The same record without its body, marked as omitted: its replays carry status, headers
    /// and trailers only, and say so (for a body larger than the layer's `max_record_bytes`, or
    /// one a store could not keep).
    pub fn with_body_omitted(mut self) -> Self {
        self.body = Bytes::new();
        self.body_omitted = true;
        self
    }

    /// The fingerprint of the request that produced it.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers, in order, repeated names kept.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The response body (empty when [`body_omitted`](Self::body_omitted)).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// True when the body was not kept (too large); the replay says so.
    pub fn body_omitted(&self) -> bool {
        self.body_omitted
    }

    /// The trailers, if the response had any.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_deref()
    }
}

/// What [`IdempotencyStore::begin`] found.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Begin {
    /// The scope was free (or its record had expired, or its lease had lapsed): the caller now
    /// holds the claim with this token and must complete or release it.
    New(Token),
    /// Another request holds the scope.
    InFlight {
        /// The token of the claim in flight; pass it to [`IdempotencyStore::wait`].
        token: Token,
        /// The fingerprint of the request in flight.
        fingerprint: Fingerprint,
    },
    /// The scope has a record that has not expired.
    Completed(Arc<Record>),
}

/// The one error type of every store.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The token no longer holds the claim (lease lapsed and taken over, key forgotten, or the
    /// claim already ended). Nothing was changed.
    Fenced,
    /// The store has no room for a new claim (it is full, or the tenant's share of it is).
    /// Nothing was claimed and nothing executes: the layer answers 503 / UNAVAILABLE with
    /// `Retry-After`, which clients retry.
    Full,
    /// The backend failed or is unreachable.
    Backend(BoxError),
    /// An entry could not be decoded.
    Corrupt(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Fenced => f.write_str("the fencing token no longer holds the claim"),
            StoreError::Full => f.write_str(
                "the idempotency store has no room for a new claim (it is full, or this \
                 tenant's share of it is); nothing was executed: retry later, or raise the \
                 store's bounds",
            ),
            StoreError::Backend(e) => write!(f, "idempotency store backend failed: {e}"),
            StoreError::Corrupt(what) => write!(f, "idempotency store entry is corrupt: {what}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Backend(e) => Some(&**e),
            _ => None,
        }
    }
}

/// Which kind of store a layer uses: the `store` label of its metrics
/// ([`IdempotencyStore::backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// [`MemoryStore`].
    Memory,
    /// `RedisStore` (feature `redis`).
    Redis,
    /// `PostgresStore` (feature `postgres`).
    Postgres,
    /// Any other store.
    Custom,
}

impl Backend {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) const ALL: [Backend; 4] = [
        Backend::Memory,
        Backend::Redis,
        Backend::Postgres,
        Backend::Custom,
    ];

    /// The label value: `memory`, `redis`, `postgres` or `custom`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
            Backend::Custom => "custom",
        }
    }
}

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
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
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

    /// Which kind of store this is: the `store` label of the layer's metrics. The default is
    /// [`Backend::Custom`].
    ///
    /// A store that wraps another (to add metrics, tracing or faults) returns the wrapped
    /// store's, as it forwards [`postgres`](Self::postgres).
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

#[cfg(all(test, any(feature = "redis", feature = "postgres")))]
mod orphan_tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A store whose `release` never answers (a store that went away), counting the calls.
    #[derive(Clone, Default)]
    struct Unanswering(Arc<AtomicUsize>);

    impl IdempotencyStore for Unanswering {
        async fn begin(
            &self,
            _: ScopeKey,
            _: Fingerprint,
            _: Duration,
        ) -> Result<Begin, StoreError> {
            std::future::pending().await
        }
        async fn complete(
            &self,
            _: ScopeKey,
            _: Token,
            _: Arc<Record>,
            _: Duration,
        ) -> Result<(), StoreError> {
            std::future::pending().await
        }
        async fn release(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        }
        async fn renew(&self, _: ScopeKey, _: Token, _: Duration) -> Result<(), StoreError> {
            std::future::pending().await
        }
        async fn wait(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            std::future::pending().await
        }
        async fn forget(&self, _: ScopeKey) -> Result<bool, StoreError> {
            std::future::pending().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn orphan_releases_are_bounded_and_a_disarmed_guard_releases_nothing() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let store = Unanswering::default();
        let lease = Duration::from_secs(30);
        let guard = |scope, i| {
            OrphanGuard::new(&store, ScopeKey([scope; 32]), Token(i), lease, lease)
                .counted_in(&RUNNING)
        };
        for i in 0..10u128 {
            guard(1, i).disarm();
        }
        for i in 0..(MAX_ORPHAN_RELEASES as u128 * 3) {
            drop(guard(2, i));
        }
        // Let every spawned release start (bounded: a few yields per task at most).
        for _ in 0..10_000 {
            if store.0.load(Ordering::SeqCst) >= MAX_ORPHAN_RELEASES {
                break;
            }
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            store.0.load(Ordering::SeqCst),
            MAX_ORPHAN_RELEASES,
            "only the bound's worth of releases run; disarmed guards release nothing"
        );
        assert_eq!(RUNNING.load(Ordering::Relaxed), MAX_ORPHAN_RELEASES);
    }

    /// A store whose claim lands late: `release` finds nothing (fenced) until `landed`, then
    /// releases it. Counts the calls and the releases.
    #[derive(Clone, Default)]
    struct LateClaim {
        landed: Arc<std::sync::atomic::AtomicBool>,
        calls: Arc<AtomicUsize>,
        released: Arc<AtomicUsize>,
    }

    impl IdempotencyStore for LateClaim {
        async fn begin(
            &self,
            _: ScopeKey,
            _: Fingerprint,
            _: Duration,
        ) -> Result<Begin, StoreError> {
            unreachable!()
        }
        async fn complete(
            &self,
            _: ScopeKey,
            _: Token,
            _: Arc<Record>,
            _: Duration,
        ) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn release(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.landed.load(Ordering::SeqCst) {
                self.released.fetch_add(1, Ordering::SeqCst);
                Ok(())
            } else {
                Err(StoreError::Fenced)
            }
        }
        async fn renew(&self, _: ScopeKey, _: Token, _: Duration) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn wait(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn forget(&self, _: ScopeKey) -> Result<bool, StoreError> {
            unreachable!()
        }
    }

    /// The first release finds nothing (the claim has not landed); the claim lands; the second
    /// release, `settle` after the guard fired, removes it. A release that removed the claim the
    /// first time is not repeated.
    #[tokio::test(start_paused = true)]
    async fn an_orphan_that_lands_after_the_first_release_is_released_by_the_second() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let store = LateClaim::default();
        let (lease, settle) = (Duration::from_secs(30), Duration::from_secs(2));
        drop(
            OrphanGuard::new(&store, ScopeKey([3; 32]), Token(1), lease, settle)
                .counted_in(&RUNNING),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "the first release ran"
        );
        store.landed.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(store.calls.load(Ordering::SeqCst), 1, "not before `settle`");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            store.released.load(Ordering::SeqCst),
            1,
            "the second release removed it"
        );
        assert_eq!(RUNNING.load(Ordering::SeqCst), 0, "and the release ended");

        drop(
            OrphanGuard::new(&store, ScopeKey([4; 32]), Token(2), lease, settle)
                .counted_in(&RUNNING),
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            3,
            "released at once: no second try"
        );
    }
}

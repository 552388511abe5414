//! The near cache of a shared store: completed records kept in this instance's memory, in front
//! of Redis or PostgreSQL, so that a replay of a recently replayed key costs no round trip.
//!
//! A completed record is immutable until it expires or is forgotten, which is what makes it
//! cacheable. The rules, each one a test in the stores' suites:
//!
//! - **Only replays fill it.** A record enters the cache when a `begin` on the shared store
//!   found it completed, never from this instance's own `complete` (a record completed inside a
//!   database transaction may still roll back). Claims always go to the shared store.
//! - **Never past the record's TTL.** The store reports the record's remaining time to live with
//!   the record; the entry expires at `sent + remaining`, where `sent` is when the `begin` was
//!   sent, so it expires no later than the record itself (clock skew between hosts does not
//!   matter: only the server's clock measures the remaining time). A `max_age` bounds it too.
//! - **Dropped on `forget`, on every instance.** `forget` publishes the scope on the store's
//!   invalidation channel (Redis pub/sub, PostgreSQL `NOTIFY`); every instance with a near cache
//!   listens and drops it. An instance serves from its cache only while it is subscribed: when
//!   the subscription is lost (the listening connection dropped), the cache is emptied and stays
//!   off until the subscription is back. A `begin` that was in flight while any invalidation
//!   arrived does not fill the cache (a generation counter), so a record forgotten while its
//!   read was on the wire is never cached.
//! - **Bounded in bytes**, with S3-FIFO eviction ([`quick_cache`]).
//!
//! What it cannot promise: a `forget` on one instance reaches the others' caches after the
//! invalidation's delivery time (sub-millisecond on one network), not at once: a request on
//! another instance in that window may still be answered with the forgotten record. And only
//! instances of this version announce their forgets: during a rolling upgrade from an older
//! version, turn the near cache on once every instance runs this one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Record, ScopeKey};

/// The configuration of a shared store's near cache: how many bytes of records it may keep and
/// for how long at most. Off unless given to the store's builder (`RedisStoreBuilder::near_cache`,
/// `PostgresStoreBuilder::near_cache`).
///
/// ```
/// use idempotency_layer::store::NearCache;
/// use std::time::Duration;
///
/// let near = NearCache::new(64 << 20).max_age(Duration::from_secs(30));
/// assert_eq!(near.max_bytes(), 64 << 20);
/// assert_eq!(near.max_age_limit(), Duration::from_secs(30));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NearCache {
    max_bytes: usize,
    max_age: Duration,
}

impl NearCache {
    /// Keeps up to `max_bytes` of records (their bodies, headers and ~100 bytes of bookkeeping
    /// each), each for at most 60 s and never past its TTL in the shared store.
    pub fn new(max_bytes: usize) -> Self {
        NearCache {
            max_bytes,
            max_age: Duration::from_secs(60),
        }
    }

    /// The longest a record stays cached (default 60 s), whatever its TTL: a bound on how
    /// stale an entry could be if an invalidation were ever lost without the subscription
    /// dropping (which a healthy connection does not do).
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// The bound in bytes.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The longest a record stays cached.
    pub fn max_age_limit(&self) -> Duration {
        self.max_age
    }
}

/// What a near cache did since its store was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NearCacheStats {
    /// `begin`s answered from the cache (no round trip).
    pub hits: u64,
    /// `begin`s that went to the shared store.
    pub misses: u64,
    /// Scopes dropped because they were forgotten (here or on another instance).
    pub invalidations: u64,
    /// Times the whole cache was emptied because its invalidation subscription was lost.
    pub resets: u64,
    /// Records held now.
    pub entries: usize,
    /// Their weight in bytes now.
    pub bytes: u64,
}

#[derive(Clone)]
struct Entry {
    record: Arc<Record>,
    expires: Instant,
}

/// Weighs an entry by what it holds on the heap, plus fixed bookkeeping.
#[derive(Clone, Copy)]
struct Weight;

/// The bytes an entry costs beyond its body and headers: the `Record` itself, the `Arc`, the
/// cache's slot and the key.
const ENTRY_OVERHEAD: u64 = 160;

impl quick_cache::Weighter<ScopeKey, Entry> for Weight {
    fn weight(&self, _: &ScopeKey, e: &Entry) -> u64 {
        let r = &e.record;
        let headers: usize = r
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 32)
            .sum();
        let trailers: usize = r.trailers.as_ref().map_or(0, |t| {
            t.iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 32)
                .sum::<usize>()
                + 96
        });
        // Headers twice: as recorded, and in the head its replays send (made by the first).
        ENTRY_OVERHEAD + (r.body.len() + 2 * headers + trailers) as u64
    }
}

/// A generation of the cache, read before a `begin` is sent: a record read by that `begin` is
/// cached only if no invalidation (and no loss of the subscription) happened since.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    generation: u64,
    sent: Instant,
}

/// The cache itself, shared by the store's clones and its listening task.
pub(crate) struct Near {
    config: NearCache,
    cache: quick_cache::sync::Cache<ScopeKey, Entry, Weight>,
    /// Bumped by every invalidation and every loss or gain of the subscription.
    generation: AtomicU64,
    /// True while the invalidation subscription is known to be up.
    live: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    invalidations: AtomicU64,
    resets: AtomicU64,
}

impl Near {
    pub(crate) fn new(config: NearCache) -> Arc<Near> {
        // quick_cache sizes its table from the expected item count: assume ~1 KiB records.
        let items = (config.max_bytes / 1024).clamp(16, 1 << 20);
        Arc::new(Near {
            config,
            cache: quick_cache::sync::Cache::with_weighter(items, config.max_bytes as u64, Weight),
            generation: AtomicU64::new(0),
            live: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            invalidations: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        })
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn config(&self) -> NearCache {
        self.config
    }

    /// The record cached for `scope`, if the cache is live and it has not expired.
    pub(crate) fn get(&self, scope: &ScopeKey) -> Option<Arc<Record>> {
        if self.live.load(Ordering::Acquire) {
            if let Some(e) = self.cache.get(scope) {
                if e.expires > Instant::now() {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Some(e.record);
                }
                self.cache.remove(scope);
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// What a store's `begin` asks first: the cached record of `scope` (`Ok`: answer with it,
    /// no round trip), or the ticket to send the `begin` with (`Err`: a miss).
    pub(crate) fn lookup(&self, scope: &ScopeKey) -> Result<Arc<Record>, Ticket> {
        self.get(scope).ok_or_else(|| self.ticket())
    }

    /// Taken just before a `begin` is sent to the shared store.
    pub(crate) fn ticket(&self) -> Ticket {
        Ticket {
            generation: self.generation.load(Ordering::SeqCst),
            sent: Instant::now(),
        }
    }

    /// Caches `record`, which the `begin` of `ticket` found completed with `ttl_left` to live
    /// in the shared store, unless an invalidation happened since the ticket (or the cache is
    /// not live).
    pub(crate) fn offer(
        &self,
        ticket: Ticket,
        scope: ScopeKey,
        record: &Arc<Record>,
        ttl_left: Duration,
    ) {
        let still = || {
            self.live.load(Ordering::SeqCst)
                && self.generation.load(Ordering::SeqCst) == ticket.generation
        };
        let life = ttl_left.min(self.config.max_age);
        if life.is_zero() || !still() {
            return;
        }
        self.cache.insert(
            scope,
            Entry {
                record: record.clone(),
                expires: ticket.sent + life,
            },
        );
        // An invalidation between the check above and the insert bumped the generation before
        // removing the scope; if that removal ran before the insert, undo the insert here.
        if !still() {
            self.cache.remove(&scope);
        }
    }

    /// Drops `scope` (forgotten here or on another instance).
    pub(crate) fn invalidate(&self, scope: &ScopeKey) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.cache.remove(scope);
        self.invalidations.fetch_add(1, Ordering::Relaxed);
    }

    /// The invalidation subscription is up (`true`) or was lost (`false`: everything cached is
    /// dropped, since invalidations may have been missed, and nothing is served until it is up).
    pub(crate) fn set_live(&self, live: bool) {
        let was = self.live.swap(live, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        if !live {
            self.cache.clear();
            if was {
                self.resets.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// True while the subscription is up.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    pub(crate) fn stats(&self) -> NearCacheStats {
        NearCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            invalidations: self.invalidations.load(Ordering::Relaxed),
            resets: self.resets.load(Ordering::Relaxed),
            entries: self.cache.len(),
            bytes: self.cache.weight(),
        }
    }
}

/// The scope a 64-character hex string (an invalidation's payload) names.
pub(crate) fn scope_from_hex(hex: &str) -> Option<ScopeKey> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(ScopeKey(out))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::store::Fingerprint;

    fn record(body: &'static str) -> Arc<Record> {
        Arc::new(Record::new(
            Fingerprint([1; 32]),
            StatusCode::CREATED,
            HeaderMap::new(),
            Bytes::from_static(body.as_bytes()),
        ))
    }

    fn live(config: NearCache) -> Arc<Near> {
        let near = Near::new(config);
        near.set_live(true);
        near
    }

    const S: ScopeKey = ScopeKey([7; 32]);

    #[tokio::test(start_paused = true)]
    async fn an_offered_record_is_served_until_its_ttl_left_and_no_longer() {
        let near = live(NearCache::new(1 << 20));
        let t = near.ticket();
        tokio::time::advance(Duration::from_secs(1)).await;
        near.offer(t, S, &record("a"), Duration::from_secs(5));
        assert_eq!(near.get(&S).unwrap().body(), "a");
        // The entry's life counts from when the begin was sent, not from when it answered.
        tokio::time::advance(Duration::from_millis(3_999)).await;
        assert!(near.get(&S).is_some());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(near.get(&S).is_none());
        let stats = near.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (2, 1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn max_age_bounds_a_long_ttl() {
        let near = live(NearCache::new(1 << 20).max_age(Duration::from_secs(2)));
        near.offer(near.ticket(), S, &record("a"), Duration::from_secs(3600));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(near.get(&S).is_none());
    }

    #[test]
    fn an_invalidation_after_the_ticket_keeps_the_record_out() {
        let near = live(NearCache::new(1 << 20));
        let t = near.ticket();
        near.invalidate(&S);
        near.offer(t, S, &record("stale"), Duration::from_secs(60));
        assert!(near.get(&S).is_none());
        // A begin sent after the invalidation may cache.
        near.offer(near.ticket(), S, &record("fresh"), Duration::from_secs(60));
        assert_eq!(near.get(&S).unwrap().body(), "fresh");
        near.invalidate(&S);
        assert!(near.get(&S).is_none());
        assert_eq!(near.stats().invalidations, 2);
    }

    #[test]
    fn a_lost_subscription_empties_the_cache_and_turns_it_off_until_it_is_back() {
        let near = live(NearCache::new(1 << 20));
        near.offer(near.ticket(), S, &record("a"), Duration::from_secs(60));
        let in_flight = near.ticket();
        near.set_live(false);
        assert!(!near.is_live());
        assert!(near.get(&S).is_none());
        near.offer(near.ticket(), S, &record("a"), Duration::from_secs(60));
        assert!(near.get(&S).is_none(), "nothing is cached while off");
        near.set_live(true);
        // A begin sent before the subscription came back may have missed an invalidation.
        near.offer(in_flight, S, &record("a"), Duration::from_secs(60));
        assert!(near.get(&S).is_none());
        near.offer(near.ticket(), S, &record("b"), Duration::from_secs(60));
        assert_eq!(near.get(&S).unwrap().body(), "b");
        assert_eq!(near.stats().resets, 1);
    }

    #[test]
    fn it_stays_within_its_bytes() {
        let near = live(NearCache::new(64 * 1024));
        let body: &'static str = Box::leak("x".repeat(1000).into_boxed_str());
        for i in 0..1000u32 {
            let mut s = [0u8; 32];
            s[..4].copy_from_slice(&i.to_le_bytes());
            near.offer(
                near.ticket(),
                ScopeKey(s),
                &record(body),
                Duration::from_secs(60),
            );
        }
        let stats = near.stats();
        assert!(stats.bytes <= 64 * 1024, "{stats:?}");
        assert!(stats.entries > 10 && stats.entries < 100, "{stats:?}");
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let s = ScopeKey(core::array::from_fn(|i| i as u8 * 7));
        assert_eq!(scope_from_hex(&s.to_hex()), Some(s));
        assert_eq!(scope_from_hex(&s.to_hex().to_uppercase()), Some(s));
        assert_eq!(scope_from_hex("abc"), None);
        assert_eq!(scope_from_hex(&"g".repeat(64)), None);
        assert_eq!(scope_from_hex(&"é".repeat(32)), None);
    }
}

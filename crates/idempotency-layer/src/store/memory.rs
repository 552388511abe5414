//! The embedded store: sharded maps in this process.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Begin, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, Token};

/// How many expired records one operation on a shard removes at most, so cleanup is incremental
/// and bounded.
const CLEANUP_PER_OP: usize = 8;

/// The in-memory store: the default, for one process.
///
/// - **Sharded**: entries are spread over shards by scope hash; each shard is a
///   `Mutex<HashMap>` held only for a few map operations, never across an `.await`.
/// - **TTL**: records expire after the layer's `ttl`, on [`tokio::time::Instant`] (so paused-time
///   tests work). An expired record is ignored at once and removed incrementally: every
///   operation on a shard removes up to a few expired records from the front of that shard's
///   expiry index, so no request scans the whole map.
/// - **Capacity**: when a shard is full, expired records go first, then the record closest to
///   expiry (the oldest, for one TTL). Claims in flight are never evicted; a shard full of claims
///   in flight answers [`StoreError::Full`]. The capacity is split evenly over the shards, so
///   [`MemoryStore::len`] never exceeds it.
/// - **Waiters** are woken by a [`tokio::sync::Notify`] per claim, made only when a duplicate
///   waits (a claim nobody waits for allocates nothing for waking), not by polling.
/// - **Tokens** come from a counter per shard, taken under the shard's lock: no counter is
///   shared between threads.
///
/// Records are lost when the process stops, and a second instance has its own: see
/// "Choosing a store" in the [crate docs](crate#choosing-a-store).
///
/// ```
/// use idempotency_layer::MemoryStore;
///
/// let store = MemoryStore::with_capacity(10_000);
/// assert!(store.is_empty());
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
}

#[derive(Default)]
struct Shard {
    /// The last token and expiry sequence number handed out by this shard.
    next: u64,
    map: HashMap<ScopeKey, Entry>,
    /// Completed records by (expiry, sequence): the front is expired first, then the oldest.
    expiry: BTreeMap<(Instant, u64), ScopeKey>,
}

enum Entry {
    InFlight {
        token: Token,
        fingerprint: Fingerprint,
        lease_until: Instant,
        /// Wakes the waiters when the claim ends (the entry is replaced or removed).
        wake: Wake,
    },
    Completed {
        record: Arc<Record>,
        at: (Instant, u64),
    },
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// The default capacity: 100 000 entries.
    pub const DEFAULT_CAPACITY: usize = 100_000;
    /// The default number of shards.
    pub const DEFAULT_SHARDS: usize = 32;

    /// A store with [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) entries.
    pub fn new() -> Self {
        MemoryStore::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A store that keeps at most `capacity` entries (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryStore::with_capacity_and_shards(capacity, Self::DEFAULT_SHARDS)
    }

    /// A store that keeps at most `capacity` entries spread over `shards` shards. Both are
    /// raised to at least one; the shard count is lowered to the capacity when it is larger, and
    /// the capacity rounded down to a multiple of the shard count.
    pub fn with_capacity_and_shards(capacity: usize, shards: usize) -> Self {
        let capacity = capacity.max(1);
        let shards = shards.clamp(1, capacity);
        let per_shard = capacity / shards;
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Mutex::default()).collect(),
                per_shard,
            }),
        }
    }

    /// The most entries this store keeps.
    pub fn capacity(&self) -> usize {
        self.inner.per_shard * self.inner.shards.len()
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

    /// Removes up to `n` expired records from the front of the expiry index.
    fn clean(&mut self, now: Instant, n: usize) {
        for _ in 0..n {
            match self.expiry.first_key_value() {
                Some((&(at, _), _)) if at <= now => {
                    if let Some((_, scope)) = self.expiry.pop_first() {
                        self.map.remove(&scope);
                    }
                }
                _ => break,
            }
        }
    }

    /// Makes room for one new entry; false if every entry is in flight.
    fn make_room(&mut self, now: Instant, per_shard: usize) -> bool {
        while self.map.len() >= per_shard {
            self.clean(now, CLEANUP_PER_OP);
            if self.map.len() < per_shard {
                break;
            }
            // No expired record left at the front: evict the record closest to expiry.
            match self.expiry.pop_first() {
                Some((_, scope)) => {
                    self.map.remove(&scope);
                }
                None => return false,
            }
        }
        true
    }

    fn remove(&mut self, scope: &ScopeKey) -> Option<Entry> {
        let entry = self.map.remove(scope)?;
        if let Entry::Completed { at, .. } = &entry {
            self.expiry.remove(at);
        }
        Some(entry)
    }

    /// The claim `token` on `scope`, if it still holds.
    fn holds(&mut self, scope: &ScopeKey, token: Token) -> bool {
        matches!(self.map.get(scope), Some(Entry::InFlight { token: t, .. }) if *t == token)
    }
}

impl IdempotencyStore for MemoryStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let (index, mut shard) = self.shard_at(&scope);
        shard.clean(now, CLEANUP_PER_OP);
        match shard.map.get(&scope) {
            Some(Entry::Completed { record, at }) if at.0 > now => {
                return Ok(Begin::Completed(record.clone()))
            }
            Some(Entry::InFlight {
                token,
                fingerprint,
                lease_until,
                ..
            }) if *lease_until > now => {
                return Ok(Begin::InFlight {
                    token: *token,
                    fingerprint: *fingerprint,
                })
            }
            // Expired record or lapsed lease: take the scope over (dropping the old entry wakes
            // its waiters; the old leader is fenced).
            Some(_) => {
                shard.remove(&scope);
            }
            None => {
                if !shard.make_room(now, self.inner.per_shard) {
                    return Err(StoreError::Full);
                }
            }
        }
        let token = shard.token(index);
        shard.map.insert(
            scope,
            Entry::InFlight {
                token,
                fingerprint,
                lease_until: now + lease,
                wake: Wake::default(),
            },
        );
        Ok(Begin::New(token))
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Record,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.shard(&scope);
        if !shard.holds(&scope, token) {
            return Err(StoreError::Fenced);
        }
        shard.next += 1;
        let seq = shard.next;
        let at = (now + ttl, seq);
        shard.expiry.insert(at, scope);
        // Replacing the claim drops its `Wake`: the waiters wake.
        shard.map.insert(
            scope,
            Entry::Completed {
                record: Arc::new(record),
                at,
            },
        );
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
            Some(Entry::InFlight {
                token: t,
                lease_until,
                ..
            }) if *t == token => {
                *lease_until = now + lease;
                Ok(())
            }
            _ => Err(StoreError::Fenced),
        }
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        let (notified, until) = {
            let mut shard = self.shard(&scope);
            let (notify, until) = match shard.map.get_mut(&scope) {
                Some(Entry::InFlight {
                    token,
                    lease_until,
                    wake,
                    ..
                }) if *token == observed => (
                    wake.0.get_or_insert_with(Default::default).clone(),
                    *lease_until,
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

    #[tokio::test(start_paused = true)]
    async fn conformance() {
        crate::conformance::run_all(MemoryStore::new).await;
        crate::conformance::run_all(|| MemoryStore::with_capacity_and_shards(1000, 1)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_holds_with_ten_times_the_keys_and_spares_claims_in_flight() {
        let store = MemoryStore::with_capacity_and_shards(100, 4);
        assert_eq!(store.capacity(), 100);
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        // Ten claims stay in flight all along.
        let mut held = Vec::new();
        for i in 0..10 {
            match store.begin(scope(i), fp, lease).await.unwrap() {
                Begin::New(t) => held.push((scope(i), t)),
                other => panic!("{other:?}"),
            }
        }
        let mut full = 0;
        for i in 10..1000 {
            match store.begin(scope(i), fp, lease).await {
                Ok(Begin::New(t)) => {
                    store
                        .complete(scope(i), t, record(), Duration::from_secs(3600))
                        .await
                        .unwrap();
                }
                Err(StoreError::Full) => full += 1,
                other => panic!("{other:?}"),
            }
            assert!(store.len() <= 100, "len {} at {i}", store.len());
        }
        assert_eq!(full, 0, "shards with records always have room");
        for (s, t) in held {
            assert!(matches!(
                store.begin(s, fp, lease).await.unwrap(),
                Begin::InFlight { token, .. } if token == t
            ));
            store.complete(s, t, record(), lease).await.unwrap();
        }
        // The newest records survived; the oldest were evicted.
        assert!(matches!(
            store.begin(scope(999), fp, lease).await.unwrap(),
            Begin::Completed(_)
        ));
        assert!(matches!(
            store.begin(scope(10), fp, lease).await.unwrap(),
            Begin::New(_)
        ));
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
                .complete(scope(i), t, record(), Duration::from_secs(10))
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
}

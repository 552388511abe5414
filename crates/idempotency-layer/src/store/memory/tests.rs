//! The memory store's own tests (the shared contract runs in `conformance`).

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
        replay_head: Default::default(),
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
    crate::conformance::run_all(|| {
        MemoryStore::builder()
            .max_entries(1000)
            .shards(1)
            .build()
            .unwrap()
    })
    .await;
}

fn tenant_scope(tenant: &str, i: u64) -> (TenantKey, ScopeKey) {
    (
        TenantKey::of(tenant),
        crate::scope::Scope::new(tenant, "POST /orders", &format!("key-{i}")).key(),
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
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(100)
        .shards(1)
        .build()
        .unwrap();
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
        .build()
        .unwrap();
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
        .build()
        .unwrap();
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
        .build()
        .unwrap();
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
        .min_retention(Duration::ZERO)
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(1000)
        .shards(32)
        .build()
        .unwrap();
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
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(10)
        .shards(1)
        .build()
        .unwrap();
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
/// minutes) is always its replay. Past what 128 MiB holds (about 270 000 of these records), the
/// oldest make room.
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
    assert!(stats.evicted > 500_000, "the oldest made room: {stats:?}");
    assert_eq!(stats.nearly_full, 1, "{stats:?}");
}

#[tokio::test(start_paused = true)]
async fn a_shard_full_of_claims_in_flight_says_full() {
    let store = MemoryStore::builder()
        .max_entries(2)
        .shards(1)
        .build()
        .unwrap();
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

/// Claims whose leases lapsed (their leaders crashed, or never learned of them: a lost `begin`
/// reply) make room for new claims when the store is full: nobody holds them any more. (They
/// were taken back only when their own scope was claimed again, and a store full of them refused
/// every new write for good.) A claim still within its lease keeps its place.
#[tokio::test(start_paused = true)]
async fn lapsed_claims_make_room_for_new_ones() {
    for shards in [1, 4] {
        let store = MemoryStore::builder()
            .max_entries(2)
            .shards(shards)
            .build()
            .unwrap();
        let fp = Fingerprint([1; 32]);
        let short = Duration::from_secs(1);
        for i in 0..2 {
            assert!(matches!(
                store.begin(scope(i), fp, short).await,
                Ok(Begin::New(_))
            ));
        }
        assert!(
            matches!(
                store.begin(scope(2), fp, short).await,
                Err(StoreError::Full)
            ),
            "{shards} shards: full while the claims hold"
        );
        tokio::time::sleep(short * 2).await;
        assert!(
            matches!(store.begin(scope(2), fp, short).await, Ok(Begin::New(_))),
            "{shards} shards: a lapsed claim makes room"
        );
        assert_eq!(store.len(), 2, "{shards} shards");
    }
}

#[tokio::test(start_paused = true)]
async fn expired_records_are_removed_incrementally() {
    let store = MemoryStore::builder()
        .max_entries(10_000)
        .shards(1)
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(1000)
        .shards(1)
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(1000)
        .shards(1)
        .build()
        .unwrap();
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
    let store = MemoryStore::builder()
        .max_entries(1000)
        .shards(1)
        .build()
        .unwrap();
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

/// A setting out of its range is refused by `build`, naming it (before, it was raised or
/// clamped silently).
#[test]
fn bad_settings_are_refused_by_build_with_what_to_change() {
    for (bad, says) in [
        (MemoryStore::builder().max_entries(0), "max_entries"),
        (MemoryStore::builder().max_bytes(1), "max_bytes"),
        (MemoryStore::builder().shards(0), "shards"),
        (
            MemoryStore::builder().tenant_share_percent(0),
            "tenant_share_percent",
        ),
        (
            MemoryStore::builder().tenant_share_percent(101),
            "tenant_share_percent",
        ),
    ] {
        match bad.build() {
            Err(StoreError::Config(why)) => assert!(why.contains(says), "{why}"),
            other => panic!("{says}: {:?}", other.map(|_| ())),
        }
    }
    // More shards than entries is not a mistake: the shards are lowered to the entries.
    assert!(MemoryStore::builder()
        .max_entries(2)
        .shards(64)
        .build()
        .is_ok());
}

/// A write with `key` through a layer over `store` whose fixed tenant is `shop` (the request
/// carries the `Tenant` extension `tenant`, if any), to a handler answering 200: its status.
async fn write_through<St: IdempotencyStore>(
    store: St,
    key: &str,
    tenant: Option<&str>,
) -> StatusCode {
    use tower::{Layer as _, ServiceExt as _};
    let svc = crate::IdempotencyLayer::new(store)
        .tenant(crate::TenantSource::fixed("shop"))
        .layer(tower::service_fn(|_: http::Request<_>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                Bytes::from_static(b"done"),
            )))
        }));
    let mut req = http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(http_body_util::Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    if let Some(tenant) = tenant {
        req.extensions_mut().insert(crate::Tenant::new(tenant));
    }
    svc.oneshot(req).await.unwrap().status()
}

/// A store reached by two paths that key scopes differently says so: a layer over the store
/// and a layer over a wrapper of it that keeps the default `scope_keys` (stable keys). A
/// wrapper that forwards `scope_keys` (the conformance suite's `FaultStore`) is one path.
#[tokio::test]
async fn scope_keys_of_two_kinds_are_told() {
    /// A wrapper of its own that forwards every operation but not `scope_keys`.
    #[derive(Clone)]
    struct Unforwarded(MemoryStore);
    impl IdempotencyStore for Unforwarded {
        async fn begin(
            &self,
            s: ScopeKey,
            f: Fingerprint,
            l: Duration,
        ) -> Result<Begin, StoreError> {
            self.0.begin(s, f, l).await
        }
        async fn complete(
            &self,
            s: ScopeKey,
            t: Token,
            r: Arc<Record>,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            self.0.complete(s, t, r, ttl).await
        }
        async fn release(&self, s: ScopeKey, t: Token) -> Result<(), StoreError> {
            self.0.release(s, t).await
        }
        async fn renew(&self, s: ScopeKey, t: Token, l: Duration) -> Result<(), StoreError> {
            self.0.renew(s, t, l).await
        }
        async fn wait(&self, s: ScopeKey, t: Token) -> Result<(), StoreError> {
            self.0.wait(s, t).await
        }
        async fn forget(&self, s: ScopeKey) -> Result<bool, StoreError> {
            self.0.forget(s).await
        }
    }

    let store = MemoryStore::new();
    assert_eq!(
        write_through(store.clone(), "order-00001", None).await,
        StatusCode::OK
    );
    let faulted = crate::conformance::FaultStore::new(store.clone());
    assert_eq!(
        write_through(faulted, "order-00002", None).await,
        StatusCode::OK
    );
    assert!(
        !store.stats().mixed_scope_keys,
        "the store and a wrapper that forwards scope_keys key alike"
    );
    assert_eq!(
        write_through(Unforwarded(store.clone()), "order-00003", None).await,
        StatusCode::OK
    );
    assert!(store.stats().mixed_scope_keys, "two kinds of keys, told");

    // Directly: a key of the store's own kind, then a stable key.
    let direct = MemoryStore::new();
    let scope = crate::Scope::new("t", "POST /orders", "k");
    let lease = Duration::from_secs(5);
    direct
        .begin(scope.key_in(&direct), Fingerprint([0; 32]), lease)
        .await
        .unwrap();
    assert!(!direct.stats().mixed_scope_keys);
    direct
        .begin(scope.key(), Fingerprint([0; 32]), lease)
        .await
        .unwrap();
    assert!(direct.stats().mixed_scope_keys);
}

/// One tenant is one tenant to the store whichever way the layer learned it: the layer's fixed
/// tenant (its key computed once) and a `Tenant` extension of the same name (its key computed
/// per request) are charged to one share, under the store's keys of this process.
#[tokio::test]
async fn a_fixed_tenant_and_the_same_tenant_as_an_extension_share_one_key() {
    let store = MemoryStore::new();
    for (key, extension) in [("order-00001", None), ("order-00002", Some("shop"))] {
        let status = write_through(store.clone(), key, extension).await;
        assert_eq!(status, StatusCode::OK, "{key}");
    }
    let stats = store.stats();
    assert_eq!(stats.entries, 2);
    assert_eq!(stats.tenants, 1, "one tenant, one key");
    // And it is the key the store's direct callers get for the tenant: no second share.
    let direct = TenantKey::of_in("shop", &store);
    store
        .begin_for_tenant(
            direct,
            scope(7),
            Fingerprint([0; 32]),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(store.stats().tenants, 1);
}

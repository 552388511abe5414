//! The store conformance suite: one set of checks every [`IdempotencyStore`] must pass.
//!
//! Enabled by the `conformance` cargo feature. A store crate runs it from its own tests, with a
//! constructor that returns a fresh, empty store each time (its own key prefix or schema):
//!
//! ```
//! use idempotency_layer::{conformance, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! conformance::run_all(MemoryStore::new).await;
//! # }
//! ```
//!
//! The checks wait for real durations of a few hundred milliseconds (leases and TTLs of
//! 300 ms); under `tokio::time::pause()` (as the `MemoryStore` tests run) they take no time.
//! Each check panics with a message that says what the store got wrong.
//!
//! A waiter must be woken by the store's notification within [`WAKE`]. A store that also polls
//! as a fallback (as the shared stores do when a notification is lost) must be run through the
//! suite with that polling slower than `WAKE`, or a store whose wake-ups are broken would pass
//! on its polling alone: `RedisStore::builder(..).poll_interval(60 s, 60 s)`, say.
//!
//! [`FaultStore`] wraps any store with injected faults (fail, hang, delay, lose a reply after
//! the operation ran, ...) and counts what each operation did: the test double for a store
//! that misbehaves, for the layer's tests and for yours.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::store::{
    Begin, Fingerprint, Held, IdempotencyStore, Record, ScopeKey, StoreError, Token,
};
use crate::Scope;

mod fault;

pub use self::fault::{Calls, Fault, FaultStore, Op, Reply, Rule};

/// The short lease and TTL the expiry checks use.
const SHORT: Duration = Duration::from_millis(300);
/// A lease long enough never to lapse during a check.
pub const LONG: Duration = Duration::from_secs(600);
/// How long a waiter may take to notice that the claim it waits for ended. A store's fallback
/// polling must be slower than this while it runs the suite (see the [module docs](self)), so
/// that only a working wake-up passes.
pub const WAKE: Duration = Duration::from_secs(2);
/// How long a waiter is given to reach its wait before the claim it waits for ends. Not a race:
/// a waiter that has not reached it yet finds the claim ended at its first check, which a store
/// must also get right (and is checked on its own); only a waiter parked in its wait checks the
/// wake-up.
const SETTLE: Duration = Duration::from_millis(200);

/// Runs every check, each on a fresh store from `make`.
pub async fn run_all<S: IdempotencyStore>(make: impl Fn() -> S) {
    claim_is_exclusive_under_a_race(make()).await;
    in_flight_reports_token_and_fingerprint(make()).await;
    complete_then_begin_replays_the_record(make()).await;
    stale_token_complete_is_fenced(make()).await;
    stale_token_release_is_fenced(make()).await;
    release_frees_the_scope(make()).await;
    records_expire(make()).await;
    lapsed_lease_is_taken_over_and_old_leader_fenced(make()).await;
    a_lapsed_leader_is_fenced_after_its_successor_completed(make()).await;
    late_complete_without_takeover_is_kept(make()).await;
    renew_keeps_the_claim(make()).await;
    renew_many_renews_each_held_claim_and_fences_the_rest(make()).await;
    renew_many_renews_a_claim_by_its_own_token_not_a_stale_one_of_its_scope(make()).await;
    forget_clears_records_and_fences_claims(make()).await;
    lookup_sees_claims_and_records_and_claims_nothing(make()).await;
    wait_wakes_on_complete(make()).await;
    wait_wakes_on_release(make()).await;
    wait_returns_at_once_when_claim_already_ended(make()).await;
    scopes_are_independent(make()).await;
}

/// A scope unique to one check and one call (so checks can share a backend).
pub fn scope(name: &str) -> ScopeKey {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nonce = format!("{name}-{n}-{:?}", std::time::SystemTime::now());
    Scope::new("conformance", name, &nonce).key()
}

/// A record with repeated headers, a body and trailers, to check a store keeps them all.
pub fn sample_record(fingerprint: Fingerprint) -> Record {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/grpc"));
    headers.append("x-multi", HeaderValue::from_static("one"));
    headers.append("x-multi", HeaderValue::from_static("two"));
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("grpc-message", HeaderValue::from_static("fine%20thanks"));
    Record {
        fingerprint,
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from_static(b"\x00\x00\x00\x00\x03abc binary \xff body"),
        body_omitted: false,
        trailers: Some(Box::new(trailers)),
        replay_head: Default::default(),
    }
}

const FP: Fingerprint = Fingerprint([7; 32]);
const OTHER_FP: Fingerprint = Fingerprint([8; 32]);

async fn new_claim<S: IdempotencyStore>(store: &S, scope: ScopeKey, lease: Duration) -> Token {
    match store.begin(scope, FP, lease).await {
        Ok(Begin::New(t)) => t,
        other => panic!("begin on a free scope must return New, got {other:?}"),
    }
}

/// 64 concurrent `begin`s on one scope: exactly one gets the claim, the others see it in flight
/// with the winner's token.
async fn claim_is_exclusive_under_a_race<S: IdempotencyStore>(store: S) {
    let s = scope("race");
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move { store.begin(s, FP, LONG).await }));
    }
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for t in tasks {
        match t.await.expect("begin task panicked") {
            Ok(Begin::New(token)) => winners.push(token),
            Ok(Begin::InFlight { token, .. }) => seen.push(token),
            other => panic!("race: unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one begin may claim a scope");
    assert!(
        seen.iter().all(|t| *t == winners[0]),
        "losers must see the winner's token"
    );
}

/// An in-flight scope reports the leader's token and fingerprint (so the layer can answer a
/// mismatch at once).
async fn in_flight_reports_token_and_fingerprint<S: IdempotencyStore>(store: S) {
    let s = scope("in-flight");
    let token = new_claim(&store, s, LONG).await;
    match store.begin(s, OTHER_FP, LONG).await {
        Ok(Begin::InFlight {
            token: t,
            fingerprint,
        }) => {
            assert_eq!(t, token, "in-flight token");
            assert_eq!(fingerprint, FP, "in-flight fingerprint is the leader's");
        }
        other => panic!("second begin must see InFlight, got {other:?}"),
    }
}

/// A completed claim replays its record exactly: status, repeated headers, binary body,
/// trailers.
async fn complete_then_begin_replays_the_record<S: IdempotencyStore>(store: S) {
    let s = scope("complete");
    let token = new_claim(&store, s, LONG).await;
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .expect("complete by the holder succeeds");
    match store.begin(s, FP, LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(*r, sample_record(FP), "record round trip"),
        other => panic!("begin after complete must return the record, got {other:?}"),
    }
    // The same complete again (resent after a lost reply) is answered as the first was, and
    // changes nothing; another token's is fenced.
    let mut other = sample_record(FP);
    other.body = Bytes::from_static(b"overwrite");
    store
        .complete(s, token, other.clone().into(), LONG)
        .await
        .expect("a complete resent by its own token is answered completed");
    assert!(matches!(
        store
            .complete(s, Token(token.0 ^ 0xAAAA), other.into(), LONG)
            .await,
        Err(StoreError::Fenced)
    ));
    match store.begin(s, FP, LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(r.body, sample_record(FP).body),
        other => panic!("record must be unchanged, got {other:?}"),
    }
}

/// `complete` with a token that never held the claim is refused and changes nothing.
async fn stale_token_complete_is_fenced<S: IdempotencyStore>(store: S) {
    let s = scope("fenced-complete");
    let token = new_claim(&store, s, LONG).await;
    let stale = Token(token.0 ^ 0x5555_5555);
    assert!(
        matches!(
            store
                .complete(s, stale, sample_record(FP).into(), LONG)
                .await,
            Err(StoreError::Fenced)
        ),
        "complete by a stale token must be fenced"
    );
    assert!(
        matches!(store.begin(s, FP, LONG).await, Ok(Begin::InFlight { token: t, .. }) if t == token),
        "the real claim is untouched"
    );
    // And a complete on a scope nobody holds is fenced too.
    assert!(matches!(
        store
            .complete(scope("nobody"), token, sample_record(FP).into(), LONG)
            .await,
        Err(StoreError::Fenced)
    ));
}

/// `release` with a stale token is refused and does not free the scope.
async fn stale_token_release_is_fenced<S: IdempotencyStore>(store: S) {
    let s = scope("fenced-release");
    let token = new_claim(&store, s, LONG).await;
    let stale = Token(token.0 ^ 0xAAAA);
    assert!(matches!(
        store.release(s, stale).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.begin(s, FP, LONG).await,
        Ok(Begin::InFlight { .. })
    ));
    // Releasing a completed record with its old token is refused: the record stays.
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    assert!(matches!(
        store.release(s, token).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.begin(s, FP, LONG).await,
        Ok(Begin::Completed(_))
    ));
}

/// After `release`, the next `begin` claims the scope again with a new token.
async fn release_frees_the_scope<S: IdempotencyStore>(store: S) {
    let s = scope("release");
    let first = new_claim(&store, s, LONG).await;
    store.release(s, first).await.expect("release by holder");
    let second = new_claim(&store, s, LONG).await;
    assert_ne!(first, second, "a new claim gets a new token");
}

/// A record expires after its TTL: the scope is free again.
async fn records_expire<S: IdempotencyStore>(store: S) {
    let s = scope("expiry");
    let token = new_claim(&store, s, LONG).await;
    store
        .complete(s, token, sample_record(FP).into(), SHORT)
        .await
        .unwrap();
    assert!(matches!(
        store.begin(s, FP, LONG).await,
        Ok(Begin::Completed(_))
    ));
    tokio::time::sleep(SHORT * 2).await;
    new_claim(&store, s, LONG).await;
}

/// A claim whose lease lapsed is taken over; the old leader's complete and release are fenced
/// and do not overwrite the new leader's record.
async fn lapsed_lease_is_taken_over_and_old_leader_fenced<S: IdempotencyStore>(store: S) {
    let s = scope("takeover");
    let old = new_claim(&store, s, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    let new = new_claim(&store, s, LONG).await;
    assert_ne!(old, new);
    assert!(matches!(
        store.complete(s, old, sample_record(FP).into(), LONG).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(s, old).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(s, old, LONG).await,
        Err(StoreError::Fenced)
    ));
    let mut mine = sample_record(FP);
    mine.body = Bytes::from_static(b"new leader");
    store
        .complete(s, new, mine.clone().into(), LONG)
        .await
        .unwrap();
    match store.begin(s, FP, LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(*r, mine),
        other => panic!("{other:?}"),
    }
}

/// A lapsed leader's `complete`, `release` and `renew`, sent after the leader that took the
/// scope over has completed it, are fenced: the record holds the successor's token, and only
/// that token's own complete again is "done already". (A store that compared part of the token,
/// say the shard it was made in, answered the lapsed leader `Ok`: it would believe it recorded
/// while another record is kept.)
async fn a_lapsed_leader_is_fenced_after_its_successor_completed<S: IdempotencyStore>(store: S) {
    let s = scope("takeover-completed");
    let old = new_claim(&store, s, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    let new = new_claim(&store, s, LONG).await;
    assert_ne!(old, new);
    let mut theirs = sample_record(FP);
    theirs.body = Bytes::from_static(b"the successor's");
    store
        .complete(s, new, theirs.clone().into(), LONG)
        .await
        .unwrap();
    assert!(
        matches!(
            store.complete(s, old, sample_record(FP).into(), LONG).await,
            Err(StoreError::Fenced)
        ),
        "a lapsed leader's complete after its successor's record is fenced"
    );
    assert!(matches!(
        store.release(s, old).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.renew(s, old, LONG).await,
        Err(StoreError::Fenced)
    ));
    // The successor's own complete, resent, is done already.
    store
        .complete(s, new, theirs.clone().into(), LONG)
        .await
        .expect("the same complete again is done already");
    match store.begin(s, FP, LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(*r, theirs),
        other => panic!("{other:?}"),
    }
}

/// A leader whose lease lapsed while nobody took the scope over still completes (a slow
/// handler whose renewals failed): its record is kept and replayed, and nothing runs twice.
async fn late_complete_without_takeover_is_kept<S: IdempotencyStore>(store: S) {
    let s = scope("late-complete");
    let token = new_claim(&store, s, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .expect("a late complete with no takeover in between is accepted");
    match store.begin(s, FP, LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(*r, sample_record(FP)),
        other => panic!("the late record must be kept, got {other:?}"),
    }
}

/// Renewing a lease keeps the claim past its first lease: a claim of [`SHORT`] renewed at once
/// for [`LONG`] still holds twice `SHORT` later. (The renewal is not timed against the first
/// lease: a store that refuses to renew a lapsed claim nobody took over still passes.)
async fn renew_keeps_the_claim<S: IdempotencyStore>(store: S) {
    let s = scope("renew");
    let token = new_claim(&store, s, SHORT).await;
    store.renew(s, token, LONG).await.expect("renew by holder");
    tokio::time::sleep(SHORT * 2).await;
    assert!(
        matches!(store.begin(s, FP, LONG).await, Ok(Begin::InFlight { token: t, .. }) if t == token),
        "a renewed claim still holds after more than its first lease"
    );
    store.renew(s, token, LONG).await.expect("renew again");
    store.release(s, token).await.unwrap();
}

/// `renew_many` answers one result per claim, in order: the claims still held are renewed past
/// their first lease, a released or completed one is fenced (and not brought back).
async fn renew_many_renews_each_held_claim_and_fences_the_rest<S: IdempotencyStore>(store: S) {
    let held: Vec<ScopeKey> = (0..5).map(|_| scope("renew-many")).collect();
    let (released, completed) = (scope("renew-many-released"), scope("renew-many-completed"));
    let mut claims = Vec::new();
    for &s in &held {
        claims.push((s, new_claim(&store, s, SHORT).await, SHORT));
    }
    let gone = new_claim(&store, released, SHORT).await;
    store.release(released, gone).await.unwrap();
    let done = new_claim(&store, completed, SHORT).await;
    store
        .complete(completed, done, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    // The two ended claims in the middle, to check the order of the answers. Each claim is
    // renewed for LONG, at once and again after its first lease would have lapsed.
    claims.insert(2, (released, gone, LONG));
    claims.insert(4, (completed, done, LONG));
    for claim in &mut claims {
        claim.2 = LONG;
    }
    for round in 0..2 {
        if round == 1 {
            tokio::time::sleep(SHORT * 2).await;
        }
        let results = store.renew_many(&claims).await;
        assert_eq!(results.len(), claims.len(), "one result per claim");
        for (i, ((s, _, _), r)) in claims.iter().zip(&results).enumerate() {
            if *s == released || *s == completed {
                assert!(
                    matches!(r, Err(StoreError::Fenced)),
                    "claim {i} had ended: renew_many must answer Fenced, got {r:?}"
                );
            } else {
                assert!(
                    r.is_ok(),
                    "claim {i} is held: renew_many must renew it, got {r:?}"
                );
            }
        }
    }
    for (s, token, _) in &claims {
        if *s == released || *s == completed {
            continue;
        }
        assert!(
            matches!(store.begin(*s, FP, LONG).await, Ok(Begin::InFlight { token: t, .. }) if t == *token),
            "a claim renewed by renew_many still holds after more than its first lease"
        );
        store.release(*s, *token).await.unwrap();
    }
    assert!(
        matches!(store.begin(released, FP, LONG).await, Ok(Begin::New(_))),
        "renew_many must not bring a released claim back"
    );
    assert!(
        matches!(
            store.begin(completed, FP, LONG).await,
            Ok(Begin::Completed(_))
        ),
        "renew_many must not touch a completed record"
    );
}

/// A batch can hold two tokens of one scope: a lapsed leader's, still on the renewal list, and
/// its successor's. Each is answered for itself (the stale one fenced, the live one renewed),
/// and the live claim gets its own lease, in either order. (A store that matched the batch's
/// claims to rows by scope alone gave the row the lease of whichever entry it met: the stale
/// one's short lease let the claim lapse under its live leader.)
async fn renew_many_renews_a_claim_by_its_own_token_not_a_stale_one_of_its_scope<
    S: IdempotencyStore,
>(
    store: S,
) {
    let s = scope("renew-many-two-tokens");
    let old = new_claim(&store, s, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    let live = new_claim(&store, s, SHORT).await;
    assert_ne!(old, live);
    for order in [
        [(s, old, SHORT), (s, live, LONG)],
        [(s, live, LONG), (s, old, SHORT)],
    ] {
        let results = store.renew_many(&order).await;
        for ((_, token, _), r) in order.iter().zip(&results) {
            if *token == old {
                assert!(
                    matches!(r, Err(StoreError::Fenced)),
                    "the stale token is fenced: {r:?}"
                );
            } else {
                assert!(r.is_ok(), "the live claim is renewed: {r:?}");
            }
        }
        tokio::time::sleep(SHORT * 2).await;
        assert!(
            matches!(store.begin(s, FP, LONG).await, Ok(Begin::InFlight { token: t, .. }) if t == live),
            "the live claim holds by its own lease, not the stale token's"
        );
    }
    store.release(s, live).await.unwrap();
}

/// `forget` clears a record, clears a claim (fencing its leader), and says whether it did.
async fn forget_clears_records_and_fences_claims<S: IdempotencyStore>(store: S) {
    let s = scope("forget");
    let token = new_claim(&store, s, LONG).await;
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    assert!(store.forget(s).await.unwrap(), "forget of a record");
    assert!(
        !store.forget(s).await.unwrap(),
        "second forget finds nothing"
    );
    let claim = new_claim(&store, s, LONG).await;
    assert!(store.forget(s).await.unwrap(), "forget of a claim");
    assert!(matches!(
        store
            .complete(s, claim, sample_record(FP).into(), LONG)
            .await,
        Err(StoreError::Fenced)
    ));
    new_claim(&store, s, LONG).await;
}

/// `lookup` reports what a scope holds (a claim in flight with its token and fingerprint, a
/// record, nothing), claims nothing itself, and sees a lapsed lease or an expired record as
/// nothing.
async fn lookup_sees_claims_and_records_and_claims_nothing<S: IdempotencyStore>(store: S) {
    let s = scope("lookup");
    assert!(store.lookup(s).await.unwrap().is_none(), "a free scope");
    assert!(
        store.lookup(s).await.unwrap().is_none(),
        "a lookup claims nothing"
    );
    let token = new_claim(&store, s, LONG).await;
    match store.lookup(s).await.unwrap() {
        Some(Held::InFlight {
            token: held,
            fingerprint,
        }) => assert_eq!((held, fingerprint), (token, FP)),
        other => panic!("a claim in flight, got {other:?}"),
    }
    let record = sample_record(FP);
    store
        .complete(s, token, record.clone().into(), SHORT)
        .await
        .unwrap();
    match store.lookup(s).await.unwrap() {
        Some(Held::Completed(found)) => assert_eq!(*found, record),
        other => panic!("the record, got {other:?}"),
    }
    tokio::time::sleep(SHORT * 2).await;
    assert!(
        store.lookup(s).await.unwrap().is_none(),
        "an expired record"
    );

    let lapsed = scope("lookup-lapsed");
    new_claim(&store, lapsed, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    assert!(
        store.lookup(lapsed).await.unwrap().is_none(),
        "a claim whose lease lapsed"
    );
}

async fn waiter<S: IdempotencyStore>(
    store: &S,
    s: ScopeKey,
    token: Token,
) -> tokio::task::JoinHandle<Result<(), StoreError>> {
    let store = store.clone();
    let handle = tokio::spawn(async move { store.wait(s, token).await });
    // Let the waiter reach its wait before the claim ends (see SETTLE: the other order is
    // checked by `wait_returns_at_once_when_claim_already_ended`).
    tokio::time::sleep(SETTLE).await;
    handle
}

/// A waiter wakes when the claim completes, well before the lease lapses, and then sees the
/// record.
async fn wait_wakes_on_complete<S: IdempotencyStore>(store: S) {
    let s = scope("wait-complete");
    let token = new_claim(&store, s, LONG).await;
    let w = waiter(&store, s, token).await;
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    tokio::time::timeout(WAKE, w)
        .await
        .expect("waiter must wake on complete")
        .expect("waiter task")
        .expect("wait result");
    assert!(matches!(
        store.begin(s, FP, LONG).await,
        Ok(Begin::Completed(_))
    ));
}

/// A waiter wakes when the claim is released, and can then claim the scope itself.
async fn wait_wakes_on_release<S: IdempotencyStore>(store: S) {
    let s = scope("wait-release");
    let token = new_claim(&store, s, LONG).await;
    let w = waiter(&store, s, token).await;
    store.release(s, token).await.unwrap();
    tokio::time::timeout(WAKE, w)
        .await
        .expect("waiter must wake on release")
        .expect("waiter task")
        .expect("wait result");
    new_claim(&store, s, LONG).await;
}

/// `wait` on a claim that already ended returns at once (no lost wake-up).
async fn wait_returns_at_once_when_claim_already_ended<S: IdempotencyStore>(store: S) {
    let s = scope("wait-ended");
    let token = new_claim(&store, s, LONG).await;
    store.release(s, token).await.unwrap();
    tokio::time::timeout(WAKE, store.wait(s, token))
        .await
        .expect("wait on an ended claim must not block")
        .unwrap();
    let token = new_claim(&store, s, LONG).await;
    store
        .complete(s, token, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    tokio::time::timeout(WAKE, store.wait(s, token))
        .await
        .expect("wait on a completed claim must not block")
        .unwrap();
}

/// Claims and records of different scopes do not interfere.
async fn scopes_are_independent<S: IdempotencyStore>(store: S) {
    let a = scope("independent-a");
    let b = scope("independent-b");
    let ta = new_claim(&store, a, LONG).await;
    let tb = new_claim(&store, b, LONG).await;
    store
        .complete(a, ta, sample_record(FP).into(), LONG)
        .await
        .unwrap();
    assert!(matches!(
        store.begin(b, FP, LONG).await,
        Ok(Begin::InFlight { .. })
    ));
    store.release(b, tb).await.unwrap();
    assert!(matches!(
        store.begin(a, FP, LONG).await,
        Ok(Begin::Completed(_))
    ));
}

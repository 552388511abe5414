//! The duplicates waiting for a request in flight, per scope: bounded per scope
//! ([`IdempotencyLayer::max_waiters`]) and in all, by the bytes they hold
//! ([`IdempotencyLayer::max_waiting_bytes`]), and told their leader's failure when it ends
//! without a record.
//!
//! A leader whose outcome is not recorded (a 503, an error, a panic) releases its key, and a
//! waiter would then claim it and run the handler again: N duplicates waiting on a failing
//! dependency would hit it N times, outside any client's retry budget. Instead (the rule of the
//! single-flight pattern: the shared call fails for all its callers, and the entry is removed)
//! the leader hands its failure to the duplicates that were already waiting for it, and they
//! answer with it; the key is free again, so a client's next retry, under its budget, runs it.
//! A request that arrives after the leader answered is a retry, not a waiter of that failure:
//! it waits for the release and runs.
//!
//! This is in-process: waiters in other instances of a shared store see the key released and
//! the first of them runs it (at most one execution per instance, not one per duplicate).
//!
//! [`IdempotencyLayer::max_waiters`]: crate::IdempotencyLayer::max_waiters
//! [`IdempotencyLayer::max_waiting_bytes`]: crate::IdempotencyLayer::max_waiting_bytes

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::reject::RejectReason;
use crate::store::{FastMap, Record, ScopeKey, Token};

const SHARDS: usize = 16;

/// The waiters of every scope that has one, shared by every clone of a layer. Only scopes with
/// a waiter have an entry, so its size is bounded by the waiters themselves.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    shards: [Mutex<FastMap<ScopeKey, Waiting>>; SHARDS],
    /// The bytes every waiter holds, in all scopes (see [`WAITER_OVERHEAD`]).
    held: AtomicUsize,
}

/// What a waiter is charged beyond its request body and head (see [`head_bytes`]): its place
/// here and its waiting state (an estimate, on the high side).
pub(crate) const WAITER_OVERHEAD: usize = 512;

/// The bytes a request head holds: its URI, its headers (each name and value, and what a
/// `HeaderMap` entry costs beside them) and its extensions' map (counted as one entry each is
/// not knowable; an estimate). A waiter keeps its head while it waits, and a head may be a
/// hundred times the size of a small body.
pub(crate) fn head_bytes(parts: &http::request::Parts) -> usize {
    /// What one entry of a `HeaderMap` costs beside its name and value (its bucket, its index
    /// slot, the `HeaderValue`'s own bytes).
    const PER_HEADER: usize = 64;
    let uri = parts.uri.path_and_query().map_or(0, |p| p.as_str().len())
        + parts.uri.authority().map_or(0, |a| a.as_str().len());
    let headers: usize = parts
        .headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + PER_HEADER)
        .sum();
    std::mem::size_of::<http::request::Parts>() + uri + headers
}

/// Why a duplicate was not let wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its scope already has `max_waiters` waiting.
    KeyFull,
    /// The waiters of every scope together already hold `max_waiting_bytes`.
    LayerFull,
}

/// The waiters of one scope.
#[derive(Debug, Default)]
struct Waiting {
    count: usize,
    /// Orders the waiters' arrivals and a failure's hand-over (under the shard's lock): a waiter
    /// takes a failure handed over after it arrived, never one from before.
    seq: u64,
    failure: Option<Failure>,
    notify: Arc<Notify>,
}

/// A leader's failure, handed to the waiters of its claim.
#[derive(Debug)]
struct Failure {
    token: Token,
    seq: u64,
    answer: SharedFailure,
}

/// What a waiter answers when its leader failed.
#[derive(Clone, Debug)]
pub(crate) enum SharedFailure {
    /// The leader's own answer (a 503, say), as it was.
    Answer(Arc<Record>),
    /// A rejection, in the waiter's protocol: the leader's handler panicked
    /// ([`RejectReason::Internal`], as its own client got), or failed with nothing to share
    /// (an error, a response that broke off: [`RejectReason::InFlightFailed`]).
    Reject(RejectReason),
}

impl Waiters {
    fn shard(&self, scope: &ScopeKey) -> MutexGuard<'_, FastMap<ScopeKey, Waiting>> {
        // Every critical section leaves the map consistent: a poisoned lock is still usable.
        self.shards[usize::from(scope.0[0]) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A place among the waiters of `scope` for a request holding `body` bytes (its body and
    /// head: see [`head_bytes`]), refused when
    /// `max` already wait for that scope, or when the waiters of every scope would then hold
    /// more than `max_bytes`.
    pub(crate) fn enter(
        self: &Arc<Self>,
        scope: ScopeKey,
        max: usize,
        body: usize,
        max_bytes: usize,
    ) -> Result<WaiterSlot, Refused> {
        let charge = body.saturating_add(WAITER_OVERHEAD);
        let mut map = self.shard(&scope);
        let w = map.entry(scope).or_default();
        let refused = if w.count >= max {
            Some(Refused::KeyFull)
        } else if self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(charge).filter(|&after| after <= max_bytes)
            })
            .is_err()
        {
            Some(Refused::LayerFull)
        } else {
            None
        };
        if let Some(refused) = refused {
            if w.count == 0 {
                map.remove(&scope);
            }
            return Err(refused);
        }
        w.count += 1;
        w.seq += 1;
        Ok(WaiterSlot {
            waiters: self.clone(),
            scope,
            seq: w.seq,
            notify: w.notify.clone(),
            charge,
        })
    }

    /// The bytes all waiters hold now.
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Does anybody wait for `scope` now?
    pub(crate) fn any(&self, scope: &ScopeKey) -> bool {
        self.shard(scope).contains_key(scope)
    }

    /// The leader of `scope` (claim `token`) ended with `answer` and no record: the waiters
    /// already waiting for it take it (and are woken). `answer` is made only if someone waits.
    pub(crate) fn share_failure(
        &self,
        scope: ScopeKey,
        token: Token,
        answer: impl FnOnce() -> SharedFailure,
    ) {
        let mut map = self.shard(&scope);
        let Some(w) = map.get_mut(&scope) else {
            return;
        };
        w.seq += 1;
        w.failure = Some(Failure {
            token,
            seq: w.seq,
            answer: answer(),
        });
        w.notify.notify_waiters();
    }

    /// How many wait for `scope` now.
    #[cfg(test)]
    pub(crate) fn count(&self, scope: &ScopeKey) -> usize {
        self.shard(scope).get(scope).map_or(0, |w| w.count)
    }
}

/// One waiter's place; leaving (drop, including cancellation) frees it.
#[derive(Debug)]
pub(crate) struct WaiterSlot {
    waiters: Arc<Waiters>,
    scope: ScopeKey,
    /// When it arrived, among its scope's waiters and failures.
    seq: u64,
    notify: Arc<Notify>,
    /// The bytes it is charged, given back when it leaves.
    charge: usize,
}

impl WaiterSlot {
    /// Resolves when a failure is handed to this scope's waiters. Enable it (or poll it) before
    /// checking [`failure`](Self::failure), so a hand-over in between is not missed.
    pub(crate) fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }

    /// The failure of the claim `token` this waiter waited for, if its leader handed one over
    /// after this waiter arrived: the waiter answers with it.
    pub(crate) fn failure(&self, token: Token) -> Option<SharedFailure> {
        let map = self.waiters.shard(&self.scope);
        let f = map.get(&self.scope)?.failure.as_ref()?;
        (f.token == token && f.seq > self.seq).then(|| f.answer.clone())
    }
}

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        self.waiters.held.fetch_sub(self.charge, Ordering::AcqRel);
        let mut map = self.waiters.shard(&self.scope);
        if let Some(w) = map.get_mut(&self.scope) {
            w.count -= 1;
            if w.count == 0 {
                map.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::store::Fingerprint;

    fn total(w: &Waiters) -> usize {
        w.shards.iter().map(|s| s.lock().unwrap().len()).sum()
    }

    #[test]
    fn bounded_per_scope_and_freed_on_drop() {
        let w = Arc::new(Waiters::default());
        let (a, b) = (ScopeKey([1; 32]), ScopeKey([2; 32]));
        let enter = |scope, max| w.enter(scope, max, 10, usize::MAX);
        let slots: Vec<_> = (0..3).map(|_| enter(a, 3).expect("a place")).collect();
        assert_eq!(
            enter(a, 3).err(),
            Some(Refused::KeyFull),
            "the fourth waiter of one scope is refused"
        );
        let other = enter(b, 3).expect("other scopes are unaffected");
        assert_eq!(w.count(&a), 3);
        assert!(w.any(&a) && w.any(&b));
        drop(slots);
        assert_eq!(w.count(&a), 0);
        assert!(!w.any(&a));
        assert_eq!(total(&w), 1);
        drop(other);
        assert_eq!(total(&w), 0);
        assert_eq!(
            enter(a, 0).err(),
            Some(Refused::KeyFull),
            "max 0: nobody waits"
        );
        assert_eq!(total(&w), 0);
        assert_eq!(w.held(), 0);
    }

    /// The bytes held by the waiters of every scope together are bounded: a waiter that would
    /// go past `max_bytes` is refused whatever its scope, and a leaving waiter gives its bytes
    /// back.
    #[test]
    fn bounded_in_all_by_the_bytes_held() {
        let w = Arc::new(Waiters::default());
        let charge = 64 * 1024 + WAITER_OVERHEAD;
        let max_bytes = 10 * charge;
        let slots: Vec<_> = (0..10u8)
            .map(|i| {
                w.enter(ScopeKey([i; 32]), 1000, 64 * 1024, max_bytes)
                    .expect("room for ten")
            })
            .collect();
        assert_eq!(w.held(), max_bytes);
        for i in [0u8, 200] {
            assert_eq!(
                w.enter(ScopeKey([i; 32]), 1000, 64 * 1024, max_bytes).err(),
                Some(Refused::LayerFull),
                "an eleventh waiter is refused, on a scope with waiters or a new one"
            );
        }
        assert_eq!(total(&w), 10, "a refused waiter leaves no entry behind");
        let small = w.enter(ScopeKey([201; 32]), 1000, 0, max_bytes + WAITER_OVERHEAD);
        assert!(small.is_ok(), "what fits still waits");
        drop(slots);
        drop(small);
        assert_eq!(w.held(), 0, "every byte is given back");
        assert_eq!(total(&w), 0);
    }

    /// A failure goes to the waiters of its claim that arrived before it, and to nobody else;
    /// with nobody waiting, nothing is kept (and the answer is never made).
    #[tokio::test]
    async fn a_failure_goes_to_the_waiters_that_were_waiting_for_it() {
        let w = Arc::new(Waiters::default());
        let scope = ScopeKey([3; 32]);
        let (leader, other) = (Token(1), Token(2));
        let answer = || {
            SharedFailure::Answer(Arc::new(Record::new(
                Fingerprint([0; 32]),
                StatusCode::SERVICE_UNAVAILABLE,
                HeaderMap::new(),
                Bytes::from_static(b"down"),
            )))
        };
        w.share_failure(scope, leader, || panic!("nobody waits: no answer is made"));
        assert_eq!(total(&w), 0);

        let early = w.enter(scope, 10, 0, usize::MAX).unwrap();
        {
            let notified = early.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            assert!(early.failure(leader).is_none());
            w.share_failure(scope, leader, answer);
            notified.await;
        }
        match early.failure(leader).expect("the early waiter takes it") {
            SharedFailure::Answer(a) => assert_eq!(a.status(), StatusCode::SERVICE_UNAVAILABLE),
            other => panic!("expected the leader's answer, got {other:?}"),
        }
        assert!(early.failure(other).is_none(), "only for its own claim");

        // A request that arrives after the hand-over (the client's own retry) does not take it.
        let late = w.enter(scope, 10, 0, usize::MAX).unwrap();
        assert!(late.failure(leader).is_none());
        drop((early, late));
        assert_eq!(total(&w), 0, "gone with the last waiter");
    }
}

//! Lease renewal: one task per layer renews the lease of every claim the layer holds.
//!
//! A task per claim would cost more than the rest of a claim's work with `MemoryStore` (spawning
//! and aborting a task and arming its timer for every first execution; see `BENCHMARKS.md`), so
//! the claims of one layer share one task. Each claim is renewed with its own lease; the task
//! ticks every fourth of the shortest lease held, so layers built from one base with different
//! [`lease`](crate::IdempotencyLayer::lease)s never renew a short lease too late.
//!
//! A claim is renewed until the end of its lifetime
//! ([`max_claim_lifetime`](crate::IdempotencyLayer::max_claim_lifetime)), not longer: the first
//! tick past it drops the claim (counted as lapsed, logged), and its lease runs out at most one
//! lease later. So no write, however stuck, keeps its key in flight for longer than its
//! lifetime and a lease.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::stats::Counters;
use crate::store::{FastMap, IdempotencyStore, ScopeKey, StoreError, Token};

/// The claims a layer holds, renewed by one task.
///
/// The task is spawned by the first claim and ends when no claim is held at a tick (the next
/// claim spawns it again), when the layer is gone, or with its runtime.
pub(crate) struct Renewals {
    state: Mutex<RenewState>,
    /// Wakes the task early when a claim with a shorter lease than any held arrives.
    shorter_lease: Notify,
    /// Where claims that reach the end of their lifetime are counted.
    counters: Arc<Counters>,
}

/// A claim renewed: its scope, its lease, and the end of its lifetime (`None`: too far for the
/// clock to express).
#[derive(Clone, Copy)]
struct Renewed {
    scope: ScopeKey,
    lease: Duration,
    until: Option<Instant>,
}

#[derive(Default)]
struct RenewState {
    held: FastMap<Token, Renewed>,
    running: bool,
    /// The task's current tick period: a fourth of the shortest lease it renews.
    period: Duration,
    /// A renewal failed: the next one comes soon.
    retry_soon: bool,
}

impl fmt::Debug for Renewals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Renewals")
            .field("held", &st.held.len())
            .field("running", &st.running)
            .field("period", &st.period)
            .finish()
    }
}

/// How often a lease is renewed: every fourth of it, so that two renewals in a row can fail and
/// the third still lands a quarter of a lease before the lapse (every third left the third
/// renewal racing the lapse: a store outage shorter than the lease could lapse it).
fn renewal_period(lease: Duration) -> Duration {
    (lease / 4).max(Duration::from_millis(10))
}

impl Renewals {
    pub(crate) fn new(counters: Arc<Counters>) -> Self {
        Renewals {
            state: Mutex::default(),
            shorter_lease: Notify::new(),
            counters,
        }
    }

    fn lock(&self) -> MutexGuard<'_, RenewState> {
        // Every critical section leaves the map consistent: a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `token` on `scope` until [`remove`](Self::remove), or until `until` (the end of its
    /// lifetime); starts the task if needed.
    pub(crate) fn add<St: IdempotencyStore>(
        self: &Arc<Self>,
        store: &St,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
        until: Option<Instant>,
    ) {
        let period = renewal_period(lease);
        let mut st = self.lock();
        st.held.insert(
            token,
            Renewed {
                scope,
                lease,
                until,
            },
        );
        if !st.running {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                st.running = true;
                st.period = period;
                rt.spawn(renew_task(store.clone(), Arc::downgrade(self)));
            }
        } else if period < st.period {
            st.period = period;
            drop(st);
            self.shorter_lease.notify_one();
        }
    }

    /// Stops renewing every claim held (a drained layer's claims lapse with their leases).
    pub(crate) fn stop_all(&self) -> usize {
        let mut st = self.lock();
        let n = st.held.len();
        st.held.clear();
        n
    }

    /// Does a claim of this layer hold `scope` now? A scan of every claim held: for the rare
    /// path that needs it (the store failed, and the layer fails open).
    pub(crate) fn holds(&self, scope: &ScopeKey) -> bool {
        self.lock().held.values().any(|c| c.scope == *scope)
    }

    pub(crate) fn remove(&self, token: Token) {
        self.lock().held.remove(&token);
    }

    /// The claim `token` reached the end of its lifetime: it is no longer renewed; counted and
    /// logged once, by whoever sees it first (this, or the task's tick). True if it was held.
    pub(crate) fn expire(&self, token: Token) -> bool {
        let Some(r) = self.lock().held.remove(&token) else {
            return false;
        };
        self.lapsed(r.scope);
        true
    }

    fn lapsed(&self, scope: ScopeKey) {
        self.counters.lapsed();
        tracing::warn!(
            ?scope,
            "idempotency: a claim reached max_claim_lifetime; its lease is no longer renewed and \
             lapses (a retry may then execute again)"
        );
    }

    /// The tick period of the running task (for tests).
    #[cfg(test)]
    pub(crate) fn period(&self) -> Duration {
        self.lock().period
    }
}

/// Clears `running` if the task is dropped (its runtime shut down) before it could.
struct Running(Option<Weak<Renewals>>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(r) = self.0.take().and_then(|w| w.upgrade()) {
            r.lock().running = false;
        }
    }
}

async fn renew_task<St: IdempotencyStore>(store: St, renewals: Weak<Renewals>) {
    let mut running = Running(Some(renewals.clone()));
    // The ticks keep a fixed cadence, measured from the previous tick's start: a renewal that
    // takes long (or fails after a timeout) does not push the next one later, so the leases'
    // margins do not drift away.
    let mut next: Option<Instant> = None;
    let in_flight = Arc::new(AtomicUsize::new(0));
    loop {
        let Some(r) = renewals.upgrade() else {
            running.0 = None;
            return;
        };
        // Sleep until the next tick; a claim with a shorter lease cuts the sleep short, and the
        // loop starts over with the shorter period. (Holding `r` meanwhile keeps the renewals
        // alive one period longer than their layer at most.)
        let period = r.lock().period;
        let due = *next.get_or_insert_with(|| Instant::now() + period);
        let woken = tokio::time::timeout_at(due, r.shorter_lease.notified())
            .await
            .is_ok();
        drop(r);
        if woken {
            // A renewal failed (tried again shortly), or a claim with a shorter lease came.
            let retry_soon = renewals
                .upgrade()
                .is_some_and(|r| std::mem::take(&mut r.lock().retry_soon));
            next = retry_soon.then(|| Instant::now() + (period / 8).max(Duration::from_millis(10)));
            continue;
        }
        let batch: Vec<(ScopeKey, Token, Duration)> = {
            let Some(r) = renewals.upgrade() else {
                running.0 = None;
                return;
            };
            let mut st = r.lock();
            // Claims past their lifetime are renewed no more.
            let now = Instant::now();
            let mut lapsed = Vec::new();
            st.held.retain(|_, c| {
                let live = c.until.is_none_or(|until| now < until);
                if !live {
                    lapsed.push(c.scope);
                }
                live
            });
            if st.held.is_empty() {
                st.running = false;
                running.0 = None;
                drop(st);
                lapsed.into_iter().for_each(|scope| r.lapsed(scope));
                return;
            }
            // The next period follows the leases still held: when the short ones are gone, the
            // task ticks less often again.
            st.period = st
                .held
                .values()
                .map(|c| renewal_period(c.lease))
                .min()
                .unwrap_or(st.period);
            let batch = st
                .held
                .iter()
                .map(|(t, c)| (c.scope, *t, c.lease))
                .collect();
            drop(st);
            lapsed.into_iter().for_each(|scope| r.lapsed(scope));
            batch
        };
        // The next tick, a period after this one began.
        let period = renewals.upgrade().map_or(period, |r| r.lock().period);
        next = Some((due + period).max(Instant::now()));
        // One call for every claim held: one round trip on the stores that batch it.
        // The tick's renewal runs as a task of its own, so that a slow reply (shorter than the
        // lease, but longer than a period) does not hold back the next ticks: those renew
        // meanwhile. At most a few run at once, so that a store that hangs does not pile them up.
        if in_flight.load(Ordering::Relaxed) >= MAX_RENEWALS_IN_FLIGHT {
            tracing::warn!("idempotency: lease renewals are not answered; skipping a tick");
            continue;
        }
        in_flight.fetch_add(1, Ordering::Relaxed);
        let renewal = renew_once(store.clone(), renewals.clone(), batch, in_flight.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(renewal);
            }
            Err(_) => renewal.await,
        }
    }
}

/// The most renewals of one task in flight at once.
const MAX_RENEWALS_IN_FLIGHT: usize = 4;

/// One tick's renewal of `batch`.
async fn renew_once<St: IdempotencyStore>(
    store: St,
    renewals: Weak<Renewals>,
    batch: Vec<(ScopeKey, Token, Duration)>,
    in_flight: Arc<AtomicUsize>,
) {
    struct Done(Arc<AtomicUsize>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _done = Done(in_flight);
    // One call for every claim held: one round trip on the stores that batch it. Bounded by half
    // the shortest lease in the batch: a call the store never answers gives its place back (it
    // kept it for ever, and with every place taken no later tick renewed anything, so a claim
    // made after the store healed lapsed under its live leader), and counts as failed, so the
    // next renewal comes soon. (Half a lease: the tick after it, a fourth of a lease later, still
    // renews in time.)
    let bound = batch
        .iter()
        .map(|(_, _, lease)| *lease)
        .min()
        .map_or(Duration::from_secs(1), |lease| {
            (lease / 2).max(Duration::from_millis(10))
        });
    let renewed = match tokio::time::timeout(bound, store.renew_many(&batch)).await {
        Ok(renewed) => renewed,
        Err(_) => batch
            .iter()
            .map(|_| {
                Err(StoreError::Backend(
                    "the store did not answer a lease renewal within half a lease".into(),
                ))
            })
            .collect(),
    };
    // A failed renewal (the store is briefly unreachable) is tried again shortly; only a fenced
    // claim (taken over or forgotten) is no longer renewed. (A store that answered fewer results
    // than claims leaves the rest to the next tick.)
    let mut fenced = Vec::new();
    let mut failed = false;
    for ((scope, token, _), r) in batch.iter().zip(renewed) {
        match r {
            Ok(()) => {}
            Err(StoreError::Fenced) => fenced.push(*token),
            Err(e) => {
                failed = true;
                tracing::warn!(
                    ?scope,
                    error = %e,
                    "idempotency: lease renewal failed; trying again shortly"
                );
            }
        }
    }
    if let Some(r) = renewals.upgrade() {
        let mut st = r.lock();
        for token in fenced {
            st.held.remove(&token);
        }
        if failed {
            // Tried again an eighth of a period later, not a whole one: with a tick every
            // fourth of the lease, a store outage shorter than about three quarters of the
            // lease then never lapses a claim.
            st.retry_soon = true;
            drop(st);
            r.shorter_lease.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{Fault, FaultStore, Op, Reply, Rule};
    use crate::store::{Begin, Fingerprint, MemoryStore};

    /// Every claim held is renewed in one `renew_many` per tick, never one `renew` per claim
    /// (which queued a thousand statements for a 16-connection pool at once); a claim the store
    /// fences is dropped from the next batch.
    #[tokio::test(start_paused = true)]
    async fn each_tick_renews_every_claim_in_one_call() {
        let store = FaultStore::new(MemoryStore::new());
        let renewals = Arc::new(Renewals::new(Arc::default()));
        let lease = Duration::from_secs(4);
        let mut tokens = Vec::new();
        for i in 0..100u8 {
            let scope = ScopeKey([i; 32]);
            let Ok(Begin::New(t)) = store.begin(scope, Fingerprint([0; 32]), lease).await else {
                panic!("fresh scope");
            };
            renewals.add(&store, scope, t, lease, None);
            tokens.push((scope, t));
        }
        // Ticks at 1 s, 2 s, 3 s (the period is a fourth of the lease).
        tokio::time::sleep(Duration::from_millis(3500)).await;
        let batches = store.calls(Op::RenewMany);
        assert_eq!(batches.made, 3, "one call per tick");
        assert_eq!(batches.answers.len(), 300, "each with the 100 claims");
        assert_eq!(store.calls(Op::Renew).made, 0, "never one renew per claim");
        // Forgotten (fenced): no longer renewed from the tick after.
        let (scope, _) = tokens[7];
        assert!(store.forget(scope).await.unwrap());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let batches = store.calls(Op::RenewMany);
        assert_eq!(batches.made, 5);
        assert_eq!(
            batches.answers.len(),
            100 * 4 + 99,
            "the forgotten claim was in the 4th batch only"
        );
        let fenced = batches.answers.iter().filter(|&&a| a == Reply::Fenced);
        assert_eq!(fenced.count(), 1);
        for (scope, token) in tokens.into_iter().filter(|&(s, _)| s != scope) {
            assert!(
                store.inner().renew(scope, token, lease).await.is_ok(),
                "claims renewed in batches still hold after 5 s on a 4 s lease"
            );
        }
    }

    /// Two layers made from one base with leases of 4 s and 400 s: the 4 s claim is renewed in
    /// time though the 400 s claim started the task.
    #[tokio::test(start_paused = true)]
    async fn each_claim_is_renewed_within_its_own_lease() {
        let store = MemoryStore::new();
        let renewals = Arc::new(Renewals::new(Arc::default()));
        let (long, short) = (ScopeKey([1; 32]), ScopeKey([2; 32]));
        let claim = |scope, lease| {
            let store = store.clone();
            async move {
                match store.begin(scope, Fingerprint([0; 32]), lease).await {
                    Ok(Begin::New(t)) => t,
                    other => panic!("expected a new claim, got {other:?}"),
                }
            }
        };
        let long_token = claim(long, Duration::from_secs(400)).await;
        renewals.add(&store, long, long_token, Duration::from_secs(400), None);
        tokio::task::yield_now().await;
        assert_eq!(renewals.period(), Duration::from_secs(100));

        let short_token = claim(short, Duration::from_secs(4)).await;
        renewals.add(&store, short, short_token, Duration::from_secs(4), None);
        assert_eq!(renewals.period(), Duration::from_secs(1));
        // Ten short leases later, the short claim is still held by its token.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(
            store
                .renew(short, short_token, Duration::from_secs(4))
                .await
                .is_ok(),
            "the 4 s claim lapsed: it was not renewed in time"
        );
        match store
            .begin(short, Fingerprint([0; 32]), Duration::from_secs(4))
            .await
        {
            Ok(Begin::InFlight { token, .. }) => assert_eq!(token, short_token),
            other => panic!("the 4 s claim should still be in flight, got {other:?}"),
        }
        // When the short claim ends, the task goes back to the long period.
        renewals.remove(short_token);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(renewals.period(), Duration::from_secs(100));
    }

    /// A store that takes 200 ms per renewal refuses renewals for two thirds of a lease (2.7 s
    /// of 4 s), starting just after one: the claim survives, renewed again right after the
    /// outage. (With a tick every third of the lease, each a full period after the last one
    /// ended, the slow replies pushed every tick later, and the first renewal after the outage
    /// came after the lapse.)
    #[tokio::test(start_paused = true)]
    async fn a_slow_store_that_refuses_renewals_for_most_of_a_lease_does_not_lapse_it() {
        let store = FaultStore::new(MemoryStore::new());
        let slow = || Rule::new(Op::RenewMany, Fault::Delay(Duration::from_millis(200)));
        store.inject(slow());
        let renewals = Arc::new(Renewals::new(Arc::default()));
        let lease = Duration::from_secs(4);
        let scope = ScopeKey([9; 32]);
        let Ok(Begin::New(token)) = store.begin(scope, Fingerprint([0; 32]), lease).await else {
            panic!("fresh scope");
        };
        renewals.add(&store, scope, token, lease, None);
        store
            .until(Duration::from_secs(10), "the first renewal", |s| {
                s.calls(Op::RenewMany).made >= 1
            })
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Refused from here (the first rule a call matches applies), then slow again.
        store.heal();
        store.inject(Rule::new(Op::RenewMany, Fault::Fail));
        store.inject(slow());
        // A duplicate knocks every 50 ms: it must find the claim held every time.
        let knock = || async {
            match store
                .inner()
                .begin(scope, Fingerprint([0; 32]), lease)
                .await
            {
                Ok(Begin::InFlight { token: held, .. }) => assert_eq!(held, token),
                other => panic!("the claim lapsed under a live leader: {other:?}"),
            }
        };
        for _ in 0..54 {
            knock().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        store.heal();
        store.inject(slow());
        for _ in 0..60 {
            knock().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One renewal's reply takes 80 % of the lease (the store was slow for a moment): the
    /// next ticks renew meanwhile, and the claim never lapses. (Before, the task waited for
    /// that reply before its next tick, and the lease lapsed under the live leader.)
    #[tokio::test(start_paused = true)]
    async fn a_slow_renewal_reply_does_not_hold_back_the_next_renewals() {
        let store = FaultStore::new(MemoryStore::new());
        let renewals = Arc::new(Renewals::new(Arc::default()));
        let lease = Duration::from_secs(4);
        let scope = ScopeKey([7; 32]);
        let Ok(Begin::New(token)) = store.begin(scope, Fingerprint([0; 32]), lease).await else {
            panic!("fresh scope");
        };
        renewals.add(&store, scope, token, lease, None);
        store
            .until(Duration::from_secs(10), "the first renewal", |s| {
                s.calls(Op::RenewMany).made >= 1
            })
            .await;
        // The next renewal (one only) is answered 3.2 s late.
        store.inject(Rule::new(Op::RenewMany, Fault::Delay(Duration::from_millis(3200))).times(1));
        for _ in 0..160 {
            match store
                .inner()
                .begin(scope, Fingerprint([0; 32]), lease)
                .await
            {
                Ok(Begin::InFlight { token: held, .. }) => assert_eq!(held, token),
                other => panic!("the claim lapsed under a live leader: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A store that hangs four `renew_many` calls, then is healthy again: a claim made
    /// afterwards is renewed and never lapses. (Each hung call kept one of the task's four
    /// places for ever, every later tick was skipped while any claim was held, and a claim made
    /// on the healthy store lapsed after one lease under its live leader.)
    #[tokio::test(start_paused = true)]
    async fn renewals_the_store_never_answers_free_their_place() {
        let store = FaultStore::new(MemoryStore::new());
        let renewals = Arc::new(Renewals::new(Arc::default()));
        let lease = Duration::from_secs(4);
        let claim = |n: u8| {
            let store = store.clone();
            async move {
                let scope = ScopeKey([n; 32]);
                match store.begin(scope, Fingerprint([0; 32]), lease).await {
                    Ok(Begin::New(t)) => (scope, t),
                    other => panic!("fresh scope, got {other:?}"),
                }
            }
        };
        // A long-lived claim keeps the task running; its renewals hang four times.
        store.inject(Rule::new(Op::RenewMany, Fault::Hang).times(4));
        let (first, first_token) = claim(1).await;
        renewals.add(&store, first, first_token, lease, None);
        store
            .until(Duration::from_secs(60), "four renewals hung", |s| {
                s.calls(Op::RenewMany).made >= 4
            })
            .await;
        // The store is healthy from here: a new claim must be renewed.
        let (scope, token) = claim(2).await;
        renewals.add(&store, scope, token, lease, None);
        for _ in 0..(3 * 4 * 20) {
            match store
                .inner()
                .begin(scope, Fingerprint([0; 32]), lease)
                .await
            {
                Ok(Begin::InFlight { token: held, .. }) => assert_eq!(held, token),
                other => panic!("the claim lapsed under a live leader: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

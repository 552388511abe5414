//! A held claim: completes or releases exactly once, renews its lease while held, and releases
//! itself if dropped unfinished.
//!
//! Leases are renewed by one task per layer ([`Renewals`]) for every claim the layer holds, not
//! by a task per claim: spawning and aborting a task (and arming its timer) for every first
//! execution cost more than the rest of the claim's work with `MemoryStore` (see
//! `BENCHMARKS.md`).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::metrics::Counters;
use crate::store::{IdempotencyStore, Record, ScopeKey, StoreError, Token};

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The store operations of one claim, with the store type erased (so bodies need not name it).
trait ClaimOps: Send + Sync + 'static {
    fn complete(self: Box<Self>, record: Record) -> BoxFuture;
    fn release(self: Box<Self>) -> BoxFuture;
}

struct StoreClaim<St> {
    store: St,
    scope: ScopeKey,
    token: Token,
    ttl: Duration,
    lease: Duration,
    counters: Arc<Counters>,
    /// Renews the lease while the claim is held; the claim leaves it when it ends.
    renewals: Arc<Renewals>,
}

impl<St> Drop for StoreClaim<St> {
    fn drop(&mut self) {
        self.renewals.remove(self.token);
    }
}

/// The claims a layer holds, renewed every third of the lease by one task per layer.
///
/// The task is spawned by the first claim and ends when no claim is held at a tick (the next
/// claim spawns it again), when the layer is gone, or with its runtime.
#[derive(Default)]
pub(crate) struct Renewals {
    state: Mutex<RenewState>,
}

#[derive(Default)]
struct RenewState {
    held: HashMap<Token, ScopeKey>,
    running: bool,
}

impl fmt::Debug for Renewals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("Renewals")
            .field("held", &st.held.len())
            .field("running", &st.running)
            .finish()
    }
}

impl Renewals {
    fn lock(&self) -> std::sync::MutexGuard<'_, RenewState> {
        // Every critical section leaves the map consistent: a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `token` on `scope` until [`remove`](Self::remove); starts the task if needed.
    fn add<St: IdempotencyStore>(
        self: &Arc<Self>,
        store: &St,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) {
        let mut st = self.lock();
        st.held.insert(token, scope);
        if !st.running {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                st.running = true;
                rt.spawn(renew_task(store.clone(), Arc::downgrade(self), lease));
            }
        }
    }

    fn remove(&self, token: Token) {
        self.lock().held.remove(&token);
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

async fn renew_task<St: IdempotencyStore>(store: St, renewals: Weak<Renewals>, lease: Duration) {
    let mut running = Running(Some(renewals.clone()));
    let period = (lease / 3).max(Duration::from_millis(10));
    let mut every = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let batch: Vec<(Token, ScopeKey)> = {
            let Some(r) = renewals.upgrade() else {
                running.0 = None;
                return;
            };
            let mut st = r.lock();
            if st.held.is_empty() {
                st.running = false;
                running.0 = None;
                return;
            }
            st.held.iter().map(|(t, s)| (*t, *s)).collect()
        };
        let renewed = futures_util::future::join_all(
            batch
                .iter()
                .map(|&(token, scope)| store.renew(scope, token, lease)),
        )
        .await;
        // A failed renewal (the store is briefly unreachable) is tried again at the next tick;
        // only a fenced claim (taken over or forgotten) is no longer renewed.
        let fenced = batch
            .iter()
            .zip(renewed)
            .filter(|(_, r)| matches!(r, Err(StoreError::Fenced)));
        if let Some(r) = renewals.upgrade() {
            let mut st = r.lock();
            for ((token, _), _) in fenced {
                st.held.remove(token);
            }
        }
    }
}

impl<St: IdempotencyStore> ClaimOps for StoreClaim<St> {
    fn complete(self: Box<Self>, record: Record) -> BoxFuture {
        Box::pin(async move {
            let (store, scope, token, ttl) = (&self.store, self.scope, self.token, self.ttl);
            let op = || store.complete(scope, token, record.clone(), ttl);
            match through_outage(self.lease, "complete", op).await {
                Ok(()) => {
                    self.counters.recorded();
                    tracing::debug!(scope = ?self.scope, "idempotency: recorded");
                }
                Err(e) => log_store_error(&self.counters, "complete", &e),
            }
        })
    }

    fn release(self: Box<Self>) -> BoxFuture {
        Box::pin(async move {
            let op = || self.store.release(self.scope, self.token);
            match through_outage(self.lease, "release", op).await {
                Ok(()) => {
                    self.counters.released();
                    tracing::debug!(scope = ?self.scope, "idempotency: released");
                }
                Err(e) => log_store_error(&self.counters, "release", &e),
            }
        })
    }
}

/// Runs a claim's final store operation through a brief store outage: a backend failure is
/// retried with backoff (50 ms doubling to 1 s) while the claim's lease could still hold (the
/// renewal keeps running meanwhile). Without this, a record lost to a 2-second outage leaves the
/// key in flight until its lease lapses, and the client's retry then executes the write again.
async fn through_outage<F, Fut>(
    lease: Duration,
    op_name: &'static str,
    mut op: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let give_up = tokio::time::Instant::now() + lease;
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

pub(crate) fn log_store_error(counters: &Counters, op: &'static str, e: &StoreError) {
    match e {
        // Another leader took over (lease lapsed) or an admin forgot the key: not a failure
        // of the store, but worth knowing.
        StoreError::Fenced => {
            tracing::warn!(
                op,
                "idempotency: claim was fenced (lease lapsed or key forgotten)"
            )
        }
        e => {
            counters.store_error();
            tracing::warn!(op, error = %e, "idempotency: store operation failed");
        }
    }
}

/// A claim held by this process.
pub(crate) struct Claim {
    ops: Option<Box<dyn ClaimOps>>,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("held", &self.ops.is_some())
            .finish()
    }
}

impl Claim {
    pub(crate) fn new<St: IdempotencyStore>(
        store: St,
        scope: ScopeKey,
        token: Token,
        ttl: Duration,
        lease: Duration,
        counters: Arc<Counters>,
        renewals: &Arc<Renewals>,
    ) -> Self {
        renewals.add(&store, scope, token, lease);
        Claim {
            ops: Some(Box::new(StoreClaim {
                store,
                scope,
                token,
                ttl,
                lease,
                counters,
                renewals: renewals.clone(),
            })),
        }
    }

    /// Stores `record` in place of the claim.
    pub(crate) fn complete(mut self, record: Record) -> impl Future<Output = ()> + Send + 'static {
        let ops = self.ops.take();
        async move {
            if let Some(ops) = ops {
                ops.complete(record).await
            }
        }
    }

    /// Releases the claim so a retry executes again.
    pub(crate) fn release(mut self) -> impl Future<Output = ()> + Send + 'static {
        let ops = self.ops.take();
        async move {
            if let Some(ops) = ops {
                ops.release().await
            }
        }
    }
}

/// Spawns `fut` on the current tokio runtime; without one, logs that the claim is left to lapse.
pub(crate) fn spawn_detached(fut: impl Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn(fut);
        }
        Err(_) => tracing::warn!(
            "idempotency: no tokio runtime to finish a claim; it is left to lapse with its lease"
        ),
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(ops) = self.ops.take() {
            spawn_detached(ops.release());
        }
    }
}

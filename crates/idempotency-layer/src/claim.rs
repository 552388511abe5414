//! A held claim: completes or releases exactly once, renews its lease while held (through the
//! layer's [`Renewals`]), and releases itself if dropped unfinished.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::observe::{self, Op, StoreKind};
use crate::renewal::Renewals;
use crate::shared::Shared;
use crate::stats::Counters;
use crate::store::{
    retry_through_outage, Begin, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, Token,
};

/// A claim's store operation, boxed once (the store type is erased).
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// How a claim whose handler wrote its record in a transaction of its own turned out
/// ([`Claim::settle`]).
#[derive(Debug)]
pub(crate) enum Settled {
    /// No such transaction committed: the claim was still this request's, and is now released
    /// (a retry executes again).
    Released,
    /// A transaction of the handler committed this record.
    Recorded(Arc<Record>),
    /// Neither could be established (the claim was taken over or forgotten, or the store is
    /// unreachable): nothing was changed.
    Unknown,
}

/// A claim's store operations, with the store type erased (so bodies need not name it). Every
/// store has them, called on the layer's one `Arc` of it: a claim holds a clone of that `Arc`,
/// not a box of its own.
trait ClaimStore: Send + Sync + 'static {
    fn complete(self: Arc<Self>, held: Held, record: Record) -> BoxFuture;
    fn release(self: Arc<Self>, held: Held) -> BoxFuture;
    fn settle(self: Arc<Self>, held: Held, fingerprint: Fingerprint) -> SettleFuture;
}

/// [`Claim::settle`]'s store operations, boxed once.
pub(crate) type SettleFuture = Pin<Box<dyn Future<Output = Settled> + Send + 'static>>;

/// What a held claim is: its scope and token, and the lease renewed while it is held.
struct Held {
    scope: ScopeKey,
    token: Token,
    ttl: Duration,
    lease: Duration,
    counters: Arc<Counters>,
    /// Renews the lease while the claim is held; the claim leaves it when it ends.
    renewals: Arc<Renewals>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renewals.remove(self.token);
    }
}

impl<St: IdempotencyStore> ClaimStore for St {
    fn complete(self: Arc<Self>, held: Held, record: Record) -> BoxFuture {
        Box::pin(async move {
            let (store, scope, token, ttl) = (&*self, held.scope, held.token, held.ttl);
            // Shared, so that a retry through an outage resends it without copying it.
            let record = Arc::new(record);
            let kind = StoreKind::of(store);
            let op = || {
                observe::timed(
                    Op::Complete,
                    kind,
                    store.complete(scope, token, record.clone(), ttl),
                )
            };
            // Through a brief store outage, while the lease could still hold (the renewal keeps
            // running meanwhile).
            match retry_through_outage(held.lease, "complete", op).await {
                Ok(()) => {
                    held.counters.recorded();
                    tracing::debug!(?scope, "idempotency: recorded");
                }
                Err(e) => log_store_error(&held.counters, kind, Op::Complete, &e),
            }
        })
    }

    fn release(self: Arc<Self>, held: Held) -> BoxFuture {
        Box::pin(async move {
            let store = &*self;
            let kind = StoreKind::of(store);
            let op = || observe::timed(Op::Release, kind, store.release(held.scope, held.token));
            match retry_through_outage(held.lease, "release", op).await {
                Ok(()) => {
                    held.counters.released();
                    tracing::debug!(scope = ?held.scope, "idempotency: released");
                }
                Err(e) => log_store_error(&held.counters, kind, Op::Release, &e),
            }
        })
    }

    fn settle(self: Arc<Self>, held: Held, fingerprint: Fingerprint) -> SettleFuture {
        Box::pin(async move {
            let (store, scope) = (&*self, held.scope);
            let kind = StoreKind::of(store);
            // Fenced: the claim row is ours only while no transaction of the handler committed
            // the record, so a release that succeeds proves none did.
            let release = || observe::timed(Op::Release, kind, store.release(scope, held.token));
            match retry_through_outage(held.lease, "release", release).await {
                Ok(()) => {
                    held.counters.released();
                    tracing::debug!(
                        ?scope,
                        "idempotency: the handler's transaction did not commit; released"
                    );
                    return Settled::Released;
                }
                Err(StoreError::Fenced) => {}
                Err(e) => {
                    log_store_error(&held.counters, kind, Op::Release, &e);
                    return Settled::Unknown;
                }
            }
            // Not ours any more: committed by the handler's transaction, or taken over or
            // forgotten meanwhile. What the scope holds now tells which.
            let begin =
                observe::timed(Op::Begin, kind, store.begin(scope, fingerprint, held.lease));
            match begin.await {
                Ok(Begin::Completed(record)) if record.fingerprint == fingerprint => {
                    held.counters.recorded();
                    Settled::Recorded(record)
                }
                Ok(Begin::New(token)) => {
                    // Forgotten meanwhile: hand back the claim this look made.
                    if let Err(e) = store.release(scope, token).await {
                        log_store_error(&held.counters, kind, Op::Release, &e);
                    }
                    Settled::Unknown
                }
                Ok(_) => Settled::Unknown,
                Err(e) => {
                    log_store_error(&held.counters, kind, Op::Begin, &e);
                    Settled::Unknown
                }
            }
        })
    }
}

pub(crate) fn log_store_error(counters: &Counters, store: StoreKind, op: Op, e: &StoreError) {
    let store_op = (op, store);
    let op = op.as_str();
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
            observe::store_error(store_op.0, store_op.1);
            tracing::warn!(op, error = %e, "idempotency: store operation failed");
        }
    }
}

/// A claim held by this process.
pub(crate) struct Claim {
    held: Option<(Arc<dyn ClaimStore>, Held)>,
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claim")
            .field("held", &self.held.is_some())
            .finish()
    }
}

impl Claim {
    /// The claim `token` on `scope`, its store operations made on `store` (the layer's).
    pub(crate) fn new<St: IdempotencyStore>(
        store: Arc<St>,
        scope: ScopeKey,
        token: Token,
        ttl: Duration,
        lease: Duration,
        shared: &Shared,
    ) -> Self {
        shared.renewals.add(&*store, scope, token, lease);
        let held = Held {
            scope,
            token,
            ttl,
            lease,
            counters: shared.counters.clone(),
            renewals: shared.renewals.clone(),
        };
        Claim {
            held: Some((store, held)),
        }
    }

    /// Stores `record` in place of the claim. The future is the store operation itself (boxed
    /// once, by the store-erased claim), so callers can hold or spawn it without boxing again.
    pub(crate) fn complete(mut self, record: Record) -> BoxFuture {
        match self.held.take() {
            Some((store, held)) => store.complete(held, record),
            None => Box::pin(std::future::ready(())),
        }
    }

    /// Releases the claim so a retry executes again.
    pub(crate) fn release(mut self) -> BoxFuture {
        match self.held.take() {
            Some((store, held)) => store.release(held),
            None => Box::pin(std::future::ready(())),
        }
    }

    /// Ends the claim whose record the handler's own transaction stored: no store operation
    /// (the lease renewal stops).
    pub(crate) fn recorded_in_transaction(mut self) {
        if let Some((_, held)) = self.held.take() {
            held.counters.recorded();
            tracing::debug!(
                scope = ?held.scope,
                "idempotency: recorded in the handler's transaction"
            );
        }
    }

    /// Ends the claim whose handler wrote the record (for a request with `fingerprint`) in a
    /// transaction of its own but returned something other than that write's response: a fenced
    /// release, which succeeds only if no such transaction committed; if it did, the record it
    /// stored.
    pub(crate) fn settle(mut self, fingerprint: Fingerprint) -> SettleFuture {
        match self.held.take() {
            Some((store, held)) => store.settle(held, fingerprint),
            None => Box::pin(std::future::ready(Settled::Unknown)),
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
        if let Some((store, held)) = self.held.take() {
            spawn_detached(store.release(held));
        }
    }
}

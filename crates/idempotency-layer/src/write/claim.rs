//! A held claim: completes or releases exactly once, renews its lease while held (through the
//! layer's [`Renewals`](crate::write::renewal::Renewals)) until the end of its lifetime, hands its
//! failure to the duplicates waiting for it, and releases itself if dropped unfinished.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use crate::config::Config;
use crate::observe::{self, Op};
use crate::shared::Shared;
use crate::stats::Counters;
use crate::store::{
    retry_through_outage, Backend, Begin, Fingerprint, IdempotencyStore, Record, ScopeKey,
    StoreError, Token, FOREVER,
};
use crate::write::detached::{self, BoxFuture, DetachTo, Kind};
use crate::write::pipe::HeldBytes;
use crate::write::waiters::SharedFailure;
use crate::write::WithinLease;

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

/// Stores `record` in place of `held`'s claim, retrying through a store outage for at most
/// `within`.
async fn complete_through_outage<St: IdempotencyStore>(
    store: &St,
    held: &Held,
    record: &Arc<Record>,
    within: Duration,
) -> Result<(), StoreError> {
    let (scope, token, ttl) = (held.scope, held.token, held.config.ttl);
    let kind = store.backend();
    // Each try is bounded by one lease, whatever the store's own timeouts: a store that never
    // answers must not hold the response's final frame (which waits for the record) forever.
    let lease = held.config.lease;
    let op = || {
        let call = observe::timed(
            Op::Complete,
            kind,
            store.complete(scope, token, record.clone(), ttl),
        );
        within_lease(call, lease, "complete")
    };
    let done = retry_through_outage(within, "complete", op).await;
    if done.is_ok() {
        tracing::debug!(?scope, "idempotency: recorded");
    }
    done
}

/// `call`, bounded by one `lease` whatever the store's own timeouts: a call the store never
/// answers ends as a store failure (`what`, for the message), and whatever waits for it (a
/// place among the detached work, the response's final frame) is freed. The timer is set only
/// if the store does not answer at once (an in-process store always does).
///
/// A plain function, not an `async fn`: that would hold `call` twice (its argument, and what it
/// awaits), in every completion's and release's future.
fn within_lease<T>(
    call: impl Future<Output = Result<T, StoreError>>,
    lease: Duration,
    what: &'static str,
) -> impl Future<Output = Result<T, StoreError>> {
    WithinLease::new(call, lease).map(move |answered| {
        answered.unwrap_or_else(|| {
            Err(StoreError::Backend(
                format!("the store did not answer a {what} within one lease").into(),
            ))
        })
    })
}

/// [`Claim::settle`]'s store operations, boxed once.
pub(crate) type SettleFuture = Pin<Box<dyn Future<Output = Settled> + Send + 'static>>;

/// What a held claim is: its scope and token, the layer's settings (its TTL, lease and
/// limits), and what the layer shares (the renewal of its lease while it is held, its waiters).
pub(super) struct Held {
    scope: ScopeKey,
    token: Token,
    config: Arc<Config>,
    shared: Arc<Shared>,
    /// The end of its lifetime (`None`: too far for the clock).
    until: Option<Instant>,
}

impl Held {
    /// Leaves the claim renewed until the end of its lifetime: no duplicate takes it over before
    /// then (it would run a write that ran). It stays held, and counted in flight (a drain waits
    /// for it, and says so if its grace ends first), until then.
    fn keep_renewing_to_the_end_of_its_lifetime(self) {
        tracing::warn!(
            scope = ?self.scope,
            "idempotency: a record the store did not take could not be resent (max_detached); \
             the claim stays in flight until max_claim_lifetime, then lapses"
        );
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to wait on: the claim is let go, and lapses with its lease.
            return;
        };
        // Nothing runs for it but this wait: the claim is renewed meanwhile, and ends there.
        runtime.spawn(async move {
            match self.until {
                Some(until) => tokio::time::sleep_until(until).await,
                // A lifetime too long for the clock: held for as long as the layer lives.
                None => std::future::pending().await,
            }
            drop(self);
        });
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shared.renewals.remove(self.token);
        self.shared.claim_ended();
    }
}

/// `record` without its body, marked so (a store with no room for it).
fn trim_body(record: &mut Arc<Record>) {
    if !record.body.is_empty() {
        Arc::make_mut(record).omit_body();
    }
}

/// Resends `record` in place of `held`'s claim until the store takes it, the claim is fenced, or
/// `within` passes; each try bounded by one lease, with a backoff between tries. A store with no
/// room is sent the record without its body.
async fn resend_while_held<St: IdempotencyStore>(
    store: &St,
    held: &Held,
    mut record: Arc<Record>,
    within: Duration,
) -> Result<(), StoreError> {
    let (scope, token, ttl, lease) = (held.scope, held.token, held.config.ttl, held.config.lease);
    let kind = store.backend();
    let give_up = Instant::now() + within.min(FOREVER);
    let mut delay = Duration::from_millis(50);
    loop {
        let call = observe::timed(
            Op::Complete,
            kind,
            store.complete(scope, token, record.clone(), ttl),
        );
        match within_lease(call, lease, "complete").await {
            Ok(()) => {
                tracing::debug!(?scope, "idempotency: recorded (resent)");
                return Ok(());
            }
            Err(StoreError::Fenced) => return Err(StoreError::Fenced),
            Err(e) if Instant::now() >= give_up => return Err(e),
            Err(e) => {
                if matches!(e, StoreError::Full) {
                    trim_body(&mut record);
                }
                tracing::debug!(?scope, error = %e, "idempotency: record not taken; resending");
                // Tried until the end of the claim's life, the last try at its end.
                let left = give_up.saturating_duration_since(Instant::now());
                tokio::time::sleep(delay.min(left)).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// A claim whose write has run, while its record is being stored: if it is let go before the
/// store took the record or fenced the claim (its future dropped: no place left for detached
/// work, or the resend gave up at the end of the claim's life), the claim stays renewed to the
/// end of its lifetime rather than lapsing at its next lease under a write that ran.
struct Recording<St: IdempotencyStore> {
    store: Arc<St>,
    held: Option<Held>,
}

impl<St: IdempotencyStore> Recording<St> {
    fn held(&self) -> &Held {
        self.held
            .as_ref()
            .expect("a recording holds its claim until it ends")
    }

    /// The store's answer to the record: it landed (counted), or the claim is not this write's
    /// any more (fenced: logged). Either way the claim ends as claims do.
    fn answered(mut self, kind: Backend, answer: Result<(), StoreError>) {
        let held = self
            .held
            .take()
            .expect("a recording holds its claim until it ends");
        match answer {
            Ok(()) => held.shared.counters.recorded(),
            Err(e) => log_store_error(&held.shared.counters, kind, Op::Complete, &e),
        }
    }
}

impl<St: IdempotencyStore> Drop for Recording<St> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            held.keep_renewing_to_the_end_of_its_lifetime();
        }
    }
}

impl<St: IdempotencyStore> ClaimStore for St {
    fn complete(self: Arc<Self>, held: Held, record: Record) -> BoxFuture {
        // Shared, so that a retry through an outage resends it without copying it. Made before
        // the future is: a `Record` it captured would take its room for the future's whole life
        // (and that room puts the boxed future past the allocator's fast sizes).
        Box::pin(completion(self, held, Arc::new(record)))
    }

    fn release(self: Arc<Self>, held: Held) -> BoxFuture {
        Box::pin(release(self, held))
    }

    fn settle(self: Arc<Self>, held: Held, fingerprint: Fingerprint) -> SettleFuture {
        Box::pin(settle(self, held, fingerprint))
    }
}

/// [`ClaimStore::complete`]'s future: `record` stored in place of `held`'s claim (through a brief
/// outage), else resent in the background while the claim lives.
pub(super) async fn completion<St: IdempotencyStore>(
    this: Arc<St>,
    held: Held,
    mut record: Arc<Record>,
) {
    let kind = this.backend();
    let recording = Recording {
        store: this,
        held: Some(held),
    };
    let (store, held) = (&*recording.store, recording.held());
    // Through a brief store outage for one lease, which the final frame waits for.
    let refused = match complete_through_outage(store, held, &record, held.config.lease).await {
        answer @ (Ok(()) | Err(StoreError::Fenced)) => return recording.answered(kind, answer),
        Err(e) => e,
    };
    // Not taken (the store is down, full, or says the entry is corrupt), and the write
    // has run: the claim must not lapse while its record can still land. It stays held
    // and renewed, so duplicates find it in flight (they wait, or are told it is), and
    // the record is resent in the background for as long as the claim may live (a full
    // store is sent it without its body, as a response too large to record is). Giving
    // up here would let the lease lapse under a write that ran, and a retry would run it
    // again.
    log_store_error(&held.shared.counters, kind, Op::Complete, &refused);
    if matches!(refused, StoreError::Full) {
        trim_body(&mut record);
    }
    let rest = held.until.map_or(FOREVER, |until| {
        until.saturating_duration_since(Instant::now())
    });
    tracing::warn!(
        scope = ?held.scope,
        error = %refused,
        "idempotency: the store did not take a record; resending it in the background \
         while the claim lives (duplicates find it in flight)"
    );
    // Detached work like any other, counted in `max_detached`: past it the record is not
    // resent, but the claim is not dropped either: it stays renewed to the end of its
    // lifetime (duplicates find it in flight until then), then lapses.
    let permit = detached::permit(
        &held.shared,
        held.config.max_detached,
        Kind::StoreOp,
        "resend a record",
    );
    let (Some(permit), Ok(runtime)) = (permit, tokio::runtime::Handle::try_current()) else {
        return; // `recording` keeps the claim renewed as it goes.
    };
    runtime.spawn(async move {
        let _permit = permit;
        let (store, held) = (&*recording.store, recording.held());
        match resend_while_held(store, held, record, rest).await {
            answer @ (Ok(()) | Err(StoreError::Fenced)) => recording.answered(kind, answer),
            // Given up at the end of the claim's life: `recording` keeps it renewed
            // there, and it lapses with its lifetime.
            Err(e) => log_store_error(&held.shared.counters, kind, Op::Complete, &e),
        }
    });
}

/// [`ClaimStore::release`]'s future: `held`'s claim let go (through a brief outage).
async fn release<St: IdempotencyStore>(this: Arc<St>, held: Held) {
    let store = &*this;
    let kind = store.backend();
    let lease = held.config.lease;
    let op = || {
        let call = observe::timed(Op::Release, kind, store.release(held.scope, held.token));
        within_lease(call, lease, "release")
    };
    let counters = &held.shared.counters;
    match retry_through_outage(held.config.lease, "release", op).await {
        Ok(()) => {
            counters.released();
            tracing::debug!(scope = ?held.scope, "idempotency: released");
        }
        Err(e) => log_store_error(counters, kind, Op::Release, &e),
    }
}

/// [`ClaimStore::settle`]'s future.
async fn settle<St: IdempotencyStore>(
    this: Arc<St>,
    held: Held,
    fingerprint: Fingerprint,
) -> Settled {
    let (store, scope, lease) = (&*this, held.scope, held.config.lease);
    let counters = &held.shared.counters;
    let kind = store.backend();
    // Fenced: the claim row is ours only while no transaction of the handler committed
    // the record, so a release that succeeds proves none did.
    let release = || {
        let call = observe::timed(Op::Release, kind, store.release(scope, held.token));
        within_lease(call, lease, "release")
    };
    match retry_through_outage(lease, "release", release).await {
        Ok(()) => {
            counters.released();
            tracing::debug!(
                ?scope,
                "idempotency: the handler's transaction did not commit; released"
            );
            return Settled::Released;
        }
        Err(StoreError::Fenced) => {}
        Err(e) => {
            log_store_error(counters, kind, Op::Release, &e);
            return Settled::Unknown;
        }
    }
    // Not ours any more: committed by the handler's transaction, or taken over or
    // forgotten meanwhile. What the scope holds now tells which.
    let begin = observe::timed(Op::Begin, kind, store.begin(scope, fingerprint, lease));
    match within_lease(begin, lease, "begin").await {
        Ok(Begin::Completed(record)) if record.fingerprint == fingerprint => {
            counters.recorded();
            Settled::Recorded(record)
        }
        Ok(Begin::New(token)) => {
            // Forgotten meanwhile: hand back the claim this look made.
            let release = within_lease(store.release(scope, token), lease, "release");
            if let Err(e) = release.await {
                log_store_error(counters, kind, Op::Release, &e);
            }
            Settled::Unknown
        }
        Ok(_) => Settled::Unknown,
        Err(e) => {
            log_store_error(counters, kind, Op::Begin, &e);
            Settled::Unknown
        }
    }
}

pub(crate) fn log_store_error(counters: &Counters, store: Backend, op: Op, e: &StoreError) {
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
    /// The claim `token` on `scope`, its store operations made on `store` (the layer's), held
    /// from now for at most the layer's `max_claim_lifetime`.
    pub(crate) fn new<St: IdempotencyStore>(
        store: Arc<St>,
        scope: ScopeKey,
        token: Token,
        config: &Arc<Config>,
        shared: &Arc<Shared>,
    ) -> Self {
        let until = Instant::now().checked_add(config.max_claim_lifetime);
        shared
            .renewals
            .add(&*store, scope, token, config.lease, until);
        if config.fail_open {
            // Its `begin`'s count, handed over when it was granted, ends now that the renewals
            // know the claim (see `write::asking`).
            shared.begins.leave(&scope);
        }
        shared.counters.claim_held();
        let held = Held {
            scope,
            token,
            config: config.clone(),
            shared: shared.clone(),
            until,
        };
        Claim {
            held: Some((store, held)),
        }
    }

    fn held(&self) -> Option<&Held> {
        self.held.as_ref().map(|(_, held)| held)
    }

    /// The end of the claim's lifetime (`None`: too far for the clock, or the claim ended).
    pub(crate) fn until(&self) -> Option<Instant> {
        self.held()?.until
    }

    /// The claim reached the end of its lifetime while its work went on: its lease is no longer
    /// renewed (counted and logged, once).
    pub(crate) fn lifetime_ended(&self) {
        if let Some(held) = self.held() {
            held.shared.renewals.expire(held.token);
        }
    }

    /// Where work for this claim goes when its client goes away (`what`, for the log), bounded
    /// by the layer's `max_detached` and the claim's lifetime.
    pub(crate) fn detach_to(&self, what: &'static str) -> Option<DetachTo> {
        let held = self.held()?;
        Some(DetachTo {
            shared: held.shared.clone(),
            max: held.config.max_detached,
            kind: Kind::Work,
            lifetime: held.until.map(|until| (held.token, until)),
            what,
        })
    }

    /// The layer's budget of response bytes held for clients, and its bound.
    pub(crate) fn held_bytes(&self) -> Option<(Arc<HeldBytes>, usize)> {
        let held = self.held()?;
        Some((
            held.shared.held_bytes.clone(),
            held.config.max_response_buffer_bytes,
        ))
    }

    /// Does any duplicate wait for this claim in this process now?
    pub(crate) fn has_waiters(&self) -> bool {
        self.held()
            .is_some_and(|held| held.shared.waiters.any(&held.scope))
    }

    /// The claim ends without a record: the duplicates waiting for it in this process take
    /// `answer` (made only if any waits) instead of running the handler again. Call it before
    /// the claim is released, so a waiter woken by the release finds it.
    pub(crate) fn share_failure(&self, answer: impl FnOnce() -> SharedFailure) {
        if let Some(held) = self.held() {
            held.shared
                .waiters
                .share_failure(held.scope, held.token, answer);
        }
    }

    /// Releases the claim in the background (detached work): the answer need not wait for the
    /// store, which may be slow or down. Past `max_detached` store operations running, the
    /// release is handed back, for the caller to await before its answer goes out: its client
    /// still waits, and a claim left to lapse would hold its key a whole lease (every retry
    /// waiting for it, and the store's room taken meanwhile). Dropped unfinished, it is
    /// cancelled and the claim lapses with its lease.
    #[must_use = "a release handed back must be awaited, or the claim lapses with its lease"]
    pub(crate) fn release(mut self) -> Option<BoxFuture> {
        let (store, held) = self.held.take()?;
        let (shared, max) = (held.shared.clone(), held.config.max_detached);
        let release = store.release(held);
        detached::spawn_or_hand_back(&shared, max, Kind::StoreOp, release).err()
    }

    fn release_detached(&mut self) {
        if let Some((store, held)) = self.held.take() {
            let (shared, max) = (held.shared.clone(), held.config.max_detached);
            let release = store.release(held);
            let _ = detached::spawn(&shared, max, Kind::StoreOp, "release a claim", release);
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

    /// Ends the claim whose record the handler's own transaction stored: no store operation
    /// (the lease renewal stops).
    pub(crate) fn recorded_in_transaction(mut self) {
        if let Some((_, held)) = self.held.take() {
            held.shared.counters.recorded();
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

impl Drop for Claim {
    /// Dropped unfinished (its handler was cancelled): released in the background.
    fn drop(&mut self) {
        self.release_detached();
    }
}

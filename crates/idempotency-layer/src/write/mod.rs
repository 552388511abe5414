//! The whole flow of one write whose key and tenant were accepted: read and fingerprint its
//! body ([`read_body`]), ask the store, and lead, replay ([`replay`](mod@replay)), wait
//! ([`waiters`]) or refuse. What `begin` found is decided in [`decision`]; the claim a leader
//! holds in [`claim`], its lease renewed by [`renewal`]; the leader's run in [`leader`], its
//! response read by [`pipe`] and recorded by [`recorder`] under the rules of [`record_rules`];
//! work whose client went away in [`detached`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::LengthLimitError;
use reason_code::InboundWrite;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Span;

use crate::body::{IdempotencyBody, RequestBody};
use crate::config::Config;
use crate::idempotent_write::IdempotentWrite;
use crate::observe::{self, Op, WriteOutcome};
use crate::protocol::Protocol;
use crate::reject::{respond, RejectReason};
use crate::shared::Shared;
use crate::stats::Counters;
use crate::store::hashing::fingerprint;
use crate::store::{Backend, IdempotencyStore, ScopeKey, ScopeKeys, StoreError, TenantKey};
use crate::tx::{self, Offer};
use crate::write::asking::Counted;
use crate::write::claim::{log_store_error, Claim};
use crate::write::decision::{Asking, Next};
use crate::write::waiters::{Refused, SharedFailure};
use reason_code::BoxError;

pub(crate) mod asking;
pub(crate) mod claim;
pub(crate) mod decision;
pub(crate) mod detached;
mod leader;
pub(crate) mod pipe;
mod read_body;
pub(crate) mod record_rules;
pub(crate) mod recorder;
pub(crate) mod renewal;
mod replay;
#[cfg(test)]
mod tests;
pub(crate) mod waiters;

use self::leader::*;
use self::read_body::*;
use self::replay::*;

/// The request head `parts` as the handler gets it, with what it can know of its write (see
/// `IdempotentWrite`; `token` is the claim it runs under, if any), and the inbound write it
/// runs as, whose derived keys come from the write's stable scope key.
///
/// A plain function, so that the write's future holds none of this across its awaits. The
/// layer makes an `IdempotentWrite` for every request it runs (it accepted the key and the
/// tenant `IdempotentWrite::of` reads again); without one, the store's key stands in.
fn as_handler_sees_it<St: IdempotencyStore>(
    store: &St,
    cfg: &Config,
    mut parts: Parts,
    (scope, token): (ScopeKey, Option<crate::store::Token>),
    grpc: bool,
    waited: bool,
) -> (Parts, InboundWrite) {
    let stable = (store.scope_keys() == ScopeKeys::Stable).then_some(scope);
    match IdempotentWrite::of(cfg, &parts, stable, token, grpc, waited) {
        Some(write) => {
            let inbound = write.inbound();
            parts.extensions.insert(write);
            (parts, inbound)
        }
        None => (parts, InboundWrite::new(scope.0)),
    }
}

/// Logs and counts a `begin` that failed: a corrupt entry (an error: only an operator can
/// help), a full store (a warning: the store is up), or the store failing.
fn note_begin_failed(counters: &Counters, kind: Backend, scope: ScopeKey, e: &StoreError) {
    match e {
        StoreError::Corrupt(what) => {
            counters.store_error();
            observe::store_error(Op::Begin, kind);
            tracing::error!(?scope, error = %what, "idempotency: the stored entry of this key is corrupt; nothing executed");
        }
        StoreError::Full => {
            tracing::warn!(?scope, "idempotency: the store is full; nothing executed");
        }
        e => log_store_error(counters, kind, Op::Begin, e),
    }
}

pub(super) type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

pin_project_lite::pin_project! {
    /// `inner`, bounded by `lease`: `None` once the lease passed first. The timer is set only
    /// when `inner` does not answer at its first poll (an in-process store always does), and
    /// boxed, so that it costs the write's future 8 bytes, not a whole timer: that future stays
    /// within the allocator's per-thread cache.
    pub(super) struct WithinLease<F> {
        #[pin]
        inner: F,
        lease: Duration,
        timer: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F> WithinLease<F> {
    pub(super) fn new(inner: F, lease: Duration) -> Self {
        WithinLease {
            inner,
            lease,
            timer: None,
        }
    }
}

impl<F> WithinLease<F> {
    /// Answers also how long `inner` took, counted from its first poll (zero when it answered
    /// at once: no clock is read then).
    pub(super) fn timed(self) -> TimedWithinLease<F> {
        TimedWithinLease { within: self }
    }
}

pin_project_lite::pin_project! {
    /// [`WithinLease::timed`].
    pub(super) struct TimedWithinLease<F> {
        #[pin]
        within: WithinLease<F>,
    }
}

impl<F: Future> Future for TimedWithinLease<F> {
    type Output = Option<(F::Output, Duration)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut within = self.project().within;
        let out = std::task::ready!(within.as_mut().poll(cx));
        let within = within.project();
        let took = within.timer.as_ref().map_or(Duration::ZERO, |timer| {
            let first_poll = timer.deadline().checked_sub(*within.lease);
            first_poll.map_or(Duration::ZERO, |at| at.elapsed())
        });
        Poll::Ready(out.map(|out| (out, took)))
    }
}

impl<F: Future> Future for WithinLease<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.inner.poll(cx) {
            return Poll::Ready(Some(out));
        }
        let lease = *this.lease;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(lease)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// How late a `begin` may be answered before its claim's lease is renewed before the handler
/// runs: an eighth of the lease. A claim is renewed a renewal period (a fourth of the lease) after
/// it is held at the latest, so a claim answered within an eighth still has three renewals due
/// before its lease, counted from when the `begin` was sent, runs out.
fn late_begin(lease: Duration) -> Duration {
    lease / 8
}

/// Renews the claim `token` on `scope` whose `begin` was answered late, bounded by one lease. `Ok`
/// means the claim was still this write's when the renewal reached the store (a claim taken over
/// meanwhile is fenced), and its lease runs a whole lease from when the renewal was sent.
async fn renew_late_claim<St: IdempotencyStore>(
    store: &St,
    scope: ScopeKey,
    token: crate::store::Token,
    lease: Duration,
) -> Result<(), StoreError> {
    let kind = store.backend();
    let renew = observe::timed(Op::Renew, kind, store.renew(scope, token, lease));
    WithinLease::new(renew, lease).await.unwrap_or_else(|| {
        Err(StoreError::Backend(
            "the store did not answer a lease renewal within one lease".into(),
        ))
    })
}

/// The inner service a write holds: the one `poll_ready` readied (with the capacity it
/// reserved), or a clone not yet ready (a write that waited let the readied one go).
pub(crate) enum Inner<S> {
    Ready(S),
    NotReady(S),
}

impl<S: Clone> Inner<S> {
    /// Lets the readied service go (and the capacity it holds), keeping a clone to ready later.
    fn release_capacity(&mut self) {
        if let Inner::Ready(s) = self {
            *self = Inner::NotReady(s.clone());
        }
    }

    /// Readies the service (if it is not) within `within` from now: ready at once, the common
    /// case, it reads no clock and sets no timer.
    async fn ready_by<R>(
        &mut self,
        within: Duration,
    ) -> Result<Result<(), S::Error>, tokio::time::error::Elapsed>
    where
        S: Service<R>,
    {
        let Inner::NotReady(s) = self else {
            return Ok(Ok(()));
        };
        match std::future::poll_fn(|cx| Poll::Ready(s.poll_ready(cx))).await {
            Poll::Ready(Ok(())) => {
                self.keep_readied();
                Ok(Ok(()))
            }
            Poll::Ready(Err(e)) => Ok(Err(e)),
            Poll::Pending => self.ready_within(Instant::now().checked_add(within)).await,
        }
    }

    /// Readies the service (if it is not), by `deadline` (`None`: unbounded); `Err` when the
    /// deadline passed first.
    async fn ready_within<R>(
        &mut self,
        deadline: Option<Instant>,
    ) -> Result<Result<(), S::Error>, tokio::time::error::Elapsed>
    where
        S: Service<R>,
    {
        let Inner::NotReady(s) = self else {
            return Ok(Ok(()));
        };
        let ready = std::future::poll_fn(|cx| s.poll_ready(cx));
        let readied = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, ready).await?,
            None => ready.await,
        };
        if readied.is_ok() {
            self.keep_readied();
        }
        Ok(readied)
    }

    /// The service just readied is kept as readied (a clone would not hold the capacity it
    /// reserved).
    fn keep_readied(&mut self) {
        if let Inner::NotReady(s) = self {
            let placeholder = Inner::NotReady(s.clone());
            if let Inner::NotReady(s) = std::mem::replace(self, placeholder) {
                *self = Inner::Ready(s);
            }
        }
    }
}

/// One write whose key and tenant were accepted: everything its flow needs, owned, so the flow
/// can outlive the request (a leader whose client went away is finished in a task).
pub(crate) struct Write<S, St> {
    /// The inner service: readied by `poll_ready` until this write waits for a duplicate.
    pub(crate) inner: Inner<S>,
    pub(crate) store: Arc<St>,
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) scope: ScopeKey,
    /// The tenant the store charges this scope's claim and record to.
    pub(crate) tenant: TenantKey,
    pub(crate) protocol: Protocol,
    /// The request's `grpc-timeout`: it bounds the reading of the body and the wait.
    pub(crate) grpc_timeout: Option<Duration>,
    /// `idempotency_layer.write`: how the write ended is recorded on it.
    pub(crate) span: Span,
}

/// Why a body over [`max_request_bytes`](crate::IdempotencyLayer::max_request_bytes) is refused.
pub(crate) fn too_large(cfg: &Config) -> String {
    format!(
        "request body is larger than {} bytes; send a smaller request",
        cfg.max_request_bytes
    )
}

impl<S, St> Write<S, St> {
    fn reject<B>(&self, reason: RejectReason, detail: &str) -> Response<IdempotencyBody<B>> {
        self.shared.counters.rejected(reason);
        observe::record_rejection(&self.span, reason);
        let cfg = &self.config;
        respond(
            reason,
            detail,
            &self.protocol,
            cfg.reasons.header_name(),
            cfg.rejection_body.as_ref(),
        )
    }
}

impl<S, St> Write<S, St>
where
    St: IdempotencyStore,
{
    /// Runs the handler as the leader of the scope it holds with `claim` (token `token`), the
    /// request rebuilt from `parts` and its body `bytes`.
    fn lead<ReqB, ResB>(
        self,
        parts: Parts,
        bytes: Bytes,
        claim: Claim,
        token: crate::store::Token,
        (fingerprint, waited): (crate::store::Fingerprint, bool),
    ) -> impl Future<Output = Answer<ResB, S::Error>>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let grpc = self.protocol.is_grpc();
        let (mut parts, inbound) = as_handler_sees_it(
            &*self.store,
            &self.config,
            parts,
            (self.scope, Some(token)),
            grpc,
            waited,
        );
        let ledger = tx::offer(
            &*self.store,
            &mut parts.extensions,
            Offer {
                scope: self.scope,
                token,
                fingerprint,
                config: &self.config,
                grpc: self.protocol.is_grpc(),
            },
        );
        let req = Request::from_parts(parts, RequestBody::buffered(bytes));
        self.run_as_leader(req, claim, ledger, (inbound, fingerprint))
    }

    /// [`lead`](Self::lead) when the `begin` that made `claim` was answered late: its lease,
    /// counted from when the `begin` was sent, may be near its end, and the renewals of a claim
    /// come a period after it is held. So the lease is renewed (and so known to hold) before the
    /// handler runs; if that fails (the claim was taken over meanwhile, or the store does not
    /// answer), the write is refused and the claim released.
    async fn lead_after_a_late_begin<ReqB, ResB>(
        self,
        parts: Parts,
        bytes: Bytes,
        claim: Claim,
        token: crate::store::Token,
        asked: (crate::store::Fingerprint, bool),
    ) -> Answer<ResB, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let (lease, kind) = (self.config.lease, self.store.backend());
        if let Err(e) = renew_late_claim(&*self.store, self.scope, token, lease).await {
            log_store_error(&self.shared.counters, kind, Op::Renew, &e);
            if let Some(release) = claim.release() {
                release.await;
            }
            return Ok(self.reject(
                RejectReason::StoreUnavailable,
                "the idempotency store answered too late to run this write safely; nothing \
                 was executed, retry",
            ));
        }
        self.lead(parts, bytes, claim, token, asked).await
    }

    /// The flow of one write: read and fingerprint the body, then claim the scope and run the
    /// handler, or replay the record, or wait for the request in flight.
    ///
    /// A plain function returning an `async move` block, not an `async fn`: an `async fn` keeps
    /// its arguments twice (as captured and as locals), and this future is moved into its box
    /// and polled on every request.
    #[expect(
        clippy::manual_async_fn,
        reason = "an `async fn` would hold its arguments twice"
    )]
    pub(crate) fn handle<ReqB, ResB>(
        mut self,
        parts: Parts,
        body: ReqB,
    ) -> impl Future<Output = Answer<ResB, S::Error>>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ReqB::Error: Into<BoxError>,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        async move {
            let cfg = &*self.config;
            let counters = &self.shared.counters;
            let scope = self.scope;
            let kind = self.store.backend();
            // A gRPC request's own deadline bounds the reading of its body and its wait.
            let (deadline, body_deadline) = {
                let grpc_timeout = self.grpc_timeout;
                let within = |limit: Duration| grpc_timeout.map_or(limit, |t| t.min(limit));
                let arrived = Instant::now();
                (
                    arrived.checked_add(within(cfg.max_wait)),
                    arrived.checked_add(within(cfg.request_body_timeout)),
                )
            };

            // (A body declared too large was refused before this future was made.) A body that
            // is not at hand holds none of the inner service's capacity while it comes: a slow or
            // stalled upload must not keep a `ConcurrencyLimit` permit, say, from every other
            // request for up to `request_body_timeout`. The service is readied again once the
            // body is read (below).
            let inner = &mut self.inner;
            let read = read_whole(body, cfg.max_request_bytes, body_deadline, || {
                inner.release_capacity();
            });
            let bytes = match read.await {
                Ok(bytes) => bytes,
                Err(e) if e.is::<LengthLimitError>() => {
                    return Ok(self.reject(RejectReason::TooLarge, &too_large(cfg)))
                }
                Err(e) if e.is::<BodyTimedOut>() => {
                    let detail = format!(
                        "request body not received within {:?} (the idempotency layer's \
                         request_body_timeout, or the request's grpc-timeout); nothing was \
                         executed: send the whole body promptly, or declare streaming gRPC \
                         methods with Writes::streaming_grpc_methods",
                        self.grpc_timeout.map_or(cfg.request_body_timeout, |t| t
                            .min(cfg.request_body_timeout))
                    );
                    return Ok(self.reject(RejectReason::BodyTimeout, &detail));
                }
                Err(e) => {
                    return Ok(self.reject(
                        RejectReason::BadBody,
                        &format!("request body could not be read: {e}"),
                    ))
                }
            };
            if let Inner::NotReady(_) = self.inner {
                // The body came late, its capacity given back meanwhile: the service is readied
                // again before anything is claimed, within `max_wait` from now (a gRPC request's
                // `grpc-timeout` shortens it). Boxed: its timer would grow every write's future.
                let within = self
                    .grpc_timeout
                    .map_or(cfg.max_wait, |t| t.min(cfg.max_wait));
                match Box::pin(self.inner.ready_by(within)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        let detail = format!(
                            "the service under the idempotency layer did not become ready within \
                             {within:?} (the layer's max_wait, or the request's grpc-timeout) \
                             after the request body arrived; nothing was executed, retry later"
                        );
                        return Ok(self.reject(RejectReason::Overloaded, &detail));
                    }
                }
            }
            // The fingerprint is kept once, in `asking` (the future holds it across its awaits).
            let mut asking = Asking {
                fingerprint: match &cfg.fingerprint {
                    Some(of) => of(&parts, &bytes),
                    None => fingerprint(&parts, &bytes),
                },
                waited: false,
                in_flight: cfg.in_flight,
                fail_open: cfg.fail_open,
                known_in_flight: false,
            };
            // This request's place among the waiters of its scope, held while it waits.
            let mut slot = None;
            loop {
                if asking.waited {
                    // Woken, it asks the store again and may lead: the service is readied first,
                    // within this request's own bound, so that a leader never holds its claim
                    // while it waits for capacity (and a service that stays not ready ends the
                    // wait like any other bound). Boxed: rare, and its timer would grow every
                    // write's future.
                    match Box::pin(self.inner.ready_within(deadline)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(e),
                        Err(_) => {
                            return Ok(self.reject(
                                RejectReason::InFlight,
                                "a request with this idempotency key was in flight and this \
                                 server has no capacity to run it now; retry later",
                            ))
                        }
                    }
                }
                let begin =
                    self.store
                        .begin_for_tenant(self.tenant, scope, asking.fingerprint, cfg.lease);
                // Bounded by one lease, whatever the store's own timeouts: a store that never
                // answers must not hold this request, nor the capacity it readied (a
                // `ConcurrencyLimit` permit), for ever when its client vanished without a reset.
                // Given up, the begin is dropped as if its caller went away (a shared store
                // releases a claim it may have written), and the write is refused even with
                // `fail_open`: a lease later, a retry may already be running it elsewhere.
                // A claim's lease runs from when its `begin` was sent (the store may have taken it
                // at once and answered late): `answered_after` says how late.
                //
                // A layer that fails open counts its `begin`s in flight, from before one is sent
                // until its answer is acted on (a claim granted: until `Claim::new` holds it, and
                // `renewals` knows it): a duplicate whose own `begin` fails must not fail open
                // beside it. Boxed with its count, so that no other layer's write carries it.
                let Some((found, answered_after)) = (if cfg.fail_open {
                    let counted = self.shared.begins.enter(scope);
                    let timed = WithinLease::new(observe::timed(Op::Begin, kind, begin), cfg.lease);
                    Box::pin(Counted::new(timed.timed(), counted)).await
                } else {
                    WithinLease::new(observe::timed(Op::Begin, kind, begin), cfg.lease)
                        .timed()
                        .await
                }) else {
                    counters.store_error();
                    observe::store_error(Op::Begin, kind);
                    tracing::warn!(
                        ?scope,
                        "idempotency: the store did not answer a begin within one lease; nothing \
                         executed"
                    );
                    return Ok(self.reject(
                        RejectReason::StoreUnavailable,
                        "the idempotency store did not answer within one lease; nothing was \
                         executed, retry",
                    ));
                };
                if let Err(e) = &found {
                    note_begin_failed(counters, kind, scope, e);
                    if asking.fail_open {
                        asking.known_in_flight = reason_code::says_seen_in_flight(&parts.headers)
                            || self.shared.renewals.holds(&scope)
                            || self.shared.begins.any(&scope);
                    }
                }
                let token = match decision::after_begin(found, &asking) {
                    Next::Lead(token) => {
                        drop(slot.take());
                        let claim = Claim::new(
                            self.store.clone(),
                            scope,
                            token,
                            &self.config,
                            &self.shared,
                        );
                        if self.shared.draining.refuses_a_claim_made() {
                            if let Some(release) = claim.release() {
                                release.await;
                            }
                            return Ok(self.reject(
                                RejectReason::ShuttingDown,
                                "the server is shutting down and takes no new write; nothing \
                                 was executed, retry",
                            ));
                        }
                        if answered_after > late_begin(cfg.lease) {
                            // Boxed with the rest of the lead: rare, and it would grow every
                            // write's future.
                            let late = self.lead_after_a_late_begin(
                                parts,
                                bytes,
                                claim,
                                token,
                                (asking.fingerprint, asking.waited),
                            );
                            return Box::pin(late).await;
                        }
                        return self
                            .lead(
                                parts,
                                bytes,
                                claim,
                                token,
                                (asking.fingerprint, asking.waited),
                            )
                            .await;
                    }
                    Next::Replay(record, outcome) => {
                        counters.replayed();
                        observe::record_outcome(&self.span, outcome);
                        tracing::debug!(?scope, waited = asking.waited, "idempotency: replayed");
                        return Ok(replay(
                            &record,
                            self.protocol.is_grpc(),
                            cfg.max_record_bytes,
                        ));
                    }
                    Next::Reject(reason, detail) => return Ok(self.reject(reason, &detail)),
                    Next::ExecuteUnprotected => {
                        counters.failed_open();
                        observe::record_outcome(&self.span, WriteOutcome::Executed);
                        tracing::warn!(
                            "idempotency: store failed; executing without protection (fail_open)"
                        );
                        // Boxed, like the leader's call: rare, and as large as the handler's
                        // future.
                        let grpc = self.protocol.is_grpc();
                        let (parts, inbound) = as_handler_sees_it(
                            &*self.store,
                            cfg,
                            parts,
                            (scope, None),
                            grpc,
                            asking.waited,
                        );
                        let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                        // As the inbound write of its scope, as a leader runs: derived keys of its
                        // outbound writes stay the same whether or not the store answered.
                        let run = Box::pin(inbound.scope(call_inner(self.inner, req)));
                        return Ok(run.await?.map(IdempotencyBody::inner));
                    }
                    Next::Wait(token) => token,
                };
                if slot.is_none() {
                    let entered = self.shared.waiters.enter(
                        scope,
                        cfg.max_waiters,
                        bytes.len().saturating_add(waiters::head_bytes(&parts)),
                        cfg.max_waiting_bytes,
                    );
                    match entered {
                        // Boxed: only a waiter needs it.
                        Ok(place) => slot = Some(Box::new(place)),
                        Err(Refused::KeyFull) => {
                            return Ok(self.reject(
                                RejectReason::InFlight,
                                "too many requests with this idempotency key are waiting for the \
                                 one in flight; retry after it completes",
                            ))
                        }
                        Err(Refused::LayerFull) => {
                            return Ok(self.reject(
                                RejectReason::InFlight,
                                "too many duplicate requests are waiting in this server \
                                 (max_waiting_bytes); retry after the one in flight completes",
                            ))
                        }
                    }
                }
                if !asking.waited {
                    asking.waited = true;
                    counters.waited();
                    tracing::debug!(?scope, "idempotency: waiting for the request in flight");
                }
                // A waiter holds none of the inner service's capacity (readied again before it
                // asks the store again, below).
                self.inner.release_capacity();
                let Some(place) = slot.as_ref() else {
                    unreachable!("a waiter has its place")
                };
                // Boxed: the store's wait and its timer are as large as the rest of the write's
                // future, and only a duplicate in flight needs them.
                let woken = Box::pin(async {
                    // Registered before the failure is looked for: a hand-over in between wakes
                    // it.
                    let mut failed = std::pin::pin!(place.notified());
                    failed.as_mut().enable();
                    if place.failure(token).is_some() {
                        return Ok(Ok(()));
                    }
                    let wake = async {
                        // Biased: the same order every time (a simulation's seed replays
                        // exactly), and the store's answer first.
                        tokio::select! {
                            biased;
                            r = self.store.wait(scope, token) => r,
                            () = failed => Ok(()),
                        }
                    };
                    match deadline {
                        Some(deadline) => tokio::time::timeout_at(deadline, wake).await,
                        // A wait too long for the clock to express: unbounded.
                        None => Ok(wake.await),
                    }
                });
                match woken.await {
                    Ok(Ok(())) => {
                        // The leader failed without a record: its failure is this request's
                        // answer, and the key is free for the client's retry.
                        if let Some(failure) = place.failure(token) {
                            counters.shared_failure();
                            observe::record_outcome(&self.span, WriteOutcome::SharedFailure);
                            tracing::debug!(
                                ?scope,
                                "idempotency: the request in flight failed; answering with its \
                                 failure"
                            );
                            return Ok(match failure {
                                SharedFailure::Answer(answer) => shared_failure(&answer),
                                SharedFailure::Reject(reason) => self.reject(
                                    reason,
                                    "the request in flight with this idempotency key failed and \
                                     nothing was recorded; a retry executes again",
                                ),
                            });
                        }
                    }
                    Ok(Err(e)) => {
                        log_store_error(counters, kind, Op::Wait, &e);
                        return Ok(self.reject(
                            RejectReason::StoreUnavailable,
                            "idempotency store unavailable while waiting; retry later",
                        ));
                    }
                    Err(_) => {
                        return Ok(self.reject(
                            RejectReason::InFlight,
                            "a request with this idempotency key is still in flight; retry later",
                        ))
                    }
                }
            }
        }
    }
}

//! [`Idempotency`]: the service, and the flow of one write.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderValue, Request, Response, Version};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use reason_code::{
    encode_grpc_message, parse_grpc_timeout, Code, InboundWrite, GRPC_MESSAGE, GRPC_STATUS,
    GRPC_TIMEOUT, IDEMPOTENT_REPLAYED,
};
use tokio::time::Instant;
use tower_service::Service;
use tracing::{Instrument, Span};

use crate::body::{IdempotencyBody, RequestBody};
use crate::claim::{log_store_error, Claim, Settled};
use crate::config::{Config, OnDisconnect, TenantSource};
use crate::decision::{self, Asking, Next};
use crate::detached::{DetachOnDrop, DetachTo};
use crate::future::ResponseFuture;
use crate::key::extract_key;
use crate::observe::{self, Op, WriteOutcome};
use crate::protocol::Protocol;
use crate::recorder::Recording;
use crate::recording::{self, AtHead};
use crate::reject::{render, RejectReason};
use crate::scope::{http_scope_key, Scope, Tenant};
use crate::shared::Shared;
use crate::stats::{Counters, IdempotencyStats};
use crate::store::hashing::fingerprint;
use crate::store::{
    Backend, BoxError, Fingerprint, IdempotencyStore, MemoryStore, Record, ScopeKey, StoreError,
    TenantKey,
};
use crate::tx::{self, Offer, TxLedger, TxOutcome};
use crate::waiters::{Refused, SharedFailure};
use crate::IDEMPOTENT_BODY_OMITTED;

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

/// Why the leader's handler produced no response.
struct Panicked;

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) makes: writes with a key execute
/// once per scope; duplicates get the recorded response.
///
/// It keeps the inner service's error type: everything the layer refuses is answered as a
/// response, so no `HandleErrorLayer` is needed.
pub struct Idempotency<S, St = MemoryStore> {
    inner: S,
    /// Shared by the service's clones and writes: a claim's store operations are made on it
    /// through the `Arc`, with no box of their own.
    store: Arc<St>,
    config: Arc<Config>,
    shared: Arc<Shared>,
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, store: St, config: Arc<Config>, shared: Arc<Shared>) -> Self {
        Idempotency {
            inner,
            store: Arc::new(store),
            config,
            shared,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The layer's counters (shared with the layer and every clone).
    pub fn stats(&self) -> IdempotencyStats {
        self.shared.stats()
    }
}

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let cfg = &self.config;
        let protocol = Protocol::of(req.headers());
        if !cfg.is_write(req.method(), req.uri(), req.headers(), protocol.is_grpc()) {
            // `self.inner` is the service that `poll_ready` drove to readiness: take it into the
            // call and leave a fresh clone in its place ("Be careful when cloning inner
            // services", tower-service docs).
            let clone = self.inner.clone();
            let mut inner = std::mem::replace(&mut self.inner, clone);
            return ResponseFuture::passthrough(inner.call(req.map(RequestBody::streaming)));
        }
        let span = observe::write_span(req.method(), req.uri().path(), protocol.is_grpc());
        let rejected = |reason: RejectReason, detail: &str| {
            self.shared.counters.rejected(reason);
            observe::record_rejection(&span, reason);
            ResponseFuture::ready(reject(reason, detail, &protocol, cfg))
        };
        if self.shared.draining.is_on() {
            return rejected(
                RejectReason::ShuttingDown,
                "the server is shutting down and takes no new write; nothing was executed, retry",
            );
        }
        // Taken apart here: the key and the tenant are read from the head where they are (the
        // key is not copied), and the write's future holds the parts and the body once, not the
        // request beside the parts taken from it.
        let (parts, body) = req.into_parts();
        let key = match extract_key(
            &parts.headers,
            cfg.key_headers.as_slice(),
            cfg.key_rule.as_ref(),
        ) {
            Ok(Some(key)) => key,
            Ok(None) if cfg.key_optional => {
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let req = Request::from_parts(parts, RequestBody::streaming(body));
                return ResponseFuture::passthrough(inner.call(req));
            }
            Ok(None) => {
                let detail = format!("write operations require {}", cfg.key_header_name());
                return rejected(RejectReason::MissingKey, &detail);
            }
            Err(e) => return rejected(RejectReason::InvalidKey, &e.to_string()),
        };
        let Some(tenant) = tenant(cfg, &parts) else {
            return rejected(
                RejectReason::NoTenant,
                "no authenticated tenant: writes with an idempotency key need one",
            );
        };
        let scope = if protocol.is_grpc() {
            Scope::new(&tenant, parts.uri.path(), key).key()
        } else {
            http_scope_key(&tenant, &parts.method, parts.uri.path(), key)
        };
        let tenant = match &cfg.tenant {
            // The layer's default tenant's key is computed once, when it is set.
            TenantSource::Default(name, key) if Arc::ptr_eq(name, &tenant) => *key,
            _ => TenantKey::of(&tenant),
        };
        // The write takes the service `poll_ready` readied (and the capacity it reserved: a
        // `ConcurrencyLimit` permit, a `Buffer` slot), leaving a fresh clone for the next call.
        // That capacity stays with the readied service until it is called: a write that readied
        // a clone of its own instead would wait for capacity the readied one holds (with
        // `buffer(n).layer(..).concurrency_limit(1)`, for ever: the Buffer's worker keeps the
        // readied service parked until its next request). A write that waits for a duplicate in
        // flight lets the readied service go (its capacity with it) and readies a clone only if
        // it leads later.
        let clone = self.inner.clone();
        let write = Write {
            inner: Inner::Ready(std::mem::replace(&mut self.inner, clone)),
            store: self.store.clone(),
            config: self.config.clone(),
            shared: self.shared.clone(),
            scope,
            tenant,
            protocol,
            span: span.clone(),
        };
        ResponseFuture::managed(Box::pin(write.handle(parts, body).instrument(span)))
    }
}

/// The request's `grpc-timeout`, if it has a valid one.
fn grpc_timeout(parts: &Parts) -> Option<Duration> {
    parts
        .headers
        .get(GRPC_TIMEOUT)
        .and_then(|v| parse_grpc_timeout(v).ok())
}

/// The request's tenant: its [`Tenant`] extension, else what the layer is configured to use.
fn tenant(cfg: &Config, parts: &Parts) -> Option<Arc<str>> {
    if let Some(t) = parts.extensions.get::<Tenant>() {
        return Some(t.0.clone());
    }
    match &cfg.tenant {
        TenantSource::Required => None,
        TenantSource::Default(t, _) => Some(t.clone()),
        TenantSource::Header(name) => {
            let mut values = parts.headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (Some(v), None) => v
                    .to_str()
                    .ok()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(Arc::from),
                _ => None,
            }
        }
        TenantSource::Fn(f) => f(parts).filter(|t| !t.is_empty()),
    }
}

/// A rejection as the layer's response.
fn reject<B>(
    reason: RejectReason,
    detail: &str,
    protocol: &Protocol,
    cfg: &Config,
) -> Response<IdempotencyBody<B>> {
    let reason_header = cfg.reasons.header_name();
    render(
        reason,
        detail,
        protocol,
        reason_header,
        cfg.rejection_body.as_ref(),
    )
    .map(IdempotencyBody::full)
}

type Answer<B, E> = Result<Response<IdempotencyBody<B>>, E>;

/// The inner service a write holds: the one `poll_ready` readied (with the capacity it
/// reserved), or a clone not yet ready (a write that waited let the readied one go).
enum Inner<S> {
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
}

/// One write whose key and tenant were accepted: everything its flow needs, owned, so the flow
/// can outlive the request (a leader whose client went away is finished in a task).
struct Write<S, St> {
    /// The inner service: readied by `poll_ready` until this write waits for a duplicate.
    inner: Inner<S>,
    store: Arc<St>,
    config: Arc<Config>,
    shared: Arc<Shared>,
    scope: ScopeKey,
    /// The tenant the store charges this scope's claim and record to.
    tenant: TenantKey,
    protocol: Protocol,
    /// `idempotency_layer.write`: how the write ended is recorded on it.
    span: Span,
}

impl<S, St> Write<S, St> {
    fn reject<B>(&self, reason: RejectReason, detail: &str) -> Response<IdempotencyBody<B>> {
        self.shared.counters.rejected(reason);
        observe::record_rejection(&self.span, reason);
        reject(reason, detail, &self.protocol, &self.config)
    }
}

impl<S, St> Write<S, St>
where
    St: IdempotencyStore,
{
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
    fn handle<ReqB, ResB>(
        mut self,
        mut parts: Parts,
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
                let grpc_timeout = grpc_timeout(&parts);
                let within = |limit: Duration| grpc_timeout.map_or(limit, |t| t.min(limit));
                let arrived = Instant::now();
                (
                    arrived.checked_add(within(cfg.max_wait)),
                    arrived.checked_add(within(cfg.request_body_timeout)),
                )
            };

            let too_large = || {
                format!(
                    "request body is larger than {} bytes; send a smaller request",
                    cfg.max_request_bytes
                )
            };
            let declared = parts
                .headers
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if declared.is_some_and(|n| n > cfg.max_request_bytes as u64) {
                return Ok(self.reject(RejectReason::TooLarge, &too_large()));
            }
            let read = read_whole(body, cfg.max_request_bytes, body_deadline);
            let bytes = match read.await {
                Ok(bytes) => bytes,
                Err(e) if e.is::<LengthLimitError>() => {
                    return Ok(self.reject(RejectReason::TooLarge, &too_large()))
                }
                Err(e) if e.is::<BodyTimedOut>() => {
                    let detail = format!(
                        "request body not received within {:?} (the idempotency layer's \
                         request_body_timeout, or the request's grpc-timeout); nothing was \
                         executed: send the whole body promptly, or declare streaming gRPC \
                         methods with streaming_grpc_methods",
                        grpc_timeout(&parts).map_or(cfg.request_body_timeout, |t| t
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
            let fp = match &cfg.fingerprint {
                Some(of) => of(&parts, &bytes),
                None => fingerprint(&parts, &bytes),
            };

            let mut asking = Asking {
                fingerprint: fp,
                waited: false,
                in_flight: cfg.in_flight,
                fail_open: cfg.fail_open,
            };
            // This request's place among the waiters of its scope, held while it waits.
            let mut slot = None;
            loop {
                let begin = self
                    .store
                    .begin_for_tenant(self.tenant, scope, fp, cfg.lease);
                let found = observe::timed(Op::Begin, kind, begin).await;
                if let Err(e) = &found {
                    note_begin_failed(counters, kind, scope, e);
                }
                let token = match decision::after_begin(found, &asking) {
                    Next::Lead(token) => {
                        drop(slot.take());
                        // Built in a block, so the request and the claim it moves into the
                        // leader are not kept beside it while it runs.
                        let leader = {
                            let claim = Claim::new(
                                self.store.clone(),
                                scope,
                                token,
                                &self.config,
                                &self.shared,
                            );
                            let ledger = tx::offer(
                                &*self.store,
                                &mut parts.extensions,
                                Offer {
                                    scope,
                                    token,
                                    fingerprint: fp,
                                    config: &self.config,
                                    grpc: self.protocol.is_grpc(),
                                },
                            );
                            let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                            self.run_as_leader(req, claim, ledger, fp)
                        };
                        return leader.await;
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
                        let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                        let run = Box::pin(call_inner(self.inner, req));
                        return Ok(run.await?.map(IdempotencyBody::inner));
                    }
                    Next::Wait(token) => token,
                };
                if slot.is_none() {
                    let entered = self.shared.waiters.enter(
                        scope,
                        cfg.max_waiters,
                        bytes.len(),
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
                    // A waiter holds none of the inner service's capacity.
                    self.inner.release_capacity();
                    tracing::debug!(?scope, "idempotency: waiting for the request in flight");
                }
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
                        tokio::select! {
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

    /// Runs the handler as the leader of the scope, and records its response as it streams
    /// (unless the handler recorded it in its own transaction: `ledger`).
    ///
    /// A plain function: the handler's call and the recording are boxed here, before anything
    /// is awaited, and the future returned holds only that box and what it needs after it, so
    /// the write's future (which holds this one) stays small and cheap to move.
    fn run_as_leader<ReqB, ResB>(
        self,
        req: Request<RequestBody<ReqB>>,
        claim: Claim,
        ledger: Option<Arc<TxLedger>>,
        fp: Fingerprint,
    ) -> impl Future<Output = Answer<ResB, S::Error>> + Send + 'static
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        self.shared.counters.executed();
        observe::record_outcome(&self.span, WriteOutcome::Executed);
        tracing::debug!("idempotency: executing");
        let Write {
            inner,
            config,
            shared,
            protocol,
            scope,
            ..
        } = self;
        // Dropped first (the client went away), `Complete` finishes the call and its recording
        // as detached work (bounded by `max_detached` and the claim's lifetime); `Release`
        // drops it (the claim is released). The handler runs in this future until then: a task
        // per execution cost more than the rest of the layer (see BENCHMARKS.md).
        let detach = match config.on_disconnect {
            OnDisconnect::Complete => claim.detach_to("finish a handler whose client went away"),
            OnDisconnect::Release => None,
        };
        let grpc = protocol.is_grpc();
        let run = Box::pin(call_and_record(
            inner,
            req,
            claim,
            ledger,
            config.clone(),
            (scope, fp),
            grpc,
        ));
        let run = DetachOnDrop::new(run, detach);
        async move {
            match run.await {
                Ok(answer) => answer,
                Err(Panicked) => {
                    shared.counters.rejected(RejectReason::Internal);
                    Ok(reject(
                        RejectReason::Internal,
                        "the handler failed; nothing was recorded, a retry executes again",
                        &protocol,
                        &config,
                    ))
                }
            }
        }
    }
}

/// Calls the inner service, readying it first unless `poll_ready` already did.
fn call_inner<S, R>(inner: Inner<S>, req: R) -> impl Future<Output = Result<S::Response, S::Error>>
where
    S: Service<R>,
{
    let (mut inner, ready) = match inner {
        Inner::Ready(s) => (s, true),
        Inner::NotReady(s) => (s, false),
    };
    async move {
        if !ready {
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
        }
        inner.call(req).await
    }
}

/// Calls the inner service and records its response with a [`Recording`] (storing the record
/// at once when the body is already whole; when the head says the outcome is not recordable,
/// answering at once and releasing the claim in the background). When the handler recorded its
/// response in its own transaction (`ledger`), the claim is left as that transaction left it.
/// A handler that fails (an error, a panic) releases the claim, and its failure is the answer
/// of the duplicates that were waiting for it.
///
/// A plain function returning a future, so the request and the service are held once (by the
/// call), not twice (by the outer future too): the future stays small enough for the allocator's
/// fast path when it is boxed.
fn call_and_record<S, ReqB, ResB>(
    inner: Inner<S>,
    req: Request<RequestBody<ReqB>>,
    claim: Claim,
    ledger: Option<Arc<TxLedger>>,
    cfg: Arc<Config>,
    (scope, fp): (ScopeKey, Fingerprint),
    grpc: bool,
) -> impl Future<Output = Result<Answer<ResB, S::Error>, Panicked>>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let http1 = req.version() < Version::HTTP_2;
    // The handler runs as the inbound write of its scope: a `RetryLayer` inside it that derives
    // keys gives its outbound writes the same keys on every run of this write.
    let inbound = InboundWrite::new(scope.0);
    let call = AssertUnwindSafe(inbound.scope(call_inner(inner, req))).catch_unwind();
    // `then`, not an `async` block awaiting `call`: the handler's call and what follows it are
    // the two states of one future, so the request is held once, not also by an `.await` slot
    // beside the captured call.
    call.then(move |called| async move {
        let res = match called {
            Ok(Ok(res)) => res,
            Ok(Err(e)) => {
                // The handler's error goes to its own client; its waiters have nothing to share
                // but the failure itself.
                let failed = || SharedFailure::Reject(RejectReason::InFlightFailed);
                return Ok(
                    match end_without_response(claim, ledger, fp, failed).await {
                        Some(record) => Ok(replay(&record, grpc, cfg.max_record_bytes)),
                        None => Err(e),
                    },
                );
            }
            Err(_) => {
                tracing::error!("idempotency: handler panicked");
                // Its waiters get what its own client gets: 500 / INTERNAL.
                let panicked = || SharedFailure::Reject(RejectReason::Internal);
                return match end_without_response(claim, ledger, fp, panicked).await {
                    Some(record) => Ok(Ok(replay(&record, grpc, cfg.max_record_bytes))),
                    None => Err(Panicked),
                };
            }
        };
        let (mut parts, body) = res.into_parts();
        let verdict = ledger.map_or(TxOutcome::Unused, |l| l.judge(Some(&mut parts.extensions)));
        match verdict {
            TxOutcome::Unused => {}
            TxOutcome::Committed => {
                claim.recorded_in_transaction();
                return Ok(Ok(Response::from_parts(
                    parts,
                    IdempotencyBody::inner(body),
                )));
            }
            TxOutcome::InDoubt => {
                // Dropped mid-way (the client went away), the store operations still complete.
                let detach = claim.detach_to("settle a transactional completion");
                let settled =
                    DetachOnDrop::new(claim.settle(fp), detach.map(DetachTo::store_op)).await;
                return Ok(Ok(match settled {
                    Settled::Recorded(record) => {
                        tracing::warn!(
                            "idempotency: the handler recorded a response in its transaction, \
                             committed, then returned another; answering with the recorded one"
                        );
                        replay(&record, grpc, cfg.max_record_bytes)
                    }
                    Settled::Released | Settled::Unknown => {
                        Response::from_parts(parts, IdempotencyBody::inner(body))
                    }
                }));
            }
        }
        let head_code = match recording::at_head(&cfg, grpc, parts.status, &parts.headers) {
            AtHead::NotRecordable(code) if !claim.has_waiters() => {
                // Answered at once; the store (which may be slow, or down) is told after.
                tracing::debug!(%code, "idempotency: outcome not recordable; releasing");
                claim.release_in_background();
                return Ok(Ok(Response::from_parts(
                    parts,
                    IdempotencyBody::inner(body),
                )));
            }
            // Duplicates wait for it: read like a record (never stored), so they get it too.
            AtHead::NotRecordable(code) => Some(code),
            AtHead::Record(head_code) => head_code,
        };
        // Poll the body once before the head goes out. A body the handler made whole (a `Full`,
        // a `String`, an empty body, which a server never polls) is recorded now, and its head
        // and its one frame then leave together: one write, with no pause between the head and
        // a small last packet while a shared store records it (Nagle and delayed ACKs would
        // stretch that to tens of milliseconds); such a body is answered as it is. A streaming
        // body is read to its end by a task of its own and recorded when it ends. The poll's
        // waker is a no-op: a body not ready now is polled again by that task.
        let started = Recording::new(
            body,
            claim,
            cfg,
            fp,
            parts.status,
            parts.headers.clone(),
            http1,
            head_code,
        )
        .start(&mut Context::from_waker(Waker::noop()));
        if let Some(store) = started.store {
            // Dropped mid-store (the client went away), the store operation still completes.
            store.await;
        }
        Ok(Ok(Response::from_parts(parts, started.body)))
    })
}

/// The request body's data, at most `limit` bytes (else a [`LengthLimitError`]), received by
/// `deadline` (else [`BodyTimedOut`]); trailers are read and left out. A body of one data frame,
/// the common case, is that frame's bytes as they are: no copy and no queue of frames
/// (`Collected` allocates one per body). A body already at hand is read without a timer.
async fn read_whole<B>(body: B, limit: usize, deadline: Option<Instant>) -> Result<Bytes, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut read = std::pin::pin!(read_frames(body, limit));
    // Boxed, and made only when the body is not at hand at the first poll: a timer is as large
    // as the rest of the write's future.
    let mut timer = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = read.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        let Some(deadline) = deadline else {
            return Poll::Pending;
        };
        let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Box::new(BodyTimedOut) as BoxError)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

async fn read_frames<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut first = Bytes::new();
    let mut more: Option<bytes::BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        match &mut more {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut buf = bytes::BytesMut::with_capacity(first.len() + data.len());
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                more = Some(buf);
            }
        }
    }
    Ok(more.map_or(first, bytes::BytesMut::freeze))
}

/// A write's request body did not arrive within `request_body_timeout`.
#[derive(Debug)]
struct BodyTimedOut;

impl fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("request body not received in time")
    }
}

impl std::error::Error for BodyTimedOut {}

/// The handler returned no response (an error, a panic): the duplicates waiting for it get
/// `failure`, and the claim is released in the background; unless the handler recorded a
/// response in its own transaction, which may have committed: then the record it stored, to
/// answer with instead (the client gets what every duplicate will get).
async fn end_without_response(
    claim: Claim,
    ledger: Option<Arc<TxLedger>>,
    fp: Fingerprint,
    failure: impl FnOnce() -> SharedFailure,
) -> Option<Arc<Record>> {
    match ledger.map_or(TxOutcome::Unused, |l| l.judge(None)) {
        TxOutcome::Unused => {
            claim.share_failure(failure);
            claim.release_in_background();
            None
        }
        // Dropped mid-way (the client went away), the store operations still complete.
        _ => {
            let detach = claim.detach_to("settle a transactional completion");
            match DetachOnDrop::new(claim.settle(fp), detach.map(DetachTo::store_op)).await {
                Settled::Recorded(record) => Some(record),
                Settled::Released | Settled::Unknown => None,
            }
        }
    }
}

/// The answer of a duplicate whose leader failed without a record: the leader's own answer,
/// as it was (not marked as a replay: nothing was recorded).
fn shared_failure<B>(answer: &Record) -> Response<IdempotencyBody<B>> {
    let mut res = Response::new(IdempotencyBody::replay(
        answer.body.clone(),
        answer.trailers.as_deref().cloned(),
    ));
    *res.status_mut() = answer.status;
    *res.headers_mut() = answer.headers.clone();
    res
}

/// The recorded response, for a duplicate (`grpc`: the request's protocol).
fn replay<B>(record: &Record, grpc: bool, max_record_bytes: usize) -> Response<IdempotencyBody<B>> {
    if record.body_omitted && grpc {
        return replay_without_message(record, max_record_bytes);
    }
    let mut res = Response::new(IdempotencyBody::replay(
        record.body.clone(),
        record.trailers.as_deref().cloned(),
    ));
    *res.status_mut() = record.status;
    *res.headers_mut() = record.headers.clone();
    let h = res.headers_mut();
    h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if record.body_omitted {
        h.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
        h.remove(CONTENT_LENGTH);
    }
    res
}

/// The replay of a gRPC response whose message was too large to record: a gRPC client cannot use
/// an OK without its message (a unary call fails with INTERNAL "missing response message"), so
/// it gets a trailers-only ALREADY_EXISTS that says what happened: final, never retried.
fn replay_without_message<B>(
    record: &Record,
    max_record_bytes: usize,
) -> Response<IdempotencyBody<B>> {
    let mut res = Response::new(IdempotencyBody::empty());
    let h = res.headers_mut();
    let content_type = record
        .headers
        .get(CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/grpc"));
    h.insert(CONTENT_TYPE, content_type);
    h.insert(
        GRPC_STATUS,
        HeaderValue::from_static(Code::AlreadyExists.as_header_str()),
    );
    h.insert(
        GRPC_MESSAGE,
        encode_grpc_message(&format!(
            "the call with this idempotency key was executed once; its response was larger than \
             the server's max_record_bytes ({max_record_bytes} bytes) and is not replayed: read \
             the result another way, or raise max_record_bytes"
        )),
    );
    h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    h.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("true"));
    res
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::Full;
    use tower::{service_fn, Layer};

    use super::*;
    use crate::IdempotencyLayer;

    async fn created(
        _: Request<RequestBody<Full<Bytes>>>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        Ok(Response::new(Full::new(Bytes::from_static(b"{}"))))
    }

    fn frames(frames: Vec<http_body::Frame<Bytes>>) -> impl Body<Data = Bytes, Error = Infallible> {
        http_body_util::StreamBody::new(futures_util::stream::iter(
            frames.into_iter().map(Ok::<_, Infallible>),
        ))
    }

    /// The body read for the fingerprint: every data frame in order, trailers left out, one
    /// frame taken as it is (the same bytes, not a copy), and a body over the limit refused.
    #[tokio::test]
    async fn the_request_body_is_read_whole() {
        use http_body::Frame;
        let one = Bytes::from_static(b"{\"sku\":\"b1\"}");
        let read = read_whole(frames(vec![Frame::data(one.clone())]), 64, None)
            .await
            .unwrap();
        assert_eq!(read, one);
        assert_eq!(read.as_ptr(), one.as_ptr(), "one frame is not copied");

        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
        let many = vec![
            Frame::data(Bytes::new()),
            Frame::data(Bytes::from_static(b"ab")),
            Frame::data(Bytes::new()),
            Frame::data(Bytes::from_static(b"cd")),
            Frame::data(Bytes::from_static(b"e")),
            Frame::trailers(trailers),
        ];
        assert_eq!(read_whole(frames(many), 64, None).await.unwrap(), "abcde");
        assert_eq!(read_whole(frames(vec![]), 64, None).await.unwrap(), "");

        let big = vec![
            Frame::data(Bytes::from_static(b"abc")),
            Frame::data(Bytes::from_static(b"def")),
        ];
        let err = read_whole(frames(big), 5, None).await.unwrap_err();
        assert!(err.is::<LengthLimitError>(), "{err}");
    }

    /// Every write's future is boxed once and moved and polled on every request, and every
    /// response the layer answers is moved through the stack above it: both stay small. (The
    /// write's future was 3.5 KB while the handler's call was inline in it, and a recording
    /// response's body some hundreds of bytes while the recorder was.)
    #[test]
    fn the_write_future_and_the_response_body_stay_small() {
        let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(created));
        let write = Write {
            inner: Inner::Ready(svc.inner),
            store: svc.store.clone(),
            config: svc.config.clone(),
            shared: svc.shared.clone(),
            scope: ScopeKey([0; 32]),
            tenant: TenantKey::default(),
            protocol: Protocol::of(&http::HeaderMap::new()),
            span: Span::none(),
        };
        let (parts, body) = Request::post("/orders")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
            .into_parts();
        let handle = write.handle(parts, body);
        let size = std::mem::size_of_val(&handle);
        assert!(size <= 1024, "the write's future is {size} bytes");
        let body = std::mem::size_of::<IdempotencyBody<Full<Bytes>>>();
        assert!(body <= 48, "the response body is {body} bytes");
        // The leader's call and recording, boxed once per first execution: within the
        // allocator's per-thread cache (glibc's tcache serves blocks up to 1 032 bytes; it was
        // 1 480 bytes while the request sat both in the call and in the `.await` beside it).
        // 784 since the handler runs as an `InboundWrite` (its scope, kept in the task-local's
        // slot: 40 bytes, cheaper than allocating it apart; see BENCHMARKS.md).
        fn returned<A, B, C, D, E, F, G, R>(_: fn(A, B, C, D, E, F, G) -> R) -> usize {
            std::mem::size_of::<R>()
        }
        fn call_and_record_size<S>(_: &S) -> usize
        where
            S: Service<Request<RequestBody<Full<Bytes>>>, Response = Response<Full<Bytes>>>,
        {
            returned(call_and_record::<S, Full<Bytes>, Full<Bytes>>)
        }
        let run = call_and_record_size(&service_fn(created));
        assert!(run <= 800, "the leader's call and recording is {run} bytes");
    }
}

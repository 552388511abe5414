//! [`Idempotency`]: the service, and the flow of one write.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::accepted::{operation_path, tenant};
use crate::body::{IdempotencyBody, RequestBody};
use crate::config::{Config, TenantFrom};
use crate::future::ResponseFuture;
use crate::head::HeadScan;
use crate::key::key_of;
use crate::observe::{self};
use crate::protocol::Protocol;
use crate::reject::{respond, RejectReason};
use crate::scope::{http_scope_key, scope_key};
use crate::shared::Shared;
use crate::stats::IdempotencyStats;
use crate::store::{IdempotencyStore, MemoryStore, ScopeKeys, TenantKey};
use crate::write::{too_large, Inner, Write};
use reason_code::BoxError;

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) makes: writes with a key execute
/// once per scope; duplicates get the recorded response.
///
/// It keeps the inner service's error type: everything the layer refuses is answered as a
/// response, so no `HandleErrorLayer` is needed.
pub struct Idempotency<S, St = MemoryStore> {
    pub(crate) inner: S,
    /// Shared by the service's clones and writes: a claim's store operations are made on it
    /// through the `Arc`, with no box of their own.
    pub(crate) store: Arc<St>,
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Arc<Shared>,
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
        if !cfg
            .writes
            .contains(req.method(), req.uri(), req.headers(), protocol.is_grpc())
        {
            // `self.inner` is the service that `poll_ready` drove to readiness: take it into the
            // call and leave a fresh clone in its place ("Be careful when cloning inner
            // services", tower-service docs).
            let clone = self.inner.clone();
            let mut inner = std::mem::replace(&mut self.inner, clone);
            return ResponseFuture::passthrough(inner.call(req.map(RequestBody::streaming)));
        }
        let span = observe::write_span(req.method(), req.uri().path(), protocol.is_grpc());
        let rejected = |inner: &mut S, reason: RejectReason, detail: &str| {
            // Nothing runs: the service `poll_ready` readied is let go, with the capacity it
            // reserved (a `ConcurrencyLimit` permit, a `Buffer` slot), so that no other request
            // waits for capacity this one will never use.
            let fresh = inner.clone();
            drop(std::mem::replace(inner, fresh));
            self.shared.counters.rejected(reason);
            observe::record_rejection(&span, reason);
            ResponseFuture::ready(respond(
                reason,
                detail,
                &protocol,
                cfg.reasons.header_name(),
                cfg.rejection_body.as_ref(),
            ))
        };
        if self.shared.draining.is_on() {
            return rejected(
                &mut self.inner,
                RejectReason::ShuttingDown,
                "the server is shutting down and takes no new write; nothing was executed, retry",
            );
        }
        // Taken apart here: the key and the tenant are read from the head where they are (the
        // key is not copied), and the write's future holds the parts and the body once, not the
        // request beside the parts taken from it.
        let (parts, body) = req.into_parts();
        let head = HeadScan::of(&parts.headers, cfg.key_headers.as_slice());
        let (grpc_timeout, declared_length) = (head.grpc_timeout, head.declared_length);
        let key = match head
            .key
            .and_then(|found| key_of(found, cfg.key_rule.as_ref()))
        {
            Ok(Some(key)) => key,
            Ok(None) if cfg.key_optional => {
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let req = Request::from_parts(parts, RequestBody::streaming(body));
                return ResponseFuture::passthrough(inner.call(req));
            }
            Ok(None) => {
                let detail = format!("write operations require {}", cfg.key_header_name());
                return rejected(&mut self.inner, RejectReason::MissingKey, &detail);
            }
            Err(e) => return rejected(&mut self.inner, RejectReason::InvalidKey, &e.to_string()),
        };
        let Some(tenant) = tenant(cfg, &parts) else {
            return rejected(
                &mut self.inner,
                RejectReason::NoTenant,
                "no tenant for this write: the server's auth layer must insert an \
                 idempotency_layer::Tenant extension before the idempotency layer runs, or a \
                 single-tenant service sets IdempotencyLayer::tenant(TenantSource::fixed(..))",
            );
        };
        // A body declared larger than the layer reads is refused before anything is made for
        // it (its `content-length`; one that grows past the bound while read is refused then).
        if declared_length.is_some_and(|n| n > cfg.max_request_bytes as u64) {
            return rejected(&mut self.inner, RejectReason::TooLarge, &too_large(cfg));
        }
        let keys = self.store.scope_keys();
        let scope = if protocol.is_grpc() {
            scope_key(keys, &tenant, &[parts.uri.path().as_bytes()], key)
        } else {
            http_scope_key(keys, &tenant, &parts.method, operation_path(&parts), key)
        };
        let tenant = match &cfg.tenant {
            // The layer's default tenant's key is computed once, when it is set.
            TenantFrom::Default(name, [stable, process]) if Arc::ptr_eq(name, &tenant) => {
                match keys {
                    ScopeKeys::Process => *process,
                    ScopeKeys::Stable => *stable,
                }
            }
            _ => TenantKey::under(keys, &tenant),
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
            grpc_timeout,
            span: span.clone(),
        };
        ResponseFuture::managed(Box::pin(write.handle(parts, body).instrument(span)))
    }
}

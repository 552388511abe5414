//! [`IdempotencyLayer`]: configuration and the tower `Layer`.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, Uri};
use reason_code::{ReasonCodes, RetryTable, IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY};
use tower_layer::Layer;

use crate::claim::Renewals;
use crate::key::Scope;
use crate::metrics::{Counters, Metrics};
use crate::service::Idempotency;
use crate::store::{IdempotencyStore, MemoryStore, StoreError};
use crate::waiters::Waiters;

/// The default of [`IdempotencyLayer::max_waiters`].
const DEFAULT_MAX_WAITERS: usize = 1024;

/// What a duplicate does when the first request with its key is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InFlight {
    /// Wait for the first request (bounded by the request's `grpc-timeout` and
    /// [`max_wait`](IdempotencyLayer::max_wait)) and answer with its outcome. The default.
    #[default]
    Wait,
    /// Answer 409 / ABORTED with `Retry-After` at once.
    Reject,
}

/// What happens to the first request's handler when its client goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnDisconnect {
    /// Drive the handler and its response body to completion in a spawned tokio task and record
    /// the outcome, so the client's retry gets the replay. The default.
    #[default]
    Complete,
    /// Drop the handler (cancelling it) and release the claim, so a retry executes again.
    Release,
}

/// Where the tenant of a request comes from.
#[derive(Clone, Debug)]
pub(crate) enum TenantSource {
    /// The [`Tenant`](crate::Tenant) extension; none means 401 / UNAUTHENTICATED.
    Required,
    /// The [`Tenant`](crate::Tenant) extension, or this tenant when there is none.
    Default(Arc<str>),
    /// A request header (opt-in: clients choose it).
    Header(HeaderName),
}

type WritePredicate = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> bool + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) key_headers: Vec<HeaderName>,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) max_wait: Duration,
    pub(crate) max_waiters: usize,
    pub(crate) waiters: Arc<Waiters>,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_record_bytes: usize,
    pub(crate) fail_open: bool,
    pub(crate) key_optional: bool,
    pub(crate) is_write: Option<WritePredicate>,
    pub(crate) idempotent_grpc: HashSet<String>,
    pub(crate) tenant: TenantSource,
    pub(crate) table: RetryTable,
    pub(crate) reasons: ReasonCodes,
    pub(crate) on_disconnect: OnDisconnect,
    pub(crate) counters: Arc<Counters>,
    /// The claims this layer holds, renewed by one task (for the layer's one store).
    pub(crate) renewals: Arc<Renewals>,
}

impl Config {
    pub(crate) fn is_write(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        grpc: bool,
    ) -> bool {
        if let Some(p) = &self.is_write {
            return p(method, uri, headers);
        }
        if grpc {
            !self.idempotent_grpc.contains(uri.path())
        } else {
            method == Method::POST || method == Method::PATCH
        }
    }

    pub(crate) fn key_header_name(&self) -> &str {
        self.key_headers
            .first()
            .map_or("x-idempotency-key", HeaderName::as_str)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("key_headers", &self.key_headers)
            .field("ttl", &self.ttl)
            .field("lease", &self.lease)
            .field("in_flight", &self.in_flight)
            .field("max_wait", &self.max_wait)
            .field("max_waiters", &self.max_waiters)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("fail_open", &self.fail_open)
            .field("key_optional", &self.key_optional)
            .field("custom_is_write", &self.is_write.is_some())
            .field("idempotent_grpc", &self.idempotent_grpc)
            .field("tenant", &self.tenant)
            .field("on_disconnect", &self.on_disconnect)
            .finish_non_exhaustive()
    }
}

/// The tower [`Layer`] that makes duplicate writes execute once per tenant + method + key.
///
/// See the [crate docs](crate) for what it does and an example. Every builder method consumes
/// and returns the layer; clones share the store and the [metrics](Self::metrics).
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<St = MemoryStore> {
    store: St,
    config: Arc<Config>,
}

impl Default for IdempotencyLayer<MemoryStore> {
    /// A layer over a new [`MemoryStore`].
    fn default() -> Self {
        IdempotencyLayer::new(MemoryStore::new())
    }
}

impl<St> IdempotencyLayer<St> {
    /// A layer over `store`, with the defaults: keys from `x-idempotency-key` or
    /// `Idempotency-Key`; POST and PATCH (and every gRPC method) are writes; tenant required
    /// from the [`Tenant`](crate::Tenant) extension; TTL 24 h; duplicates wait up to 30 s;
    /// requests up to 1 MiB, records up to 1 MiB; fail closed; successes recorded, permanent
    /// failures not.
    pub fn new(store: St) -> Self {
        IdempotencyLayer {
            store,
            config: Arc::new(Config {
                key_headers: vec![X_IDEMPOTENCY_KEY, IDEMPOTENCY_KEY],
                ttl: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(30),
                in_flight: InFlight::Wait,
                max_wait: Duration::from_secs(30),
                max_waiters: DEFAULT_MAX_WAITERS,
                waiters: Arc::default(),
                max_request_bytes: 1024 * 1024,
                max_record_bytes: 1024 * 1024,
                fail_open: false,
                key_optional: false,
                is_write: None,
                idempotent_grpc: HashSet::new(),
                tenant: TenantSource::Required,
                table: RetryTable::default(),
                reasons: ReasonCodes::default(),
                on_disconnect: OnDisconnect::Complete,
                counters: Arc::default(),
                renewals: Arc::default(),
            }),
        }
    }

    fn config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Uses another store, keeping the configuration.
    pub fn with_store<St2>(self, store: St2) -> IdempotencyLayer<St2> {
        // The renewal task of a layer renews through the layer's store: another store, another
        // set of claims.
        let this = self.config(|c| c.renewals = Arc::default());
        IdempotencyLayer {
            store,
            config: this.config,
        }
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// Reads the key from this header only (instead of `x-idempotency-key` and
    /// `Idempotency-Key`).
    pub fn header(self, name: HeaderName) -> Self {
        self.config(|c| c.key_headers = vec![name])
    }

    /// Also reads the key from this header. A request with keys in two headers is refused.
    pub fn also_header(self, name: HeaderName) -> Self {
        self.config(|c| c.key_headers.push(name))
    }

    /// How long a record is kept (default 24 h).
    pub fn ttl(self, ttl: Duration) -> Self {
        self.config(|c| c.ttl = ttl)
    }

    /// The lease of a claim in flight (default 30 s). The leader renews it every third of the
    /// lease while its handler runs; a shared store lets another instance take over a claim
    /// whose lease lapsed (its leader crashed).
    pub fn lease(self, lease: Duration) -> Self {
        self.config(|c| c.lease = lease.max(Duration::from_millis(30)))
    }

    /// What a duplicate does while the first request runs (default [`InFlight::Wait`]).
    pub fn in_flight(self, mode: InFlight) -> Self {
        self.config(|c| c.in_flight = mode)
    }

    /// The longest a duplicate waits for the first request (default 30 s); a gRPC request's
    /// `grpc-timeout` shortens it. When it runs out the duplicate gets 409 / ABORTED.
    pub fn max_wait(self, max: Duration) -> Self {
        self.config(|c| c.max_wait = max)
    }

    /// The most duplicates of one key (one scope) that wait at once in this layer and its clones
    /// (default 1024). Past it, further duplicates get 409 / ABORTED with `Retry-After` at once,
    /// as with [`InFlight::Reject`], instead of holding their request body and a task each: a
    /// flood of duplicates of one key cannot grow the server's memory past about
    /// `max_waiters` x [`max_request_bytes`](Self::max_request_bytes). Other keys are
    /// unaffected. `0` makes every duplicate in flight get 409 / ABORTED.
    pub fn max_waiters(self, max: usize) -> Self {
        self.config(|c| c.max_waiters = max)
    }

    /// The largest request body of a write (default 1 MiB); larger: 413 / RESOURCE_EXHAUSTED.
    pub fn max_request_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_request_bytes = max)
    }

    /// The largest response body recorded (default 1 MiB). A larger response still streams to
    /// its client in full, but is recorded as status and headers only, and its replays carry
    /// `idempotent-body-omitted: true`.
    pub fn max_record_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_record_bytes = max)
    }

    /// When the store fails: `false` (default) answers 503 / UNAVAILABLE with `Retry-After`
    /// and executes nothing; `true` executes the request without protection and logs a warning.
    pub fn fail_open(self, fail_open: bool) -> Self {
        self.config(|c| c.fail_open = fail_open)
    }

    /// `true` passes writes without a key through unprotected instead of answering 400.
    pub fn key_optional(self, optional: bool) -> Self {
        self.config(|c| c.key_optional = optional)
    }

    /// Decides which requests are writes (they need a key and are deduplicated); everything
    /// else passes through untouched. Replaces the default (POST and PATCH; every gRPC method
    /// not declared with [`idempotent_grpc_methods`](Self::idempotent_grpc_methods)).
    pub fn is_write<F>(self, predicate: F) -> Self
    where
        F: Fn(&Method, &Uri, &HeaderMap) -> bool + Send + Sync + 'static,
    {
        self.config(|c| c.is_write = Some(Arc::new(predicate)))
    }

    /// gRPC methods (paths such as `/library.Library/GetBook`) that are reads: they pass
    /// through.
    ///
    /// Declare streaming-request methods here too (or exclude them with
    /// [`is_write`](Self::is_write)): the request body of a write is read in full, up to
    /// [`max_request_bytes`](Self::max_request_bytes), before its handler runs.
    pub fn idempotent_grpc_methods<I>(self, paths: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.config(|c| c.idempotent_grpc.extend(paths.into_iter().map(Into::into)))
    }

    /// Takes the tenant from a request header when the request has no
    /// [`Tenant`](crate::Tenant) extension. Opt-in: a client can claim any tenant this way, so
    /// use it only behind a proxy that sets the header.
    pub fn tenant_from_header(self, name: HeaderName) -> Self {
        self.config(|c| c.tenant = TenantSource::Header(name))
    }

    /// Uses this tenant when a request has no [`Tenant`](crate::Tenant) extension (a
    /// single-tenant service), instead of answering 401 / UNAUTHENTICATED.
    pub fn default_tenant(self, tenant: impl Into<Arc<str>>) -> Self {
        self.config(|c| c.tenant = TenantSource::Default(tenant.into()))
    }

    /// Requires a [`Tenant`](crate::Tenant) extension on every write (the default).
    pub fn require_tenant(self) -> Self {
        self.config(|c| c.tenant = TenantSource::Required)
    }

    /// The table that decides which outcomes are recorded. Opt in to recording permanent
    /// failures with `RetryTable::default().record_permanent_failures(true)`.
    pub fn table(self, table: RetryTable) -> Self {
        self.config(|c| c.table = table)
    }

    /// The business reason codes read from responses (they take precedence over the status).
    pub fn reason_codes(self, reasons: ReasonCodes) -> Self {
        self.config(|c| c.reasons = reasons)
    }

    /// What happens to the handler when the first request's client goes away.
    pub fn on_disconnect(self, mode: OnDisconnect) -> Self {
        self.config(|c| c.on_disconnect = mode)
    }

    /// The counters of every service this layer (and its clones) made.
    pub fn metrics(&self) -> Metrics {
        self.config.counters.snapshot()
    }
}

impl<St: IdempotencyStore> IdempotencyLayer<St> {
    /// Forgets what the store holds for `scope` (for example a recorded permanent failure), so
    /// the next request with that key executes again. True if there was something.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use idempotency_layer::{IdempotencyLayer, Scope};
    ///
    /// let layer = IdempotencyLayer::default();
    /// let method = Scope::http(&http::Method::POST, "/orders");
    /// let forgot = layer.forget(Scope::new("acme", &method, "order-00042")).await.unwrap();
    /// assert!(!forgot);
    /// # }
    /// ```
    pub async fn forget(&self, scope: Scope<'_>) -> Result<bool, StoreError> {
        let key = scope.key();
        let r = self.store.forget(key).await;
        tracing::info!(scope = ?key, forgot = ?r.as_ref().ok(), "idempotency: forget");
        r
    }
}

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.store.clone(), self.config.clone())
    }
}

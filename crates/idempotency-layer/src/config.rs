//! The layer's plain settings: what the builder sets, copied on write by its setters.
//!
//! Nothing here is shared state: counters, waiters and lease renewals live in
//! [`Shared`](crate::shared::Shared), made once per layer and never copied by a setter.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, Uri};
use reason_code::{GrpcMethods, KeyHeaders, ReasonCodes, RetryTable};

use crate::key::KeyRuleFn;
use crate::reject::RejectionBodyFn;
use crate::store::{Fingerprint, ScopeKeys, TenantKey};

/// What a duplicate does when the first request with its key is still running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InFlight {
    /// Wait for the first request (bounded by the request's `grpc-timeout` and
    /// [`max_wait`](crate::IdempotencyLayer::max_wait)) and answer with its outcome. The default.
    #[default]
    Wait,
    /// Answer 409 / ABORTED with `Retry-After` and the reason code
    /// [`IDEMPOTENCY_IN_FLIGHT`](reason_code::IDEMPOTENCY_IN_FLIGHT) at once; `retry-layer`
    /// retries that answer unchanged after the pushback.
    Reject,
}

/// Which of a response's headers its record keeps, and so which a replay sends.
///
/// By default every header but `set-cookie` and `date`:
///
/// - `set-cookie`: a cookie the first answer set (a session, a CSRF token) is for the client
///   that got it, not for whoever sends the same key again;
/// - `date`: a replay is a new message, dated when it is sent (hyper's server stamps a
///   response that has none), not when the first answer was.
///
/// The first client gets every header its handler set either way; only the record is filtered.
/// A header the layer adds to a replay (`idempotent-replayed`) is never recorded.
///
/// ```
/// use http::HeaderName;
/// use idempotency_layer::{IdempotencyLayer, MemoryStore, RecordedHeaders};
///
/// // Keep cookies in replays (say, a cookie that only names the order), and drop a
/// // per-response trace id as well.
/// let headers = RecordedHeaders::default()
///     .keep(http::header::SET_COOKIE)
///     .drop(HeaderName::from_static("x-trace-id"));
/// let layer = IdempotencyLayer::new(MemoryStore::new()).recorded_headers(headers);
/// # let _ = layer;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedHeaders {
    dropped: Vec<HeaderName>,
}

impl Default for RecordedHeaders {
    fn default() -> Self {
        RecordedHeaders {
            dropped: vec![http::header::SET_COOKIE, http::header::DATE],
        }
    }
}

impl RecordedHeaders {
    /// Records every header the handler set, `set-cookie` and `date` included.
    pub fn all() -> Self {
        RecordedHeaders {
            dropped: Vec::new(),
        }
    }

    /// Also leaves `name` out of records.
    pub fn drop(mut self, name: HeaderName) -> Self {
        if !self.dropped.contains(&name) {
            self.dropped.push(name);
        }
        self
    }

    /// Records `name` after all (one of the defaults, say).
    pub fn keep(mut self, name: HeaderName) -> Self {
        self.dropped.retain(|n| *n != name);
        self
    }

    /// Whether a record keeps `name`.
    pub fn records(&self, name: &HeaderName) -> bool {
        !self.dropped.contains(name)
    }

    /// Takes the headers records do not keep out of `headers`.
    pub(crate) fn filter(&self, headers: &mut HeaderMap) {
        for name in &self.dropped {
            headers.remove(name);
        }
    }
}

/// What happens to the first request's handler when its client goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnDisconnect {
    /// Drive the handler and its response body to completion in a spawned tokio task and record
    /// the outcome, so the client's retry gets the replay. The default.
    ///
    /// The task runs in the request's hop (`reason_code::Hop`, which retry-layer's `HopLayer`
    /// sets in front of this layer): a handler serving a retry of the tier above still sends
    /// its own outbound writes once. Other task-locals of the request's task do not follow it.
    #[default]
    Complete,
    /// Drop the handler (cancelling it) and release the claim, so a retry executes again.
    ///
    /// This applies while the handler runs. Once it has answered with a head whose outcome is
    /// recorded (a 2xx, say), its side effect has happened: its body is read to its end and
    /// recorded whatever the client does, in both modes, so a retry gets the replay.
    Release,
}

/// Where the tenant of a request comes from ([`TenantSource`]'s choice).
#[derive(Clone)]
pub(crate) enum TenantFrom {
    /// The [`Tenant`](crate::Tenant) extension; none means 401 / UNAUTHENTICATED.
    Required,
    /// The [`Tenant`](crate::Tenant) extension, or this tenant (and its keys, computed once:
    /// for a store of stable keys, and for one of this process's) when there is none.
    Default(Arc<str>, [TenantKey; 2]),
    /// A request header (opt-in: clients choose it).
    Header(HeaderName),
    /// A function of the request head (for example a verified claim an auth layer left in the
    /// extensions, or a header a trusted proxy sets); `None` means 401 / UNAUTHENTICATED.
    Fn(TenantFn),
}

pub(crate) type TenantFn = Arc<dyn Fn(&http::request::Parts) -> Option<Arc<str>> + Send + Sync>;

impl fmt::Debug for TenantFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantFrom::Required => f.write_str("Required"),
            TenantFrom::Default(t, _) => f.debug_tuple("Default").field(t).finish(),
            TenantFrom::Header(h) => f.debug_tuple("Header").field(h).finish(),
            TenantFrom::Fn(_) => f.write_str("Fn(..)"),
        }
    }
}

/// Where a write's tenant comes from when the request has no [`Tenant`](crate::Tenant)
/// extension (an authentication layer in front of this one inserts it):
/// [`IdempotencyLayer::tenant`](crate::IdempotencyLayer::tenant). Keys are scoped per tenant,
/// so a tenant must never be something the client chooses freely: a client could then read
/// another tenant's recorded responses.
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, TenantSource};
///
/// // A single-tenant service: every key belongs to one tenant.
/// let layer = IdempotencyLayer::default().tenant(TenantSource::fixed("orders"));
/// # let _ = layer;
///
/// /// What the auth layer in front of this one inserts after verifying a token.
/// #[derive(Clone)]
/// struct Claims {
///     org: String,
/// }
/// let layer = IdempotencyLayer::default().tenant(TenantSource::from_fn(|parts| {
///     parts.extensions.get::<Claims>().map(|c| c.org.clone())
/// }));
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct TenantSource(pub(crate) TenantFrom);

impl Default for TenantSource {
    /// [`TenantSource::required`].
    fn default() -> Self {
        TenantSource::required()
    }
}

impl TenantSource {
    /// None: a write without a [`Tenant`](crate::Tenant) extension is answered 401 /
    /// UNAUTHENTICATED (the default).
    pub fn required() -> Self {
        TenantSource(TenantFrom::Required)
    }

    /// This tenant, for a single-tenant service.
    pub fn fixed(tenant: impl Into<Arc<str>>) -> Self {
        let tenant: Arc<str> = tenant.into();
        let keys = [ScopeKeys::Stable, ScopeKeys::Process].map(|k| TenantKey::under(k, &tenant));
        TenantSource(TenantFrom::Default(tenant, keys))
    }

    /// A request header. A client can claim any tenant this way: use it only behind a proxy
    /// that sets the header.
    pub fn header(name: HeaderName) -> Self {
        TenantSource(TenantFrom::Header(name))
    }

    /// A function of the request head (a verified claim an authentication step left in the
    /// extensions, or a header only a trusted proxy sets); `None` answers 401 /
    /// UNAUTHENTICATED.
    pub fn from_fn<F, T>(tenant: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Option<T> + Send + Sync + 'static,
        T: Into<Arc<str>>,
    {
        let f: TenantFn = Arc::new(move |parts| tenant(parts).map(Into::into));
        TenantSource(TenantFrom::Fn(f))
    }
}

type WritePredicate = Arc<dyn Fn(&Method, &Uri, &HeaderMap) -> bool + Send + Sync>;

/// Which requests are writes: each needs an idempotency key and runs once per tenant + method +
/// key; every other request passes through untouched. Set with
/// [`IdempotencyLayer::writes`](crate::IdempotencyLayer::writes).
///
/// The default: POST and PATCH over HTTP; over gRPC, every method but health checks
/// (`/grpc.health.v1.Health/*`), server reflection (`/grpc.reflection.v1.ServerReflection/*`,
/// `v1alpha`) and the methods declared here as idempotent or streaming, which always pass
/// through. [`Writes::from_fn`] replaces the rest of that rule with a function of yours.
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, Writes};
/// use reason_code::GrpcMethods;
///
/// // gRPC: reads declared by path (retry-layer takes the same set), and a streaming method.
/// let writes = Writes::default()
///     .idempotent_grpc_methods(
///         GrpcMethods::new(["/plume.linkd.v3.Library/GetBook", "/plume.linkd.v3.Catalog/"])
///             .expect("valid method paths"),
///     )
///     .streaming_grpc_methods(
///         GrpcMethods::new(["/plume.linkd.v3.Library/ImportBooks"]).expect("valid method paths"),
///     );
/// let layer = IdempotencyLayer::default().writes(writes);
/// # let _ = layer;
///
/// // HTTP: PUT is a write too on this service.
/// let layer = IdempotencyLayer::default().writes(Writes::from_fn(|method, _uri, _headers| {
///     matches!(method.as_str(), "POST" | "PATCH" | "PUT")
/// }));
/// # let _ = layer;
/// ```
#[derive(Clone, Default)]
pub struct Writes {
    idempotent_grpc: GrpcMethods,
    /// Client-streaming and bidirectional methods: passed through, never read whole.
    streaming_grpc: GrpcMethods,
    predicate: Option<WritePredicate>,
}

impl Writes {
    /// Writes are the requests for which `predicate(method, uri, headers)` is true, in place of
    /// the default rule (POST and PATCH; every gRPC method but health checks and server
    /// reflection). The gRPC methods declared with
    /// [`idempotent_grpc_methods`](Self::idempotent_grpc_methods) and
    /// [`streaming_grpc_methods`](Self::streaming_grpc_methods) still pass through before it is
    /// asked.
    pub fn from_fn<F>(predicate: F) -> Self
    where
        F: Fn(&Method, &Uri, &HeaderMap) -> bool + Send + Sync + 'static,
    {
        Writes {
            predicate: Some(Arc::new(predicate)),
            ..Writes::default()
        }
    }

    /// gRPC methods declared idempotent (`/package.Service/Method`, or `/package.Service/` for a
    /// whole service): reads that pass through without a key. `retry-layer`'s
    /// `idempotent_grpc_methods` takes the same type, so one string declares the same methods
    /// on both sides.
    pub fn idempotent_grpc_methods(mut self, methods: GrpcMethods) -> Self {
        self.idempotent_grpc = methods;
        self
    }

    /// gRPC methods whose request is a stream (client-streaming and bidirectional methods, by
    /// path, or `/package.Service/` for a whole service): passed through untouched.
    ///
    /// A write's request body is read whole before its handler runs (its fingerprint covers all
    /// of it), which a streaming call cannot allow: a bidirectional call that waits for a reply
    /// before it half-closes would never reach its handler, and would be answered
    /// DEADLINE_EXCEEDED after
    /// [`request_body_timeout`](crate::IdempotencyLayer::request_body_timeout). The layer does
    /// not deduplicate such methods: make them idempotent in the handler (a key in the first
    /// message, checked against your own table), or split the write into a unary call.
    pub fn streaming_grpc_methods(mut self, methods: GrpcMethods) -> Self {
        self.streaming_grpc = methods;
        self
    }

    /// Is this request a write (deduplicated) rather than a read (passed through)?
    pub(crate) fn contains(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        grpc: bool,
    ) -> bool {
        let path = uri.path();
        if grpc && (self.idempotent_grpc.contains(path) || self.streaming_grpc.contains(path)) {
            return false;
        }
        if let Some(p) = &self.predicate {
            return p(method, uri, headers);
        }
        if grpc {
            !INFRASTRUCTURE_GRPC_SERVICES
                .iter()
                .any(|service| path.starts_with(service))
        } else {
            method == Method::POST || method == Method::PATCH
        }
    }
}

impl fmt::Debug for Writes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writes")
            .field("idempotent_grpc", &self.idempotent_grpc)
            .field("streaming_grpc", &self.streaming_grpc)
            .field("custom_predicate", &self.predicate.is_some())
            .finish()
    }
}

/// A fingerprint of the layer's own: of a request's head and whole body.
pub(crate) type FingerprintFn =
    Arc<dyn Fn(&http::request::Parts, &bytes::Bytes) -> Fingerprint + Send + Sync>;

/// gRPC services whose methods are never writes: health probes and server reflection.
const INFRASTRUCTURE_GRPC_SERVICES: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// The default of [`IdempotencyLayer::max_waiters`](crate::IdempotencyLayer::max_waiters).
const DEFAULT_MAX_WAITERS: usize = 1024;

/// The default of [`IdempotencyLayer::max_waiting_bytes`](crate::IdempotencyLayer::max_waiting_bytes).
pub(crate) const DEFAULT_MAX_WAITING_BYTES: usize = 64 << 20;

/// The default of [`IdempotencyLayer::max_response_buffer_bytes`](crate::IdempotencyLayer::max_response_buffer_bytes).
pub(crate) const DEFAULT_MAX_RESPONSE_BUFFER_BYTES: usize = 64 << 20;

/// The default of [`IdempotencyLayer::max_claim_lifetime`](crate::IdempotencyLayer::max_claim_lifetime).
pub(crate) const DEFAULT_MAX_CLAIM_LIFETIME: Duration = Duration::from_secs(5 * 60);

/// The default of [`IdempotencyLayer::request_body_timeout`](crate::IdempotencyLayer::request_body_timeout).
pub(crate) const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The default of [`IdempotencyLayer::max_detached`](crate::IdempotencyLayer::max_detached).
pub(crate) const DEFAULT_MAX_DETACHED: usize = 1024;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) key_headers: KeyHeaders,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) max_wait: Duration,
    pub(crate) max_waiters: usize,
    pub(crate) max_waiting_bytes: usize,
    pub(crate) max_response_buffer_bytes: usize,
    /// How long a claim may be held at most; renewal stops there.
    pub(crate) max_claim_lifetime: Duration,
    /// How long a write's request body may take to arrive.
    pub(crate) request_body_timeout: Duration,
    /// How much detached work (handlers and recordings whose client went away, background
    /// releases) may run at once, layer-wide.
    pub(crate) max_detached: usize,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_record_bytes: usize,
    pub(crate) recorded_headers: RecordedHeaders,
    pub(crate) fail_open: bool,
    pub(crate) key_optional: bool,
    pub(crate) writes: Writes,
    pub(crate) tenant: TenantFrom,
    pub(crate) table: RetryTable,
    pub(crate) reasons: ReasonCodes,
    pub(crate) on_disconnect: OnDisconnect,
    pub(crate) fingerprint: Option<FingerprintFn>,
    pub(crate) key_rule: Option<KeyRuleFn>,
    pub(crate) rejection_body: Option<RejectionBodyFn>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            key_headers: KeyHeaders::default(),
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            in_flight: InFlight::Wait,
            max_wait: Duration::from_secs(30),
            max_waiters: DEFAULT_MAX_WAITERS,
            max_waiting_bytes: DEFAULT_MAX_WAITING_BYTES,
            max_response_buffer_bytes: DEFAULT_MAX_RESPONSE_BUFFER_BYTES,
            max_claim_lifetime: DEFAULT_MAX_CLAIM_LIFETIME,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            max_detached: DEFAULT_MAX_DETACHED,
            max_request_bytes: 1024 * 1024,
            max_record_bytes: 1024 * 1024,
            recorded_headers: RecordedHeaders::default(),
            fail_open: false,
            key_optional: false,
            writes: Writes::default(),
            tenant: TenantFrom::Required,
            table: RetryTable::default(),
            reasons: ReasonCodes::default(),
            on_disconnect: OnDisconnect::Complete,
            fingerprint: None,
            key_rule: None,
            rejection_body: None,
        }
    }
}

impl Config {
    pub(crate) fn key_header_name(&self) -> &str {
        self.key_headers.first().as_str()
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
            .field("max_waiting_bytes", &self.max_waiting_bytes)
            .field("max_response_buffer_bytes", &self.max_response_buffer_bytes)
            .field("max_claim_lifetime", &self.max_claim_lifetime)
            .field("request_body_timeout", &self.request_body_timeout)
            .field("max_detached", &self.max_detached)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("recorded_headers", &self.recorded_headers)
            .field("fail_open", &self.fail_open)
            .field("key_optional", &self.key_optional)
            .field("writes", &self.writes)
            .field("tenant", &self.tenant)
            .field("on_disconnect", &self.on_disconnect)
            .field("custom_fingerprint", &self.fingerprint.is_some())
            .field("custom_key_rule", &self.key_rule.is_some())
            .field("custom_rejection_body", &self.rejection_body.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_and_reflection_are_reads_by_default() {
        let cfg = Config::default();
        let h = HeaderMap::new();
        let is_write = |path: &'static str| {
            cfg.writes
                .contains(&Method::POST, &Uri::from_static(path), &h, true)
        };
        assert!(!is_write("/grpc.health.v1.Health/Check"));
        assert!(!is_write("/grpc.health.v1.Health/Watch"));
        assert!(!is_write(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!is_write(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        ));
        assert!(is_write("/library.Library/CreateOrder"));
        assert!(is_write("/grpc.health.v1.Healthy/Check"));
    }
}

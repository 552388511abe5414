//! [`IdempotencyLayer`]: the builder and the tower `Layer`.

use std::sync::Arc;
use std::time::Duration;

use reason_code::{KeyHeaders, ReasonCodes, RetryTable};
use tower_layer::Layer;

use crate::config::{Config, InFlight, OnDisconnect, RecordedHeaders, TenantSource, Writes};
use crate::scope::Scope;
use crate::service::Idempotency;
use crate::shared::Shared;
use crate::stats::IdempotencyStats;
use crate::store::{Held, IdempotencyStore, MemoryStore, StoreError, FOREVER};

/// The tower [`Layer`] that makes duplicate writes execute once per tenant + method + key.
///
/// See the [crate docs](crate) for what it does and an example. Every builder method consumes
/// and returns the layer.
///
/// Cloning the layer shares the store, the [counters](Self::stats), the
/// [`max_waiters`](Self::max_waiters) bound and the task that renews leases; a setter called on
/// a clone changes that clone's settings only.
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<St = MemoryStore> {
    store: St,
    config: Arc<Config>,
    shared: Arc<Shared>,
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
    /// from the [`Tenant`](crate::Tenant) extension; TTL 24 h; a write's request body must
    /// arrive within 30 s; duplicates wait up to 30 s; a claim is held at most 5 minutes;
    /// requests up to 1 MiB, records up to 1 MiB; at most 1024 pieces of detached work;
    /// fail closed; successes recorded, permanent failures not.
    ///
    /// Every duration setting is clamped to 100 years ("keep forever"): `Duration::MAX` is a
    /// valid setting, never an overflow. The layer's setters cannot fail (a layer is made inside
    /// a `ServiceBuilder` chain, with no fallible step): the one value below its floor (a
    /// [`lease`](Self::lease) under 30 ms) is raised to it with a warning. The stores' builders
    /// refuse a bad setting with [`StoreError::Config`].
    pub fn new(store: St) -> Self {
        IdempotencyLayer {
            store,
            config: Arc::new(Config::default()),
            shared: Arc::default(),
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
        IdempotencyLayer {
            store,
            shared: Arc::new(self.shared.for_another_store()),
            config: self.config,
        }
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// The headers a key is read from (default `x-idempotency-key`, then `Idempotency-Key`). A
    /// request with keys in two of them is refused. `retry-layer`'s `key_headers` takes the same
    /// type, so both halves agree on where keys travel.
    ///
    /// ```
    /// use http::HeaderName;
    /// use idempotency_layer::IdempotencyLayer;
    /// use reason_code::KeyHeaders;
    ///
    /// let headers = KeyHeaders::new([HeaderName::from_static("x-request-key")]).unwrap();
    /// let layer = IdempotencyLayer::default().key_headers(headers);
    /// # let _ = layer;
    /// ```
    pub fn key_headers(self, headers: KeyHeaders) -> Self {
        self.config(|c| c.key_headers = headers)
    }

    /// How long a record is kept (default 24 h).
    pub fn ttl(self, ttl: Duration) -> Self {
        self.config(|c| c.ttl = ttl.min(FOREVER))
    }

    /// The lease of a claim in flight (default 30 s). The leader renews it every fourth of the
    /// lease while its handler runs (and again shortly after a renewal fails); a shared store
    /// lets another instance take over a claim whose lease lapsed (its leader crashed). A store
    /// that refuses or stalls renewals for about three quarters of a lease or more can lapse a
    /// live claim: a duplicate may then run the write again, so choose a lease well above the
    /// longest store outage you want to ride through.
    ///
    /// At least 30 ms (a shorter one is raised to it, with a warning: renewals could not keep
    /// up).
    pub fn lease(self, lease: Duration) -> Self {
        let floor = Duration::from_millis(30);
        if lease < floor {
            tracing::warn!(
                ?lease,
                "idempotency: a lease under 30 ms cannot be renewed in time; using 30 ms"
            );
        }
        self.config(|c| c.lease = lease.clamp(floor, FOREVER))
    }

    /// The longest a claim is held (default 5 minutes), from the moment its write claimed the
    /// key: the bound on how long one write can keep its key in flight.
    ///
    /// The leader's response is recorded as soon as its handler's body ends, independently of
    /// how fast its client reads it, so only a handler that runs this long (or a response body
    /// that streams this long, or one larger than
    /// [`max_record_bytes`](Self::max_record_bytes) whose client stalls) reaches it. Then the
    /// lease is no longer renewed and the claim lapses with it (a retry may then execute
    /// again), counted in [`IdempotencyStats::lapsed`] and logged at `WARN`; work detached
    /// from a gone client is cancelled; and a response whose head was already recorded-worthy
    /// (a 2xx, say) is recorded without its body, and its client's stream ends with an error.
    /// Set it above your slowest write.
    pub fn max_claim_lifetime(self, max: Duration) -> Self {
        self.config(|c| c.max_claim_lifetime = max.min(FOREVER))
    }

    /// How long a write's request body may take to arrive (default 30 s; a gRPC request's
    /// `grpc-timeout` shortens it). The layer reads a write's whole body (to fingerprint it)
    /// before anything is claimed or run; a body not received in time is answered 408 Request
    /// Timeout / DEADLINE_EXCEEDED, and nothing was claimed and nothing ran. This is what keeps
    /// a slow-loris client, or a client-streaming gRPC call that waits for a reply before
    /// half-closing, from holding a request open forever: declare such methods with
    /// [`Writes::streaming_grpc_methods`].
    pub fn request_body_timeout(self, timeout: Duration) -> Self {
        self.config(|c| c.request_body_timeout = timeout.min(FOREVER))
    }

    /// The most work the layer keeps running for requests whose client went away, layer-wide
    /// (default 1024): handlers finished after their client left ([`OnDisconnect::Complete`])
    /// and response bodies read to their end to record them, each also ended at
    /// [`max_claim_lifetime`](Self::max_claim_lifetime); and, counted apart, as many store
    /// operations finishing in the background (a record whose client left while it was stored,
    /// a claim released after its failure was answered), each bounded by the store's retries
    /// within one lease.
    ///
    /// Past the limit (an RST_STREAM flood, say), a handler whose client left is cancelled and
    /// its claim released, as with [`OnDisconnect::Release`]; a response body not yet read to
    /// its end is recorded without its body if its head is recorded-worthy; a store operation
    /// for a client that went away is not made (its claim lapses with its lease). Each is
    /// counted in [`IdempotencyStats::detached_refused`]. The release of a claim whose client
    /// still waits (a failure the table does not record) is made before its answer goes out
    /// then, rather than left to lapse: a key is never held a whole lease for want of room.
    pub fn max_detached(self, max: usize) -> Self {
        self.config(|c| c.max_detached = max)
    }

    /// What a duplicate does while the first request runs (default [`InFlight::Wait`]).
    pub fn in_flight(self, mode: InFlight) -> Self {
        self.config(|c| c.in_flight = mode)
    }

    /// The longest a duplicate waits for the first request (default 30 s), counted from when it
    /// arrived; a gRPC request's `grpc-timeout` shortens it. When it runs out the duplicate gets 409 / ABORTED with
    /// `Retry-After` and the reason code
    /// [`IDEMPOTENCY_IN_FLIGHT`](reason_code::IDEMPOTENCY_IN_FLIGHT), which `retry-layer`
    /// retries unchanged after the pushback.
    ///
    /// It bounds too how long a write whose request body was not at hand waits, once the body
    /// is read, for the service under the layer to be ready again (the write gives back the
    /// capacity its service reserved, a `ConcurrencyLimit` permit say, while its body comes):
    /// past it the write gets 503 / UNAVAILABLE with `Retry-After`
    /// ([`RejectReason::Overloaded`](crate::RejectReason::Overloaded)), nothing run.
    pub fn max_wait(self, max: Duration) -> Self {
        self.config(|c| c.max_wait = max.min(FOREVER))
    }

    /// The most duplicates of one key (one scope) that wait at once in this layer and its clones
    /// (default 1024). Past it, further duplicates get 409 / ABORTED with `Retry-After` (and the
    /// reason code [`IDEMPOTENCY_IN_FLIGHT`](reason_code::IDEMPOTENCY_IN_FLIGHT)) at once, as
    /// with [`InFlight::Reject`], instead of holding their request body and a task each. Other
    /// keys are unaffected. `0` makes every duplicate in flight get 409 / ABORTED. The memory
    /// of all waiters together, over every key, is bounded by
    /// [`max_waiting_bytes`](Self::max_waiting_bytes).
    pub fn max_waiters(self, max: usize) -> Self {
        self.config(|c| c.max_waiters = max)
    }

    /// The most bytes that duplicates waiting for their key's request in flight may hold at
    /// once in this layer and its clones, over every key (default 64 MiB): each waiter counts
    /// its request body, its head (URI and headers, names and values, and about 64 bytes per
    /// header) and about 0.5 KiB for its state. Past it, further duplicates get
    /// 409 / ABORTED with `Retry-After` (reason code
    /// [`IDEMPOTENCY_IN_FLIGHT`](reason_code::IDEMPOTENCY_IN_FLIGHT)) at once, whatever their
    /// key. [`max_waiters`](Self::max_waiters) bounds one key's waiters; this bounds them all,
    /// so that floods of duplicates on many keys at once cannot grow the server's memory
    /// without bound (`max_waiters` x [`max_request_bytes`](Self::max_request_bytes) per key,
    /// times every key in flight). The default holds about 60 000 waiters with bodies of 100
    /// bytes, or 63 with bodies of 1 MiB.
    pub fn max_waiting_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_waiting_bytes = max)
    }

    /// The most response bytes the layer holds for clients that have not read them yet, all
    /// responses together (default 64 MiB).
    ///
    /// The layer reads a leader's response body as fast as the handler makes it, so that its
    /// record is stored when the body ends, not when a slow client reads its last frame. Each
    /// response may hold its first 64 KiB for its client whatever this says; beyond that, the
    /// bytes are charged here, and when they are spent each response is read at its own
    /// client's pace (flow control reaches the handler). Clients that do not read then cannot
    /// grow the server's memory without bound.
    pub fn max_response_buffer_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_response_buffer_bytes = max)
    }

    /// The largest request body of a write (default 1 MiB); larger: 413 / RESOURCE_EXHAUSTED
    /// with the reason code [`REQUEST_TOO_LARGE`](reason_code::REQUEST_TOO_LARGE), which no
    /// client retries (it can never fit).
    pub fn max_request_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_request_bytes = max)
    }

    /// The largest response body recorded (default 1 MiB). A larger response still streams to
    /// its client in full, but is recorded as status and headers only, and its replays carry
    /// `idempotent-body-omitted: true`.
    ///
    /// A gRPC client cannot use a replay without its message (a unary call would fail with
    /// INTERNAL "missing response message"), so over gRPC such a replay answers
    /// ALREADY_EXISTS, with a `grpc-message` saying that the write was executed once and its
    /// response was too large to keep: a final answer that no client retries.
    pub fn max_record_bytes(self, max: usize) -> Self {
        self.config(|c| c.max_record_bytes = max)
    }

    /// Which response headers a record keeps (default: all but `set-cookie` and `date`; see
    /// [`RecordedHeaders`]). The first client gets every header either way.
    pub fn recorded_headers(self, headers: RecordedHeaders) -> Self {
        self.config(|c| c.recorded_headers = headers)
    }

    /// When the store fails: `false` (default) answers 503 / UNAVAILABLE with `Retry-After`
    /// and executes nothing; `true` executes the request without protection and logs a warning.
    ///
    /// Fail-open is for "we cannot know whether this ran": a request known to have a write with
    /// its key in flight is answered 503 even then, never run beside it. Known when it waited
    /// for that write, when a claim of this layer holds its key, when another request of this
    /// layer has asked the store for its key and not yet had the answer (that `begin` may have
    /// been granted), or when its client says an earlier attempt of the same call was answered that the key was in flight
    /// ([`IDEMPOTENCY_SEEN_IN_FLIGHT`](reason_code::IDEMPOTENCY_SEEN_IN_FLIGHT), which
    /// `retry-layer` sends on every attempt after such an answer). A full store, or a corrupt
    /// entry, never fails open.
    pub fn fail_open(self, fail_open: bool) -> Self {
        self.config(|c| c.fail_open = fail_open)
    }

    /// `true` passes writes without a key through unprotected instead of answering 400.
    pub fn key_optional(self, optional: bool) -> Self {
        self.config(|c| c.key_optional = optional)
    }

    /// Which requests are writes (they need a key and run once per key); everything else
    /// passes through untouched. The default: POST and PATCH; every gRPC method but health
    /// checks and server reflection. Declare gRPC reads and streaming methods on
    /// [`Writes`], or replace the rule with [`Writes::from_fn`].
    ///
    /// ```
    /// use idempotency_layer::{IdempotencyLayer, Writes};
    /// use reason_code::GrpcMethods;
    ///
    /// let reads = GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"]).expect("a method path");
    /// let layer = IdempotencyLayer::default().writes(Writes::default().idempotent_grpc_methods(reads));
    /// # let _ = layer;
    /// ```
    pub fn writes(self, writes: Writes) -> Self {
        self.config(|c| c.writes = writes)
    }

    /// Where a write's tenant comes from when the request has no [`Tenant`](crate::Tenant)
    /// extension: [`TenantSource::required`] (the default: 401 / UNAUTHENTICATED),
    /// [`TenantSource::fixed`] for a single-tenant service, [`TenantSource::header`] or
    /// [`TenantSource::from_fn`].
    pub fn tenant(self, source: TenantSource) -> Self {
        self.config(|c| c.tenant = source.0)
    }

    /// The table that decides which outcomes are recorded. Opt in to recording permanent
    /// failures with `RetryTable::default().record_permanent_failures(true)`.
    ///
    /// It is the client's [`RetryTable`] on purpose, not a type of the server's own: one table
    /// says both what a client retries and what a server does not record, so that the two
    /// halves cannot disagree (an outcome retried and also recorded would replay the failure
    /// to every retry; one neither retried nor recorded would run again on a retry of the
    /// client's own).
    pub fn table(self, table: RetryTable) -> Self {
        self.config(|c| c.table = table)
    }

    /// The business reason codes read from responses (they refine a failed status, never a
    /// success).
    pub fn reason_codes(self, reasons: ReasonCodes) -> Self {
        self.config(|c| c.reasons = reasons)
    }

    /// Fingerprints writes with a function of your own instead of the layer's (method, path,
    /// query, content type and body bytes): a request with the same scope and another
    /// fingerprint is refused with 422 / FAILED_PRECONDITION. Use it when equal requests can
    /// differ in bytes, for example a client that re-serialises its JSON body on a retry: hash a
    /// canonical form, with [`Fingerprint::of_request`](crate::store::Fingerprint::of_request).
    /// The function sees the request's head and whole body (read up to
    /// [`max_request_bytes`](Self::max_request_bytes)). Changing it changes the fingerprint of
    /// every request: records made before are then refused as mismatches until they expire.
    ///
    /// ```
    /// use idempotency_layer::store::Fingerprint;
    /// use idempotency_layer::IdempotencyLayer;
    ///
    /// // JSON bodies fingerprinted in a canonical form: keys sorted, no insignificant spaces.
    /// let layer = IdempotencyLayer::default().fingerprint_fn(|parts, body| {
    ///     match serde_json::from_slice::<serde_json::Value>(body) {
    ///         Ok(json) => Fingerprint::of_request(parts, json.to_string().as_bytes()),
    ///         Err(_) => Fingerprint::of_request(parts, body),
    ///     }
    /// });
    /// # let _ = layer;
    /// ```
    pub fn fingerprint_fn<F>(self, fingerprint: F) -> Self
    where
        F: Fn(&http::request::Parts, &bytes::Bytes) -> crate::store::Fingerprint
            + Send
            + Sync
            + 'static,
    {
        self.config(|c| c.fingerprint = Some(Arc::new(fingerprint)))
    }

    /// Validates keys with a rule of your own instead of `[A-Za-z0-9_-]{8,64}` (Stripe allows
    /// 255 characters; the IETF draft sets no format). The rule gets the key (bare, or the
    /// string of a structured-field string, as for the default rule; always visible ASCII,
    /// without spaces or quotes) and answers `Err(message)` to refuse it: 400 /
    /// INVALID_ARGUMENT with that message. Keys are hashed into the scope, so their length
    /// costs the store nothing.
    ///
    /// ```
    /// use idempotency_layer::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::default().key_rule(|key| match key.len() {
    ///     1..=255 => Ok(()),
    ///     n => Err(format!("idempotency key is {n} characters long: use 1 to 255")),
    /// });
    /// # let _ = layer;
    /// ```
    pub fn key_rule<F>(self, rule: F) -> Self
    where
        F: Fn(&str) -> Result<(), String> + Send + Sync + 'static,
    {
        self.config(|c| c.key_rule = Some(Arc::new(rule)))
    }

    /// Shapes the body of the layer's own HTTP answers (rejections: a missing key, a mismatch,
    /// a full store, ...) instead of the default `application/problem+json` document: the
    /// function gets the [`Rejection`](crate::Rejection) and answers the content type and the
    /// bytes. Their status, `Retry-After` and reason code are the layer's, so clients read them
    /// as the one table says. gRPC answers are trailers-only and keep their `grpc-message`.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::HeaderValue;
    /// use idempotency_layer::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::default().rejection_body(|r| {
    ///     let body = serde_json::json!({ "error": { "code": r.code.as_str(), "message": r.detail } });
    ///     (HeaderValue::from_static("application/json"), Bytes::from(body.to_string()))
    /// });
    /// # let _ = layer;
    /// ```
    pub fn rejection_body<F>(self, body: F) -> Self
    where
        F: Fn(&crate::Rejection<'_>) -> (http::HeaderValue, bytes::Bytes) + Send + Sync + 'static,
    {
        self.config(|c| c.rejection_body = Some(Arc::new(body)))
    }

    /// What happens to the handler when the first request's client goes away.
    pub fn on_disconnect(self, mode: OnDisconnect) -> Self {
        self.config(|c| c.on_disconnect = mode)
    }

    /// The counters of every service this layer (and its clones) made.
    pub fn stats(&self) -> IdempotencyStats {
        self.shared.stats()
    }
}

/// How a [`drain`](IdempotencyLayer::drain) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Claims still held when the grace ran out (their handlers or recordings had not
    /// finished): no longer renewed, they lapse with their leases, and a retry after that runs
    /// them again. 0: everything the layer had started is recorded or released.
    pub left: u64,
}

impl<St> IdempotencyLayer<St> {
    /// Drains the layer for a graceful shutdown (a rolling deploy's SIGTERM): from now on every
    /// write is answered 503 / UNAVAILABLE with `Retry-After` (`RejectReason::ShuttingDown`;
    /// nothing runs, a client retries it elsewhere or later), and the claims this layer and its
    /// clones hold (handlers running, responses being recorded, work detached from clients
    /// that went away) get up to `grace` to finish and store their records. Then renewal stops:
    /// what is left lapses with its lease. Reads pass through as before.
    ///
    /// Run it beside the server's own graceful shutdown (axum's `with_graceful_shutdown`,
    /// tonic's `serve_with_shutdown`), which stops accepting connections and lets the responses
    /// in flight go out, and exit the process only after both: a process that exits between a
    /// handler's side effect and its record makes the client's retry run it again.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// use idempotency_layer::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::default();
    /// // ... serve with `layer.clone()`; on SIGTERM:
    /// let drained = layer.drain(Duration::from_secs(30)).await;
    /// assert_eq!(drained.left, 0);
    /// assert!(layer.is_draining());
    /// # }
    /// ```
    pub async fn drain(&self, grace: Duration) -> Drained {
        let drain = &self.shared.draining;
        drain.start();
        tracing::info!(?grace, "idempotency: draining; new writes are refused");
        let until = tokio::time::Instant::now().checked_add(grace.min(FOREVER));
        loop {
            let idle = drain.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.shared.counters.in_flight() == 0 {
                tracing::info!("idempotency: drained");
                return Drained { left: 0 };
            }
            let woken = match until {
                Some(until) => tokio::time::timeout_at(until, idle).await.is_ok(),
                None => {
                    idle.await;
                    true
                }
            };
            if !woken {
                let left = self.shared.counters.in_flight();
                let stopped = self.shared.renewals.stop_all();
                tracing::warn!(
                    left,
                    stopped,
                    "idempotency: drain's grace ran out; the claims left lapse with their leases"
                );
                return Drained { left };
            }
        }
    }

    /// True once [`drain`](Self::drain) has started.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.is_on()
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
    /// let method = Scope::http_operation(&http::Method::POST, "/orders");
    /// let forgot = layer.forget(Scope::new("acme", &method, "order-00042")).await.unwrap();
    /// assert!(!forgot);
    /// # }
    /// ```
    pub async fn forget(&self, scope: Scope<'_>) -> Result<bool, StoreError> {
        let key = scope.key_in(&self.store);
        let r = self.store.forget(key).await;
        tracing::info!(scope = ?key, forgot = ?r.as_ref().ok(), "idempotency: forget");
        r
    }

    /// What the store holds for `scope` now, claiming nothing: a write in flight, its record
    /// (what every duplicate is answered), or `None`. For a support page or an operator's tool;
    /// [`forget`](Self::forget) clears it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use idempotency_layer::{IdempotencyLayer, Scope};
    ///
    /// let layer = IdempotencyLayer::default();
    /// let method = Scope::http_operation(&http::Method::POST, "/orders");
    /// let held = layer.lookup(Scope::new("acme", &method, "order-00042")).await.unwrap();
    /// assert!(held.is_none());
    /// # }
    /// ```
    pub async fn lookup(&self, scope: Scope<'_>) -> Result<Option<Held>, StoreError> {
        self.store.lookup(scope.key_in(&self.store)).await
    }
}

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(
            inner,
            self.store.clone(),
            self.config.clone(),
            self.shared.clone(),
        )
    }
}

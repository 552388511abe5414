//! Server-side idempotency for tower stacks: a duplicate write executes once per
//! tenant + method + idempotency key, and every duplicate gets the recorded response.
//!
//! A client that retries a write after a timeout cannot know whether the first attempt ran.
//! With an idempotency key per business intent (`x-idempotency-key` or `Idempotency-Key`) and
//! this layer on the server, the retry is answered with the first attempt's response instead
//! of running the side effect again. It works on axum routers and tonic servers alike.
//!
//! # Example
//!
//! ```
//! use axum::{routing::post, Router};
//! use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource};
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! static ORDERS: AtomicUsize = AtomicUsize::new(0);
//!
//! let app = Router::new()
//!     .route("/orders", post(|| async {
//!         let n = ORDERS.fetch_add(1, Ordering::SeqCst) + 1;
//!         format!("order {n} created")
//!     }))
//!     // Single-tenant service; behind an auth layer, insert a `Tenant` extension instead.
//!     .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("shop")));
//!
//! let request = || {
//!     http::Request::post("/orders")
//!         .header("x-idempotency-key", "order-7f3a9c21")
//!         .body(axum::body::Body::from(r#"{"sku":"b1"}"#))
//!         .unwrap()
//! };
//! let body = |r: axum::response::Response| async {
//!     axum::body::to_bytes(r.into_body(), 1024).await.unwrap()
//! };
//! // The record is stored when the first response's body has been sent.
//! let first = body(app.clone().oneshot(request()).await.unwrap()).await;
//! let retry = app.clone().oneshot(request()).await.unwrap();
//!
//! assert_eq!(ORDERS.load(Ordering::SeqCst), 1, "the handler ran once");
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(body(retry).await, first);
//! # }
//! ```
//!
//! On a tonic server: `Server::builder().layer(IdempotencyLayer::new(store)).add_service(..)`.
//! Rejections are answered in the request's protocol: an `application/problem+json` body with
//! `title`, `status`, `detail` and a `code` field for HTTP, a trailers-only response with
//! `grpc-status` and `grpc-message` for gRPC.
//!
//! # What the layer does with a request
//!
//! - **Reads pass through untouched** (GET, HEAD, PUT, DELETE, ... by default: only POST and
//!   PATCH are writes; for gRPC and gRPC-Web every method is a write except those declared with
//!   [`Writes::idempotent_grpc_methods`] or [`Writes::streaming_grpc_methods`], health checks
//!   (`grpc.health.v1.Health`) and server reflection; or a rule of your own,
//!   [`Writes::from_fn`], all set with [`writes`](IdempotencyLayer::writes)).
//! - **Writes need a key**, `[A-Za-z0-9_-]{8,64}` (a UUID fits), bare or as a quoted
//!   structured-field string. Missing: 400 / INVALID_ARGUMENT "write operations require
//!   x-idempotency-key"; invalid, repeated or non-ASCII: 400 / INVALID_ARGUMENT naming the rule
//!   ([`key_optional`](IdempotencyLayer::key_optional) passes keyless writes through instead).
//! - **Writes need a tenant**: the [`Tenant`] extension an auth layer set, else 401 /
//!   UNAUTHENTICATED (or [`TenantSource::fixed`] for a single-tenant service, or the opt-in
//!   [`TenantSource::header`], set with [`tenant`](IdempotencyLayer::tenant)).
//! - The **scope** is tenant + operation + key, encoded without ambiguity and hashed
//!   ([`Scope`]). The operation is the gRPC path, or over HTTP the method and the route's
//!   template where an axum `Router` names it (`POST /books/{id}/deduct`, with the default
//!   feature `axum` and the layer added by `Router::layer`), else the concrete path. The
//!   **fingerprint** hashes method, concrete path, query, content type and body: the same scope
//!   with another fingerprint (one key reused on `/books/b2/deduct` after `/books/b1/deduct`,
//!   or with another body) gets 422 / FAILED_PRECONDITION and nothing runs: one key names one
//!   operation. Bodies over
//!   [`max_request_bytes`](IdempotencyLayer::max_request_bytes) get 413 / RESOURCE_EXHAUSTED
//!   with the reason code [`REQUEST_TOO_LARGE`](reason_code::REQUEST_TOO_LARGE), which no client
//!   retries; a body that does not arrive within
//!   [`request_body_timeout`](IdempotencyLayer::request_body_timeout) gets 408 /
//!   DEADLINE_EXCEEDED. Either way nothing was claimed and nothing ran.
//! - The **first request** claims the scope in the store (with a lease and a fencing token),
//!   runs the handler, and streams the response to its client while recording it. Duplicates
//!   that arrive meanwhile **wait** for it ([`InFlight::Wait`], bounded by their
//!   `grpc-timeout` and [`max_wait`](IdempotencyLayer::max_wait); at most
//!   [`max_waiters`](IdempotencyLayer::max_waiters) per key, the rest get 409 / ABORTED) or get
//!   409 / ABORTED with `Retry-After` ([`InFlight::Reject`]). That answer carries the reason code
//!   [`IDEMPOTENCY_IN_FLIGHT`](reason_code::IDEMPOTENCY_IN_FLIGHT): nothing ran for it, and
//!   `retry-layer` retries it unchanged after the pushback. A waiter holds none of the inner
//!   service's capacity (a `ConcurrencyLimit` permit, a `Buffer` slot): a write takes the
//!   service that `poll_ready` readied, and lets it go when it waits. Later duplicates get the
//!   **replay**: status, headers, body and trailers byte for byte, plus
//!   `idempotent-replayed: true`.
//! - **When the record is stored:** when the handler's body ends, and before the response's
//!   final frame is handed to the server (the last data frame of a body that ends or reaches
//!   its Content-Length, the trailers frame, or, for an empty body, before the head goes out).
//!   hyper stops polling a body once it has written its Content-Length or its trailers, and
//!   never polls an empty one; so a client that has received the whole response and retries
//!   always finds the record, in every [`OnDisconnect`] mode. A body that is not whole at once
//!   is read by a task of its own at the handler's pace, not the client's: a slow or stalled
//!   client does not keep the key in flight.
//! - If the first client goes away, the handler moves to a detached task, runs to completion
//!   and its outcome is recorded ([`OnDisconnect::Complete`]; this needs a tokio runtime, which
//!   axum and tonic servers have), within [`max_detached`](IdempotencyLayer::max_detached) and
//!   [`max_claim_lifetime`](IdempotencyLayer::max_claim_lifetime). Once the handler has answered
//!   a head that is recorded, a client leaving mid-body never makes a retry run it again, in
//!   either mode. A handler that panics releases the key and answers 500 / INTERNAL.
//! - **A leader that fails** without a record (a 503, an error, a panic) answers at once and
//!   releases its key in the background; the duplicates that were waiting for it get the same
//!   failure (one execution for all of them, as in the single-flight pattern), and the key is
//!   free for the client's next retry, which its retry budget bounds.
//! - If the store fails, the layer **fails closed**: 503 / UNAVAILABLE with `Retry-After`, and
//!   nothing executes ([`fail_open`](IdempotencyLayer::fail_open) executes unprotected instead).
//!
//! # Where to put the layer
//!
//! - After (inside) the authentication layer that inserts [`Tenant`], so the tenant is known.
//! - On the outermost router, with `Router::layer` (or `route_layer`): there the route's
//!   template is known, and axum's `Router::nest` strips the prefix from the path a nested
//!   router sees, so a layer inside two nested routers would see `/v1/orders` and `/v2/orders`
//!   both as `/orders`. Around the router (`ServiceBuilder::new().layer(..).service(router)`)
//!   no route is matched yet: the concrete path names the operation, and one key on
//!   `/books/b1/deduct` and on `/books/b2/deduct` runs both.
//! - Inside a tokio runtime: a first request's handler whose client goes away is finished in a
//!   spawned task, and the leases of the claims a layer holds are renewed by one spawned task.
//!
//! ## One route, or some routes
//!
//! A layer on a method router covers that route alone (axum's `MatchedPath` is known there, so
//! the route's template names the operation); `route_layer` on a router covers the routes it
//! has so far, not the ones added after:
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::routing::{get, post};
//! use axum::Router;
//! use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource};
//!
//! let idempotency = IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("shop"));
//! let app: Router = Router::new()
//!     // Only this route's writes are deduplicated.
//!     .route("/orders", post(|| async { "created" }).layer(idempotency))
//!     .route("/health", get(|| async { "ok" }));
//! # let _ = app;
//! # }
//! ```
//!
//! ## CORS
//!
//! Put `CorsLayer` outside (after, in `Router::layer` order) the idempotency layer, so that a
//! preflight `OPTIONS` is answered before it, and let browsers send the key header and read
//! the headers the layer answers with (a replay's `idempotent-replayed`, a refusal's
//! `x-reason-code`, `retry-after`):
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::routing::post;
//! use axum::Router;
//! use http::HeaderName;
//! use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource};
//! use tower_http::cors::CorsLayer;
//!
//! let cors = CorsLayer::new()
//!     .allow_origin(http::HeaderValue::from_static("https://shop.example"))
//!     .allow_methods([http::Method::POST])
//!     .allow_headers([
//!         http::header::CONTENT_TYPE,
//!         HeaderName::from_static("x-idempotency-key"),
//!     ])
//!     .expose_headers([
//!         HeaderName::from_static("idempotent-replayed"),
//!         HeaderName::from_static("x-reason-code"),
//!         http::header::RETRY_AFTER,
//!     ]);
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("shop")))
//!     .layer(cors);
//! # let _ = app;
//! # }
//! ```
//!
//! # What the handler sees
//!
//! Every write the layer runs carries an [`IdempotentWrite`] in its request extensions (an axum
//! extractor with the `axum` feature): the validated key, the tenant, the operation, the
//! scope's stable key, the claim's fencing token, and whether an earlier run may have begun the
//! work. Use it rather than parsing the key header again.
//!
//! # Where the tenant comes from
//!
//! The tenant scopes every key, so it must come from a verified identity, set before this layer
//! runs. In order of preference:
//!
//! - **An auth layer in front of this one inserts [`Tenant`].** In axum, a middleware added
//!   *after* the idempotency layer wraps it (`.layer(IdempotencyLayer::new(store)).layer(auth)`:
//!   the last `.layer` runs first). An axum extractor (`FromRequestParts`) runs in the handler,
//!   which is too late for the layer: do the verification in a middleware and let the extractor
//!   read what it inserted. In tonic, interceptors (`InterceptedService`) run inside the
//!   server's router, after every `Server::builder().layer(..)`, also too late: put the auth
//!   step in a tower layer before this one,
//!   `Server::builder().layer(ServiceBuilder::new().layer(auth).layer(IdempotencyLayer::new(store)))`,
//!   where `auth` verifies the request's metadata (its headers) and inserts [`Tenant`] (the
//!   example crate `tonic-library` does this).
//! - **[`TenantSource::from_fn`]** when the auth step leaves its result in
//!   another form (a claims type in the extensions).
//! - **[`TenantSource::fixed`]** for a single-tenant service, and
//!   **[`TenantSource::header`]** only behind a proxy that
//!   sets the header itself.
//!
//! # How long the layer holds a request
//!
//! Every wait has a bound with a default, and reaching it is a clear, classified answer:
//!
//! | wait | bound (default) | then |
//! |---|---|---|
//! | a write's request body | [`request_body_timeout`](IdempotencyLayer::request_body_timeout) (30 s), or the request's `grpc-timeout` | 408 / DEADLINE_EXCEEDED; nothing claimed, nothing ran |
//! | a duplicate waiting for the request in flight | [`max_wait`](IdempotencyLayer::max_wait) (30 s), or its `grpc-timeout` | 409 / ABORTED with `IDEMPOTENCY_IN_FLIGHT`, which `retry-layer` retries after the pushback |
//! | a claim in flight | [`max_claim_lifetime`](IdempotencyLayer::max_claim_lifetime) (5 min), plus one [`lease`](IdempotencyLayer::lease) (30 s) | the lease is no longer renewed and lapses (counted in [`IdempotencyStats::lapsed`], logged); a response body still streaming is ended with an error (recorded without its body after a 2xx head) |
//! | recording a response | the handler's pace: its body is read to its end by the layer, whatever the client's | a stalled client holds no key |
//! | work for a client that went away | [`max_detached`](IdempotencyLayer::max_detached) (1024) at once, each ended at `max_claim_lifetime` | past it, the handler is cancelled and its claim released ([`IdempotencyStats::detached_refused`]) |
//! | a failure's release | answered first, released in the background (as many at once as `max_detached`) | a slow or unreachable store never holds an answer |
//! | a store operation | the store's own timeouts; a record or release is retried through an outage for at most one lease | 503 / UNAVAILABLE (fail closed) |
//!
//! The layer never holds a handler itself past these: a handler that hangs while its client
//! waits is the server's to bound (tower's `TimeoutLayer`, tonic's `timeout`), and after
//! `max_claim_lifetime` it no longer holds its key.
//!
//! # Failure modes
//!
//! What the layer cannot promise, what a user sees then, and what to do about it.
//!
//! - **A crash between the side effect and the record.** The handler's write committed, then the
//!   instance died (or lost the store for longer than the lease) before the record was stored:
//!   the claim's lease lapses and the client's retry executes again. When the side effect lives
//!   in the same PostgreSQL database as a `PostgresStore`, close the window: the handler writes
//!   the record in its own transaction with [`TxCompletion`] (feature `postgres`; see
//!   [Transactional completion](#transactional-completion-postgresql)), so the side effect and
//!   the record commit or roll back together. Otherwise keep the lease above the handler's worst
//!   latency, and make the side effect itself refuse a second run where it can (a unique
//!   constraint on the idempotency key in the same database).
//! - **A store partition longer than the lease.** The leader cannot renew its claim; after the
//!   lease another instance takes the key over and executes again, and the first leader's late
//!   record is refused by its fencing token (its client got a response that was never recorded;
//!   every later duplicate gets the second execution's). While the store is unreachable, new
//!   writes fail closed (503 / UNAVAILABLE, nothing runs), so only claims already in flight are
//!   exposed. Size the lease for the partitions you expect to ride out.
//! - **[`MemoryStore`] with several replicas.** Each replica has its own records: a retry that
//!   lands on another replica executes again. Use a shared store, or route each key to one
//!   replica.
//! - **Redis failover with asynchronous replication.** A claim or record written to the primary
//!   and not yet replicated is lost when a replica is promoted: a retry then executes again.
//!   Redis's `WAIT` narrows the window but does not close it; a PostgreSQL with synchronous
//!   replication does.
//! - **Evicted entries.** A Redis whose `maxmemory-policy` can evict our keys drops claims and
//!   records under memory pressure, and a dropped record means a second execution: run it with
//!   `noeviction`.
//! - **Clocks.** Leases and TTLs run on the store's clock (Redis and PostgreSQL expire by their
//!   own time) or on this process's monotonic clock ([`MemoryStore`]); no wall clock is compared
//!   across machines. A leader paused longer than its lease (a stop-the-world pause, a frozen
//!   VM) is treated as crashed: another instance may execute, and the paused leader's record is
//!   refused when it wakes.
//! - **Large responses.** A response over
//!   [`max_record_bytes`](IdempotencyLayer::max_record_bytes) is replayed without its body
//!   (`idempotent-body-omitted: true`; ALREADY_EXISTS over gRPC). Its client reads it at its
//!   own pace (the layer keeps no more than `max_record_bytes` of it waiting), so a client that
//!   stalls holds its key until `max_claim_lifetime`.
//! - **A response that breaks off** after a head whose outcome is recorded (a 2xx, then a body
//!   error, a client gone past `max_detached`, or `max_claim_lifetime`): its client sees the
//!   error, and the record is kept without the body, like a large response: the side effect
//!   happened, a retry gets "executed once". A gRPC response whose status was to come in its
//!   trailers has none: it is released, and a retry executes again.
//! - **A handler that runs longer than `max_claim_lifetime`.** Its lease lapses: a retry after
//!   that executes it a second time (the first one's late record is refused by its fencing
//!   token). Set the lifetime above your slowest write.
//! - **Waiters on other instances.** A leader's failure is handed to the duplicates waiting for
//!   it in the same process; with a shared store, a duplicate waiting on another instance sees
//!   the key released and runs it (at most one execution per instance, not per duplicate).
//! - **Streaming requests.** Client-streaming and bidirectional gRPC methods declared with
//!   [`Writes::streaming_grpc_methods`] pass through without
//!   deduplication: their handlers must make them idempotent.
//!
//! # What is recorded and what is not
//!
//! Each handler outcome is classified into a [`Code`](reason_code::Code), exactly as the client
//! side (`retry-layer`) classifies it: for gRPC the `grpc-status` of a trailers-only response or
//! of the trailers, for HTTP the status; a failure is then refined by a business reason code
//! header (`x-reason-code`, see [`ReasonCodes`](reason_code::ReasonCodes)), a success never is
//! (a 201 carrying `RATE_LIMITED` is recorded). The one
//! [`RetryTable`](reason_code::RetryTable) then decides:
//!
//! | outcome | recorded? | so a retry... |
//! |---|---|---|
//! | 2xx, 3xx (a 303 See Other after a POST is a completed create), gRPC OK | yes | gets the replay |
//! | 503, 429, 504, 409, 500 (UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ABORTED, INTERNAL, UNKNOWN), DATA_LOSS | no: the key is released | executes again |
//! | 400, 401, 403, 404, 412, 501 ... (permanent failures) | only if opted in with `.table(RetryTable::default().record_permanent_failures(true))` | executes again, or gets the recorded failure |
//! | handler error, panic | no: released (its waiters get its failure) | executes again |
//! | a body error after a recorded head (a 2xx) | yes, without its body | gets "executed once" (`idempotent-body-omitted: true`) |
//!
//! The client retries exactly what the server did not record. Responses larger than
//! [`max_record_bytes`](IdempotencyLayer::max_record_bytes) still reach their first client in
//! full, but are recorded as status, headers and trailers only; their replays say so with
//! `idempotent-body-omitted: true`; over gRPC, where a client cannot use a reply without its
//! message, such a replay answers ALREADY_EXISTS with a message that says the call was executed
//! once. A recorded permanent failure can be cleared with [`IdempotencyLayer::forget`].
//!
//! gRPC-Web responses carry their status in the headers of a trailers-only response or in a
//! trailers frame at the end of the body (base64-encoded in the `-text` variants); the layer
//! reads it there, so a gRPC-Web error is never recorded as a success.
//!
//! # Why wait for the first request
//!
//! A duplicate that arrives while the first request is still running is almost always the
//! client's own retry after a timeout. Answering it 409 makes the client retry again and again
//! until the first one finishes, and a client that gives up never learns the outcome. Waiting
//! (single-flight) gives it the first request's response as soon as it exists, with no extra
//! load on the handler. The wait is bounded; a waiter whose leader failed without a record (a
//! 503, a panic) gets that failure, and its client's retry (under its budget) runs the handler
//! again, so a failing dependency is hit once per retry, not once per duplicate; a waiter whose
//! leader's claim lapsed (a crashed instance) becomes the leader itself. [`InFlight::Reject`]
//! is there for servers that must not hold connections.
//!
//! # Choosing a store
//!
//! The [`IdempotencyStore`] trait is the one seam; the layer is the same whatever the store.
//!
//! - [`MemoryStore`] (the default): fast, embedded, no setup. Records live in this process
//!   only: they are lost on restart, and a second replica behind a load balancer has its own,
//!   so a retry that lands on the other replica executes again. Right for one instance, tests,
//!   and as a first layer in front of a shared store.
//! - A shared store for services with more than one instance, or deploys that restart them:
//!   claims and records are visible to every instance, a claim whose leader crashed is taken
//!   over when its lease lapses, and the fencing token refuses the crashed leader's late writes.
//!   - `RedisStore` (cargo feature `redis`): one round trip per claim, per completion and per
//!     replay (Lua scripts), expiry by Redis itself, waiters woken by pub/sub. Records survive
//!     as far as Redis persists them.
//!   - `PostgresStore` (cargo feature `postgres`): one statement per claim, per completion and
//!     per replay, waiters woken by LISTEN/NOTIFY, expired rows removed in batches. Records
//!     survive restarts and failovers of the database like any other row; a handler whose side
//!     effects live in the same database can commit its record with them
//!     ([transactional completion](#transactional-completion-postgresql)).
//!
//!   Their own docs list what each guarantees and its knobs (prefix or table, lease, TTL, pool
//!   size, timeouts). Either can keep recently replayed records in this instance's memory with a
//!   near cache (`near_cache(store::NearCache::new(bytes))` on its builder): a replay then
//!   costs no round trip, an entry never outlives its record's TTL, and a `forget` on any
//!   instance drops it on every instance.
//!
//! Every store runs the same [conformance suite][conformance] (cargo feature
//! `conformance`).
//!
//! # Transactional completion (PostgreSQL)
//!
//! The layer stores a record after its handler returns, so there is a moment when the handler's
//! side effect has committed and the record does not exist yet; an instance that dies then
//! leaves a claim that lapses, and the retry runs again. When the handler's side effects go to
//! the same PostgreSQL database as the `PostgresStore`, the handler can write the record itself,
//! in its own transaction: the layer hands it a [`TxCompletion`] (a request extension, on a
//! first request whose store is a `PostgresStore` or an [`AnyStore`](store::AnyStore) holding
//! one), and the handler calls `completion.complete_in(&tx, response)` before `tx.commit()`,
//! then returns the response it got back (on sqlx, cargo feature `sqlx`:
//! `completion.complete_in_sqlx(&mut tx, response)` with the `sqlx::Transaction` of a pool on
//! the same database). The record is written with the store's own fenced statement (a claim
//! taken over meanwhile is refused with [`TxCompletionError::Fenced`], and the handler rolls
//! back), and is byte for byte the one the layer would have stored. Then:
//!
//! - **committed**: the side effect and the record exist together; the layer writes nothing
//!   more. If the instance dies before the response leaves, the retry gets the replay;
//! - **rolled back**: neither exists; the layer releases the claim when the handler returns (or
//!   its lease lapses, if the instance died), and the retry runs once.
//!
//! [`TxCompletion`]'s docs have an example and the rules (call it last, return its response
//! after the commit, what happens to any other answer). The `axum-orders` example's PostgreSQL
//! mode uses it, with a test that kills the server between the commit and the response.
//!
//! # Chains of services
//!
//! Each handler the layer executes runs as the current [`InboundWrite`](reason_code::InboundWrite)
//! (a tokio task-local holding the request's scope). A `retry-layer` client inside the handler
//! with derived keys (`RetryPolicyBuilder::derive_idempotency_keys`) keys its outbound writes
//! from it, so a handler that runs again for the same request (a takeover after a crash, a
//! lapsed or released claim) sends its downstream writes with the same keys, and the services
//! below replay them: one execution per logical request along the whole chain.
//!
//! # Cost
//!
//! Measured by the workspace's `benchmarks` crate (`cargo bench -p benchmarks --bench
//! idempotency`; tables and commands in `BENCHMARKS.md` at the repository root), with a trivial
//! handler and `MemoryStore`, against the same handler without the layer and against a
//! hand-rolled `Mutex<HashMap<key, body>>` in front of it (which has no tenant scope, no
//! fingerprint, no single-flight, no streaming and no TTL). A first execution costs 2 to 3 µs
//! on the benchmark machines (the scope key's hash, the fingerprint's XXH3, the claim,
//! recording the body), a replay less than half of that, and a read passes through
//! untouched.
//!
//! # Observability
//!
//! **Counters** in [`IdempotencyStats`], read with [`IdempotencyLayer::stats`], always.
//!
//! **Tracing.** Each write the layer manages (a request with a key, or a rejected one) is a
//! `DEBUG` span `idempotency_layer.write` with OpenTelemetry's attributes
//! (`http.request.method` and `url.path`, or `rpc.system = "grpc"` and `rpc.method`) and how it
//! ended: `idempotency.outcome` = `executed`, `replayed`, `waited` (it waited for the request in
//! flight, then replayed its record), `shared_failure` (it waited, and got its leader's
//! unrecorded failure) or `rejected`, with `idempotency.reject_reason`
//! ([`RejectReason::as_str`]). Events: `DEBUG` for executions, replays, waits and rejections,
//! `WARN` for store failures and fail-open executions. With no subscriber enabling `DEBUG` the
//! span is `Span::none()` and none of its fields is evaluated.
//!
//! **Metrics** (feature `metrics`), through the [`metrics`](https://docs.rs/metrics) facade, to
//! whatever recorder the application installs (a Prometheus exporter, say):
//!
//! | name | type | labels | counts |
//! |---|---|---|---|
//! | `idempotency_layer_executions_total` | counter | | handler executions the layer led |
//! | `idempotency_layer_replays_total` | counter | | responses replayed from a record |
//! | `idempotency_layer_waits_total` | counter | | duplicates that waited for the request in flight |
//! | `idempotency_layer_records_total` | counter | | records stored |
//! | `idempotency_layer_releases_total` | counter | | claims released without a record |
//! | `idempotency_layer_failed_open_total` | counter | | writes executed unprotected (`fail_open`) |
//! | `idempotency_layer_shared_failures_total` | counter | | duplicates answered with their leader's unrecorded failure |
//! | `idempotency_layer_lapsed_total` | counter | | claims held past `max_claim_lifetime` (no longer renewed) |
//! | `idempotency_layer_detached_refused_total` | counter | | detached work not run: `max_detached` already running |
//! | `idempotency_layer_in_flight` | gauge | | claims held now (leaders running or recording) |
//! | `idempotency_layer_memory_store_nearly_full_total` | counter | | times a `MemoryStore` passed 80 % of its bounds |
//! | `idempotency_layer_memory_store_evicted_total` | counter | | records a full `MemoryStore` evicted (older than `min_retention`) |
//! | `idempotency_layer_store_cleanup_failures_total` | counter | `store` | background removals of expired rows that failed (logged at `warn`) |
//! | `idempotency_layer_store_cancels_skipped_total` | counter | `store` | abandoned PostgreSQL statements closed without a cancel request, because four cancels were already in flight (the session's `statement_timeout` ends them) |
//! | `idempotency_layer_rejections_total` | counter | `reason` | rejections, by [`RejectReason::as_str`] |
//! | `idempotency_layer_store_errors_total` | counter | `op`, `store` | failed store operations |
//! | `idempotency_layer_store_duration_seconds` | histogram | `op`, `store` | store latency, in seconds |
//!
//! `op` is `begin`, `wait`, `complete` or `release` (`store_duration_seconds` times `begin`,
//! `complete` and `release`: a `wait` lasts as long as the request in flight); `store` is `memory`,
//! `redis`, `postgres` (an [`AnyStore`](store::AnyStore) by the store it holds) or `custom`.
//! Every key is a `static` (label values are `&'static str`): counting allocates nothing; a
//! store operation reads the clock twice. Without the feature nothing is compiled in.
//!
//! # Cargo features
//!
#![doc = document_features::document_features!()]
// Links to items behind features: to the items themselves when they are built, else to docs.rs
// (built with every feature), so the docs of every feature set link somewhere.
#![doc = ""]
#![cfg_attr(
    feature = "postgres",
    doc = "[`TxCompletion`]: crate::TxCompletion\n[`TxCompletionError::Fenced`]: crate::TxCompletionError::Fenced"
)]
#![cfg_attr(
    not(feature = "postgres"),
    doc = "[`TxCompletion`]: https://docs.rs/idempotency-layer/latest/idempotency_layer/struct.TxCompletion.html\n[`TxCompletionError::Fenced`]: https://docs.rs/idempotency-layer/latest/idempotency_layer/enum.TxCompletionError.html#variant.Fenced"
)]
#![cfg_attr(feature = "conformance", doc = "[conformance]: crate::conformance")]
#![cfg_attr(
    not(feature = "conformance"),
    doc = "[conformance]: https://docs.rs/idempotency-layer/latest/idempotency_layer/conformance/index.html"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(rust_2018_idioms, warnings))))]

mod accepted;
mod body;
mod classify;
mod config;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod future;
mod head;
mod idempotent_write;
mod key;
mod layer;
mod observe;
mod protocol;
mod reject;
mod scope;
mod service;
mod shared;
mod stats;
pub mod store;
// Without a store that can complete in a transaction (feature `postgres`), the layer still
// judges every leader's response by the ledger, but nothing ever writes one.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
mod tx;
mod write;

pub use body::{IdempotencyBody, RequestBody};
pub use config::{InFlight, OnDisconnect, RecordedHeaders, TenantSource, Writes};
/// The [`deadpool_postgres`](https://docs.rs/deadpool-postgres) and
/// [`tokio_postgres`](https://docs.rs/tokio-postgres) crates the PostgreSQL store is built on
/// (feature `postgres`): a pool you share with the store (`PostgresStore::builder_from_pool`)
/// and the transaction `TxCompletion` takes must be of these versions, so take them from here.
#[cfg(feature = "postgres")]
pub use deadpool_postgres;
pub use future::ResponseFuture;
pub use idempotent_write::IdempotentWrite;
#[cfg(feature = "axum")]
pub use idempotent_write::MissingIdempotentWrite;
pub use key::{validate_key, KeyError};
pub use layer::{Drained, IdempotencyLayer};
/// The shared vocabulary ([`reason_code::RetryTable`], [`reason_code::ReasonCodes`],
/// [`reason_code::GrpcMethods`], [`reason_code::KeyHeaders`]), re-exported so a
/// server needs no third dependency kept in lockstep.
pub use reason_code;
pub use reason_code::{
    IDEMPOTENCY_KEY, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED, X_IDEMPOTENCY_KEY,
};
/// The [`redis`](https://docs.rs/redis) crate the Redis store is built on (feature `redis`):
/// a `redis::Client` or `ConnectionManager` you pass to `RedisStore` must be of this version,
/// so take it from here.
#[cfg(feature = "redis")]
pub use redis;
pub use reject::{RejectReason, Rejection};
pub use scope::{Scope, Tenant};
pub use service::Idempotency;
/// The [`sqlx`](https://docs.rs/sqlx) crate `TxCompletion::complete_in_sqlx` takes a
/// transaction of (feature `sqlx`).
#[cfg(feature = "sqlx")]
pub use sqlx;
pub use stats::IdempotencyStats;
pub use store::{IdempotencyStore, MemoryStore, StoreError};
#[cfg(feature = "postgres")]
pub use store::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "redis")]
pub use store::{RedisStore, RedisStoreBuilder};
#[cfg(feature = "postgres")]
#[doc(no_inline)]
pub use tokio_postgres;
#[cfg(feature = "postgres")]
pub use tx::{TxCompletion, TxCompletionError};

/// The crate's README, whose code blocks are compiled (and run, unless marked `no_run`) as
/// doctests: what a user copies from crates.io builds.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

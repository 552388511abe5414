//! Client-side retries that are safe for writes: a tower middleware for any HTTP or gRPC client.
//!
//! `RetryLayer` retries exactly what the shared [`reason_code::RetryTable`] says is retryable,
//! with async exponential backoff and jitter, a deadline budget, a retry budget shared by all
//! clones, server pushback, replayable request bodies of any [`http_body::Body`] type, and
//! idempotency keys so that retried writes execute once on servers running
//! `idempotency-layer`.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//!
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use bytes::Bytes;
//! use retry_layer::{RetryLayer, RetryPolicy};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // A backend that is unavailable twice, then answers.
//! let calls = Arc::new(AtomicU32::new(0));
//! let backend = {
//!     let calls = calls.clone();
//!     tower::service_fn(move |_req: Request<_>| {
//!         let n = calls.fetch_add(1, Ordering::SeqCst);
//!         async move {
//!             let status = if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!             Ok::<_, Infallible>(Response::builder().status(status).body(Full::new(Bytes::new())).unwrap())
//!         }
//!     })
//! };
//!
//! let layer = RetryLayer::new(RetryPolicy::builder().ensure_idempotency_key().build().unwrap());
//! let mut client = ServiceBuilder::new().layer(layer.clone()).service(backend);
//!
//! // A POST is not idempotent, but ensure_idempotency_key() gives it a key, so it is retried.
//! let req = Request::post("http://orders/orders").body(Full::new(Bytes::from("{}"))).unwrap();
//! let res = client.ready().await.unwrap().call(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::CREATED);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//! assert_eq!(layer.stats().retries, 2);
//! # }
//! ```
//!
//! # What is retried
//!
//! Every attempt's outcome is classified once, and the [`RetryTable`](reason_code::RetryTable)
//! decides. A response is classified by [`reason_code::classify_head`], the classifier
//! `idempotency-layer` calls too, plus the client's rules for 421/425 and transport errors. In
//! order:
//!
//! 1. a gRPC response with HTTP 200 whose headers carry no `grpc-status` has started streaming:
//!    it is committed (gRFC A6), final, and no reason-code header reopens it;
//! 2. a business reason code in `x-reason-code` (a [`ReasonCodes`](reason_code::ReasonCodes)
//!    table, so `IDEMPOTENCY_IN_FLIGHT` from `idempotency-layer` is retried after its pushback);
//! 3. gRPC: `grpc-status` in the headers (a trailers-only response; a malformed value is
//!    UNKNOWN, never OK), else the gRPC spec's mapping of a non-200 HTTP status
//!    ([`Code::from_grpc_http_status`](reason_code::Code::from_grpc_http_status): 429, 502,
//!    503 and 504 are UNAVAILABLE, 404 UNIMPLEMENTED, 400 INTERNAL ...);
//! 4. 421 Misdirected Request and 425 Too Early were not processed by the server (RFC 9110,
//!    RFC 8470): *unsent*;
//! 5. HTTP: the status; a transport error is *unsent* (connect refused, h2 `REFUSED_STREAM`,
//!    GOAWAY beyond the stream) or *ambiguous* (anything after the request may have left).
//!
//! By default:
//!
//! - a request that never left the client is retried, whatever its method (up to
//!   `max_unsent_retries` beyond `max_attempts`);
//! - 502/503/UNAVAILABLE, 504/DEADLINE_EXCEEDED, a connection lost after sending and an attempt
//!   timeout are retried only for **idempotent** requests: GET, HEAD, OPTIONS, TRACE, PUT,
//!   DELETE, gRPC methods declared with
//!   [`idempotent_grpc_methods`](RetryPolicyBuilder::idempotent_grpc_methods) (the same
//!   [`GrpcMethods`] the server layer takes), or any request that carries an
//!   idempotency key in one of the [`key_headers`](RetryPolicyBuilder::key_headers)
//!   (`x-idempotency-key` or `idempotency-key` by default);
//! - 429/RESOURCE_EXHAUSTED is retried for any request, after the server's pushback;
//! - 409/ABORTED is returned, unless a [`rebuild_on_conflict`](RetryPolicyBuilder::rebuild_on_conflict)
//!   hook rebuilds the request. The rebuilt request is judged afresh (method, gRPC method,
//!   key): a rebuilt write without a key keeps the key of the request it replaces, unless the
//!   hook set another;
//! - an answer marked `idempotent-replayed: true` (a replay of the server's record for the
//!   key) is returned, whatever its status: every retry with that key would get the same;
//! - everything else is returned as it is.
//!
//! Before each retry three checks must all pass: the outcome is retryable, an attempt is left,
//! and the deadline leaves at least the delay plus `min_attempt_time` (checked again once the
//! inner service is ready to take the retry). Then the retry budget must grant it.
//!
//! Your say, which can narrow the table and never widen it:
//! [`retry_if`](RetryPolicyBuilder::retry_if) may decline a retry (per path, per code, per
//! response header); [`NoRetry`] in a request's extensions sends that request once;
//! [`on_retry`](RetryPolicyBuilder::on_retry) is told of each retry before its wait. An attempt
//! that provably never left is sent again regardless, as gRPC's transparent retries are.
//!
//! # Keys across a chain: derived keys
//!
//! A `RetryLayer` that calls other services from inside a handler served by
//! `idempotency-layer` can give each outbound write a key derived from the inbound write it is
//! executing ([`RetryPolicyBuilder::derive_idempotency_keys`]): a keyed hash of the inbound
//! write's scope (tenant, method, key) and the call's place in the handler (its [`KeyLabel`], or
//! its target and how many calls to that target came before it). When the handler runs a second
//! time for the same inbound write (its instance crashed after the outbound call and another
//! took the claim over; its claim lapsed; a failure released it), it sends the same keys in the
//! same order, and the services below replay instead of executing again: the chain is
//! effectively-once, not only each hop. Fresh keys (`ensure_idempotency_key` alone) would make
//! every downstream write run once per run of the handler.
//!
//! It applies when the handler is deterministic in its outbound writes (the same calls in the
//! same order). Label a call with [`KeyLabel`] when it is not: raced calls, a target chosen at
//! random or by load, a call made only on a cache miss. The secret must be the same on every
//! instance of the service. Outbound calls made from a task of their own (`tokio::spawn`) see
//! the inbound write only if the task runs in a handle of it (`InboundWrite::current()` taken before
//! the spawn, then `.scope(task)`; see `reason_code::InboundWrite`).
//! Over HTTP and gRPC alike; `tests/tests/chain.rs` (workspace) runs both.
//!
//! # Why a deadline budget
//!
//! A retry that cannot finish before the caller gives up only adds load. The deadline is the
//! earliest of a [`Deadline`] request extension, `grpc-timeout` and the policy's
//! `total_timeout` (a source never extends a shorter one); a call whose deadline has already
//! passed sends nothing. Each gRPC attempt's `grpc-timeout` is rewritten to the time really
//! left, capped at `attempt_timeout`, so the server stops working when the client has stopped
//! waiting. Every wait of the layer ends at the deadline: an attempt, the backoff, the inner
//! service's readiness (a tonic `Channel` is a buffer whose `poll_ready` stays pending while it
//! cannot connect or is full) and the rebuild hook. Without a deadline, `response_head_timeout`
//! bounds them instead (see "Failure modes").
//!
//! # Readiness
//!
//! The layer keeps tower's contract: its `poll_ready` never turns a slow inner service into an
//! error, which tower reads as "discard this service" (a `Buffer` in front would fail every
//! later call, a `Balance` would drop the endpoint, a generated tonic client would answer
//! `UNKNOWN`). It is ready at once; a call whose inner service was not ready yet takes the very
//! service that was polled (with what it reserved or waits for) and waits for it in its response
//! future, bounded by the call's deadline (counted from the call, a per-request [`Deadline`] and
//! `grpc-timeout` included) or else by `response_head_timeout`. Only an error of the inner
//! service's own `poll_ready` passes through `poll_ready`.
//!
//! # Failure modes
//!
//! Every wait of the client has a bound with a default, and reaching it ends in a classified
//! answer, never in silence:
//!
//! | wait | bound | default | when it is reached |
//! |---|---|---|---|
//! | the whole call, retries included | the earliest of the [`Deadline`] extension, an inbound `grpc-timeout` and `total_timeout` | none: set one (the examples use 10 s) | [`DeadlineExceeded`] (counted in `deadline_stops`); no retry that cannot fit `min_attempt_time` (50 ms) is sent |
//! | one attempt's response head | `response_head_timeout`; not sent to the server | 60 s | [`ResponseHeadTimedOut`], ambiguous: retried only when idempotent or keyed |
//! | one attempt, sent to the server as the `grpc-timeout` cap | `attempt_timeout` | none | [`AttemptTimedOut`], ambiguous |
//! | the backoff between attempts | `max_delay` (x jitter) and the deadline | 1 s (+-20 %) | |
//! | a server pushback (`Retry-After`, `grpc-retry-pushback-ms`, `google.rpc.RetryInfo`) | `max_pushback` and the deadline | 30 s | the answer is returned as it is (`pushback_stops`) |
//! | the inner service's readiness, before any attempt (in the response future, never in `poll_ready`) | the deadline, else `response_head_timeout` | 60 s | [`DeadlineExceeded`] or [`ServiceNotReady`]; nothing of that attempt is sent |
//! | the rebuild hook | the deadline, else `response_head_timeout` | 60 s | [`DeadlineExceeded`], or the conflict returned |
//! | hedges ([`hedge::HedgeLayer`]) | `max_pushback`, the deadline, `response_head_timeout` per attempt | 30 s, none, 60 s | the last failure, or [`DeadlineExceeded`] |
//! | attempts per call | `max_attempts`, plus `max_unsent_retries` for requests never sent | 3 + 2 | the last answer (`exhausted`) |
//! | retries across calls | the retry budget, per layer or per authority | 10 % of requests + 10/s | the answer (`budget_refusals`) |
//! | memory kept for replay | `max_replay_bytes` per request, `max_replay_bytes_total` per layer | 64 KiB, 16 MiB | sent without replay; freed when the call has its answer |
//!
//! So `RetryPolicy::default()` ends every call: a server that never answers costs an
//! idempotent request three head timeouts and two backoffs (about three minutes), a write
//! without key one (a minute). Give real calls a deadline (`total_timeout`, or a
//! [`Deadline`] per request) far below that.
//!
//! Two waits are not the layer's to bound:
//!
//! - **The response body.** The layer's answer is the response head; a body that stops
//!   streaming is the caller's to bound (read it under a timeout). A gRPC response that has
//!   started streaming is committed (gRFC A6) and never retried. Through
//!   [`RetryLayer::tonic_channel`] a call with a deadline is bounded to its end: a response
//!   body (a unary call's message and trailers) still open at the deadline ends with
//!   DEADLINE_EXCEEDED.
//! - **A connection that died without a word.** A call on an HTTP/2 connection whose peer
//!   vanished (a NAT that dropped it, a host that lost power) waits for its head until
//!   `response_head_timeout`, and every call sent on that connection meanwhile too. Turn on
//!   HTTP/2 keep-alive, so that such a connection is found by a missed PING and closed (its
//!   calls then fail, and are retried, within seconds):
//!
//! ```
//! use std::time::Duration;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::{TokioExecutor, TokioTimer};
//!
//! let client = Client::builder(TokioExecutor::new())
//!     .timer(TokioTimer::new())
//!     .http2_keep_alive_interval(Some(Duration::from_secs(20)))
//!     .http2_keep_alive_timeout(Duration::from_secs(10))
//!     .build_http::<retry_layer::ReplayBody<http_body_util::Full<bytes::Bytes>>>();
//! // For tonic: Endpoint::http2_keep_alive_interval(..).keep_alive_timeout(..).
//! # let _ = client;
//! ```
//!
//! One more wait only a timeout ends: hyper's client can strand a request sent on a pooled
//! connection just as that connection's task ends (hyper 1.12 and hyper-util 0.1.21, about once
//! in 10⁵ to 10⁶ calls on connections that are cut often; RELIABILITY.md, "A request hyper's client strands"). The request is
//! never sent and never answered, keep-alive does not help, and `response_head_timeout` is what
//! ends it: after it, a keyed or idempotent call is retried as the budget allows. Lower it, or
//! give calls a deadline, if a minute is too long a stall.
//!
//! # Why a retry budget
//!
//! See [`budget`]: `max_attempts` bounds one request, the budget bounds a fleet.
//!
//! # Errors
//!
//! Every error the layer returns is a [`RetryError`] in the
//! [`BoxError`](reason_code::BoxError): the last attempt's error (or [`DeadlineExceeded`]) as
//! its source, the attempts sent, and the idempotency key the
//! layer generated. A caller that retries on its own should resend with that key: the server
//! then sees the same intent, not a new one.
//!
//! # Request bodies
//!
//! The inner service receives [`ReplayBody<B>`]. The first attempt streams the body while up to
//! `max_replay_bytes` (64 KiB) are kept, trailers included; a larger body is sent once and its
//! outcome returned. A body whose frames are at hand when the request is sent (a `Full<Bytes>`,
//! a tonic unary request's message) is taken whole at once, and every attempt sends those bytes. The copy is complete as soon as the last frame is produced (hyper stops
//! polling once `is_end_stream()` is true, a Content-Length is written, or the trailers are
//! sent), which is what the rebuild hook needs. A transport may keep reading an abandoned
//! attempt's body (h2 streams on, HTTP/1 keeps writing after an early answer): each new attempt
//! cuts the earlier readers off, so they can neither take the live attempt's wake-ups nor drop
//! what it replays.
//!
//! With a hyper-util client the body type is inferred. A tonic `Channel` takes
//! `tonic::body::Body`: with the `tonic` feature, [`RetryLayer::tonic_channel`] makes a
//! nameable `tonic::RetryChannel<Channel>`; without it, convert with `map_request`:
//!
//! ```
//! # fn channel() -> tonic::transport::Channel {
//! #     tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy()
//! # }
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use retry_layer::{GrpcMethods, ReplayBody, RetryLayer, RetryPolicy};
//! use tower::ServiceBuilder;
//!
//! let reads = GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"]).unwrap();
//! let policy = RetryPolicy::builder()
//!     .idempotent_grpc_methods(reads)
//!     .ensure_idempotency_key()
//!     .build()
//!     .unwrap();
//! let svc = ServiceBuilder::new()
//!     .layer(RetryLayer::new(policy))
//!     .map_request(|req: http::Request<ReplayBody<tonic::body::Body>>| {
//!         req.map(tonic::body::Body::new)
//!     })
//!     .service(channel());
//! // let client = LibraryClient::new(svc);
//! # let _ = svc;
//! # }
//! ```
//!
//! Idempotent reads can be hedged instead of retried ([`hedge::HedgeLayer`], gRFC A6
//! `hedgingPolicy`): a second attempt after a delay, the first good answer wins.
//!
//! A service that calls others while serving requests is a hop: [`hop::HopLayer`] on its server
//! keeps retries at one tier across any number of hops (see [`hop`]).
//!
//! A reqwest client is not a tower service: with the `reqwest` feature,
//! [`reqwest::RetryMiddleware`] runs the same machinery as a
//! [`reqwest-middleware`](https://docs.rs/reqwest-middleware) middleware (same policy, table,
//! budget and keys; it can share a layer's budget with `RetryMiddleware::from(&layer)`).
//!
//! # Differences from `tower::retry` and gRFC A6
//!
//! - `tower::retry` asks every user to write the policy, clone the request (so bodies must be
//!   `Clone`, which streaming bodies and tonic's are not) and bring a backoff; it has no
//!   `Retry-After`, no deadline and no body replay. Here the policy is data, the table is shared
//!   with the server, and any body type is replayed up to a limit, trailers included.
//! - gRFC A6 defines the committed rule, pushback, `grpc-previous-rpc-attempts` and throttling;
//!   tonic implements none of it. Here:
//!   - a service config loads as A6 describes it
//!     ([`from_grpc_service_config`](RetryPolicy::from_grpc_service_config)): `methodConfig[]`
//!     chosen per call by its gRPC path, `retryThrottling` as a token bucket; `maxAttempts`
//!     above 5 is 5, the delay is full-jittered, and after a server pushback the backoff
//!     restarts from `initialBackoff`, as grpc-java does;
//!   - throttling counts as A6 does: an OK response adds `tokenRatio`, a failure the policy
//!     would retry takes a token; other failures (and conflicts with no rebuild hook) leave the
//!     bucket alone;
//!   - unlike A6, a status in `retryableStatusCodes` is retried only for an idempotent request
//!     (a declared method or a keyed one): the layer does not know that a write is safe to
//!     repeat unless told;
//!   - a malformed `grpc-status` is UNKNOWN, and an HTTP error on a gRPC call maps as the gRPC
//!     spec says;
//!   - transparent retries of unsent requests are bounded by `max_unsent_retries`, the deadline
//!     and the budget.
//! - The same rules apply to plain HTTP, with `Retry-After` (seconds or an HTTP date; a
//!   malformed one is ignored), `x-previous-attempts`, and 421/425 retried for any method.
//! - Neither knows about idempotency keys: a POST is either never retried (safe, but the write is
//!   lost on a dropped connection) or retried blindly (the write runs twice). With
//!   [`ensure_idempotency_key`](RetryPolicyBuilder::ensure_idempotency_key) and
//!   `idempotency-layer` on the server, it is retried and runs once; and when the layer gives
//!   up, its [`RetryError`] tells the caller the key to resend with.
//!
//! # Observability
//!
//! **Counters**: [`RetryLayer::stats`], always.
//!
//! **Tracing.** Each call is a `DEBUG` span `retry_layer.call`, and each attempt a
//! `retry_layer.attempt` span inside it, with OpenTelemetry's attribute names:
//!
//! - HTTP: `http.request.method`, `url.full` (user info and query values written `REDACTED`:
//!   a URL's secrets never reach the logs), `server.address` on the call;
//!   `http.request.resend_count` (0 for the first attempt) on each attempt;
//!   `http.response.status_code` on both;
//! - gRPC: `rpc.system = "grpc"`, `rpc.service`, `rpc.method`, `server.address` on the call,
//!   `grpc.previous_rpc_attempts` on each attempt, and `rpc.grpc.status_code` on both when the
//!   answer is trailers-only (a streamed answer's status is in its trailers, which the layer
//!   does not wait for);
//! - ours: `retry.code` (the attempt's classified code, [`Code::as_str`](reason_code::Code::as_str)),
//!   `error.type` = `unsent` / `ambiguous` for a transport error, `retry.attempts` on the call.
//!
//! The inner service's future is polled inside its attempt's span, so the client's own spans
//! nest under it. With no subscriber enabling `DEBUG`, both spans are `Span::none()` and no
//! field is evaluated.
//!
//! Each retry, give-up and budget refusal is a `DEBUG` event with the attempt number and code.
//! A dead backend makes every call give up, so the layer also writes a `WARN` summary, at most
//! one per 10 s per layer, with how many calls gave up (`gave_up`) and how many retries the
//! budget refused (`budget_refusals`) since the last one.
//!
//! **Metrics** (feature `metrics`), through the [`metrics`](https://docs.rs/metrics) facade, to
//! whatever recorder the application installs:
//!
//! | name | type | labels | counts |
//! |---|---|---|---|
//! | `retry_layer_requests_total` | counter | | calls |
//! | `retry_layer_attempts_total` | counter | `code` | attempts, by the code they ended with |
//! | `retry_layer_retries_total` | counter | `code` | retries, by the code that caused them |
//! | `retry_layer_budget_refusals_total` | counter | `code` | retries the budget refused |
//! | `retry_layer_give_ups_total` | counter | `reason`, `code` | retryable outcomes returned, and calls the deadline ended (`deadline`, `DEADLINE_EXCEEDED`) |
//!
//! `code` is [`Code::as_str`](reason_code::Code::as_str) (`OK`, `UNAVAILABLE`, ...; a transport
//! error is `UNAVAILABLE`); `reason` is `exhausted`, `deadline`, `pushback`, `not_replayable`,
//! `inbound_retry` (see [`hop`]) or `declined` (the caller's
//! [`retry_if`](RetryPolicyBuilder::retry_if) or [`NoRetry`]). Every key is a `static`: counting is a few atomic increments, with no
//! allocation. Without the feature nothing is compiled in.
//!
//! # Cargo features
//!
#![doc = document_features::document_features!()]
// Links to items behind features: to the items themselves when they are built, else to docs.rs
// (built with every feature), so the docs of every feature set link somewhere.
#![doc = ""]
#![cfg_attr(
    feature = "tonic",
    doc = "[`RetryLayer::tonic_channel`]: crate::RetryLayer::tonic_channel"
)]
#![cfg_attr(
    not(feature = "tonic"),
    doc = "[`RetryLayer::tonic_channel`]: https://docs.rs/retry-layer/latest/retry_layer/struct.RetryLayer.html#method.tonic_channel"
)]
#![cfg_attr(
    feature = "reqwest",
    doc = "[`reqwest::RetryMiddleware`]: crate::reqwest::RetryMiddleware"
)]
#![cfg_attr(
    not(feature = "reqwest"),
    doc = "[`reqwest::RetryMiddleware`]: https://docs.rs/retry-layer/latest/retry_layer/reqwest/struct.RetryMiddleware.html"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(rust_2018_idioms, warnings))))]

#[macro_use]
mod macros;

pub mod backoff;
mod body;
pub mod budget;
mod classify;
mod deadline;
mod derived_key;
mod error;
pub mod hedge;
pub mod hop;
mod ready;
mod request;
#[cfg(feature = "reqwest")]
pub mod reqwest;
mod retry;
#[cfg(feature = "tonic")]
pub mod tonic;

pub use body::{BodyNotReplayable, ReplayBody};
pub use deadline::Deadline;
pub use derived_key::KeyLabel;
pub use error::{
    AttemptTimedOut, DeadlineExceeded, ResponseHeadTimedOut, RetryError, RetryErrorKind, RetryInfo,
    ServiceNotReady,
};
/// The shared vocabulary ([`reason_code::RetryTable`], [`reason_code::ReasonCodes`], ...),
/// re-exported so a client needs no third dependency kept in lockstep.
pub use reason_code;
pub use retry::policy::{
    Conflict, InboundRetry, InvalidPolicy, InvalidPolicyKind, NoRetry, Rebuild, RebuildFuture,
    RetryCandidate, RetryEvent, RetryPolicy, RetryPolicyBuilder,
};
#[cfg(feature = "service-config")]
pub use retry::policy::{GrpcRetryPolicy, GrpcRetryThrottling, StatusCodeName};
pub use retry::{ResponseFuture, Retry, RetryLayer, RetryStats};

/// The settings both layers take, re-exported so a client needs no direct `reason-code`
/// dependency: see [`RetryPolicyBuilder::idempotent_grpc_methods`] and
/// [`RetryPolicyBuilder::key_headers`].
pub use reason_code::{GrpcMethods, InvalidGrpcMethod, KeyHeaders, NoKeyHeader};

/// The crate's README, whose code blocks are compiled (and run, unless marked `no_run`) as
/// doctests: what a user copies from crates.io builds.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

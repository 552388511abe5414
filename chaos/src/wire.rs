//! The soak's wires and client policies.
//!
//! Three wires carry the same write, each through a fault proxy of its own:
//! - [`Wire::Http1`]: hyper over HTTP/1.1, a connection per attempt, so that every attempt can
//!   be dropped after its request, reset, or delayed;
//! - [`Wire::Http2`]: hyper over h2c, one multiplexed connection, faulted per response (a drop
//!   closes the connection and every call on it);
//! - [`Wire::Grpc`]: a tonic `Channel` (through [`RetryChannel`]) to a tonic server, faulted as
//!   HTTP/2.
//!
//! The server side of each instance serves HTTP/1.1 and h2c on one axum listener, and gRPC on a
//! tonic listener, both behind the same `IdempotencyLayer`.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioTimer;
use retry_layer::tonic::RetryChannel;
use retry_layer::{RetryInfo, RetryLayer, RetryPolicy};
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;
use tower::ServiceExt;

use crate::attempts::{AttemptLog, Attempts, SpanExec};
use crate::conn_trace::TracedConnector;
use crate::{error_kind, HttpClient, Ledger, Outcome, PATH};

/// How often the HTTP/2 and gRPC clients ping their connection, and how long a PING may go
/// unanswered before the connection is closed.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The gRPC write: `/chaos.Ops/Write`.
pub(crate) const GRPC_PATH: &str = "/chaos.Ops/Write";

/// Which wire a client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Wire {
    /// HTTP/1.1, a connection per attempt.
    Http1,
    /// HTTP/2 (h2c), one multiplexed connection.
    Http2,
    /// gRPC: a tonic `Channel` to a tonic server.
    Grpc,
}

impl Wire {
    /// Every wire.
    pub const ALL: [Wire; 3] = [Wire::Http1, Wire::Http2, Wire::Grpc];

    /// The short name the report uses.
    pub fn name(self) -> &'static str {
        match self {
            Wire::Http1 => "http1",
            Wire::Http2 => "http2",
            Wire::Grpc => "grpc",
        }
    }

    /// The method part of the idempotency scope of this wire's write.
    pub(crate) fn scope_method(self) -> String {
        match self {
            Wire::Http1 | Wire::Http2 => {
                idempotency_layer::Scope::http_operation(&http::Method::POST, PATH)
            }
            Wire::Grpc => idempotency_layer::Scope::grpc_operation(GRPC_PATH),
        }
    }
}

/// Which retry policy a client runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Policy {
    /// Tuned for the injected faults: 12 attempts, backoff up to 1 s, a 20 s deadline, a
    /// budget of 1 000 retries per 10 s at ratio 1.0.
    Tuned,
    /// `RetryPolicy::default()`, as a user who configures nothing runs it.
    Default,
}

impl Policy {
    /// Both policies.
    pub const ALL: [Policy; 2] = [Policy::Tuned, Policy::Default];

    /// The short name the report uses.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Tuned => "tuned",
            Policy::Default => "default",
        }
    }

    /// The policy itself.
    pub fn retry_policy(self) -> RetryPolicy {
        match self {
            Policy::Tuned => RetryPolicy::builder()
                .max_attempts(12)
                .base_delay(Duration::from_millis(10))
                .max_delay(Duration::from_secs(1))
                .total_timeout(Duration::from_secs(20))
                .budget(retry_layer::budget::RetryBudget::sliding_window(
                    Duration::from_secs(10),
                    1_000,
                    1.0,
                ))
                .build()
                .expect("a valid policy"),
            Policy::Default => RetryPolicy::default(),
        }
    }
}

/// One client group: a wire and a policy, with a layer of its own (its own budget and
/// counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Group {
    /// The wire.
    pub wire: Wire,
    /// The policy.
    pub policy: Policy,
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.wire.name(), self.policy.name())
    }
}

/// A retrying client of one wire.
#[derive(Clone)]
pub(crate) enum WireClient {
    /// HTTP/1.1 or HTTP/2, the proxy's base URL, and the log of the attempts in flight.
    Http(Box<HttpClient>, String, AttemptLog),
    /// gRPC over a retrying tonic `Channel`.
    Grpc(tonic::client::Grpc<RetryChannel<Channel>>),
}

impl WireClient {
    /// A client of `wire` through `layer` to the proxy at `proxy`.
    pub(crate) fn new(
        wire: Wire,
        layer: &RetryLayer,
        proxy: SocketAddr,
        log: AttemptLog,
        keep_alive: bool,
    ) -> Self {
        let base = format!("http://{proxy}");
        match wire {
            Wire::Http1 | Wire::Http2 => WireClient::Http(
                Box::new(http_client(wire, layer, log.clone(), keep_alive)),
                base,
                log,
            ),
            Wire::Grpc => {
                let mut endpoint = Endpoint::from_shared(base).expect("a valid URI");
                if keep_alive {
                    endpoint = endpoint
                        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
                        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT);
                }
                let channel = endpoint.connect_lazy();
                WireClient::Grpc(tonic::client::Grpc::new(layer.tonic_channel(channel)))
            }
        }
    }

    /// One logical operation: `key`, retried by the layer until it succeeds or gives up. Also
    /// the attempts it took (0 when the call ended in an error or a gRPC status).
    pub(crate) async fn operation(&self, key: &str) -> (Outcome, u32) {
        match self {
            WireClient::Http(client, base, log) => {
                let done = http_operation(client, base, key).await;
                log.finish(key);
                done
            }
            WireClient::Grpc(client) => grpc_operation(client.clone(), key).await,
        }
    }
}

async fn http_operation(client: &HttpClient, base: &str, key: &str) -> (Outcome, u32) {
    let req = Request::post(format!("{base}{PATH}"))
        .header("x-idempotency-key", key)
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(format!("op {key}"))))
        .expect("a request");
    let res = match client.clone().oneshot(req).await {
        Ok(res) => res,
        Err(e) => return (Outcome::Failed(error_kind(&*e)), 0),
    };
    let status = res.status();
    let attempts = RetryInfo::attempts_of(&res);
    let body = match res.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return (Outcome::Failed("body cut".into()), attempts),
    };
    let expected = format!("{key} ");
    if status == StatusCode::CREATED && body.starts_with(expected.as_bytes()) {
        (Outcome::Succeeded, attempts)
    } else {
        (
            Outcome::Failed(format!("HTTP {}", status.as_u16())),
            attempts,
        )
    }
}

/// A hyper client through `layer`: for HTTP/1.1 a connection per attempt (so that the fault
/// proxy can fault every attempt), for HTTP/2 one multiplexed h2c connection.
pub(crate) fn http_client(
    wire: Wire,
    layer: &RetryLayer,
    log: AttemptLog,
    keep_alive: bool,
) -> HttpClient {
    let mut builder = Client::builder(SpanExec);
    match wire {
        Wire::Http1 => builder.pool_max_idle_per_host(0),
        Wire::Http2 | Wire::Grpc => builder.http2_only(true),
    };
    // HTTP/2 keep-alive, as the retry layer's docs advise: a connection whose peer went away
    // without a word is found by a missed PING and closed.
    if keep_alive && wire != Wire::Http1 {
        builder
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(Some(KEEP_ALIVE_INTERVAL))
            .http2_keep_alive_timeout(KEEP_ALIVE_TIMEOUT);
    }
    let connector = TracedConnector::new(log.conns.clone());
    tower::Layer::layer(layer, Attempts::new(builder.build(connector), log))
}

/// The gRPC message of both directions: the key, and in the answer the executions so far.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Op {
    /// The operation's idempotency key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The ledger's count for the key after this execution (answers only).
    #[prost(uint64, tag = "2")]
    pub count: u64,
}

type OpCodec = ProstCodec<Op, Op>;

async fn grpc_operation(
    mut client: tonic::client::Grpc<RetryChannel<Channel>>,
    key: &str,
) -> (Outcome, u32) {
    if let Err(e) = client.ready().await {
        return (Outcome::Failed(error_kind(&*e)), 0);
    }
    let mut req = tonic::Request::new(Op {
        key: key.to_owned(),
        count: 0,
    });
    req.metadata_mut()
        .insert("x-idempotency-key", key.parse().expect("keys are ASCII"));
    match client
        .unary(
            req,
            PathAndQuery::from_static(GRPC_PATH),
            OpCodec::default(),
        )
        .await
    {
        Ok(res) => {
            let attempts = res
                .extensions()
                .get::<RetryInfo>()
                .map_or(1, |i| i.attempts);
            if res.get_ref().key == key && res.get_ref().count > 0 {
                (Outcome::Succeeded, attempts)
            } else {
                (Outcome::Failed("gRPC wrong answer".into()), attempts)
            }
        }
        // A status carries no `RetryInfo`: the attempts are in the layer's counters.
        Err(status) => (Outcome::Failed(grpc_cause(&status)), 0),
    }
}

/// A short name for a failed call's status: its code, and for transport failures (whose
/// messages are long) the start of the message.
fn grpc_cause(status: &tonic::Status) -> String {
    let message = status.message();
    let message = message.split(':').next().unwrap_or(message);
    let message: String = message.chars().take(40).collect();
    format!("gRPC {:?} {message}", status.code())
        .trim_end()
        .to_owned()
}

/// The tonic service: `/chaos.Ops/Write` adds one execution to the ledger and answers the key
/// and its count; a ledger error is `UNAVAILABLE` (the effect did not happen, so the layer
/// records nothing and the client retries).
#[derive(Clone)]
pub(crate) struct OpsServer {
    ledger: Ledger,
}

impl OpsServer {
    pub(crate) fn new(ledger: Ledger) -> Self {
        OpsServer { ledger }
    }
}

impl tonic::server::NamedService for OpsServer {
    const NAME: &'static str = "chaos.Ops";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<tonic::body::Body>> for OpsServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let ledger = self.ledger.clone();
        Box::pin(async move {
            if req.uri().path() != GRPC_PATH {
                return Ok(tonic::Status::unimplemented(req.uri().path().to_owned()).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(OpCodec::default());
            Ok(grpc.unary(Write(ledger), req).await)
        })
    }
}

struct Write(Ledger);

impl tonic::server::UnaryService<Op> for Write {
    type Response = Op;
    type Future = BoxFuture<Result<tonic::Response<Op>, tonic::Status>>;

    fn call(&mut self, req: tonic::Request<Op>) -> Self::Future {
        let ledger = self.0.clone();
        Box::pin(async move {
            let key = req
                .metadata()
                .get("x-idempotency-key")
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| tonic::Status::invalid_argument("no key"))?
                .to_owned();
            match ledger.add(&key).await {
                Ok(count) => Ok(tonic::Response::new(Op { key, count })),
                // The effect may have happened (a lost reply): INTERNAL, never retried.
                Err(e) => Err(tonic::Status::internal(format!("ledger: {e}"))),
            }
        })
    }
}

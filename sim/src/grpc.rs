//! The gRPC half: the same writes as a unary method `/sim.Writes/Put`, served by tonic's server
//! behind the `IdempotencyLayer`, called through `RetryLayer::tonic_channel` over tonic
//! `Channel`s, all on the simulated network.
//!
//! The method is served without generated code: a tower service that reads the request and
//! answers one length-prefixed message and `grpc-status` trailers (or a trailers-only status),
//! as a generated unary service does. A unary tonic handler finishes before anything is sent,
//! so its faults are the handler's (an error status, a panic, slowness, no end); a body that
//! breaks off between its message and its trailers is not a fault a unary handler can make.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use tonic::body::Body;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::server::NamedService;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;
use tower_service::Service;

use http::uri::PathAndQuery;
use retry_layer::tonic::RetryChannel;

use crate::app::{attempt_of, tenant_of, AppState, HANDLER_PANIC};
use crate::client::ReadyGate;
use crate::ledger::ScopeName;
use crate::ledger::{Ending, Ledger};
use crate::net::{SimConnector, SimStream, PORT};
use crate::schedule::Handler;
use crate::schedule::Schedule;
use crate::tag::ATTEMPT_HEADER;

/// The gRPC path of the write.
pub const PUT: &str = "/sim.Writes/Put";

/// The write method, as a tonic service.
#[derive(Clone)]
pub(crate) struct Writes(pub(crate) AppState);

impl NamedService for Writes {
    const NAME: &'static str = "sim.Writes";
}

type BoxFut = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl Service<Request<Body>> for Writes {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFut;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFut {
        let app = self.0.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let received = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            // One length-prefixed message: its payload.
            let received = received.get(5..).unwrap_or_default().to_vec();
            let key = parts
                .headers
                .get(idempotency_layer::X_IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let scope: ScopeName = (tenant_of(&parts.headers), key);
            let Some(mut started) = app.start(scope, attempt_of(&parts.headers), &received) else {
                // A probe: a fresh key, nothing planned for it.
                return Ok(Response::builder()
                    .header(http::header::CONTENT_TYPE, "application/grpc")
                    .body(Body::new(crate::app::grpc_message(b"probe")))
                    .expect("a valid response"));
            };
            // A unary handler cannot break its body off between the message and the trailers.
            if matches!(
                started.plan,
                Handler::PanicInBody { .. } | Handler::ErrorInBody { .. }
            ) {
                started.plan = Handler::Ok;
            }
            match started.plan {
                Handler::Error => return Ok(status_only(13)),
                Handler::Unavailable => return Ok(status_only(14)),
                Handler::PanicBeforeHead => panic!("{HANDLER_PANIC}"),
                Handler::NeverEnds => std::future::pending::<()>().await,
                Handler::Slow(d) => tokio::time::sleep(d).await,
                _ => {}
            }
            if !app.write_down(&started).await {
                return Ok(status_only(14));
            }
            let body = app.commit(&started, 200, true);
            Ok(Response::builder()
                .header(http::header::CONTENT_TYPE, "application/grpc")
                .header(crate::app::EXECUTION_HEADER, started.name())
                .body(Body::new(body))
                .expect("a valid response"))
        })
    }
}

/// A trailers-only answer with `code` (0: OK and no message).
fn status_only(code: u8) -> Response<Body> {
    Response::builder()
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header("grpc-status", HeaderValue::from(u16::from(code)))
        .body(Body::empty())
        .expect("a valid response")
}

impl Connected for SimStream {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

/// A server's gRPC software: tonic's server with the attempt tags and `layer` in front of the
/// method, on [`PORT`].
pub(crate) async fn serve(
    layer: idempotency_layer::IdempotencyLayer<crate::store_host::StoreLink>,
    app: AppState,
    panics: crate::app::PanicArm,
    mut drain: crate::net::DrainSignal,
) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(SimStream::accepted);
        Some((accepted, listener))
    });
    let hop = app.chains().then(retry_layer::hop::HopLayer::new);
    tonic::transport::Server::builder()
        .layer(crate::tag::TagLayer(app.ledger().clone()))
        .layer(tower::util::option_layer(hop))
        .layer(layer)
        .layer(crate::app::PanicLayer(panics))
        .add_service(Writes(app))
        .serve_with_incoming_shutdown(incoming, async move { drain.requested().await })
        .await?;
    Ok(())
}

/// The messages are raw bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// One tonic `Channel` per server; each call goes to the next (readied first), stamped with a
/// fresh attempt tag; not ready while the client's gate is closed.
pub(crate) struct Channels {
    channels: Arc<Vec<Channel>>,
    /// Each call's own clone of the channel it readies.
    picked: Option<(usize, Channel)>,
    next: Arc<AtomicU64>,
    tags: Arc<AtomicU64>,
    client: usize,
    gate: ReadyGate,
    ledger: Ledger,
}

impl Clone for Channels {
    fn clone(&self) -> Self {
        Channels {
            channels: self.channels.clone(),
            picked: None,
            next: self.next.clone(),
            tags: self.tags.clone(),
            client: self.client,
            gate: self.gate.clone(),
            ledger: self.ledger.clone(),
        }
    }
}

impl Channels {
    /// Lazily connecting channels to every server.
    pub(crate) fn new(
        servers: usize,
        client: usize,
        gate: ReadyGate,
        tags: Arc<AtomicU64>,
        ledger: Ledger,
    ) -> Channels {
        let channels = (0..servers)
            .map(|s| {
                Endpoint::from_shared(format!("http://server{s}:{PORT}"))
                    .expect("a valid endpoint")
                    .connect_with_connector_lazy(SimConnector)
            })
            .collect();
        Channels {
            channels: Arc::new(channels),
            picked: None,
            next: Arc::new(AtomicU64::new(client as u64)),
            tags,
            client,
            gate,
            ledger,
        }
    }
}

impl Service<Request<Body>> for Channels {
    type Response = Response<Body>;
    type Error = tonic::transport::Error;
    type Future = crate::client::Watched<<Channel as Service<Request<Body>>>::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.gate.closed(cx) {
            return Poll::Pending;
        }
        let (next, channels) = (&self.next, &self.channels);
        let (_, channel) = self.picked.get_or_insert_with(|| {
            let i = next.fetch_add(1, Ordering::Relaxed) as usize % channels.len();
            (i, channels[i].clone())
        });
        channel.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let (_, mut channel) = self.picked.take().expect("call after poll_ready");
        let tag = (self.client as u64) << 40 | self.tags.fetch_add(1, Ordering::Relaxed);
        req.headers_mut().insert(ATTEMPT_HEADER, tag.into());
        let call = crate::client::call_of(req.headers());
        if let Some(call) = call {
            self.ledger.attempt_of_call(tag, call);
        }
        crate::client::Watched::new(channel.call(req), call, self.ledger.clone())
    }
}

/// A gRPC client's whole stack: `RetryLayer::tonic_channel` over the channels.
pub(crate) type GrpcStack = RetryChannel<Channels>;

/// Client `client`'s gRPC stack.
pub(crate) fn stack(
    schedule: &Schedule,
    ledger: &Ledger,
    client: usize,
    gate: ReadyGate,
) -> GrpcStack {
    let tags = ledger.attempt_counter(client);
    let channels = Channels::new(
        schedule.settings.servers,
        client,
        gate,
        tags,
        ledger.clone(),
    );
    crate::client::retry_layer(schedule, ledger).tonic_channel(channels)
}

/// One unary call, as a generated client makes it: readiness, then the call (its message and
/// trailers read by tonic).
pub(crate) async fn call(
    svc: GrpcStack,
    key: Option<&str>,
    tenant: Option<&str>,
    body: Bytes,
    ledger: &Ledger,
    i: usize,
) -> Option<Ending> {
    // The layer's answer is its response head: noted when the layer's future resolves, before
    // tonic reads the message and trailers (an HTTP call's head is noted the same way; what
    // bounds the read after it is the body's matter, not the layer's answer).
    let svc = NoteHead {
        inner: svc,
        ledger: ledger.clone(),
        call: i,
    };
    let mut grpc = tonic::client::Grpc::new(svc);
    let mut req = tonic::Request::new(body);
    if let Some(key) = key {
        req.metadata_mut()
            .insert("x-idempotency-key", key.parse().expect("ascii"));
    }
    if let Some(tenant) = tenant {
        req.metadata_mut()
            .insert("x-tenant", tenant.parse().expect("ascii"));
    }
    req.metadata_mut().insert("x-sim-call", i.into());
    let answer = match grpc.ready().await {
        Ok(()) => {
            grpc.unary(req, PathAndQuery::from_static(PUT), RawCodec)
                .await
        }
        Err(e) => {
            ledger.call_head(i);
            Err(Status::from_error(e))
        }
    };
    Some(match answer {
        Ok(resp) => {
            let replayed = resp
                .metadata()
                .get("idempotent-replayed")
                .is_some_and(|v| v.as_bytes() == b"true");
            let execution = resp
                .metadata()
                .get(crate::app::EXECUTION_HEADER.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            Ending::Response {
                status: 200,
                replayed,
                body_omitted: false,
                reason: None,
                body: resp.into_inner().to_vec(),
                body_error: None,
                content_length: None,
                execution,
                content_type: None,
            }
        }
        Err(status) => Ending::Error(format!("grpc {:?}: {}", status.code(), status.message())),
    })
}

/// Notes when the layer answers call `call` (its response future resolves), as its head.
struct NoteHead<S> {
    inner: S,
    ledger: Ledger,
    call: usize,
}

impl<S: Service<R>, R> Service<R> for NoteHead<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = NoteHeadFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        NoteHeadFuture {
            inner: self.inner.call(req),
            ledger: Some(self.ledger.clone()),
            call: self.call,
        }
    }
}

pin_project_lite::pin_project! {
    /// See [`NoteHead`].
    struct NoteHeadFuture<F> {
        #[pin]
        inner: F,
        ledger: Option<Ledger>,
        call: usize,
    }
}

impl<F: Future> Future for NoteHeadFuture<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let out = std::task::ready!(this.inner.poll(cx));
        if let Some(ledger) = this.ledger.take() {
            ledger.call_head(*this.call);
        }
        Poll::Ready(out)
    }
}

/// The final probe of `server` over gRPC: a fresh write, straight to it (no retry).
pub(crate) async fn probe(server: usize, key: &str) -> Result<u16, String> {
    let channel = Endpoint::from_shared(format!("http://server{server}:{PORT}"))
        .expect("a valid endpoint")
        .connect_with_connector_lazy(SimConnector);
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut req = tonic::Request::new(Bytes::from_static(b"probe"));
    req.metadata_mut()
        .insert("x-idempotency-key", key.parse().expect("ascii"));
    req.metadata_mut()
        .insert("x-tenant", "probe".parse().expect("ascii"));
    grpc.ready().await.map_err(|e| e.to_string())?;
    match grpc
        .unary(req, PathAndQuery::from_static(PUT), RawCodec)
        .await
    {
        Ok(_) => Ok(200),
        Err(status) => Err(format!("grpc {:?}: {}", status.code(), status.message())),
    }
}

/// One quiescence write of `key` (with `body`) over gRPC, straight to `server` (no retry),
/// stamped with the attempt tag `tag`.
pub(crate) async fn probe_write(
    server: usize,
    key: &str,
    tenant: &str,
    body: Bytes,
    tag: u64,
) -> Ending {
    let channel = Endpoint::from_shared(format!("http://server{server}:{PORT}"))
        .expect("a valid endpoint")
        .connect_with_connector_lazy(SimConnector);
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut req = tonic::Request::new(body);
    req.metadata_mut()
        .insert("x-idempotency-key", key.parse().expect("ascii"));
    req.metadata_mut()
        .insert("x-tenant", tenant.parse().expect("ascii"));
    req.metadata_mut().insert("x-sim-attempt", tag.into());
    if let Err(e) = grpc.ready().await {
        return Ending::Error(e.to_string());
    }
    match grpc
        .unary(req, PathAndQuery::from_static(PUT), RawCodec)
        .await
    {
        Ok(resp) => {
            let replayed = resp
                .metadata()
                .get("idempotent-replayed")
                .is_some_and(|v| v.as_bytes() == b"true");
            let execution = resp
                .metadata()
                .get(crate::app::EXECUTION_HEADER.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            Ending::Response {
                status: 200,
                replayed,
                body_omitted: false,
                reason: None,
                body: resp.into_inner().to_vec(),
                body_error: None,
                content_length: None,
                execution,
                content_type: None,
            }
        }
        Err(status) => Ending::Error(format!("grpc {:?}: {}", status.code(), status.message())),
    }
}

//! The server instances: an axum handler with a side effect and the faults a schedule gives it,
//! behind the real `IdempotencyLayer`, served by hyper over the simulated network.
//!
//! The side effect of a write happens when its handler answers a success (it commits, then
//! answers): a handler cancelled or crashed before that did nothing, which is the model both
//! `OnDisconnect` modes rely on. The ledger counts these commits per scope.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Response, StatusCode};
use http_body::{Frame, SizeHint};
use idempotency_layer::IdempotencyLayer;
use retry_layer::hop::HopLayer;
use tokio::time::Sleep;
use tower::limit::ConcurrencyLimitLayer;
use tower::ServiceBuilder;

use crate::ledger::{now, Execution, Ledger, Memory, ScopeName};
use crate::net::DrainSignal;
use crate::schedule::{Handler, Intent, Schedule};
use crate::store_host::StoreLink;
use crate::tag::{TagLayer, ATTEMPT_HEADER};

/// The header that names the tenant (trusted in the simulation, as behind a proxy).
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-tenant");

/// The message of every panic the simulated handlers raise on purpose.
pub const HANDLER_PANIC: &str = "sim: the handler panics (a fault of the schedule)";

/// The header each execution's answer carries, naming it (`tenant/key#n`): a replay must carry
/// the one of the record its store holds, a fresh answer the one of the execution that made it.
pub const EXECUTION_HEADER: HeaderName = HeaderName::from_static("x-sim-execution");

/// The name of execution `n` of `scope`, as [`EXECUTION_HEADER`] carries it.
pub(crate) fn execution_name(scope: &ScopeName, n: u32) -> String {
    format!("{}/{}#{n}", scope.0, scope.1)
}

/// A one-shot panic of the service under a server's layer (user code), armed by the schedule:
/// the next `poll_ready` (1) or `call` (2) it is asked for panics.
#[derive(Clone, Debug, Default)]
pub struct PanicArm(Arc<std::sync::atomic::AtomicU8>);

impl PanicArm {
    /// Arms it: the next `call` (`in_call`) or `poll_ready` panics.
    pub fn arm(&self, in_call: bool) {
        self.0.store(
            if in_call { 2 } else { 1 },
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Disarms it (the fault healed before any call came).
    pub fn disarm(&self) {
        self.0.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the method `which` (1: `poll_ready`, 2: `call`) panics now (once).
    fn fires(&self, which: u8) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.0.compare_exchange(which, 0, SeqCst, SeqCst).is_ok()
    }
}

/// Puts a [`PanicArm`] in front of a service: user code under the layer whose `poll_ready` or
/// `call` panics.
#[derive(Clone, Debug)]
pub(crate) struct PanicLayer(pub(crate) PanicArm);

impl<S> tower_layer::Layer<S> for PanicLayer {
    type Service = Panicky<S>;
    fn layer(&self, inner: S) -> Panicky<S> {
        Panicky {
            inner,
            arm: self.0.clone(),
        }
    }
}

/// A service whose `poll_ready` or `call` panics once when its arm says so.
#[derive(Clone, Debug)]
pub(crate) struct Panicky<S> {
    inner: S,
    arm: PanicArm,
}

impl<S, R> tower_service::Service<R> for Panicky<S>
where
    S: tower_service::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if self.arm.fires(1) {
            panic!("{HANDLER_PANIC}");
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        if self.arm.fires(2) {
            panic!("{HANDLER_PANIC}");
        }
        self.inner.call(req)
    }
}

/// One boot of one server host: which server, which boot, its drain requests and its
/// service's armed panics.
#[derive(Debug)]
pub struct ServerHost {
    /// The server's index.
    pub server: usize,
    /// Its boot (a restart starts the next).
    pub boot: u32,
    /// Its drain requests (counted).
    pub drains: Arc<tokio::sync::watch::Sender<u64>>,
    /// The one-shot panics of the service under its layer.
    pub panics: PanicArm,
}

/// What every server instance shares: the plan, the ledger, the count of executions started.
#[derive(Clone, Debug)]
pub struct Shared {
    plan: Arc<BTreeMap<ScopeName, Intent>>,
    ledger: Ledger,
    started: Arc<Mutex<BTreeMap<ScopeName, u32>>>,
}

impl Shared {
    /// The shared state of `schedule`'s servers.
    pub fn new(schedule: &Schedule, ledger: Ledger) -> Shared {
        let plan = schedule
            .intents
            .iter()
            .map(|i| ((i.tenant.to_owned(), i.key.clone()), i.clone()))
            .collect();
        Shared {
            plan: Arc::new(plan),
            ledger,
            started: Arc::default(),
        }
    }
}

/// One server instance's handler state.
#[derive(Clone)]
pub(crate) struct AppState {
    shared: Shared,
    server: usize,
    boot: u32,
    /// The client of the downstream tier, when the handlers write to it.
    down: Option<crate::chain::DownClient>,
}

/// Server `server`'s software for its boot `boot`: the layer with the schedule's settings
/// over the handlers, served until the host crashes, or until a drain (`drains` counts them)
/// has ended: the layer's ([`IdempotencyLayer::drain`]: new writes refused, the claims held
/// let finish) and the connections' (a graceful shutdown).
pub async fn run_server(
    schedule: Arc<Schedule>,
    shared: Shared,
    store: StoreLink,
    host: ServerHost,
) -> turmoil::Result {
    let ServerHost {
        server,
        boot,
        drains,
        panics,
    } = host;
    let s = &schedule.settings;
    let mut layer = IdempotencyLayer::new(store)
        .tenant(idempotency_layer::TenantSource::header(TENANT_HEADER))
        .in_flight(s.in_flight)
        .on_disconnect(s.on_disconnect)
        .fail_open(s.fail_open);
    let own = s.per_server.get(server).copied().unwrap_or_default();
    if let Some(lease) = own.lease.or(s.lease) {
        layer = layer.lease(lease);
    }
    if let Some(max) = own.max_claim_lifetime {
        layer = layer.max_claim_lifetime(max);
    }
    if let Some(max) = own.max_detached {
        layer = layer.max_detached(max);
    }
    if let Some(max) = own.max_wait {
        layer = layer.max_wait(max);
    }
    if let Some(max) = own.max_waiters {
        layer = layer.max_waiters(max);
    }
    if let Some(ttl) = own.ttl {
        layer = layer.ttl(ttl);
    }
    if let Some(timeout) = own.request_body_timeout {
        layer = layer.request_body_timeout(timeout);
    }
    if let Some(max) = s.bounds.max_waiting_bytes {
        layer = layer.max_waiting_bytes(max);
    }
    if let Some(max) = s.bounds.max_response_buffer_bytes {
        layer = layer.max_response_buffer_bytes(max);
    }
    let stats = layer.clone();
    shared
        .ledger
        .stats_reader(server, Arc::new(move || stats.stats()));
    let gauge = layer.clone();
    shared.ledger.gauge(Arc::new(move || {
        let stats = gauge.stats();
        Memory {
            waiting_bytes: stats.waiting_bytes,
            response_buffer_bytes: stats.response_buffer_bytes,
            ..Memory::default()
        }
    }));
    let ledger = shared.ledger.clone();
    let draining = {
        let (layer, mut signal) = (layer.clone(), DrainSignal::new(&drains));
        async move {
            signal.requested().await;
            let drained = layer.drain(DRAIN_GRACE).await;
            ledger.event(format!("server{server}: layer drained: {drained:?}"));
        }
    };
    let app = AppState {
        shared,
        server,
        boot,
        down: s.chain.then(|| {
            use crate::chain::DownStack;
            crate::chain::down_client(match (s.hedging, s.hedging_alone) {
                (false, _) => DownStack::Retry,
                (true, false) => DownStack::RetryOverHedge(s.hedge_delay),
                (true, true) => DownStack::HedgeAlone(s.hedge_delay),
            })
        }),
    };
    let serving = async {
        if s.protocol == crate::schedule::Protocol::Grpc {
            return crate::grpc::serve(layer, app, panics, DrainSignal::new(&drains)).await;
        }
        let tags = TagLayer(app.ledger().clone());
        let router = Router::new()
            .route("/w/{key}", post(write))
            .route("/health", get(|| async { "ok" }))
            .with_state(app);
        let service = ServiceBuilder::new()
            .layer(tags)
            .option_layer(s.chain.then(HopLayer::new))
            .layer(layer)
            .layer(PanicLayer(panics))
            .option_layer(s.server_limit.map(ConcurrencyLimitLayer::new))
            .service(router);
        crate::net::serve(service, DrainSignal::new(&drains)).await
    };
    let (served, ()) = tokio::join!(serving, draining);
    served
}

/// How long a draining server's layer waits for its claims: past it, the restart (the fault's
/// heal) kills whatever is left, as an orchestrator does after its grace period.
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// One execution's start: what the handler does this time. `None` for a probe's key (nothing
/// planned: it just answers).
pub(crate) struct Started {
    scope: ScopeName,
    intent: Intent,
    n: u32,
    /// What this execution does.
    pub(crate) plan: Handler,
    attempt: Option<u64>,
    at: std::time::Duration,
    /// Its side effect happened.
    committed: std::sync::atomic::AtomicBool,
    ledger: Ledger,
}

impl Drop for Started {
    /// A run that ends without its side effect (it failed, panicked, or was cancelled) is noted:
    /// its layer then lets its claim go (a release, sent or refused for want of room).
    fn drop(&mut self) {
        if !self.committed.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(attempt) = self.attempt {
                self.ledger.lock().runs_ended_undone.insert(attempt, now());
            }
        }
    }
}

impl Started {
    /// Its name, as [`EXECUTION_HEADER`] carries it.
    pub(crate) fn name(&self) -> String {
        execution_name(&self.scope, self.n)
    }
}

impl AppState {
    /// The ledger the servers note what they see in.
    pub(crate) fn ledger(&self) -> &Ledger {
        &self.shared.ledger
    }

    /// Whether the handlers write to a downstream tier (the server then runs `HopLayer`, the
    /// server half of one-tier retries, in front of its layer).
    pub(crate) fn chains(&self) -> bool {
        self.down.is_some()
    }

    /// The handler's downstream write, if the handlers make one: `false` when it failed (the
    /// handler then answers a retryable failure, and its side effect does not happen).
    pub(crate) async fn write_down(&self, started: &Started) -> bool {
        match &self.down {
            Some(down) => {
                let written = crate::chain::write_down(down, &started.scope, started.attempt).await;
                // A downstream write that failed in a way it could have tried again tells the
                // hop how it ended (retried below, or do not retry), whichever layer made it:
                // the hop's answer says so upstream.
                let hop = retry_layer::hop::Hop::current();
                let retryable = written == Err(crate::chain::DownFailure::Retryable);
                if retryable && hop.is_some_and(|h| !h.deferred() && !h.gave_up()) {
                    self.shared
                        .ledger
                        .lock()
                        .hops_untold
                        .push((started.scope.clone(), started.attempt));
                }
                written.is_ok()
            }
            None => true,
        }
    }

    /// An execution of `scope` starts (the attempt that carries it: `attempt`), with the
    /// request body it received: one its intent's sends carried, or a violation is noted.
    pub(crate) fn start(
        &self,
        scope: ScopeName,
        attempt: Option<u64>,
        body: &[u8],
    ) -> Option<Started> {
        let intent = self.shared.plan.get(&scope).cloned()?;
        if !intent.sends.iter().any(|s| intent.body_of(s) == body) {
            self.shared.ledger.lock().wrong_bodies.push((
                scope.clone(),
                format!(
                    "the handler got {} bytes on server {}, not any body its sends carried",
                    body.len(),
                    self.server
                ),
            ));
        }
        let n = {
            let mut started = self.shared.started.lock().expect("started");
            let n = started.entry(scope.clone()).or_default();
            *n += 1;
            *n
        };
        // Once every fault has healed (the quiescence step), handlers do as planned no more.
        let plan = if self.shared.ledger.lock().healed {
            Handler::Ok
        } else {
            intent.plan(n)
        };
        self.shared.ledger.event(format!(
            "{}/{} execution {n} on server {} boot {} (attempt {attempt:?}): {plan:?}",
            scope.0, scope.1, self.server, self.boot
        ));
        Some(Started {
            scope,
            intent,
            n,
            plan,
            attempt,
            at: now(),
            committed: Default::default(),
            ledger: self.shared.ledger.clone(),
        })
    }

    /// The side effect of `started` commits, answering `status` with a body of its own; the
    /// body to answer with (`frame`: wrapped as one gRPC message, with `trailers` after it).
    pub(crate) fn commit(&self, started: &Started, status: u16, grpc: bool) -> SimBody {
        started
            .committed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let Started {
            scope, intent, n, ..
        } = started;
        let body = response_body(scope, *n, intent.response_len);
        let ledger = &self.shared.ledger;
        let index = {
            let mut o = ledger.lock();
            let execs = o.executions.entry(scope.clone()).or_default();
            execs.push(Execution {
                server: self.server,
                boot: self.boot,
                started: started.at,
                at: now(),
                attempt: started.attempt,
                status,
                body: body.to_vec(),
                broke_before_status: false,
                name: Some(execution_name(scope, *n)),
            });
            execs.len() - 1
        };
        ledger.event(format!("{}/{} execution {n} committed", scope.0, scope.1));
        let (data, trailers) = if grpc {
            let (data, trailers) = grpc_framed(&body);
            (data, Some(trailers))
        } else {
            (body, None)
        };
        SimBody {
            data,
            pos: 0,
            sized: intent.sized && !grpc,
            plan: started.plan,
            stall: None,
            stalled: false,
            trailers,
            ledger: ledger.clone(),
            name: format!("{}/{} execution {n}", scope.0, scope.1),
            hints: Default::default(),
            grpc_execution: grpc.then(|| (scope.clone(), index)),
        }
    }
}

/// A body of frames at hand.
pub(crate) type FramesBody = http_body_util::StreamBody<
    futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::convert::Infallible>>>,
>;

/// One gRPC message (`payload`) and OK trailers, as a body.
pub(crate) fn grpc_message(payload: &[u8]) -> FramesBody {
    let (data, trailers) = grpc_framed(payload);
    http_body_util::StreamBody::new(futures_util::stream::iter(vec![
        Ok(Frame::data(data)),
        Ok(Frame::trailers(trailers)),
    ]))
}

/// `payload` as one length-prefixed gRPC message, and the OK trailers that follow it.
fn grpc_framed(payload: &[u8]) -> (Bytes, HeaderMap) {
    let mut framed = Vec::with_capacity(payload.len() + 5);
    framed.push(0);
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload);
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    (Bytes::from(framed), trailers)
}

/// The attempt tag a request carries.
pub(crate) fn attempt_of(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(ATTEMPT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The tenant a request names.
pub(crate) fn tenant_of(headers: &HeaderMap) -> String {
    headers
        .get(&TENANT_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn write(
    State(app): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<axum::body::Body> {
    let scope: ScopeName = (tenant_of(&headers), key);
    let Some(started) = app.start(scope, attempt_of(&headers), &body) else {
        // A probe: a fresh key, nothing planned for it.
        return Response::new(axum::body::Body::from("probe"));
    };
    match started.plan {
        Handler::Error => return status(StatusCode::INTERNAL_SERVER_ERROR),
        Handler::Unavailable => return status(StatusCode::SERVICE_UNAVAILABLE),
        Handler::PanicBeforeHead => panic!("{HANDLER_PANIC}"),
        Handler::NeverEnds => std::future::pending::<()>().await,
        Handler::Slow(d) => tokio::time::sleep(d).await,
        _ => {}
    }
    if !app.write_down(&started).await {
        return status(StatusCode::SERVICE_UNAVAILABLE);
    }
    // The side effect commits here, then the handler answers.
    let body = app.commit(&started, 201, false);
    Response::builder()
        .status(StatusCode::CREATED)
        .header(http::header::CONTENT_TYPE, "text/plain")
        .header(EXECUTION_HEADER, started.name())
        .body(axum::body::Body::new(body))
        .expect("a valid response")
}

fn status(code: StatusCode) -> Response<axum::body::Body> {
    Response::builder()
        .status(code)
        .body(axum::body::Body::empty())
        .expect("a valid response")
}

/// The body of execution `n` of `scope`: different for every execution, so a replay of the
/// wrong one, or of a second one, shows.
fn response_body(scope: &ScopeName, n: u32, len: usize) -> Bytes {
    let unit = format!("{}/{}#{n};", scope.0, scope.1);
    Bytes::from(unit.bytes().cycle().take(len).collect::<Vec<u8>>())
}

/// A response body of 16-byte frames with the plan's fault at its byte, then its trailers.
pub(crate) struct SimBody {
    data: Bytes,
    pos: usize,
    sized: bool,
    plan: Handler,
    stall: Option<Pin<Box<Sleep>>>,
    stalled: bool,
    trailers: Option<HeaderMap>,
    ledger: Ledger,
    /// Its scope and execution, for the trace.
    name: String,
    /// `size_hint` calls so far (axum's router makes the first: see `size_hint`).
    hints: std::sync::atomic::AtomicU32,
    /// Its execution in the ledger (scope, index), told when a gRPC body breaks off before its
    /// trailers; `None` over HTTP, whose head decides the outcome.
    grpc_execution: Option<(ScopeName, usize)>,
}

impl SimBody {
    /// The body breaks off here (an error, a panic): a gRPC response then never gives its
    /// status, and the ledger is told.
    fn breaks(&self) {
        if let Some((scope, i)) = &self.grpc_execution {
            if let Some(e) = self
                .ledger
                .lock()
                .executions
                .get_mut(scope)
                .and_then(|v| v.get_mut(*i))
            {
                e.broke_before_status = true;
            }
        }
    }
}

impl Drop for SimBody {
    fn drop(&mut self) {
        // A gRPC body let go before its trailers (the layer stopped reading it: its client went
        // away with no room to finish it, its claim's lifetime ended): its status never went out.
        if self.trailers.is_some() {
            self.breaks();
        }
        let end = if self.pos >= self.data.len() {
            "at its end"
        } else {
            "before its end"
        };
        self.ledger.event(format!(
            "{}: body dropped {end} (byte {} of {})",
            self.name,
            self.pos,
            self.data.len()
        ));
    }
}

/// A response body's frame: 16 bytes, or [`BIG_FRAME`] for a body over 4 KiB (so that a body
/// over 64 KiB is not thousands of frames).
const FRAME: usize = 16;

/// The frame of a body over 4 KiB.
pub(crate) const BIG_FRAME: usize = 4096;

impl http_body::Body for SimBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(sleep) = &mut this.stall {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.stall = None;
            this.stalled = true;
        }
        let frame = if this.data.len() > BIG_FRAME {
            BIG_FRAME
        } else {
            FRAME
        };
        let mut end = (this.pos + frame).min(this.data.len());
        match this.plan {
            Handler::PanicInBody { at } | Handler::ErrorInBody { at }
                if this.pos >= at || this.pos + frame > at =>
            {
                if this.pos < at {
                    end = at;
                } else if matches!(this.plan, Handler::PanicInBody { .. }) {
                    this.breaks();
                    panic!("{HANDLER_PANIC}");
                } else {
                    this.breaks();
                    return Poll::Ready(Some(Err("sim: the response body fails".into())));
                }
            }
            Handler::StallInBody { at, stall } if !this.stalled && this.pos + frame > at => {
                if this.pos < at {
                    end = at;
                } else {
                    this.ledger.event(format!(
                        "{}: body stalls at byte {at} for {stall:?}",
                        this.name
                    ));
                    this.stall = Some(Box::pin(tokio::time::sleep(stall)));
                    return Pin::new(this).poll_frame(cx);
                }
            }
            _ => {}
        }
        if this.pos >= this.data.len() {
            return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        let end = end.max(this.pos + 1).min(this.data.len());
        let chunk = this.data.slice(this.pos..end);
        this.pos = end;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        if let Handler::PanicInIsEndStream { at } = self.plan {
            if self.pos >= at {
                self.breaks();
                panic!("{HANDLER_PANIC}");
            }
        }
        self.pos >= self.data.len()
            && self.trailers.is_none()
            && !matches!(
                self.plan,
                Handler::PanicInBody { at } | Handler::ErrorInBody { at } if at >= self.pos
            )
    }

    fn size_hint(&self) -> SizeHint {
        // axum's router (tonic's too) reads every response's size hint once, in the service's own
        // future (to set its content-length), before the layer has the response: a panic there
        // is the service's, before any head, which the layer settles as a handler that failed
        // (released, its failure shared; a retry runs it again, as for any handler that fails
        // after its side effect). The body whose `size_hint` panics panics from the call after,
        // when the layer reads it.
        let call = self
            .hints
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Handler::PanicInSizeHint { at } = self.plan {
            if self.pos >= at && call > 0 {
                self.breaks();
                panic!("{HANDLER_PANIC}");
            }
        }
        if self.sized {
            SizeHint::with_exact((self.data.len() - self.pos) as u64)
        } else {
            SizeHint::default()
        }
    }
}

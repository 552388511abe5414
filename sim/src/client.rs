//! The client hosts: the real `RetryLayer` over hyper-util's client on the simulated network,
//! with a router that sends each attempt to the next server instance (as a load balancer
//! does) and a readiness gate the schedule can close (a full Buffer); composed as users do,
//! with a `Buffer` in front, a `ConcurrencyLimit` under the layer, and one HTTP/1.1 connection
//! (`crate::connection`) when the schedule draws them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::{IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};
use reason_code::BoxError;
use retry_layer::budget::{Budget, RetryBudget, TpsBudget};
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use retry_layer::{RetryLayer, RetryPolicy};
use tower::buffer::Buffer;
use tower::limit::ConcurrencyLimitLayer;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};
use tower_layer::Layer;
use tower_service::Service;

use crate::app::TENANT_HEADER;
use crate::connection::{Held, OneConnection, CALL};
use crate::ledger::{now, BudgetOf, Ending, Ledger, Memory, SendId};
use crate::net::SimConnector;
use crate::schedule::{BodyFault, MalformedKind, Protocol, Schedule};
use crate::tag::ATTEMPT_HEADER;

/// The bound on reading a response body once its head arrived. The client layer does not
/// bound an HTTP body (long streams stay alive); the simulated handlers stall for at most a
/// few seconds, so a body that has not ended by then never will.
pub const BODY_BOUND: Duration = Duration::from_secs(60);

/// How long a client that reads slowly pauses between frames, at most, in all.
const SLOW_READ_FOR: Duration = Duration::from_secs(10);

/// A readiness gate: while closed, `poll_ready` stays pending, as a full tower Buffer does.
#[derive(Clone, Debug, Default)]
pub struct ReadyGate(Arc<GateState>);

#[derive(Debug, Default)]
struct GateState {
    closed: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl ReadyGate {
    /// Closes the gate: the service stops being ready.
    pub fn close(&self) {
        self.0.closed.store(true, Ordering::SeqCst);
    }

    /// Whether the gate is closed; if it is, `cx` is woken when it opens.
    pub fn closed(&self, cx: &mut Context<'_>) -> bool {
        if !self.0.closed.load(Ordering::SeqCst) {
            return false;
        }
        self.0.wakers.lock().expect("gate").push(cx.waker().clone());
        true
    }

    /// Opens the gate and wakes whoever waits on it.
    pub fn open(&self) {
        self.0.closed.store(false, Ordering::SeqCst);
        for w in self.0.wakers.lock().expect("gate").drain(..) {
            w.wake();
        }
    }
}

/// Routes each attempt to the next server (round robin) and stamps it with a fresh attempt tag;
/// not ready while its gate is closed.
#[derive(Clone, Debug)]
pub struct Route<S> {
    inner: S,
    servers: usize,
    next: Arc<AtomicU64>,
    tags: Arc<AtomicU64>,
    client: usize,
    gate: ReadyGate,
    ledger: Ledger,
}

impl Route<()> {
    /// This route in front of `inner`.
    fn over<S>(self, inner: S) -> Route<S> {
        Route {
            inner,
            servers: self.servers,
            next: self.next,
            tags: self.tags,
            client: self.client,
            gate: self.gate,
            ledger: self.ledger,
        }
    }
}

pin_project_lite::pin_project! {
    /// An attempt's response future, watched: an answer that says the key is in flight
    /// (`IDEMPOTENCY_IN_FLIGHT`) is noted for its call, a fact of the client's (the attempts it
    /// sends after it know).
    pub struct Watched<F> {
        #[pin]
        inner: F,
        call: Option<usize>,
        ledger: Ledger,
    }
}

impl<F> Watched<F> {
    /// `inner`, the attempt of `call`.
    pub(crate) fn new(inner: F, call: Option<usize>, ledger: Ledger) -> Self {
        Watched {
            inner,
            call,
            ledger,
        }
    }
}

impl<F, B, E> std::future::Future for Watched<F>
where
    F: std::future::Future<Output = Result<http::Response<B>, E>>,
{
    type Output = F::Output;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = std::task::ready!(this.inner.poll(cx));
        if let (Ok(res), Some(call)) = (&out, this.call) {
            let told = res
                .headers()
                .get("x-reason-code")
                .is_some_and(|v| v.as_bytes() == reason_code::IDEMPOTENCY_IN_FLIGHT.as_bytes());
            if told {
                this.ledger.call_told_in_flight(*call);
            }
        }
        Poll::Ready(out)
    }
}

impl<S, B, R> Service<Request<B>> for Route<S>
where
    S: Service<Request<crate::held::InTransport<B>>, Response = http::Response<R>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Watched<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if self.gate.0.closed.load(Ordering::SeqCst) {
            self.gate
                .0
                .wakers
                .lock()
                .expect("gate")
                .push(cx.waker().clone());
            return Poll::Pending;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let server = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.servers;
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| "/".to_owned());
        *req.uri_mut() = format!("http://server{server}:{}{path}", crate::net::PORT)
            .parse::<Uri>()
            .expect("a valid URI");
        let tag = (self.client as u64) << 40 | self.tags.fetch_add(1, Ordering::Relaxed);
        req.headers_mut().insert(ATTEMPT_HEADER, tag.into());
        let call = call_of(req.headers());
        if let Some(call) = call {
            self.ledger.attempt_of_call(tag, call);
        }
        if let Some(handoff) = handoff_of(req.headers()) {
            self.ledger.attempt_of_handoff(handoff);
        }
        // Its body, noted as the transport's while the transport holds it.
        let req = req.map(|body| self.ledger.held.in_transport(call, body));
        Watched::new(self.inner.call(req), call, self.ledger.clone())
    }
}

/// The header [`Handoffs`] stamps on each request the retry layer hands on (hedges copy it).
pub const HANDOFF_HEADER: http::HeaderName = http::HeaderName::from_static("x-sim-handoff");

fn handoff_of(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(HANDOFF_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Between the retry layer and what it calls (a hedge, or the client under it): notes each
/// request handed on, by call, and stamps it with a serial number that the router reads on
/// each attempt that reaches the wire (a hedge's attempts carry its request's).
#[derive(Clone, Debug)]
pub struct Handoffs<S> {
    inner: S,
    ledger: Ledger,
}

impl<S> Handoffs<S> {
    fn new(inner: S, ledger: &Ledger) -> Self {
        Handoffs {
            inner,
            ledger: ledger.clone(),
        }
    }
}

impl<S, B> Service<Request<B>> for Handoffs<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let serial = self.ledger.handoff(call_of(req.headers()));
        req.headers_mut().insert(HANDOFF_HEADER, serial.into());
        self.inner.call(req)
    }
}

/// The header that carries the index of the call an attempt belongs to.
pub const CALL_HEADER: http::HeaderName = http::HeaderName::from_static("x-sim-call");

/// The call a request belongs to.
pub(crate) fn call_of(headers: &http::HeaderMap) -> Option<usize> {
    headers
        .get(CALL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The client's whole stack, as a user builds it: `RetryLayer` (and, when the schedule hedges,
/// `HedgeLayer` under it) over the router and hyper-util's client.
pub type ClientStack = BoxCloneService<Request<SendBody>, Response<Held<Incoming>>, BoxError>;

/// A request body as a client streams it: its bytes, with the schedule's fault midway (a stall,
/// or a source that fails), under a `content-length` that announces all of it.
#[derive(Debug)]
pub struct SendBody {
    data: Bytes,
    fault: Option<BodyFault>,
    /// Bytes sent so far.
    sent: usize,
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
    /// Where each frame's bytes are counted while alive, and as whose (client, call).
    counted: Option<(crate::held::Holdings, usize, usize)>,
}

impl SendBody {
    /// `data`, sent as the schedule says (`fault`: midway, if any).
    pub fn new(data: Bytes, fault: Option<BodyFault>) -> SendBody {
        SendBody {
            done: data.is_empty() && fault.is_none(),
            data,
            fault,
            sent: 0,
            stall: None,
            counted: None,
        }
    }

    /// Each frame this body yields counted in `held` as call `call` of client `client`'s
    /// while it is alive.
    pub fn counted_in(mut self, held: &crate::held::Holdings, client: usize, call: usize) -> Self {
        self.counted = Some((held.clone(), client, call));
        self
    }

    fn frame_of(&self, data: Bytes) -> http_body::Frame<Bytes> {
        http_body::Frame::data(match &self.counted {
            Some((held, client, call)) => held.counted(*client, *call, data),
            None => data,
        })
    }
}

impl http_body::Body for SendBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        let len = this.data.len();
        let at = match this.fault {
            Some(BodyFault::Stall { at, .. } | BodyFault::Fail { at }) => at.min(len),
            None => len,
        };
        if this.sent < at {
            this.sent = at;
            return Poll::Ready(Some(Ok(this.frame_of(this.data.slice(..at)))));
        }
        match this.fault {
            Some(BodyFault::Fail { .. }) => {
                this.done = true;
                Poll::Ready(Some(Err(
                    "sim: the request body's source failed midway".into()
                )))
            }
            Some(BodyFault::Stall { stall, .. }) => {
                let sleep = this
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                std::task::ready!(sleep.as_mut().poll(cx));
                this.done = true;
                if this.sent < len {
                    this.sent = len;
                    Poll::Ready(Some(Ok(this.frame_of(this.data.slice(at..)))))
                } else {
                    Poll::Ready(None)
                }
            }
            None => {
                this.done = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.data.len() as u64)
    }
}

/// The policy of `schedule`: the defaults, with its deadline, its replay memory and a
/// deterministic jitter.
pub fn policy(schedule: &Schedule, ledger: &Ledger) -> RetryPolicy {
    let mut b = RetryPolicy::builder()
        .jitter_seed(schedule.seed)
        .budget(counted_budget(ledger, BudgetOf::Retry));
    if let Some(d) = schedule.settings.deadline {
        b = b.total_timeout(d);
    }
    if let Some(max) = schedule.settings.bounds.max_replay_bytes_total {
        b = b.max_replay_bytes_total(max);
    }
    b.build().expect("a valid policy")
}

/// The default retry budget (`TpsBudget`: 10 % of requests over 10 s, plus 10 retries a
/// second), its tokens counted by the ledger: each one granted, each one given back.
fn counted_budget(ledger: &Ledger, layer: BudgetOf) -> RetryBudget {
    let inner = TpsBudget::new(Duration::from_secs(10), 10, 0.1).expect("the default budget");
    RetryBudget::custom(Arc::new(CountedBudget {
        inner,
        layer,
        ledger: ledger.clone(),
    }))
}

/// A budget whose tokens the ledger counts, by the layer it pays for.
#[derive(Debug)]
struct CountedBudget {
    inner: TpsBudget,
    layer: BudgetOf,
    ledger: Ledger,
}

impl Budget for CountedBudget {
    fn deposit(&self) {
        self.inner.deposit();
    }

    fn record(&self, failed: bool) {
        self.inner.record(failed);
    }

    fn withdraw(&self) -> bool {
        let granted = self.inner.withdraw();
        if granted {
            self.ledger.budget_token(self.layer, 1);
        }
        granted
    }

    fn refund(&self) {
        self.inner.refund();
        self.ledger.budget_token(self.layer, -1);
    }
}

/// The retry layer of `schedule`, its replay memory read by the ledger after every step.
pub fn retry_layer(schedule: &Schedule, ledger: &Ledger) -> RetryLayer {
    let retry = RetryLayer::new(policy(schedule, ledger));
    let gauge = retry.clone();
    ledger.gauge(Arc::new(move || Memory {
        replay_bytes: gauge.stats().replay_bytes,
        ..Memory::default()
    }));
    retry
}

/// The hedging policy of `schedule`: a second attempt of a keyed write after its delay.
pub fn hedge_policy(schedule: &Schedule, ledger: &Ledger) -> HedgePolicy {
    HedgePolicy::builder()
        .budget(counted_budget(ledger, BudgetOf::Hedge))
        .max_attempts(2)
        .hedging_delay(schedule.settings.hedge_delay)
        .hedge_writes()
        .build()
        .expect("a valid hedging policy")
}

/// Client `client`'s stack.
pub fn stack(schedule: &Schedule, ledger: &Ledger, client: usize, gate: ReadyGate) -> ClientStack {
    let tags = ledger.attempt_counter(client);
    let route = |schedule: &Schedule, client: usize, gate: ReadyGate| Route {
        inner: (),
        servers: schedule.settings.servers,
        next: Arc::new(AtomicU64::new(client as u64)),
        tags: tags.clone(),
        client,
        gate,
        ledger: ledger.clone(),
    };
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(schedule.settings.protocol == Protocol::Http2);
    if schedule.settings.bounds.max_response_buffer_bytes.is_some() {
        // The protocol's own initial window, fixed: a client that reads slowly then holds the
        // server's sending back after 64 KiB, as many HTTP/2 clients do (hyper's default lets
        // 2 MiB through unread).
        builder.http2_initial_stream_window_size(65_535);
        builder.http2_adaptive_window(false);
    }
    let retry = retry_layer(schedule, ledger);
    // Under the layer, a `ConcurrencyLimit` when the schedule draws one: its calls (and hedges)
    // wait for its permits.
    // (A macro: each stack's hyper client takes its own request body type.)
    macro_rules! below {
        () => {
            ServiceBuilder::new()
                .option_layer(
                    schedule
                        .settings
                        .client_limit
                        .map(ConcurrencyLimitLayer::new),
                )
                .service(OneConnection::new(
                    route(schedule, client, gate).over(builder.build(SimConnector)),
                    schedule.settings.client_one_connection,
                    ledger.clone(),
                ))
        };
    }
    // What the client's layers count of the request bytes they keep, read after every step.
    let counted = retry.clone();
    let hedge = HedgeLayer::new(hedge_policy(schedule, ledger));
    let hedge_counted = hedge.clone();
    if !(schedule.settings.hedging && schedule.settings.hedging_alone) {
        ledger.held.counter(
            client,
            "retry",
            Arc::new(move || counted.stats().replay_bytes),
        );
    }
    if schedule.settings.hedging {
        ledger.held.counter(
            client,
            "hedge",
            Arc::new(move || hedge_counted.stats().replay_bytes),
        );
    }
    let stack: ClientStack = if schedule.settings.hedging && schedule.settings.hedging_alone {
        // Hedging alone, with no retry layer above it: it answers on its own bounds.
        BoxCloneService::new(Handoffs::new(hedge.layer(below!()), ledger))
    } else if schedule.settings.hedging {
        let hedged = hedge.layer(below!());
        BoxCloneService::new(retry.layer(Handoffs::new(hedged, ledger)))
    } else {
        BoxCloneService::new(retry.layer(Handoffs::new(below!(), ledger)))
    };
    // In front, a `Buffer` shared by every call of the client when the schedule draws one: if
    // the layer ever answered a slow service with a readiness error, tower's contract would
    // let the buffer discard the stack, and every later call would fail.
    match schedule.settings.client_buffer {
        Some(bound) => BoxCloneService::new(Buffer::new(stack, bound)),
        None => stack,
    }
}

/// Client `client`'s software for its boot `boot`: sends its share of the intents at their
/// times, each call watched for its bound, and records how each ended. A restarted client
/// (`boot` > 0) sends again, at once and with the same key, every send that had not ended when
/// it crashed, and the rest at their times. Sets `finished` when every send has ended.
pub async fn run_client(
    schedule: Arc<Schedule>,
    ledger: Ledger,
    client: usize,
    gate: ReadyGate,
    watchdog: Duration,
    finished: Arc<AtomicBool>,
) -> turmoil::Result {
    let caller = if schedule.settings.protocol == Protocol::Grpc {
        Caller::Grpc(crate::grpc::stack(&schedule, &ledger, client, gate))
    } else {
        let stack = stack(&schedule, &ledger, client, gate);
        // As a generated client kept in a struct: one service, `ready()` then `call` under
        // `&mut`, its caller free to give up in the middle.
        let shared = schedule
            .settings
            .client_reuses_service
            .then(|| Arc::new(tokio::sync::Mutex::new(stack.clone())));
        Caller::Http(HttpCaller {
            client,
            stack,
            shared,
            deadline: schedule.settings.call_deadline,
            ready_timeout: schedule.settings.client_ready_timeout,
        })
    };
    let mut tasks = Vec::new();
    for (n, intent) in schedule.intents.iter().enumerate() {
        for (k, send) in intent.sends.iter().enumerate() {
            let id = SendId::Write { intent: n, send: k };
            if send.client != client || ledger.send_ended(client, id) {
                continue;
            }
            let caller = caller.clone();
            let ledger = ledger.clone();
            let intent = intent.clone();
            let send = *send;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(send.at.saturating_sub(now())).await;
                let scope = (intent.tenant.to_owned(), intent.key.clone());
                let sent = intent.body_of(&send);
                let i = ledger.call_started(client, scope, &sent);
                let body = Bytes::from(sent);
                let call = caller.send(
                    Some(&intent.key),
                    Some(intent.tenant),
                    (body, send.body_fault),
                    send.slow_read,
                    &ledger,
                    i,
                );
                let ending = match send.cancel_after {
                    Some(after) => match tokio::time::timeout(after, call).await {
                        Ok(ending) => ending,
                        Err(_) => Some(Ending::Cancelled),
                    },
                    None => tokio::time::timeout(watchdog, call)
                        .await
                        .unwrap_or_default(),
                };
                if let Some(ending) = ending {
                    ledger.call_ended(i, ending);
                }
                ledger.end_send(client, id);
            }));
        }
    }
    for (n, m) in schedule.malformed.iter().enumerate() {
        let id = SendId::Malformed(n);
        if m.client != client || ledger.send_ended(client, id) {
            continue;
        }
        let (caller, ledger, m) = (caller.clone(), ledger.clone(), *m);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(m.at.saturating_sub(now())).await;
            let scope = ("-".to_owned(), format!("{:?}", m.kind));
            let i = ledger.call_started(client, scope, &[]);
            let (key, tenant) = match m.kind {
                MalformedKind::NoKey => (None, Some("acme")),
                MalformedKind::BadKey => (Some("no"), Some("acme")),
                MalformedKind::NoTenant => (Some("malformed-no-tenant"), None),
            };
            let call = caller.send(key, tenant, (Bytes::new(), None), None, &ledger, i);
            if let Ok(Some(ending)) = tokio::time::timeout(watchdog, call).await {
                ledger.call_ended(i, ending);
            }
            ledger.end_send(client, id);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    finished.store(true, Ordering::SeqCst);
    Ok(())
}

/// A client's stack for its protocol.
#[derive(Clone)]
enum Caller {
    Http(HttpCaller),
    Grpc(crate::grpc::GrpcStack),
}

/// An HTTP client's stack, and how its calls use it.
#[derive(Clone)]
struct HttpCaller {
    client: usize,
    stack: ClientStack,
    /// One service for all the client's calls, when the schedule draws it: each call takes it,
    /// waits for `ready()`, calls, and gives it back (a call cancelled meanwhile abandons its
    /// `ready()` on it). Else each call has a clone of its own (`oneshot`).
    shared: Option<Arc<tokio::sync::Mutex<ClientStack>>>,
    /// A per-request [`retry_layer::Deadline`] on every call, when the schedule draws one.
    deadline: Option<Duration>,
    /// With a shared service: how long a caller waits for its `ready()` before it gives the
    /// call up (a timeout around a generated client's call).
    ready_timeout: Option<Duration>,
}

impl Caller {
    /// One write with `key` and `tenant` (either may be missing: a malformed write).
    async fn send(
        self,
        key: Option<&str>,
        tenant: Option<&str>,
        (body, fault): (Bytes, Option<BodyFault>),
        slow_read: Option<Duration>,
        ledger: &Ledger,
        i: usize,
    ) -> Option<Ending> {
        match self {
            Caller::Http(http) => {
                let mut req = Request::post(format!("/w/{}", key.unwrap_or("malformed")));
                if let Some(d) = http.deadline {
                    req = req.extension(retry_layer::Deadline::after(d));
                }
                if let Some(key) = key {
                    req = req.header(idempotency_layer::X_IDEMPOTENCY_KEY, key);
                }
                if let Some(tenant) = tenant {
                    req = req.header(TENANT_HEADER, tenant);
                }
                req = req.header(CALL_HEADER, i);
                let req = req
                    .body(SendBody::new(body, fault).counted_in(&ledger.held, http.client, i))
                    .expect("a valid request");
                call(http, req, slow_read, ledger, i).await
            }
            Caller::Grpc(svc) => crate::grpc::call(svc, key, tenant, body, ledger, i).await,
        }
    }
}

/// One call: readiness, the layer's answer, then the body read to its end. `None`: the body
/// did not end within [`BODY_BOUND`].
async fn call(
    http: HttpCaller,
    req: Request<SendBody>,
    slow_read: Option<Duration>,
    ledger: &Ledger,
    i: usize,
) -> Option<Ending> {
    // The call is inside its layers until they answer (or it is given up).
    let in_layer = ledger.held.in_layer(i);
    let answer = match http.shared {
        None => {
            ledger.call_took_service(i);
            CALL.scope(i, http.stack.oneshot(req)).await
        }
        Some(shared) => {
            let sent = CALL
                .scope(i, async move {
                    let mut svc = shared.lock().await;
                    ledger.call_took_service(i);
                    let ready = match http.ready_timeout {
                        Some(t) => match tokio::time::timeout(t, svc.ready()).await {
                            Ok(ready) => ready,
                            // The caller gives up on the service's readiness: it abandons its
                            // `ready()` on the shared service.
                            Err(_) => return None,
                        },
                        None => svc.ready().await,
                    };
                    let future = match ready {
                        Ok(svc) => svc.call(req),
                        Err(e) => return Some(Err(e)),
                    };
                    drop(svc);
                    Some(future.await)
                })
                .await;
            match sent {
                Some(answer) => answer,
                None => return Some(Ending::Cancelled),
            }
        }
    };
    drop(in_layer);
    ledger.call_head(i);
    read_answer(answer, slow_read).await
}

/// The answer of one call, its body read to its end: `None` if it did not end within
/// [`BODY_BOUND`].
async fn read_answer<B>(
    answer: Result<Response<B>, BoxError>,
    slow_read: Option<Duration>,
) -> Option<Ending>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + 'static,
{
    let resp = match answer {
        Ok(resp) => resp,
        Err(e) => return Some(Ending::Error(error_chain(&*e))),
    };
    let (parts, body) = resp.into_parts();
    let flag = |name: &http::HeaderName| {
        parts
            .headers
            .get(name)
            .is_some_and(|v| v.as_bytes() == b"true")
    };
    let text = |name: &http::HeaderName| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let mut bytes = Vec::new();
    let mut body_error = None;
    let mut paused = Duration::ZERO;
    let read = async {
        let mut body = body;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Some(d) = frame.data_ref() {
                        bytes.extend_from_slice(d);
                    }
                    // Slowly for its first seconds (enough for flow control to reach the server),
                    // then at full speed: the read must fit in `BODY_BOUND`, which judges the
                    // layer, not this client's patience.
                    if let Some(pause) = slow_read.filter(|_| paused < SLOW_READ_FOR) {
                        tokio::time::sleep(pause).await;
                        paused += pause;
                    }
                }
                Err(e) => {
                    body_error = Some(error_chain(&e));
                    break;
                }
            }
        }
    };
    if tokio::time::timeout(BODY_BOUND, read).await.is_err() {
        return None;
    }
    Some(Ending::Response {
        status: parts.status.as_u16(),
        replayed: flag(&IDEMPOTENT_REPLAYED),
        body_omitted: flag(&IDEMPOTENT_BODY_OMITTED),
        reason: parts
            .headers
            .get("x-reason-code")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        content_length: parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok()),
        execution: text(&crate::app::EXECUTION_HEADER),
        content_type: text(&http::header::CONTENT_TYPE),
        body: bytes,
        body_error,
    })
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(e) = source {
        s.push_str(": ");
        s.push_str(&e.to_string());
        source = e.source();
    }
    s
}

/// The final probe: once the schedule's faults are healed, each server must still serve a
/// fresh write (no panic took it down, no capacity was leaked).
pub async fn run_probe(
    schedule: Arc<Schedule>,
    ledger: Ledger,
    go: Arc<AtomicBool>,
) -> turmoil::Result {
    while !go.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let restarted servers bind again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(schedule.settings.protocol == Protocol::Http2);
    let hyper: Client<SimConnector, Full<Bytes>> = builder.build(SimConnector);
    // A store drawn small may be full of records younger than its retention: a fresh write is
    // then refused (503, retryably) until the oldest passes it, and is sent again until then.
    // Or full of claims no layer holds (a lost `begin` reply's orphans), which lapse with their
    // lease (the downstream tier's, 30 s, included) and then make room: the store's bound.
    let lease = schedule
        .settings
        .per_server
        .iter()
        .filter_map(|s| s.lease)
        .chain(schedule.settings.lease)
        .max()
        .unwrap_or(Duration::from_secs(30))
        .max(Duration::from_secs(30));
    let full_for = schedule
        .settings
        .bounds
        .store
        .map(|(_, retention)| retention.max(lease) + Duration::from_secs(5));
    for server in 0..schedule.settings.servers {
        let key = format!("probe-{:x}-{server}", schedule.seed);
        let started = now();
        let result = loop {
            let req = Request::post(format!(
                "http://server{server}:{}/w/{key}",
                crate::net::PORT
            ))
            .header(idempotency_layer::X_IDEMPOTENCY_KEY, &key)
            .header(TENANT_HEADER, "probe")
            .body(Full::new(Bytes::from_static(b"probe")))
            .expect("a valid request");
            let result = if schedule.settings.protocol == Protocol::Grpc {
                tokio::time::timeout(Duration::from_secs(30), crate::grpc::probe(server, &key))
                    .await
                    .unwrap_or_else(|_| Err("no answer within 30 s".to_owned()))
            } else {
                let answer =
                    tokio::time::timeout(Duration::from_secs(30), hyper.request(req)).await;
                match answer {
                    Ok(Ok(resp)) => Ok(resp.status().as_u16()),
                    Ok(Err(e)) => Err(error_chain(&e)),
                    Err(_) => Err("no answer within 30 s".to_owned()),
                }
            };
            let refused = match &result {
                Ok(503) => true,
                Err(e) => e.contains("no room"),
                Ok(_) => false,
            };
            // No answer yet: a run started before the heal may still hold the server's capacity
            // (with a `ConcurrencyLimit` of one, a handler whose downstream call waits out its
            // attempts' head bounds). Tried again within the bound the quiescence probe gives a
            // run in flight; a server that holds its capacity longer (for ever) still fails.
            let busy = matches!(&result, Err(e) if e.starts_with("no answer within"));
            if busy && now() - started <= quiescence_bound(&schedule) {
                continue;
            }
            if !refused || full_for.is_none_or(|bound| now() - started > bound) {
                break result;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        ledger.lock().probes.push((server, result));
    }
    quiesce(&schedule, &ledger, &hyper).await;
    Ok(())
}

/// The client index of the quiescence probe's calls.
pub const PROBE: usize = 999;

/// How long the quiescence probe tries one key: a claim in flight is held at most its
/// server's `max_claim_lifetime` (5 minutes by default), then lapses with its lease (30 s by
/// default); a duplicate waits at most `max_wait` (30 s) for it.
pub fn quiescence_bound(schedule: &Schedule) -> Duration {
    let s = &schedule.settings;
    let max = |f: &dyn Fn(&crate::schedule::ServerSettings) -> Option<Duration>, d: u64| {
        s.per_server
            .iter()
            .map(|p| f(p).unwrap_or(Duration::from_secs(d)))
            .max()
            .unwrap_or(Duration::from_secs(d))
    };
    // A handler that writes downstream waits there too: an orphan claim of its downstream write
    // (a `begin` reply lost) holds that key for the downstream tier's lease (its default, 30 s),
    // and a duplicate waits for it up to its `max_wait` (30 s).
    let downstream = if s.chain {
        Duration::from_secs(30 + 30)
    } else {
        Duration::ZERO
    };
    max(&|p| p.max_claim_lifetime, 300)
        + max(&|p| p.lease, 30)
        + max(&|p| p.max_wait, 30)
        + downstream
        + Duration::from_secs(10)
}

/// Whether the quiescence probe has its answer: a replay (of any status), or a first run's
/// success read to its end. Anything else (in flight, refused for now, a run that failed
/// without a record) is tried again. When a send of the key carried another body, that one
/// may have been recorded: the intent's own body is then refused with 422.
pub fn quiescent_answer(ending: &Ending, other_body: bool) -> bool {
    match ending {
        Ending::Response {
            status,
            replayed,
            body_error,
            ..
        } => {
            *replayed
                || ((200..300).contains(status) && body_error.is_none())
                || (other_body && *status == 422)
        }
        // gRPC's 422: the key was used with the other body (tonic gives the status as an error);
        // a replay of a record kept without its body is a trailers-only ALREADY_EXISTS.
        Ending::Error(e) => {
            (other_body && e.starts_with("grpc FailedPrecondition"))
                || e.starts_with("grpc AlreadyExists")
        }
        _ => false,
    }
}

/// Quiescence: every fault healed, each intent's key is sent once more (with its body) and
/// answered (a replay of its record, or a first run if nothing was recorded), retried while it
/// is in flight or refused for now; then, once background work had time to end, every server's
/// layer statistics are read (no claim, waiter or detached work may be left).
async fn quiesce(schedule: &Schedule, ledger: &Ledger, hyper: &Client<SimConnector, Full<Bytes>>) {
    let bound = quiescence_bound(schedule);
    let writes = schedule
        .intents
        .iter()
        .enumerate()
        .map(|(n, intent)| async move {
            let server = n % schedule.settings.servers;
            let scope = (intent.tenant.to_owned(), intent.key.clone());
            let i = ledger.call_started(PROBE, scope, &intent.body);
            let started = now();
            let mut tag = (PROBE as u64) << 40 | (n as u64) << 20;
            let ending = loop {
                tag += 1;
                let try_started = now();
                let body = Bytes::from(intent.body.clone());
                let ending = if schedule.settings.protocol == Protocol::Grpc {
                    let write =
                        crate::grpc::probe_write(server, &intent.key, intent.tenant, body, tag);
                    tokio::time::timeout(Duration::from_secs(60), write).await
                } else {
                    let req = Request::post(format!(
                        "http://server{server}:{}/w/{}",
                        crate::net::PORT,
                        intent.key
                    ))
                    .header(idempotency_layer::X_IDEMPOTENCY_KEY, &intent.key)
                    .header(TENANT_HEADER, intent.tenant)
                    .header(ATTEMPT_HEADER, tag)
                    .body(Full::new(body))
                    .expect("a valid request");
                    let write = async {
                        let answer = hyper
                            .request(req)
                            .await
                            .map_err(|e| Box::new(e) as BoxError);
                        read_answer(answer, None).await
                    };
                    tokio::time::timeout(Duration::from_secs(60), write)
                        .await
                        .map(|e| e.unwrap_or(Ending::Error("no body end".to_owned())))
                };
                let ending =
                    ending.unwrap_or_else(|_| Ending::Error("no answer within 60 s".into()));
                let other = intent.sends.iter().any(|s| s.other_body);
                // Another try while the bound has not passed when this one started: a try that
                // waited long (a run started before the heal that never ends, until its
                // lifetime) is followed by one more.
                if quiescent_answer(&ending, other) || try_started - started > bound {
                    break ending;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            };
            ledger.call_head(i);
            ledger.call_ended(i, ending);
        });
    futures_util::future::join_all(writes).await;
    // Background work (a record resent, a release) ends within a few store calls, each bounded
    // by a lease (a reply held back that long included): read the layers once they are idle, or
    // when that has passed.
    let lease = schedule
        .settings
        .per_server
        .iter()
        .filter_map(|s| s.lease)
        .chain(schedule.settings.lease)
        .max()
        .unwrap_or(Duration::from_secs(30))
        .max(Duration::from_secs(30));
    // Detached work (a handler whose client went away) may run to its claim's lifetime.
    let lifetime = schedule
        .settings
        .per_server
        .iter()
        .map(|s| {
            s.max_claim_lifetime
                .unwrap_or(crate::invariants::DEFAULT_MAX_CLAIM_LIFETIME)
        })
        .max()
        .unwrap_or(crate::invariants::DEFAULT_MAX_CLAIM_LIFETIME);
    let idle_by = now() + lifetime + 2 * lease + Duration::from_secs(10);
    while !ledger.layers_idle() && now() < idle_by {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ledger.read_final_stats();
}

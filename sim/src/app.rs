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
use tokio::time::Sleep;
use tower::limit::ConcurrencyLimitLayer;
use tower::ServiceBuilder;

use crate::ledger::{now, Execution, Ledger, ScopeName};
use crate::schedule::{Handler, Intent, Schedule};
use crate::store_host::StoreLink;
use crate::tag::{TagLayer, ATTEMPT_HEADER};

/// The header that names the tenant (trusted in the simulation, as behind a proxy).
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-tenant");

/// The message of every panic the simulated handlers raise on purpose.
pub const HANDLER_PANIC: &str = "sim: the handler panics (a fault of the schedule)";

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

#[derive(Clone)]
struct AppState {
    shared: Shared,
    server: usize,
    boot: u32,
}

/// Server `server`'s software for its boot `boot`: the layer with the schedule's settings
/// over the handlers, served until the host crashes.
pub async fn run_server(
    schedule: Arc<Schedule>,
    shared: Shared,
    store: StoreLink,
    server: usize,
    boot: u32,
) -> turmoil::Result {
    let s = &schedule.settings;
    let mut layer = IdempotencyLayer::new(store)
        .tenant_from_header(TENANT_HEADER)
        .in_flight(s.in_flight)
        .on_disconnect(s.on_disconnect)
        .fail_open(s.fail_open);
    if let Some(lease) = s.lease {
        layer = layer.lease(lease);
    }
    let router = Router::new()
        .route("/w/{key}", post(write))
        .route("/health", get(|| async { "ok" }))
        .with_state(AppState {
            shared,
            server,
            boot,
        });
    let service = ServiceBuilder::new()
        .layer(TagLayer)
        .layer(layer)
        .option_layer(s.server_limit.map(ConcurrencyLimitLayer::new))
        .service(router);
    crate::net::serve(service).await
}

async fn write(
    State(app): State<AppState>,
    Path(key): Path<String>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response<axum::body::Body> {
    let tenant = headers
        .get(&TENANT_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let attempt = headers
        .get(ATTEMPT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let scope: ScopeName = (tenant, key);
    let Some(intent) = app.shared.plan.get(&scope).cloned() else {
        // A probe: a fresh key, nothing planned for it.
        return Response::new(axum::body::Body::from("probe"));
    };
    let n = {
        let mut started = app.shared.started.lock().expect("started");
        let n = started.entry(scope.clone()).or_default();
        *n += 1;
        *n
    };
    let ledger = &app.shared.ledger;
    let plan = if n == 1 { intent.first } else { Handler::Ok };
    ledger.event(format!(
        "{}/{} execution {n} on server {} boot {} (attempt {attempt:?}): {plan:?}",
        scope.0, scope.1, app.server, app.boot
    ));
    match plan {
        Handler::Error => return status(StatusCode::INTERNAL_SERVER_ERROR),
        Handler::Unavailable => return status(StatusCode::SERVICE_UNAVAILABLE),
        Handler::PanicBeforeHead => panic!("{HANDLER_PANIC}"),
        Handler::NeverEnds => std::future::pending::<()>().await,
        Handler::Slow(d) => tokio::time::sleep(d).await,
        _ => {}
    }
    // The side effect commits here, then the handler answers.
    let body = response_body(&scope, n, intent.response_len);
    ledger
        .lock()
        .executions
        .entry(scope.clone())
        .or_default()
        .push(Execution {
            server: app.server,
            boot: app.boot,
            at: now(),
            attempt,
            status: 201,
            body: body.to_vec(),
        });
    ledger.event(format!("{}/{} execution {n} committed", scope.0, scope.1));
    let body = SimBody {
        data: body,
        pos: 0,
        sized: intent.sized,
        plan,
        stall: None,
        stalled: false,
        ledger: ledger.clone(),
        name: format!("{}/{} execution {n}", scope.0, scope.1),
    };
    Response::builder()
        .status(StatusCode::CREATED)
        .header(http::header::CONTENT_TYPE, "text/plain")
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

/// A response body of 16-byte frames with the plan's fault at its byte.
struct SimBody {
    data: Bytes,
    pos: usize,
    sized: bool,
    plan: Handler,
    stall: Option<Pin<Box<Sleep>>>,
    stalled: bool,
    ledger: Ledger,
    /// Its scope and execution, for the trace.
    name: String,
}

impl Drop for SimBody {
    fn drop(&mut self) {
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

const FRAME: usize = 16;

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
        let mut end = (this.pos + FRAME).min(this.data.len());
        match this.plan {
            Handler::PanicInBody { at } | Handler::ErrorInBody { at }
                if this.pos >= at || this.pos + FRAME > at =>
            {
                if this.pos < at {
                    end = at;
                } else if matches!(this.plan, Handler::PanicInBody { .. }) {
                    panic!("{HANDLER_PANIC}");
                } else {
                    return Poll::Ready(Some(Err("sim: the response body fails".into())));
                }
            }
            Handler::StallInBody { at, stall } if !this.stalled && this.pos + FRAME > at => {
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
            return Poll::Ready(None);
        }
        let end = end.max(this.pos + 1).min(this.data.len());
        let chunk = this.data.slice(this.pos..end);
        this.pos = end;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.pos >= self.data.len()
            && !matches!(
                self.plan,
                Handler::PanicInBody { at } | Handler::ErrorInBody { at } if at >= self.pos
            )
    }

    fn size_hint(&self) -> SizeHint {
        if self.sized {
            SizeHint::with_exact((self.data.len() - self.pos) as u64)
        } else {
            SizeHint::default()
        }
    }
}

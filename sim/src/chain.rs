//! A chain: the servers' handlers make one write of their own to a downstream tier before their
//! side effect commits, through a `RetryLayer` that derives the downstream key from the inbound
//! write (`derive_idempotency_keys`). Whatever runs the upstream handler again (a crash, a lapsed
//! lease, fail-open), the downstream write carries the same key and runs once.

use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::IdempotencyLayer;
use reason_code::BoxError;
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use retry_layer::{RetryLayer, RetryPolicy};
use std::time::Duration;
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};
use tower_layer::Layer;

use crate::ledger::{now, Execution, Ledger, ScopeName};
use crate::net::{SimConnector, PORT};
use crate::store_host::StoreLink;

/// The downstream host's name.
pub const DOWN: &str = "down";

/// The header that names the upstream scope a downstream write belongs to (bookkeeping of the
/// simulation; the layers never read it).
pub const PARENT_HEADER: HeaderName = HeaderName::from_static("x-sim-parent");

/// The secret every upstream instance derives downstream keys with.
const SECRET: &str = "sim: derived keys";

/// An upstream instance's client of the downstream tier.
#[derive(Clone)]
pub struct DownClient {
    service: BoxCloneSyncService<Request<Full<Bytes>>, Response<hyper::body::Incoming>, BoxError>,
    /// Hedging alone: no retry layer derives the downstream key, so the handler names it.
    names_keys: bool,
}

impl std::fmt::Debug for DownClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownClient")
            .field("names_keys", &self.names_keys)
            .finish_non_exhaustive()
    }
}

/// The header that names the upstream attempt whose handler run made a downstream write
/// (bookkeeping of the simulation, as [`PARENT_HEADER`]).
pub const UPSTREAM_ATTEMPT_HEADER: HeaderName = HeaderName::from_static("x-sim-upstream-attempt");

/// How the upstream handlers' client of the downstream tier is stacked, as the seed's clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownStack {
    /// `RetryLayer` over hyper-util's client.
    Retry,
    /// `RetryLayer` over `HedgeLayer` (this hedging delay) over the client.
    RetryOverHedge(Duration),
    /// `HedgeLayer` alone (this hedging delay): the handler names the key.
    HedgeAlone(Duration),
}

/// The client an upstream handler calls the downstream tier with, stacked as `stack` says. Each
/// layer reads the handler's hop: under an inbound retry, the write is sent once, and a failure
/// it could have tried again is told to the hop.
pub fn down_client(stack: DownStack) -> DownClient {
    let hedging = |delay| {
        HedgePolicy::builder()
            .max_attempts(2)
            .hedging_delay(delay)
            .hedge_writes()
            .build()
            .expect("a valid hedging policy")
    };
    let retry = || {
        RetryLayer::new(
            RetryPolicy::builder()
                .derive_idempotency_keys(SECRET)
                .total_timeout(Duration::from_secs(5))
                .build()
                .expect("a valid policy"),
        )
    };
    // The client is built in each arm: the body type it sends differs under each layer.
    let hyper = Client::builder(TokioExecutor::new());
    let service = match stack {
        DownStack::Retry => BoxCloneSyncService::new(retry().layer(hyper.build(SimConnector))),
        DownStack::RetryOverHedge(delay) => BoxCloneSyncService::new(
            retry().layer(HedgeLayer::new(hedging(delay)).layer(hyper.build(SimConnector))),
        ),
        DownStack::HedgeAlone(delay) => BoxCloneSyncService::new(
            HedgeLayer::new(hedging(delay)).layer(hyper.build(SimConnector)),
        ),
    };
    DownClient {
        service,
        names_keys: matches!(stack, DownStack::HedgeAlone(_)),
    }
}

/// How long an upstream handler waits for its downstream answer's body.
const BODY_WAIT: Duration = Duration::from_secs(5);

/// How a downstream write failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownFailure {
    /// A failure the client could have tried again (a transport error, a timeout, a retryable
    /// status): the layer that made the write tells the hop how it ended.
    Retryable,
    /// A final answer (a replay, a status the table never retries): nothing to tell the hop.
    Final,
}

/// The upstream handler's downstream write, made as part of its execution of `parent` (by the
/// handler run of upstream attempt `upstream`). `Ok` when the downstream tier answered a
/// success (executed or replayed).
pub async fn write_down(
    client: &DownClient,
    parent: &ScopeName,
    upstream: Option<u64>,
) -> Result<(), DownFailure> {
    let mut req = Request::post(format!("http://{DOWN}:{PORT}/d"))
        .header(crate::app::TENANT_HEADER, "down")
        .header(PARENT_HEADER, format!("{}/{}", parent.0, parent.1))
        .body(Full::new(Bytes::new()))
        .expect("a valid request");
    if let Some(upstream) = upstream {
        req.headers_mut()
            .insert(UPSTREAM_ATTEMPT_HEADER, upstream.into());
    }
    if client.names_keys {
        let key = format!("{}_{}", parent.0, parent.1);
        req.headers_mut().insert(
            idempotency_layer::X_IDEMPOTENCY_KEY,
            key.parse().expect("a key of visible ASCII"),
        );
    }
    let res = client
        .service
        .clone()
        .oneshot(req)
        .await
        .map_err(|_| DownFailure::Retryable)?;
    let failure = (!res.status().is_success()).then(|| {
        if retryable(&res) {
            DownFailure::Retryable
        } else {
            DownFailure::Final
        }
    });
    // Bounded, as a careful handler bounds what it waits for: a body cut off by a partition
    // would otherwise hold the upstream write (and its claim) for good.
    let _ = tokio::time::timeout(BODY_WAIT, res.into_body().collect()).await;
    failure.map_or(Ok(()), Err)
}

/// Whether the retry table retries this answer to a keyed write (a replay never is).
fn retryable<B>(res: &Response<B>) -> bool {
    let replayed = res
        .headers()
        .get(reason_code::IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    let reasons = reason_code::ReasonCodes::default();
    match reason_code::classify_head(&reasons, false, res.status(), res.headers()) {
        reason_code::HeadClass::Decided(code) if !replayed => {
            reason_code::RetryTable::default().verdict(reason_code::Outcome::Status(code), true)
                == reason_code::Verdict::Retry
        }
        _ => false,
    }
}

#[derive(Clone)]
struct DownState {
    ledger: Ledger,
    boot: u32,
}

/// The downstream tier's software: the layer over a handler that records its executions by the
/// key it was called with and the upstream scope it belongs to.
pub async fn run_down(ledger: Ledger, store: StoreLink, boot: u32) -> turmoil::Result {
    let layer = IdempotencyLayer::new(store).tenant(idempotency_layer::TenantSource::header(
        crate::app::TENANT_HEADER,
    ));
    let received = ledger.clone();
    let router = Router::new()
        .route("/d", post(down_write))
        .with_state(DownState { ledger, boot });
    let service = ServiceBuilder::new()
        .map_request(move |req: Request<hyper::body::Incoming>| {
            let upstream = req
                .headers()
                .get(UPSTREAM_ATTEMPT_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if let Some(upstream) = upstream {
                received.down_received(upstream);
            }
            req
        })
        .layer(layer)
        .service(router);
    crate::net::serve(service, crate::net::DrainSignal::never()).await
}

async fn down_write(State(st): State<DownState>, headers: HeaderMap) -> Response<axum::body::Body> {
    let key = headers
        .get(idempotency_layer::X_IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned();
    let parent = headers
        .get(PARENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = format!("down {parent} {key}");
    let scope: ScopeName = (format!("down:{parent}"), key);
    st.ledger
        .lock()
        .executions
        .entry(scope.clone())
        .or_default()
        .push(Execution {
            server: usize::MAX,
            boot: st.boot,
            started: now(),
            at: now(),
            attempt: None,
            status: 201,
            body: body.clone().into_bytes(),
            broke_before_status: false,
            name: None,
        });
    st.ledger
        .event(format!("{}/{} downstream execution", scope.0, scope.1));
    Response::builder()
        .status(StatusCode::CREATED)
        .body(axum::body::Body::from(body))
        .expect("a valid response")
}

//! Helpers shared by the integration tests: servers on 127.0.0.1:0, a raw hyper client,
//! a channel-fed body and a store that fails on demand.
#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey, Token};
use idempotency_layer::{IdempotencyStore, MemoryStore, StoreError, Tenant};

/// Serves an axum router on 127.0.0.1:0 until the test's runtime stops.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(64)
        .build_http()
}

/// A response read to the end: status, headers, body, trailers.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Collected {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

pub async fn collect<B>(res: Response<B>) -> Collected
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    let (parts, body) = res.into_parts();
    let c = body.collect().await.expect("body");
    let trailers = c.trailers().cloned();
    Collected {
        status: parts.status,
        headers: parts.headers,
        body: c.to_bytes(),
        trailers,
    }
}

pub fn req_post(uri: &str, key: Option<&str>, body: &'static str) -> Request<axum::body::Body> {
    let mut b = Request::post(uri).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("x-idempotency-key", k);
    }
    b.body(axum::body::Body::from(body)).unwrap()
}

pub fn with_tenant<B>(mut req: Request<B>, tenant: &str) -> Request<B> {
    req.extensions_mut().insert(Tenant::new(tenant));
    req
}

/// A body fed from a channel: each message is one data frame.
pub struct ChannelBody(pub tokio::sync::mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

/// A store that delegates to a `MemoryStore` and fails every operation while `down` is set.
#[derive(Clone, Debug, Default)]
pub struct FlakyStore {
    pub inner: MemoryStore,
    pub down: Arc<AtomicBool>,
}

impl FlakyStore {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::Backend(
                "connection refused (test double)".into(),
            ))
        } else {
            Ok(())
        }
    }
}

impl IdempotencyStore for FlakyStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        self.check()?;
        self.inner.begin(scope, fingerprint, lease).await
    }
    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Record,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.check()?;
        self.inner.complete(scope, token, record, ttl).await
    }
    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        self.check()?;
        self.inner.release(scope, token).await
    }
    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.check()?;
        self.inner.renew(scope, token, lease).await
    }
    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        self.check()?;
        self.inner.wait(scope, observed).await
    }
    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        self.check()?;
        self.inner.forget(scope).await
    }
}

/// Yields until `cond` holds; panics naming `what` if it does not within 1 000 000 yields (a
/// test that fails instead of hanging).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1_000_000 {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never happened: {what}");
}

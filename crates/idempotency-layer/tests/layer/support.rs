//! Helpers shared by the integration tests: servers on 127.0.0.1:0, a raw hyper client,
//! a channel-fed body and a store that fails on demand.
#![allow(dead_code, unreachable_pub, unused_imports)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame};
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey, Token};
use idempotency_layer::{IdempotencyStore, MemoryStore, StoreError, Tenant};

pub use test_support::net::{collect, serve, Collected, HttpClient};

/// An HTTP/1.1 keep-alive client.
pub fn client() -> HttpClient {
    test_support::net::client_h1()
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
        record: Arc<Record>,
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

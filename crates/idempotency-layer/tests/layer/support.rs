//! Helpers shared by the integration tests: servers on 127.0.0.1:0, a raw hyper client,
//! a channel-fed body and a store that fails on demand (a `FaultStore`); waiting for events is
//! `test_support::wait`.
#![allow(dead_code, unreachable_pub, unused_imports)]

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame};
pub use idempotency_layer::conformance::{Fault, FaultStore, Op, Reply, Rule};
use idempotency_layer::{MemoryStore, Tenant};
pub use test_support::wait;

pub use test_support::net::{collect, serve, Collected, HttpClient};

/// A router whose `POST /orders` waits for a permit of the semaphore returned with it (none at
/// first: `add_permits` lets handlers finish), then answers `answer()`.
pub fn gated_orders<R>(answer: fn() -> R) -> (axum::Router, std::sync::Arc<tokio::sync::Semaphore>)
where
    R: axum::response::IntoResponse + 'static,
{
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let router = {
        let gate = gate.clone();
        axum::Router::new().route(
            "/orders",
            axum::routing::post(move || {
                let gate = gate.clone();
                async move {
                    gate.acquire().await.unwrap().forget();
                    answer()
                }
            }),
        )
    };
    (router, gate)
}

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

/// A `MemoryStore` that fails every operation while it is down ([`down`] / [`up`]).
pub type FlakyStore = FaultStore<MemoryStore>;

/// Takes `store` down: every operation fails as if it were unreachable.
pub fn down(store: &FlakyStore) {
    store.inject(Rule::every_op(Fault::Fail));
}

/// Brings `store` back up.
pub fn up(store: &FlakyStore) {
    store.heal();
}

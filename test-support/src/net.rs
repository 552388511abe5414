//! Real sockets for tests: an axum router served on 127.0.0.1:0, hyper-util clients over
//! HTTP/1.1 and HTTP/2 (h2c), and a response read to its end (trailers included).

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Serves `app` on 127.0.0.1:0 until the test's runtime stops; the address to call.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A hyper-util client sending `Full<Bytes>` bodies.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The HTTP version a test's client speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// HTTP/1.1 with keep-alive.
    Http1,
    /// HTTP/2 with prior knowledge (h2c), as gRPC clients speak.
    Http2,
}

impl Transport {
    /// Both, for the tests that run on each.
    pub const BOTH: [Transport; 2] = [Transport::Http1, Transport::Http2];

    /// A hyper-util client speaking this version (64 idle connections per host), sending `B`
    /// bodies.
    pub fn client<B>(self) -> Client<HttpConnector, B>
    where
        B: http_body::Body + Send + 'static,
        B::Data: Send,
    {
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_max_idle_per_host(64);
        if self == Transport::Http2 {
            builder.http2_only(true);
        }
        builder.build_http()
    }
}

/// An HTTP/1.1 keep-alive client (64 idle connections per host).
pub fn client_h1() -> HttpClient {
    Transport::Http1.client()
}

/// An HTTP/2 client with prior knowledge (h2c), as gRPC clients speak.
pub fn client_h2() -> HttpClient {
    Transport::Http2.client()
}

/// A response read to the end: status, headers, body, trailers.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// The trailers, if any.
    pub trailers: Option<HeaderMap>,
}

impl Collected {
    /// True when the response carries `idempotent-replayed: true`.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The body as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

/// Reads `res` to its end.
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

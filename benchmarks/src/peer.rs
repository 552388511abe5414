//! The peer a user would pick instead of idempotency-layer, on the load test's sockets:
//! [`axum-idempotent`](https://crates.io/crates/axum-idempotent) 0.6 on `ruts` sessions with its
//! in-memory store (moka), in front of the same handler as every HTTP scenario
//! ([`handler_app`]). Built with the `axum-idempotent` feature of this crate.
//!
//! axum-idempotent keeps each recorded response in the caller's session and records one only for
//! a request that carries an existing session, so its callers hold a session cookie from a
//! `POST /login` route of the same server:
//!
//! - **`axum-idempotent/first`**: each connection logs in again every [`WRITES_PER_SESSION`]
//!   writes (one session holding every response of a run grows without bound and makes each
//!   first execution slower than the last); the login's time counts in the write that follows
//!   it, as a real client's would.
//! - **`axum-idempotent/replay`**: each connection logs in once, before the rounds, and records
//!   its key in that session ([`replay_sessions`]).
//!
//! A write counts as answered only if it got 201, its whole body, and the peer's
//! `idempotency-replayed` header exactly when it was meant to replay: a scenario that timed
//! something else shows errors.
//!
//! What the peer does not do, so it costs nothing here: concurrent duplicates are not
//! coordinated (each runs the handler), a retry with another body is not refused, and the
//! records live in one process's memory (no shared store).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::post;
use axum::Router;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use ruts::store::moka::MokaStore;
use ruts::store::Ttl;
use ruts::{CookieOptions, Session, SessionLayer};
use tower_cookies::CookieManagerLayer;

use crate::load::{client, handler_app, key_of, request, Caller, Keys};

/// The scenario of first executions.
pub const FIRST: &str = "axum-idempotent/first";
/// The scenario of replays.
pub const REPLAY: &str = "axum-idempotent/replay";
/// Writes a connection sends in one session before it logs in again (first executions).
pub const WRITES_PER_SESSION: u32 = 100;

/// [`handler_app`] behind axum-idempotent (key from `x-idempotency-key`, required), its ruts
/// session layer on a moka store, and a `POST /login` route that starts a session.
pub fn app() -> Router {
    let store = Arc::new(MokaStore::builder().build());
    handler_app()
        .route(
            "/login",
            post(|session: Session<MokaStore>| async move {
                let ttl = Ttl::new(3600).map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                match session.set("user", &1i64, ttl, None).await {
                    Ok(_) => Ok("ok"),
                    Err(_) => Err(StatusCode::INTERNAL_SERVER_ERROR),
                }
            }),
        )
        .layer(IdempotentLayer::<MokaStore>::new(
            IdempotentOptions::default()
                .use_idempotency_key_header(Some("x-idempotency-key"), true),
        ))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name("session").path("/")),
        )
        .layer(CookieManagerLayer::new())
}

/// A connection of an axum-idempotent scenario: a hyper client (one per connection, as every
/// other scenario's) and the session cookie it sends.
#[derive(Debug)]
pub struct SessionCaller {
    client: Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    cookie: Option<HeaderValue>,
    writes_in_session: u32,
    /// Replays: one session for good, and every answer must be a replay.
    replays: bool,
}

impl SessionCaller {
    /// A caller of first executions: it logs in before its first write and again every
    /// [`WRITES_PER_SESSION`] writes.
    pub fn first_executions(addr: SocketAddr) -> Self {
        SessionCaller {
            client: client(),
            addr,
            cookie: None,
            writes_in_session: 0,
            replays: false,
        }
    }

    /// A caller of replays in the session of `cookie` (from [`replay_sessions`]).
    pub fn replays(addr: SocketAddr, cookie: HeaderValue) -> Self {
        SessionCaller {
            client: client(),
            addr,
            cookie: Some(cookie),
            writes_in_session: 0,
            replays: true,
        }
    }

    /// Starts a session (`POST /login`) and keeps its cookie; false if that failed.
    async fn login(&mut self) -> bool {
        static LOGINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = LOGINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let login = Request::post(format!("http://{}/login", self.addr))
            .header(
                "x-idempotency-key",
                format!("login-{}-{n:010}", std::process::id()),
            )
            .body(Full::new(Bytes::new()))
            .expect("valid request");
        let Ok(res) = self.client.request(login).await else {
            return false;
        };
        let cookie = res
            .headers()
            .get(http::header::SET_COOKIE)
            .and_then(|c| c.to_str().ok())
            .and_then(|c| c.split(';').next())
            .and_then(|c| HeaderValue::from_str(c).ok());
        let ok = res.status() == StatusCode::OK && res.into_body().collect().await.is_ok();
        self.cookie = cookie;
        self.writes_in_session = 0;
        ok && self.cookie.is_some()
    }

    /// Sends one write with `key` in the current session: true if it was answered 201 with
    /// its whole body, replayed exactly when this caller replays.
    async fn write(&mut self, key: &str) -> bool {
        let mut req = request(self.addr, key);
        if let Some(cookie) = &self.cookie {
            req.headers_mut()
                .insert(http::header::COOKIE, cookie.clone());
        }
        self.writes_in_session += 1;
        let Ok(res) = self.client.request(req).await else {
            return false;
        };
        let replayed = res.headers().contains_key("idempotency-replayed");
        res.status() == StatusCode::CREATED
            && replayed == self.replays
            && res.into_body().collect().await.is_ok()
    }
}

impl Caller for SessionCaller {
    async fn call(&mut self, key: String) -> bool {
        if !self.replays
            && (self.cookie.is_none() || self.writes_in_session >= WRITES_PER_SESSION)
            && !self.login().await
        {
            return false;
        }
        self.write(&key).await
    }
}

/// Logs each of `connections` connections in, records its replay key (`prefix`, as
/// [`Keys::PerConnection`] names it) in its session, and returns the sessions' cookies.
pub async fn replay_sessions(
    addr: SocketAddr,
    prefix: &str,
    connections: usize,
) -> Vec<HeaderValue> {
    let mut cookies = Vec::with_capacity(connections);
    for conn in 0..connections {
        let mut caller = SessionCaller::first_executions(addr);
        assert!(caller.login().await, "log in to axum-idempotent");
        let key = key_of(prefix, Keys::PerConnection, conn, 0);
        assert!(caller.write(&key).await, "pre-record a replay key");
        cookies.push(caller.cookie.expect("a session cookie"));
    }
    cookies
}

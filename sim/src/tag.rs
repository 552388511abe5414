//! Attempt tags: which attempt saw what at the store.
//!
//! The clients' router stamps every attempt with a number of its own (`x-sim-attempt`); on the
//! servers, [`TagLayer`] (outside the idempotency layer) keeps that number in a task-local
//! while the layer handles the request, and the store link notes, per attempt, what each
//! `begin` answered. The invariants then tell a write that ran unprotected because the store
//! was down (fail-open, a documented exception when nothing was known) from one that had seen
//! its key in flight first (never allowed).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http::{HeaderName, Request};
use tower_layer::Layer;
use tower_service::Service;

use crate::ledger::Ledger;

/// The header that carries an attempt's tag.
pub const ATTEMPT_HEADER: HeaderName = HeaderName::from_static("x-sim-attempt");

tokio::task_local! {
    static ATTEMPT: u64;
}

/// What one attempt's `begin` calls answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BeginsSeen {
    /// A `begin` answered that the key was in flight.
    pub in_flight: bool,
    /// A `begin` failed (store error).
    pub failed: bool,
    /// A `begin` claimed the key.
    pub claimed: bool,
}

/// The begins every tagged attempt saw.
#[derive(Clone, Debug, Default)]
pub struct AttemptTags(Arc<Mutex<BTreeMap<u64, BeginsSeen>>>);

impl AttemptTags {
    /// The tag of the attempt being handled here, if any.
    pub fn current() -> Option<u64> {
        ATTEMPT.try_with(|a| *a).ok()
    }

    /// Notes what a `begin` of `attempt` answered.
    pub fn note(&self, attempt: Option<u64>, f: impl FnOnce(&mut BeginsSeen)) {
        if let Some(a) = attempt {
            f(self
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(a)
                .or_default());
        }
    }

    /// What `attempt`'s begins answered.
    pub fn seen(&self, attempt: u64) -> BeginsSeen {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&attempt)
            .copied()
            .unwrap_or_default()
    }
}

/// Keeps each request's attempt tag in a task-local around the inner service's call.
/// It also notes, in the ledger, every tagged attempt that reached a server.
#[derive(Clone)]
pub struct TagLayer(pub Ledger);

impl<S> Layer<S> for TagLayer {
    type Service = Tag<S>;
    fn layer(&self, inner: S) -> Tag<S> {
        Tag {
            inner,
            ledger: self.0.clone(),
        }
    }
}

impl std::fmt::Debug for TagLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagLayer").finish_non_exhaustive()
    }
}

/// See [`TagLayer`].
#[derive(Clone)]
pub struct Tag<S> {
    inner: S,
    ledger: Ledger,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Tag<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tag")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, B> Service<Request<B>> for Tag<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures_util::future::Either<
        tokio::task::futures::TaskLocalFuture<u64, S::Future>,
        S::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let tag = req
            .headers()
            .get(ATTEMPT_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        match tag {
            Some(tag) => {
                let previous = [
                    reason_code::X_PREVIOUS_ATTEMPTS,
                    reason_code::GRPC_PREVIOUS_RPC_ATTEMPTS,
                ]
                .iter()
                .filter_map(|name| req.headers().get(name))
                .filter_map(|v| v.to_str().ok()?.parse::<u32>().ok())
                .max()
                .unwrap_or(0);
                self.ledger.lock().arrived.insert(tag, previous);
                let fut = ATTEMPT.sync_scope(tag, || self.inner.call(req));
                futures_util::future::Either::Left(ATTEMPT.scope(tag, fut))
            }
            None => futures_util::future::Either::Right(self.inner.call(req)),
        }
    }
}

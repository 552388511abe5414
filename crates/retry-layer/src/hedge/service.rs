//! [`Hedge`]: the service; `call` judges whether the request may be hedged, wraps its body and
//! hands both to a [`ResponseFuture`].

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use reason_code::{BoxError, Hop};
use tokio::time::Instant;
use tower_service::Service;

use super::future::{Plan, ResponseFuture};
use super::shared::HedgeShared;
use super::stats::incr;
use crate::body::ReplayBody;
use crate::deadline::{deadline_of, rewrite_grpc_timeout};
use crate::error::DeadlineExceeded;
use crate::ready::Readiness;
use crate::request::{remove_attempt_headers, PreviousAttempts};

/// The service [`HedgeLayer`](super::HedgeLayer) makes. Its inner service takes
/// [`ReplayBody`] requests, as [`Retry`](crate::Retry)'s does.
#[derive(Debug, Clone)]
pub struct Hedge<S> {
    inner: S,
    shared: Arc<HedgeShared>,
    ready: Readiness,
}

impl<S> Hedge<S> {
    pub(super) fn from_shared(inner: S, shared: Arc<HedgeShared>) -> Self {
        Hedge {
            inner,
            shared,
            ready: Readiness::default(),
        }
    }

    define_inner_service_accessors!();
}

impl<S, B, R> Service<Request<B>> for Hedge<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<R>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<R>;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    /// Ready at once, as [`Retry`](crate::Retry)'s: a call whose inner service is not ready
    /// yet waits for it in its response future, bounded by its deadline or else the policy's
    /// `response_head_timeout` (past that, [`DeadlineExceeded`] or
    /// [`ServiceNotReady`](crate::ServiceNotReady), nothing sent). Only an error of the inner
    /// service's own `poll_ready` is returned here.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.ready.poll(&mut self.inner, cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The service that was driven to readiness is the one that must be called (tower-service
        // docs, "Be careful when cloning inner services").
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let ready = self.ready.take();
        let shared = self.shared.clone();
        let policy = &shared.policy;
        let (mut parts, body) = req.into_parts();
        // A retry layer above wrote the attempt header of its retry and said so: the hedges
        // count on from it. Any other is forwarded from a request being served, not this call's
        // count.
        let previous = match parts.extensions.get::<PreviousAttempts>() {
            Some(p) => p.0,
            None => {
                remove_attempt_headers(&mut parts);
                0
            }
        };
        let grpc = reason_code::is_grpc(&parts.headers);
        let rules = policy.rules_for(&parts, grpc);
        let hedgeable = rules.max_attempts > 1 && policy.may_hedge(&parts, grpc);
        // The hop this call is made from, if the handler runs in one (as `Retry` reads it): a
        // request served as a retry of the hop above is sent once, not hedged (the hop above
        // retries; hedging here too would multiply its attempts), and a failure the hedge
        // could have tried again is told to the hop as deferred.
        let hop = if hedgeable {
            parts
                .extensions
                .get::<Arc<Hop>>()
                .cloned()
                .or_else(Hop::current)
        } else {
            None
        };
        let hedged = hedgeable && !hop.as_ref().is_some_and(|h| h.arrived_as_retry());
        let max = if hedged { policy.max_replay_bytes } else { 0 };
        let deadline = deadline_of(&parts, grpc, None);
        if grpc {
            rewrite_grpc_timeout(&mut parts, deadline, None);
        }
        incr(&shared.stats.requests);
        let plan = Plan {
            max_attempts: if hedged { rules.max_attempts } else { 1 },
            delay: rules.delay,
            non_fatal: rules.non_fatal,
            grpc,
            deadline,
            previous,
        };
        let wrapped = if deadline.is_some_and(|d| Instant::now() >= d) {
            Err(DeadlineExceeded::new().into())
        } else {
            ReplayBody::new(body, max, None, &shared.replay_memory)
        };
        match wrapped {
            Ok((first_body, body)) => {
                shared.budget.deposit();
                let kept = hedged.then(|| parts.clone());
                ResponseFuture::start(
                    service,
                    shared,
                    plan,
                    Request::from_parts(parts, first_body),
                    kept,
                    body,
                    ready,
                    hop,
                )
            }
            // Nothing is sent: the deadline had passed, or the body failed before its first
            // byte. That is the answer.
            Err(e) => ResponseFuture::not_sent(service, shared, plan, e),
        }
    }
}

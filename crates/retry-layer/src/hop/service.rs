//! [`HopScope`]: runs each request's handler in the scope of its [`Hop`].

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use reason_code::{Hop, ReasonCodes, GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS};
use tower_service::Service;

use super::ResponseFuture;
use crate::deadline::Deadline;

/// The service [`HopLayer`](super::HopLayer) makes: runs each request's handler in the scope of a [`Hop`] (the
/// per-request state, made from the request's headers), and marks the handler's answer when an
/// outbound call stopped retrying.
///
/// Named for what it does (it runs the handler in a hop's scope) rather than `Hop`, the
/// name of the per-request state it makes, which `reason-code` owns and both layers read.
#[derive(Debug, Clone)]
pub struct HopScope<S> {
    inner: S,
    reasons: ReasonCodes,
}

impl<S> HopScope<S> {
    pub(super) fn new(inner: S, reasons: ReasonCodes) -> Self {
        HopScope { inner, reasons }
    }

    define_inner_service_accessors!();
}

impl<S, B, R> Service<Request<B>> for HopScope<S>
where
    S: Service<Request<B>, Response = Response<R>>,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let headers = req.headers();
        let mut hop = Hop::from_request_headers(headers);
        if let Some(Deadline(d)) = req.extensions().get::<Deadline>() {
            hop = hop.with_inbound_deadline(*d);
        }
        let hop = Arc::new(hop);
        let headers = req.headers();
        if hop.previous_attempts() == 0 {
            warn_if_malformed(headers);
        }
        let grpc = reason_code::is_grpc(headers);
        req.extensions_mut().insert(hop.clone());
        let future = hop.clone().scope(self.inner.call(req));
        ResponseFuture::new(future, hop, grpc, self.reasons.clone())
    }
}

/// An attempt header that is present but not a count is read as "not a retry".
fn warn_if_malformed(headers: &http::HeaderMap) {
    for name in [GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS] {
        if let Some(v) = headers.get(&name) {
            if v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
                .is_none()
            {
                tracing::warn!(header = %name, value = ?v, "malformed attempt header: the request is served as a first attempt");
            }
        }
    }
}

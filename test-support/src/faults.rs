//! A layer that answers "unavailable" to a share of first attempts without calling the handler:
//! the server-side transient failure a client must retry through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures_util::future::{Either, Ready};
use http::{HeaderValue, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

/// The headers a retrying client (retry-layer) puts on a retry, HTTP and gRPC: a request with
/// neither is a first attempt. Spelled here rather than imported from `reason-code`, so that this
/// crate depends on none of the workspace's; the e2e crate checks they are `reason-code`'s.
pub const RETRY_HEADERS: [&str; 2] = ["x-previous-attempts", "grpc-previous-rpc-attempts"];

/// Answers 503 (HTTP) or a trailers-only UNAVAILABLE (gRPC) to first attempts with probability
/// `p`, from a seeded generator.
#[derive(Debug, Clone)]
pub struct Unavailable {
    p: f64,
    /// Retries too, not only first attempts: a backend that is down.
    every_attempt: bool,
    rng: Arc<Mutex<fastrand::Rng>>,
    injected: Arc<AtomicUsize>,
}

impl Unavailable {
    /// Fails first attempts with probability `p`.
    pub fn first_attempts(p: f64, seed: u64) -> Self {
        Unavailable {
            p,
            every_attempt: false,
            rng: Arc::new(Mutex::new(fastrand::Rng::with_seed(seed))),
            injected: Arc::default(),
        }
    }

    /// Fails every attempt, retries included: a backend that is down.
    pub fn every_attempt() -> Self {
        Unavailable {
            every_attempt: true,
            ..Unavailable::first_attempts(1.0, 0)
        }
    }

    /// How many failures were injected.
    pub fn injected(&self) -> usize {
        self.injected.load(Ordering::SeqCst)
    }
}

impl<S> Layer<S> for Unavailable {
    type Service = UnavailableService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        UnavailableService {
            inner,
            faults: self.clone(),
        }
    }
}

/// The service of [`Unavailable`].
#[derive(Debug, Clone)]
pub struct UnavailableService<S> {
    inner: S,
    faults: Unavailable,
}

impl<S, B, R> Service<Request<B>> for UnavailableService<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    R: Default,
{
    type Response = Response<R>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Response<R>, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let h = req.headers();
        let first = RETRY_HEADERS.iter().all(|name| !h.contains_key(*name));
        let fail = (first || self.faults.every_attempt)
            && self.faults.rng.lock().unwrap().f64() < self.faults.p;
        if !fail {
            return Either::Left(self.inner.call(req));
        }
        self.faults.injected.fetch_add(1, Ordering::SeqCst);
        let grpc = h
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let mut res = Response::new(R::default());
        if grpc {
            let hs = res.headers_mut();
            hs.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            hs.insert("grpc-status", HeaderValue::from_static("14"));
            hs.insert("grpc-message", HeaderValue::from_static("injected%20fault"));
        } else {
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        }
        Either::Right(futures_util::future::ready(Ok(res)))
    }
}

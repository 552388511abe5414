//! What a user would hand-roll instead of our pieces, as baselines of the same run:
//! [`MutexStore`], one `Mutex<HashMap>` doing the same claim and record work as `MemoryStore`
//! without shards, TTL index, capacity or waiter channels; and [`NaiveCacheLayer`], a server
//! middleware that remembers response bodies by idempotency key and does nothing else.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::WithTrailers;
use http_body_util::{BodyExt, Full};
use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey, Token};
use idempotency_layer::{IdempotencyStore, StoreError};
use tower::{Layer, Service};

use crate::NaiveCache;

enum Entry {
    InFlight {
        token: Token,
        fingerprint: Fingerprint,
    },
    Completed(Arc<Record>),
}

/// One `Mutex<HashMap<ScopeKey, Entry>>`: claim if free, report a claim or a record, replace a
/// claim by its record. Waiters poll every millisecond.
#[derive(Clone, Default)]
pub struct MutexStore {
    map: Arc<Mutex<HashMap<ScopeKey, Entry>>>,
    next: Arc<AtomicU64>,
}

impl std::fmt::Debug for MutexStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MutexStore").finish_non_exhaustive()
    }
}

impl MutexStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopeKey, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn holds(map: &HashMap<ScopeKey, Entry>, scope: &ScopeKey, token: Token) -> bool {
        matches!(map.get(scope), Some(Entry::InFlight { token: t, .. }) if *t == token)
    }
}

impl IdempotencyStore for MutexStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        _lease: Duration,
    ) -> Result<Begin, StoreError> {
        let token = Token(u128::from(self.next.fetch_add(1, Ordering::Relaxed)));
        let mut map = self.lock();
        match map.get(&scope) {
            Some(Entry::Completed(r)) => Ok(Begin::Completed(r.clone())),
            Some(Entry::InFlight { token, fingerprint }) => Ok(Begin::InFlight {
                token: *token,
                fingerprint: *fingerprint,
            }),
            None => {
                map.insert(scope, Entry::InFlight { token, fingerprint });
                Ok(Begin::New(token))
            }
        }
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        _ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut map = self.lock();
        if !Self::holds(&map, &scope, token) {
            return Err(StoreError::Fenced);
        }
        map.insert(scope, Entry::Completed(record));
        Ok(())
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let mut map = self.lock();
        if !Self::holds(&map, &scope, token) {
            return Err(StoreError::Fenced);
        }
        map.remove(&scope);
        Ok(())
    }

    async fn renew(&self, scope: ScopeKey, token: Token, _: Duration) -> Result<(), StoreError> {
        if Self::holds(&self.lock(), &scope, token) {
            Ok(())
        } else {
            Err(StoreError::Fenced)
        }
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        while Self::holds(&self.lock(), &scope, observed) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        Ok(self.lock().remove(&scope).is_some())
    }
}

/// What [`NaiveCacheLayer`] remembers of a response: its status, its `content-type`, its body
/// and its trailers (a gRPC response's `grpc-status` is one).
#[derive(Clone, Debug)]
pub struct NaiveResponse {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

/// The body [`NaiveCacheService`] answers with: the whole body, then the trailers if any.
pub type NaiveBody = WithTrailers<Full<Bytes>, Ready<Option<Result<HeaderMap, Infallible>>>>;

impl NaiveResponse {
    fn to_response(&self) -> Response<NaiveBody> {
        let body = Full::new(self.body.clone()).with_trailers(ready(self.trailers.clone().map(Ok)));
        let mut res = Response::new(body);
        *res.status_mut() = self.status;
        if let Some(ct) = &self.content_type {
            res.headers_mut().insert(CONTENT_TYPE, ct.clone());
        }
        res
    }
}

/// The idempotency middleware a user might hand-roll for a server: a [`NaiveCache`] from the
/// request's `x-idempotency-key` to the handler's response ([`NaiveResponse`]: status,
/// `content-type`, body, trailers). A key it holds is answered with that response, and the
/// handler does not run; otherwise the handler runs and a successful response (2xx) is read
/// whole and remembered. The same layer serves HTTP (axum) and gRPC (tonic `Server::layer`: a
/// gRPC response's trailers are kept).
///
/// It is the floor of what any idempotency layer does on a first execution and a replay (a
/// lookup, buffering the response, a copy of it per replay) and none of the rest: it does not
/// read the request body (no fingerprint), keeps no other headers, no tenant, no single flight
/// (two duplicates at once both run), no TTL and no bound. The load test runs it beside
/// `IdempotencyLayer` (`naive/first`, `naive/replay`, `grpc/naive/first`, `grpc/naive/replay`)
/// to show what that floor costs on the same wire.
#[derive(Clone, Debug, Default)]
pub struct NaiveCacheLayer {
    cache: Arc<NaiveCache<Arc<NaiveResponse>>>,
}

impl<S> Layer<S> for NaiveCacheLayer {
    type Service = NaiveCacheService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        NaiveCacheService {
            inner,
            cache: self.cache.clone(),
        }
    }
}

/// The service [`NaiveCacheLayer`] makes.
#[derive(Clone, Debug)]
pub struct NaiveCacheService<S> {
    inner: S,
    cache: Arc<NaiveCache<Arc<NaiveResponse>>>,
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for NaiveCacheService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    ReqB: Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<NaiveBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let key = req
            .headers()
            .get("x-idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if let Some(recorded) = key.as_deref().and_then(|k| self.cache.get(k)) {
            return Box::pin(ready(Ok(recorded.to_response())));
        }
        let cache = self.cache.clone();
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (parts, body) = inner.call(req).await?.into_parts();
            let Ok(collected) = body.collect().await else {
                let mut res = Response::new(Full::default().with_trailers(ready(None)));
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                return Ok(res);
            };
            let trailers = collected.trailers().cloned();
            let body = collected.to_bytes();
            if let (Some(key), true) = (key, parts.status.is_success()) {
                let recorded = NaiveResponse {
                    status: parts.status,
                    content_type: parts.headers.get(CONTENT_TYPE).cloned(),
                    body: body.clone(),
                    trailers: trailers.clone(),
                };
                cache.put(key, Arc::new(recorded));
            }
            let body = Full::new(body).with_trailers(ready(trailers.map(Ok)));
            Ok(Response::from_parts(parts, body))
        })
    }
}

#[cfg(test)]
mod tests {
    use tower::{service_fn, ServiceExt};

    use super::*;
    use crate::{created, order_request, RESPONSE_200};

    /// The baseline does what the load test counts on: a first request runs the handler, a
    /// duplicate is answered 201 with the same body and does not.
    #[tokio::test]
    async fn the_naive_cache_runs_a_key_once_and_replays_its_body() {
        let runs = Arc::new(AtomicU64::new(0));
        let handler = {
            let runs = runs.clone();
            service_fn(move |req: Request<Full<Bytes>>| {
                runs.fetch_add(1, Ordering::Relaxed);
                created(req)
            })
        };
        let svc = NaiveCacheLayer::default().layer(handler);
        for _ in 0..3 {
            let res = svc
                .clone()
                .oneshot(order_request("order-000000000001"))
                .await;
            let res = res.expect("infallible");
            assert_eq!(res.status(), StatusCode::CREATED);
            let body = res.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(body, RESPONSE_200);
        }
        assert_eq!(runs.load(Ordering::Relaxed), 1, "the handler ran once");
        svc.oneshot(order_request("order-000000000002"))
            .await
            .expect("infallible");
        assert_eq!(runs.load(Ordering::Relaxed), 2, "a new key runs");
    }

    /// A gRPC-shaped response (200, `application/grpc`, a body, then `grpc-status` in the
    /// trailers) is replayed whole: status, content type, body and trailers.
    #[tokio::test]
    async fn the_naive_cache_replays_status_content_type_and_trailers() {
        let runs = Arc::new(AtomicU64::new(0));
        let handler = {
            let runs = runs.clone();
            service_fn(move |_req: Request<Full<Bytes>>| {
                runs.fetch_add(1, Ordering::Relaxed);
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                let body = Full::new(Bytes::from_static(RESPONSE_200))
                    .with_trailers(ready(Some(Ok::<_, Infallible>(trailers))));
                let mut res = Response::new(body);
                res.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
                ready(Ok::<_, Infallible>(res))
            })
        };
        let svc = NaiveCacheLayer::default().layer(handler);
        for _ in 0..2 {
            let res = svc
                .clone()
                .oneshot(order_request("order-000000000001"))
                .await
                .expect("infallible");
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(res.headers()[CONTENT_TYPE], "application/grpc");
            let collected = res.into_body().collect().await.expect("body");
            assert_eq!(collected.trailers().expect("trailers")["grpc-status"], "0");
            assert_eq!(collected.to_bytes(), RESPONSE_200);
        }
        assert_eq!(runs.load(Ordering::Relaxed), 1, "the handler ran once");
    }
}

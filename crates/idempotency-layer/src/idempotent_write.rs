//! [`IdempotentWrite`]: what a handler the layer runs can know of its write, as a request
//! extension (and an axum extractor, feature `axum`).

use std::sync::{Arc, OnceLock};

use http::request::Parts;
use http::{HeaderValue, Method};

use crate::accepted::OperationPath;
use crate::config::Config;
use reason_code::{InboundWrite, ScopeSource};

use crate::scope::{http_scope_key, scope_key, Scope};
use crate::store::{ScopeKey, ScopeKeys, Token};

/// The write a handler is running, as the idempotency layer accepted it: the validated key,
/// the tenant, the operation, the scope's store key, the claim's fencing token, and whether an
/// earlier run of the same write may have started. The layer puts it in the request's
/// extensions of every write it executes; a replay never reaches the handler, and a request the
/// layer passes through (a read, or a write without a key where keys are optional) carries none.
///
/// Use it instead of parsing the key header again (the key may be a structured-field string,
/// and a key rule of your own may apply): for example as a unique column beside the side
/// effect, keyed by [`scope_key`](Self::scope_key) (tenant, operation and key hashed, so two
/// tenants' equal keys never collide), or to fence the side effect with
/// [`token`](Self::token).
///
/// With axum (feature `axum`), it is an extractor; `Option<IdempotentWrite>` for a handler that
/// also serves requests the layer passes through:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{routing::post, Router};
/// use idempotency_layer::{IdempotencyLayer, IdempotentWrite, MemoryStore, TenantSource};
///
/// async fn create_order(write: IdempotentWrite, body: String) -> String {
///     // The key as the client sent it, and whether an earlier run may have begun the work.
///     let again = write.may_have_run_before();
///     format!("order of {} bytes for key {} (again: {again})", body.len(), write.key())
/// }
///
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("shop")));
/// # let _ = app;
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentWrite(Arc<Accepted>);

/// What the layer accepted, kept as it came (the key's header value and an axum route are
/// shared, the path copied); the key and the operation's text are made from them when a
/// handler asks, so a handler that never looks costs its write two allocations.
#[derive(Debug)]
struct Accepted {
    /// The key header's value, which the layer validated: [`IdempotentWrite::key`] is its
    /// text without structured-field quotes.
    key: HeaderValue,
    tenant: Arc<str>,
    /// The HTTP method; `None` for gRPC, whose operation is its path alone.
    method: Option<Method>,
    path: OperationPath,
    /// `"POST /orders"`, made on the first [`IdempotentWrite::operation`] of an HTTP write.
    operation: OnceLock<Box<str>>,
    /// [`Scope::key`], given where the store files the scope under it (the layer computed it),
    /// else made on the first [`IdempotentWrite::scope_key`] or derived outbound key.
    stable_key: OnceLock<ScopeKey>,
    token: Option<Token>,
    previous_attempts: u32,
    after_a_run_without_record: bool,
}

impl IdempotentWrite {
    /// The idempotency key, validated, without its structured-field quotes.
    pub fn key(&self) -> &str {
        crate::key::accepted_key(&self.0.key).unwrap_or_default()
    }

    /// The tenant the write is scoped to.
    pub fn tenant(&self) -> &str {
        &self.0.tenant
    }

    /// The operation the key is scoped to: `"POST /orders"` (the route's template with axum's
    /// `MatchedPath`, else the path) or a gRPC method path (`/shop.v1.Orders/Create`).
    pub fn operation(&self) -> &str {
        let a = &*self.0;
        match &a.method {
            None => a.path.as_str(),
            Some(method) => a.operation.get_or_init(|| {
                let path = a.path.as_str();
                let mut s = String::with_capacity(method.as_str().len() + 1 + path.len());
                s.push_str(method.as_str());
                s.push(' ');
                s.push_str(path);
                s.into_boxed_str()
            }),
        }
    }

    /// The write's scope: tenant, operation and key.
    pub fn scope(&self) -> Scope<'_> {
        Scope::new(self.tenant(), self.operation(), self.key())
    }

    /// The stable key of the scope ([`Scope::key`]): a hash of tenant, operation and key, the
    /// same on every instance, every run of this write and every version. A good unique column
    /// for the side effect (`scope_key().to_hex()`). (A store of this process alone, as
    /// [`MemoryStore`](crate::MemoryStore), files the scope under a key of its own:
    /// [`Scope::key_in`].)
    pub fn scope_key(&self) -> ScopeKey {
        self.0.stable_key()
    }

    /// The inbound write this one is to the handler's outbound calls ([`InboundWrite`]): its
    /// derived keys come from the stable scope key, made only if a call derives one.
    pub(crate) fn inbound(&self) -> InboundWrite {
        match self.0.stable_key.get() {
            Some(key) => InboundWrite::new(key.0),
            None => InboundWrite::deferred(self.0.clone()),
        }
    }

    /// The fencing token of the claim this run holds: another run of the same write (after this
    /// one's lease lapsed, or after it failed) holds another. `None` when the store failed and
    /// the layer runs the write anyway ([`fail_open`](crate::IdempotencyLayer::fail_open)).
    pub fn token(&self) -> Option<Token> {
        self.0.token
    }

    /// False when no claim guards this run: the store failed and the layer runs the write
    /// anyway ([`fail_open`](crate::IdempotencyLayer::fail_open)); a duplicate may run at the
    /// same time.
    pub fn is_protected(&self) -> bool {
        self.0.token.is_some()
    }

    /// The attempts the client says preceded this request (`x-previous-attempts`,
    /// `grpc-previous-rpc-attempts`; 0 when it says none).
    pub fn previous_attempts(&self) -> u32 {
        self.0.previous_attempts
    }

    /// True when an earlier run of this write may have begun its work: the client says this is
    /// a retry, or this request waited for a duplicate whose run ended without a record (it was
    /// cancelled with [`OnDisconnect::Release`](crate::OnDisconnect::Release), or its instance
    /// went away and its lease lapsed). The layer guarantees no two runs at once and no run
    /// after a record; a handler whose side effects span several steps checks what an earlier
    /// run left (by [`scope_key`](Self::scope_key)) before acting again.
    pub fn may_have_run_before(&self) -> bool {
        self.0.previous_attempts > 0 || self.0.after_a_run_without_record
    }

    /// The write of the request `parts`, which the layer accepted with the key and tenant their
    /// headers and extensions carry (read again here: only the writes that run pay for it).
    /// `stable_key` is the stable scope key where the layer computed it (its store's keys are
    /// [`ScopeKeys::Stable`]).
    pub(crate) fn of(
        cfg: &Config,
        parts: &Parts,
        stable_key: Option<ScopeKey>,
        token: Option<Token>,
        grpc: bool,
        waited: bool,
    ) -> Option<Self> {
        // The layer accepted this key (the only value of its headers) before the write ran.
        let (key, previous_attempts) =
            crate::head::key_and_attempts(&parts.headers, cfg.key_headers.as_slice());
        let key = key?;
        let tenant = crate::accepted::tenant(cfg, parts)?;
        Some(IdempotentWrite(Arc::new(Accepted {
            key: key.clone(),
            tenant,
            // gRPC: the method's path, never a route's template (tonic routes by a wildcard).
            method: (!grpc).then(|| parts.method.clone()),
            path: if grpc {
                OperationPath::request_path(parts)
            } else {
                OperationPath::of(parts)
            },
            operation: OnceLock::new(),
            stable_key: stable_key.map_or_else(OnceLock::new, OnceLock::from),
            token,
            previous_attempts,
            after_a_run_without_record: waited,
        })))
    }
}

impl Accepted {
    fn stable_key(&self) -> ScopeKey {
        *self.stable_key.get_or_init(|| {
            let key = crate::key::accepted_key(&self.key).unwrap_or_default();
            // As the layer keys a write (`Idempotency::call`), with stable keys.
            let path = self.path.as_str();
            match &self.method {
                None => scope_key(ScopeKeys::Stable, &self.tenant, &[path.as_bytes()], key),
                Some(method) => http_scope_key(ScopeKeys::Stable, &self.tenant, method, path, key),
            }
        })
    }
}

/// The scope of a handler's outbound writes' derived keys: the write's stable key.
impl ScopeSource for Accepted {
    fn scope_bytes(&self) -> [u8; 32] {
        self.stable_key().0
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::request::Parts;
    use http::StatusCode;

    use super::IdempotentWrite;

    /// Why [`IdempotentWrite`] could not be extracted: the request did not run under an
    /// idempotency layer (a route outside it, or a request it passes through). Answers 500: the
    /// handler needs a layer the application did not put in front of it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MissingIdempotentWrite;

    impl std::fmt::Display for MissingIdempotentWrite {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "this handler needs an IdempotentWrite, but the request was not executed by an \
                 IdempotencyLayer: put the layer in front of the route, or take \
                 Option<IdempotentWrite> where keys are optional",
            )
        }
    }

    impl std::error::Error for MissingIdempotentWrite {}

    impl IntoResponse for MissingIdempotentWrite {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotentWrite {
        type Rejection = MissingIdempotentWrite;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<IdempotentWrite>()
                .cloned()
                .ok_or(MissingIdempotentWrite)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotentWrite {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotentWrite>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingIdempotentWrite;

//! What a write's request names, read the one way the layer and the handler's view
//! ([`IdempotentWrite`](crate::IdempotentWrite)) both read it: its tenant and its operation.

use std::sync::Arc;

use http::request::Parts;

use crate::config::{Config, TenantFrom};
use crate::scope::Tenant;

/// The path that names an HTTP write's operation in its scope: the template of the route the
/// request matched, where the router says (axum's `MatchedPath`, feature `axum`), so that one
/// key cannot name two resources of one route (the concrete path is in the fingerprint: a key
/// reused on `/books/b2/deduct` after `/books/b1/deduct` is a mismatch); else the concrete path.
pub(crate) fn operation_path(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(route) = matched_route(parts) {
        return route.as_str();
    }
    parts.uri.path()
}

/// The template of the axum route the request matched, if the router says.
#[cfg(feature = "axum")]
fn matched_route(parts: &Parts) -> Option<&axum::extract::MatchedPath> {
    parts.extensions.get::<axum::extract::MatchedPath>()
}

/// [`operation_path`], kept beyond the request's head (an axum route is shared, a path copied:
/// a clone of the URI would turn its buffer shared, which costs more than the copy).
#[derive(Debug)]
pub(crate) enum OperationPath {
    /// The request's path.
    Path(Box<str>),
    /// The template of the axum route the request matched.
    #[cfg(feature = "axum")]
    Route(axum::extract::MatchedPath),
}

impl OperationPath {
    pub(crate) fn of(parts: &Parts) -> Self {
        #[cfg(feature = "axum")]
        if let Some(route) = matched_route(parts) {
            return OperationPath::Route(route.clone());
        }
        OperationPath::request_path(parts)
    }

    /// The request's own path, whatever route it matched (a gRPC method's).
    pub(crate) fn request_path(parts: &Parts) -> Self {
        OperationPath::Path(parts.uri.path().into())
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            OperationPath::Path(path) => path,
            #[cfg(feature = "axum")]
            OperationPath::Route(route) => route.as_str(),
        }
    }
}

/// The request's tenant: its [`Tenant`] extension, else what the layer is configured to use.
pub(crate) fn tenant(cfg: &Config, parts: &Parts) -> Option<Arc<str>> {
    if let Some(t) = parts.extensions.get::<Tenant>() {
        return Some(t.0.clone());
    }
    match &cfg.tenant {
        TenantFrom::Required => None,
        TenantFrom::Default(t, _) => Some(t.clone()),
        TenantFrom::Header(name) => {
            let mut values = parts.headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (Some(v), None) => v
                    .to_str()
                    .ok()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(Arc::from),
                _ => None,
            }
        }
        TenantFrom::Fn(f) => f(parts).filter(|t| !t.is_empty()),
    }
}

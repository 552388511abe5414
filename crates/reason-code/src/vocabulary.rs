//! Settings both layers take, as one parsed, validated type each, so the same string means the
//! same thing on both sides: [`GrpcMethods`] and [`KeyHeaders`].

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use http::header::{HeaderMap, HeaderName};

use crate::headers::{IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY};

/// A set of gRPC methods, declared by path: the methods a setting applies to.
///
/// Each entry is a full method path, `/package.Service/Method`, or a whole service,
/// `/package.Service/`, which declares every method of that service. Cloning is cheap (the sets
/// are shared). Both layers take it:
///
/// - methods declared idempotent: reads the server passes through without a key, and calls the
///   client may retry like GET. `retry-layer`'s `RetryPolicyBuilder::idempotent_grpc_methods`
///   and `idempotency-layer`'s `Writes::idempotent_grpc_methods` take it, so a string declares
///   the same methods on both sides;
/// - `idempotency-layer`'s `Writes::streaming_grpc_methods`: client-streaming and
///   bidirectional methods, which the server passes through (their request is never read whole).
///
/// ```
/// use reason_code::GrpcMethods;
///
/// let methods = GrpcMethods::new([
///     "/plume.linkd.v3.Library/GetBook",
///     "/grpc.health.v1.Health/",
/// ])
/// .unwrap();
/// assert!(methods.contains("/plume.linkd.v3.Library/GetBook"));
/// assert!(!methods.contains("/plume.linkd.v3.Library/CreateOrder"));
/// assert!(methods.contains("/grpc.health.v1.Health/Watch"));
///
/// let err = GrpcMethods::new(["GetBook"]).unwrap_err();
/// assert!(err.to_string().contains("/package.Service/Method"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GrpcMethods {
    methods: Arc<HashSet<Box<str>>>,
    /// Services declared whole, as `/package.Service/`.
    services: Arc<HashSet<Box<str>>>,
}

/// A gRPC method path that is neither `/package.Service/Method` nor `/package.Service/`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{path:?} is not a gRPC method path: write /package.Service/Method for one method, or \
     /package.Service/ for every method of a service"
)]
pub struct InvalidGrpcMethod {
    path: String,
}

impl GrpcMethods {
    /// Parses every path; the first invalid one is the error.
    pub fn new<I>(paths: I) -> Result<Self, InvalidGrpcMethod>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        paths
            .into_iter()
            .try_fold(GrpcMethods::default(), |m, p| m.with(p.as_ref()))
    }

    /// Adds one path (a method, or a whole service ending in `/`).
    pub fn with(mut self, path: &str) -> Result<Self, InvalidGrpcMethod> {
        let invalid = || InvalidGrpcMethod {
            path: path.to_owned(),
        };
        let rest = path.strip_prefix('/').ok_or_else(invalid)?;
        let (service, method) = rest.split_once('/').ok_or_else(invalid)?;
        let valid_name = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        };
        if !valid_name(service) || !(method.is_empty() || valid_name(method)) {
            return Err(invalid());
        }
        if method.is_empty() {
            Arc::make_mut(&mut self.services).insert(path.into());
        } else {
            Arc::make_mut(&mut self.methods).insert(path.into());
        }
        Ok(self)
    }

    /// True when `path` (a request's `/package.Service/Method`) is declared, by itself or by its
    /// service.
    pub fn contains(&self, path: &str) -> bool {
        if self.methods.contains(path) {
            return true;
        }
        if self.services.is_empty() {
            return false;
        }
        match path.rfind('/') {
            Some(i) if i > 0 => self.services.contains(&path[..=i]),
            _ => false,
        }
    }

    /// True when nothing is declared.
    pub fn is_empty(&self) -> bool {
        self.methods.is_empty() && self.services.is_empty()
    }

    /// Every declared path (methods, then services), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.methods
            .iter()
            .chain(self.services.iter())
            .map(|s| &**s)
    }
}

/// The headers an idempotency key travels in, in order of preference.
///
/// The default is `x-idempotency-key`, then the IETF draft's `Idempotency-Key`. The server reads
/// a key from any of them (a request with keys in two is refused); the client treats a request
/// carrying any of them as keyed, and puts a key it generates in the first. Both layers'
/// `key_headers` setters take this one type.
///
/// ```
/// use http::{HeaderMap, HeaderName};
/// use reason_code::KeyHeaders;
///
/// let default = KeyHeaders::default();
/// assert_eq!(default.first().as_str(), "x-idempotency-key");
///
/// let mine = KeyHeaders::new([HeaderName::from_static("x-request-key")]).unwrap();
/// let mut h = HeaderMap::new();
/// h.insert("x-request-key", "order-0042".parse().unwrap());
/// assert!(mine.is_keyed(&h));
/// assert!(!default.is_keyed(&h));
/// assert!(KeyHeaders::new([]).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyHeaders {
    names: Arc<[HeaderName]>,
}

/// A [`KeyHeaders`] with no header: keys could travel nowhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no idempotency key header given: name at least one, such as x-idempotency-key")]
pub struct NoKeyHeader;

impl Default for KeyHeaders {
    fn default() -> Self {
        KeyHeaders {
            names: Arc::new([X_IDEMPOTENCY_KEY, IDEMPOTENCY_KEY]),
        }
    }
}

impl KeyHeaders {
    /// These headers, in order of preference (duplicates dropped); at least one.
    pub fn new<I: IntoIterator<Item = HeaderName>>(names: I) -> Result<Self, NoKeyHeader> {
        let mut list: Vec<HeaderName> = Vec::new();
        for n in names {
            if !list.contains(&n) {
                list.push(n);
            }
        }
        if list.is_empty() {
            return Err(NoKeyHeader);
        }
        Ok(KeyHeaders { names: list.into() })
    }

    /// The preferred header: where a generated key goes, and the one error messages name.
    pub fn first(&self) -> &HeaderName {
        &self.names[0]
    }

    /// Every header, in order of preference.
    pub fn as_slice(&self) -> &[HeaderName] {
        &self.names
    }

    /// True when `headers` carry a key in any of these headers.
    pub fn is_keyed(&self, headers: &HeaderMap) -> bool {
        self.names.iter().any(|n| headers.contains_key(n))
    }
}

impl fmt::Display for KeyHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.names.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(n.as_str())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_and_services() {
        let m = GrpcMethods::new(["/a.B/Get", "/a.C/"]).unwrap();
        assert!(m.contains("/a.B/Get"));
        assert!(!m.contains("/a.B/Put"));
        assert!(m.contains("/a.C/Anything"));
        assert!(!m.contains("/a.CX/Anything"));
        assert!(!m.contains("/a.C"));
        assert!(!m.contains(""));
        assert_eq!(m.iter().count(), 2);
        for bad in [
            "",
            "/",
            "a.B/Get",
            "/a.B",
            "//Get",
            "/a.B/Get/x",
            "/a B/Get",
            "/a.B/G et",
        ] {
            assert!(GrpcMethods::new([bad]).is_err(), "{bad:?}");
        }
        assert!(GrpcMethods::default().is_empty());
    }

    #[test]
    fn key_headers_keep_order_and_drop_duplicates() {
        let k = KeyHeaders::new([IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY, IDEMPOTENCY_KEY]).unwrap();
        assert_eq!(k.as_slice(), &[IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY]);
        assert_eq!(k.first(), &IDEMPOTENCY_KEY);
        assert_eq!(k.to_string(), "idempotency-key, x-idempotency-key");
        assert_eq!(KeyHeaders::new([]), Err(NoKeyHeader));
    }
}

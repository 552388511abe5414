//! The request before each attempt: whether it is idempotent, the idempotency key it carries,
//! the head kept for retries, and the headers each attempt writes afresh.

use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use reason_code::{KeyHeaders, GRPC_PREVIOUS_RPC_ATTEMPTS, GRPC_TIMEOUT, X_PREVIOUS_ATTEMPTS};

use crate::retry::policy::RetryPolicy;

/// What the layer decided about a request (the first, or one a rebuild hook made) before
/// sending it.
#[derive(Debug)]
pub(crate) struct Judged {
    /// A gRPC call (by its content type).
    pub(crate) grpc: bool,
    /// The gRPC method config that applies (see `RetryPolicy::from_grpc_service_config`).
    pub(crate) method: Option<usize>,
    /// A safe method, a declared gRPC method, or a keyed request.
    pub(crate) idempotent: bool,
    /// The key `ensure_idempotency_key` generated, if it did.
    pub(crate) generated_key: Option<HeaderValue>,
}

/// What the layer reads of a request's headers before an attempt, found in one pass over them
/// ([`HeaderScan::of`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HeaderScan {
    /// The content type says gRPC.
    pub(crate) grpc: bool,
    /// One of the policy's key headers is present.
    pub(crate) keyed: bool,
    /// The `content-length`, if present and a number.
    pub(crate) content_length: Option<u64>,
    /// An attempt header (`x-previous-attempts`, `grpc-previous-rpc-attempts`) is present.
    pub(crate) attempt_headers: bool,
    /// A `grpc-timeout` is present (read, and checked for repeats, only then).
    pub(crate) grpc_timeout: bool,
}

/// Above this many header entries the scan looks each header up instead: a lookup hashes its
/// name once, a pass compares every name with each of the few the layer reads.
const SCAN_AT_MOST: usize = 16;

impl HeaderScan {
    /// Reads `headers` for what the layer needs of them: a pass over a request's few headers
    /// instead of a hashed lookup (about a hundred instructions) for each of five names.
    pub(crate) fn of(headers: &HeaderMap, key_headers: &KeyHeaders) -> HeaderScan {
        let length = |v: &HeaderValue| v.to_str().ok().and_then(|v| v.parse().ok());
        if headers.keys_len() > SCAN_AT_MOST {
            return HeaderScan {
                grpc: reason_code::is_grpc(headers),
                keyed: key_headers.is_keyed(headers),
                content_length: headers.get(CONTENT_LENGTH).and_then(length),
                attempt_headers: headers.contains_key(X_PREVIOUS_ATTEMPTS)
                    || headers.contains_key(GRPC_PREVIOUS_RPC_ATTEMPTS),
                grpc_timeout: headers.contains_key(GRPC_TIMEOUT),
            };
        }
        let mut scan = HeaderScan::default();
        // Each name's first value, as `HeaderMap::get` would give it.
        // (An entry's further values follow it and borrow the same name.)
        let mut last: *const HeaderName = std::ptr::null();
        for (name, value) in headers {
            if std::ptr::eq(last, name) {
                continue;
            }
            last = name;
            if !scan.keyed && key_headers.as_slice().contains(name) {
                scan.keyed = true;
            }
            if *name == CONTENT_TYPE {
                scan.grpc = reason_code::is_grpc_content_type(value);
            } else if *name == CONTENT_LENGTH {
                scan.content_length = length(value);
            } else if *name == X_PREVIOUS_ATTEMPTS || *name == GRPC_PREVIOUS_RPC_ATTEMPTS {
                scan.attempt_headers = true;
            } else if *name == GRPC_TIMEOUT {
                scan.grpc_timeout = true;
            }
        }
        scan
    }
}

/// Judges a request and gives it its key.
///
/// A request with a key is idempotent. A write without one gets `intent_key`, the key of the
/// request it replaces (a rebuilt write is the same intent), else a generated one when the
/// policy ensures keys.
pub(crate) fn judge(
    policy: &RetryPolicy,
    parts: &mut Parts,
    intent_key: Option<(HeaderName, HeaderValue)>,
) -> Judged {
    let scan = HeaderScan::of(&parts.headers, &policy.key_headers);
    judge_scanned(policy, parts, intent_key, scan)
}

/// [`judge`] with the request's headers already scanned.
pub(crate) fn judge_scanned(
    policy: &RetryPolicy,
    parts: &mut Parts,
    intent_key: Option<(HeaderName, HeaderValue)>,
    scan: HeaderScan,
) -> Judged {
    let grpc = scan.grpc;
    let method = if grpc {
        policy.grpc_method(parts.uri.path())
    } else {
        None
    };
    let (idempotent, generated_key) = settle_key(policy, parts, grpc, scan.keyed, intent_key);
    Judged {
        grpc,
        method,
        idempotent,
        generated_key,
    }
}

/// Returns whether the request is idempotent and the key generated, if one was.
fn settle_key(
    policy: &RetryPolicy,
    parts: &mut Parts,
    grpc: bool,
    keyed: bool,
    intent_key: Option<(HeaderName, HeaderValue)>,
) -> (bool, Option<HeaderValue>) {
    if keyed {
        return (true, None);
    }
    let by_method = if grpc {
        policy.idempotent_grpc.contains(parts.uri.path())
    } else {
        is_idempotent_method(&parts.method)
    };
    if by_method {
        return (true, None);
    }
    if let Some((name, value)) = intent_key {
        parts.headers.insert(name, value);
        return (true, None);
    }
    if let Some(value) = policy.derived_keys.as_ref().and_then(|d| d.key_for(parts)) {
        parts
            .headers
            .insert(policy.key_headers.first().clone(), value.clone());
        return (true, Some(value));
    }
    if !policy.ensure_key {
        return (false, None);
    }
    let key = uuid::Uuid::new_v4();
    let mut buf = uuid::Uuid::encode_buffer();
    let key = key.hyphenated().encode_lower(&mut buf);
    let value = HeaderValue::from_str(key).expect("a UUID is a valid header value");
    parts
        .headers
        .insert(policy.key_headers.first().clone(), value.clone());
    (true, Some(value))
}

/// Safe HTTP methods (RFC 9110 §9.2.1): reads.
pub(crate) fn is_safe_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Safe and idempotent HTTP methods (RFC 9110 §9.2).
pub(crate) fn is_idempotent_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// The key a request carries, in the first of the policy's key headers that holds one: the
/// intent a rebuilt request keeps.
pub(crate) fn intent_key(policy: &RetryPolicy, parts: &Parts) -> Option<(HeaderName, HeaderValue)> {
    policy
        .key_headers
        .as_slice()
        .iter()
        .find_map(|h| parts.headers.get(h).map(|v| (h.clone(), v.clone())))
}

/// On a retry the retry layer sends: how many attempts before it may have reached the server
/// (what its attempt header says). A [`HedgeLayer`](crate::hedge::HedgeLayer) below keeps that
/// header and counts its own hedges on from it; a header on a request without this mark was
/// forwarded from a request being served, and is not the call's count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreviousAttempts(pub(crate) u32);

/// Marks a response whose call was told, by an answer a layer below saw, that its key is in
/// flight at the server (a `HedgeLayer` under the retry layer, whose own answer may be another
/// attempt's): the retry layer's later attempts then say so too
/// ([`IDEMPOTENCY_SEEN_IN_FLIGHT`](reason_code::IDEMPOTENCY_SEEN_IN_FLIGHT)).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeenInFlight;

/// Writes the attempts sent before this one: `grpc-previous-rpc-attempts` (gRPC) or
/// `x-previous-attempts` (HTTP). `previous` counts only attempts that may have reached the
/// server: an attempt that provably never left the client is not one. With none, nothing is
/// written: to the server this is a first attempt.
pub(crate) fn write_previous_attempts(parts: &mut Parts, grpc: bool, previous: u32) {
    if previous == 0 {
        return;
    }
    let name = if grpc {
        GRPC_PREVIOUS_RPC_ATTEMPTS
    } else {
        X_PREVIOUS_ATTEMPTS
    };
    parts.headers.insert(name, HeaderValue::from(previous));
}

/// Removes the headers the layer writes per attempt (from a request before its first attempt,
/// and from one a hook rebuilt): each attempt's are written afresh.
pub(crate) fn remove_attempt_headers(parts: &mut Parts) {
    // Most requests carry neither: a scan of their few names is cheaper than two removals,
    // each of which hashes its name.
    let present = parts
        .headers
        .keys()
        .any(|k| *k == X_PREVIOUS_ATTEMPTS || *k == GRPC_PREVIOUS_RPC_ATTEMPTS);
    if present {
        parts.headers.remove(X_PREVIOUS_ATTEMPTS);
        parts.headers.remove(GRPC_PREVIOUS_RPC_ATTEMPTS);
    }
}

#[cfg(test)]
mod tests {
    use http::Request;
    use reason_code::{GrpcMethods, KeyHeaders};

    use super::*;

    /// The pass over the headers finds what a lookup of each name finds: first values of
    /// repeated names, every key header, maps short and long (looked up then).
    #[test]
    fn the_header_scan_agrees_with_lookups() {
        let keys = KeyHeaders::default();
        let candidates: [(&'static str, &'static str); 9] = [
            ("content-type", "application/grpc+proto"),
            ("content-type", "application/json"),
            ("content-length", "12"),
            ("content-length", "x"),
            ("idempotency-key", "k1"),
            ("x-idempotency-key", "k2"),
            ("x-previous-attempts", "1"),
            ("grpc-previous-rpc-attempts", "2"),
            ("grpc-timeout", "5S"),
        ];
        for headers in test_support::headers::combinations(&candidates) {
            let scan = HeaderScan::of(&headers, &keys);
            let what = format!("{headers:?}");
            assert_eq!(scan.grpc, reason_code::is_grpc(&headers), "{what}");
            assert_eq!(scan.keyed, keys.is_keyed(&headers), "{what}");
            assert_eq!(
                scan.content_length,
                headers
                    .get(CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse().ok()),
                "{what}"
            );
            assert_eq!(
                scan.attempt_headers,
                headers.contains_key(X_PREVIOUS_ATTEMPTS)
                    || headers.contains_key(GRPC_PREVIOUS_RPC_ATTEMPTS),
                "{what}"
            );
            assert_eq!(
                scan.grpc_timeout,
                headers.contains_key(GRPC_TIMEOUT),
                "{what}"
            );
        }
    }

    fn head(method: Method, path: &str, headers: &[(&'static str, &'static str)]) -> Parts {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://svc{path}"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.body(()).unwrap().into_parts().0
    }

    const GRPC: (&str, &str) = ("content-type", "application/grpc");

    #[test]
    fn the_idempotency_verdict() {
        let policy = RetryPolicy::builder()
            .idempotent_grpc_methods(GrpcMethods::new(["/a.S/Get", "/a.R/"]).unwrap())
            .build()
            .unwrap();
        // (method, path, headers, idempotent)
        type Headers = &'static [(&'static str, &'static str)];
        let cases: &[(Method, &str, Headers, bool)] = &[
            (Method::GET, "/x", &[], true),
            (Method::PUT, "/x", &[], true),
            (Method::DELETE, "/x", &[], true),
            (Method::POST, "/x", &[], false),
            (Method::PATCH, "/x", &[], false),
            (
                Method::POST,
                "/x",
                &[("x-idempotency-key", "k-0000001")],
                true,
            ),
            (
                Method::POST,
                "/x",
                &[("idempotency-key", "\"k-0000001\"")],
                true,
            ),
            (Method::POST, "/a.S/Get", &[GRPC], true),
            (Method::POST, "/a.S/Put", &[GRPC], false),
            (Method::POST, "/a.R/Anything", &[GRPC], true),
            // Not gRPC: the path is just a path, and POST is not idempotent.
            (Method::POST, "/a.S/Get", &[], false),
        ];
        for (method, path, headers, idempotent) in cases {
            let mut parts = head(method.clone(), path, headers);
            let judged = judge(&policy, &mut parts, None);
            assert_eq!(
                judged.idempotent, *idempotent,
                "{method} {path} {headers:?}"
            );
            assert!(judged.generated_key.is_none());
        }
    }

    #[test]
    fn keys_are_generated_once_and_kept_when_given() {
        let policy = RetryPolicy::builder()
            .ensure_idempotency_key()
            .build()
            .unwrap();
        let mut parts = head(Method::POST, "/orders", &[]);
        let judged = judge(&policy, &mut parts, None);
        let key = judged.generated_key.expect("a generated key");
        assert_eq!(parts.headers["x-idempotency-key"], key);
        assert_eq!(key.len(), 36, "a UUID");

        // A caller's key is never changed; a read gets none.
        let mut parts = head(Method::POST, "/orders", &[("idempotency-key", "mine-0001")]);
        assert!(judge(&policy, &mut parts, None).generated_key.is_none());
        assert_eq!(parts.headers["idempotency-key"], "mine-0001");
        assert!(!parts.headers.contains_key("x-idempotency-key"));
        let mut parts = head(Method::GET, "/orders", &[]);
        assert!(judge(&policy, &mut parts, None).generated_key.is_none());
        assert!(parts.headers.is_empty());

        // A rebuilt write keeps the intent's key rather than getting a new one.
        let intent = (
            HeaderName::from_static("x-idempotency-key"),
            HeaderValue::from_static("intent-0001"),
        );
        let mut parts = head(Method::POST, "/orders", &[]);
        let judged = judge(&policy, &mut parts, Some(intent));
        assert!(judged.idempotent && judged.generated_key.is_none());
        assert_eq!(parts.headers["x-idempotency-key"], "intent-0001");
    }

    #[test]
    fn the_first_key_header_is_where_keys_go_and_are_found() {
        let headers = KeyHeaders::new([
            HeaderName::from_static("x-request-key"),
            HeaderName::from_static("x-idempotency-key"),
        ])
        .unwrap();
        let policy = RetryPolicy::builder()
            .key_headers(headers)
            .ensure_idempotency_key()
            .build()
            .unwrap();
        let mut parts = head(Method::POST, "/orders", &[]);
        judge(&policy, &mut parts, None);
        assert!(parts.headers.contains_key("x-request-key"));
        assert!(!parts.headers.contains_key("x-idempotency-key"));
        let (name, _) = intent_key(&policy, &parts).unwrap();
        assert_eq!(name, "x-request-key");
        // `idempotency-key` is not among these headers: such a request is not keyed.
        let mut parts = head(Method::POST, "/orders", &[("idempotency-key", "k-0000001")]);
        assert!(judge(&policy, &mut parts, None).generated_key.is_some());
    }

    #[test]
    fn attempt_headers() {
        let mut parts = head(Method::POST, "/a.S/M", &[GRPC]);
        write_previous_attempts(&mut parts, true, 2);
        assert_eq!(parts.headers["grpc-previous-rpc-attempts"], "2");
        write_previous_attempts(&mut parts, false, 3);
        assert_eq!(parts.headers["x-previous-attempts"], "3");
        let mut none = head(Method::GET, "/x", &[]);
        write_previous_attempts(&mut none, false, 0);
        assert!(none.headers.is_empty(), "no attempt was sent before");
        remove_attempt_headers(&mut parts);
        assert!(!parts.headers.contains_key("grpc-previous-rpc-attempts"));
        assert!(!parts.headers.contains_key("x-previous-attempts"));
    }
}

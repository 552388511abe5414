//! What a write's flow reads of its request's headers, found in one pass over them: the
//! idempotency key's value, `grpc-timeout` and `content-length`.

use std::time::Duration;

use http::header::CONTENT_LENGTH;
use http::{HeaderMap, HeaderName, HeaderValue};
use reason_code::GRPC_TIMEOUT;

use crate::key::KeyError;

/// What [`HeadScan::of`] found.
#[derive(Debug)]
pub(crate) struct HeadScan<'h> {
    /// The one value of the key headers; [`KeyError::Repeated`] when they hold more than one.
    pub(crate) key: Result<Option<&'h HeaderValue>, KeyError>,
    /// The request's `grpc-timeout`, if it has a valid one.
    pub(crate) grpc_timeout: Option<Duration>,
    /// The request's `content-length`, if it declares one as a number.
    pub(crate) declared_length: Option<u64>,
}

/// Above this many header entries the scan looks each header up instead: a lookup hashes its
/// name once, a pass compares every name with each of the few the layer reads.
const SCAN_AT_MOST: usize = 16;

impl<'h> HeadScan<'h> {
    /// Reads `headers` for a write, `key_names` being the layer's key headers: a pass over a
    /// request's few headers instead of a hashed lookup (about a hundred instructions) for each
    /// key header, `grpc-timeout` and `content-length`.
    pub(crate) fn of(headers: &'h HeaderMap, key_names: &[HeaderName]) -> HeadScan<'h> {
        let timeout = |v: &HeaderValue| reason_code::parse_grpc_timeout(v).ok();
        let length = |v: &HeaderValue| v.to_str().ok()?.parse().ok();
        if headers.keys_len() > SCAN_AT_MOST {
            return HeadScan {
                key: find_key(headers, key_names),
                grpc_timeout: headers.get(GRPC_TIMEOUT).and_then(timeout),
                declared_length: headers.get(CONTENT_LENGTH).and_then(length),
            };
        }
        let mut key: Result<Option<&HeaderValue>, KeyError> = Ok(None);
        let (mut grpc_timeout, mut declared_length) = (None, None);
        // Every value of a key header counts (two are a repeated key); of the others, each
        // name's first value, as `HeaderMap::get` gives it. (An entry's further values follow
        // it and borrow the same name.)
        let mut last: *const HeaderName = std::ptr::null();
        for (name, value) in headers {
            let first = !std::ptr::eq(last, name);
            last = name;
            if key_names.contains(name) {
                key = match key {
                    Ok(None) => Ok(Some(value)),
                    _ => Err(KeyError::Repeated),
                };
            } else if !first {
                continue;
            } else if *name == CONTENT_LENGTH {
                declared_length = length(value);
            } else if *name == GRPC_TIMEOUT {
                grpc_timeout = timeout(value);
            }
        }
        HeadScan {
            key,
            grpc_timeout,
            declared_length,
        }
    }
}

/// What the handler's view of a write reads from its head, in one pass (by lookups past
/// [`SCAN_AT_MOST`] entries): the key's value (the first, which the layer accepted as the only
/// one), and the attempts the client says preceded it
/// ([`reason_code::previous_attempts`]' rule: `grpc-previous-rpc-attempts` first).
pub(crate) fn key_and_attempts<'h>(
    headers: &'h HeaderMap,
    key_names: &[HeaderName],
) -> (Option<&'h HeaderValue>, u32) {
    use reason_code::{GRPC_PREVIOUS_RPC_ATTEMPTS, X_PREVIOUS_ATTEMPTS};
    if headers.keys_len() > SCAN_AT_MOST {
        let key = key_names.iter().find_map(|n| headers.get(n));
        return (key, reason_code::previous_attempts(headers));
    }
    let (mut key, mut grpc, mut http) = (None, None, None);
    for (name, value) in headers {
        if key_names.contains(name) {
            key.get_or_insert(value);
        } else if *name == GRPC_PREVIOUS_RPC_ATTEMPTS {
            grpc.get_or_insert(value);
        } else if *name == X_PREVIOUS_ATTEMPTS {
            http.get_or_insert(value);
        }
    }
    let attempts = grpc
        .or(http)
        .map_or(0, reason_code::parse_previous_attempts);
    (key, attempts)
}

/// The one value of the headers `names` in `headers` (by lookups).
pub(crate) fn find_key<'h>(
    headers: &'h HeaderMap,
    names: &[HeaderName],
) -> Result<Option<&'h HeaderValue>, KeyError> {
    let mut found = None;
    for name in names {
        for value in headers.get_all(name) {
            if found.is_some() {
                return Err(KeyError::Repeated);
            }
            found = Some(value);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handler view's pass reads what lookups read, in short maps and long ones: the key,
    /// and the attempts by `reason_code::previous_attempts`' rule (gRPC's header first, a
    /// malformed count 0).
    #[test]
    fn key_and_attempts_agree_with_lookups() {
        let names = [
            HeaderName::from_static("x-idempotency-key"),
            HeaderName::from_static("idempotency-key"),
        ];
        let cases: [&[(&str, &str)]; 5] = [
            &[("idempotency-key", "k1")],
            &[("x-previous-attempts", "2"), ("x-idempotency-key", "k2")],
            &[
                ("x-previous-attempts", "2"),
                ("grpc-previous-rpc-attempts", "3"),
            ],
            &[
                ("grpc-previous-rpc-attempts", "x"),
                ("x-previous-attempts", "2"),
            ],
            &[("content-type", "text/plain")],
        ];
        for case in cases {
            for filler in [0, 20] {
                let mut h = HeaderMap::new();
                for i in 0..filler {
                    h.insert(
                        HeaderName::try_from(format!("x-filler-{i}")).unwrap(),
                        "v".parse().unwrap(),
                    );
                }
                for (n, v) in case {
                    h.append(HeaderName::from_static(n), v.parse().unwrap());
                }
                let looked_up = names.iter().find_map(|n| h.get(n));
                assert_eq!(
                    key_and_attempts(&h, &names),
                    (looked_up, reason_code::previous_attempts(&h)),
                    "{case:?} with {filler} more headers"
                );
            }
        }
    }

    /// The pass finds what lookups find: a key repeated in one header or across two, the first
    /// values of the others, maps short and long (looked up then).
    #[test]
    fn the_head_scan_agrees_with_lookups() {
        let names = [
            HeaderName::from_static("idempotency-key"),
            HeaderName::from_static("x-idempotency-key"),
        ];
        let candidates: [(&'static str, &'static str); 8] = [
            ("idempotency-key", "key-00001"),
            ("idempotency-key", "key-00002"),
            ("x-idempotency-key", "key-00003"),
            ("content-length", "12"),
            ("content-length", "x"),
            ("grpc-timeout", "5S"),
            ("grpc-timeout", "bad"),
            ("content-type", "application/json"),
        ];
        for headers in test_support::headers::combinations(&candidates) {
            let scan = HeadScan::of(&headers, &names);
            let what = format!("{headers:?}");
            assert_eq!(scan.key, find_key(&headers, &names), "{what}");
            assert_eq!(
                scan.grpc_timeout,
                headers
                    .get(GRPC_TIMEOUT)
                    .and_then(|v| reason_code::parse_grpc_timeout(v).ok()),
                "{what}"
            );
            assert_eq!(
                scan.declared_length,
                headers
                    .get(CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse().ok()),
                "{what}"
            );
        }
    }
}

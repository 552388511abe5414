//! What every fuzz target checks, one function per target.
//!
//! The targets in `fuzz_targets/` call these under libFuzzer (`cargo fuzz run <target>`); the
//! main workspace replays the committed corpora through the same functions as ordinary tests
//! (`tests/tests/fuzz_corpora.rs` includes this file), so a clean clone checks every corpus
//! input without cargo-fuzz. Each function must not panic on any input: a panic is a finding.

use std::time::{Duration, SystemTime};

use http::HeaderValue;
use idempotency_layer::store::{decode_record, encode_record};
use idempotency_layer::{validate_key, Scope};
use reason_code::{
    decode_grpc_message, encode_grpc_message, encode_grpc_timeout, parse_grpc_pushback,
    parse_grpc_status, parse_grpc_timeout, parse_retry_after, Code, Pushback,
};

/// The longest `grpc-timeout` the header can say: 99 999 999 hours.
const MAX_GRPC_TIMEOUT: Duration = Duration::from_secs(99_999_999 * 3600);

fn is_key_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// `x-idempotency-key` / `Idempotency-Key` values: `validate_key`, bare and as a structured-field
/// string. An accepted key is 8 to 64 characters of `[A-Za-z0-9_-]`, a valid header value, and
/// validates to itself again, bare or quoted.
pub fn key_header(data: &[u8]) {
    let result = validate_key(data);
    if let Ok(key) = result {
        assert!((8..=64).contains(&key.len()), "{key:?}");
        assert!(key.bytes().all(is_key_char), "{key:?}");
        assert!(HeaderValue::from_str(key).is_ok());
        assert_eq!(validate_key(key.as_bytes()), Ok(key));
        let quoted = format!("\"{key}\"");
        assert_eq!(validate_key(quoted.as_bytes()), Ok(key));
    }
    // The layer reads keys from header values: the same answer through one.
    if let Ok(v) = HeaderValue::from_bytes(data) {
        assert_eq!(validate_key(v.as_bytes()), result);
    }
}

/// Splits `data` after its first eight bytes: a number and a header value.
fn number_and_value(data: &[u8]) -> Option<(u64, HeaderValue)> {
    let (head, rest) = data.split_at_checked(8)?;
    let n = u64::from_le_bytes(head.try_into().ok()?);
    Some((n, HeaderValue::from_bytes(rest).ok()?))
}

/// `Retry-After` against a clock read from the input: delta-seconds are exact (saturating), an
/// HTTP-date never yields more than the time from `now` to that date.
pub fn retry_after(data: &[u8]) {
    let Some((secs, value)) = number_and_value(data) else {
        return;
    };
    // Any clock from 1970 to about year 2500.
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(secs % 16_725_225_600);
    let Ok(delay) = parse_retry_after(&value, now) else {
        return;
    };
    let s = value.to_str().expect("parsed values are ASCII").trim();
    if s.bytes().all(|b| b.is_ascii_digit()) {
        let expected = s.parse::<u64>().map_or(Duration::MAX, Duration::from_secs);
        assert_eq!(delay, expected, "{s:?}");
    } else {
        // Years past 9999 cannot be HTTP-dates, so the delay stays well below that.
        assert!(
            delay < Duration::from_secs(10_000 * 366 * 86_400),
            "{s:?}: {delay:?}"
        );
    }
}

/// `grpc-timeout`: parsing never panics and stays within what the header can say; encoding any
/// duration parses back to at most that duration (a deadline is never extended), and a parsed
/// value survives encode + parse exactly.
pub fn grpc_timeout(data: &[u8]) {
    if let Ok(v) = HeaderValue::from_bytes(data) {
        if let Ok(d) = parse_grpc_timeout(&v) {
            assert!(d <= MAX_GRPC_TIMEOUT, "{v:?}: {d:?}");
            assert_eq!(parse_grpc_timeout(&encode_grpc_timeout(d)), Ok(d), "{v:?}");
        }
    }
    if let Some(head) = data.get(..16) {
        let secs = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let nanos = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) % 1_000_000_000;
        let d = Duration::new(secs, nanos);
        let back = parse_grpc_timeout(&encode_grpc_timeout(d)).expect("an encoding parses");
        assert!(back <= d, "{d:?} encoded as {back:?}");
        assert!(back <= MAX_GRPC_TIMEOUT);
    }
}

/// `grpc-status` and `grpc-message`: a status is a code (0 to 16 exactly, anything larger
/// UNKNOWN); a message decodes without panicking and survives encode + decode unchanged.
pub fn grpc_status_message(data: &[u8]) {
    if let Ok(v) = HeaderValue::from_bytes(data) {
        if let Ok(code) = parse_grpc_status(&v) {
            let n: u64 = v.to_str().expect("ASCII").trim().parse().expect("digits");
            if n <= 16 {
                assert_eq!(code as u64, n);
            } else {
                assert_eq!(code, Code::Unknown);
            }
        }
        let message = decode_grpc_message(&v);
        assert_eq!(decode_grpc_message(&encode_grpc_message(&message)), message);
    }
    let text = String::from_utf8_lossy(data);
    let encoded = encode_grpc_message(&text);
    assert!(
        encoded.to_str().is_ok(),
        "an encoded message is visible ASCII"
    );
    assert_eq!(decode_grpc_message(&encoded), text);
}

/// `grpc-retry-pushback-ms`: a signed number of milliseconds; negative (non-zero) is "stop",
/// anything else the exact number of milliseconds.
pub fn grpc_pushback(data: &[u8]) {
    let Ok(v) = HeaderValue::from_bytes(data) else {
        return;
    };
    let Ok(pushback) = parse_grpc_pushback(&v) else {
        return;
    };
    let s = v.to_str().expect("ASCII").trim();
    let (negative, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let n: u64 = digits.parse().expect("digits");
    match pushback {
        Pushback::Stop => assert!(negative && n > 0, "{s:?}"),
        Pushback::After(d) => {
            assert!(!negative || n == 0, "{s:?}");
            assert_eq!(d, Duration::from_millis(n));
        }
        other => panic!("{s:?} parsed as a pushback this check does not know: {other:?}"),
    }
}

/// Splits `data` into a (tenant, method, key) triple at the two cut points its first two bytes
/// choose (UTF-8 replaced where invalid).
fn triple(data: &[u8]) -> Option<(String, String, String)> {
    let (&[a, b], rest) = data.split_first_chunk::<2>()?;
    let (a, b) = (
        usize::from(a) % (rest.len() + 1),
        usize::from(b) % (rest.len() + 1),
    );
    let (a, b) = (a.min(b), a.max(b));
    let part = |p: &[u8]| String::from_utf8_lossy(p).into_owned();
    Some((part(&rest[..a]), part(&rest[a..b]), part(&rest[b..])))
}

/// Reads an encoding back into its three parts, or `None` if it is not exactly three parts.
fn decode_scope(mut bytes: &[u8]) -> Option<[Vec<u8>; 3]> {
    let mut parts: [Vec<u8>; 3] = Default::default();
    for part in &mut parts {
        let (len, rest) = bytes.split_first_chunk::<8>()?;
        let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
        let (value, rest) = rest.split_at_checked(len)?;
        *part = value.to_vec();
        bytes = rest;
    }
    bytes.is_empty().then_some(parts)
}

/// Scope encoding: the encoding of any (tenant, method, key) decodes back to exactly those three
/// parts (so it is injective: no two scopes share an encoding), and two different triples cut
/// from the same bytes get different store keys.
pub fn scope_encoding(data: &[u8]) {
    let Some((tenant, method, key)) = triple(data) else {
        return;
    };
    let scope = Scope::new(&tenant, &method, &key);
    let encoded = scope.encode();
    let parts = decode_scope(&encoded).expect("an encoding decodes");
    assert_eq!(parts[0], tenant.as_bytes());
    assert_eq!(parts[1], method.as_bytes());
    assert_eq!(parts[2], key.as_bytes());
    assert_eq!(scope.key(), Scope::new(&tenant, &method, &key).key());
    // The same text cut elsewhere: a different scope, a different store key.
    let moved = format!("{method}{key}");
    let other = Scope::new(&tenant, "", &moved);
    assert_eq!(other.encode() == encoded, method.is_empty());
    assert_eq!(other.key() == scope.key(), method.is_empty());
}

/// Stored records (the Redis / PostgreSQL entry format): decoding any bytes never panics, and a
/// record that decodes encodes and decodes back to itself.
pub fn record_decode(data: &[u8]) {
    if let Ok(record) = decode_record(data) {
        let again = encode_record(&record).expect("a decoded record encodes");
        assert_eq!(decode_record(&again).expect("its encoding decodes"), record);
    }
}

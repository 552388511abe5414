//! Parsers and encoders for the headers both layers read: `grpc-status`, `grpc-message`,
//! `grpc-timeout`, `grpc-retry-pushback-ms` and `Retry-After`.
//!
//! Every parser takes untrusted input, never panics, and returns a typed [`HeaderError`] that
//! says what was wrong, so a caller can log it and treat the header as absent.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use percent_encoding::{percent_decode, utf8_percent_encode, AsciiSet, CONTROLS};

use crate::Code;

/// `grpc-status`: the gRPC status code of a response (headers of a trailers-only response, or
/// trailers).
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`: the percent-encoded status message.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-timeout`: the time the caller allows for the call.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
/// `grpc-retry-pushback-ms`: server pushback (gRFC A6); negative means "do not retry".
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// `grpc-previous-rpc-attempts`: how many attempts preceded this one (gRFC A6).
pub const GRPC_PREVIOUS_RPC_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");
/// `x-previous-attempts`: the HTTP equivalent of `grpc-previous-rpc-attempts`.
pub const X_PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static("x-previous-attempts");
/// `x-reason-code`: the default business reason-code header.
pub const X_REASON_CODE: HeaderName = HeaderName::from_static("x-reason-code");
/// `x-idempotency-key`: the default idempotency key header.
pub const X_IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");
/// `idempotency-key`: the IETF httpapi draft's idempotency key header (a structured-field string).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `idempotent-replayed`: set to `true` on a response replayed from a record.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// `idempotent-body-omitted`: set to `true` on a replay whose body was too large to record.
pub const IDEMPOTENT_BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");
/// `idempotency-seen-in-flight`: set to `?1` (a structured-field true) by a client's retry layer
/// on every attempt of a call after one was answered that its key was in flight
/// ([`IDEMPOTENCY_IN_FLIGHT`](crate::IDEMPOTENCY_IN_FLIGHT)). The server then knows a write with
/// this key is in flight somewhere, as a duplicate that waited for it knows, and never runs it
/// unprotected when its store is down (`fail_open`). A client can only make a server more
/// careful with it, never less. See [`says_seen_in_flight`].
pub const IDEMPOTENCY_SEEN_IN_FLIGHT: HeaderName =
    HeaderName::from_static("idempotency-seen-in-flight");

/// True when `headers` say the call was told its key was in flight
/// ([`IDEMPOTENCY_SEEN_IN_FLIGHT`]: `?1`, or `true` as written by hand). Any other value, or none,
/// says nothing.
///
/// ```
/// use http::{HeaderMap, HeaderValue};
/// use reason_code::{says_seen_in_flight, IDEMPOTENCY_SEEN_IN_FLIGHT};
///
/// let mut h = HeaderMap::new();
/// assert!(!says_seen_in_flight(&h));
/// h.insert(IDEMPOTENCY_SEEN_IN_FLIGHT, HeaderValue::from_static("?1"));
/// assert!(says_seen_in_flight(&h));
/// ```
pub fn says_seen_in_flight(headers: &HeaderMap) -> bool {
    headers
        .get_all(IDEMPOTENCY_SEEN_IN_FLIGHT)
        .iter()
        .any(|v| matches!(v.as_bytes().trim_ascii(), b"?1" | b"true"))
}

/// Why a header value could not be parsed.
///
/// The value itself is kept (shortened to 64 bytes) so the message can say what was received.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The value is empty or contains bytes that are not visible ASCII.
    #[error("{header}: value is empty or not visible ASCII; send a plain ASCII value")]
    NotAscii {
        /// The header's name.
        header: &'static str,
    },
    /// The value is not a number of the expected form.
    #[error("{header}: {value:?} is not {expected}")]
    Malformed {
        /// The header's name.
        header: &'static str,
        /// The value received (shortened).
        value: String,
        /// What the header must contain.
        expected: &'static str,
    },
    /// The header is repeated where only one value is allowed.
    #[error("{header}: the header is repeated; send it once")]
    Repeated {
        /// The header's name.
        header: &'static str,
    },
}

fn shorten(s: &str) -> String {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn ascii<'a>(header: &'static str, v: &'a HeaderValue) -> Result<&'a str, HeaderError> {
    match v.to_str() {
        Ok(s) if !s.trim().is_empty() => Ok(s.trim()),
        _ => Err(HeaderError::NotAscii { header }),
    }
}

fn malformed(header: &'static str, value: &str, expected: &'static str) -> HeaderError {
    HeaderError::Malformed {
        header,
        value: shorten(value),
        expected,
    }
}

/// Returns the single value of `name`, `Ok(None)` when absent, or an error when repeated.
pub fn single<'a>(
    headers: &'a HeaderMap,
    name: &'static str,
) -> Result<Option<&'a HeaderValue>, HeaderError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(HeaderError::Repeated { header: name });
    }
    Ok(first)
}

/// True when a `content-type` says gRPC (`application/grpc`, `application/grpc+proto`, ...).
///
/// ```
/// use http::{header::CONTENT_TYPE, HeaderMap, HeaderValue};
///
/// let mut h = HeaderMap::new();
/// h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc+proto"));
/// assert!(reason_code::is_grpc(&h));
/// ```
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(is_grpc_content_type)
}

/// True when a `content-type` value says gRPC: [`is_grpc`] for a value already at hand (one
/// found while scanning a request's headers, say).
///
/// ```
/// use http::HeaderValue;
///
/// assert!(reason_code::is_grpc_content_type(&HeaderValue::from_static("application/grpc")));
/// assert!(!reason_code::is_grpc_content_type(&HeaderValue::from_static("application/grpc-web")));
/// ```
pub fn is_grpc_content_type(value: &HeaderValue) -> bool {
    let b = value.as_bytes();
    b.len() >= 16
        && b[..16].eq_ignore_ascii_case(b"application/grpc")
        && matches!(b.get(16), None | Some(b'+') | Some(b';'))
}

/// Parses a `grpc-status` value: a decimal number; numbers outside 0..=16 are UNKNOWN.
///
/// ```
/// use http::HeaderValue;
/// use reason_code::{parse_grpc_status, Code};
///
/// assert_eq!(parse_grpc_status(&HeaderValue::from_static("14")), Ok(Code::Unavailable));
/// assert!(parse_grpc_status(&HeaderValue::from_static("fourteen")).is_err());
/// ```
pub fn parse_grpc_status(v: &HeaderValue) -> Result<Code, HeaderError> {
    const H: &str = "grpc-status";
    let s = ascii(H, v)?;
    if s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(H, s, "a decimal status code"));
    }
    // At most 10 digits: fits u64, and anything over 16 is UNKNOWN.
    let n: u64 = s
        .parse()
        .map_err(|_| malformed(H, s, "a decimal status code"))?;
    Ok(if n <= 16 {
        Code::from_i32(n as i32)
    } else {
        Code::Unknown
    })
}

/// Decodes a `grpc-message` value (percent-encoded UTF-8); invalid UTF-8 is replaced, never an
/// error, as the gRPC spec asks of receivers.
///
/// ```
/// use http::HeaderValue;
///
/// let v = HeaderValue::from_static("out%20of%20stock%3A%20b1");
/// assert_eq!(reason_code::decode_grpc_message(&v), "out of stock: b1");
/// ```
pub fn decode_grpc_message(v: &HeaderValue) -> Cow<'_, str> {
    percent_decode(v.as_bytes()).decode_utf8_lossy()
}

/// The bytes gRPC requires to be percent-encoded in `grpc-message`: everything outside
/// printable ASCII, and `%` itself.
const GRPC_MESSAGE_ESCAPES: &AsciiSet = &CONTROLS.add(b'%');

/// Encodes a status message as a `grpc-message` value.
///
/// ```
/// let v = reason_code::encode_grpc_message("write operations require x-idempotency-key");
/// assert_eq!(reason_code::decode_grpc_message(&v), "write operations require x-idempotency-key");
/// let v = reason_code::encode_grpc_message("100% sure: ключ\r\n");
/// assert_eq!(reason_code::decode_grpc_message(&v), "100% sure: ключ\r\n");
/// ```
pub fn encode_grpc_message(message: &str) -> HeaderValue {
    let encoded: String = utf8_percent_encode(message, GRPC_MESSAGE_ESCAPES).collect();
    // Every byte is now printable ASCII, which is always a valid header value.
    HeaderValue::try_from(encoded).unwrap_or_else(|_| HeaderValue::from_static("invalid message"))
}

/// Parses a `grpc-timeout` value: 1 to 8 ASCII digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
///
/// ```
/// use std::time::Duration;
/// use http::HeaderValue;
/// use reason_code::parse_grpc_timeout;
///
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("250m")), Ok(Duration::from_millis(250)));
/// assert_eq!(parse_grpc_timeout(&HeaderValue::from_static("2H")), Ok(Duration::from_secs(7200)));
/// assert!(parse_grpc_timeout(&HeaderValue::from_static("123456789S")).is_err());
/// ```
pub fn parse_grpc_timeout(v: &HeaderValue) -> Result<Duration, HeaderError> {
    const H: &str = "grpc-timeout";
    const EXPECTED: &str = "1 to 8 digits followed by one of the units H, M, S, m, u, n";
    let s = ascii(H, v)?;
    let (digits, unit) = s.split_at(s.len() - 1);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(H, s, EXPECTED));
    }
    let n: u64 = digits.parse().map_err(|_| malformed(H, s, EXPECTED))?;
    Ok(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(malformed(H, s, EXPECTED)),
    })
}

/// Encodes a duration as a `grpc-timeout` value in the finest unit whose count fits 8 digits,
/// rounding down (a deadline must never be extended by rounding). Durations beyond what the
/// header can say (99 999 999 hours) are capped.
///
/// ```
/// use std::time::Duration;
/// use reason_code::encode_grpc_timeout;
///
/// assert_eq!(encode_grpc_timeout(Duration::from_millis(1500)), "1500000u");
/// assert_eq!(encode_grpc_timeout(Duration::from_secs(3600 * 24 * 365)), "31536000S");
/// ```
pub fn encode_grpc_timeout(d: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let nanos = d.as_nanos();
    let units: [(u128, &str); 6] = [
        (1, "n"),
        (1_000, "u"),
        (1_000_000, "m"),
        (1_000_000_000, "S"),
        (60_000_000_000, "M"),
        (3_600_000_000_000, "H"),
    ];
    for (per, unit) in units {
        let n = nanos / per;
        if n <= MAX {
            return HeaderValue::try_from(format!("{n}{unit}"))
                .unwrap_or_else(|_| HeaderValue::from_static("0n"));
        }
    }
    HeaderValue::from_static("99999999H")
}

/// What a server's pushback asks of the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Pushback {
    /// Wait this long before the next attempt (replaces the computed backoff).
    After(Duration),
    /// Do not retry (a negative `grpc-retry-pushback-ms`).
    Stop,
}

/// Parses `grpc-retry-pushback-ms`: a signed decimal number of milliseconds; negative means stop.
///
/// ```
/// use std::time::Duration;
/// use http::HeaderValue;
/// use reason_code::{parse_grpc_pushback, Pushback};
///
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("150")), Ok(Pushback::After(Duration::from_millis(150))));
/// assert_eq!(parse_grpc_pushback(&HeaderValue::from_static("-1")), Ok(Pushback::Stop));
/// assert!(parse_grpc_pushback(&HeaderValue::from_static("1.5")).is_err());
/// ```
pub fn parse_grpc_pushback(v: &HeaderValue) -> Result<Pushback, HeaderError> {
    const H: &str = "grpc-retry-pushback-ms";
    const EXPECTED: &str = "a signed decimal number of milliseconds";
    let s = ascii(H, v)?;
    let (neg, digits) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 19 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(H, s, EXPECTED));
    }
    let n: u64 = digits.parse().map_err(|_| malformed(H, s, EXPECTED))?;
    Ok(if neg && n > 0 {
        Pushback::Stop
    } else {
        Pushback::After(Duration::from_millis(n))
    })
}

/// Parses `Retry-After` (RFC 9110 §10.2.3): delta-seconds, or an HTTP-date taken relative to
/// `now` (a date in the past means "now").
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::HeaderValue;
/// use reason_code::parse_retry_after;
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_770);
/// assert_eq!(parse_retry_after(&HeaderValue::from_static("1"), now), Ok(Duration::from_secs(1)));
/// let date = HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT");
/// assert_eq!(parse_retry_after(&date, now), Ok(Duration::from_secs(7)));
/// assert!(parse_retry_after(&HeaderValue::from_static("soon"), now).is_err());
/// ```
pub fn parse_retry_after(v: &HeaderValue, now: SystemTime) -> Result<Duration, HeaderError> {
    const H: &str = "retry-after";
    const EXPECTED: &str = "delta-seconds or an HTTP-date";
    let s = ascii(H, v)?;
    if s.bytes().all(|b| b.is_ascii_digit()) {
        // Saturate absurdly long values; the caller's maximum pushback bounds them anyway.
        return Ok(match s.parse::<u64>() {
            Ok(n) => Duration::from_secs(n),
            Err(_) => Duration::MAX,
        });
    }
    let when = httpdate::parse_http_date(s).map_err(|_| malformed(H, s, EXPECTED))?;
    Ok(when.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hv(s: &'static str) -> HeaderValue {
        HeaderValue::from_static(s)
    }

    #[test]
    fn grpc_status_bad_input_is_an_error() {
        for bad in ["", " ", "-1", "1.0", "0x1", "99999999999999999999", "١"] {
            let v = HeaderValue::from_bytes(bad.as_bytes()).unwrap();
            assert!(parse_grpc_status(&v).is_err(), "{bad:?}");
        }
        assert_eq!(parse_grpc_status(&hv("17")), Ok(Code::Unknown));
        assert_eq!(parse_grpc_status(&hv("4294967296")), Ok(Code::Unknown));
        assert_eq!(parse_grpc_status(&hv(" 0 ")), Ok(Code::Ok));
    }

    #[test]
    fn grpc_timeout_units_and_limits() {
        let cases = [
            ("1H", Duration::from_secs(3600)),
            ("1M", Duration::from_secs(60)),
            ("1S", Duration::from_secs(1)),
            ("1m", Duration::from_millis(1)),
            ("1u", Duration::from_micros(1)),
            ("1n", Duration::from_nanos(1)),
            ("99999999H", Duration::from_secs(99_999_999 * 3600)),
            ("00000000n", Duration::ZERO),
        ];
        for (s, d) in cases {
            assert_eq!(parse_grpc_timeout(&hv(s)), Ok(d), "{s}");
        }
        for bad in [
            "",
            "S",
            "1",
            "1s",
            "1h",
            "-1S",
            "1.5S",
            "123456789m",
            "1 S",
            "1SS",
        ] {
            let v = HeaderValue::from_bytes(bad.as_bytes()).unwrap();
            let err = parse_grpc_timeout(&v).unwrap_err();
            assert!(err.to_string().contains("grpc-timeout"), "{err}");
        }
    }

    #[test]
    fn pushback_forms() {
        assert_eq!(
            parse_grpc_pushback(&hv("0")),
            Ok(Pushback::After(Duration::ZERO))
        );
        assert_eq!(
            parse_grpc_pushback(&hv("-0")),
            Ok(Pushback::After(Duration::ZERO))
        );
        assert_eq!(parse_grpc_pushback(&hv("-250")), Ok(Pushback::Stop));
        for bad in ["", "-", "+", "abc", "1e3", "99999999999999999999"] {
            let v = HeaderValue::from_bytes(bad.as_bytes()).unwrap();
            assert!(parse_grpc_pushback(&v).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        let past = hv("Sun, 06 Nov 1994 08:49:30 GMT");
        assert_eq!(parse_retry_after(&past, now), Ok(Duration::ZERO));
        assert_eq!(
            parse_retry_after(&hv("120"), now),
            Ok(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after(&hv("99999999999999999999999"), now),
            Ok(Duration::MAX)
        );
        for bad in ["-1", "1.5", "tomorrow", "Sun, 06 Nov 1994"] {
            assert!(parse_retry_after(&hv(bad), now).is_err(), "{bad}");
        }
        let non_ascii = HeaderValue::from_bytes(b"\xff1").unwrap();
        assert_eq!(
            parse_retry_after(&non_ascii, now),
            Err(HeaderError::NotAscii {
                header: "retry-after"
            })
        );
    }

    #[test]
    fn content_type_detection() {
        let check = |ct: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::CONTENT_TYPE, hv(ct));
            is_grpc(&h)
        };
        assert!(check("application/grpc"));
        assert!(check("application/grpc+proto"));
        assert!(check("Application/GRPC;charset=utf-8"));
        assert!(!check("application/grpc-web"));
        assert!(!check("application/json"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn repeated_header_is_reported() {
        let mut h = HeaderMap::new();
        h.append("x-idempotency-key", hv("a"));
        assert_eq!(single(&h, "x-idempotency-key").unwrap(), Some(&hv("a")));
        h.append("x-idempotency-key", hv("b"));
        assert!(matches!(
            single(&h, "x-idempotency-key"),
            Err(HeaderError::Repeated { .. })
        ));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                let _ = parse_grpc_status(&v);
                let _ = parse_grpc_timeout(&v);
                let _ = parse_grpc_pushback(&v);
                let _ = parse_retry_after(&v, SystemTime::now());
                let _ = decode_grpc_message(&v);
            }
        }

        #[test]
        fn grpc_timeout_encoding_round_trips_without_growing(nanos in 0u64..u64::MAX) {
            let d = Duration::from_nanos(nanos);
            let parsed = parse_grpc_timeout(&encode_grpc_timeout(d)).unwrap();
            prop_assert!(parsed <= d);
            // Rounding down loses less than one unit of the chosen resolution, and a coarser unit
            // is chosen only past 10^8 finer units: the loss stays under 0.001%.
            prop_assert!(d - parsed <= d / 100_000 + Duration::from_nanos(1));
        }

        #[test]
        fn grpc_message_round_trips(s in ".*") {
            let v = encode_grpc_message(&s);
            prop_assert_eq!(decode_grpc_message(&v), s);
        }
    }
}

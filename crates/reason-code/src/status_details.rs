//! `grpc-status-details-bin`: the `google.rpc.Status` a gRPC server may attach to a failure, and
//! the one detail a retrying client reads from it, `google.rpc.RetryInfo`.
//!
//! The decoder is a minimal protobuf reader for the three messages involved (`Status`, `Any`,
//! `RetryInfo` with its `Duration`): no code generation and no protobuf dependency.

use std::time::Duration;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::Engine as _;
use http::HeaderValue;

use crate::headers::HeaderError;

/// The header carrying a serialized `google.rpc.Status` (base64, padded or not).
pub const GRPC_STATUS_DETAILS_BIN: &str = "grpc-status-details-bin";

const RETRY_INFO_TYPE: &str = "type.googleapis.com/google.rpc.RetryInfo";
const EXPECTED: &str = "a base64 google.rpc.Status";

/// gRPC's `-bin` headers are base64 with or without padding.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The `retry_delay` of the `google.rpc.RetryInfo` detail in a `grpc-status-details-bin` value:
/// `Ok(None)` when the status carries no such detail. A delay too large for a `Duration` is
/// `Duration::MAX`; a negative one, or a value that is not a base64 `google.rpc.Status`, is an
/// error.
///
/// Google APIs send it with RESOURCE_EXHAUSTED and UNAVAILABLE to say when to come back
/// (AIP-194); a retrying client honours it as server pushback.
///
/// ```
/// use std::time::Duration;
/// use http::HeaderValue;
/// use reason_code::parse_grpc_retry_info;
///
/// // google.rpc.Status { code: 8, message: "slow down", details: [RetryInfo { retry_delay: 2 s }] }
/// let v = HeaderValue::from_static(
///     "CAgSCXNsb3cgZG93bhowCih0eXBlLmdvb2dsZWFwaXMuY29tL2dvb2dsZS5ycGMuUmV0cnlJbmZvEgQKAggC",
/// );
/// assert_eq!(parse_grpc_retry_info(&v), Ok(Some(Duration::from_secs(2))));
/// assert!(parse_grpc_retry_info(&HeaderValue::from_static("%%")).is_err());
/// ```
pub fn parse_grpc_retry_info(v: &HeaderValue) -> Result<Option<Duration>, HeaderError> {
    let malformed = || HeaderError::Malformed {
        header: GRPC_STATUS_DETAILS_BIN,
        value: String::from_utf8_lossy(&v.as_bytes()[..v.len().min(64)]).into_owned(),
        expected: EXPECTED,
    };
    let bytes = BASE64
        .decode(v.as_bytes().trim_ascii())
        .map_err(|_| malformed())?;
    retry_delay_of_status(&bytes).ok_or_else(malformed)
}

/// `google.rpc.Status`: `details` (field 3) are `Any`s; the first `RetryInfo` among them.
fn retry_delay_of_status(status: &[u8]) -> Option<Option<Duration>> {
    let mut found = None;
    for field in Fields(status) {
        let (number, value) = field?;
        if let (3, Value::Bytes(any)) = (number, value) {
            if found.is_none() {
                found = retry_info_of_any(any)?;
            }
        }
    }
    Some(found)
}

/// `google.protobuf.Any`: `type_url` (1) and `value` (2). `Some(None)` for another type.
fn retry_info_of_any(any: &[u8]) -> Option<Option<Duration>> {
    let mut type_url = None;
    let mut value: &[u8] = &[];
    for field in Fields(any) {
        match field? {
            (1, Value::Bytes(b)) => type_url = Some(b),
            (2, Value::Bytes(b)) => value = b,
            _ => {}
        }
    }
    if type_url != Some(RETRY_INFO_TYPE.as_bytes()) {
        return Some(None);
    }
    // `RetryInfo`: `retry_delay` (1), a `google.protobuf.Duration`; absent means zero.
    let mut delay = Duration::ZERO;
    for field in Fields(value) {
        if let (1, Value::Bytes(d)) = field? {
            delay = duration(d)?;
        }
    }
    Some(Some(delay))
}

/// `google.protobuf.Duration`: `seconds` (1, int64) and `nanos` (2, int32), never negative here.
fn duration(d: &[u8]) -> Option<Duration> {
    let (mut seconds, mut nanos) = (0i64, 0i32);
    for field in Fields(d) {
        match field? {
            (1, Value::Varint(n)) => seconds = n as i64,
            (2, Value::Varint(n)) => nanos = n as i64 as i32,
            _ => {}
        }
    }
    if seconds < 0 || !(0..1_000_000_000).contains(&nanos) {
        return None;
    }
    Some(Duration::from_secs(seconds as u64).saturating_add(Duration::from_nanos(nanos as u64)))
}

/// A field's value, by wire type (fixed-size ones are skipped).
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a protobuf message, in order; `None` for bytes that are not a message.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Option<(u64, Value<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.read_field();
        if field.is_none() {
            // Malformed: stop after reporting it once.
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut n = 0u64;
        for i in 0..10 {
            let (&b, rest) = self.0.split_first()?;
            self.0 = rest;
            n |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some(n);
            }
        }
        None
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(taken)
    }

    fn read_field(&mut self) -> Option<(u64, Value<'a>)> {
        let key = self.varint()?;
        let value = match key & 0x7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                Value::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            _ => return None,
        };
        Some((key >> 3, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &'static str) -> Result<Option<Duration>, HeaderError> {
        parse_grpc_retry_info(&HeaderValue::from_static(s))
    }

    #[test]
    fn retry_info_in_a_status() {
        // RetryInfo { retry_delay: 1 s 500 000 000 ns }, padded.
        assert_eq!(
            parse(
                "CA4aNgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxIKCggIARCAyrXuAQ=="
            ),
            Ok(Some(Duration::from_millis(1_500)))
        );
        // The same, unpadded.
        assert_eq!(
            parse("CA4aNgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxIKCggIARCAyrXuAQ"),
            Ok(Some(Duration::from_millis(1_500)))
        );
        // RetryInfo with an empty delay: zero.
        assert_eq!(
            parse("CAgaLgoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLlJldHJ5SW5mbxICCgA="),
            Ok(Some(Duration::ZERO))
        );
        // A DebugInfo only: no delay.
        assert_eq!(
            parse("CAgaLAoodHlwZS5nb29nbGVhcGlzLmNvbS9nb29nbGUucnBjLkRlYnVnSW5mbxIA"),
            Ok(None)
        );
        // A status with no details at all (code 14).
        assert_eq!(parse("CA4="), Ok(None));
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for s in ["%%%", "////", "CA", "Gg==", "GgUKAw=="] {
            let r = parse(s);
            assert!(r.is_err() || r == Ok(None), "{s}: {r:?}");
        }
        // A truncated length-delimited field.
        assert!(parse("GgUKAw==").is_err());
    }
}

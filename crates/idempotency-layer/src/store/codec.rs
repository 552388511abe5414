//! The encoding of a [`Record`] in a shared store: postcard over a versioned, serde-derived
//! struct (headers as ordered `(name, value)` pairs, so order and repeated names survive).

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::{Fingerprint, Record, StoreError};

/// The encoding version written first; a record of another version is reported as corrupt.
const VERSION: u8 = 1;

#[derive(Serialize, Deserialize)]
struct Stored {
    version: u8,
    fingerprint: [u8; 32],
    status: u16,
    headers: Vec<(String, Bytes)>,
    body: Bytes,
    body_omitted: bool,
    trailers: Option<Vec<(String, Bytes)>>,
}

fn pairs(map: &HeaderMap) -> Vec<(String, Bytes)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

fn map(pairs: Vec<(String, Bytes)>) -> Result<HeaderMap, StoreError> {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| StoreError::Corrupt(format!("record header name {name:?}: {e}")))?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|e| StoreError::Corrupt(format!("record header {name}: {e}")))?;
        map.append(name, value);
    }
    Ok(map)
}

/// Encodes `record` for the store.
pub(crate) fn encode(record: &Record) -> Result<Vec<u8>, StoreError> {
    let stored = Stored {
        version: VERSION,
        fingerprint: record.fingerprint.0,
        status: record.status.as_u16(),
        headers: pairs(&record.headers),
        body: record.body.clone(),
        body_omitted: record.body_omitted,
        trailers: record.trailers.as_deref().map(pairs),
    };
    postcard::to_allocvec(&stored)
        .map_err(|e| StoreError::Backend(format!("encoding a record: {e}").into()))
}

/// Decodes what [`encode`] wrote; anything else is [`StoreError::Corrupt`].
pub(crate) fn decode(bytes: &[u8]) -> Result<Record, StoreError> {
    let stored: Stored = postcard::from_bytes(bytes)
        .map_err(|e| StoreError::Corrupt(format!("record does not decode: {e}")))?;
    if stored.version != VERSION {
        return Err(StoreError::Corrupt(format!(
            "record encoding version {} (this build reads {VERSION})",
            stored.version
        )));
    }
    let status = StatusCode::from_u16(stored.status)
        .map_err(|_| StoreError::Corrupt(format!("record status {}", stored.status)))?;
    Ok(Record {
        fingerprint: Fingerprint(stored.fingerprint),
        status,
        headers: map(stored.headers)?,
        body: stored.body,
        body_omitted: stored.body_omitted,
        trailers: stored.trailers.map(map).transpose()?.map(Box::new),
    })
}

/// A fingerprint read back from a store: exactly 32 bytes, else corrupt.
pub(crate) fn fingerprint(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    <[u8; 32]>::try_from(bytes)
        .map(Fingerprint)
        .map_err(|_| StoreError::Corrupt(format!("fingerprint of {} bytes, not 32", bytes.len())))
}

/// A fresh fencing token: 128 random bits, unique across instances.
pub(crate) fn new_token() -> super::Token {
    super::Token(uuid::Uuid::new_v4().as_u128())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_order_repeats_binary_and_trailers() {
        let mut headers = HeaderMap::new();
        headers.append("x-b", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        headers.append("x-b", HeaderValue::from_static("3"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let record = Record {
            fingerprint: Fingerprint([9; 32]),
            status: StatusCode::ACCEPTED,
            headers,
            body: Bytes::from_static(b"\x00\xffbody"),
            body_omitted: false,
            trailers: Some(Box::new(trailers)),
        };
        let back = decode(&encode(&record).unwrap()).unwrap();
        assert_eq!(back, record);
        let names: Vec<_> = back.headers.iter().map(|(n, v)| (n.as_str(), v)).collect();
        assert_eq!(names.len(), 3);
    }

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        for garbage in [&b""[..], b"\xff\xff\xff\xff\xff", b"garbage", &[1u8; 40]] {
            assert!(matches!(decode(garbage), Err(StoreError::Corrupt(_))));
        }
        assert!(matches!(fingerprint(b"short"), Err(StoreError::Corrupt(_))));
    }
}

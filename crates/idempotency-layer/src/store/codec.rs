//! The encoding of a [`Record`] in a shared store: postcard over a versioned, serde-derived
//! struct (headers as ordered `(name, value)` pairs, so order and repeated names survive).
//!
//! Versions evolve by appending: version N+1 writes version N's fields, in order, then its own.
//! A reader of version N decodes any version from 1 to [`LAST_COMPATIBLE`] by reading the fields
//! it knows and leaving the rest, so instances of two versions can share a store during a
//! rolling upgrade, whichever writes the record. A change that cannot be made by appending takes
//! a version past `LAST_COMPATIBLE`, which older readers report as corrupt (and refuse to run
//! anything for) rather than misread.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::{Fingerprint, Record, StoreError};

/// The encoding version this build writes first.
const VERSION: u8 = 1;

/// The last version whose fields start with this one's: any version from 1 to this is read.
const LAST_COMPATIBLE: u8 = 127;

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
    if !(1..=LAST_COMPATIBLE).contains(&stored.version) {
        return Err(StoreError::Corrupt(format!(
            "record encoding version {} (this build reads 1 to {LAST_COMPATIBLE}: a newer \
             version that changed the encoding wrote it; upgrade this instance)",
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
        replay_head: Default::default(),
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
            replay_head: Default::default(),
        };
        let back = decode(&encode(&record).unwrap()).unwrap();
        assert_eq!(back, record);
        let names: Vec<_> = back.headers.iter().map(|(n, v)| (n.as_str(), v)).collect();
        assert_eq!(names.len(), 3);
    }

    /// A record of version 1 as every build since has written it (a fixed fixture: if this
    /// changes, records already stored no longer decode).
    const V1_RECORD: &[u8] = &[
        1, // version
        7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
        7, 7, // fingerprint
        201, 1, // status 201, varint
        1, // one header
        12, b'c', b'o', b'n', b't', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 4, b'j', b's',
        b'o', b'n', // content-type: json
        2, b'h', b'i', // body
        0,    // body not omitted
        0,    // no trailers
    ];

    fn v1_record() -> Record {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("json"));
        Record {
            fingerprint: Fingerprint([7; 32]),
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"hi"),
            body_omitted: false,
            trailers: None,
            replay_head: Default::default(),
        }
    }

    #[test]
    fn a_record_of_each_version_decodes() {
        // This build writes version 1, byte for byte as the fixture.
        assert_eq!(encode(&v1_record()).unwrap(), V1_RECORD);
        assert_eq!(decode(V1_RECORD).unwrap(), v1_record());
        // A later version appends fields: this build reads what it knows and leaves the rest.
        let mut next = V1_RECORD.to_vec();
        next[0] = 2;
        next.extend_from_slice(&[3, 0xde, 0xad, 0xbe, 1]);
        assert_eq!(decode(&next).unwrap(), v1_record());
        // A version that changed the encoding is refused as corrupt, never misread.
        let mut breaking = V1_RECORD.to_vec();
        breaking[0] = LAST_COMPATIBLE + 1;
        let err = decode(&breaking).unwrap_err();
        assert!(
            matches!(&err, StoreError::Corrupt(m) if m.contains("upgrade")),
            "{err}"
        );
        let mut zero = V1_RECORD.to_vec();
        zero[0] = 0;
        assert!(matches!(decode(&zero), Err(StoreError::Corrupt(_))));
    }

    #[test]
    fn garbage_is_corrupt_not_a_panic() {
        for garbage in [&b""[..], b"\xff\xff\xff\xff\xff", b"garbage", &[1u8; 40]] {
            assert!(matches!(decode(garbage), Err(StoreError::Corrupt(_))));
        }
        assert!(matches!(fingerprint(b"short"), Err(StoreError::Corrupt(_))));
    }
}

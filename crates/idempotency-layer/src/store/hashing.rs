//! How scope keys and fingerprints are hashed: length-prefixed parts under a domain string,
//! with BLAKE3. Stored entries are found and checked by these hashes across instances and
//! versions, so the encodings never change within a domain's version.

use super::Fingerprint;

/// The domain of request fingerprints; bump its version, never change the encoding under it.
pub(crate) const FINGERPRINT_DOMAIN: &[u8] = b"idempotency-layer fingerprint v1\0";

/// A BLAKE3 hasher fed through a buffer on the stack. Each `update` call has a fixed cost, which
/// the many short pieces of an encoding (8-byte lengths, a method, a path) would each pay; here
/// they are gathered and hashed in one call. An encoding that fits the buffer (most scope keys
/// and the fingerprints of small bodies) is hashed at once by [`blake3::hash`], and the
/// incremental hasher (about 2 KB, moved and initialised at a cost of its own) is made only for
/// longer ones. The bytes hashed, and so the hash, are the same either way.
pub(crate) struct FramedHasher {
    buf: [u8; 256],
    len: usize,
    /// Made when the encoding outgrows `buf`.
    hasher: Option<Box<blake3::Hasher>>,
}

impl FramedHasher {
    pub(crate) fn new(domain: &[u8]) -> Self {
        let mut b = FramedHasher {
            buf: [0; 256],
            len: 0,
            hasher: None,
        };
        b.push(domain);
        b
    }

    /// `bytes` as a part of the encoding: its 8-byte little-endian length, then itself.
    pub(crate) fn part(&mut self, bytes: &[u8]) {
        self.push(&(bytes.len() as u64).to_le_bytes());
        self.push(bytes);
    }

    pub(crate) fn push(&mut self, bytes: &[u8]) {
        let room = self.buf.len();
        if self.len + bytes.len() > room {
            let hasher = self.flush();
            if bytes.len() > room {
                hasher.update(bytes);
                return;
            }
        }
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// Hashes what the buffer holds into the incremental hasher (made now if need be).
    fn flush(&mut self) -> &mut blake3::Hasher {
        let hasher = self.hasher.get_or_insert_with(Default::default);
        hasher.update(&self.buf[..self.len]);
        self.len = 0;
        hasher
    }

    pub(crate) fn finish(mut self) -> [u8; 32] {
        if self.hasher.is_none() {
            return *blake3::hash(&self.buf[..self.len]).as_bytes();
        }
        *self.flush().finalize().as_bytes()
    }
}

/// The fingerprint of a request: method, path, query, content type and body, each
/// length-prefixed, hashed with BLAKE3. [`Fingerprint::of_request`] is this, public.
pub(crate) fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    let mut h = FramedHasher::new(FINGERPRINT_DOMAIN);
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or_default().as_bytes(),
        content_type,
        body,
    ] {
        h.part(part);
    }
    Fingerprint(h.finish())
}

//! How scope keys and fingerprints are hashed: length-prefixed parts under a domain string.
//! Scope keys with BLAKE3 (cryptographic: they separate tenants in a shared store), or, for a
//! store whose keys never leave its process, SipHash keyed for that store ([`ScopeHasher`]);
//! fingerprints
//! with XXH3-128 (they only tell a retry from another request under the same scope). Stored
//! entries are found and checked by these hashes across instances and versions, so the
//! encodings never change within a domain's version: a change is a new domain and mark.

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use super::{Fingerprint, ScopeKey};

/// The domain of request fingerprints. (Its `v2` is the encoding's version: no `v1` was ever
/// released.)
const FINGERPRINT_V2_DOMAIN: &[u8] = b"idempotency-layer fingerprint v2\0";

/// The last 16 bytes of every fingerprint of this version: its 128-bit hash fills the first 16.
/// The mark tells this version's fingerprints from a later one's, so that a next encoding can
/// still match the records this one made.
const FINGERPRINT_V2_MARK: [u8; 16] = *b"idem-fp-v2\0\0\0\0\0\0";

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

/// The domain of stable scope keys ([`Scope::key`](crate::Scope::key)).
pub(crate) const SCOPE_DOMAIN: &[u8] = b"idempotency-layer scope v1\0";

/// How a store turns a [`Scope`](crate::Scope) into the [`ScopeKey`] it files the scope under: what
/// [`IdempotencyStore::scope_hasher`](crate::store::IdempotencyStore::scope_hasher) answers.
///
/// - [`ScopeHasher::stable`] (the default): [`Scope::key`](crate::Scope::key), BLAKE3 of the scope's encoding. The
///   same key in every process, so instances that share a store find each other's claims and
///   records, and the stored keys outlive a restart. No raw tenant or key reaches the store.
/// - [`ScopeHasher::local`]: SipHash-1-3 (128 bits) of the same encoding under a random key
///   made for one store. About a fifth of BLAKE3's cost; for a store whose keys never leave the
///   process that made them ([`MemoryStore`](crate::MemoryStore)). With the key secret, no one
///   can aim two scopes at one key: separating tenants needs no more than that.
///
/// ```
/// use idempotency_layer::store::{IdempotencyStore, ScopeHasher};
/// use idempotency_layer::{MemoryStore, Scope};
///
/// let scope = Scope::new("acme", "POST /orders", "order-0001");
/// assert_eq!(ScopeHasher::stable().key(&scope), scope.key());
///
/// let store = MemoryStore::new();
/// let local = store.scope_hasher();
/// assert_eq!(local.key(&scope), local.key(&scope));
/// assert_ne!(local.key(&scope), scope.key());
/// ```
#[derive(Clone, Copy)]
pub struct ScopeHasher(HasherKind);

#[derive(Clone, Copy)]
enum HasherKind {
    Stable,
    Local { k0: u64, k1: u64 },
}

impl ScopeHasher {
    /// [`Scope::key`](crate::Scope::key): the same key in every process.
    pub const fn stable() -> Self {
        ScopeHasher(HasherKind::Stable)
    }

    /// A keyed hash under a random key made now: two calls give unrelated hashers, so a store
    /// makes one and answers it for as long as it lives.
    pub fn local() -> Self {
        use std::hash::{BuildHasher, RandomState};
        // Each `RandomState` is seeded from the OS's randomness (per thread, then stepped): its
        // SipHash of a constant is a random word.
        let k0 = RandomState::new().hash_one(0x5ec0_u64);
        let k1 = RandomState::new().hash_one(0x5ec1_u64);
        ScopeHasher(HasherKind::Local { k0, k1 })
    }

    /// True for [`ScopeHasher::stable`].
    pub fn is_stable(&self) -> bool {
        matches!(self.0, HasherKind::Stable)
    }

    /// The key of the scope of `tenant`, the method made of `method_pieces` (one part, its
    /// pieces concatenated) and `key`.
    pub(crate) fn of_pieces(&self, tenant: &str, method_pieces: &[&[u8]], key: &str) -> ScopeKey {
        match self.0 {
            HasherKind::Stable => scope_key(tenant, method_pieces, key),
            HasherKind::Local { k0, k1 } => local_key(k0, k1, tenant, method_pieces, key),
        }
    }

    /// A local hasher's SipHash keys (tests check its hashes against SipHash itself).
    #[cfg(test)]
    pub(crate) fn local_keys(&self) -> Option<(u64, u64)> {
        match self.0 {
            HasherKind::Local { k0, k1 } => Some((k0, k1)),
            HasherKind::Stable => None,
        }
    }
}

impl std::fmt::Debug for ScopeHasher {
    /// Never shows a local hasher's key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            HasherKind::Stable => "ScopeHasher::stable",
            HasherKind::Local { .. } => "ScopeHasher::local",
        })
    }
}

/// SipHash-1-3, 128 bits, of [`Scope::encode`](crate::Scope::encode) (the method given in pieces) under `(k0, k1)`:
/// the encoding gathered on the stack and hashed in one call when it fits (an idempotency key
/// is at most 255 bytes, so nearly always), else streamed. The first 16 bytes of the key are
/// the hash, the rest zero.
fn local_key(k0: u64, k1: u64, tenant: &str, method_pieces: &[&[u8]], key: &str) -> ScopeKey {
    use siphasher::sip128::{Hasher128, SipHasher13};
    use std::hash::Hasher;
    const ROOM: usize = 384;
    let method_len: usize = method_pieces.iter().map(|p| p.len()).sum();
    let mut hasher = SipHasher13::new_with_keys(k0, k1);
    let framed = 24 + tenant.len() + method_len + key.len();
    if framed <= ROOM {
        let mut buf = [0u8; ROOM];
        let mut len = 0;
        let mut push = |bytes: &[u8]| {
            buf[len..len + bytes.len()].copy_from_slice(bytes);
            len += bytes.len();
        };
        push(&(tenant.len() as u64).to_le_bytes());
        push(tenant.as_bytes());
        push(&(method_len as u64).to_le_bytes());
        for piece in method_pieces {
            push(piece);
        }
        push(&(key.len() as u64).to_le_bytes());
        push(key.as_bytes());
        hasher.write(&buf[..len]);
    } else {
        hasher.write(&(tenant.len() as u64).to_le_bytes());
        hasher.write(tenant.as_bytes());
        hasher.write(&(method_len as u64).to_le_bytes());
        for piece in method_pieces {
            hasher.write(piece);
        }
        hasher.write(&(key.len() as u64).to_le_bytes());
        hasher.write(key.as_bytes());
    }
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&hasher.finish128().as_bytes());
    ScopeKey(out)
}

/// The BLAKE3 hash of [`Scope::encode`](crate::Scope::encode) of `tenant`, the method made of `method_pieces` (one
/// part, its pieces concatenated) and `key`, fed to the hasher piece by piece (BLAKE3 hashes a
/// stream: the result is the hash of the whole encoding, with no buffer to build).
fn scope_key(tenant: &str, method_pieces: &[&[u8]], key: &str) -> ScopeKey {
    let mut h = FramedHasher::new(SCOPE_DOMAIN);
    h.part(tenant.as_bytes());
    let method_len: usize = method_pieces.iter().map(|p| p.len()).sum();
    h.push(&(method_len as u64).to_le_bytes());
    for piece in method_pieces {
        h.push(piece);
    }
    h.part(key.as_bytes());
    ScopeKey(h.finish())
}

/// The parts of a request its fingerprint covers: method, path, query, content type, body.
fn fingerprinted<'a>(parts: &'a http::request::Parts, body: &'a [u8]) -> [&'a [u8]; 5] {
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or_default().as_bytes(),
        content_type,
        body,
    ]
}

/// The fingerprint of a request: method, path, query, content type and body, each
/// length-prefixed under [`FINGERPRINT_V2_DOMAIN`], hashed with XXH3-128, then
/// [`FINGERPRINT_V2_MARK`]. [`Fingerprint::of_request`] is this, public.
///
/// The encoding is gathered in a buffer on the stack and hashed in one call when it fits (a
/// body of up to about 150 bytes), else streamed through the incremental hasher: the same hash
/// either way.
pub(crate) fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let pieces = fingerprinted(parts, body);
    let framed = FINGERPRINT_V2_DOMAIN.len() + pieces.iter().map(|p| 8 + p.len()).sum::<usize>();
    let hash = if framed <= SMALL {
        let mut buf = [0u8; SMALL];
        let mut len = 0;
        let mut push = |bytes: &[u8]| {
            buf[len..len + bytes.len()].copy_from_slice(bytes);
            len += bytes.len();
        };
        push(FINGERPRINT_V2_DOMAIN);
        for piece in pieces {
            push(&(piece.len() as u64).to_le_bytes());
            push(piece);
        }
        xxh3_128(&buf[..len])
    } else {
        let mut h = Xxh3::new();
        h.update(FINGERPRINT_V2_DOMAIN);
        for piece in pieces {
            h.update(&(piece.len() as u64).to_le_bytes());
            h.update(piece);
        }
        h.digest128()
    };
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&hash.to_le_bytes());
    out[16..].copy_from_slice(&FINGERPRINT_V2_MARK);
    Fingerprint(out)
}

/// The largest encoding hashed in one call from the stack.
const SMALL: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body_len: usize) -> (http::request::Parts, Vec<u8>) {
        let (parts, ()) = http::Request::post("/orders?x=1")
            .header("content-type", "application/json")
            .body(())
            .unwrap()
            .into_parts();
        (parts, vec![b'a'; body_len])
    }

    #[test]
    fn the_stack_buffer_and_the_stream_hash_alike() {
        // Around the buffer's size: each length hashed both ways gives one answer.
        for len in 100..220 {
            let (parts, body) = request(len);
            let mut h = Xxh3::new();
            h.update(FINGERPRINT_V2_DOMAIN);
            for piece in fingerprinted(&parts, &body) {
                h.update(&(piece.len() as u64).to_le_bytes());
                h.update(piece);
            }
            let streamed = h.digest128().to_le_bytes();
            assert_eq!(
                fingerprint(&parts, &body).0[..16],
                streamed,
                "body of {len}"
            );
        }
    }

    #[test]
    fn a_fingerprint_carries_its_mark_and_each_part_counts() {
        let (parts, body) = request(10);
        let v2 = fingerprint(&parts, &body);
        assert_eq!(v2.0[16..], FINGERPRINT_V2_MARK);
        let (mut other, _) = request(10);
        other.uri = "/orders?x=2".parse().unwrap();
        assert_ne!(fingerprint(&other, &body), v2);
        assert_ne!(fingerprint(&parts, b"aaaaaaaaab"), v2);
    }
}

//! How scope keys and fingerprints are hashed: length-prefixed parts under a domain string.
//! Stable scope keys with BLAKE3 (cryptographic: they separate tenants in a shared store);
//! process scope keys with SipHash-2-4 under a secret of the process (a keyed hash, as strong
//! against a chosen key, for a store no other process reads); fingerprints with XXH3-128 (they
//! only tell a retry from another request under the same scope). Stored entries are found and
//! checked by the stable hashes across instances and versions, so those encodings never change
//! within a domain's version: a change is a new domain and mark.

use std::hash::Hasher as _;
use std::sync::OnceLock;

use siphasher::sip128::{Hasher128 as _, SipHasher24};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use super::{Fingerprint, ScopeKey, TenantKey};

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

/// The last 16 bytes of every process scope key: its 128-bit hash fills the first 16. A stable
/// key (BLAKE3) ends otherwise short of a 2^-128 chance, so a log line tells the two apart.
const PROCESS_KEY_MARK: [u8; 16] = *b"idem-scope-proc\0";

/// True for a key [`process_scope_key`] made (by its mark).
pub(crate) fn is_process_key(key: &ScopeKey) -> bool {
    key.0[16..] == PROCESS_KEY_MARK
}

/// The secret process scope keys are made under: 128 bits from the operating system, drawn on
/// the first write. `None` when the system had none to give: process keys are then the stable
/// ones, for the whole life of the process (one scope never has two keys in one process).
fn process_secret() -> Option<&'static SipHasher24> {
    static SECRET: OnceLock<Option<SipHasher24>> = OnceLock::new();
    SECRET
        .get_or_init(|| {
            let mut key = [0u8; 16];
            match getrandom::fill(&mut key) {
                Ok(()) => Some(SipHasher24::new_with_key(&key)),
                Err(e) => {
                    tracing::warn!(error = %e, "idempotency: no randomness from the operating \
                        system; in-process stores key scopes by their stable hash (slower, \
                        as safe)");
                    None
                }
            }
        })
        .as_ref()
}

/// The largest process key encoding hashed in one call from the stack.
const PROCESS_SMALL: usize = 128;

/// The process scope key of `tenant`, the method made of `method_pieces` (one part, its pieces
/// concatenated) and `key`: SipHash-2-4 with 128-bit output, under [`process_secret`], of
/// `len(tenant) tenant len(method) method key`, each length a LEB128 varint (the key is last,
/// so the hash's own length ends it). The encoding is unambiguous, and the hash a keyed PRF, so
/// two scopes share a key only by a 128-bit collision under a secret no caller sees. `None`
/// when the process has no secret.
pub(crate) fn process_scope_key(
    tenant: &[u8],
    method_pieces: &[&[u8]],
    key: &[u8],
) -> Option<ScopeKey> {
    let secret = process_secret()?;
    let method_len: usize = method_pieces.iter().map(|p| p.len()).sum();
    let (tenant_len, method_varint) = (Varint::of(tenant.len()), Varint::of(method_len));
    let framed = tenant_len.len + tenant.len() + method_varint.len + method_len + key.len();
    let hash = if framed <= PROCESS_SMALL {
        let mut buf = [0u8; PROCESS_SMALL];
        let mut len = 0;
        let mut push = |bytes: &[u8]| {
            buf[len..len + bytes.len()].copy_from_slice(bytes);
            len += bytes.len();
        };
        push(tenant_len.bytes());
        push(tenant);
        push(method_varint.bytes());
        for piece in method_pieces {
            push(piece);
        }
        push(key);
        secret.hash(&buf[..len])
    } else {
        let mut h = *secret;
        h.write(tenant_len.bytes());
        h.write(tenant);
        h.write(method_varint.bytes());
        for piece in method_pieces {
            h.write(piece);
        }
        h.write(key);
        h.finish128()
    };
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&hash.as_bytes());
    out[16..].copy_from_slice(&PROCESS_KEY_MARK);
    Some(ScopeKey(out))
}

/// The process tenant key of `tenant`: the first 64 bits of SipHash-2-4 (128 bits) of the
/// tenant under [`process_secret`] (a tenant key is only ever compared with tenant keys).
/// `None` when the process has no secret.
pub(crate) fn process_tenant_key(tenant: &[u8]) -> Option<TenantKey> {
    Some(TenantKey(process_secret()?.hash(tenant).h1))
}

/// A length as a LEB128 varint: 7 bits a byte, low first, the high bit set on all but the last
/// (one byte below 128). No two lengths share an encoding, and none is a prefix of another's.
struct Varint {
    buf: [u8; 10],
    len: usize,
}

impl Varint {
    fn of(mut n: usize) -> Self {
        let mut v = Varint {
            buf: [0; 10],
            len: 0,
        };
        loop {
            let low = (n & 0x7f) as u8;
            n >>= 7;
            v.buf[v.len] = if n == 0 { low } else { low | 0x80 };
            v.len += 1;
            if n == 0 {
                return v;
            }
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
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

    /// A tenant key is the first 8 bytes of BLAKE3 of its domain and the tenant, whether the
    /// tenant fits the stack buffer or not (the incremental hasher was the reference).
    #[test]
    fn a_tenant_key_hashes_its_domain_and_tenant() {
        for len in [0, 1, 16, 200, 228, 229, 230, 256, 300, 1000, 5000] {
            let tenant = "t".repeat(len);
            let mut h = blake3::Hasher::new();
            h.update(b"idempotency-layer tenant v1\0");
            h.update(tenant.as_bytes());
            let expected = u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().unwrap());
            assert_eq!(
                super::super::TenantKey::of(&tenant).0,
                expected,
                "tenant of {len}"
            );
        }
        assert_eq!(
            super::super::TenantKey::of("acme").0,
            0x2c8a_6b9b_9f0d_2c16,
            "tenant keys changed: a shared store of your own may bound tenants by them"
        );
    }

    #[test]
    fn lengths_encode_as_leb128() {
        for (n, bytes) in [
            (0, &[0x00][..]),
            (1, &[0x01]),
            (127, &[0x7f]),
            (128, &[0x80, 0x01]),
            (300, &[0xac, 0x02]),
            (16_384, &[0x80, 0x80, 0x01]),
        ] {
            assert_eq!(Varint::of(n).bytes(), bytes, "{n}");
        }
        let max = Varint::of(usize::MAX);
        assert_eq!(max.bytes().len(), 10);
        assert_eq!(max.bytes()[9], 0x01);
    }

    /// Around the stack buffer's size, a process key is SipHash-2-4 of the encoding the docs
    /// name, hashed at once or streamed: one answer either way, ending in its mark.
    #[test]
    fn a_process_key_hashes_its_encoding_at_once_or_streamed() {
        let secret = process_secret().expect("this machine gives randomness");
        for key_len in 60..200 {
            let (tenant, method, key) = (b"acme".as_slice(), b"POST /orders", vec![b'k'; key_len]);
            let mut encoding = vec![4u8];
            encoding.extend_from_slice(tenant);
            encoding.push(12);
            encoding.extend_from_slice(method);
            encoding.extend_from_slice(&key);
            let expected = secret.hash(&encoding).as_bytes();
            let pieces: [&[u8]; 3] = [b"POST", b" ", b"/orders"];
            let got = process_scope_key(tenant, &pieces, &key).unwrap();
            assert_eq!(got.0[..16], expected, "key of {key_len}");
            assert_eq!(got.0[16..], PROCESS_KEY_MARK);
            assert_eq!(Some(got), process_scope_key(tenant, &[method], &key));
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

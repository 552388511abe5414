//! Tenants, scopes and fingerprints: what a key is scoped by, and what a request is compared by.

use std::sync::Arc;

use crate::store::hashing::{process_scope_key, FramedHasher};
use crate::store::{IdempotencyStore, ScopeKey, ScopeKeys};

/// The authenticated tenant of a request: a request extension that an authentication layer
/// placed before [`IdempotencyLayer`](crate::IdempotencyLayer) inserts.
///
/// Keys are scoped per tenant, so two tenants that pick the same key never see each other's
/// responses. The layer never trusts a client header for this unless configured with
/// [`TenantSource::header`](crate::TenantSource::header).
///
/// ```
/// use idempotency_layer::Tenant;
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Tenant::new("acme"));
/// assert_eq!(req.extensions().get::<Tenant>().unwrap().as_str(), "acme");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub Arc<str>);

impl Tenant {
    /// A tenant with this identifier.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Tenant(id.into())
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The three parts of a scope: one execution happens per distinct scope.
///
/// `method` is `"POST /orders"` (HTTP method, a space, the route's template where an axum
/// `Router` matched one, such as `"POST /books/{id}/deduct"`, else the path) for HTTP requests
/// and the gRPC path `"/package.Service/Method"` for gRPC requests: see [`Scope::http_operation`] and
/// [`Scope::grpc_operation`].
/// Use it with [`IdempotencyLayer::forget`](crate::IdempotencyLayer::forget).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scope<'a> {
    /// The tenant identifier.
    pub tenant: &'a str,
    /// The method: `"POST /orders"` or `"/package.Service/Method"`.
    pub method: &'a str,
    /// The idempotency key.
    pub key: &'a str,
}

const SCOPE_DOMAIN: &[u8] = b"idempotency-layer scope v1\0";

impl<'a> Scope<'a> {
    /// A scope from its parts.
    pub fn new(tenant: &'a str, method: &'a str, key: &'a str) -> Self {
        Scope {
            tenant,
            method,
            key,
        }
    }

    /// The operation of an HTTP request, as a scope names it: `"POST /orders"` (with axum, the
    /// route's template: `"POST /books/{id}/orders"`). For [`Scope::new`]'s `method`.
    pub fn http_operation(method: &http::Method, path: &str) -> String {
        format!("{} {}", method.as_str(), path)
    }

    /// The operation of a gRPC request, as a scope names it: its path,
    /// `"/package.Service/Method"`. For [`Scope::new`]'s `method`.
    pub fn grpc_operation(path: &str) -> String {
        path.to_owned()
    }

    /// The unambiguous encoding: each part as an 8-byte little-endian length and its bytes.
    /// Different scopes always encode differently (no `"a" + "bc"` vs `"ab" + "c"` collision).
    pub fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(24 + self.tenant.len() + self.method.len() + self.key.len());
        for part in [self.tenant, self.method, self.key] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part.as_bytes());
        }
        out
    }

    /// The stable store key ([`ScopeKeys::Stable`]): the BLAKE3 hash of the encoding, the same
    /// in every process and version. What a shared store (Redis, PostgreSQL) files the scope
    /// under; [`key_in`](Self::key_in) gives the key of any store.
    pub fn key(&self) -> ScopeKey {
        stable_scope_key(self.tenant, &[self.method.as_bytes()], self.key)
    }

    /// The key `store` files this scope under, as the layer computes it
    /// ([`IdempotencyStore::scope_keys`]): [`key`](Self::key) for a shared store, a key of this
    /// process for a [`MemoryStore`](crate::MemoryStore). For calling a store's methods yourself;
    /// [`IdempotencyLayer::forget`](crate::IdempotencyLayer::forget) and
    /// [`lookup`](crate::IdempotencyLayer::lookup) take the scope itself.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use idempotency_layer::store::IdempotencyStore;
    /// use idempotency_layer::{MemoryStore, Scope};
    ///
    /// let store = MemoryStore::new();
    /// let scope = Scope::new("acme", "POST /orders", "order-00042");
    /// assert_ne!(scope.key_in(&store), scope.key(), "a key of this process");
    /// assert!(store.lookup(scope.key_in(&store)).await.unwrap().is_none());
    /// # }
    /// ```
    pub fn key_in<S: IdempotencyStore>(&self, store: &S) -> ScopeKey {
        scope_key(
            store.scope_keys(),
            self.tenant,
            &[self.method.as_bytes()],
            self.key,
        )
    }
}

/// The key of an HTTP request's scope (method string `"POST /orders"`) under `keys`, without
/// making the method string: the same bytes are hashed in pieces.
pub(crate) fn http_scope_key(
    keys: ScopeKeys,
    tenant: &str,
    method: &http::Method,
    path: &str,
    key: &str,
) -> ScopeKey {
    scope_key(
        keys,
        tenant,
        &[method.as_str().as_bytes(), b" ", path.as_bytes()],
        key,
    )
}

/// The key of a scope under `keys`, its method given as `method_pieces` (one part, its pieces
/// concatenated). A process key falls back to the stable one when the process has no secret.
pub(crate) fn scope_key(
    keys: ScopeKeys,
    tenant: &str,
    method_pieces: &[&[u8]],
    key: &str,
) -> ScopeKey {
    match keys {
        ScopeKeys::Process => process_scope_key(tenant.as_bytes(), method_pieces, key.as_bytes())
            .unwrap_or_else(|| stable_scope_key(tenant, method_pieces, key)),
        ScopeKeys::Stable => stable_scope_key(tenant, method_pieces, key),
    }
}

/// The BLAKE3 hash of [`Scope::encode`] of `tenant`, the method made of `method_pieces` (one
/// part, its pieces concatenated) and `key`, fed to the hasher piece by piece (BLAKE3 hashes a
/// stream: the result is the hash of the whole encoding, with no buffer to build).
fn stable_scope_key(tenant: &str, method_pieces: &[&[u8]], key: &str) -> ScopeKey {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::hashing::fingerprint;
    use proptest::prelude::*;

    /// Stored records are found by scope key and checked by fingerprint across instances,
    /// restarts and upgrades: a change to either encoding would orphan every stored record (and
    /// let a retried write execute again). These values must never change within `v1`.
    #[test]
    fn scope_key_and_fingerprint_are_stable_across_versions() {
        let scope = Scope::new("acme", "POST /orders", "order-0001").key();
        assert_eq!(
            scope.to_hex(),
            "fc0970866b580da848999be4eefc6c092e402b8ffbd978d8e25015e428f6def1",
            "the scope encoding changed: bump SCOPE_DOMAIN's version instead"
        );
        assert_eq!(
            http_scope_key(
                ScopeKeys::Stable,
                "acme",
                &http::Method::POST,
                "/orders",
                "order-0001"
            ),
            scope,
            "the layer's HTTP shortcut hashes the same bytes"
        );
        let parts = http::Request::post("/orders?x=1")
            .header("content-type", "application/json")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let fp = fingerprint(&parts, b"{\"sku\":\"b1\"}");
        assert_eq!(
            crate::store::ScopeKey(fp.0).to_hex(),
            "f26e022f6272e67c9a36d4c31911f0c86964656d2d66702d7632000000000000",
            "the fingerprint changed: make a new version (domain and mark) instead"
        );
    }

    #[test]
    fn fingerprint_covers_each_part() {
        let base = || {
            http::Request::post("/orders?x=1")
                .header("content-type", "application/json")
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let fp = fingerprint(&base(), b"{}");
        assert_eq!(fp, fingerprint(&base(), b"{}"));
        assert_ne!(fp, fingerprint(&base(), b"{ }"));
        let mut p = base();
        p.uri = "/orders?x=2".parse().unwrap();
        assert_ne!(fp, fingerprint(&p, b"{}"));
        let mut p = base();
        p.uri = "/order?x=1".parse().unwrap();
        assert_ne!(fp, fingerprint(&p, b"{}"));
        let mut p = base();
        p.method = http::Method::PUT;
        assert_ne!(fp, fingerprint(&p, b"{}"));
        let mut p = base();
        p.headers
            .insert("content-type", "text/plain".parse().unwrap());
        assert_ne!(fp, fingerprint(&p, b"{}"));
    }

    proptest! {
        /// The key is the hash of the encoding, and the layer's HTTP shortcut (no method
        /// string made) gives the key of `Scope::http_operation`'s method string.
        #[test]
        fn the_key_hashes_the_encoding(
            t in any::<String>(), path in any::<String>(), k in any::<String>(),
            m in prop::sample::select(vec!["GET", "POST", "PUT", "PATCH", "DELETE", "PURGE"]),
        ) {
            let method = http::Method::from_bytes(m.as_bytes()).unwrap();
            let scope_method = Scope::http_operation(&method, &path);
            let scope = Scope::new(&t, &scope_method, &k);
            let mut h = blake3::Hasher::new();
            h.update(SCOPE_DOMAIN);
            h.update(&scope.encode());
            prop_assert_eq!(scope.key().0, *h.finalize().as_bytes());
            prop_assert_eq!(http_scope_key(ScopeKeys::Stable, &t, &method, &path, &k), scope.key());
            // A process key of the pieces is the process key of the whole method string.
            prop_assert_eq!(
                http_scope_key(ScopeKeys::Process, &t, &method, &path, &k),
                scope_key(ScopeKeys::Process, &t, &[scope_method.as_bytes()], &k)
            );
            prop_assert_eq!(scope.key_in(&crate::MemoryStore::new()), scope_key(ScopeKeys::Process, &t, &[scope_method.as_bytes()], &k));
        }

        /// Two triples built from the same characters split differently encode differently,
        /// and equal triples encode equally: the encoding is injective.
        #[test]
        fn scope_encoding_is_injective(
            s in "[a-c/ ]{0,12}",
            cuts in (0usize..=12, 0usize..=12, 0usize..=12, 0usize..=12),
        ) {
            let split = |a: usize, b: usize| {
                let (a, b) = (a.min(s.len()), b.min(s.len()));
                let (a, b) = (a.min(b), a.max(b));
                (&s[..a], &s[a..b], &s[b..])
            };
            let x = split(cuts.0, cuts.1);
            let y = split(cuts.2, cuts.3);
            let ex = Scope::new(x.0, x.1, x.2).encode();
            let ey = Scope::new(y.0, y.1, y.2).encode();
            prop_assert_eq!(ex == ey, x == y);
            prop_assert_eq!(Scope::new(x.0, x.1, x.2).key() == Scope::new(y.0, y.1, y.2).key(), x == y);
            let process = |t: (&str, &str, &str)| scope_key(ScopeKeys::Process, t.0, &[t.1.as_bytes()], t.2);
            prop_assert_eq!(process(x) == process(y), x == y);
        }

        /// Over arbitrary strings of any length (any Unicode, NUL, the separators people use):
        /// the encoding reads back to exactly its three parts, so no two (tenant, method, key)
        /// triples share an encoding, and their store keys differ.
        #[test]
        fn scope_encoding_reads_back_to_its_parts(
            a in (any::<String>(), any::<String>(), any::<String>()),
            b in (any::<String>(), any::<String>(), any::<String>()),
        ) {
            for t in [&a, &b] {
                let e = Scope::new(&t.0, &t.1, &t.2).encode();
                let mut rest = &e[..];
                let mut parts = Vec::new();
                for _ in 0..3 {
                    let (len, tail) = rest.split_at(8);
                    let len = u64::from_le_bytes(len.try_into().unwrap()) as usize;
                    parts.push(&tail[..len]);
                    rest = &tail[len..];
                }
                prop_assert!(rest.is_empty());
                prop_assert_eq!(parts, vec![t.0.as_bytes(), t.1.as_bytes(), t.2.as_bytes()]);
            }
            let (ka, kb) = (Scope::new(&a.0, &a.1, &a.2).key(), Scope::new(&b.0, &b.1, &b.2).key());
            prop_assert_eq!(ka == kb, a == b);
            // Moving bytes between tenant and key never lands on another tenant's record.
            let moved = format!("{}{}", a.0, a.2);
            prop_assert_eq!(Scope::new("", &a.1, &moved).key() == ka, a.0.is_empty());
            // The same of process keys: their encoding (varint lengths, the key last) is
            // unambiguous too, and two scopes share a key only by a 128-bit collision.
            let process = |t: &str, m: &str, k: &str| scope_key(ScopeKeys::Process, t, &[m.as_bytes()], k);
            let (pa, pb) = (process(&a.0, &a.1, &a.2), process(&b.0, &b.1, &b.2));
            prop_assert_eq!(pa == pb, a == b);
            prop_assert_eq!(process("", &a.1, &moved) == pa, a.0.is_empty());
            let moved_method = format!("{}{}", a.1, a.2);
            prop_assert_eq!(process(&a.0, &moved_method, "") == pa, a.2.is_empty());
            prop_assert_ne!(pa, ka, "a process key is never the stable one");
        }

        /// The scope key is BLAKE3 of its encoding whatever its size: encodings that fit the
        /// stack buffer (hashed at once) and encodings that outgrow it (hashed incrementally)
        /// give the hash of the same bytes.
        #[test]
        fn scope_key_hashes_the_encoding(
            tenant in "[a-z]{0,40}",
            path in "/[a-z/]{0,300}",
            key in "[a-z0-9-]{1,255}",
        ) {
            let method = format!("POST {path}");
            let mut h = blake3::Hasher::new();
            h.update(SCOPE_DOMAIN);
            for part in [tenant.as_bytes(), method.as_bytes(), key.as_bytes()] {
                h.update(&(part.len() as u64).to_le_bytes());
                h.update(part);
            }
            prop_assert_eq!(Scope::new(&tenant, &method, &key).key().0, *h.finalize().as_bytes());
        }

        /// The fingerprint depends only on method, path, query, content type and body: other
        /// headers, their order and extensions do not change it, and it is the same every time.
        #[test]
        fn fingerprint_is_stable(
            body in proptest::collection::vec(any::<u8>(), 0..256),
            noise in proptest::collection::vec(("x-[a-z]{1,8}", "[a-z0-9]{0,16}"), 0..6),
        ) {
            let parts = |noise: &[(String, String)]| {
                let mut b = http::Request::post("/orders?a=1").header("content-type", "application/json");
                for (k, v) in noise {
                    b = b.header(k.as_str(), v.as_str());
                }
                b.body(()).unwrap().into_parts().0
            };
            let clean = fingerprint(&parts(&[]), &body);
            prop_assert_eq!(clean, fingerprint(&parts(&noise), &body));
            let mut reversed = noise.clone();
            reversed.reverse();
            prop_assert_eq!(clean, fingerprint(&parts(&reversed), &body));
            let mut other = body.clone();
            other.push(0);
            prop_assert_ne!(clean, fingerprint(&parts(&[]), &other));
        }

        #[test]
        fn scope_encoding_is_injective_for_any_strings(
            a in (".{0,6}", ".{0,6}", ".{0,6}"),
            b in (".{0,6}", ".{0,6}", ".{0,6}"),
        ) {
            let ea = Scope::new(&a.0, &a.1, &a.2).encode();
            let eb = Scope::new(&b.0, &b.1, &b.2).encode();
            prop_assert_eq!(ea == eb, a == b);
        }
    }
}

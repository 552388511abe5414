//! The values a store keeps and answers with: scope and tenant keys, fingerprints, fencing
//! tokens, records, what `begin` found, and the one error type.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, HeaderValue, StatusCode};
use once_cell::race::OnceBox;

use reason_code::{BoxError, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED};

/// The hash of a scope (tenant + method + key), the only identifier a store sees.
///
/// Made with [`Scope::key`](crate::Scope::key) (a BLAKE3 hash of an unambiguous,
/// length-prefixed encoding, so no raw tenant or key reaches the store), or, for a store that
/// answers [`ScopeKeys::Process`], with a keyed hash of this process: see
/// [`Scope::key_in`](crate::Scope::key_in).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ScopeKey(pub [u8; 32]);

/// Hashes the key's first 8 bytes as one `u64`: the key is BLAKE3 output, uniform already, so
/// the other 24 add nothing a hash table can use, and a seeded hasher (the stores' maps use
/// foldhash with a random seed per map) mixes one word far faster than 32 bytes. Equal keys
/// hash equally, as `Hash` requires.
impl std::hash::Hash for ScopeKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let (word, _) = self.0.split_first_chunk::<8>().expect("32 bytes");
        state.write_u64(u64::from_le_bytes(*word));
    }
}

/// Which key a store files each scope under: what
/// [`IdempotencyStore::scope_keys`](super::IdempotencyStore::scope_keys) answers, and so what
/// the layer computes for each write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ScopeKeys {
    /// [`Scope::key`](crate::Scope::key): BLAKE3 of the scope's encoding, the same in every
    /// process, on every machine and in every version of this crate. What a store that other
    /// processes share (Redis, PostgreSQL) or that outlives its process needs. The default.
    Stable,
    /// A keyed hash (SipHash-2-4, 128 bits) under a secret drawn from the operating system when
    /// the process first needs it: as unguessable to a client that picks keys, about a quarter
    /// of the cost, and meaningless to any other process. For a store that lives and dies with
    /// its process ([`MemoryStore`](super::MemoryStore)).
    Process,
}

/// The domain of tenant keys: BLAKE3 of it and the tenant's bytes (no length: one part).
const TENANT_DOMAIN: &[u8] = b"idempotency-layer tenant v1\0";

/// The hash of a tenant alone: what a store needs to keep each tenant to its share (see
/// [`IdempotencyStore::begin_for_tenant`](super::IdempotencyStore::begin_for_tenant)) without learning who the tenant is.
///
/// Equal for every scope of one tenant and, short of a 64-bit collision, different between
/// tenants. [`TenantKey::default`] is "no tenant known" (a direct [`IdempotencyStore::begin`](super::IdempotencyStore::begin)).
///
/// The layer keys tenants as its store keys scopes ([`ScopeKeys`]): [`TenantKey::of`] for a
/// store of stable keys, a key of this process for a [`MemoryStore`](super::MemoryStore).
/// [`TenantKey::of_in`] gives the key a store is given.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct TenantKey(pub u64);

impl TenantKey {
    /// The key of `tenant` as the layer gives it to `store`: [`of`](Self::of) for a store of
    /// stable keys, a key of this process for one of [`ScopeKeys::Process`]. For calling
    /// [`begin_for_tenant`](super::IdempotencyStore::begin_for_tenant) yourself.
    pub fn of_in<S: super::IdempotencyStore>(tenant: &str, store: &S) -> TenantKey {
        TenantKey::under(store.scope_keys(), tenant)
    }

    /// The key of `tenant` under `keys`: [`of`](Self::of) for a store of stable keys, else a
    /// key of this process (a `MemoryStore` bounds each tenant by it, in this process alone).
    pub(crate) fn under(keys: ScopeKeys, tenant: &str) -> TenantKey {
        match keys {
            ScopeKeys::Process => super::hashing::process_tenant_key(tenant.as_bytes())
                .unwrap_or_else(|| TenantKey::of(tenant)),
            ScopeKeys::Stable => TenantKey::of(tenant),
        }
    }

    /// The key of `tenant` (the tenant a [`Scope`](crate::Scope) is made with).
    pub fn of(tenant: &str) -> TenantKey {
        // Hashed at once from the stack where it fits (the incremental hasher costs a third
        // more), the same bytes either way.
        let mut h = super::hashing::FramedHasher::new(TENANT_DOMAIN);
        h.push(tenant.as_bytes());
        let mut word = [0u8; 8];
        word.copy_from_slice(&h.finish()[..8]);
        TenantKey(u64::from_le_bytes(word))
    }
}

impl ScopeKey {
    /// The key as lowercase hex, 64 characters (for stores that need a string key).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// True for a key of this process ([`ScopeKeys::Process`]), by the mark its last 16 bytes
    /// carry (a stable key carries it with a chance of 2^-128).
    pub(crate) fn is_of_this_process(&self) -> bool {
        super::hashing::is_process_key(self)
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({})", &self.to_hex()[..16])
    }
}

/// The hash of what a request asks for: method, path, query, content type and body.
///
/// The same scope with another fingerprint is a different request reusing a key, and is refused.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The layer's own fingerprint of a request: its method, path, query, content type and
    /// `body`, each length-prefixed, hashed with XXH3-128 and marked with its version (a stable
    /// encoding: stored records are checked against it across instances and versions). A
    /// [`fingerprint_fn`](crate::IdempotencyLayer::fingerprint_fn) of your own can call it with
    /// a canonical form of the body.
    ///
    /// It is not a cryptographic hash, and needs not be: it only tells a retry from another
    /// request under the same scope, which one tenant's own key already names (a client that
    /// forged a collision would get the replay of its own earlier request). What separates
    /// tenants in a shared store is the scope key, which stays keyed BLAKE3.
    pub fn of_request(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
        super::hashing::fingerprint(parts, body)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &hex(&self.0)[..16])
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A fencing token: names one claim of one scope. Made by the store; unique per store (a shared
/// store must make tokens unique across instances, e.g. random 128-bit values).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Token(pub u128);

/// A recorded response: everything needed to replay it byte for byte.
///
/// Made by the layer when a response is recorded; a store keeps it and hands it back. Build one
/// with [`Record::new`] (stores that decode their own format, tests); read it with the accessors.
///
/// ```
/// use bytes::Bytes;
/// use http::{HeaderMap, StatusCode};
/// use idempotency_layer::store::{Fingerprint, Record};
///
/// let mut trailers = HeaderMap::new();
/// trailers.insert("grpc-status", "0".parse().unwrap());
/// let record = Record::new(Fingerprint([7; 32]), StatusCode::OK, HeaderMap::new(), Bytes::from("hi"))
///     .with_trailers(trailers);
/// assert_eq!(record.body(), "hi");
/// assert_eq!(record.trailers().unwrap()["grpc-status"], "0");
/// assert!(!record.body_omitted());
/// assert!(record.clone().with_body_omitted().body().is_empty());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) body_omitted: bool,
    /// Boxed: trailers are rare (gRPC's status), and every record in memory would otherwise
    /// carry a whole `HeaderMap` for them.
    pub(crate) trailers: Option<Box<HeaderMap>>,
    /// The head its replays send, made by the first ([`Record::replay_head`]).
    pub(crate) replay_head: ReplayHead,
}

impl Record {
    /// A record of a response with this status, headers and whole body, made by a request with
    /// this fingerprint; no trailers.
    pub fn new(
        fingerprint: Fingerprint,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    ) -> Self {
        Record {
            fingerprint,
            status,
            headers,
            body,
            body_omitted: false,
            trailers: None,
            replay_head: ReplayHead::default(),
        }
    }

    /// The same record with these trailers (a gRPC response's status lives there).
    pub fn with_trailers(mut self, trailers: HeaderMap) -> Self {
        self.trailers = Some(Box::new(trailers));
        self
    }

    /// The same record without its body, marked as omitted: its replays carry status, headers
    /// and trailers only, and say so (for a body larger than the layer's `max_record_bytes`, or
    /// one a store could not keep).
    pub fn with_body_omitted(mut self) -> Self {
        self.omit_body();
        self
    }

    /// Drops the body and marks it omitted (as [`with_body_omitted`](Self::with_body_omitted)),
    /// in place: its replays' head is made anew.
    pub(crate) fn omit_body(&mut self) {
        self.body = Bytes::new();
        self.body_omitted = true;
        self.replay_head = ReplayHead::default();
    }

    /// The fingerprint of the request that produced it.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response headers, in order, repeated names kept.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The response body (empty when [`body_omitted`](Self::body_omitted)).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// True when the body was not kept (too large); the replay says so.
    pub fn body_omitted(&self) -> bool {
        self.body_omitted
    }

    /// The trailers, if the response had any.
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_deref()
    }

    /// The head a replay sends: [`headers`](Self::headers) (the layer's own markers as a handler
    /// set them left out) and `idempotent-replayed: true`; for a record without its body,
    /// `idempotent-body-omitted: true` too, and no `content-length`. Made by the first replay;
    /// every later one clones it.
    pub(crate) fn replay_head(&self) -> &HeaderMap {
        self.replay_head.0.get_or_init(|| {
            let marks = [
                Some(IDEMPOTENT_REPLAYED),
                self.body_omitted.then_some(IDEMPOTENT_BODY_OMITTED),
            ];
            let mut head = HeaderMap::with_capacity(self.headers.len() + marks.len());
            for (name, value) in &self.headers {
                let dropped = (self.body_omitted && *name == CONTENT_LENGTH)
                    || marks.iter().flatten().any(|mark| name == mark);
                if !dropped {
                    head.append(name.clone(), value.clone());
                }
            }
            for mark in marks.into_iter().flatten() {
                head.append(mark, HeaderValue::from_static("true"));
            }
            Box::new(head)
        })
    }
}

/// The head a record's replays send, made by its first replay and cloned by every later one:
/// a replay then inserts nothing into the map it cloned (a cloned `HeaderMap` has no room to
/// grow, so an insert there reallocates it). A write that is never replayed (most of them)
/// makes none. Not part of what a record says: two records are equal whatever their replays
/// made.
///
/// One pointer: a record that is never replayed pays 8 bytes for it.
#[derive(Clone, Default)]
pub(crate) struct ReplayHead(OnceBox<HeaderMap>);

impl PartialEq for ReplayHead {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl fmt::Debug for ReplayHead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0.get() {
            Some(_) => "made",
            None => "not made yet",
        })
    }
}

/// What [`IdempotencyStore::begin`](super::IdempotencyStore::begin) found.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Begin {
    /// The scope was free (or its record had expired, or its lease had lapsed): the caller now
    /// holds the claim with this token and must complete or release it.
    New(Token),
    /// Another request holds the scope.
    InFlight {
        /// The token of the claim in flight; pass it to [`IdempotencyStore::wait`](super::IdempotencyStore::wait).
        token: Token,
        /// The fingerprint of the request in flight.
        fingerprint: Fingerprint,
    },
    /// The scope has a record that has not expired.
    Completed(Arc<Record>),
}

/// What a store holds for a scope ([`IdempotencyStore::lookup`](super::IdempotencyStore::lookup)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Held {
    /// A claim in flight, its lease running: a request with this fingerprint is executing.
    InFlight {
        /// The claim's token.
        token: Token,
        /// The fingerprint of the request executing.
        fingerprint: Fingerprint,
    },
    /// A record, not yet expired: what every duplicate is answered.
    Completed(Arc<Record>),
}

/// The one error type of every store.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The token no longer holds the claim (lease lapsed and taken over, key forgotten, or the
    /// claim already ended). Nothing was changed.
    Fenced,
    /// The store has no room for a new claim (it is full, or the tenant's share of it is).
    /// Nothing was claimed and nothing executes: the layer answers 503 / UNAVAILABLE with
    /// `Retry-After`, which clients retry.
    Full,
    /// The backend failed or is unreachable: an outage, which may pass.
    Backend(BoxError),
    /// An entry could not be decoded.
    Corrupt(String),
    /// A setting, a URL or the server's own configuration the store cannot work with (a bad
    /// table name, a pool of no connection, a URL scheme this build has no feature for, a Redis
    /// that may evict the store's keys): nothing works until it is changed, so it is not an
    /// outage to wait out. The message says what to change.
    Config(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Fenced => f.write_str("the fencing token no longer holds the claim"),
            StoreError::Full => f.write_str(
                "the idempotency store has no room for a new claim (it is full, or this \
                 tenant's share of it is); nothing was executed: retry later, or raise the \
                 store's bounds",
            ),
            StoreError::Backend(e) => write!(f, "idempotency store backend failed: {e}"),
            StoreError::Corrupt(what) => write!(f, "idempotency store entry is corrupt: {what}"),
            StoreError::Config(what) => write!(f, "idempotency store misconfigured: {what}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Backend(e) => Some(&**e),
            _ => None,
        }
    }
}

/// Which kind of store a layer uses: the `store` label of its metrics
/// ([`IdempotencyStore::backend`](super::IdempotencyStore::backend)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// [`MemoryStore`](super::MemoryStore).
    Memory,
    /// `RedisStore` (feature `redis`).
    Redis,
    /// `PostgresStore` (feature `postgres`).
    Postgres,
    /// Any other store.
    Custom,
}

impl Backend {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) const ALL: [Backend; 4] = [
        Backend::Memory,
        Backend::Redis,
        Backend::Postgres,
        Backend::Custom,
    ];

    /// The label value: `memory`, `redis`, `postgres` or `custom`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
            Backend::Custom => "custom",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("2"));
        headers.append("x-order", HeaderValue::from_static("1"));
        headers.append("x-order", HeaderValue::from_static("2"));
        // A handler's own markers are not the layer's: replaced.
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("handler"));
        headers.insert(IDEMPOTENT_BODY_OMITTED, HeaderValue::from_static("handler"));
        Record::new(
            Fingerprint([1; 32]),
            StatusCode::OK,
            headers,
            Bytes::from("{}"),
        )
    }

    fn pairs(h: &HeaderMap) -> Vec<(&str, &str)> {
        h.iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect()
    }

    #[test]
    fn the_replay_head_is_made_once_and_follows_the_body() {
        let mut record = record();
        let head = record.replay_head();
        assert!(std::ptr::eq(head, record.replay_head()), "made once");
        assert_eq!(
            pairs(head),
            [
                ("content-type", "application/json"),
                ("content-length", "2"),
                ("x-order", "1"),
                ("x-order", "2"),
                ("idempotent-body-omitted", "handler"),
                ("idempotent-replayed", "true"),
            ]
        );
        // What the record says is unchanged, and equality ignores what replays made.
        assert_eq!(record.headers()[IDEMPOTENT_REPLAYED], "handler");
        assert_eq!(record, self::record());

        // Without its body, the head is made anew: no length, and it says so.
        record.omit_body();
        assert_eq!(
            pairs(record.replay_head()),
            [
                ("content-type", "application/json"),
                ("x-order", "1"),
                ("x-order", "2"),
                ("idempotent-replayed", "true"),
                ("idempotent-body-omitted", "true"),
            ]
        );
        let omitted = self::record().with_body_omitted();
        assert_eq!(pairs(omitted.replay_head()), pairs(record.replay_head()));
    }
}

//! The one seam between the layer and where records live: [`IdempotencyStore`].
//!
//! A store keeps one entry per scope (a hash of tenant + method + key, see
//! [`Scope`](crate::Scope)). An entry is either *in flight* (claimed by one leader, with a lease
//! and a fencing token) or *completed* (a [`Record`] with a time to live). The layer drives it:
//!
//! 1. [`begin`](IdempotencyStore::begin) atomically claims the scope ([`Begin::New`]), or reports
//!    the current claim ([`Begin::InFlight`]) or record ([`Begin::Completed`]).
//! 2. The leader runs the handler, renewing its lease with
//!    [`renew`](IdempotencyStore::renew) while it runs.
//! 3. The leader either [`complete`](IdempotencyStore::complete)s the claim with a record, or
//!    [`release`](IdempotencyStore::release)s it so a retry executes again. Both are fenced: a
//!    token that no longer holds the claim (the lease lapsed and another leader took over, or the
//!    key was forgotten) gets [`StoreError::Fenced`] and changes nothing.
//! 4. Duplicates that found the scope in flight call [`wait`](IdempotencyStore::wait), which
//!    resolves when that claim ends (or may end: a store may wake early), then `begin` again.
//!
//! The in-memory [`MemoryStore`] is the default; other stores (Redis, PostgreSQL) implement the
//! same trait and run the same [conformance suite](crate#choosing-a-store).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

#[cfg(any(feature = "redis", feature = "postgres"))]
mod codec;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod wake;

#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresStore, PostgresStoreBuilder};

/// Encodes a [`Record`] as the shared stores (`RedisStore`, `PostgresStore`) write it:
/// a version byte and a postcard-encoded struct, which [`decode_record`] reads back.
///
/// For tools that inspect or repair store entries, and for other stores that want the same
/// format.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub fn encode_record(record: &Record) -> Result<Vec<u8>, StoreError> {
    codec::encode(record)
}

/// Decodes what [`encode_record`] wrote. Any other input (truncated, garbage, another encoding
/// version, an invalid status or header) is [`StoreError::Corrupt`], never a panic; the shared
/// stores report such an entry as corrupt and the layer executes nothing for its key.
///
/// ```
/// use idempotency_layer::store::{decode_record, StoreError};
///
/// assert!(matches!(decode_record(b"\x01garbage"), Err(StoreError::Corrupt(_))));
/// ```
#[cfg(any(feature = "redis", feature = "postgres"))]
pub fn decode_record(bytes: &[u8]) -> Result<Record, StoreError> {
    codec::decode(bytes)
}
#[cfg(feature = "redis")]
pub use self::redis::{RedisStore, RedisStoreBuilder};

/// After a `begin` of a shared store failed with a backend error, the claim may have been
/// written and only its reply lost (the connection dropped or timed out after the server ran
/// it). No one knows they hold that claim, so it would block its key until its lease lapsed (30
/// s by default) and every retry would wait for it. This releases it in the background,
/// fenced by its token (so it removes nothing but that orphan), retrying with backoff (50 ms
/// to 1 s) while the store is unreachable, for at most one lease.
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) fn release_orphan<St: IdempotencyStore>(
    store: St,
    scope: ScopeKey,
    token: Token,
    lease: Duration,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let give_up = tokio::time::Instant::now() + lease;
        let mut delay = Duration::from_millis(50);
        loop {
            match store.release(scope, token).await {
                Err(StoreError::Backend(_)) if tokio::time::Instant::now() + delay < give_up => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
                // Released (it was written), fenced (it never was), or out of time.
                _ => return,
            }
        }
    });
}
pub use memory::MemoryStore;

/// The boxed error a store wraps from its backend.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The hash of a scope (tenant + method + key), the only identifier a store sees.
///
/// Made with [`Scope::key`](crate::Scope::key): a BLAKE3 hash of an unambiguous, length-prefixed
/// encoding, so no raw tenant or key reaches the store.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeKey(pub [u8; 32]);

impl ScopeKey {
    /// The key as lowercase hex, 64 characters (for stores that need a string key).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
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
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The fingerprint of the request that produced it.
    pub fingerprint: Fingerprint,
    /// The response status.
    pub status: StatusCode,
    /// The response headers, in order, repeated names kept.
    pub headers: HeaderMap,
    /// The response body (empty when `body_omitted`).
    pub body: Bytes,
    /// True when the body was larger than the layer's `max_record_bytes` and was not kept: the
    /// replay carries status and headers only, and says so.
    pub body_omitted: bool,
    /// The trailers (gRPC status lives here), if the response had any.
    pub trailers: Option<HeaderMap>,
}

/// What [`IdempotencyStore::begin`] found.
#[derive(Clone, Debug)]
pub enum Begin {
    /// The scope was free (or its record had expired, or its lease had lapsed): the caller now
    /// holds the claim with this token and must complete or release it.
    New(Token),
    /// Another request holds the scope.
    InFlight {
        /// The token of the claim in flight; pass it to [`IdempotencyStore::wait`].
        token: Token,
        /// The fingerprint of the request in flight.
        fingerprint: Fingerprint,
    },
    /// The scope has a record that has not expired.
    Completed(Arc<Record>),
}

/// The one error type of every store.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The token no longer holds the claim (lease lapsed and taken over, key forgotten, or the
    /// claim already ended). Nothing was changed.
    Fenced,
    /// The store has no room: every entry is in flight. Nothing was changed.
    Full,
    /// The backend failed or is unreachable.
    Backend(BoxError),
    /// An entry could not be decoded.
    Corrupt(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Fenced => f.write_str("the fencing token no longer holds the claim"),
            StoreError::Full => f.write_str("the store is full of requests in flight"),
            StoreError::Backend(e) => write!(f, "idempotency store backend failed: {e}"),
            StoreError::Corrupt(what) => write!(f, "idempotency store entry is corrupt: {what}"),
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

/// Where claims and records live. See the [module docs](self) for the protocol.
///
/// Implementations are cheap to clone (a handle to shared state), and every method is atomic on
/// its own: `begin` in particular must never hand [`Begin::New`] to two callers for one scope
/// while the first claim's lease holds.
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// Claims `scope` for a request with `fingerprint`, with a lease of `lease`, or reports who
    /// holds it. An expired record or a lapsed lease counts as free.
    fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Replaces the claim `token` with `record`, kept for `ttl`, and wakes the waiters.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
    fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Record,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Removes the claim `token` so the next `begin` executes again, and wakes the waiters.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
    fn release(
        &self,
        scope: ScopeKey,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends the lease of claim `token` to `lease` from now.
    /// [`StoreError::Fenced`] if `token` no longer holds the claim.
    fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Resolves when the claim `observed` on `scope` has ended (completed, released, forgotten,
    /// taken over) or its lease has lapsed; immediately if it already has. It may resolve early;
    /// the caller calls `begin` again either way. It must not resolve only after a claim ends
    /// when the claim already ended before the call (no lost wake-ups).
    fn wait(
        &self,
        scope: ScopeKey,
        observed: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Removes whatever `scope` holds (record or claim); true if there was something. A claim
    /// that is forgotten is fenced: its leader's `complete` is refused.
    fn forget(&self, scope: ScopeKey) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

//! [`AnyStore`]: a store chosen at run time, from a URL.

use std::sync::Arc;
use std::time::Duration;

use super::{
    Backend, Begin, Fingerprint, Held, IdempotencyStore, MemoryStore, Record, ScopeKey, ScopeKeys,
    StoreError, TenantKey, Token,
};

/// Any of the stores this crate has, chosen at run time (say from a `--store` flag or an
/// environment variable) with [`AnyStore::from_url`].
///
/// A plain enum: each call is one `match` on the variant and then the store's own code, so the
/// statically typed path (`IdempotencyLayer<RedisStore>` and friends) pays nothing for it, and
/// a layer over `AnyStore` pays one branch per store operation. Build a variant yourself to
/// configure its store (`AnyStore::Redis(RedisStore::builder(url).prefix("orders:")...)`).
///
/// ```
/// use idempotency_layer::store::AnyStore;
/// use idempotency_layer::IdempotencyLayer;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotency_layer::StoreError> {
/// let url = std::env::var("IDEMPOTENCY_STORE").unwrap_or_else(|_| "memory".into());
/// let store = AnyStore::from_url(&url).await?; // memory, redis://..., postgres://...
/// store.migrate().await?; // PostgreSQL's table, where absent; nothing for the others
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum AnyStore {
    /// [`MemoryStore`].
    Memory(MemoryStore),
    /// `RedisStore` (feature `redis`).
    #[cfg(feature = "redis")]
    Redis(super::RedisStore),
    /// `PostgresStore` (feature `postgres`).
    #[cfg(feature = "postgres")]
    Postgres(super::PostgresStore),
}

impl AnyStore {
    /// Creates what the store needs where absent: `PostgresStore::migrate` (the schema, the
    /// table and its index) for PostgreSQL; nothing for the others. Run it at start, or create
    /// the table with your own migrations instead.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(store) => store.migrate().await,
            _ => Ok(()),
        }
    }

    /// Opens the store `url` names, with that store's defaults:
    ///
    /// - `memory` (or `memory://`): a [`MemoryStore::new`];
    /// - `redis://...` or `rediss://...` (TLS, feature `redis-tls`): `RedisStore::connect`;
    /// - `redis+cluster://host1:port1,host2:port2` (feature `redis-cluster`; `rediss+cluster://`
    ///   for TLS): a Redis Cluster with those seed nodes;
    /// - `redis+sentinel://host1:port1,host2:port2/master` (feature `redis-sentinel`;
    ///   `rediss+sentinel://` for TLS): the primary those Sentinels name `master`;
    /// - `postgres://...` or `postgresql://...`: `PostgresStore::connect`. It runs no DDL:
    ///   create the table with [`migrate`](Self::migrate) (or your own migrations, from
    ///   `PostgresStoreBuilder::migration_sql`).
    ///
    /// Every Redis URL goes through `RedisStore::builder`, which reads the same schemes.
    /// A scheme whose store this build does not have (its cargo feature is off) or an unknown
    /// scheme is an error that says which.
    pub async fn from_url(url: &str) -> Result<AnyStore, StoreError> {
        let scheme = url.split_once("://").map_or(url, |(s, _)| s);
        match scheme {
            "memory" => Ok(AnyStore::Memory(MemoryStore::new())),
            #[cfg(feature = "redis")]
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redis+sentinel"
            | "rediss+sentinel" => Ok(AnyStore::Redis(
                super::RedisStore::builder(url).connect().await?,
            )),
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => Ok(AnyStore::Postgres(
                super::PostgresStore::connect(url).await?,
            )),
            #[allow(unreachable_patterns)]
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redis+sentinel"
            | "rediss+sentinel" | "postgres" | "postgresql" => Err(StoreError::Config(format!(
                "this build has no {scheme} store: enable the idempotency-layer cargo feature \
                     `{}`",
                if scheme.ends_with("+cluster") {
                    "redis-cluster"
                } else if scheme.ends_with("+sentinel") {
                    "redis-sentinel"
                } else if scheme.starts_with("redis") {
                    "redis"
                } else {
                    "postgres"
                }
            ))),
            other => Err(StoreError::Config(format!(
                "unknown idempotency store {other:?}: use memory, redis://HOST:PORT, \
                     rediss://HOST:PORT or postgres://USER@HOST/DB"
            ))),
        }
    }
}

impl From<MemoryStore> for AnyStore {
    fn from(s: MemoryStore) -> Self {
        AnyStore::Memory(s)
    }
}

#[cfg(feature = "redis")]
impl From<super::RedisStore> for AnyStore {
    fn from(s: super::RedisStore) -> Self {
        AnyStore::Redis(s)
    }
}

#[cfg(feature = "postgres")]
impl From<super::PostgresStore> for AnyStore {
    fn from(s: super::PostgresStore) -> Self {
        AnyStore::Postgres(s)
    }
}

/// Forwards a call to whichever store this is.
macro_rules! each {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($s) => $call.await,
            #[cfg(feature = "redis")]
            AnyStore::Redis($s) => $call.await,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres($s) => $call.await,
        }
    };
}

impl IdempotencyStore for AnyStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        each!(self, s => s.begin(scope, fingerprint, lease))
    }

    async fn begin_for_tenant(
        &self,
        tenant: TenantKey,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        each!(self, s => s.begin_for_tenant(tenant, scope, fingerprint, lease))
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        each!(self, s => s.complete(scope, token, record, ttl))
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        each!(self, s => s.release(scope, token))
    }

    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        each!(self, s => s.renew(scope, token, lease))
    }

    async fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> Vec<Result<(), StoreError>> {
        each!(self, s => s.renew_many(claims))
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        each!(self, s => s.wait(scope, observed))
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        each!(self, s => s.forget(scope))
    }

    async fn lookup(&self, scope: ScopeKey) -> Result<Option<Held>, StoreError> {
        each!(self, s => s.lookup(scope))
    }

    fn scope_keys(&self) -> ScopeKeys {
        match self {
            AnyStore::Memory(s) => s.scope_keys(),
            #[cfg(feature = "redis")]
            AnyStore::Redis(s) => s.scope_keys(),
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(s) => s.scope_keys(),
        }
    }

    fn backend(&self) -> Backend {
        match self {
            AnyStore::Memory(s) => s.backend(),
            #[cfg(feature = "redis")]
            AnyStore::Redis(s) => s.backend(),
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(s) => s.backend(),
        }
    }

    #[cfg(feature = "postgres")]
    fn postgres(&self) -> Option<&super::PostgresStore> {
        match self {
            AnyStore::Postgres(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn memory_from_url_passes_conformance_and_unknown_schemes_say_what_to_use() {
        let store = AnyStore::from_url("memory").await.unwrap();
        assert!(matches!(store, AnyStore::Memory(_)));
        crate::conformance::run_all(|| store.clone()).await;
        let e = AnyStore::from_url("mongodb://x").await.unwrap_err();
        assert!(e.to_string().contains("use memory, redis://"), "{e}");
        assert!(
            matches!(e, StoreError::Config(_)),
            "a setting to change: {e:?}"
        );
    }
}

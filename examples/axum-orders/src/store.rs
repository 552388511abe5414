//! Choosing the idempotency store from the command line: `memory`, `redis://...` or
//! `postgres://...`.

use std::str::FromStr;

/// A `--store` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreArg {
    /// The embedded in-memory store.
    Memory,
    /// A Redis URL.
    Redis(String),
    /// A PostgreSQL URL.
    Postgres(String),
}

impl FromStr for StoreArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            Ok(StoreArg::Memory)
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(StoreArg::Redis(s.to_owned()))
        } else if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Ok(StoreArg::Postgres(s.to_owned()))
        } else {
            Err(format!(
                "unknown store {s:?}: use memory, redis://HOST:PORT or postgres://USER@HOST/DB"
            ))
        }
    }
}

/// Something to do with a store once it is open, whatever its type.
#[allow(async_fn_in_trait)]
pub trait WithStore {
    /// What it produces.
    type Output;
    /// Does it with `store`.
    async fn run<St: idempotency_layer::IdempotencyStore>(self, store: St) -> Self::Output;
}

/// Opens the store `arg` names (migrating the PostgreSQL table if needed) and hands it to `f`.
pub async fn open<W: WithStore>(
    arg: &StoreArg,
    f: W,
) -> Result<W::Output, Box<dyn std::error::Error + Send + Sync>> {
    match arg {
        StoreArg::Memory => Ok(f.run(idempotency_layer::MemoryStore::new()).await),
        #[cfg(feature = "redis")]
        StoreArg::Redis(url) => {
            let store = idempotency_layer::RedisStore::connect(url).await?;
            Ok(f.run(store).await)
        }
        #[cfg(feature = "postgres")]
        StoreArg::Postgres(url) => {
            let store = idempotency_layer::PostgresStore::connect(url).await?;
            store.migrate().await?;
            Ok(f.run(store).await)
        }
        #[allow(unreachable_patterns)]
        other => Err(format!(
            "{other:?} needs the cargo feature of that store (redis, postgres), on by default"
        )
        .into()),
    }
}

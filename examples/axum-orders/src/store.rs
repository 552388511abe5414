//! Choosing the idempotency store from the command line: `memory`, `redis://...`,
//! `rediss://...` or `postgres://...`, opened as an [`AnyStore`].

use std::str::FromStr;

pub use idempotency_layer::store::AnyStore;

/// A `--store` argument: a store URL, checked for a known scheme when parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreArg(pub String);

impl FromStr for StoreArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let scheme = s.split_once("://").map_or(s, |(scheme, _)| scheme);
        match scheme {
            "memory" | "redis" | "rediss" | "postgres" | "postgresql" => Ok(StoreArg(s.to_owned())),
            _ => Err(format!(
                "unknown store {s:?}: use memory, redis://HOST:PORT, rediss://HOST:PORT or \
                 postgres://USER@HOST/DB"
            )),
        }
    }
}

/// Opens the store `arg` names (migrating the PostgreSQL table if needed).
pub async fn open(arg: &StoreArg) -> Result<AnyStore, idempotency_layer::StoreError> {
    let store = AnyStore::from_url(&arg.0).await?;
    store.migrate().await?;
    Ok(store)
}

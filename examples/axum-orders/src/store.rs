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

//! A handler that completes its claim in its own database transaction, so its side effects and
//! the idempotency record commit (or roll back) together.
//!
//! [`TxCompletion`] (feature `postgres`) is what the handler holds: a request extension the
//! layer inserts for the request that holds the claim, when its store offers it
//! ([`IdempotencyStore::postgres`](crate::store::IdempotencyStore::postgres)). The ledger is
//! what the handler's completions and the layer share about that claim: the layer reads it when
//! the handler returns, to know whether the record is already stored.
//!
//! This is the layer's side; the store only offers its fenced statement and connection pool.

#[cfg(feature = "postgres")]
mod completion;
mod ledger;

#[cfg(feature = "postgres")]
pub use self::completion::{TxCompletion, TxCompletionError};
pub(crate) use self::ledger::{offer, Offer, TxLedger, TxOutcome};

//! Example: an axum orders service whose writes run once per idempotency key, and a client that
//! retries through failures.
//!
//! ```text
//! cargo run -p axum-orders --bin orders-server
//! cargo run -p axum-orders --bin orders-client -- --url http://127.0.0.1:3000 create --book b1 --quantity 1
//! ```
//!
//! The library holds what the binaries, the tonic example and the end-to-end tests share: the
//! [`inventory`] (books, orders, counters of real side effects), the [`auth`] demo layer, the
//! HTTP [`server`] and its Prometheus [`metrics`] page, the retrying [`client`], the
//! [`stock`] an order takes (local, or another server's inventory), the [`store`] selection, and the graceful [`shutdown`] both example servers use.
//!
//! With `--store postgres://...`, orders go to an `orders` table in that database (`pg_orders`,
//! feature `postgres`), and each is inserted in one transaction with its idempotency record
//! (`idempotency_layer::TxCompletion`): a crash between the order's commit and its response
//! cannot make the client's retry create a second order.
//!
//! With `--inventory-url http://...`, an orders-server takes each order's stock from another
//! orders-server's inventory (`POST /books/{id}/deduct`) instead of its own: a two-tier chain
//! whose deductions go through a `RetryLayer` with keys derived from the order
//! (`--derived-keys-secret` or `DERIVED_KEYS_SECRET`, the same on every instance), so that an
//! order run twice (a crash after the deduction, a failure after it) deducts once
//! ([`stock`]; `--no-derived-keys` for the comparison).
//!
//! ```text
//! cargo run -p axum-orders --bin orders-server -- --listen 127.0.0.1:3001
//! DERIVED_KEYS_SECRET=s3cret cargo run -p axum-orders --bin orders-server -- --inventory-url http://127.0.0.1:3001
//! ```

pub mod auth;
pub mod cli;
pub mod client;
pub mod inventory;
pub mod metrics;
pub mod orders_server;
#[cfg(feature = "postgres")]
pub mod pg_orders;
pub mod server;
pub mod shutdown;
pub mod stock;
pub mod store;

//! Orders in PostgreSQL (`--store postgres://...`): an `orders` table in the idempotency store's
//! database, and the order insert that completes the request's idempotency claim in the same
//! transaction ([`TxCompletion`]), so the order row and its idempotency record commit together.
//!
//! Stock stays in the in-memory [`Inventory`]: an order takes it before the transaction and
//! puts it back if the transaction does not commit.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idempotency_layer::{PostgresStore, TxCompletion, TxCompletionError};
use serde_json::json;

use crate::inventory::{Inventory, Order};

/// The table, created at start if absent (in the schema the connection's search path names
/// first, `public` by default).
pub const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS orders (\n\
    order_id   text        PRIMARY KEY,\n\
    tenant     text        NOT NULL,\n\
    book_id    text        NOT NULL,\n\
    quantity   integer     NOT NULL,\n\
    created_at timestamptz NOT NULL DEFAULT now()\n\
)";

/// The environment variable that arms a [`Failpoint`] (unset: none).
pub const FAILPOINT_VAR: &str = "ORDERS_FAILPOINT";

/// A fault the server injects into itself, for the crash tests: armed by
/// [`FAILPOINT_VAR`] at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    /// `abort-after-commit`: the process aborts (no unwinding, no response) right after an
    /// order's transaction commits, before its response leaves: the crash that transactional
    /// completion makes harmless.
    AbortAfterCommit,
}

impl Failpoint {
    /// The failpoint [`FAILPOINT_VAR`] names; an unknown name is an error that lists the known.
    pub fn from_env() -> Result<Option<Failpoint>, String> {
        match std::env::var(FAILPOINT_VAR) {
            Err(_) => Ok(None),
            Ok(v) if v == "abort-after-commit" => Ok(Some(Failpoint::AbortAfterCommit)),
            Ok(v) => Err(format!(
                "{FAILPOINT_VAR}={v:?} is not a failpoint: use abort-after-commit, or unset it"
            )),
        }
    }
}

/// Who writes an order's idempotency record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recording {
    /// The order's own transaction ([`TxCompletion::complete_in`]): no crash can leave the order
    /// without its record. The default.
    #[default]
    InTransaction,
    /// The idempotency layer, after the handler returns (as with any other store): a crash
    /// between the order's commit and the record lets the retry create a second order. For
    /// demonstrations (`orders-server --record-after-commit`).
    AfterCommit,
}

/// Orders in the idempotency store's database: cheap to clone.
#[derive(Debug, Clone)]
pub struct PgOrders {
    store: PostgresStore,
    recording: Recording,
    failpoint: Option<Failpoint>,
}

/// Why an order was not stored (nothing committed).
#[derive(Debug)]
enum NotStored {
    Pool(String),
    Postgres(tokio_postgres::Error),
    Completion(TxCompletionError),
}

impl std::fmt::Display for NotStored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotStored::Pool(e) => write!(f, "no database connection: {e}"),
            NotStored::Postgres(e) => write!(f, "the order's transaction failed: {e}"),
            NotStored::Completion(e) => e.fmt(f),
        }
    }
}

impl From<tokio_postgres::Error> for NotStored {
    fn from(e: tokio_postgres::Error) -> Self {
        NotStored::Postgres(e)
    }
}

impl PgOrders {
    /// Orders in `store`'s database, on its pool; creates the table if absent ([`MIGRATION`]).
    pub async fn open(
        store: PostgresStore,
        recording: Recording,
        failpoint: Option<Failpoint>,
    ) -> Result<PgOrders, Box<dyn std::error::Error + Send + Sync>> {
        store.pool().get().await?.batch_execute(MIGRATION).await?;
        Ok(PgOrders {
            store,
            recording,
            failpoint,
        })
    }

    /// Creates an order of `quantity` copies of `book_id` for `tenant`: takes the stock, then
    /// inserts the order row and (unless [`Recording::AfterCommit`]) writes the request's
    /// idempotency record in the same transaction. The response: 201 and the order, or the
    /// inventory's refusal, or 503 when nothing could be committed (a retry runs again).
    pub async fn create_order(
        &self,
        inventory: &Inventory,
        completion: Option<&TxCompletion>,
        tenant: &str,
        book_id: &str,
        quantity: i64,
    ) -> Result<Response, crate::inventory::InventoryError> {
        let order = inventory.reserve(book_id, quantity).await?;
        match self.insert(&order, tenant, completion).await {
            Ok(response) => {
                inventory.confirm(&order);
                if self.failpoint == Some(Failpoint::AbortAfterCommit) {
                    eprintln!("{FAILPOINT_VAR}=abort-after-commit: aborting after the commit");
                    std::process::abort();
                }
                Ok(response)
            }
            Err(e) => {
                inventory.cancel(&order);
                tracing::warn!(error = %e, "order not stored");
                Ok((
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"error": "unavailable", "detail": e.to_string()})),
                )
                    .into_response())
            }
        }
    }

    /// Inserts `order` and, when the layer offers it, records the response in the same
    /// transaction. Any error leaves the transaction uncommitted (dropped: rolled back).
    async fn insert(
        &self,
        order: &Order,
        tenant: &str,
        completion: Option<&TxCompletion>,
    ) -> Result<Response, NotStored> {
        let mut db = self
            .store
            .pool()
            .get()
            .await
            .map_err(|e| NotStored::Pool(e.to_string()))?;
        let tx = db.transaction().await?;
        tx.execute(
            "INSERT INTO orders (order_id, tenant, book_id, quantity) VALUES ($1, $2, $3, $4)",
            &[&order.order_id, &tenant, &order.book_id, &order.quantity],
        )
        .await?;
        let response = (StatusCode::CREATED, Json(order)).into_response();
        let response = match (completion, self.recording) {
            (Some(completion), Recording::InTransaction) => completion
                .complete_in(&tx, response)
                .await
                .map_err(NotStored::Completion)?
                .into_response(),
            // No claim (a keyless request the layer let through), or the layer records it.
            _ => response,
        };
        tx.commit().await?;
        Ok(response)
    }
}

//! Orders in PostgreSQL (`--store postgres://...`): an `orders` table in the idempotency store's
//! database, and the order insert that completes the request's idempotency claim in the same
//! transaction ([`TxCompletion`]), so the order row and its idempotency record commit together.
//! The transaction is on tokio-postgres (the store's pool, [`TxCompletion::complete_in`]) or,
//! with `--orders-driver sqlx` (feature `sqlx`), on a sqlx `PgPool` of the same database
//! (`TxCompletion::complete_in_sqlx`).
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
/// first, `public` by default). `idempotency_key` is the key of the request that created the
/// order (NULL for a keyless one): counting rows per key is how the crash tests and the
/// kill-chaos soak find duplicate side effects.
pub const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS orders (\n\
    order_id        text        PRIMARY KEY,\n\
    tenant          text        NOT NULL,\n\
    book_id         text        NOT NULL,\n\
    quantity        integer     NOT NULL,\n\
    idempotency_key text,\n\
    created_at      timestamptz NOT NULL DEFAULT now()\n\
);\n\
ALTER TABLE orders ADD COLUMN IF NOT EXISTS idempotency_key text";

/// The environment variable that arms a [`Failpoint`] (unset: none).
pub const FAILPOINT_VAR: &str = "ORDERS_FAILPOINT";

/// A fault the server injects into itself, for the crash tests and the kill-chaos soak: armed by
/// [`FAILPOINT_VAR`] at start.
///
/// - `abort-after-commit`: every order aborts the process right after its commit;
/// - `abort-after-commit:P` (0 < P <= 1): each order does so with probability P, so a soak
///   crashes in that window now and then while most orders complete.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Failpoint {
    /// The process aborts (no unwinding, no response) right after an order's transaction
    /// commits, before its response leaves, with this probability per order: the crash that
    /// transactional completion makes harmless.
    AbortAfterCommit(f64),
}

impl Failpoint {
    /// The failpoint [`FAILPOINT_VAR`] names; an unknown name or a bad probability is an error
    /// that says what is accepted.
    pub fn from_env() -> Result<Option<Failpoint>, String> {
        match std::env::var(FAILPOINT_VAR) {
            Err(_) => Ok(None),
            Ok(v) => v.parse().map(Some),
        }
    }

    /// Whether this order crashes.
    fn fires(&self) -> bool {
        match *self {
            Failpoint::AbortAfterCommit(p) => p >= 1.0 || fastrand::f64() < p,
        }
    }
}

impl std::str::FromStr for Failpoint {
    type Err = String;

    fn from_str(v: &str) -> Result<Failpoint, String> {
        let (name, p) = v.split_once(':').unwrap_or((v, "1"));
        let p: f64 = p.parse().map_err(|_| {
            format!("{FAILPOINT_VAR}={v:?}: the probability after ':' must be a number")
        })?;
        match name {
            "abort-after-commit" if p > 0.0 && p <= 1.0 => Ok(Failpoint::AbortAfterCommit(p)),
            "abort-after-commit" => Err(format!(
                "{FAILPOINT_VAR}={v:?}: the probability must be in (0, 1]"
            )),
            _ => Err(format!(
                "{FAILPOINT_VAR}={v:?} is not a failpoint: use abort-after-commit or \
                 abort-after-commit:P (0 < P <= 1), or unset it"
            )),
        }
    }
}

/// Who writes an order's idempotency record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recording {
    /// The order's own transaction ([`TxCompletion::complete_in`], or `complete_in_sqlx`): no
    /// crash can leave the order
    /// without its record. The default.
    #[default]
    InTransaction,
    /// The idempotency layer, after the handler returns (as with any other store): a crash
    /// between the order's commit and the record lets the retry create a second order. For
    /// demonstrations (`orders-server --record-after-commit`).
    AfterCommit,
}

/// Orders in a PostgreSQL database (the idempotency store's, or `--orders-db`): cheap to clone.
#[derive(Debug, Clone)]
pub struct PgOrders {
    db: Db,
    recording: Recording,
    failpoint: Option<Failpoint>,
}

/// The pool the order transactions are on.
#[derive(Debug, Clone)]
enum Db {
    /// tokio-postgres: the store's own pool.
    TokioPostgres(PostgresStore),
    /// sqlx: a pool of the same database.
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::PgPool),
}

/// Why an order was not stored (nothing committed).
#[derive(Debug)]
enum NotStored {
    Pool(String),
    Postgres(tokio_postgres::Error),
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::Error),
    Completion(TxCompletionError),
}

impl std::fmt::Display for NotStored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotStored::Pool(e) => write!(f, "no database connection: {e}"),
            NotStored::Postgres(e) => write!(f, "the order's transaction failed: {e}"),
            #[cfg(feature = "sqlx")]
            NotStored::Sqlx(e) => write!(f, "the order's transaction failed: {e}"),
            NotStored::Completion(e) => e.fmt(f),
        }
    }
}

impl From<tokio_postgres::Error> for NotStored {
    fn from(e: tokio_postgres::Error) -> Self {
        NotStored::Postgres(e)
    }
}

#[cfg(feature = "sqlx")]
impl From<sqlx::Error> for NotStored {
    fn from(e: sqlx::Error) -> Self {
        NotStored::Sqlx(e)
    }
}

/// The order row.
const INSERT: &str = "INSERT INTO orders (order_id, tenant, book_id, quantity, idempotency_key) \
                      VALUES ($1, $2, $3, $4, $5)";

impl PgOrders {
    /// Orders in `store`'s database, on its pool; creates the table if absent ([`MIGRATION`]).
    pub async fn open(
        store: PostgresStore,
        recording: Recording,
        failpoint: Option<Failpoint>,
    ) -> Result<PgOrders, Box<dyn std::error::Error + Send + Sync>> {
        store.pool().get().await?.batch_execute(MIGRATION).await?;
        Ok(PgOrders {
            db: Db::TokioPostgres(store),
            recording,
            failpoint,
        })
    }

    /// Orders in the database of `url` on a sqlx pool of their own (the store's database, for
    /// [`Recording::InTransaction`]); creates the table if absent ([`MIGRATION`]).
    #[cfg(feature = "sqlx")]
    pub async fn open_sqlx(
        url: &str,
        recording: Recording,
        failpoint: Option<Failpoint>,
    ) -> Result<PgOrders, Box<dyn std::error::Error + Send + Sync>> {
        let pool = sqlx::PgPool::connect(url).await?;
        sqlx::raw_sql(MIGRATION).execute(&pool).await?;
        Ok(PgOrders {
            db: Db::Sqlx(pool),
            recording,
            failpoint,
        })
    }

    /// Creates an order of `quantity` copies of `book_id` for `tenant`, made by a request with
    /// idempotency `key`: takes the stock, then inserts the order row and (unless [`Recording::AfterCommit`]) writes the request's
    /// idempotency record in the same transaction. The response: 201 and the order, or the
    /// inventory's refusal, or 503 when nothing could be committed (a retry runs again).
    pub async fn create_order(
        &self,
        inventory: &Inventory,
        completion: Option<&TxCompletion>,
        tenant: &str,
        key: Option<&str>,
        book_id: &str,
        quantity: i64,
    ) -> Result<Response, crate::inventory::InventoryError> {
        let order = inventory.reserve(book_id, quantity).await?;
        match self.insert(&order, tenant, key, completion).await {
            Ok(response) => {
                inventory.confirm(&order);
                if self.failpoint.is_some_and(|f| f.fires()) {
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
        key: Option<&str>,
        completion: Option<&TxCompletion>,
    ) -> Result<Response, NotStored> {
        // No claim (a keyless request the layer let through), or the layer records it: `None`.
        let completion = completion.filter(|_| self.recording == Recording::InTransaction);
        let response = (StatusCode::CREATED, Json(order)).into_response();
        match &self.db {
            Db::TokioPostgres(store) => {
                let mut db = store
                    .pool()
                    .get()
                    .await
                    .map_err(|e| NotStored::Pool(e.to_string()))?;
                let tx = db.transaction().await?;
                tx.execute(
                    INSERT,
                    &[
                        &order.order_id,
                        &tenant,
                        &order.book_id,
                        &order.quantity,
                        &key,
                    ],
                )
                .await?;
                let response = match completion {
                    Some(completion) => completion
                        .complete_in(&tx, response)
                        .await
                        .map_err(NotStored::Completion)?
                        .into_response(),
                    None => response,
                };
                tx.commit().await?;
                Ok(response)
            }
            #[cfg(feature = "sqlx")]
            Db::Sqlx(pool) => {
                let mut tx = pool.begin().await?;
                sqlx::query(INSERT)
                    .bind(&order.order_id)
                    .bind(tenant)
                    .bind(&order.book_id)
                    .bind(order.quantity)
                    .bind(key)
                    .execute(&mut *tx)
                    .await?;
                let response = match completion {
                    Some(completion) => completion
                        .complete_in_sqlx(&mut tx, response)
                        .await
                        .map_err(NotStored::Completion)?
                        .into_response(),
                    None => response,
                };
                tx.commit().await?;
                Ok(response)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Failpoint;

    macro_rules! failpoints {
        ($($name:ident: $value:expr => $expected:expr;)*) => {$(
            #[test]
            fn $name() {
                assert_eq!($value.parse::<Failpoint>().ok(), $expected);
            }
        )*};
    }

    failpoints! {
        bare_name_always_fires: "abort-after-commit" => Some(Failpoint::AbortAfterCommit(1.0));
        with_a_probability: "abort-after-commit:0.02" => Some(Failpoint::AbortAfterCommit(0.02));
        probability_one: "abort-after-commit:1" => Some(Failpoint::AbortAfterCommit(1.0));
        probability_zero_is_refused: "abort-after-commit:0" => None;
        probability_above_one_is_refused: "abort-after-commit:1.5" => None;
        not_a_number_is_refused: "abort-after-commit:often" => None;
        unknown_name_is_refused: "abort-before-commit" => None;
        empty_is_refused: "" => None;
    }

    #[test]
    fn a_certain_failpoint_always_fires() {
        assert!((0..100).all(|_| Failpoint::AbortAfterCommit(1.0).fires()));
    }
}

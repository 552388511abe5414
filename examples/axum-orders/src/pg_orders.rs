//! Orders in PostgreSQL (`--store postgres://...`): an `orders` table in the idempotency store's
//! database, and the order insert that completes the request's idempotency claim in the same
//! transaction ([`TxCompletion`]), so the order row and its idempotency record commit together.
//! The transaction is on tokio-postgres (the store's pool, [`TxCompletion::complete_in`]) or,
//! with `--orders-driver sqlx` (feature `sqlx`), on a sqlx `PgPool` of the same database
//! (`TxCompletion::complete_in_sqlx`). Stock deductions (`POST /books/{id}/deduct`) are kept the
//! same way, one `deductions` row per executed deduction.
//!
//! Stock stays in the in-memory [`Inventory`] (or another server's, [`Stock::Remote`]): an order
//! takes it before the transaction and puts it back if the transaction does not commit.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idempotency_layer::{PostgresStore, TxCompletion, TxCompletionError};
use serde_json::json;

use crate::inventory::{Inventory, InventoryError};
use crate::stock::Stock;

/// The tables, created at start if absent (in the schema the connection's search path names
/// first, `public` by default). `idempotency_key` is the key of the request that created the
/// row (NULL for a keyless one): counting rows per key is how the crash tests and the
/// kill-chaos soak find duplicate side effects. A deduction's `order_ref` is the caller's
/// reference of the order it was for (an orders-server with `--inventory-url` sends its order's
/// key): counting deductions per order is how the chain's kill chaos finds a deduction run
/// twice for one order.
pub const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS orders (\n\
    order_id        text        PRIMARY KEY,\n\
    tenant          text        NOT NULL,\n\
    book_id         text        NOT NULL,\n\
    quantity        integer     NOT NULL,\n\
    idempotency_key text,\n\
    created_at      timestamptz NOT NULL DEFAULT now()\n\
);\n\
ALTER TABLE orders ADD COLUMN IF NOT EXISTS idempotency_key text;\n\
CREATE TABLE IF NOT EXISTS deductions (\n\
    deduction_id    text        PRIMARY KEY,\n\
    tenant          text        NOT NULL,\n\
    book_id         text        NOT NULL,\n\
    quantity        integer     NOT NULL,\n\
    idempotency_key text,\n\
    order_ref       text,\n\
    created_at      timestamptz NOT NULL DEFAULT now()\n\
)";

/// The environment variable that arms a [`Failpoint`] (unset: none).
pub const FAILPOINT_VAR: &str = "ORDERS_FAILPOINT";

/// A fault the server injects into itself, for the crash tests and the kill-chaos soak: armed by
/// [`FAILPOINT_VAR`] at start.
///
/// - `abort-after-commit`: every order aborts the process right after its commit;
/// - `abort-after-commit:P` (0 < P <= 1): each order does so with probability P, so a soak
///   crashes in that window now and then while most orders complete;
/// - `abort-after-side-effect[:P]`: the same, right after the order's stock was taken (with
///   `--inventory-url`: the inventory service answered the deduction) and before the order's
///   transaction, so the order is neither stored nor recorded and its retry runs it again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Failpoint {
    /// The process aborts (no unwinding, no response) right after an order's transaction
    /// commits, before its response leaves, with this probability per order: the crash that
    /// transactional completion makes harmless.
    AbortAfterCommit(f64),
    /// The process aborts right after an order's stock was taken, before its transaction, with
    /// this probability per order: the crash after a downstream side effect that derived
    /// idempotency keys make harmless.
    AbortAfterSideEffect(f64),
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
            Failpoint::AbortAfterCommit(p) | Failpoint::AbortAfterSideEffect(p) => {
                p >= 1.0 || fastrand::f64() < p
            }
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
        let failpoint = match name {
            "abort-after-commit" => Failpoint::AbortAfterCommit,
            "abort-after-side-effect" => Failpoint::AbortAfterSideEffect,
            _ => {
                return Err(format!(
                    "{FAILPOINT_VAR}={v:?} is not a failpoint: use abort-after-commit[:P] or \
                     abort-after-side-effect[:P] (0 < P <= 1), or unset it"
                ))
            }
        };
        if p > 0.0 && p <= 1.0 {
            Ok(failpoint(p))
        } else {
            Err(format!(
                "{FAILPOINT_VAR}={v:?}: the probability must be in (0, 1]"
            ))
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
const INSERT_ORDER: &str =
    "INSERT INTO orders (order_id, tenant, book_id, quantity, idempotency_key) \
     VALUES ($1, $2, $3, $4, $5)";

/// The deduction row.
const INSERT_DEDUCTION: &str = "INSERT INTO deductions \
     (deduction_id, tenant, book_id, quantity, idempotency_key, order_ref) \
     VALUES ($1, $2, $3, $4, $5, $6)";

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
    /// idempotency `key`: takes the stock (from `stock`), then inserts the order row and (unless
    /// [`Recording::AfterCommit`]) writes the request's idempotency record in the same
    /// transaction. The response: 201 and the order, or the inventory's refusal, or 503 when
    /// nothing could be committed (a retry runs again).
    #[allow(clippy::too_many_arguments)]
    pub async fn create_order(
        &self,
        stock: &Stock,
        inventory: &Inventory,
        completion: Option<&TxCompletion>,
        tenant: &str,
        key: Option<&str>,
        book_id: &str,
        quantity: i64,
    ) -> Result<Response, InventoryError> {
        let order = stock
            .reserve(inventory, tenant, key, book_id, quantity)
            .await?;
        self.crash_at(Failpoint::AbortAfterSideEffect(0.0));
        let response = (StatusCode::CREATED, Json(&order)).into_response();
        let row = Row::Order {
            order_id: &order.order_id,
            book_id: &order.book_id,
            quantity: order.quantity,
        };
        match self.insert(row, tenant, key, completion, response).await {
            Ok(response) => {
                inventory.confirm(&order);
                self.crash_at(Failpoint::AbortAfterCommit(0.0));
                Ok(response)
            }
            Err(e) => {
                stock.cancel(inventory, &order);
                Ok(not_stored(e))
            }
        }
    }

    /// Deducts `quantity` copies of `book_id` from `inventory` (if the book is still at
    /// `expected_version` when one is given) for `tenant`, by a request with idempotency `key`
    /// for the caller's order `order_ref`: inserts a `deductions` row and (unless
    /// [`Recording::AfterCommit`]) writes the request's idempotency record in the same
    /// transaction. The response: 200 and what remains, or the inventory's refusal, or 503 when
    /// nothing could be committed (the stock is put back; a retry runs again).
    #[allow(clippy::too_many_arguments)]
    pub async fn deduct(
        &self,
        inventory: &Inventory,
        completion: Option<&TxCompletion>,
        tenant: &str,
        key: Option<&str>,
        order_ref: Option<&str>,
        book_id: &str,
        quantity: i64,
        expected_version: Option<u64>,
    ) -> Result<Response, InventoryError> {
        let d = inventory
            .deduct(book_id, quantity, expected_version)
            .await?;
        let response =
            Json(json!({"book_id": book_id, "remaining": d.remaining, "version": d.version}))
                .into_response();
        let deduction_id = uuid::Uuid::new_v4().to_string();
        let row = Row::Deduction {
            deduction_id: &deduction_id,
            book_id,
            quantity: quantity as i32,
            order_ref,
        };
        match self.insert(row, tenant, key, completion, response).await {
            Ok(response) => Ok(response),
            Err(e) => {
                inventory.put_back(book_id, quantity);
                Ok(not_stored(e))
            }
        }
    }

    /// Aborts the process here if the armed failpoint is of `point`'s kind and fires.
    fn crash_at(&self, point: Failpoint) {
        let Some(armed) = self.failpoint else { return };
        if std::mem::discriminant(&armed) == std::mem::discriminant(&point) && armed.fires() {
            eprintln!("{FAILPOINT_VAR}={armed:?}: aborting");
            std::process::abort();
        }
    }

    /// Inserts `row` and, when the layer offers it, records `response` in the same
    /// transaction. Any error leaves the transaction uncommitted (dropped: rolled back).
    async fn insert(
        &self,
        row: Row<'_>,
        tenant: &str,
        key: Option<&str>,
        completion: Option<&TxCompletion>,
        response: Response,
    ) -> Result<Response, NotStored> {
        // No claim (a keyless request the layer let through), or the layer records it: `None`.
        let completion = completion.filter(|_| self.recording == Recording::InTransaction);
        match &self.db {
            Db::TokioPostgres(store) => {
                let mut db = store
                    .pool()
                    .get()
                    .await
                    .map_err(|e| NotStored::Pool(e.to_string()))?;
                let tx = db.transaction().await?;
                match row {
                    Row::Order {
                        order_id,
                        book_id,
                        quantity,
                    } => {
                        tx.execute(
                            INSERT_ORDER,
                            &[&order_id, &tenant, &book_id, &quantity, &key],
                        )
                        .await?
                    }
                    Row::Deduction {
                        deduction_id,
                        book_id,
                        quantity,
                        order_ref,
                    } => {
                        tx.execute(
                            INSERT_DEDUCTION,
                            &[
                                &deduction_id,
                                &tenant,
                                &book_id,
                                &quantity,
                                &key,
                                &order_ref,
                            ],
                        )
                        .await?
                    }
                };
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
                let query = match row {
                    Row::Order {
                        order_id,
                        book_id,
                        quantity,
                    } => sqlx::query(INSERT_ORDER)
                        .bind(order_id)
                        .bind(tenant)
                        .bind(book_id)
                        .bind(quantity)
                        .bind(key),
                    Row::Deduction {
                        deduction_id,
                        book_id,
                        quantity,
                        order_ref,
                    } => sqlx::query(INSERT_DEDUCTION)
                        .bind(deduction_id)
                        .bind(tenant)
                        .bind(book_id)
                        .bind(quantity)
                        .bind(key)
                        .bind(order_ref),
                };
                query.execute(&mut *tx).await?;
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

/// The row a write inserts.
#[derive(Debug, Clone, Copy)]
enum Row<'a> {
    /// An order (`orders`).
    Order {
        order_id: &'a str,
        book_id: &'a str,
        quantity: i32,
    },
    /// A stock deduction (`deductions`).
    Deduction {
        deduction_id: &'a str,
        book_id: &'a str,
        quantity: i32,
        order_ref: Option<&'a str>,
    },
}

/// The answer to a write that was not stored: 503, nothing committed, a retry runs again.
fn not_stored(e: NotStored) -> Response {
    tracing::warn!(error = %e, "not stored");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": "unavailable", "detail": e.to_string()})),
    )
        .into_response()
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
        after_side_effect: "abort-after-side-effect:0.1" => Some(Failpoint::AbortAfterSideEffect(0.1));
        after_side_effect_bare: "abort-after-side-effect" => Some(Failpoint::AbortAfterSideEffect(1.0));
        after_side_effect_zero_is_refused: "abort-after-side-effect:0" => None;
        empty_is_refused: "" => None;
    }

    #[test]
    fn a_certain_failpoint_always_fires() {
        assert!((0..100).all(|_| Failpoint::AbortAfterCommit(1.0).fires()));
    }
}

//! [`TxCompletion`]: a handler completes its claim inside its own PostgreSQL transaction.

use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use tokio_postgres::error::SqlState;
use tokio_postgres::Transaction;

use super::ledger::{Offer, RecordedInTx, TxLedger};
use crate::body::IdempotencyBody;
use crate::config::Config;
use crate::store::postgres::{affected, CompleteParams};
use crate::store::{codec, Fingerprint, PostgresStore, ScopeKey, StoreError, Token};
use crate::write::record_rules::{self, AtHead, Finished, RecordBuilder};
use reason_code::BoxError;

/// Completes the claim of the request being handled inside the handler's own PostgreSQL
/// transaction, so the handler's side effects and the idempotency record commit (or roll back)
/// together.
///
/// # Why
///
/// Without it there is one window in which a retried write still runs twice: the handler's
/// transaction commits its side effect, then the instance dies (or loses the store for longer
/// than the lease) before the layer stores the record; the claim's lease lapses, and the client's
/// retry runs the handler again. When the side effect lives in the same PostgreSQL database as
/// the [`PostgresStore`], the record can be written by the handler's transaction itself (the
/// "atomic phases" of Brandur Leach's *Implementing Stripe-like Idempotency Keys in Postgres*):
///
/// - the transaction commits: the side effect and the record exist together. If the instance
///   dies before the response leaves, the retry gets the replay;
/// - the transaction rolls back (or the instance dies before the commit): neither exists. The
///   layer releases the claim when the handler returns (or, after a crash, its lease lapses), and
///   the retry runs the handler once.
///
/// # How
///
/// The layer inserts a `TxCompletion` into the request's extensions when its store is a
/// [`PostgresStore`] (or an [`AnyStore`](crate::store::AnyStore) holding one) and the request
/// holds the claim of its key (it is the first request: duplicates wait or replay and never
/// reach the handler). The handler, in a transaction on the store's database (take a connection
/// from [`PostgresStore::pool`], or from any pool of the same database):
///
/// 1. does its writes;
/// 2. builds its response and hands it to [`complete_in`](Self::complete_in), which reads the
///    body to its end, builds the record exactly as the layer would (status, headers, body,
///    trailers; the same `max_record_bytes` and table), and writes it with the store's own
///    fenced statement (`UPDATE ... WHERE scope = $1 AND token = $2 AND state = 'in_flight'`,
///    the same SQL, schema and table) in the transaction;
/// 3. commits, and returns the response `complete_in` gave back.
///
/// The layer recognizes that response as the one recorded by the handler's last `complete_in`,
/// and leaves the claim as the commit left it: no second write, no release. Replays are the same
/// as if the layer had recorded the response itself.
///
/// A handler on sqlx does the same in a `sqlx::Transaction` (`pool.begin()`, on a pool of the
/// store's database) with [`complete_in_sqlx`] (feature `sqlx`): the same record, statement
/// and rules.
///
#[cfg_attr(
    feature = "sqlx",
    doc = "[`complete_in_sqlx`]: TxCompletion::complete_in_sqlx"
)]
#[cfg_attr(
    not(feature = "sqlx"),
    doc = "[`complete_in_sqlx`]: https://docs.rs/idempotency-layer/latest/idempotency_layer/struct.TxCompletion.html#method.complete_in_sqlx"
)]
///
/// # Example
///
/// ```
/// use axum::extract::State;
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use axum::routing::post;
/// use axum::{Extension, Router};
/// use idempotency_layer::{IdempotencyLayer, PostgresStore, TxCompletion};
/// use tower::ServiceExt;
///
/// /// Creates an order: the order row and the idempotency record commit in one transaction.
/// async fn create_order(
///     State(store): State<PostgresStore>,
///     Extension(completion): Extension<TxCompletion>,
///     item: String,
/// ) -> Result<Response, Failed> {
///     let mut db = store.pool().get().await?;
///     let tx = db.transaction().await?;
///     let row = tx
///         .query_one("INSERT INTO orders (item) VALUES ($1) RETURNING id", &[&item])
///         .await?;
///     let id: i64 = row.get(0);
///     let response = (StatusCode::CREATED, format!("order {id}")).into_response();
///     // Fenced by the claim's token; an error means: roll back (dropping `tx` does).
///     let response = completion.complete_in(&tx, response).await?;
///     tx.commit().await?;
///     Ok(response.into_response())
/// }
///
/// /// Nothing committed: 503, which clients retry (the claim is released, the retry runs once).
/// struct Failed(String);
///
/// impl<E: std::error::Error> From<E> for Failed {
///     fn from(e: E) -> Self {
///         Failed(e.to_string())
///     }
/// }
///
/// impl IntoResponse for Failed {
///     fn into_response(self) -> Response {
///         (StatusCode::SERVICE_UNAVAILABLE, self.0).into_response()
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let Ok(url) = std::env::var("DATABASE_URL") else { return Ok(()) };
/// # // A schema of this run's own, where the pool's connections also find `orders`.
/// # let schema = format!("doc_{}", uuid::Uuid::new_v4().simple());
/// # let url = format!("{url}{}options=-csearch_path%3D{schema}", if url.contains('?') { '&' } else { '?' });
/// let store = PostgresStore::builder(&url).schema(&schema).connect().await?;
/// store.migrate().await?;
/// store
///     .pool()
///     .get()
///     .await?
///     .batch_execute("CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)")
///     .await?;
/// let app = Router::new()
///     .route("/orders", post(create_order))
///     .with_state(store.clone())
///     .layer(IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("shop")));
///
/// let order = || {
///     http::Request::post("/orders")
///         .header("x-idempotency-key", "order-7f3a9c21")
///         .body(axum::body::Body::from("a book"))
///         .unwrap()
/// };
/// let first = app.clone().oneshot(order()).await?;
/// assert_eq!(first.status(), StatusCode::CREATED);
/// let retry = app.clone().oneshot(order()).await?;
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// let body = |r: Response| async move { axum::body::to_bytes(r.into_body(), 1024).await.unwrap() };
/// assert_eq!(body(retry).await, body(first).await);
///
/// let orders: i64 = store.pool().get().await?
///     .query_one("SELECT count(*) FROM orders", &[]).await?.get(0);
/// assert_eq!(orders, 1, "the handler ran once");
/// # store.pool().get().await?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await?;
/// # Ok(())
/// # }
/// ```
///
/// # Rules
///
/// - **Call it last, then commit at once.** Until the commit, the claim's row is locked by the
///   transaction: the layer's lease renewal and the claims of duplicates wait for it.
/// - **Return the response it gave back, and only after the commit succeeded.** That response is
///   how the layer knows the record is stored. If the handler returns anything else after calling
///   `complete_in` (another response, an error, a panic), the layer cannot know whether the
///   transaction committed, and asks the store with a fenced release: if no transaction
///   committed, the claim is released and the handler's response goes out unrecorded (a retry
///   runs again, as after any rollback); if one did, the client gets the recorded response
///   instead of the handler's, the same as every duplicate. A transaction retry loop (a
///   serialization failure, say) may call `complete_in` once per attempt; only the last call's
///   response counts.
/// - **On an error, roll back.** [`TxCompletionError::Fenced`] means another request owns the key
///   now (this claim's lease lapsed and it was taken over, or the key was forgotten): committing
///   the side effect would run it twice. Answer with a retryable status (503): the client's retry
///   then waits for, or replays, the request that owns the key.
/// - **An outcome the layer does not record is not recorded here either.** A response whose code
///   the table does not record (a 5xx, a 409, ...) is returned as it is, and nothing is written:
///   the layer releases the claim when the response leaves, as usual.
/// - **The transaction must be on the store's database** (any schema search path: the statement
///   names the store's schema and table). Read committed, PostgreSQL's default, is right; under
///   repeatable read or serializable, a lease renewal committed after the transaction's snapshot
///   makes the statement fail with a serialization failure (retry the transaction). The record's
///   TTL counts from the transaction's start (PostgreSQL's `now()`).
/// - **HTTP handlers with whole responses.** The body is read to its end before the record is
///   written (a streamed body is buffered, and sent whole afterwards). A tonic handler cannot use
///   it: tonic encodes the response after the handler returns. Put no middleware that rewrites
///   responses (compression, say) between the layer and the handler: the record is what the
///   handler gave `complete_in`.
#[derive(Clone)]
pub struct TxCompletion {
    store: PostgresStore,
    scope: ScopeKey,
    token: Token,
    fingerprint: Fingerprint,
    config: Arc<Config>,
    grpc: bool,
    ledger: Arc<TxLedger>,
}

impl fmt::Debug for TxCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxCompletion")
            .field("table", &self.store.table())
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl TxCompletion {
    pub(crate) fn new(store: PostgresStore, offer: Offer<'_>, ledger: Arc<TxLedger>) -> Self {
        TxCompletion {
            store,
            scope: offer.scope,
            token: offer.token,
            fingerprint: offer.fingerprint,
            config: offer.config.clone(),
            grpc: offer.grpc,
            ledger,
        }
    }

    /// Records `response` as the outcome of this request's claim inside `tx`, fenced by the
    /// claim's token, and returns the response to send (its body read whole): commit `tx`, then
    /// return it from the handler. See the [type docs](Self) for the rules.
    ///
    /// A response the layer would not record (by its [`RetryTable`](reason_code::RetryTable))
    /// comes back unchanged, and nothing is written.
    ///
    /// `tx` may be a `deadpool_postgres::Transaction` (`&tx` dereferences to the
    /// `tokio_postgres` one). The statement is sent unprepared with its parameter types (one
    /// round trip, nothing left on the connection). A handler on sqlx calls
    /// [`complete_in_sqlx`] (feature `sqlx`) instead.
    ///
    #[cfg_attr(
        feature = "sqlx",
        doc = "[`complete_in_sqlx`]: TxCompletion::complete_in_sqlx"
    )]
    #[cfg_attr(
        not(feature = "sqlx"),
        doc = "[`complete_in_sqlx`]: https://docs.rs/idempotency-layer/latest/idempotency_layer/struct.TxCompletion.html#method.complete_in_sqlx"
    )]
    ///
    /// # Errors
    ///
    /// Nothing was recorded; roll the transaction back. See [`TxCompletionError`].
    pub async fn complete_in<B>(
        &self,
        tx: &Transaction<'_>,
        response: Response<B>,
    ) -> Result<Response<IdempotencyBody<B>>, TxCompletionError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let write = match self.prepare(response).await? {
            Prepared::NotRecordable(response) => return Ok(response),
            Prepared::Write(write) => write,
        };
        let params = write.params(self);
        let rows = tx
            .query_typed(self.store.complete_statement(), &params.typed())
            .await
            .map_err(|e| match e.code() {
                Some(&SqlState::UNDEFINED_TABLE) => TxCompletionError::OtherDatabase,
                _ => TxCompletionError::Postgres(e),
            })?;
        self.finish(write, affected(&rows)).await
    }

    /// [`complete_in`](Self::complete_in) for a handler on [sqlx](https://docs.rs/sqlx)
    /// (feature `sqlx`): records `response` as the outcome of this request's claim inside `tx`,
    /// fenced by the claim's token, and returns the response to send (its body read whole):
    /// commit `tx`, then return it from the handler. The same record, statement, fencing and
    /// [rules](Self#rules) as `complete_in`.
    ///
    /// `tx` is the transaction of `pool.begin()` or `conn.begin()`: pass `&mut tx`. Its pool must
    /// be on the store's database (the same `DATABASE_URL`; sqlx keeps a pool of its own beside
    /// the store's). The statement is prepared and cached on the connection as sqlx does for
    /// every query (one round trip once cached).
    ///
    /// # Example
    ///
    /// ```
    /// use axum::extract::State;
    /// use axum::http::StatusCode;
    /// use axum::response::{IntoResponse, Response};
    /// use axum::routing::post;
    /// use axum::{Extension, Router};
    /// use idempotency_layer::{IdempotencyLayer, PostgresStore, TxCompletion};
    /// use sqlx::PgPool;
    /// use tower::ServiceExt;
    ///
    /// /// Creates an order: the order row and the idempotency record commit in one transaction.
    /// async fn create_order(
    ///     State(db): State<PgPool>,
    ///     Extension(completion): Extension<TxCompletion>,
    ///     item: String,
    /// ) -> Result<Response, Failed> {
    ///     let mut tx = db.begin().await?;
    ///     let (id,): (i64,) = sqlx::query_as("INSERT INTO orders (item) VALUES ($1) RETURNING id")
    ///         .bind(item)
    ///         .fetch_one(&mut *tx)
    ///         .await?;
    ///     let response = (StatusCode::CREATED, format!("order {id}")).into_response();
    ///     // Fenced by the claim's token; an error means: roll back (dropping `tx` does).
    ///     let response = completion.complete_in_sqlx(&mut tx, response).await?;
    ///     tx.commit().await?;
    ///     Ok(response.into_response())
    /// }
    ///
    /// /// Nothing committed: 503, which clients retry (the claim is released, the retry runs once).
    /// struct Failed(String);
    ///
    /// impl<E: std::error::Error> From<E> for Failed {
    ///     fn from(e: E) -> Self {
    ///         Failed(e.to_string())
    ///     }
    /// }
    ///
    /// impl IntoResponse for Failed {
    ///     fn into_response(self) -> Response {
    ///         (StatusCode::SERVICE_UNAVAILABLE, self.0).into_response()
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let Ok(url) = std::env::var("DATABASE_URL") else { return Ok(()) };
    /// # // A schema of this run's own, where the pools' connections also find `orders`.
    /// # let schema = format!("doc_{}", uuid::Uuid::new_v4().simple());
    /// # let url = format!("{url}{}options=-csearch_path%3D{schema}", if url.contains('?') { '&' } else { '?' });
    /// let store = PostgresStore::builder(&url).schema(&schema).connect().await?;
    /// store.migrate().await?;
    /// let db = PgPool::connect(&url).await?; // the same database
    /// sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)")
    ///     .execute(&db)
    ///     .await?;
    /// let app = Router::new()
    ///     .route("/orders", post(create_order))
    ///     .with_state(db.clone())
    ///     .layer(IdempotencyLayer::new(store.clone()).tenant(idempotency_layer::TenantSource::fixed("shop")));
    ///
    /// let order = || {
    ///     http::Request::post("/orders")
    ///         .header("x-idempotency-key", "order-7f3a9c21")
    ///         .body(axum::body::Body::from("a book"))
    ///         .unwrap()
    /// };
    /// let first = app.clone().oneshot(order()).await?;
    /// assert_eq!(first.status(), StatusCode::CREATED);
    /// let retry = app.clone().oneshot(order()).await?;
    /// assert_eq!(retry.headers()["idempotent-replayed"], "true");
    /// let body = |r: Response| async move { axum::body::to_bytes(r.into_body(), 1024).await.unwrap() };
    /// assert_eq!(body(retry).await, body(first).await);
    ///
    /// let (orders,): (i64,) = sqlx::query_as("SELECT count(*) FROM orders").fetch_one(&db).await?;
    /// assert_eq!(orders, 1, "the handler ran once");
    /// # sqlx::query(&format!("DROP SCHEMA {schema} CASCADE")).execute(&db).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// Nothing was recorded; roll the transaction back. See [`TxCompletionError`]; sqlx's own
    /// errors are [`TxCompletionError::Sqlx`].
    #[cfg(feature = "sqlx")]
    pub async fn complete_in_sqlx<B>(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        response: Response<B>,
    ) -> Result<Response<IdempotencyBody<B>>, TxCompletionError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        use sqlx::Row as _;

        let write = match self.prepare(response).await? {
            Prepared::NotRecordable(response) => return Ok(response),
            Prepared::Write(write) => write,
        };
        let params = write.params(self);
        // Unnamed, as `complete_in` sends it: a named statement would stay on the server
        // session, where a pooler in transaction mode hands it to another client.
        let row = params
            .bind(sqlx::query(self.store.complete_statement()).persistent(false))
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(db)
                    if db.code().as_deref() == Some(SqlState::UNDEFINED_TABLE.code()) =>
                {
                    TxCompletionError::OtherDatabase
                }
                _ => TxCompletionError::Sqlx(e),
            })?;
        let affected = row.try_get::<i64, _>(0).map_err(TxCompletionError::Sqlx)?;
        self.finish(write, affected).await
    }

    /// What every transaction client shares before the fenced statement: the response
    /// classified as the layer would ([`record_rules::at_head`], then at its end), its body read
    /// whole, the record built and encoded, and the write counted in the ledger (refused once
    /// the handler has returned).
    async fn prepare<B>(&self, response: Response<B>) -> Result<Prepared<B>, TxCompletionError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = response.into_parts();
        let head_code = match record_rules::at_head(
            &self.config,
            self.grpc,
            parts.status,
            &parts.headers,
        ) {
            AtHead::NotRecordable(code) => {
                tracing::debug!(%code, "idempotency: outcome not recordable; nothing written in the transaction");
                return Ok(Prepared::NotRecordable(Response::from_parts(
                    parts,
                    IdempotencyBody::inner(body),
                )));
            }
            AtHead::Record(head_code) => head_code,
        };
        let mut record = RecordBuilder::new(
            self.fingerprint,
            parts.status,
            parts.headers.clone(),
            head_code,
            self.config.max_record_bytes,
        );
        let mut chunks = Vec::new();
        let mut body = std::pin::pin!(body);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| TxCompletionError::Body(e.into()))?;
            record.observe(&frame);
            if let Ok(data) = frame.into_data() {
                chunks.push(data);
            }
        }
        let trailers = record.trailers().cloned();
        let record = match record.finish(&self.config) {
            Finished::Recorded(record) => record,
            Finished::NotRecorded(code, _) => {
                tracing::debug!(%code, "idempotency: outcome not recordable; nothing written in the transaction");
                return Ok(Prepared::NotRecordable(Response::from_parts(
                    parts,
                    IdempotencyBody::replay(concat(chunks), trailers),
                )));
            }
        };
        let encoded = codec::encode(&record).map_err(TxCompletionError::Store)?;
        let marker = self
            .ledger
            .start_write()
            .map_err(|_| TxCompletionError::HandlerReturned)?;
        let data = if record.body_omitted {
            concat(chunks)
        } else {
            record.body
        };
        Ok(Prepared::Write(PendingWrite {
            parts,
            data,
            trailers,
            encoded,
            marker,
        }))
    }

    /// What every transaction client shares after the fenced statement changed `affected` rows:
    /// none, the claim is not this request's (or the transaction is elsewhere); one, the
    /// response to send, marked as the one this write recorded.
    async fn finish<B>(
        &self,
        write: PendingWrite,
        affected: i64,
    ) -> Result<Response<IdempotencyBody<B>>, TxCompletionError> {
        if affected == 0 {
            return Err(self.why_fenced().await);
        }
        tracing::debug!(scope = ?self.scope, "idempotency: recorded in the handler's transaction");
        let PendingWrite {
            mut parts,
            data,
            trailers,
            marker,
            ..
        } = write;
        parts.extensions.insert(marker);
        Ok(Response::from_parts(
            parts,
            IdempotencyBody::replay(data, trailers),
        ))
    }

    /// The fenced statement changed no row: the claim is someone else's now, or the transaction
    /// does not see the store's table (another database), which the store itself tells apart.
    async fn why_fenced(&self) -> TxCompletionError {
        match self.store.held(&self.scope, self.token, false).await {
            Ok(Some(_)) => TxCompletionError::OtherDatabase,
            Ok(None) | Err(_) => TxCompletionError::Fenced,
        }
    }
}

/// The body's data frames as one buffer (no copy for a body of one frame).
fn concat(chunks: Vec<Bytes>) -> Bytes {
    match <[Bytes; 1]>::try_from(chunks) {
        Ok([one]) => one,
        Err(chunks) => {
            let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for c in &chunks {
                all.extend_from_slice(c);
            }
            all.freeze()
        }
    }
}

/// A response handed to a completion, once read: sent as it is, or recorded first.
enum Prepared<B> {
    /// The layer would not record it: nothing is written in the transaction.
    NotRecordable(Response<IdempotencyBody<B>>),
    /// Its record, for the fenced statement.
    Write(PendingWrite),
}

/// A record ready for the fenced statement, and the response to send once it is written.
struct PendingWrite {
    parts: http::response::Parts,
    /// The body to send (all of it, also when the record omits it).
    data: Bytes,
    trailers: Option<http::HeaderMap>,
    /// The record, encoded: the statement's `$3`.
    encoded: Vec<u8>,
    /// Which write of the claim this is, for the response's extensions.
    marker: RecordedInTx,
}

impl PendingWrite {
    /// The fenced statement's parameters.
    fn params<'a>(&'a self, completion: &'a TxCompletion) -> CompleteParams<'a> {
        CompleteParams::new(
            &completion.scope,
            completion.token,
            &self.encoded,
            completion.config.ttl,
        )
    }
}

/// Why [`TxCompletion::complete_in`] (or `complete_in_sqlx`) recorded nothing. In every case,
/// roll the transaction back.
#[derive(Debug)]
#[non_exhaustive]
pub enum TxCompletionError {
    /// The claim is no longer this request's: its lease lapsed and another request took the key
    /// over, or an operator forgot the key. Committing would run the side effect twice.
    Fenced,
    /// The transaction is not on the store's database: the store's table is missing there, or
    /// the claim's row is not in it while the store still sees it held.
    OtherDatabase,
    /// The handler had already returned its response when `complete_in` was called (from a task
    /// it spawned): the layer has settled the claim.
    HandlerReturned,
    /// The response body failed while it was read.
    Body(BoxError),
    /// PostgreSQL failed the statement; the transaction is aborted. A serialization failure
    /// (SQLSTATE 40001) may be retried in a new transaction.
    Postgres(tokio_postgres::Error),
    /// [`complete_in_sqlx`](TxCompletion::complete_in_sqlx): sqlx or PostgreSQL failed the
    /// statement (feature `sqlx`); the transaction is aborted or its connection lost. A
    /// serialization failure (SQLSTATE 40001) may be retried in a new transaction.
    #[cfg(feature = "sqlx")]
    Sqlx(sqlx::Error),
    /// The record could not be encoded.
    Store(StoreError),
}

impl fmt::Display for TxCompletionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TxCompletionError::Fenced => f.write_str(
                "the claim on this idempotency key was taken over (its lease lapsed) or \
                 forgotten, so another request owns the key: roll the transaction back and \
                 answer with a retryable status (503); the client's retry gets that request's \
                 outcome",
            ),
            TxCompletionError::OtherDatabase => f.write_str(
                "the transaction is not on the idempotency store's database: roll it back, and \
                 open the handler's transaction on the store's database (PostgresStore::pool, \
                 or a sqlx pool of the same database URL)",
            ),
            TxCompletionError::HandlerReturned => f.write_str(
                "the handler had already returned its response: call complete_in, and commit, \
                 before the handler returns; roll this transaction back",
            ),
            TxCompletionError::Body(e) => write!(
                f,
                "the response body failed while it was recorded ({e}): roll the transaction back"
            ),
            TxCompletionError::Postgres(e) => statement_failed(f, e),
            #[cfg(feature = "sqlx")]
            TxCompletionError::Sqlx(e) => statement_failed(f, e),
            TxCompletionError::Store(e) => write!(
                f,
                "the response could not be recorded ({e}): roll the transaction back"
            ),
        }
    }
}

/// The database failed the fenced statement (`e`, from either client).
fn statement_failed(f: &mut fmt::Formatter<'_>, e: &dyn fmt::Display) -> fmt::Result {
    write!(
        f,
        "recording the response in the transaction failed ({e}): roll it back (a serialization \
         failure may be retried in a new transaction)"
    )
}

impl std::error::Error for TxCompletionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TxCompletionError::Body(e) => Some(&**e),
            TxCompletionError::Postgres(e) => Some(e),
            #[cfg(feature = "sqlx")]
            TxCompletionError::Sqlx(e) => Some(e),
            TxCompletionError::Store(e) => Some(e),
            _ => None,
        }
    }
}

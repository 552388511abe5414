//! [`PostgresStore`]: claims and records in a PostgreSQL table, shared by every instance.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use uuid::Uuid;

use super::codec;
use super::near_cache::{Near, NearCacheStats, Ticket};
use super::wake::{Polling, Waiters};
use super::{
    Backend, Begin, Fingerprint, Held, IdempotencyStore, Record, ScopeKey, StoreError, Token,
    LATE_COMPLETE_GRACE,
};

mod builder;
mod busy;
mod listen;
mod sql;

pub use self::builder::PostgresStoreBuilder;
use self::listen::*;
use self::sql::*;
pub(crate) use self::sql::{affected, CompleteParams};

use busy::{Busy, Canceller};

/// How often `begin` runs its claim again when a concurrent transaction inserted the row after
/// the statement's snapshot (the claim then neither inserts nor sees the row).
const CLAIM_ATTEMPTS: usize = 10;

/// The PostgreSQL store: one row per scope in a table, visible to every instance of a service.
///
/// # The table
///
/// [`migrate`](PostgresStore::migrate) creates it if absent (with the defaults below: schema
/// `public`, table `idempotency_records`):
///
/// ```sql
/// CREATE SCHEMA IF NOT EXISTS "public";
/// CREATE TABLE IF NOT EXISTS "public"."idempotency_records" (
///     scope       bytea       PRIMARY KEY,  -- ScopeKey: a hash, never the raw tenant or key
///     state       text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
///     token       uuid        NOT NULL,     -- the fencing token (128 random bits)
///     fingerprint bytea       NOT NULL,
///     expires_at  timestamptz NOT NULL,     -- in flight: end of the lease; completed: end of the TTL
///     record      bytea,                    -- the response (postcard), when completed
///     watched     boolean     NOT NULL DEFAULT false, -- a waiter wants the end notified
///     CHECK ((state = 'completed') = (record IS NOT NULL))
/// );
/// CREATE INDEX IF NOT EXISTS "idempotency_records_expires_at"
///     ON "public"."idempotency_records" (expires_at);
/// ```
///
/// Every time is the database's own clock (`now()`), so instances with skewed clocks agree.
///
/// # Statements: one per operation
///
/// - `begin` is one statement that writes only when it claims: a `SELECT` of the live row (a
///   record or a held claim), and only when there is none an `INSERT ... ON CONFLICT (scope) DO
///   UPDATE ... WHERE expires_at <= now()` (a lapsed lease or an expired record is taken over
///   with a new token). A replay therefore takes no transaction id, writes no WAL and waits for
///   no commit flush, and replays of one key never queue on its row lock. In the rare race
///   where another transaction inserted the row after the statement's snapshot, the statement
///   runs again.
/// - **With a synchronous standby** (`synchronous_standby_names` set, `synchronous_commit`
///   above `local`; the claim statement reads both each time) a replay then locks its row
///   `FOR SHARE` in a second statement, whose commit waits for the standby: a record is
///   replayed only once the standby has it.
///   A commit whose wait for the standby was cancelled (the store cancels what it gave up on)
///   is visible on the primary at once, and a plain read would answer a duplicate with a record
///   a failover can still lose. A replay then costs a second round trip and a commit that
///   waits for the standby (measured: 5 241 replays/s against 16 532 without a synchronous
///   standby; see BENCHMARKS.md); the [near cache](PostgresStoreBuilder::near_cache) answers
///   repeated replays without it. Without a synchronous standby nothing changes.
/// - `complete`, `release`, `renew` are fenced: `UPDATE`/`DELETE ... WHERE scope = $1 AND
///   token = $2 AND state = 'in_flight'`; no row matched is [`StoreError::Fenced`]. `complete`,
///   `release` and `forget` call `pg_notify` in the same statement only when a waiter marked
///   the row `watched`: a transaction that sent a NOTIFY holds a server-wide lock through its
///   commit, which would serialize every completion in the server.
/// - Statements are prepared once per pooled connection (`prepare_cached`); behind a pooler in
///   transaction mode (`pooling=transaction`, see [`PostgresStore::builder`]) each
///   is sent unnamed with its parameters instead, in the same single round trip.
/// - Renewals run on two connections of their own, which handlers' transactions cannot take,
///   and skip (rather than wait for) a row another transaction holds locked.
///
/// # Waiters
///
/// A dedicated connection per store `LISTEN`s on the table's channel (`idem_` + a hash of the
/// schema and table name; the payload is the scope in hex) and reconnects by itself. It proves
/// it hears with a heartbeat notification every 5 s
/// ([`listener_hears`](PostgresStore::listener_hears)). A waiter also polls with backoff (25 ms
/// doubling to 1 s by default), so a lost notification, or a listener that cannot hear, delays
/// it at most one poll interval and never hangs it.
///
/// # Expiry
///
/// Expired rows are ignored by `begin` at once (taken over), and removed by a background task
/// in batches (`DELETE ... WHERE scope IN (SELECT scope ... LIMIT n FOR UPDATE SKIP LOCKED)`;
/// by primary key, so a table partitioned by `scope` is cleaned correctly too),
/// every [`cleanup_interval`](PostgresStoreBuilder::cleanup_interval); or on demand with
/// [`remove_expired`](PostgresStore::remove_expired). The cleanup removes records past their TTL
/// at once, but a claim only an hour after its lease lapsed: until then a new `begin` takes it
/// over, and a late leader that nobody took it from can still complete it and store its record
/// (the same grace as on Redis, where a claim's key outlives its lease by an hour).
///
/// # Transactional completion
///
/// A handler whose side effects go to the same database can write the record in its own
/// transaction, with the [`TxCompletion`](crate::TxCompletion) the layer puts in its request's extensions and a
/// connection from [`pool`](PostgresStore::pool): the side effect and the record then commit
/// or roll back together, and no crash between them can make a retry run twice. It runs the
/// same fenced `complete` statement, on the handler's connection, unprepared (one round trip).
///
/// # Choosing a store
///
/// Measured by the `benchmarks` loadtest (`pg_stat_database.xact_commit` deltas): a first
/// execution costs 2 statements, each one round trip (claim, complete), a replay 1. See the
/// comparison table on `RedisStore` (feature `redis`); in short,
/// PostgreSQL keeps records as durably as the rest of your data (they survive a restart of the
/// service and of the server; with a synchronous standby, a failover too), at the cost of one
/// pooled connection per statement in flight and of dead tuples for autovacuum.
///
/// **What a multi-instance deployment needs**: every instance on the same primary, the same
/// [schema](PostgresStoreBuilder::schema) and [table](PostgresStoreBuilder::table), and the
/// same layer configuration ([`lease`](crate::IdempotencyLayer::lease),
/// [`ttl`](crate::IdempotencyLayer::ttl), key headers, tenant source). Not a read replica:
/// every statement writes or must see the latest write. Through PgBouncer (or any pooler) in
/// transaction mode, say so with `pooling=transaction` in the URL
/// ([`PostgresStore::builder`]): the store then prepares no statement and sets nothing on a session; and give
/// its listener a direct URL ([`listen_url`](PostgresStoreBuilder::listen_url)), since a
/// transaction pooler does not carry `LISTEN`.
///
/// # Deploying
///
/// - **Roles**: run the application as a role with `USAGE` on the schema and `SELECT, INSERT,
///   UPDATE, DELETE` on the table; create the table once as its owner
///   ([`PostgresStoreBuilder::migration_sql`], no connection needed; the default schema and
///   table's is the crate's `migrations/postgres.sql`). [`migrate`](PostgresStore::migrate)
///   then changes nothing and needs no `CREATE`; it is safe for N replicas starting at once.
/// - **TLS**: `sslmode=require` in the URL with the `postgres-tls` feature (rustls): encrypted,
///   and with [`tls_root_certificates`](PostgresStoreBuilder::tls_root_certificates) the
///   server's certificate is checked, like libpq's `sslrootcert`.
/// - **Your own pool**: [`builder_from_pool`](PostgresStore::builder_from_pool) (a
///   `deadpool_postgres::Pool`, re-exported as `idempotency_layer::deadpool_postgres`). An
///   application on sqlx keeps its `PgPool` and gives the store a small pool of its own on
///   the same database: the store's statements run on tokio-postgres (unnamed statements
///   behind a pooler, the cancel protocol, its own renewal connections), which a sqlx pool
///   cannot carry. What must share the application's connection is the record of a write,
///   and it does: `TxCompletion::complete_in_sqlx` writes it in the handler's own
///   `sqlx::Transaction`.
/// - **Sizing**: the table holds about `writes per second x TTL` rows; the cleanup removes
///   every expired row each [`cleanup_interval`](PostgresStoreBuilder::cleanup_interval), in
///   batches (measured here: ~200 000 rows/s), so it keeps up with any write rate the store
///   itself sustains. Autovacuum reclaims the space.
/// - **Failover**: committed rows are durable; with a synchronous standby a failover loses
///   none. Point every instance at the primary (not a read replica), through an address that
///   follows it (a DNS name, a proxy, or libpq-style `target_session_attrs=read-write` with
///   several hosts). After a failover the pool's connections may still reach the old primary,
///   now read-only: the first statement that fails there (SQLSTATE 25006, or a shutdown error)
///   drops that connection and every idle one, so one request per instance in flight at that
///   moment answers 503 (retryable, nothing ran), and the next connections go to the new
///   primary.
/// - **Timeouts**: the store's own pools set `statement_timeout` and `lock_timeout` to the
///   store's [timeout](PostgresStoreBuilder::timeout) on their sessions (a pool of your own
///   keeps its settings: set them there; behind a pooler in transaction mode nothing is set on
///   a session, since it would leak to the pooler's other clients: set the pooler's
///   `query_timeout`). A statement still running when its request gives up
///   (the timeout, or a client that went away) is cancelled on the server and its connection
///   leaves the pool, so it neither stalls the next statements (behind the row lock of an open
///   `TxCompletion` transaction, say) nor lands later: a claim abandoned that way is released
///   by its token in the background, once at once and once more twice the timeout later.
///   Every abandoned statement is cancelled, at most four at once (each cancel is a connection
///   of its own; the others wait their turn, up to the timeout), and its connection is closed
///   once it answers again: a commit waiting for a synchronous standby ends only on a cancel,
///   never when its connection closes, so a standby away for minutes leaves no backend
///   waiting. To one server over TCP (PgBouncer's address, typically), a cancel is sent as
///   libpq sends it, its connection kept open until the server closes it: PgBouncer 1.18
///   (Debian 12's; its issues #801 and #1376 report the same up to 1.24) exits on a fatal
///   error when a cancel's client closes first, as `tokio-postgres`'s own cancel does (the
///   store tests crashed PgBouncer 1.18 in every run with that cancel). Through several hosts
///   or a Unix socket, `tokio-postgres` sends the cancel: in front of PgBouncer, give the
///   store its one TCP address.
///   Your own transactions on [`pool`](PostgresStore::pool) connections inherit those
///   settings: `SET LOCAL statement_timeout` in a transaction that needs longer.
/// - **Eviction, cluster**: nothing is evicted; records go only when expired or forgotten.
///
/// **Knobs**: [`pool_size`](PostgresStoreBuilder::pool_size) (default 16; each request holds a
/// connection only for one statement), [`timeout`](PostgresStoreBuilder::timeout) (how fast an
/// outage fails closed, default 2 s), [`cleanup_interval`](PostgresStoreBuilder::cleanup_interval)
/// and [`cleanup_batch`](PostgresStoreBuilder::cleanup_batch),
/// [`poll_interval`](PostgresStoreBuilder::poll_interval); on the layer,
/// [`lease`](crate::IdempotencyLayer::lease) (default 30 s) and
/// [`ttl`](crate::IdempotencyLayer::ttl) (default 24 h; the table holds about
/// `requests per second x TTL` rows).
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, PostgresStore};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotency_layer::StoreError> {
/// # let Ok(url) = std::env::var("DATABASE_URL") else { return Ok(()) };
/// let store = PostgresStore::builder(url) // e.g. "postgres://app@db.internal/orders"
///     .table("idempotency_records")
///     .pool_size(16)
///     .connect()
///     .await?;
/// store.migrate().await?; // creates the table and index if absent
/// let layer = IdempotencyLayer::new(store)
///     .lease(Duration::from_secs(30))
///     .ttl(Duration::from_secs(24 * 3600));
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// Behind a transaction pooler: no statement is prepared (each is sent unnamed, with its
    /// parameters), and no session setting is made.
    unprepared: bool,
    /// The renewals' own connections ([`RENEWAL_CONNECTIONS`]).
    renewals: Pool,
    /// Where the listening connection connects ([`PostgresStoreBuilder::listen_url`]); `None`
    /// behind a transaction pooler without one (no listener).
    listen_config: Option<tokio_postgres::Config>,
    /// What the listener's heartbeats say: [`HEARS`], [`DEAF`], or nothing yet
    /// ([`PostgresStore::listener_hears`]).
    hears: AtomicU8,
    schema: String,
    table: String,
    channel: String,
    sql: Sql,
    timeout: Duration,
    polling: Polling,
    cleanup_batch: i64,
    tls: Connector,
    /// Cancels the statements their requests abandoned, a few at a time.
    canceller: Canceller,
    waiters: Arc<Waiters>,
    listener: OnceLock<Listener>,
    /// Completed records kept here, if the builder asked for a near cache.
    near: Option<Arc<Near>>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.inner.schema)
            .field("table", &self.inner.table)
            .field("pool", &self.inner.pool.status())
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// A statement's parameter, with its type (a statement prepared once per connection and an
/// unnamed one sent with its parameters both need them).
type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// [`Inner::hears`]: the listener heard its last heartbeat.
const HEARS: u8 = 1;
/// [`Inner::hears`]: it missed one, or lost its connection.
const DEAF: u8 = 2;

/// How the store's connections are made.
#[derive(Clone)]
pub(super) enum Connector {
    Plain,
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

/// The payload prefix of a forgotten record's notification (then the scope in hex); any other
/// payload is a claim's end, for waiters.
pub(super) const FORGET_PREFIX: &str = "forget:";

/// The connections renewals run on, apart from the store's pool: at most this many renewal
/// statements at once (the layer sends at most four per tick).
const RENEWAL_CONNECTIONS: usize = 2;

/// The most claims one renewal statement carries (a tick with more sends several).
const RENEW_CHUNK: usize = 4096;

fn backend(e: tokio_postgres::Error) -> StoreError {
    StoreError::Backend(Box::new(e))
}

fn pool_error(e: deadpool_postgres::PoolError) -> StoreError {
    StoreError::Backend(Box::new(e))
}

fn millis(d: Duration) -> i64 {
    // At most "forever" (100 years): `now() + interval` would overflow PostgreSQL's timestamps.
    i64::try_from(d.min(super::FOREVER).as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

impl PostgresStore {
    /// Creates the schema, the table, its columns and its index where absent (the SQL is in
    /// the [type docs](PostgresStore)). Safe to run at every start:
    ///
    /// - **by a least-privilege role**: it reads the catalog first and runs only the
    ///   statements that something is missing for, so a role with no `CREATE` on the database
    ///   (or on the schema) migrates fine once the schema (or the table) exists;
    /// - **by N replicas at once**: the check and the statements run in one transaction that
    ///   holds a transaction-level advisory lock of its own (`pg_advisory_xact_lock`, which
    ///   needs no privilege), so replicas that start together take turns instead of racing on
    ///   `pg_type`.
    ///
    /// A missing object the role may not create is an error that says which statement to run
    /// as the owner ([`migration_sql`](Self::migration_sql)).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let sql = &self.inner.sql;
        let lock = i64::from_le_bytes(
            blake3::hash(format!("idempotency-layer migrate {}", self.table()).as_bytes())
                .as_bytes()[..8]
                .try_into()
                .expect("8 bytes"),
        );
        let index = format!("{}_expires_at", self.inner.table);
        // DDL on a busy table may wait for locks longer than one statement's timeout.
        let within = self.inner.timeout.max(Duration::from_secs(30));
        let op = async {
            let mut client = self.inner.pool.get().await.map_err(pool_error)?;
            let tx = client.transaction().await.map_err(backend)?;
            // DDL may wait for locks longer than the sessions' statement timeout allows.
            let ms = millis(within);
            tx.batch_execute(&format!(
                "SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
            ))
            .await
            .map_err(backend)?;
            // Unnamed statements (`query_typed`), as behind a transaction pooler: a statement
            // prepared by name could meet one of the same name on a pooled server session.
            tx.query_typed("SELECT pg_advisory_xact_lock($1)", &[(&lock, Type::INT8)])
                .await
                .map_err(backend)?;
            // The catalog, not `to_regclass`: it needs no privilege on the schema.
            let rows = tx
                .query_typed(
                    "SELECT                        EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1),                        EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')),                        EXISTS (SELECT 1 FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid                                JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = 'watched'                                AND NOT a.attisdropped),                        EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $3 AND c.relkind = 'i')",
                    &[
                        (&self.inner.schema, Type::TEXT),
                        (&self.inner.table, Type::TEXT),
                        (&index, Type::TEXT),
                    ],
                )
                .await
                .map_err(backend)?;
            let row = rows
                .first()
                .ok_or_else(|| StoreError::Corrupt("the catalog query returned no row".into()))?;
            let (schema, table, watched, indexed): (bool, bool, bool, bool) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let steps = [
                (!schema, &sql.create_schema, "create the schema"),
                (!table, &sql.create_table, "create the table"),
                (
                    table && !watched,
                    &sql.add_watched,
                    "add the `watched` column",
                ),
                (!indexed, &sql.create_index, "create the expiry index"),
            ];
            for (needed, statement, what) in steps {
                if !needed {
                    continue;
                }
                if let Err(e) = tx.batch_execute(statement).await {
                    return Err(migrate_error(e, what, statement));
                }
            }
            tx.commit().await.map_err(backend)
        };
        match tokio::time::timeout(within, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Backend(
                format!("postgres migration did not finish within {within:?}").into(),
            )),
        }
    }

    /// The SQL that [`migrate`](Self::migrate) runs, for a migration tool of your own.
    pub fn migration_sql(&self) -> &str {
        &self.inner.sql.migrate
    }

    /// The channel waiters `LISTEN` on (`idem_` + a hash of schema and table); a claim's end
    /// is notified there (payload: the scope in hex) only when a waiter watches it.
    pub fn channel(&self) -> &str {
        &self.inner.channel
    }

    /// What the near cache did, if the store has one ([`PostgresStoreBuilder::near_cache`]).
    pub fn near_cache_stats(&self) -> Option<NearCacheStats> {
        self.inner.near.as_ref().map(|n| n.stats())
    }

    /// The schema-qualified, quoted table name.
    pub fn table(&self) -> String {
        format!("\"{}\".\"{}\"", self.inner.schema, self.inner.table)
    }

    /// Whether the store's listening connection hears notifications: `Some(true)` when it
    /// proved so with its last heartbeat (a notification the store sends itself every few
    /// seconds and must receive within twice its timeout), `Some(false)` when a heartbeat did
    /// not arrive in time or the connection was lost, `None` before the first verdict (the
    /// listener starts with the first `begin` or `wait`). A listener behind a pooler in
    /// transaction mode hears nothing (see
    /// [`PostgresStore::builder`], "Behind a pooler in transaction mode"). Unless it hears,
    /// waiters find a claim's end by polling and the near cache is off; a warning is logged
    /// when it goes deaf, and the gauge `idempotency_layer_store_listener_hears` (feature
    /// `metrics`) is 0.
    pub fn listener_hears(&self) -> Option<bool> {
        match self.inner.hears.load(Ordering::Relaxed) {
            HEARS => Some(true),
            DEAF => Some(false),
            _ => None,
        }
    }

    /// The store's connection pool (the one it made, or yours from
    /// [`builder_from_pool`](Self::builder_from_pool)): for handlers whose side effects go to
    /// the same database, to open the transactions they complete their claims in
    /// ([`TxCompletion`](crate::TxCompletion)). Such a handler holds a connection for its whole transaction; size
    /// the pool for them too ([`pool_size`](PostgresStoreBuilder::pool_size)).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The fenced statement that stores a claim's record (`$1` scope, `$2` token, `$3` the
    /// encoded record, `$4` its TTL in milliseconds; see [`CompleteParams`]), for a handler's
    /// own transaction.
    pub(crate) fn complete_statement(&self) -> &str {
        &self.inner.sql.complete
    }

    /// Removes every expired row (records past their TTL; claims whose lease lapsed more than an
    /// hour ago, so that a late leader never taken over can still complete), in
    /// batches of [`cleanup_batch`](PostgresStoreBuilder::cleanup_batch) until a batch comes
    /// back short; returns how many rows it removed. The background task calls this, so one
    /// run clears whatever expired since the last, however fast rows are written (each batch
    /// is one short transaction on a pooled connection; concurrent runs on other instances
    /// skip each other's rows).
    pub async fn remove_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let rows = self
                .query(
                    &self.inner.sql.cleanup,
                    &[
                        (&self.inner.cleanup_batch, Type::INT8),
                        (&millis(LATE_COMPLETE_GRACE), Type::INT8),
                    ],
                )
                .await?;
            let n = affected(&rows) as u64;
            total += n;
            if n < self.inner.cleanup_batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    /// How long after its sender gave up a claim statement may still run: the sessions'
    /// `statement_timeout` is the store's timeout, from when the server starts it; twice that
    /// covers a statement that reached the server late.
    fn settle(&self) -> Duration {
        self.inner.timeout * 2
    }

    /// A connection of `pool` for one statement (see [`Busy`]).
    async fn busy_on<'a>(&'a self, pool: &'a Pool) -> Result<Busy<'a>, StoreError> {
        let conn = pool.get().await.map_err(pool_error)?;
        Ok(Busy::new(
            conn,
            pool,
            &self.inner.canceller,
            self.inner.timeout,
        ))
    }

    async fn bounded<T>(
        &self,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.inner.timeout, op).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Backend(
                format!("postgres did not answer within {:?}", self.inner.timeout).into(),
            )),
        }
    }

    /// Runs the statement `sql` with its typed parameters and returns its rows.
    async fn query(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError> {
        self.query_noting_sent(sql, params, &AtomicBool::new(false))
            .await
    }

    /// [`query`](Self::query), setting `sent` once the statement is handed to a connection
    /// (before that, a failure proves it never ran).
    async fn query_noting_sent(
        &self,
        sql: &str,
        params: &[Param<'_>],
        sent: &AtomicBool,
    ) -> Result<Vec<Row>, StoreError> {
        self.query_on(&self.inner.pool, sql, params, sent).await
    }

    /// [`query_noting_sent`](Self::query_noting_sent) on a connection of `pool`: a statement
    /// prepared once per connection, or, behind a transaction pooler (where a statement
    /// prepared in one transaction is gone in the next), an unnamed one sent with its
    /// parameters in the same round trip.
    async fn query_on(
        &self,
        pool: &Pool,
        sql: &str,
        params: &[Param<'_>],
        sent: &AtomicBool,
    ) -> Result<Vec<Row>, StoreError> {
        self.bounded(async {
            let mut busy = self.busy_on(pool).await?;
            if self.inner.unprepared {
                sent.store(true, Ordering::Relaxed);
                let rows = busy.client().query_typed(sql, params).await;
                return busy.finish(rows).map_err(backend);
            }
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let stmt = busy.client().prepare_typed_cached(sql, &types).await;
            let stmt = busy.finish_if_err(stmt).map_err(backend)?;
            sent.store(true, Ordering::Relaxed);
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            let rows = busy.client().query(&stmt, &values).await;
            busy.finish(rows).map_err(backend)
        })
        .await
    }

    /// Claims `scope` with a fresh token (see `begin`), offering a completed record to the near
    /// cache under `ticket`.
    async fn claim(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ticket: Option<Ticket>,
    ) -> Result<Begin, StoreError> {
        let token = codec::new_token();
        let uuid = Uuid::from_u128(token.0);
        for _ in 0..CLAIM_ATTEMPTS {
            // Armed while the claim may be written with nobody knowing: the statement is in
            // flight (this future may be dropped), or its reply was lost.
            let orphan = super::OrphanGuard::new(self, scope, token, lease, self.settle());
            let sent = AtomicBool::new(false);
            let rows = self
                .query_noting_sent(
                    &self.inner.sql.claim,
                    &[
                        (&&scope.0[..], Type::BYTEA),
                        (&uuid, Type::UUID),
                        (&&fingerprint.0[..], Type::BYTEA),
                        (&millis(lease), Type::INT8),
                    ],
                    &sent,
                )
                .await;
            match &rows {
                // Only an error after the statement was handed to a connection is ambiguous; a
                // pool timeout or a refused connection sent nothing.
                Err(StoreError::Backend(_)) if sent.load(Ordering::Relaxed) => drop(orphan),
                _ => orphan.disarm(),
            }
            let rows = rows?;
            if let Some(row) = rows.first() {
                let (begin, ttl_left) = decode_row(row, token)?;
                if matches!(begin, Begin::Completed(_))
                    && standby_confirms(row)
                    && !self.anchored(&scope, row).await?
                {
                    // Removed or replaced since the claim read it: claim again.
                    continue;
                }
                if let (Begin::Completed(record), Some(near), Some(ticket)) =
                    (&begin, &self.inner.near, ticket)
                {
                    near.offer(ticket, scope, record, ttl_left);
                }
                return Ok(begin);
            }
        }
        Err(StoreError::Backend(
            format!("claim found neither a free nor a held row {CLAIM_ATTEMPTS} times").into(),
        ))
    }

    /// Locks the record the claim statement's `row` found ([`Sql::anchor`]): answers once the
    /// synchronous standby confirmed it (the lock's commit waits for the standby), `false` if
    /// the record is no longer there.
    async fn anchored(&self, scope: &ScopeKey, row: &Row) -> Result<bool, StoreError> {
        let token: Uuid = row
            .try_get(2)
            .map_err(|e| StoreError::Corrupt(format!("row: {e}")))?;
        let rows = self
            .query(
                &self.inner.sql.anchor,
                &[(&&scope.0[..], Type::BYTEA), (&token, Type::UUID)],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    /// The lease left of claim `token`, or `None` when it no longer holds. `watch` also marks
    /// the claim watched, so that its end is notified.
    pub(crate) async fn held(
        &self,
        scope: &ScopeKey,
        token: Token,
        watch: bool,
    ) -> Result<Option<Duration>, StoreError> {
        let sql = if watch {
            &self.inner.sql.watch
        } else {
            &self.inner.sql.peek
        };
        let rows = self
            .query(
                sql,
                &[
                    (&&scope.0[..], Type::BYTEA),
                    (&Uuid::from_u128(token.0), Type::UUID),
                ],
            )
            .await?;
        Ok(rows.first().map(|r| {
            let ms: i64 = r.try_get(0).unwrap_or(0);
            Duration::from_millis(ms.max(0) as u64)
        }))
    }
}

impl IdempotencyStore for PostgresStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        // With a near cache: its listener (which keeps it honest) runs from the first begin
        // on, and a hit answers with no round trip.
        let ticket = match self.inner.near.as_ref().map(|near| near.lookup(&scope)) {
            Some(Ok(record)) => return Ok(Begin::Completed(record)),
            Some(Err(ticket)) => {
                self.listener();
                Some(ticket)
            }
            None => None,
        };
        // Boxed: the round trip's future would otherwise size every write's future, a
        // near-cache hit's included, past the allocator's fast sizes.
        Box::pin(self.claim(scope, fingerprint, lease, ticket)).await
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let bytes = codec::encode(&record)?;
        let params = CompleteParams::new(&scope, token, &bytes, ttl);
        // Boxed, as `begin`'s round trip is: it would otherwise size the layer's completion
        // future past the allocator's fast sizes.
        let rows = Box::pin(self.query(&self.inner.sql.complete, &params.typed())).await?;
        fenced_unless_affected(&rows)
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let rows = self
            .query(
                &self.inner.sql.release,
                &[
                    (&&scope.0[..], Type::BYTEA),
                    (&Uuid::from_u128(token.0), Type::UUID),
                ],
            )
            .await?;
        fenced_unless_affected(&rows)
    }

    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        // One claim renewed as a batch renews them: on the renewals' connections, skipping
        // (not waiting for) a row another transaction locked.
        self.renew_many(&[(scope, token, lease)])
            .await
            .pop()
            .unwrap_or(Err(StoreError::Fenced))
    }

    async fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> Vec<Result<(), StoreError>> {
        let mut results = Vec::with_capacity(claims.len());
        for chunk in claims.chunks(RENEW_CHUNK) {
            let scopes: Vec<&[u8]> = chunk.iter().map(|(s, _, _)| &s.0[..]).collect();
            let tokens: Vec<Uuid> = chunk.iter().map(|(_, t, _)| Uuid::from_u128(t.0)).collect();
            let leases: Vec<i64> = chunk.iter().map(|&(_, _, l)| millis(l)).collect();
            let renewed = self
                .query_on(
                    &self.inner.renewals,
                    &self.inner.sql.renew_many,
                    &[
                        (&scopes, Type::BYTEA_ARRAY),
                        (&tokens, Type::UUID_ARRAY),
                        (&leases, Type::INT8_ARRAY),
                    ],
                    &AtomicBool::new(false),
                )
                .await;
            match renewed {
                Ok(rows) => {
                    // Each claim's token, and whether it was renewed (`false`: still held, but
                    // its row is locked by another transaction, so it was skipped, not waited
                    // for); a claim absent from the rows no longer holds.
                    let answered: std::collections::HashMap<Uuid, bool> = rows
                        .iter()
                        .filter_map(|r| Some((r.try_get(0).ok()?, r.try_get(1).ok()?)))
                        .collect();
                    results.extend(tokens.iter().map(|t| {
                        match answered.get(t) {
                            Some(true) => Ok(()),
                            Some(false) => Err(StoreError::Backend(
                                "the claim's row is locked by another transaction (a commit in \
                             progress?); its renewal is tried again shortly"
                                    .into(),
                            )),
                            None => Err(StoreError::Fenced),
                        }
                    }));
                }
                Err(e) => {
                    let e = e.to_string();
                    results.extend(
                        chunk
                            .iter()
                            .map(|_| Err(StoreError::Backend(e.clone().into()))),
                    );
                }
            }
        }
        results
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        // Registered before the first check, which marks the claim watched: its end is then
        // notified, and the notification finds this waiter. The listener is started, not
        // waited for: a claim that already ended is seen at once even while the listener
        // (re)connects. Until it listens, polling covers; when it does, it wakes every waiter
        // to look again, so nothing notified before is missed.
        let guard = self.inner.waiters.register(scope.to_hex(), None);
        self.listener();
        let mut first = true;
        guard
            .wait(self.inner.polling, || {
                let watch = std::mem::replace(&mut first, false);
                self.held(&scope, observed, watch)
            })
            .await
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        // Before (a begin of this instance in flight now must not cache what it reads) and
        // after (one that read before the removal may have cached it meanwhile); the other
        // instances hear the NOTIFY.
        if let Some(near) = &self.inner.near {
            near.invalidate(&scope);
        }
        let rows = self
            .query(&self.inner.sql.forget, &[(&&scope.0[..], Type::BYTEA)])
            .await;
        if let Some(near) = &self.inner.near {
            near.invalidate(&scope);
        }
        Ok(affected(&rows?) > 0)
    }

    async fn lookup(&self, scope: ScopeKey) -> Result<Option<Held>, StoreError> {
        let rows = self
            .query(&self.inner.sql.lookup, &[(&&scope.0[..], Type::BYTEA)])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let corrupt = |e: tokio_postgres::Error| StoreError::Corrupt(format!("row: {e}"));
        let state: &str = row.try_get(0).map_err(corrupt)?;
        let token: Uuid = row.try_get(1).map_err(corrupt)?;
        match state {
            "in_flight" => {
                let fp: &[u8] = row.try_get(2).map_err(corrupt)?;
                Ok(Some(Held::InFlight {
                    token: Token(token.as_u128()),
                    fingerprint: codec::fingerprint(fp)?,
                }))
            }
            "completed" => {
                let record: Option<&[u8]> = row.try_get(3).map_err(corrupt)?;
                let record = record
                    .ok_or_else(|| StoreError::Corrupt("completed row has no record".into()))?;
                Ok(Some(Held::Completed(Arc::new(codec::decode(record)?))))
            }
            other => Err(StoreError::Corrupt(format!("row state {other:?}"))),
        }
    }

    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn postgres(&self) -> Option<&PostgresStore> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::builder::check_identifier;
    use super::Sql;

    #[test]
    fn identifiers_are_checked() {
        assert!(check_identifier("table", "idempotency_records", 48).is_ok());
        assert!(check_identifier("table", "_t1", 48).is_ok());
        for bad in ["", "1abc", "a-b", "a\"b", "a b", &"x".repeat(49)] {
            assert!(check_identifier("table", bad, 48).is_err(), "{bad:?}");
        }
    }

    /// The migration file the crate ships for migration tools is what `migrate` runs for the
    /// default schema and table (regenerate it from `migration_sql()` when the table changes).
    #[test]
    fn the_shipped_migration_file_is_the_default_migration() {
        let shipped = include_str!("../../../migrations/postgres.sql");
        let sql = crate::PostgresStore::builder("postgres://unused")
            .migration_sql()
            .unwrap();
        assert_eq!(shipped, sql);
        assert!(crate::PostgresStore::builder("postgres://unused")
            .table("bad-name")
            .migration_sql()
            .is_err());
    }

    /// A setting the store cannot work with is refused at connect, before anything connects,
    /// as a configuration error that says what to change (it was raised silently before).
    #[tokio::test]
    async fn bad_settings_are_refused_at_connect_with_what_to_change() {
        let builder = || crate::PostgresStore::builder("postgres://nobody@127.0.0.1:1/none");
        for (bad, says) in [
            (builder().pool_size(0), "pool_size"),
            (builder().timeout(std::time::Duration::ZERO), "timeout"),
            (builder().cleanup_batch(0), "cleanup_batch"),
            (builder().table("no-dashes"), "table name"),
            (
                crate::PostgresStore::builder("postgres://a@b/c?sslmode=nonsense"),
                "postgres URL",
            ),
        ] {
            match bad.connect().await {
                Err(crate::StoreError::Config(why)) => assert!(why.contains(says), "{why}"),
                other => panic!("{says}: {:?}", other.map(|_| ())),
            }
        }
    }

    #[test]
    fn migration_sql_names_the_table() {
        let sql = Sql::new("s", "t", "idem_0");
        assert!(sql
            .migrate
            .contains("CREATE TABLE IF NOT EXISTS \"s\".\"t\""));
        assert!(sql.claim.contains("ON CONFLICT (scope) DO UPDATE"));
        assert!(sql.complete.contains("token = $2 AND state = 'in_flight'"));
    }
}

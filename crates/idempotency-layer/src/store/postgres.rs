//! [`PostgresStore`]: claims and records in a PostgreSQL table, shared by every instance.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, NoTls, Row, Socket};
use uuid::Uuid;

use super::codec;
use super::near_cache::{scope_from_hex, Near, NearCache, NearCacheStats};
use super::wake::{Polling, Waiters};
use super::{
    Begin, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, Token, LATE_COMPLETE_GRACE,
};

mod busy;
mod tx;

use busy::Busy;

pub use self::tx::{TxCompletion, TxCompletionError};

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
/// - `begin` is one statement: `INSERT ... ON CONFLICT (scope) DO UPDATE ... WHERE
///   expires_at <= now() RETURNING ...` (a lapsed lease or an expired record is taken over with
///   a new token), combined in a CTE with a `SELECT` of the current row when the scope is held.
///   In the rare race where another transaction inserted the row after the statement's
///   snapshot, the statement runs again.
/// - `complete`, `release`, `renew` are fenced: `UPDATE`/`DELETE ... WHERE scope = $1 AND
///   token = $2 AND state = 'in_flight'`; no row matched is [`StoreError::Fenced`]. `complete`,
///   `release` and `forget` call `pg_notify` in the same statement only when a waiter marked
///   the row `watched`: a transaction that sent a NOTIFY holds a server-wide lock through its
///   commit, which would serialize every completion in the server.
/// - Statements are prepared once per pooled connection (`prepare_cached`).
///
/// # Waiters
///
/// A dedicated connection per store `LISTEN`s on the table's channel (`idem_` + a hash of the
/// schema and table name; the payload is the scope in hex) and reconnects by itself. A waiter
/// also polls with backoff (25 ms doubling to 1 s by default), so a lost notification delays it
/// at most one poll interval and never hangs it.
///
/// # Expiry
///
/// Expired rows are ignored by `begin` at once (taken over), and removed by a background task
/// in batches (`DELETE ... WHERE ctid IN (SELECT ctid ... LIMIT n FOR UPDATE SKIP LOCKED)`),
/// every [`cleanup_interval`](PostgresStoreBuilder::cleanup_interval); or on demand with
/// [`remove_expired`](PostgresStore::remove_expired). The cleanup removes records past their TTL
/// at once, but a claim only an hour after its lease lapsed: until then a new `begin` takes it
/// over, and a late leader that nobody took it from can still complete it and store its record
/// (the same grace as on Redis, where a claim's key outlives its lease by an hour).
///
/// # Transactional completion
///
/// A handler whose side effects go to the same database can write the record in its own
/// transaction, with the [`TxCompletion`] the layer puts in its request's extensions and a
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
/// every statement writes or must see the latest write. Through PgBouncer, use session pooling
/// for the listener (transaction pooling does not carry `LISTEN`; waiters then fall back to
/// polling) and mind that statements are prepared by name.
///
/// # Deploying
///
/// - **Roles**: run the application as a role with `USAGE` on the schema and `SELECT, INSERT,
///   UPDATE, DELETE` on the table; create the table once as its owner
///   ([`migration_sql`](PostgresStore::migration_sql)). [`migrate`](PostgresStore::migrate)
///   then changes nothing and needs no `CREATE`; it is safe for N replicas starting at once.
/// - **TLS**: `sslmode=require` in the URL with the `postgres-tls` feature (rustls): encrypted,
///   and with [`tls_root_certificates`](PostgresStoreBuilder::tls_root_certificates) the
///   server's certificate is checked, like libpq's `sslrootcert`.
/// - **Your own pool**: [`builder_from_pool`](PostgresStore::builder_from_pool).
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
///   keeps its settings: set them there). A statement still running when its request gives up
///   (the timeout, or a client that went away) is cancelled on the server and its connection
///   leaves the pool, so it neither stalls the next statements (behind the row lock of an open
///   `TxCompletion` transaction, say) nor lands later: a claim abandoned that way is released
///   by its token in the background, once at once and once more twice the timeout later.
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
    config: tokio_postgres::Config,
    schema: String,
    table: String,
    channel: String,
    sql: Sql,
    timeout: Duration,
    polling: Polling,
    cleanup_batch: i64,
    tls: Connector,
    waiters: Arc<Waiters>,
    listener: OnceLock<Listener>,
    /// Completed records kept here, if the builder asked for a near cache.
    near: Option<Arc<Near>>,
}

/// The payload prefix of a forgotten record's notification (then the scope in hex); any other
/// payload is a claim's end, for waiters.
const FORGET_PREFIX: &str = "forget:";

struct Listener {
    /// Dropped with the store: the listener task ends.
    _stop: oneshot::Sender<()>,
}

struct Sql {
    claim: String,
    complete: String,
    release: String,
    renew: String,
    renew_many: String,
    forget: String,
    watch: String,
    peek: String,
    cleanup: String,
    migrate: String,
    create_schema: String,
    create_table: String,
    add_watched: String,
    create_index: String,
}

impl Sql {
    fn new(schema: &str, table: &str, channel: &str) -> Sql {
        let t = format!("\"{schema}\".\"{table}\"");
        let lease = "now() + $4::bigint * interval '1 millisecond'";
        // `pg_notify` only for a claim a waiter marked `watched`: a transaction that has sent a
        // NOTIFY takes a cluster-wide lock through its commit (fsync included), which would
        // serialize every completion in the server with every other one.
        let notify_if_watched = |cte: &str| {
            format!(
                "notified AS (SELECT pg_notify('{channel}', encode(scope, 'hex')) FROM {cte} \
                   WHERE watched) \
                 SELECT (SELECT count(*) FROM {cte}) AS n, (SELECT count(*) FROM notified) AS woken"
            )
        };
        let create_schema = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
        let create_table = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n\
             \x20   scope       bytea       PRIMARY KEY,\n\
             \x20   state       text        NOT NULL CHECK (state IN ('in_flight', 'completed')),\n\
             \x20   token       uuid        NOT NULL,\n\
             \x20   fingerprint bytea       NOT NULL,\n\
             \x20   expires_at  timestamptz NOT NULL,\n\
             \x20   record      bytea,\n\
             \x20   watched     boolean     NOT NULL DEFAULT false,\n\
             \x20   CHECK ((state = 'completed') = (record IS NOT NULL))\n\
             )"
        );
        let add_watched = format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false"
        );
        let create_index =
            format!("CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON {t} (expires_at)");
        Sql {
            claim: format!(
                "WITH claimed AS (\
                   INSERT INTO {t} AS e (scope, state, token, fingerprint, expires_at, record) \
                   VALUES ($1, 'in_flight', $2, $3, {lease}, NULL) \
                   ON CONFLICT (scope) DO UPDATE SET state = 'in_flight', token = excluded.token, \
                     fingerprint = excluded.fingerprint, expires_at = excluded.expires_at, record = NULL, \
                     watched = false \
                   WHERE e.expires_at <= now() \
                   RETURNING e.state, e.token, e.fingerprint, e.record) \
                 SELECT true AS claimed, state, token, fingerprint, record, 0::bigint AS ttl_ms \
                 FROM claimed \
                 UNION ALL \
                 SELECT false, state, token, fingerprint, record, \
                   GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint FROM {t} \
                 WHERE scope = $1 AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM claimed)"
            ),
            complete: format!(
                "WITH done AS (\
                   UPDATE {t} SET state = 'completed', record = $3, \
                     expires_at = {lease} \
                   WHERE scope = $1 AND token = $2 AND state = 'in_flight' RETURNING scope, watched), \
                 {}",
                notify_if_watched("done")
            ),
            release: format!(
                "WITH gone AS (\
                   DELETE FROM {t} WHERE scope = $1 AND token = $2 AND state = 'in_flight' \
                   RETURNING scope, watched), \
                 {}",
                notify_if_watched("gone")
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = now() + $3::bigint * interval '1 millisecond' \
                 WHERE scope = $1 AND token = $2 AND state = 'in_flight'"
            ),
            // Every claim of a renewal tick in one statement: ($1, $2, $3) are the claims'
            // scopes, tokens and leases (ms); returns the tokens that still held.
            renew_many: format!(
                "UPDATE {t} AS e SET expires_at = now() + c.ms * interval '1 millisecond' \
                 FROM unnest($1::bytea[], $2::uuid[], $3::bigint[]) AS c(scope, token, ms) \
                 WHERE e.scope = c.scope AND e.token = c.token AND e.state = 'in_flight' \
                 RETURNING e.token"
            ),
            // A forgotten record is always announced (rare, so the NOTIFY's lock costs
            // nothing that matters), for the near caches of every instance.
            forget: format!(
                "WITH gone AS (DELETE FROM {t} WHERE scope = $1 RETURNING scope, watched, state), \
                 invalidated AS (SELECT pg_notify('{channel}', '{FORGET_PREFIX}' || encode(scope, 'hex')) \
                   FROM gone WHERE state = 'completed'), \
                 notified AS (SELECT pg_notify('{channel}', encode(scope, 'hex')) FROM gone \
                   WHERE watched) \
                 SELECT (SELECT count(*) FROM gone) AS n, (SELECT count(*) FROM notified) AS woken, \
                   (SELECT count(*) FROM invalidated) AS invalidated"
            ),
            watch: format!(
                "UPDATE {t} SET watched = true \
                 WHERE scope = $1 AND token = $2 AND state = 'in_flight' AND expires_at > now() \
                 RETURNING GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint"
            ),
            peek: format!(
                "SELECT GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint \
                 FROM {t} \
                 WHERE scope = $1 AND token = $2 AND state = 'in_flight' AND expires_at > now()"
            ),
            // Records past their TTL; claims only once their lease lapsed longer than
            // `LATE_COMPLETE_GRACE` ago ($2 ms): a late leader that was never taken over can
            // still complete its claim and store its record, as on Redis.
            cleanup: format!(
                "DELETE FROM {t} WHERE ctid IN (\
                   SELECT ctid FROM {t} WHERE expires_at <= now() \
                     AND (state = 'completed' \
                          OR expires_at <= now() - $2::bigint * interval '1 millisecond') \
                   LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            migrate: format!(
                "{create_schema};\n{create_table};\n{add_watched};\n{create_index};\n"
            ),
            create_schema,
            create_table,
            add_watched,
            create_index,
        }
    }
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

/// Builds a [`PostgresStore`]: [`PostgresStore::builder`].
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    schema: String,
    table: String,
    pool_size: usize,
    timeout: Duration,
    polling: Polling,
    cleanup_interval: Duration,
    cleanup_batch: i64,
    pool: Option<Pool>,
    near: Option<NearCache>,
    #[cfg(feature = "postgres-tls")]
    roots: Option<Vec<u8>>,
}

impl PostgresStoreBuilder {
    /// The schema of the table (default `public`): `[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes.
    /// [`migrate`](PostgresStore::migrate) creates it if absent.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The table (default `idempotency_records`): `[A-Za-z_][A-Za-z0-9_]*`, at most 48 bytes
    /// (its index is named after it). Give each service (or each test) its own.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The most pooled connections (default 16), besides the one that listens for
    /// notifications. Each request in flight holds one only for the length of a statement.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The longest any one operation may take, waiting for a pooled connection and connecting
    /// included, before it fails with [`StoreError::Backend`] (default 2 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How waiters poll when no notification comes: `first` after the first check, doubling
    /// up to `max` (defaults 25 ms and 1 s).
    pub fn poll_interval(mut self, first: Duration, max: Duration) -> Self {
        self.polling = Polling::new(first, max);
        self
    }

    /// How often the background task removes expired rows (default 60 s; zero: never, call
    /// [`remove_expired`](PostgresStore::remove_expired) yourself).
    pub fn cleanup_interval(mut self, every: Duration) -> Self {
        self.cleanup_interval = every;
        self
    }

    /// How many expired rows one cleanup statement removes at most (default 1000).
    pub fn cleanup_batch(mut self, rows: u32) -> Self {
        self.cleanup_batch = i64::from(rows.max(1));
        self
    }

    /// Keeps recently replayed records in this instance's memory ([`NearCache`]): a replay of
    /// a cached record costs no statement. Claims still always go to PostgreSQL; an entry never
    /// outlives its record's TTL; a `forget` on any instance drops it from every instance's
    /// cache (a `NOTIFY` on the store's [`channel`](PostgresStore::channel), which the store's
    /// listening connection hears; while that connection is down, the cache is empty and off).
    /// Off by default. See [`NearCache`] for what it promises and what it does not.
    ///
    /// ```
    /// use idempotency_layer::store::NearCache;
    /// use idempotency_layer::PostgresStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// # let Ok(url) = std::env::var("DATABASE_URL") else { return Ok(()) };
    /// let store = PostgresStore::builder(url)
    ///     .near_cache(NearCache::new(64 << 20)) // up to 64 MiB of records
    ///     .connect()
    ///     .await?;
    /// assert_eq!(store.near_cache_stats().unwrap().hits, 0);
    /// # Ok(())
    /// # }
    /// ```
    pub fn near_cache(mut self, near: NearCache) -> Self {
        self.near = Some(near);
        self
    }

    /// With `sslmode=require` in the URL, check the server's certificate (chain and host name)
    /// against these PEM root certificates. Without them, `sslmode=require` means what it means
    /// to libpq: the connection is encrypted and the certificate is not checked.
    #[cfg(feature = "postgres-tls")]
    pub fn tls_root_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.roots = Some(pem.into());
        self
    }

    /// Connects (the server must be reachable now; later outages are survived: broken pooled
    /// connections are replaced, the listener reconnects). Does not create the table: see
    /// [`PostgresStore::migrate`].
    pub async fn connect(self) -> Result<PostgresStore, StoreError> {
        check_identifier("schema", &self.schema, 63)?;
        check_identifier("table", &self.table, 48)?;
        let mut config = tokio_postgres::Config::from_str(&self.url).map_err(backend)?;
        config.connect_timeout(self.timeout);
        let tls = if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            #[cfg(feature = "postgres-tls")]
            {
                Connector::Rustls(tls::connector(self.roots.as_deref())?)
            }
            #[cfg(not(feature = "postgres-tls"))]
            return Err(StoreError::Backend(
                "sslmode=require needs the idempotency-layer cargo feature `postgres-tls`".into(),
            ));
        } else {
            Connector::Plain
        };
        // The server ends any of the store's statements that outlives the store's timeout
        // (and any wait for a lock that long), even when the client that sent it is gone: an
        // abandoned claim cannot land long after its orphan release ran. Set by a `SET` on each
        // new session rather than as startup options, which PgBouncer refuses. (A pool of your
        // own, `builder_from_pool`, keeps its sessions' settings: set these there.)
        let session_timeouts = {
            let ms = millis(self.timeout);
            format!("SET statement_timeout = {ms}; SET lock_timeout = {ms}")
        };
        let pool = match self.pool {
            Some(pool) => pool,
            None => {
                let mc = ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                };
                let manager = match &tls {
                    Connector::Plain => Manager::from_config(config.clone(), NoTls, mc),
                    #[cfg(feature = "postgres-tls")]
                    Connector::Rustls(t) => Manager::from_config(config.clone(), t.clone(), mc),
                };
                Pool::builder(manager)
                    .post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
                        let set = session_timeouts.clone();
                        Box::pin(async move {
                            client
                                .batch_execute(&set)
                                .await
                                .map_err(deadpool_postgres::HookError::Backend)
                        })
                    }))
                    .max_size(self.pool_size)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(self.timeout))
                    .create_timeout(Some(self.timeout))
                    .recycle_timeout(Some(self.timeout))
                    .build()
                    .map_err(|e| StoreError::Backend(Box::new(e)))?
            }
        };
        // Fail now if the server is unreachable.
        drop(pool.get().await.map_err(pool_error)?);
        let id = blake3::hash(format!("{}.{}", self.schema, self.table).as_bytes());
        let channel = format!("idem_{}", &id.to_hex()[..16]);
        let inner = Arc::new(Inner {
            sql: Sql::new(&self.schema, &self.table, &channel),
            pool,
            config,
            schema: self.schema,
            table: self.table,
            channel,
            timeout: self.timeout,
            polling: self.polling,
            cleanup_batch: self.cleanup_batch,
            tls,
            waiters: Arc::default(),
            listener: OnceLock::new(),
            near: self.near.map(Near::new),
        });
        if !self.cleanup_interval.is_zero() {
            tokio::spawn(cleanup_task(Arc::downgrade(&inner), self.cleanup_interval));
        }
        Ok(PostgresStore { inner })
    }
}

/// How the store's connections are made.
#[derive(Clone)]
enum Connector {
    Plain,
    #[cfg(feature = "postgres-tls")]
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

#[cfg(feature = "postgres-tls")]
mod tls {
    use std::sync::Arc;

    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

    use super::StoreError;

    /// `sslmode=require` as libpq has it: encrypted, the certificate not checked (signatures of
    /// the handshake still are).
    #[derive(Debug)]
    struct EncryptOnly(Arc<CryptoProvider>);

    impl ServerCertVerifier for EncryptOnly {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    pub(super) fn connector(
        roots: Option<&[u8]>,
    ) -> Result<tokio_postgres_rustls::MakeRustlsConnect, StoreError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        let config = match roots {
            Some(pem) => {
                let mut store = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(pem) {
                    let cert = cert.map_err(|e| {
                        StoreError::Backend(format!("tls_root_certificates: {e}").into())
                    })?;
                    store
                        .add(cert)
                        .map_err(|e| StoreError::Backend(Box::new(e)))?;
                }
                if store.is_empty() {
                    return Err(StoreError::Backend(
                        "tls_root_certificates: no PEM certificate found".into(),
                    ));
                }
                builder.with_root_certificates(store).with_no_client_auth()
            }
            None => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
                .with_no_client_auth(),
        };
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
    }
}

fn check_identifier(what: &str, name: &str, max: usize) -> Result<(), StoreError> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= max;
    if ok {
        Ok(())
    } else {
        Err(StoreError::Backend(
            format!(
                "invalid {what} name {name:?}: use [A-Za-z_][A-Za-z0-9_]*, at most {max} bytes"
            )
            .into(),
        ))
    }
}

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

async fn cleanup_task(inner: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let store = PostgresStore { inner };
        match store.remove_expired().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(rows = n, "idempotency: removed expired rows"),
            Err(e) => tracing::debug!(error = %e, "idempotency: expired-row cleanup failed"),
        }
    }
}

/// Owns the store's listening connection: `LISTEN`s on the table's channel, wakes local
/// waiters on notifications, and reconnects when the connection is lost (waking every waiter,
/// so they poll for what they may have missed). Ends when the store is dropped.
async fn listen_task<T>(
    config: tokio_postgres::Config,
    tls: T,
    channel: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<Arc<Near>>,
    mut stop: oneshot::Receiver<()>,
) where
    T: MakeTlsConnect<Socket> + Clone + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = tokio::select! {
            _ = &mut stop => return,
            c = tokio::time::timeout(timeout, config.connect(tls.clone())) => c,
        };
        if let Ok(Ok((client, mut connection))) = connected {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let driver = tokio::spawn(async move {
                let mut messages = futures_util::stream::poll_fn(|cx| connection.poll_message(cx));
                while let Some(m) = messages.next().await {
                    match m {
                        Ok(AsyncMessage::Notification(n)) => {
                            if tx.send(Some(n.payload().to_owned())).is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                let _ = tx.send(None);
            });
            let listened = tokio::time::timeout(
                timeout,
                client.batch_execute(&format!("LISTEN \"{channel}\"")),
            )
            .await;
            if matches!(listened, Ok(Ok(()))) {
                backoff = Duration::from_millis(50);
                // Anything that ended before the LISTEN took effect: let the waiters look.
                waiters.wake_all();
                if let Some(near) = &near {
                    near.set_live(true);
                }
                loop {
                    tokio::select! {
                        _ = &mut stop => {
                            driver.abort();
                            return;
                        }
                        m = rx.recv() => match m {
                            Some(Some(payload)) => match payload.strip_prefix(FORGET_PREFIX) {
                                Some(hex) => {
                                    if let Some(near) = &near {
                                        match scope_from_hex(hex) {
                                            Some(scope) => near.invalidate(&scope),
                                            None => {
                                                near.set_live(false);
                                                near.set_live(true);
                                            }
                                        }
                                    }
                                }
                                None => waiters.wake(&payload),
                            },
                            _ => break,
                        },
                    }
                }
                if let Some(near) = &near {
                    near.set_live(false);
                }
            }
            driver.abort();
            drop(client);
            tracing::debug!("idempotency: postgres listener connection lost; reconnecting");
        }
        waiters.wake_all();
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl PostgresStore {
    /// A builder for a store on the database at `url` (`postgres://user@host:port/db`).
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            schema: "public".to_owned(),
            table: "idempotency_records".to_owned(),
            pool_size: 16,
            timeout: Duration::from_secs(2),
            polling: Polling::default(),
            cleanup_interval: Duration::from_secs(60),
            cleanup_batch: 1000,
            pool: None,
            near: None,
            #[cfg(feature = "postgres-tls")]
            roots: None,
        }
    }

    /// A builder for a store on your own pool: statements run on its connections (sized,
    /// configured and shared as you like; [`pool_size`](PostgresStoreBuilder::pool_size) is
    /// then ignored). `url` names the same database: the store's listener (one connection that
    /// waits for notifications, which a pooled connection cannot) connects with it, and its
    /// `sslmode` picks TLS for that connection.
    pub fn builder_from_pool(pool: Pool, url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            pool: Some(pool),
            ..PostgresStore::builder(url)
        }
    }

    /// Connects to the database at `url` with the defaults (table
    /// `public.idempotency_records`, 16 pooled connections, timeout 2 s).
    pub async fn connect(url: &str) -> Result<PostgresStore, StoreError> {
        PostgresStore::builder(url).connect().await
    }

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
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
                .await
                .map_err(backend)?;
            // The catalog, not `to_regclass`: it needs no privilege on the schema.
            let row = tx
                .query_one(
                    "SELECT                        EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1),                        EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')),                        EXISTS (SELECT 1 FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid                                JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = 'watched'                                AND NOT a.attisdropped),                        EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace                                WHERE n.nspname = $1 AND c.relname = $3 AND c.relkind = 'i')",
                    &[&self.inner.schema, &self.inner.table, &index],
                )
                .await
                .map_err(backend)?;
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

    /// The store's connection pool (the one it made, or yours from
    /// [`builder_from_pool`](Self::builder_from_pool)): for handlers whose side effects go to
    /// the same database, to open the transactions they complete their claims in
    /// ([`TxCompletion`]). Such a handler holds a connection for its whole transaction; size
    /// the pool for them too ([`pool_size`](PostgresStoreBuilder::pool_size)).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// `store` itself when it is a `PostgresStore`, or the one an [`AnyStore`](super::AnyStore)
    /// holds. The type checks fold away once `St` is known.
    pub(crate) fn of<St: IdempotencyStore>(store: &St) -> Option<&PostgresStore> {
        let any = store as &dyn std::any::Any;
        if let Some(pg) = any.downcast_ref::<PostgresStore>() {
            return Some(pg);
        }
        match any.downcast_ref::<super::AnyStore>() {
            Some(super::AnyStore::Postgres(pg)) => Some(pg),
            _ => None,
        }
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
            let n = self
                .bounded(async {
                    let mut busy = self.busy().await?;
                    let stmt = busy.client().prepare_cached(&self.inner.sql.cleanup).await;
                    let stmt = busy.finish_if_err(stmt).map_err(backend)?;
                    let n = busy
                        .client()
                        .execute(
                            &stmt,
                            &[&self.inner.cleanup_batch, &millis(LATE_COMPLETE_GRACE)],
                        )
                        .await;
                    busy.finish(n).map_err(backend)
                })
                .await?;
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

    /// A pooled connection for one statement (see [`Busy`]).
    async fn busy(&self) -> Result<Busy<'_>, StoreError> {
        let conn = self.inner.pool.get().await.map_err(pool_error)?;
        Ok(Busy::new(
            conn,
            &self.inner.pool,
            &self.inner.tls,
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

    /// Runs the prepared statement `sql` and returns its rows.
    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        self.query_noting_sent(sql, params, &AtomicBool::new(false))
            .await
    }

    /// [`query`](Self::query), setting `sent` once the statement is handed to a connection
    /// (before that, a failure proves it never ran).
    async fn query_noting_sent(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        sent: &AtomicBool,
    ) -> Result<Vec<Row>, StoreError> {
        self.bounded(async {
            let mut busy = self.busy().await?;
            let stmt = busy.client().prepare_cached(sql).await;
            let stmt = busy.finish_if_err(stmt).map_err(backend)?;
            sent.store(true, Ordering::Relaxed);
            let rows = busy.client().query(&stmt, params).await;
            busy.finish(rows).map_err(backend)
        })
        .await
    }

    /// The lease left of claim `token`, or `None` when it no longer holds. `watch` also marks
    /// the claim watched, so that its end is notified.
    async fn held(
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
            .query(sql, &[&&scope.0[..], &Uuid::from_u128(token.0)])
            .await?;
        Ok(rows.first().map(|r| {
            let ms: i64 = r.try_get(0).unwrap_or(0);
            Duration::from_millis(ms.max(0) as u64)
        }))
    }

    fn listener(&self) -> &Listener {
        self.inner.listener.get_or_init(|| {
            let (stop, stop_rx) = oneshot::channel();
            let (config, channel) = (self.inner.config.clone(), self.inner.channel.clone());
            let (timeout, waiters) = (self.inner.timeout, self.inner.waiters.clone());
            let near = self.inner.near.clone();
            match &self.inner.tls {
                Connector::Plain => tokio::spawn(listen_task(
                    config, NoTls, channel, timeout, waiters, near, stop_rx,
                )),
                #[cfg(feature = "postgres-tls")]
                Connector::Rustls(t) => tokio::spawn(listen_task(
                    config,
                    t.clone(),
                    channel,
                    timeout,
                    waiters,
                    near,
                    stop_rx,
                )),
            };
            Listener { _stop: stop }
        })
    }
}

/// The rows a complete, release or forget changed (its one result row's first column).
fn affected(rows: &[Row]) -> i64 {
    rows.first()
        .and_then(|r| r.try_get::<_, i64>(0).ok())
        .unwrap_or(0)
}

/// A fenced complete or release that changed no row: the token no longer holds the claim.
fn fenced_unless_affected(rows: &[Row]) -> Result<(), StoreError> {
    if affected(rows) == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

/// The parameters of the fenced `complete` statement, in its order (`$1`..`$4`): one list,
/// whether the store runs the statement on a pooled connection or a handler runs it in its own
/// transaction ([`TxCompletion`]).
struct CompleteParams<'a> {
    scope: &'a [u8],
    token: Uuid,
    record: &'a [u8],
    ttl_ms: i64,
}

impl<'a> CompleteParams<'a> {
    fn new(scope: &'a ScopeKey, token: Token, record: &'a [u8], ttl: Duration) -> Self {
        CompleteParams {
            scope: &scope.0,
            token: Uuid::from_u128(token.0),
            record,
            ttl_ms: millis(ttl),
        }
    }

    /// For a prepared statement, which knows its parameter types.
    fn untyped(&self) -> [&(dyn ToSql + Sync); 4] {
        [&self.scope, &self.token, &self.record, &self.ttl_ms]
    }

    /// For an unprepared one (`query_typed`: one round trip, no statement left on the
    /// connection).
    fn typed(&self) -> [(&(dyn ToSql + Sync), Type); 4] {
        [
            (&self.scope, Type::BYTEA),
            (&self.token, Type::UUID),
            (&self.record, Type::BYTEA),
            (&self.ttl_ms, Type::INT8),
        ]
    }

    /// Bound to a sqlx `query` of the statement, in the same order
    /// ([`TxCompletion::complete_in_sqlx`]).
    #[cfg(feature = "sqlx")]
    fn bind<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        query
            .bind(self.scope)
            .bind(self.token)
            .bind(self.record)
            .bind(self.ttl_ms)
    }
}

/// A migration statement failed: say what to do when it is a missing privilege.
fn migrate_error(e: tokio_postgres::Error, what: &str, statement: &str) -> StoreError {
    if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
        StoreError::Backend(
            format!(
                "migrate: this role may not {what} ({e}); run `{statement}` once as the owner \
                 (PostgresStore::migration_sql has it all), then grant this role USAGE on the \
                 schema and SELECT, INSERT, UPDATE, DELETE on the table"
            )
            .into(),
        )
    } else {
        backend(e)
    }
}

/// The claim statement's row as a [`Begin`], and for a completed record the time it has left to
/// live (for the near cache).
fn decode_row(row: &Row, ours: Token) -> Result<(Begin, Duration), StoreError> {
    let corrupt = |e: tokio_postgres::Error| StoreError::Corrupt(format!("row: {e}"));
    let claimed: bool = row.try_get(0).map_err(corrupt)?;
    let state: &str = row.try_get(1).map_err(corrupt)?;
    let token: Uuid = row.try_get(2).map_err(corrupt)?;
    let token = Token(token.as_u128());
    if claimed {
        return if token == ours {
            Ok((Begin::New(token), Duration::ZERO))
        } else {
            Err(StoreError::Corrupt("claimed row has another token".into()))
        };
    }
    match state {
        "in_flight" => {
            let fp: &[u8] = row.try_get(3).map_err(corrupt)?;
            Ok((
                Begin::InFlight {
                    token,
                    fingerprint: codec::fingerprint(fp)?,
                },
                Duration::ZERO,
            ))
        }
        "completed" => {
            let record: Option<&[u8]> = row.try_get(4).map_err(corrupt)?;
            let record =
                record.ok_or_else(|| StoreError::Corrupt("completed row has no record".into()))?;
            let ttl_ms: i64 = row.try_get(5).map_err(corrupt)?;
            Ok((
                Begin::Completed(Arc::new(codec::decode(record)?)),
                Duration::from_millis(ttl_ms.max(0) as u64),
            ))
        }
        other => Err(StoreError::Corrupt(format!("row state {other:?}"))),
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
                    &[&&scope.0[..], &uuid, &&fingerprint.0[..], &millis(lease)],
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

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let bytes = codec::encode(&record)?;
        let params = CompleteParams::new(&scope, token, &bytes, ttl);
        let rows = self
            .query(&self.inner.sql.complete, &params.untyped())
            .await?;
        fenced_unless_affected(&rows)
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let rows = self
            .query(
                &self.inner.sql.release,
                &[&&scope.0[..], &Uuid::from_u128(token.0)],
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
        let n = self
            .bounded(async {
                let mut busy = self.busy().await?;
                let stmt = busy.client().prepare_cached(&self.inner.sql.renew).await;
                let stmt = busy.finish_if_err(stmt).map_err(backend)?;
                let n = busy
                    .client()
                    .execute(
                        &stmt,
                        &[&&scope.0[..], &Uuid::from_u128(token.0), &millis(lease)],
                    )
                    .await;
                busy.finish(n).map_err(backend)
            })
            .await?;
        if n == 0 {
            Err(StoreError::Fenced)
        } else {
            Ok(())
        }
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
            match self
                .query(&self.inner.sql.renew_many, &[&scopes, &tokens, &leases])
                .await
            {
                Ok(rows) => {
                    let held: std::collections::HashSet<Uuid> =
                        rows.iter().filter_map(|r| r.try_get(0).ok()).collect();
                    results.extend(tokens.iter().map(|t| {
                        if held.contains(t) {
                            Ok(())
                        } else {
                            Err(StoreError::Fenced)
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
        let rows = self.query(&self.inner.sql.forget, &[&&scope.0[..]]).await;
        if let Some(near) = &self.inner.near {
            near.invalidate(&scope);
        }
        Ok(affected(&rows?) > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        assert!(check_identifier("table", "idempotency_records", 48).is_ok());
        assert!(check_identifier("table", "_t1", 48).is_ok());
        for bad in ["", "1abc", "a-b", "a\"b", "a b", &"x".repeat(49)] {
            assert!(check_identifier("table", bad, 48).is_err(), "{bad:?}");
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

//! [`PostgresStoreBuilder`]: connecting a [`PostgresStore`] (URL or pool, TLS, table, bounds).

use std::str::FromStr;
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use crate::store::near_cache::{Near, NearCache};
use crate::store::wake::Polling;
use crate::store::StoreError;

use super::busy::Canceller;
use super::listen::cleanup_task;
use super::sql::Sql;
use super::Connector;
use super::{millis, pool_error, Inner, PostgresStore, RENEWAL_CONNECTIONS};

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
    listen_url: Option<String>,
    #[cfg(feature = "postgres-tls")]
    roots: Option<Vec<u8>>,
}

/// The URL query parameter that says the URL names a transaction pooler (see
/// [`PostgresStore::builder`]); taken out of the URL before it is parsed.
const POOLING_PARAM: &str = "pooling=transaction";

/// `url` without [`POOLING_PARAM`], and whether it had it.
fn take_pooling_param(url: &str) -> (String, bool) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), false);
    };
    let mut found = false;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| {
            let ours = *p == POOLING_PARAM;
            found |= ours;
            !ours
        })
        .collect();
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, found)
}

/// The channel a store on `schema`.`table` notifies the end of a watched claim on: `idem_` and
/// a hash of both (a channel name is at most 63 bytes; schema and table may be longer).
fn channel_of(schema: &str, table: &str) -> String {
    let id = blake3::hash(format!("{schema}.{table}").as_bytes());
    format!("idem_{}", &id.to_hex()[..16])
}

impl PostgresStoreBuilder {
    /// The SQL that [`migrate`](PostgresStore::migrate) runs for this builder's schema and
    /// table, without a connection: for `sqlx::migrate!`, refinery or a migration file of your
    /// own (the default schema and table's is in the crate, `migrations/postgres.sql`). Each
    /// statement is idempotent (`IF NOT EXISTS`).
    ///
    /// ```
    /// use idempotency_layer::PostgresStore;
    ///
    /// let sql = PostgresStore::builder("postgres://app@db/orders")
    ///     .schema("billing")
    ///     .migration_sql()
    ///     .expect("valid names");
    /// assert!(sql.starts_with("CREATE SCHEMA IF NOT EXISTS \"billing\""));
    /// ```
    pub fn migration_sql(&self) -> Result<String, StoreError> {
        check_identifier("schema", &self.schema, 63)?;
        check_identifier("table", &self.table, 48)?;
        let channel = channel_of(&self.schema, &self.table);
        Ok(Sql::new(&self.schema, &self.table, &channel).migrate)
    }

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

    /// The most pooled connections (default 16; at least 1, else [`connect`](Self::connect)
    /// refuses it), besides the one that listens for notifications. Each request in flight
    /// holds one only for the length of a statement.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// The longest any one operation may take, waiting for a pooled connection and connecting
    /// included, before it fails with [`StoreError::Backend`] (default 2 s; zero is refused at
    /// connect).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
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

    /// How many expired rows one cleanup statement removes at most (default 1000; zero is
    /// refused at connect).
    pub fn cleanup_batch(mut self, rows: u32) -> Self {
        self.cleanup_batch = i64::from(rows);
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

    /// Where the store's listening connection (the one that `LISTEN`s, to wake waiters and
    /// keep near caches coherent) connects: by default the store's URL. Set it when that URL
    /// names a pooler in transaction mode (`pooling=transaction`, see
    /// [`PostgresStore::builder`]):
    /// to the server itself, or to a pooler in session mode.
    pub fn listen_url(mut self, url: impl Into<String>) -> Self {
        self.listen_url = Some(url.into());
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
        if self.pool.is_none() && self.pool_size == 0 {
            return Err(StoreError::Config(
                "pool_size must be at least 1: a pool of no connection runs nothing".into(),
            ));
        }
        if self.timeout.is_zero() {
            return Err(StoreError::Config(
                "timeout must be more than zero: every operation would fail at once".into(),
            ));
        }
        if self.cleanup_batch == 0 {
            return Err(StoreError::Config(
                "cleanup_batch must be at least 1 row (to stop the cleanup, set \
                 cleanup_interval to zero)"
                    .into(),
            ));
        }
        let (url, pooling_param) = take_pooling_param(&self.url);
        let unprepared = pooling_param;
        let mut config = tokio_postgres::Config::from_str(&url).map_err(not_a_url)?;
        config.connect_timeout(self.timeout);
        let listen_config = match &self.listen_url {
            Some(url) => {
                let mut c = tokio_postgres::Config::from_str(&take_pooling_param(url).0)
                    .map_err(not_a_url)?;
                c.connect_timeout(self.timeout);
                Some(c)
            }
            // Behind a pooler in transaction mode a `LISTEN` hears nothing, and stays on the
            // server session the pooler then hands to its other clients: no listener at all.
            None if unprepared => {
                tracing::warn!(
                    "idempotency: the postgres store is behind a pooler in transaction mode \
                     and has no listen_url: it does not LISTEN (a LISTEN there would hear \
                     nothing and stay on a session the pooler hands to its other clients); \
                     waiters poll and the near cache is off. Give the store a listen_url that \
                     reaches the server directly, or a pooler in session mode"
                );
                None
            }
            None => Some(config.clone()),
        };
        let tls = if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            #[cfg(feature = "postgres-tls")]
            {
                Connector::Rustls(tls::connector(self.roots.as_deref())?)
            }
            #[cfg(not(feature = "postgres-tls"))]
            return Err(StoreError::Config(
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
        let make_pool = |size: usize| -> Result<Pool, StoreError> {
            let mc = ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            };
            let manager = match &tls {
                Connector::Plain => Manager::from_config(config.clone(), NoTls, mc),
                #[cfg(feature = "postgres-tls")]
                Connector::Rustls(t) => Manager::from_config(config.clone(), t.clone(), mc),
            };
            let session_timeouts = session_timeouts.clone();
            let mut pool = Pool::builder(manager);
            if !unprepared {
                pool = pool.post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
                    let set = session_timeouts.clone();
                    Box::pin(async move {
                        client
                            .batch_execute(&set)
                            .await
                            .map_err(deadpool_postgres::HookError::Backend)
                    })
                }));
            }
            pool.max_size(size)
                .runtime(Runtime::Tokio1)
                .wait_timeout(Some(self.timeout))
                .create_timeout(Some(self.timeout))
                .recycle_timeout(Some(self.timeout))
                .build()
                .map_err(|e| StoreError::Backend(Box::new(e)))
        };
        let pool = match self.pool {
            Some(pool) => pool,
            None => make_pool(self.pool_size)?,
        };
        // Renewals run on connections of their own, which neither handlers (their
        // `TxCompletion` transactions take connections from `pool`) nor a burst of claims can
        // take: a busy pool must not starve the renewals that keep live claims alive.
        let renewals = make_pool(RENEWAL_CONNECTIONS)?;
        // Fail now if the server is unreachable.
        drop(pool.get().await.map_err(pool_error)?);
        let channel = channel_of(&self.schema, &self.table);
        let inner = Arc::new(Inner {
            sql: Sql::new(&self.schema, &self.table, &channel),
            pool,
            unprepared,
            renewals,
            hears: AtomicU8::new(if listen_config.is_none() {
                super::DEAF
            } else {
                0
            }),
            listen_config,
            schema: self.schema,
            table: self.table,
            channel,
            timeout: self.timeout,
            polling: self.polling,
            cleanup_batch: self.cleanup_batch,
            canceller: Canceller::new(tls.clone(), &config),
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

/// A URL tokio-postgres cannot read: a setting to change, not an outage.
fn not_a_url(e: tokio_postgres::Error) -> StoreError {
    StoreError::Config(format!("not a postgres URL the store can use: {e}"))
}

pub(super) fn check_identifier(what: &str, name: &str, max: usize) -> Result<(), StoreError> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= max;
    if ok {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "invalid {what} name {name:?}: use [A-Za-z_][A-Za-z0-9_]*, at most {max} bytes"
        )))
    }
}

impl PostgresStore {
    /// A builder for a store on the database at `url` (`postgres://user@host:port/db`, with
    /// libpq's parameters).
    ///
    /// # Behind a pooler in transaction mode
    ///
    /// Add `pooling=transaction` to the URL's parameters when it names a pooler in transaction
    /// mode (PgBouncer's `pool_mode = transaction`, the way most PostgreSQL deployments run
    /// it): `postgres://app@pgbouncer:6432/app?pooling=transaction`. The store takes the
    /// parameter out before it connects; a URL is the one way to say it, so a store configured
    /// from the environment ([`AnyStore::from_url`](crate::store::AnyStore::from_url)) says it
    /// too. Each transaction may then run on another server session, so the store:
    /// - prepares no statement: each is sent unnamed with its parameters, in one round trip;
    /// - sets nothing on a session: a `SET` would leak to the pooler's other clients. Its
    ///   statements are bounded by the store's [`timeout`](PostgresStoreBuilder::timeout) and
    ///   cancelled when it passes; set the pooler's `query_timeout` for a bound on the server
    ///   side too;
    /// - listens for notifications on a connection of its own, which a transaction pooler
    ///   cannot carry (`LISTEN` there succeeds, hears nothing, and stays on a server session
    ///   the pooler hands to its other clients): give it a URL that reaches the server
    ///   directly, or a pooler in session mode, with
    ///   [`listen_url`](PostgresStoreBuilder::listen_url). Without one, the store does not
    ///   listen at all: the near cache stays off and waiters poll
    ///   ([`listener_hears`](PostgresStore::listener_hears) is `Some(false)`; a warning is
    ///   logged at connect). A pooler the store is not told of is found out by the listener's
    ///   heartbeat notification, with the same outcome.
    ///
    /// ```
    /// use idempotency_layer::PostgresStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// # let Ok(url) = std::env::var("PGBOUNCER_URL") else { return Ok(()) };
    /// # let Ok(direct) = std::env::var("DATABASE_URL") else { return Ok(()) };
    /// let store = PostgresStore::builder(url) // postgres://app@pgbouncer:6432/app?pooling=transaction
    ///     .listen_url(direct) // postgres://app@db:5432/app
    ///     .connect()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            schema: "public".to_owned(),
            table: "idempotency_records".to_owned(),
            pool_size: 16,
            listen_url: None,
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
}

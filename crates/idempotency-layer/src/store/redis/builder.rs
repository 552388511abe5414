//! [`RedisStoreBuilder`]: connecting a [`RedisStore`] (a URL, a client, a cluster, Sentinels)
//! and checking the server's eviction policy.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Value};
#[cfg(feature = "redis-cluster")]
use tokio::sync::mpsc;

use crate::store::near_cache::{Near, NearCache};
use crate::store::wake::Polling;
use crate::store::StoreError;

use super::conn::{Conn, PubSubSource};
#[cfg(feature = "redis-cluster")]
use super::nodes::value_text;
use super::nodes::{judge_maxmemory_policies, multi_node_url, node_urls};
use super::redial::Redialing;
use super::{backend, timed_out, Inner, RedisStore};

/// Builds a [`RedisStore`]: [`RedisStore::builder`] or [`RedisStore::builder_from_client`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    pub(super) source: Source,
    conn: Option<ConnectionManager>,
    prefix: String,
    timeout: Duration,
    polling: Polling,
    near: Option<NearCache>,
    require_noeviction: bool,
    wait_for_replicas: Option<super::replicas::WaitForReplicas>,
}

#[derive(Clone, Debug)]
pub(super) enum Source {
    Url(String),
    Client(Box<redis::Client>),
    #[cfg(feature = "redis-cluster")]
    Cluster(Vec<String>),
    /// Sentinel URLs and the master name.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(Vec<String>, String),
}

impl Source {
    /// Where a store at `url` is: a cluster's nodes or Sentinel's, for their schemes (when the
    /// build has their feature), else the one server the URL names.
    fn of_url(url: String) -> Source {
        #[cfg(feature = "redis-cluster")]
        if let Some(nodes) = cluster_nodes_from_url(&url) {
            return Source::Cluster(nodes);
        }
        #[cfg(feature = "redis-sentinel")]
        if let Some((sentinels, master)) = super::sentinel::sentinel_from_url(&url) {
            return Source::Sentinel(sentinels, master);
        }
        Source::Url(url)
    }
}

/// Why a URL of a cluster or Sentinel scheme was left as a plain URL by [`Source::of_url`].
fn unserved_scheme(url: &str) -> Option<String> {
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    if scheme.ends_with("+cluster") {
        return Some(format!(
            "{url:?} names a Redis Cluster: build idempotency-layer with its `redis-cluster` \
             feature"
        ));
    }
    if scheme.ends_with("+sentinel") {
        return Some(if cfg!(feature = "redis-sentinel") {
            format!("{url:?}: a Sentinel URL names its master: redis+sentinel://HOST:PORT/MASTER")
        } else {
            format!(
                "{url:?} names a Sentinel deployment: build idempotency-layer with its \
                 `redis-sentinel` feature"
            )
        });
    }
    None
}

/// The node URLs a `redis+cluster://host1:port1,host2:port2` URL names (`rediss+cluster://` for
/// TLS): `["redis://host1:port1", "redis://host2:port2"]`; an item that has its own scheme
/// (`redis://...`) is kept as is. `None` for any other scheme.
#[cfg_attr(not(feature = "redis-cluster"), allow(dead_code))]
pub(super) fn cluster_nodes_from_url(url: &str) -> Option<Vec<String>> {
    let (base, rest) = multi_node_url(url, "+cluster")?;
    Some(node_urls(base, rest))
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("source", &self.source)
            .field("own_connection_manager", &self.conn.is_some())
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("near_cache", &self.near)
            .field("wait_for_replicas", &self.wait_for_replicas)
            .finish_non_exhaustive()
    }
}

/// The hash tag a key starting with `prefix` carries, as Redis Cluster reads it: what lies
/// between the first `{` and the first `}` after it, when that is not empty.
#[cfg_attr(not(feature = "redis-cluster"), allow(dead_code))]
pub(super) fn hash_tag(prefix: &str) -> Option<&str> {
    let open = prefix.find('{')?;
    let close = prefix[open + 1..].find('}')?;
    let tag = &prefix[open + 1..open + 1 + close];
    (!tag.is_empty()).then_some(tag)
}

/// Why `prefix` cannot be used on a cluster, if it cannot: a brace in it. A hash tag
/// (`{...}` with something between the braces) would send every key to one slot, on one
/// master; any other brace makes the store's keys and the keys it writes beside them (the
/// `{key}:acked` marker of [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas), which
/// must hash as its key does) land in different slots, on different masters.
#[cfg_attr(not(feature = "redis-cluster"), allow(dead_code))]
pub(super) fn cluster_prefix_problem(prefix: &str) -> Option<String> {
    if let Some(tag) = hash_tag(prefix) {
        return Some(format!(
            "the key prefix {prefix:?} holds the hash tag {{{tag}}}: on a cluster every key would \
             go to that one slot, on one master; choose a prefix without braces"
        ));
    }
    prefix.contains(['{', '}']).then(|| {
        format!(
            "the key prefix {prefix:?} holds a brace: on a cluster the store's keys and the \
             markers it writes beside them would hash to different slots, on different masters; \
             choose a prefix without braces"
        )
    })
}

impl RedisStoreBuilder {
    /// The prefix of every key and channel (default `idempotency:`). Give each service (or each
    /// test) its own. On a cluster, [`connect`](Self::connect) refuses a prefix that holds a
    /// brace: a hash tag (`{...}` with something between the braces) would send every key to
    /// that one slot, on one master, and any other brace would split a key from the keys the
    /// store writes beside it.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest any one operation (or a connection attempt) may take before it fails with
    /// [`StoreError::Backend`] (default 1 s; zero is refused at connect).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How waiters poll when no pub/sub message comes: `first` after the first check, doubling
    /// up to `max` (defaults 25 ms and 1 s).
    pub fn poll_interval(mut self, first: Duration, max: Duration) -> Self {
        self.polling = Polling::new(first, max);
        self
    }

    /// Keeps recently replayed records in this instance's memory ([`NearCache`]): a replay of
    /// a cached record costs no round trip. Claims still always go to Redis; an entry never
    /// outlives its record's TTL; a `forget` on any instance drops it from every instance's
    /// cache (published on the channel `{prefix}forget`, which every store with a near cache
    /// subscribes to; while that subscription is down, the cache is empty and off). Off by
    /// default. See [`NearCache`] for what it promises and what it does not.
    ///
    /// ```
    /// use idempotency_layer::store::NearCache;
    /// use idempotency_layer::RedisStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// # let Ok(url) = std::env::var("REDIS_URL") else { return Ok(()) };
    /// let store = RedisStore::builder(url)
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

    /// Closes the asynchronous-replication gap for claims and records: after a claim is
    /// written (`begin` answers [`Begin::New`](crate::store::Begin::New)) and after a record is written (`complete`),
    /// the store sends `WAIT replicas timeout` in the same round trip as the script, and the
    /// operation succeeds only if at least `replicas` replicas acknowledged the write within
    /// `timeout`. Off by default (a failover can then lose what was acknowledged just before
    /// it; see "Deploying" on [`RedisStore`]).
    ///
    /// When too few replicas acknowledge, the operation is a [`StoreError::Backend`] (the layer
    /// fails closed, 503 / UNAVAILABLE, and the client retries): a claim is then released in
    /// the background like any claim whose caller never learnt of it; a record stays written on
    /// the primary (Redis cannot take a write back) but `complete` does not report it `Ok` (the
    /// layer's retry of that `complete` is then refused as fenced, and logged: the record is
    /// there, only not known to be replicated).
    /// `release`, `renew` and `forget` do not wait (a lost release or renewal only lets a
    /// claim lapse; a lost `forget` brings a record back).
    ///
    /// A replay waits for the replicas too, unless its record is known to be replicated: a
    /// record whose `complete` was not acknowledged stays on the primary, and a duplicate
    /// answered from it at once would get a record a failover can still lose. A record is
    /// marked acknowledged (a field of its hash, written in the background) once a `WAIT`
    /// covered it, after its `complete` or after a replay that waited; replays of a marked
    /// record wait for no replica.
    ///
    /// Costs: a claim is acknowledged only after a replica's acknowledgement: a first
    /// execution pays about one round trip to the primary and one primary-replica round trip
    /// more for its claim, and its complete one primary-replica round trip; a replay of a
    /// marked record, or a duplicate that finds the claim in flight, writes nothing and waits
    /// for no replica (while the replicas are away, a replay of a record not yet marked fails
    /// closed like a write). A
    /// `WAIT` blocks the connection it is sent on, so those waits run on eight connections of
    /// the store's own: renewals, releases and replays never queue behind one (while a replica
    /// is down, each new claim or complete holds one of the eight for up to `timeout`, and
    /// the ones beyond them wait for a free one within the store's timeout). Measured in
    /// BENCHMARKS.md ("Redis wait_for_replicas"). `WAIT` narrows the gap, it does not make
    /// Redis a consensus store: a primary whose replica acknowledged can still lose the
    /// write if Sentinel promotes another replica that had not.
    ///
    /// ```
    /// use idempotency_layer::RedisStore;
    /// use std::time::Duration;
    ///
    /// let builder = RedisStore::builder("redis://127.0.0.1:6380")
    ///     .wait_for_replicas(1, Duration::from_millis(100));
    /// # let _ = builder;
    /// ```
    pub fn wait_for_replicas(mut self, replicas: usize, timeout: Duration) -> Self {
        self.wait_for_replicas = Some(super::replicas::WaitForReplicas { replicas, timeout });
        self
    }

    /// Runs commands on this connection manager (yours, shared with the rest of your
    /// application) instead of making one; the client given to the builder still opens the
    /// store's pub/sub connection. Its own timeouts and reconnection settings apply; every
    /// store operation is still bounded by [`timeout`](Self::timeout).
    pub fn connection_manager(mut self, conn: ConnectionManager) -> Self {
        self.conn = Some(conn);
        self
    }

    /// Refuses to start ([`connect`](Self::connect) fails) unless every server this store
    /// writes to (on a cluster, every node: masters, and the replicas a failover may promote) has `maxmemory-policy noeviction`, or when the
    /// policy cannot be read (`CONFIG` forbidden, as on some managed services: check it in their
    /// console, then leave this off). Off by default: an evicting policy is then logged as an
    /// error at connect and the store runs. Turn it on wherever you control the servers: an
    /// evicting policy turns memory pressure into duplicate executions, silently.
    ///
    /// ```
    /// use idempotency_layer::RedisStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// # let Ok(url) = std::env::var("REDIS_URL") else { return Ok(()) };
    /// let store = RedisStore::builder(url)
    ///     .require_noeviction(true) // fails here if Redis could evict a claim or a record
    ///     .connect()
    ///     .await?;
    /// assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn require_noeviction(mut self, require: bool) -> Self {
        self.require_noeviction = require;
        self
    }

    /// Connects (the server must be reachable now; later outages are survived by reconnecting),
    /// and reads the server's `maxmemory-policy` (on a cluster, every node's, replicas included): a policy that
    /// can evict this store's keys is logged as an error, or refused with
    /// [`require_noeviction`](Self::require_noeviction) (see "Deploying" on [`RedisStore`]); a
    /// server that forbids `CONFIG` is accepted, with a note in the log, unless
    /// `require_noeviction` is on.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        self.check()?;
        let (mut conn, client) = self.open(false).await?;
        // `WAIT` blocks the connection it is sent on until the replicas acknowledge (or its
        // timeout passes): replicated writes get connections of their own, so that nothing
        // else (renewals, releases, replays) ever queues behind one.
        let waits = match self.wait_for_replicas {
            Some(_) => {
                let opened = futures_util::future::join_all(
                    (0..super::replicas::WAIT_CONNECTIONS).map(|_| self.open(true)),
                )
                .await;
                let conns = opened
                    .into_iter()
                    .map(|r| r.map(|(c, _)| c))
                    .collect::<Result<Vec<_>, _>>()?;
                Some(super::replicas::WaitConns::new(conns))
            }
            None => None,
        };
        let maxmemory_policy =
            check_maxmemory_policy(&mut conn, self.timeout, self.require_noeviction).await?;
        #[cfg(feature = "redis-sentinel")]
        if let Conn::Sentinel(c) = &conn {
            c.set_maxmemory_policy(maxmemory_policy.clone());
        }
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn,
                client,
                prefix: self.prefix,
                timeout: self.timeout,
                polling: self.polling,
                waiters: Arc::default(),
                pubsub: OnceLock::new(),
                renewals_failed: Arc::default(),
                redials: Arc::default(),
                maxmemory_policy,
                near: self.near.map(Near::new),
                wait_for_replicas: self.wait_for_replicas,
                waits,
            }),
        })
    }

    /// The settings the store cannot work with, refused before anything connects.
    fn check(&self) -> Result<(), StoreError> {
        if self.timeout.is_zero() {
            return Err(StoreError::Config(
                "timeout must be more than zero: every operation would fail at once".into(),
            ));
        }
        if let Some(wait) = &self.wait_for_replicas {
            if wait.replicas == 0 || wait.timeout.is_zero() {
                return Err(StoreError::Config(format!(
                    "wait_for_replicas({}, {:?}): ask for at least one replica and a timeout                      above zero (Redis reads WAIT 0 as \"block for ever\"), or leave it unset",
                    wait.replicas, wait.timeout
                )));
            }
        }
        Ok(())
    }

    /// The store's connection and where its pub/sub comes from. `fresh`: a connection of its
    /// own, never the builder's [`connection_manager`](Self::connection_manager).
    async fn open(&self, fresh: bool) -> Result<(Conn, PubSubSource), StoreError> {
        Ok(match &self.source {
            Source::Url(url) => {
                if let Some(why) = unserved_scheme(url) {
                    return Err(StoreError::Config(why));
                }
                let client = redis::Client::open(url.as_str())
                    .map_err(|e| StoreError::Config(format!("{url:?} is not a redis URL: {e}")))?;
                self.single(fresh, client).await?
            }
            Source::Client(client) => self.single(fresh, (**client).clone()).await?,
            #[cfg(feature = "redis-sentinel")]
            Source::Sentinel(nodes, master) => {
                if self.conn.is_some() {
                    return Err(StoreError::Config(
                        "connection_manager is for a standalone server, not a sentinel".into(),
                    ));
                }
                let conn = super::sentinel::SentinelConn::connect(
                    nodes,
                    master,
                    manager_config(self.timeout),
                    self.timeout,
                    self.require_noeviction,
                )
                .await?;
                let client = PubSubSource::Sentinel(conn.clone());
                (Conn::Sentinel(conn), client)
            }
            #[cfg(feature = "redis-cluster")]
            Source::Cluster(nodes) => {
                if let Some(problem) = cluster_prefix_problem(&self.prefix) {
                    return Err(StoreError::Config(problem));
                }
                if self.conn.is_some() {
                    return Err(StoreError::Config(
                        "connection_manager is for a standalone server, not a cluster".into(),
                    ));
                }
                let client = cluster_client(nodes, self.timeout, None)?;
                let conn = tokio::time::timeout(self.timeout * 4, client.get_async_connection())
                    .await
                    .map_err(|_| timed_out(self.timeout * 4))?
                    .map_err(backend)?;
                (
                    Conn::Cluster(conn),
                    PubSubSource::Cluster(nodes.clone().into()),
                )
            }
        })
    }

    /// The connection to a standalone server through `client`: the builder's connection manager,
    /// or one of the store's own.
    async fn single(
        &self,
        fresh: bool,
        client: redis::Client,
    ) -> Result<(Conn, PubSubSource), StoreError> {
        let conn = match &self.conn {
            Some(conn) if !fresh => Redialing::new(conn.clone(), None, self.timeout),
            _ => {
                let config = manager_config(self.timeout);
                let conn = tokio::time::timeout(
                    self.timeout * 4,
                    client.get_connection_manager_with_config(config.clone()),
                )
                .await
                .map_err(|_| timed_out(self.timeout * 4))?
                .map_err(backend)?;
                Redialing::new(conn, Some((client.clone(), config)), self.timeout)
            }
        };
        Ok((Conn::Single(conn), PubSubSource::Single(Box::new(client))))
    }
}

/// The settings of the connection managers the store makes.
pub(super) fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(2)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(500))
}

/// Reads `maxmemory-policy` from every server the store writes to (on a cluster, every
/// master) and warns loudly when one can evict, or refuses it with `require`; returns the policy
/// (the first that can evict, if any), `None` when no server would say.
pub(super) async fn check_maxmemory_policy(
    conn: &mut Conn,
    timeout: Duration,
    require: bool,
) -> Result<Option<String>, StoreError> {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("maxmemory-policy");
    let read = async {
        match conn {
            Conn::Single(c) => Ok::<_, RedisError>(vec![(
                "the server".to_owned(),
                c.current().send_packed_command(&cmd).await?,
            )]),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => {
                use redis::aio::ConnectionLike;
                Ok(vec![(
                    "the primary".to_owned(),
                    c.req_packed_command(&cmd).await?,
                )])
            }
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
                // Every node, replicas too: a replica is promoted by a failover, and its policy
                // then decides what the master keeps.
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
                match c.route_command(cmd.clone(), routing).await? {
                    Value::Map(nodes) => Ok(nodes
                        .into_iter()
                        .map(|(node, v)| (format!("node {}", value_text(&node)), v))
                        .collect()),
                    other => Ok(vec![("the cluster".to_owned(), other)]),
                }
            }
        }
    };
    let replies: Vec<(String, Value)> = match tokio::time::timeout(timeout, read).await {
        Err(_) => return Err(timed_out(timeout)),
        Ok(Err(e)) if e.code().is_some() => vec![("the server".to_owned(), Value::Nil)],
        Ok(Err(e)) => return Err(backend(e)),
        Ok(Ok(replies)) => replies,
    };
    judge_maxmemory_policies(replies, require)
}

/// A cluster client on the seed `nodes`; with a push sender, it speaks RESP3 (pub/sub pushes
/// arrive on the command connection).
#[cfg(feature = "redis-cluster")]
pub(super) fn cluster_client(
    nodes: &[String],
    timeout: Duration,
    pushes: Option<mpsc::UnboundedSender<redis::PushInfo>>,
) -> Result<redis::cluster::ClusterClient, StoreError> {
    if nodes.is_empty() {
        return Err(StoreError::Config(
            "a redis cluster needs at least one seed node URL".into(),
        ));
    }
    let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(2)
        .min_retry_wait(10)
        .max_retry_wait(500);
    if let Some(tx) = pushes {
        builder = builder
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(tx);
    }
    builder.build().map_err(backend)
}

impl RedisStore {
    /// A builder for a store at `url`:
    ///
    /// - `redis://host:port/db` (`rediss://` for TLS with the `redis-tls` feature): one server;
    /// - `redis+cluster://host1:port1,host2:port2` (feature `redis-cluster`): a Redis Cluster,
    ///   as [`builder_cluster`](Self::builder_cluster) with those nodes;
    /// - `redis+sentinel://host1:port1,host2:port2/master` (feature `redis-sentinel`): the
    ///   primary Sentinel names `master`, as [`builder_sentinel`](Self::builder_sentinel).
    ///
    /// A URL the build cannot serve (a cluster or Sentinel URL without its feature, a Sentinel
    /// URL without a master name) is refused at [`connect`](RedisStoreBuilder::connect), with
    /// what to do.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            source: Source::of_url(url.into()),
            conn: None,
            prefix: "idempotency:".to_owned(),
            timeout: Duration::from_secs(1),
            polling: Polling::default(),
            near: None,
            require_noeviction: false,
            wait_for_replicas: None,
        }
    }

    /// A builder for a store on a Redis Cluster (feature `redis-cluster`), given the URLs of
    /// some of its nodes (`redis://host:port`; `rediss://` with `redis-tls`): the client learns
    /// the rest of the topology from them and follows slot moves and failovers by itself.
    /// Each operation is one script on one key, routed to the master of that key's slot;
    /// waiters `SSUBSCRIBE` to the key's channel and the scripts `SPUBLISH` on it (sharded
    /// pub/sub, Redis 7+). [`connection_manager`](RedisStoreBuilder::connection_manager) does
    /// not apply to a cluster.
    #[cfg(feature = "redis-cluster")]
    pub fn builder_cluster<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder {
            source: Source::Cluster(nodes.into_iter().map(Into::into).collect()),
            ..RedisStore::builder(String::new())
        }
    }

    /// A builder for a store on the primary that Redis Sentinel names `master` (feature
    /// `redis-sentinel`), given the URLs of some of the Sentinels (`redis://host:26379`).
    /// The store asks them for the primary at connect, and again whenever the node it talks to
    /// stops being the primary: a write refused with `READONLY` (a demoted primary; the
    /// command is sent again to the new one: it wrote nothing), or a connection refused or
    /// dropped (the command is not sent again: it may have run). The pub/sub connection
    /// follows. Data nodes are reached without credentials on database 0: for others, connect
    /// through a [`builder_from_client`](Self::builder_from_client) of your own and follow the
    /// primary yourself. [`connection_manager`](RedisStoreBuilder::connection_manager) does not
    /// apply.
    ///
    /// ```no_run
    /// use idempotency_layer::RedisStore;
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// let store = RedisStore::builder_sentinel(["redis://127.0.0.1:26379"], "mymaster")
    ///     .wait_for_replicas(1, Duration::from_millis(100))
    ///     .connect()
    ///     .await?;
    /// // The same: RedisStore::builder("redis+sentinel://127.0.0.1:26379/mymaster")
    /// assert_eq!(store.primary_switches(), 0);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis-sentinel")]
    pub fn builder_sentinel<I, S>(sentinels: I, master: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder {
            source: Source::Sentinel(
                sentinels.into_iter().map(Into::into).collect(),
                master.into(),
            ),
            ..RedisStore::builder(String::new())
        }
    }

    /// A builder for a store on a client you made (your own TLS certificates with
    /// `redis::Client::build_with_tls`, credentials, protocol settings). Add your own
    /// [`connection_manager`](RedisStoreBuilder::connection_manager) to share its connection.
    pub fn builder_from_client(client: redis::Client) -> RedisStoreBuilder {
        RedisStoreBuilder {
            source: Source::Client(Box::new(client)),
            ..RedisStore::builder(String::new())
        }
    }

    /// Connects to the server at `url` with the defaults (prefix `idempotency:`, timeout 1 s).
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder(url).connect().await
    }
}

//! What the store's commands and its pub/sub travel over: one connection to a standalone server
//! or a Sentinel-managed primary, or a cluster connection routing by slot.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Value};
#[cfg(feature = "redis-cluster")]
use redis::{ErrorKind, RedisError};
use tokio::time::Instant;

/// The connection commands go through: a standalone server's connection manager, or a
/// cluster connection that routes each command to the master of its key's slot.
#[derive(Clone)]
pub(super) enum Conn {
    Single(Redialing),
    #[cfg(feature = "redis-cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
    /// The primary the Sentinels name, followed through failovers.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(super::sentinel::SentinelConn),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => Box::pin(async move { c.current().req_packed_command(cmd).await }),
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => c.req_packed_command(cmd),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => {
                Box::pin(async move { c.current().req_packed_commands(cmd, offset, count).await })
            }
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.current().get_db(),
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => c.get_db(),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

impl Conn {
    /// A command on this connection went unanswered for the store's whole timeout: the
    /// connection may be gone half-open (a dead NAT entry, a host that froze), which no error
    /// ever reports, so it is replaced (see [`Redialing`]).
    /// Answers whether it was replaced (not when it was replaced a moment ago already).
    pub(super) fn unanswered(&self) -> bool {
        match self {
            Conn::Single(c) => c.unanswered(),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.unanswered(),
            // The cluster client times out a node's connection and reconnects it by itself.
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(_) => false,
        }
    }
}

/// A connection manager replaced by a fresh one (connecting on its first command) when a
/// command on it goes unanswered for the store's timeout.
///
/// redis-rs's [`ConnectionManager`] reconnects when an error says the connection dropped; a
/// response timeout is not such an error, so a connection gone half-open (its packets dropped,
/// no FIN or RST ever coming: a NAT entry expired, a server host frozen) would time out every
/// command until TCP keepalive gives up on it, hours by default. At most one replacement per
/// timeout: the commands that were waiting on the old connection time out together, and a
/// command sent on the new one must wait a whole timeout before it says anything of it.
/// A manager the user gave the store ([`connection_manager`](super::RedisStoreBuilder::connection_manager))
/// is theirs, and is never replaced.
#[derive(Clone)]
pub(super) struct Redialing(Arc<RedialShared>);

struct RedialShared {
    /// `None`: the user's manager, kept as it is.
    dial: Option<(redis::Client, ConnectionManagerConfig)>,
    timeout: Duration,
    current: RwLock<(ConnectionManager, Instant)>,
}

impl Redialing {
    /// `conn`, made from `dial` (replaced when unanswered), or the user's (`dial`: `None`).
    pub(super) fn new(
        conn: ConnectionManager,
        dial: Option<(redis::Client, ConnectionManagerConfig)>,
        timeout: Duration,
    ) -> Redialing {
        Redialing(Arc::new(RedialShared {
            dial,
            timeout,
            current: RwLock::new((conn, Instant::now())),
        }))
    }

    /// The manager commands go through now.
    pub(super) fn current(&self) -> ConnectionManager {
        self.0
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Replaces the manager unless it is the user's or was made less than a timeout ago;
    /// answers whether it did.
    pub(super) fn unanswered(&self) -> bool {
        let Some((client, config)) = &self.0.dial else {
            return false;
        };
        let mut current = self.0.current.write().unwrap_or_else(|e| e.into_inner());
        if current.1.elapsed() < self.0.timeout {
            // Replaced since this command was sent.
            return false;
        }
        match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
            Ok(fresh) => {
                tracing::warn!(
                    server = %client.get_connection_info().addr(),
                    timeout = ?self.0.timeout,
                    "idempotency: redis: a command went unanswered for the store's timeout; \
                     replacing the connection (it may have gone half-open)"
                );
                *current = (fresh, Instant::now());
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "idempotency: redis: cannot replace the connection");
                false
            }
        }
    }
}

/// Where the store's pub/sub connection comes from.
#[derive(Clone)]
pub(super) enum PubSubSource {
    Single(Box<redis::Client>),
    /// The cluster's seed nodes: the store opens its own RESP3 cluster connection for sharded
    /// pub/sub.
    #[cfg(feature = "redis-cluster")]
    Cluster(Arc<[String]>),
    /// The primary the store's command connection follows.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(super::sentinel::SentinelConn),
}

impl PubSubSource {
    /// A pub/sub connection to a standalone server (or the Sentinels' current primary).
    pub(super) async fn open_pubsub(&self) -> redis::RedisResult<redis::aio::PubSub> {
        match self {
            PubSubSource::Single(client) => client.get_async_pubsub().await,
            #[cfg(feature = "redis-sentinel")]
            PubSubSource::Sentinel(conn) => super::sentinel::open_pubsub(conn).await,
            #[cfg(feature = "redis-cluster")]
            PubSubSource::Cluster(_) => Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a cluster's pub/sub is sharded (cluster_pubsub_task)",
            ))),
        }
    }
}

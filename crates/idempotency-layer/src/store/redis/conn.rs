//! What the store's commands and its pub/sub travel over: one connection to a standalone server
//! or a Sentinel-managed primary, or a cluster connection routing by slot.

#[cfg(feature = "redis-cluster")]
use std::sync::Arc;

use redis::{Cmd, Value};
#[cfg(feature = "redis-cluster")]
use redis::{ErrorKind, RedisError};

use super::redial::Redialing;

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

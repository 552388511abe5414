//! `RedisStore` on a Sentinel-managed primary (feature `redis-sentinel`): the connection asks the
//! Sentinels for the current primary at connect, and again when the node it talks to stops
//! being the primary (a write answered `READONLY`, the connection was refused or dropped).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;

use super::redial::Redialing;
use super::{backend, timed_out, StoreError};

/// The Sentinels are asked at most this often while the primary they name does not change
/// (during the seconds a failover takes, every failed command would otherwise ask again).
const MIN_ASK_INTERVAL: Duration = Duration::from_millis(100);

/// The sentinel URLs and the master name of a `redis+sentinel://host1:port1,host2:port2/name`
/// URL (`rediss+sentinel://` for TLS to the sentinels and the data nodes); `None` for any other
/// scheme or a URL without a master name.
pub(super) fn sentinel_from_url(url: &str) -> Option<(Vec<String>, String)> {
    let (base, rest) = super::nodes::multi_node_url(url, "+sentinel")?;
    let (nodes, name) = rest.rsplit_once('/')?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    let nodes = super::nodes::node_urls(base, nodes);
    (!nodes.is_empty()).then(|| (nodes, name.to_owned()))
}

/// How the data nodes the Sentinels name are reached: with the credentials (user, password,
/// database) and the TLS of the URL (`rediss+sentinel://user:password@host:port/master`), as
/// the Sentinels themselves are. Without it, the primary would be reached in plain text and
/// unauthenticated.
pub(super) fn data_nodes(sentinel_url: &str) -> Result<SentinelNodeConnectionInfo, StoreError> {
    let info = redis::IntoConnectionInfo::into_connection_info(sentinel_url).map_err(backend)?;
    let mut nodes = SentinelNodeConnectionInfo::default()
        .set_redis_connection_info(info.redis_settings().clone());
    if let redis::ConnectionAddr::TcpTls { insecure, .. } = info.addr() {
        nodes = nodes.set_tls_mode(if *insecure {
            redis::TlsMode::Insecure
        } else {
            redis::TlsMode::Secure
        });
    }
    Ok(nodes)
}

/// The store's command connection on a Sentinel-managed primary: a [`Redialing`] manager on
/// the primary the Sentinels named last, replaced when that node is no longer the primary.
#[derive(Clone)]
pub(super) struct SentinelConn(Arc<Shared>);

struct Shared {
    master: String,
    sentinel: tokio::sync::Mutex<Asker>,
    current: RwLock<Current>,
    config: ConnectionManagerConfig,
    timeout: Duration,
    /// How many times the store moved to another primary.
    switches: AtomicU64,
    /// [`RedisStoreBuilder::require_noeviction`](super::RedisStoreBuilder::require_noeviction).
    require_noeviction: bool,
    /// The current primary's `maxmemory-policy`, read at connect and after each switch.
    policy: RwLock<Option<String>>,
}

struct Asker {
    client: SentinelClient,
    last_asked: Option<Instant>,
}

#[derive(Clone)]
struct Current {
    /// Bumped at each switch: a command that failed on generation g asks again only if nobody
    /// switched since.
    generation: u64,
    client: redis::Client,
    conn: Redialing,
}

impl fmt::Debug for SentinelConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let current = self.current();
        f.debug_struct("SentinelConn")
            .field("master", &self.0.master)
            .field("primary", &current.client.get_connection_info().addr())
            .finish_non_exhaustive()
    }
}

impl SentinelConn {
    /// Asks the Sentinels at `nodes` for the primary of `master` and connects to it.
    pub(super) async fn connect(
        nodes: &[String],
        master: &str,
        config: ConnectionManagerConfig,
        timeout: Duration,
        require_noeviction: bool,
    ) -> Result<SentinelConn, StoreError> {
        if nodes.is_empty() {
            return Err(StoreError::Config(
                "a redis sentinel store needs at least one sentinel URL".into(),
            ));
        }
        // A `String` without redis's `tls-rustls` feature, an `impl AsRef<str>` with it.
        #[allow(clippy::unnecessary_to_owned)]
        let mut sentinel = SentinelClient::build(
            nodes.iter().map(String::as_str).collect(),
            master.to_owned(),
            Some(data_nodes(&nodes[0])?),
            SentinelServerType::Master,
        )
        .map_err(backend)?;
        let client = tokio::time::timeout(timeout * 4, sentinel.async_get_client())
            .await
            .map_err(|_| timed_out(timeout * 4))?
            .map_err(backend)?;
        let conn = tokio::time::timeout(
            timeout * 4,
            client.get_connection_manager_with_config(config.clone()),
        )
        .await
        .map_err(|_| timed_out(timeout * 4))?
        .map_err(backend)?;
        Ok(SentinelConn(Arc::new(Shared {
            master: master.to_owned(),
            sentinel: tokio::sync::Mutex::new(Asker {
                client: sentinel,
                last_asked: Some(Instant::now()),
            }),
            current: RwLock::new(Current {
                generation: 0,
                conn: Redialing::new(conn, Some((client.clone(), config.clone())), timeout),
                client,
            }),
            config,
            timeout,
            switches: AtomicU64::new(0),
            require_noeviction,
            policy: RwLock::new(None),
        })))
    }

    /// The current primary's `maxmemory-policy` (as last read).
    pub(super) fn maxmemory_policy(&self) -> Option<String> {
        self.0
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Sets what [`check_maxmemory_policy`](super::builder::check_maxmemory_policy) read at
    /// connect.
    pub(super) fn set_maxmemory_policy(&self, policy: Option<String>) {
        *self.0.policy.write().unwrap_or_else(|e| e.into_inner()) = policy;
    }

    fn current(&self) -> Current {
        self.0
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A client for the primary as last named by the Sentinels (the pub/sub connection's).
    pub(super) fn client(&self) -> redis::Client {
        self.current().client
    }

    /// How many times the store moved to another primary since it connected.
    pub(super) fn switches(&self) -> u64 {
        self.0.switches.load(Ordering::Relaxed)
    }

    /// A command went unanswered for the store's timeout: the primary may be gone (a failover
    /// the Sentinels may name by now), or its connection half-open; the Sentinels are asked
    /// again in the background and, if they still name this node, its connection is replaced.
    pub(super) fn unanswered(&self) -> bool {
        let current = self.current();
        let shared = self.0.clone();
        tokio::spawn(async move { shared.ask_again(current.generation).await });
        current.conn.unanswered()
    }

    /// Asks the Sentinels again, unless someone switched since generation `seen` or asked less
    /// than [`MIN_ASK_INTERVAL`] ago; switches to the primary they name if it is another node.
    /// Runs in its own task: a command whose future is dropped does not cut it short.
    async fn ask_again(&self, seen: u64) -> Current {
        let shared = self.0.clone();
        let task = tokio::spawn(async move { shared.ask_again(seen).await });
        match task.await {
            Ok(current) => current,
            Err(_) => self.current(),
        }
    }
}

impl Shared {
    async fn ask_again(&self, seen: u64) -> Current {
        let mut asker = self.sentinel.lock().await;
        let current = self
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if current.generation != seen
            || asker
                .last_asked
                .is_some_and(|t| t.elapsed() < MIN_ASK_INTERVAL)
        {
            return current;
        }
        asker.last_asked = Some(Instant::now());
        let asked = tokio::time::timeout(self.timeout, asker.client.async_get_client()).await;
        let client = match asked {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                tracing::debug!(master = %self.master, error = %e, "idempotency: redis sentinel: no primary named yet");
                return current;
            }
            Err(_) => return current,
        };
        if client.get_connection_info().addr() == current.client.get_connection_info().addr() {
            // Same node (the failover has not happened yet): its manager reconnects by itself.
            return current;
        }
        let made = tokio::time::timeout(
            self.timeout * 4,
            client.get_connection_manager_with_config(self.config.clone()),
        )
        .await;
        let conn = match made {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "idempotency: redis sentinel: the new primary does not answer yet");
                return current;
            }
            Err(_) => return current,
        };
        // The new primary's eviction policy, judged as at connect: an evicting one is logged,
        // and with `require_noeviction` not followed (the store's writes fail closed there).
        let mut config_get = redis::cmd("CONFIG");
        config_get.arg("GET").arg("maxmemory-policy");
        let read =
            tokio::time::timeout(self.timeout, conn.clone().send_packed_command(&config_get)).await;
        let reply = match read {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) if e.code().is_some() => Value::Nil,
            _ => return current,
        };
        let node = format!("the new primary {}", client.get_connection_info().addr());
        let policy = match super::nodes::judge_maxmemory_policies(
            vec![(node, reply)],
            self.require_noeviction,
        ) {
            Ok(policy) => policy,
            Err(e) => {
                tracing::error!(
                    master = %self.master,
                    error = %e,
                    "idempotency: redis sentinel: not following the primary's move (writes fail \
                     closed until its maxmemory-policy is noeviction)"
                );
                return current;
            }
        };
        tracing::warn!(
            master = %self.master,
            from = %current.client.get_connection_info().addr(),
            to = %client.get_connection_info().addr(),
            "idempotency: redis sentinel: the primary moved; the store follows it"
        );
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = policy;
        let next = Current {
            generation: current.generation + 1,
            conn: Redialing::new(
                conn,
                Some((client.clone(), self.config.clone())),
                self.timeout,
            ),
            client,
        };
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next.clone();
        self.switches.fetch_add(1, Ordering::Relaxed);
        next
    }
}

/// An error that proves the command did not run on a primary: a replica refused the write
/// (`READONLY`), or no connection was made. The command is sent again to the primary the
/// Sentinels name now.
fn not_run_on_a_primary(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) || e.is_connection_refusal()
}

/// An error after which the node may be gone (the command may have run: not sent again).
fn node_may_be_gone(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

fn readonly_in(values: &[Value]) -> bool {
    values
        .iter()
        .any(|v| matches!(v, Value::ServerError(e) if e.code() == "READONLY"))
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let current = self.current();
            let mut conn = current.conn.current();
            match conn.req_packed_command(cmd).await {
                // Error replies come back as values here; the caller makes them errors.
                Ok(value) if readonly_in(std::slice::from_ref(&value)) => {
                    let mut conn = self.ask_again(current.generation).await.conn.current();
                    conn.req_packed_command(cmd).await
                }
                Err(e) if not_run_on_a_primary(&e) => {
                    let mut conn = self.ask_again(current.generation).await.conn.current();
                    conn.req_packed_command(cmd).await
                }
                Err(e) => {
                    if node_may_be_gone(&e) {
                        self.ask_again(current.generation).await;
                    }
                    Err(e)
                }
                ok => ok,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let current = self.current();
            let mut conn = current.conn.current();
            match conn.req_packed_commands(cmd, offset, count).await {
                // A pipeline with `ignore_errors` has its errors among its values: a script
                // refused by a replica wrote nothing (it fails at its first write).
                Ok(values) if readonly_in(&values) => {
                    let mut conn = self.ask_again(current.generation).await.conn.current();
                    conn.req_packed_commands(cmd, offset, count).await
                }
                Err(e) if not_run_on_a_primary(&e) => {
                    let mut conn = self.ask_again(current.generation).await.conn.current();
                    conn.req_packed_commands(cmd, offset, count).await
                }
                Err(e) => {
                    if node_may_be_gone(&e) {
                        self.ask_again(current.generation).await;
                    }
                    Err(e)
                }
                ok => ok,
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.current().conn.current().get_db()
    }
}

impl fmt::Debug for Current {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Current")
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

/// Opens a pub/sub connection on the primary as last named (pub/sub messages also reach the
/// replicas through replication, so a connection left on a demoted primary still hears them).
pub(super) async fn open_pubsub(conn: &SentinelConn) -> RedisResult<redis::aio::PubSub> {
    conn.client().get_async_pubsub().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_their_sentinels_and_master() {
        assert_eq!(
            sentinel_from_url("redis+sentinel://a:26379,b:26380/idem").unwrap(),
            (
                vec!["redis://a:26379".to_owned(), "redis://b:26380".to_owned()],
                "idem".to_owned()
            )
        );
        assert_eq!(
            sentinel_from_url("rediss+sentinel://a:1/m").unwrap().0,
            ["rediss://a:1"]
        );
        assert!(sentinel_from_url("redis+sentinel://a:1").is_none());
        assert!(sentinel_from_url("redis+sentinel://a:1/").is_none());
        assert!(sentinel_from_url("redis://a:1/idem").is_none());
    }
}

//! [`RedisStore`]: claims and records in Redis, shared by every instance of a service.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, Value};
use tokio::sync::{mpsc, oneshot};

use super::near_cache::{scope_from_hex, Near, NearCache, NearCacheStats, Ticket};
use super::wake::{Polling, Waiters};
use super::{codec, LATE_COMPLETE_GRACE};
use super::{Begin, Fingerprint, IdempotencyStore, Record, ScopeKey, StoreError, Token};

mod replicas;
#[cfg(feature = "redis-sentinel")]
mod sentinel;

// The time in Redis's own clock, in ms (instances with skewed clocks agree).
const NOW: &str = r#"
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
"#;

/// Claims the key: free (absent, expired by Redis, a claim whose lease lapsed, or the tombstone
/// of a forgotten claim) -> in flight; else reports what holds it. A claim that already holds
/// this call's own token ARGV[1] is this call's: the command ran once already and is being
/// resent (a cluster connection resends after a lost reply), so it answers "claimed" again
/// rather than "in flight" (which would make the request wait for itself). A claim's lease end is its
/// field `e` (ms); the key itself lives ARGV[4] ms longer, so that a leader whose lease lapsed
/// with no takeover can still complete (as with the other stores).
const CLAIM: &str = r#"
local k = KEYS[1]
local function claim()
  redis.call('DEL', k)
  redis.call('HSET', k, 's', 'i', 't', ARGV[1], 'f', ARGV[2], 'e', now + tonumber(ARGV[3]))
  redis.call('PEXPIRE', k, tonumber(ARGV[3]) + tonumber(ARGV[4]))
  return {1}
end
local t = redis.call('TYPE', k)['ok']
if t == 'none' then return claim() end
if t ~= 'hash' then return {4, 'the key holds a ' .. t .. ', not an idempotency entry'} end
local v = redis.call('HMGET', k, 's', 't', 'f', 'r', 'e')
if v[1] == 'c' and v[4] then return {3, v[4], redis.call('PTTL', k)} end
if v[1] == 'i' and v[2] == ARGV[1] then return {1} end
if v[1] == 'i' and v[2] and v[3] then
  if v[5] and tonumber(v[5]) <= now then return claim() end
  return {2, v[2], v[3]}
end
if v[1] == 'x' then return claim() end
return {4, 'the entry has no valid state'}
"#;

/// Replaces the claim ARGV[1] (even one whose lease lapsed, if nobody took it over) with the
/// record ARGV[2], kept ARGV[3] ms; wakes the waiters.
const COMPLETE: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return 0 end
redis.call('DEL', k)
redis.call('HSET', k, 's', 'c', 'r', ARGV[2])
redis.call('PEXPIRE', k, ARGV[3])
redis.call(PUBLISH, k, 'c')
return 1
"#;

/// Removes the claim ARGV[1]; wakes the waiters.
const RELEASE: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return 0 end
redis.call('DEL', k)
redis.call(PUBLISH, k, 'r')
return 1
"#;

/// Extends the lease of the claim ARGV[1] to ARGV[2] ms from now.
const RENEW: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return 0 end
local v = redis.call('HMGET', k, 's', 't')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return 0 end
redis.call('HSET', k, 'e', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', k, tonumber(ARGV[2]) + tonumber(ARGV[3]))
return 1
"#;

/// [`RENEW`] for every key of KEYS in one call: ARGV[1] is how long a key outlives its lease
/// (ms), and claim i's token and lease (ms) are ARGV[2i] and ARGV[2i + 1]; answers 1 (renewed)
/// or 0 (no longer held) per key.
const RENEW_MANY: &str = r#"
local grace = tonumber(ARGV[1])
local out = {}
for i, k in ipairs(KEYS) do
  local token, lease = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  out[i] = 0
  if redis.call('TYPE', k)['ok'] == 'hash' then
    local v = redis.call('HMGET', k, 's', 't')
    if v[1] == 'i' and v[2] == token then
      redis.call('HSET', k, 'e', now + lease)
      redis.call('PEXPIRE', k, lease + grace)
      out[i] = 1
    end
  end
end
return out
"#;

/// The most claims one `RENEW_MANY` call carries: the script blocks the server while it runs,
/// so a tick with more claims sends several (each well under a millisecond).
const RENEW_CHUNK: usize = 512;

/// Removes whatever the key holds; wakes the waiters. A claim leaves a tombstone with its
/// token for as long as its key would have lived, so its leader's late complete is refused.
/// A record's removal is also published on the store's invalidation channel ARGV[1] (plain
/// `PUBLISH`: on a cluster it reaches every node), with the scope ARGV[2], for the instances'
/// near caches.
const FORGET: &str = r#"
local k = KEYS[1]
local t = redis.call('TYPE', k)['ok']
if t == 'none' then return 0 end
if t == 'hash' then
  local v = redis.call('HMGET', k, 's', 't')
  if v[1] == 'x' then return 0 end
  if v[1] == 'i' then
    local ttl = redis.call('PTTL', k)
    redis.call('DEL', k)
    redis.call('HSET', k, 's', 'x', 't', v[2])
    if ttl > 0 then redis.call('PEXPIRE', k, ttl) end
    redis.call(PUBLISH, k, 'f')
    return 1
  end
end
redis.call('DEL', k)
redis.call(PUBLISH, k, 'f')
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"#;

/// The lease left (ms) of the claim ARGV[1], or -2 if it no longer holds (ended, taken over,
/// or its lease lapsed: the waiter then begins again and takes it over).
const PEEK: &str = r#"
local k = KEYS[1]
if redis.call('TYPE', k)['ok'] ~= 'hash' then return -2 end
local v = redis.call('HMGET', k, 's', 't', 'e')
if v[1] ~= 'i' or v[2] ~= ARGV[1] then return -2 end
if not v[3] then return redis.call('PTTL', k) end
local left = tonumber(v[3]) - now
if left <= 0 then return -2 end
return left
"#;

/// A script's source for the server: the clock prelude where it needs one, and `PUBLISH` or
/// the cluster's `SPUBLISH` (sharded pub/sub: the message stays on the key's shard).
fn source(body: &str, publish: &str) -> String {
    let body = body.replace("redis.call(PUBLISH,", &format!("redis.call('{publish}',"));
    if body.contains("now") {
        format!("{NOW}{body}")
    } else {
        body
    }
}

/// A script: its source and the SHA1 `EVALSHA` names it by.
struct Lua {
    source: String,
    script: Script,
}

impl Lua {
    fn new(body: &str, publish: &str) -> Lua {
        let source = source(body, publish);
        Lua {
            script: Script::new(&source),
            source,
        }
    }
}

struct Scripts {
    claim: Lua,
    complete: Lua,
    release: Lua,
    renew: Lua,
    renew_many: Lua,
    forget: Lua,
    peek: Lua,
}

impl Scripts {
    fn new(publish: &str) -> Scripts {
        Scripts {
            claim: Lua::new(CLAIM, publish),
            complete: Lua::new(COMPLETE, publish),
            release: Lua::new(RELEASE, publish),
            renew: Lua::new(RENEW, publish),
            renew_many: Lua::new(RENEW_MANY, publish),
            forget: Lua::new(FORGET, publish),
            peek: Lua::new(PEEK, publish),
        }
    }
}

/// The scripts for a standalone server (`PUBLISH`) or a cluster (`SPUBLISH`: the message is
/// delivered on the shard that owns the key's slot, where the waiters `SSUBSCRIBE`d).
fn scripts(cluster: bool) -> &'static Scripts {
    static STANDALONE: OnceLock<Scripts> = OnceLock::new();
    static CLUSTER: OnceLock<Scripts> = OnceLock::new();
    if cluster {
        CLUSTER.get_or_init(|| Scripts::new("SPUBLISH"))
    } else {
        STANDALONE.get_or_init(|| Scripts::new("PUBLISH"))
    }
}

/// The connection commands go through: a standalone server's connection manager, or a
/// cluster connection that routes each command to the master of its key's slot.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    #[cfg(feature = "redis-cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
    /// The primary the Sentinels name, followed through failovers.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(sentinel::SentinelConn),
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
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
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(c) => c.get_db(),
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// Where the store's pub/sub connection comes from.
#[derive(Clone)]
enum PubSubSource {
    Single(Box<redis::Client>),
    /// The cluster's seed nodes: the store opens its own RESP3 cluster connection for sharded
    /// pub/sub.
    #[cfg(feature = "redis-cluster")]
    Cluster(Arc<[String]>),
    /// The primary the store's command connection follows.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(sentinel::SentinelConn),
}

impl PubSubSource {
    /// A pub/sub connection to a standalone server (or the Sentinels' current primary).
    async fn open_pubsub(&self) -> redis::RedisResult<redis::aio::PubSub> {
        match self {
            PubSubSource::Single(client) => client.get_async_pubsub().await,
            #[cfg(feature = "redis-sentinel")]
            PubSubSource::Sentinel(conn) => sentinel::open_pubsub(conn).await,
            #[cfg(feature = "redis-cluster")]
            PubSubSource::Cluster(_) => Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a cluster's pub/sub is sharded (cluster_pubsub_task)",
            ))),
        }
    }
}

/// The Redis store: claims and records in Redis, visible to every instance of a service.
///
/// - **One round trip per operation.** `begin` (the claim), `complete`, `release` and `renew`
///   are each one Lua script, run atomically by Redis with `EVALSHA` (and `EVAL` when the
///   server does not know the script yet, for example after a restart or a failover).
/// - **One key per scope**: `{prefix}` + the hex of the [`ScopeKey`] (a hash: no raw tenant or
///   idempotency key reaches Redis). Every operation touches exactly that key, so the layout
///   works on Redis Cluster unchanged (see "Deploying"). The entry is a hash: `s` (state: `i`
///   in flight, `c` completed), `t` (fencing token), `f` (fingerprint), `r` (the record,
///   postcard-encoded).
/// - **Expiry**: a claim's lease end is kept in the entry (Redis's own clock): once it passed,
///   the next `begin` takes the claim over with a new token, and the old leader's `complete` is
///   refused ([`StoreError::Fenced`]); with no takeover, the old leader's late `complete` is
///   kept, as with the other stores. A completed key expires with its TTL (`PEXPIRE`).
/// - **Waiters** are woken by pub/sub: every `complete`, `release` and `forget` publishes on
///   the key's own channel (same name as the key; on a cluster, `SPUBLISH` on the shard
///   channel, which lives on the key's slot). One dedicated pub/sub connection per store
///   carries the subscriptions of all its waiters, and reconnects by itself; a waiter also
///   polls with backoff (25 ms doubling to 1 s by default), so a lost message delays it at
///   most one poll interval and never hangs it.
/// - **Failures**: commands go through a [`ConnectionManager`] that reconnects on its own;
///   every operation is bounded by [`RedisStoreBuilder::timeout`], so an unreachable server
///   answers [`StoreError::Backend`] quickly (the layer then fails closed with 503 /
///   UNAVAILABLE). An entry that does not decode is [`StoreError::Corrupt`].
///
/// Measured by the `benchmarks` loadtest (Redis `INFO commandstats` deltas): a first
/// execution costs 2 round trips (claim, complete), a replay 1 (the claim finds the record).
///
/// # Choosing a store
///
/// | | [`MemoryStore`](crate::MemoryStore) | `RedisStore` | `PostgresStore` (feature `postgres`) |
/// |---|---|---|---|
/// | shared by instances | no | yes | yes |
/// | survives a restart of the service | no | yes | yes |
/// | survives a restart of the server | n/a | as far as Redis persistence goes (AOF `everysec`: up to ~1 s of writes lost; none: everything lost) | yes (committed rows are durable) |
/// | failover | n/a | replication is asynchronous: a claim or record written just before a failover can be lost, and that key can execute once more, unless [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas) | to a synchronous standby: nothing lost |
/// | round trips: first execution / replay | 0 / 0 | 2 / 1 (0 on a [near cache](RedisStoreBuilder::near_cache) hit) | 2 / 1 (0 on a near cache hit) |
/// | expiry | incremental, in process | Redis's own (`PEXPIRE`) | ignored at once, rows removed by a background task |
///
/// **What a multi-instance deployment needs**: every instance on the same Redis (or cluster)
/// with the same [prefix](RedisStoreBuilder::prefix) and the same layer configuration
/// ([`lease`](crate::IdempotencyLayer::lease), [`ttl`](crate::IdempotencyLayer::ttl), key
/// headers, tenant source), so that every instance computes the same scope for a request.
///
/// # Deploying
///
/// - **Eviction policy: `maxmemory-policy noeviction`.** Every other policy can evict this
///   store's keys: `volatile-ttl` evicts the shortest TTLs first, which are the claims in
///   flight (a duplicate then runs), and `allkeys-*` / `volatile-lru` evict records (a retry
///   runs again). With `noeviction` a full Redis refuses writes: the layer fails closed with a
///   retryable 503 and nothing runs. The store reads the policy at connect (on a cluster, every
///   master's) and logs an error for any other ([`RedisStore::maxmemory_policy`]); with
///   [`require_noeviction(true)`](RedisStoreBuilder::require_noeviction) it refuses to start
///   instead: use that wherever you control the servers. Managed services that forbid `CONFIG`
///   are accepted without it (check the policy in their console).
/// - **Sizing**: `writes per second x TTL x (record size + ~200 bytes)`, plus claims in
///   flight. A claim whose leader crashed stays (small, fenced) up to an hour after its lease,
///   so that a late `complete` with no takeover is still kept.
/// - **TLS**: `rediss://host:port` with the `redis-tls` feature (rustls; the certificate is
///   checked against the system's roots). For a private CA or client certificates, build a
///   `redis::Client::build_with_tls` and use [`RedisStore::builder_from_client`];
///   `rediss://...#insecure` encrypts without checking.
/// - **Your own connection**: [`builder_from_client`](RedisStore::builder_from_client) and
///   [`connection_manager`](RedisStoreBuilder::connection_manager) reuse what your application
///   already has.
/// - **Cluster** (feature `redis-cluster`, Redis 7+): connect with
///   [`RedisStore::builder_cluster`]`(["redis://node1:6379", "redis://node2:6379"])` (some
///   seed nodes; the client discovers the rest), or `redis+cluster://node1:6379,node2:6379`
///   with [`AnyStore::from_url`](crate::store::AnyStore::from_url). Every script touches
///   exactly one key, so it runs on the master of that key's slot (the client follows
///   `MOVED` / `ASK` and topology changes by itself); keys of different scopes spread over all
///   masters. Waiters use **sharded pub/sub**: they `SSUBSCRIBE` to the key's channel on its
///   shard, over one RESP3 cluster connection per store, and the scripts `SPUBLISH` there, so
///   a wake-up never crosses the cluster bus. When a node's connection drops, every waiter
///   re-checks at once and the client resubscribes; polling still bounds any lost message.
///   `maxmemory-policy` is read from every master: set `noeviction` on every node. A prefix must
///   not contain a `{hash tag}` (it would put every key in one slot). Failover within the
///   cluster is asynchronous, as below. Tested against a local 3-master cluster
///   (`.ci/redis-cluster.sh`).
/// - **Sentinel** (feature `redis-sentinel`): connect with
///   [`RedisStore::builder_sentinel`]`(["redis://sentinel1:26379"], "mymaster")`. The store
///   asks the Sentinels for the primary, and asks again when the node it talks to is no longer
///   the primary (a write refused `READONLY` by a demoted primary is sent again to the new one;
///   a refused or dropped connection fails that operation, the next goes to the new primary);
///   [`primary_switches`](RedisStore::primary_switches) counts the moves. Tested against a
///   local primary + replica + Sentinel (`.ci/redis-sentinel.sh`), with forced failovers.
/// - **Failover**: replication is asynchronous. The primary acknowledges a claim or a record
///   before any replica has it; a failover then promotes a replica without it, and the record
///   is gone (the key executes once more) or the claim is gone (a duplicate runs beside its
///   leader). Two windows: the replica's lag when the primary dies (usually milliseconds,
///   seconds if the replica was cut off), and a `SENTINEL FAILOVER` or a partition, where the
///   old primary keeps acknowledging writes until it is demoted: in RELIABILITY.md ("Redis
///   failover"), 7 % of the records acknowledged in a run with 3 such failovers were lost.
///   [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas)`(1, timeout)` closes the gap
///   for claims and records: each is acknowledged only once a replica has it (`WAIT`, in the
///   same round trip), and fails closed otherwise; no record it acknowledged was lost in those
///   runs. It costs a primary-replica round trip per operation, and `WAIT` holds the store's
///   one multiplexed connection while it waits: BENCHMARKS.md ("Redis wait_for_replicas")
///   measured the throughput and latency of begin + complete against the same run without it.
///   Sentinel may still promote a replica that had not acknowledged (with two replicas and
///   `WAIT 1`); `min-replicas-to-write` on the server bounds how long an isolated primary
///   accepts writes. Where a second execution is unacceptable, use `PostgresStore` with a
///   synchronous standby.
/// - **Renewals**: [`renewals_failed`](RedisStore::renewals_failed) counts lease renewals that
///   failed or were refused; each is logged. The layer renews every claim it holds in one
///   script per tick (512 claims per script; on a cluster, one per claim, since a script's keys
///   must share a slot).
/// - **What each fault costs**:
///   - *A lost reply* (a dropped connection, the [timeout](RedisStoreBuilder::timeout)): the
///     claim may have been written; the request answers 503 (retryable) and releases the claim
///     by its token in the background (the orphan release), so a retry is not blocked for a
///     lease. A cluster connection that *resends* the claim after a lost reply finds its own
///     token and answers "claimed": the request does not wait for itself.
///   - *A command still in flight when its request gives up*: Redis runs it whenever it reads
///     it. On one connection commands run in order, so the orphan release, sent after the claim,
///     runs after it; after a reconnection it can overtake a claim still buffered on the old
///     socket. What bounds that: Redis reads a socket's buffered commands at once unless a slow
///     command blocks it, and the connection's response timeout (the store's timeout) drops
///     the old socket; the orphan release tries again twice the timeout after the request gave
///     up, and removes a claim that landed late. A Redis blocked for longer (a slow script, a
///     `DEBUG SLEEP`) can still leave such a claim in place for one lease.
///   - *Eviction*: see above; *failover*: see below.
///
/// **Knobs**: [`prefix`](RedisStoreBuilder::prefix) (one per service or environment),
/// [`timeout`](RedisStoreBuilder::timeout) (how fast an outage fails closed, default 1 s),
/// [`poll_interval`](RedisStoreBuilder::poll_interval) (the waiters' fallback); on the layer,
/// [`lease`](crate::IdempotencyLayer::lease) (how long a crashed leader's claim blocks its key,
/// default 30 s) and [`ttl`](crate::IdempotencyLayer::ttl) (how long records are kept, default
/// 24 h). There is no pool to size: commands share one multiplexed connection, and waiters one
/// pub/sub connection.
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, RedisStore};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotency_layer::StoreError> {
/// # let Ok(url) = std::env::var("REDIS_URL") else { return Ok(()) };
/// let store = RedisStore::builder(url) // e.g. "redis://127.0.0.1:6379"
///     .prefix("orders:idem:")
///     .timeout(Duration::from_secs(1))
///     .connect()
///     .await?;
/// let layer = IdempotencyLayer::new(store)
///     .lease(Duration::from_secs(30)) // renewed every 10 s while the handler runs
///     .ttl(Duration::from_secs(24 * 3600)); // how long Redis keeps each record
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    client: PubSubSource,
    prefix: String,
    timeout: Duration,
    polling: Polling,
    waiters: Arc<Waiters>,
    pubsub: OnceLock<PubSub>,
    /// Lease renewals that failed or were refused (shared by stores made `with_prefix`).
    renewals_failed: Arc<AtomicU64>,
    /// The server's `maxmemory-policy` as read at connect, if it could be read.
    maxmemory_policy: Option<String>,
    /// Completed records kept here, if the builder asked for a near cache.
    near: Option<Arc<Near>>,
    /// [`RedisStoreBuilder::wait_for_replicas`], if asked for.
    wait_for_replicas: Option<replicas::WaitForReplicas>,
}

struct PubSub {
    commands: mpsc::UnboundedSender<Command>,
    unsubscribe: mpsc::UnboundedSender<String>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStore`]: [`RedisStore::builder`] or [`RedisStore::builder_from_client`].
#[derive(Clone)]
pub struct RedisStoreBuilder {
    source: Source,
    conn: Option<ConnectionManager>,
    prefix: String,
    timeout: Duration,
    polling: Polling,
    near: Option<NearCache>,
    require_noeviction: bool,
    wait_for_replicas: Option<replicas::WaitForReplicas>,
}

#[derive(Clone, Debug)]
enum Source {
    Url(String),
    Client(Box<redis::Client>),
    #[cfg(feature = "redis-cluster")]
    Cluster(Vec<String>),
    /// Sentinel URLs and the master name.
    #[cfg(feature = "redis-sentinel")]
    Sentinel(Vec<String>, String),
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

/// True for a `maxmemory-policy` under which Redis may evict this store's keys (every policy
/// but `noeviction`): an evicted claim lets a duplicate execute, an evicted record lets a retry
/// execute again.
pub fn maxmemory_policy_can_evict(policy: &str) -> bool {
    !policy.eq_ignore_ascii_case("noeviction")
}

impl RedisStoreBuilder {
    /// The prefix of every key and channel (default `idempotency:`). Give each service (or each
    /// test) its own.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest any one operation (or a connection attempt) may take before it fails with
    /// [`StoreError::Backend`] (default 1 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
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
    /// written (`begin` answers [`Begin::New`]) and after a record is written (`complete`),
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
    /// Costs: the primary answers only after a replica's acknowledgement (about one
    /// primary-replica round trip more per first execution; replays that find a record pay it
    /// too, since `WAIT` goes with every claim script), and a waiting `WAIT` holds back the
    /// commands queued behind it on the store's one multiplexed connection. Measured in
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
        self.wait_for_replicas = Some(replicas::WaitForReplicas {
            replicas,
            timeout: timeout.max(Duration::from_millis(1)),
        });
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
    /// writes to (on a cluster, every master) has `maxmemory-policy noeviction`, or when the
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
    /// assert_eq!(store.maxmemory_policy(), Some("noeviction"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn require_noeviction(mut self, require: bool) -> Self {
        self.require_noeviction = require;
        self
    }

    /// Connects (the server must be reachable now; later outages are survived by reconnecting),
    /// and reads the server's `maxmemory-policy` (on a cluster, every master's): a policy that
    /// can evict this store's keys is logged as an error, or refused with
    /// [`require_noeviction`](Self::require_noeviction) (see "Deploying" on [`RedisStore`]); a
    /// server that forbids `CONFIG` is accepted, with a note in the log, unless
    /// `require_noeviction` is on.
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let (mut conn, client) = match &self.source {
            Source::Url(url) => {
                self.single(redis::Client::open(url.as_str()).map_err(backend)?)
                    .await?
            }
            Source::Client(client) => self.single((**client).clone()).await?,
            #[cfg(feature = "redis-sentinel")]
            Source::Sentinel(nodes, master) => {
                if self.conn.is_some() {
                    return Err(StoreError::Backend(
                        "connection_manager is for a standalone server, not a sentinel".into(),
                    ));
                }
                let conn = sentinel::SentinelConn::connect(
                    nodes,
                    master,
                    manager_config(self.timeout),
                    self.timeout,
                )
                .await?;
                let client = PubSubSource::Sentinel(conn.clone());
                (Conn::Sentinel(conn), client)
            }
            #[cfg(feature = "redis-cluster")]
            Source::Cluster(nodes) => {
                if self.conn.is_some() {
                    return Err(StoreError::Backend(
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
        };
        let maxmemory_policy =
            check_maxmemory_policy(&mut conn, self.timeout, self.require_noeviction).await?;
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
                maxmemory_policy,
                near: self.near.map(Near::new),
                wait_for_replicas: self.wait_for_replicas,
            }),
        })
    }

    /// The connection to a standalone server through `client`: the builder's connection manager,
    /// or one of the store's own.
    async fn single(&self, client: redis::Client) -> Result<(Conn, PubSubSource), StoreError> {
        let conn = match &self.conn {
            Some(conn) => conn.clone(),
            None => tokio::time::timeout(
                self.timeout * 4,
                client.get_connection_manager_with_config(manager_config(self.timeout)),
            )
            .await
            .map_err(|_| timed_out(self.timeout * 4))?
            .map_err(backend)?,
        };
        Ok((Conn::Single(conn), PubSubSource::Single(Box::new(client))))
    }
}

/// The base scheme (`redis` or `rediss`) and the rest of a `redis{suffix}://...` or
/// `rediss{suffix}://...` URL; `None` for any other scheme.
fn multi_node_url<'a>(url: &'a str, suffix: &str) -> Option<(&'a str, &'a str)> {
    let (scheme, rest) = url.split_once("://")?;
    let base = scheme.strip_suffix(suffix)?;
    (base == "redis" || base == "rediss").then_some((base, rest))
}

/// The node URLs of a comma-separated `host:port` list, each given the scheme `base` unless it
/// has one of its own.
fn node_urls(base: &str, list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            if n.contains("://") {
                n.to_owned()
            } else {
                format!("{base}://{n}")
            }
        })
        .collect()
}

/// The settings of the connection managers the store makes.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
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
async fn check_maxmemory_policy(
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
                c.send_packed_command(&cmd).await?,
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
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                match c.route_command(cmd.clone(), routing).await? {
                    Value::Map(nodes) => Ok(nodes
                        .into_iter()
                        .map(|(node, v)| (format!("master {}", value_text(&node)), v))
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
    let mut policy = None;
    for (node, reply) in replies {
        match policy_in(&reply) {
            None => {
                let refusal = format!(
                    "cannot read maxmemory-policy on {node} (CONFIG is not allowed?); make sure \
                     it is noeviction, or records and claims may be evicted early"
                );
                if require {
                    return Err(StoreError::Backend(
                        format!(
                            "{refusal}. require_noeviction is on, so the store refuses to start: \
                             allow CONFIG GET for this user, or check the policy yourself and \
                             turn require_noeviction off"
                        )
                        .into(),
                    ));
                }
                tracing::info!("idempotency: {refusal}");
            }
            Some(p) if maxmemory_policy_can_evict(&p) => {
                if require {
                    return Err(StoreError::Backend(
                        format!(
                            "{node} has maxmemory-policy {p}, which can evict this store's keys \
                             (an evicted claim lets a duplicate execute, an evicted record lets a \
                             retry execute again); require_noeviction is on, so the store refuses \
                             to start: run CONFIG SET maxmemory-policy noeviction on every node \
                             (and in its config file)"
                        )
                        .into(),
                    ));
                }
                tracing::error!(
                    %node,
                    maxmemory_policy = %p,
                    "idempotency: redis maxmemory-policy can evict this store's keys: under memory \
                     pressure an evicted claim lets a duplicate execute, an evicted record lets a \
                     retry execute again. Set `maxmemory-policy noeviction` (writes then fail \
                     closed with 503 when Redis is full), or give Redis room for \
                     writes/s x TTL x record size"
                );
                policy = Some(p);
            }
            Some(p) => {
                policy.get_or_insert(p);
            }
        }
    }
    Ok(policy)
}

/// The policy in a `CONFIG GET maxmemory-policy` reply (`[name, value]`, or a map in RESP3);
/// `None` for an error reply or anything else.
fn policy_in(reply: &Value) -> Option<String> {
    match reply {
        Value::Array(items) if items.len() == 2 => Some(value_text(&items[1])),
        Value::Map(pairs) if pairs.len() == 1 => Some(value_text(&pairs[0].1)),
        _ => None,
    }
}

fn value_text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::VerbatimString { text, .. } => text.clone(),
        other => format!("{other:?}"),
    }
}

/// A cluster client on the seed `nodes`; with a push sender, it speaks RESP3 (pub/sub pushes
/// arrive on the command connection).
#[cfg(feature = "redis-cluster")]
fn cluster_client(
    nodes: &[String],
    timeout: Duration,
    pushes: Option<mpsc::UnboundedSender<redis::PushInfo>>,
) -> Result<redis::cluster::ClusterClient, StoreError> {
    if nodes.is_empty() {
        return Err(StoreError::Backend(
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

fn warn_renewal_failed(key: &str, e: &StoreError) {
    match e {
        StoreError::Fenced => tracing::warn!(
            key,
            "idempotency: lease renewal refused: the claim was taken over or forgotten; \
             a duplicate may be executing this key"
        ),
        e => tracing::warn!(
            key,
            error = %e,
            "idempotency: lease renewal failed; the claim lapses if this persists"
        ),
    }
}

fn backend(e: RedisError) -> StoreError {
    StoreError::Backend(Box::new(e))
}

/// False when the error proves the command never reached Redis (the connection was refused);
/// anything else after a command was handed to the connection may have run.
fn may_have_run(e: &StoreError) -> bool {
    match e {
        StoreError::Backend(e) => !e
            .downcast_ref::<RedisError>()
            .is_some_and(RedisError::is_connection_refusal),
        _ => false,
    }
}

fn timed_out(after: Duration) -> StoreError {
    StoreError::Backend(format!("redis did not answer within {after:?}").into())
}

fn millis(d: Duration) -> u64 {
    // At most "forever" (100 years): Redis refuses an expiry past its clock's range.
    u64::try_from(d.min(super::FOREVER).as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn token_bytes(t: Token) -> [u8; 16] {
    t.0.to_be_bytes()
}

fn token_from(bytes: &[u8]) -> Result<Token, StoreError> {
    <[u8; 16]>::try_from(bytes)
        .map(|b| Token(u128::from_be_bytes(b)))
        .map_err(|_| StoreError::Corrupt(format!("token of {} bytes, not 16", bytes.len())))
}

fn bulk(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        _ => None,
    }
}

impl RedisStore {
    fn near_listener(&self) -> Option<NearListener> {
        self.inner.near.as_ref().map(|near| NearListener {
            near: near.clone(),
            channel: self.forget_channel(),
        })
    }

    /// A builder for a store on the server at `url` (`redis://host:port/db`, or
    /// `rediss://host:port/db` for TLS with the `redis-tls` feature).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            source: Source::Url(url.into()),
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
    /// ```
    /// use idempotency_layer::RedisStore;
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idempotency_layer::StoreError> {
    /// # let Some((sentinels, master)) = std::env::var("REDIS_SENTINEL_URL").ok()
    /// #     .and_then(|url| RedisStore::sentinel_from_url(&url)) else { return Ok(()) };
    /// // e.g. (["redis://127.0.0.1:26379"], "mymaster")
    /// let store = RedisStore::builder_sentinel(sentinels, master)
    ///     .wait_for_replicas(1, Duration::from_millis(100))
    ///     .connect()
    ///     .await?;
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

    /// The Sentinel URLs and master name a `redis+sentinel://host1:port1,host2:port2/master`
    /// URL names (`rediss+sentinel://` for TLS): `(["redis://host1:port1",
    /// "redis://host2:port2"], "master")`, for [`builder_sentinel`](Self::builder_sentinel).
    /// `None` for any other scheme or without a master name.
    #[cfg(feature = "redis-sentinel")]
    pub fn sentinel_from_url(url: &str) -> Option<(Vec<String>, String)> {
        sentinel::sentinel_from_url(url)
    }

    /// How many times the store moved to another primary since it connected (a store made
    /// with `builder_sentinel`, feature `redis-sentinel`; 0 for any other).
    pub fn primary_switches(&self) -> u64 {
        match &self.inner.conn {
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.switches(),
            _ => 0,
        }
    }

    /// The node URLs a `redis+cluster://host1:port1,host2:port2` URL names (`rediss+cluster://`
    /// for TLS): `["redis://host1:port1", "redis://host2:port2"]`; an item that has its own
    /// scheme (`redis://...`) is kept as is. `None` for any other scheme.
    pub fn cluster_nodes_from_url(url: &str) -> Option<Vec<String>> {
        let (base, rest) = multi_node_url(url, "+cluster")?;
        Some(node_urls(base, rest))
    }

    /// True when the store runs on a Redis Cluster ([`builder_cluster`](Self::builder_cluster)).
    pub fn is_cluster(&self) -> bool {
        self.cluster()
    }

    fn cluster(&self) -> bool {
        match self.inner.conn {
            Conn::Single(_) => false,
            #[cfg(feature = "redis-cluster")]
            Conn::Cluster(_) => true,
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(_) => false,
        }
    }

    fn scripts(&self) -> &'static Scripts {
        scripts(self.cluster())
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

    /// Lease renewals that failed (the server was unreachable) or were refused (the claim had
    /// been taken over or forgotten) since the store was made; each is also logged. A rising
    /// count means leaders are at risk of losing their claims: check the server and the
    /// layer's [`lease`](crate::IdempotencyLayer::lease).
    pub fn renewals_failed(&self) -> u64 {
        self.inner.renewals_failed.load(Ordering::Relaxed)
    }

    /// The server's `maxmemory-policy` as read at connect; `None` if the server did not allow
    /// `CONFIG GET`. Anything but `noeviction` can evict this store's keys (see
    /// [`maxmemory_policy_can_evict`]).
    pub fn maxmemory_policy(&self) -> Option<&str> {
        self.inner.maxmemory_policy.as_deref()
    }

    /// Connects to the server at `url` with the defaults (prefix `idempotency:`, timeout 1 s).
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        RedisStore::builder(url).connect().await
    }

    /// What the near cache did, if the store has one ([`RedisStoreBuilder::near_cache`]).
    pub fn near_cache_stats(&self) -> Option<NearCacheStats> {
        self.inner.near.as_ref().map(|n| n.stats())
    }

    /// The channel `forget` publishes forgotten scopes on, for the near caches of every
    /// instance: the prefix + `forget`.
    fn forget_channel(&self) -> String {
        format!("{}forget", self.inner.prefix)
    }

    /// The key (and pub/sub channel) of `scope`: the prefix + 64 hex characters.
    pub fn key(&self, scope: &ScopeKey) -> String {
        format!("{}{}", self.inner.prefix, scope.to_hex())
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// A store on the same connections with another key prefix (cheap: no new connection until
    /// a waiter needs the pub/sub one).
    pub fn with_prefix(&self, prefix: impl Into<String>) -> RedisStore {
        RedisStore {
            inner: Arc::new(Inner {
                conn: self.inner.conn.clone(),
                client: self.inner.client.clone(),
                prefix: prefix.into(),
                timeout: self.inner.timeout,
                polling: self.inner.polling,
                waiters: Arc::default(),
                pubsub: OnceLock::new(),
                renewals_failed: self.inner.renewals_failed.clone(),
                maxmemory_policy: self.inner.maxmemory_policy.clone(),
                // Another prefix is other keys and another invalidation channel.
                near: self.inner.near.as_ref().map(|n| Near::new(n.config())),
                wait_for_replicas: self.inner.wait_for_replicas,
            }),
        }
    }

    /// Runs `script` on `key` in one round trip: `EVALSHA`, and `EVAL` with the source when
    /// the server answers `NOSCRIPT`.
    async fn run(&self, lua: &Lua, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        self.run_keys(lua, &[key], args).await
    }

    /// [`run`](Self::run) on several keys (on a cluster, all in one slot).
    async fn run_keys(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let command = |name: &str, first: &str| {
            let mut cmd = Cmd::new();
            cmd.arg(name).arg(first).arg(keys.len()).arg(keys);
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        let mut conn = self.inner.conn.clone();
        let op = async {
            match command("EVALSHA", lua.script.get_hash())
                .query_async::<Value>(&mut conn)
                .await
            {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    command("EVAL", &lua.source)
                        .query_async::<Value>(&mut conn)
                        .await
                }
                other => other,
            }
        };
        match tokio::time::timeout(self.inner.timeout, op).await {
            Ok(r) => r.map_err(backend),
            Err(_) => Err(timed_out(self.inner.timeout)),
        }
    }

    async fn run_flag(
        &self,
        lua: &Lua,
        scope: &ScopeKey,
        args: &[&[u8]],
    ) -> Result<(), StoreError> {
        match self.run(lua, &self.key(scope), args).await? {
            Value::Int(1) => Ok(()),
            Value::Int(0) => Err(StoreError::Fenced),
            other => Err(StoreError::Backend(
                format!("unexpected script reply {other:?}").into(),
            )),
        }
    }

    /// How long after its sender gave up a claim may still be written: a script runs at once
    /// when the server reads it, and a command already written to a connection is read within
    /// the connection's response timeout (the store's timeout) or the connection is dropped;
    /// twice that covers a command still queued to be written.
    fn settle(&self) -> Duration {
        self.inner.timeout * 2
    }

    /// Claims `scope` with `token` (a fresh one per call: see `begin`).
    async fn claim(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
        token: Token,
        ticket: Option<Ticket>,
    ) -> Result<Begin, StoreError> {
        let s = self.scripts();
        // Armed while the claim may be written with nobody knowing: the reply is pending (this
        // future may be dropped), or it was lost.
        let orphan = super::OrphanGuard::new(self, scope, token, lease, self.settle());
        let reply = self
            .run_replicated(
                &s.claim,
                &self.key(&scope),
                &[
                    &token_bytes(token),
                    &fingerprint.0,
                    millis(lease).to_string().as_bytes(),
                    millis(LATE_COMPLETE_GRACE).to_string().as_bytes(),
                ],
            )
            .await
            // With wait_for_replicas: a claim too few replicas acknowledged is an error, and an
            // orphan like any claim nobody knows they hold (released in the background).
            .and_then(|(reply, replicated)| match replicated {
                Err(e) if replicas::is_new_claim(&reply) => Err(e),
                _ => Ok(reply),
            });
        match &reply {
            Err(e) if may_have_run(e) => drop(orphan),
            _ => orphan.disarm(),
        }
        let reply = reply?;
        let Value::Array(items) = reply else {
            return Err(StoreError::Backend(
                format!("unexpected claim reply {reply:?}").into(),
            ));
        };
        let corrupt = || StoreError::Corrupt("malformed claim reply".to_owned());
        match items.first() {
            Some(Value::Int(1)) => Ok(Begin::New(token)),
            Some(Value::Int(2)) => {
                let t = items.get(1).and_then(bulk).ok_or_else(corrupt)?;
                let f = items.get(2).and_then(bulk).ok_or_else(corrupt)?;
                let holder = token_from(t)?;
                // Our own token: this call's claim, written by an earlier send of the same
                // command (a resend after a lost reply, by a script older than this one).
                if holder == token {
                    return Ok(Begin::New(token));
                }
                Ok(Begin::InFlight {
                    token: holder,
                    fingerprint: codec::fingerprint(f)?,
                })
            }
            Some(Value::Int(3)) => {
                let r = items.get(1).and_then(bulk).ok_or_else(corrupt)?;
                let record = Arc::new(codec::decode(r)?);
                if let (Some(near), Some(ticket), Some(Value::Int(ttl_ms))) =
                    (&self.inner.near, ticket, items.get(2))
                {
                    // -1 (no expiry, set by hand) is not cached: nothing would bound it but
                    // max_age, and a record is meant to expire.
                    if *ttl_ms > 0 {
                        let ttl_left = Duration::from_millis(*ttl_ms as u64);
                        near.offer(ticket, scope, &record, ttl_left);
                    }
                }
                Ok(Begin::Completed(record))
            }
            Some(Value::Int(4)) => {
                let why = items.get(1).and_then(bulk).unwrap_or(b"unknown");
                Err(StoreError::Corrupt(format!(
                    "redis key {}: {}",
                    self.key(&scope),
                    String::from_utf8_lossy(why)
                )))
            }
            _ => Err(corrupt()),
        }
    }

    /// The lease left of claim `token` on `scope`, or `None` when it no longer holds.
    async fn held(&self, key: &str, token: Token) -> Result<Option<Duration>, StoreError> {
        let s = self.scripts();
        match self.run(&s.peek, key, &[&token_bytes(token)]).await? {
            Value::Int(-2) => Ok(None),
            Value::Int(ms) if ms >= 0 => Ok(Some(Duration::from_millis(ms as u64))),
            // No expiry at all (set by hand): keep polling at the slowest interval.
            Value::Int(_) => Ok(Some(self.inner.polling.max)),
            other => Err(StoreError::Backend(
                format!("unexpected script reply {other:?}").into(),
            )),
        }
    }

    fn pubsub(&self) -> &PubSub {
        self.inner.pubsub.get_or_init(|| {
            let (commands, rx) = mpsc::unbounded_channel();
            let (unsubscribe, unsub_rx) = mpsc::unbounded_channel();
            match &self.inner.client {
                #[cfg(feature = "redis-sentinel")]
                PubSubSource::Sentinel(_) => {
                    tokio::spawn(pubsub_task(
                        self.inner.client.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
                PubSubSource::Single(_) => {
                    tokio::spawn(pubsub_task(
                        self.inner.client.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
                #[cfg(feature = "redis-cluster")]
                PubSubSource::Cluster(nodes) => {
                    tokio::spawn(cluster_pubsub_task(
                        nodes.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
            }
            PubSub {
                commands,
                unsubscribe,
            }
        })
    }
}

enum Command {
    Subscribe(String, oneshot::Sender<()>),
}

/// What the pub/sub task does for a near cache: subscribe to its invalidation channel and drop
/// the scopes published there.
struct NearListener {
    near: Arc<Near>,
    channel: String,
}

impl NearListener {
    /// Handles a message on `channel`; true if it was an invalidation.
    fn on_message(&self, channel: &[u8], payload: &[u8]) -> bool {
        if channel != self.channel.as_bytes() {
            return false;
        }
        match std::str::from_utf8(payload).ok().and_then(scope_from_hex) {
            Some(scope) => self.near.invalidate(&scope),
            None => {
                // Not ours to read; to be safe, forget everything.
                tracing::warn!(
                    channel = %self.channel,
                    "idempotency: unreadable near-cache invalidation; emptying the near cache"
                );
                self.near.set_live(false);
                self.near.set_live(true);
            }
        }
        true
    }
}

/// Owns the store's pub/sub connection: subscribes and unsubscribes channels as waiters come
/// and go, wakes local waiters on messages, and reconnects (resubscribing every channel that
/// still has waiters) when the connection is lost. Ends when the store is dropped.
/// Waits out `backoff` before the pub/sub connection is tried again, doubling it up to 2 s, while
/// dropping the subscribe and unsubscribe requests that arrive meanwhile (their waiters poll).
/// False when the store is gone (a channel closed): the task ends.
async fn sit_out(
    backoff: &mut Duration,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    unsubscribe: &mut mpsc::UnboundedReceiver<String>,
) -> bool {
    let sleep = tokio::time::sleep(*backoff);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => break,
            c = commands.recv() => if c.is_none() { return false },
            u = unsubscribe.recv() => if u.is_none() { return false },
        }
    }
    *backoff = (*backoff * 2).min(Duration::from_secs(2));
    true
}

async fn pubsub_task(
    client: PubSubSource,
    prefix: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<NearListener>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut unsubscribe: mpsc::UnboundedReceiver<String>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = match tokio::time::timeout(timeout, client.open_pubsub()).await {
            Ok(Ok(ps)) => Some(ps.split()),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "idempotency: redis pub/sub connect failed");
                None
            }
            Err(_) => None,
        };
        let Some((mut sink, mut stream)) = connected else {
            // Waiters poll meanwhile; pending subscriptions are dropped (their waiters poll).
            waiters.wake_all();
            if !sit_out(&mut backoff, &mut commands, &mut unsubscribe).await {
                return;
            }
            continue;
        };
        backoff = Duration::from_millis(50);
        let mut ok = true;
        if let Some(n) = &near {
            let r = tokio::time::timeout(timeout, sink.subscribe(&n.channel)).await;
            ok = matches!(r, Ok(Ok(())));
            // Served from only once every later invalidation is sure to arrive.
            n.near.set_live(ok);
        }
        for scope in waiters.scopes() {
            if sink.subscribe(format!("{prefix}{scope}")).await.is_err() {
                ok = false;
                break;
            }
        }
        while ok {
            tokio::select! {
                c = commands.recv() => match c {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let r = tokio::time::timeout(timeout, sink.subscribe(&channel)).await;
                        ok = matches!(r, Ok(Ok(())));
                        if ok {
                            let _ = ack.send(());
                        }
                    }
                },
                u = unsubscribe.recv() => match u {
                    None => return,
                    // A new waiter may have come since: keep the subscription then.
                    Some(scope) if !waiters.has(&scope) => {
                        let r = tokio::time::timeout(
                            timeout,
                            sink.unsubscribe(format!("{prefix}{scope}")),
                        )
                        .await;
                        ok = matches!(r, Ok(Ok(())));
                    }
                    Some(_) => {}
                },
                m = stream.next() => match m {
                    Some(msg) => {
                        let channel = msg.get_channel_name();
                        let invalidation = near.as_ref().is_some_and(|n| {
                            n.on_message(channel.as_bytes(), msg.get_payload_bytes())
                        });
                        if invalidation {
                            continue;
                        }
                        if let Some(scope) = channel.strip_prefix(prefix.as_str()) {
                            waiters.wake(scope);
                        }
                    }
                    None => ok = false,
                },
            }
        }
        tracing::debug!("idempotency: redis pub/sub connection lost; reconnecting");
        if let Some(n) = &near {
            n.near.set_live(false);
        }
        waiters.wake_all();
    }
}

/// The cluster's counterpart of [`pubsub_task`]: one RESP3 cluster connection per store whose
/// pushes come back on a channel. `SSUBSCRIBE` goes to the master of the channel's slot (the
/// key's: the scripts `SPUBLISH` there); the client reconnects to a lost node and resubscribes
/// its channels by itself, and a disconnection wakes every waiter so that they check at once.
#[cfg(feature = "redis-cluster")]
async fn cluster_pubsub_task(
    nodes: Arc<[String]>,
    prefix: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<NearListener>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut unsubscribe: mpsc::UnboundedReceiver<String>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let (tx, mut pushes) = mpsc::unbounded_channel();
        let connected = match cluster_client(&nodes, timeout, Some(tx)) {
            Ok(client) => {
                match tokio::time::timeout(timeout * 4, client.get_async_connection()).await {
                    Ok(Ok(conn)) => Some(conn),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "idempotency: redis cluster pub/sub connect failed");
                        None
                    }
                    Err(_) => None,
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "idempotency: redis cluster pub/sub client");
                None
            }
        };
        let Some(mut conn) = connected else {
            waiters.wake_all();
            if !sit_out(&mut backoff, &mut commands, &mut unsubscribe).await {
                return;
            }
            continue;
        };
        backoff = Duration::from_millis(50);
        if let Some(n) = &near {
            // A plain (not sharded) subscription: `forget` publishes with `PUBLISH`, which the
            // cluster bus carries to every node.
            let r = tokio::time::timeout(timeout, conn.subscribe(&n.channel)).await;
            n.near.set_live(matches!(r, Ok(Ok(()))));
        }
        for scope in waiters.scopes() {
            let r =
                tokio::time::timeout(timeout, conn.ssubscribe(format!("{prefix}{scope}"))).await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::debug!("idempotency: redis cluster ssubscribe failed; the waiter polls");
            }
        }
        loop {
            tokio::select! {
                c = commands.recv() => match c {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let r = tokio::time::timeout(timeout, conn.ssubscribe(&channel)).await;
                        if matches!(r, Ok(Ok(()))) {
                            let _ = ack.send(());
                        } else {
                            // The client reconnects by itself; meanwhile this waiter polls.
                            tracing::debug!(
                                channel,
                                "idempotency: redis cluster ssubscribe failed; the waiter polls"
                            );
                        }
                    }
                },
                u = unsubscribe.recv() => match u {
                    None => return,
                    Some(scope) if !waiters.has(&scope) => {
                        let _ = tokio::time::timeout(
                            timeout,
                            conn.sunsubscribe(format!("{prefix}{scope}")),
                        )
                        .await;
                    }
                    Some(_) => {}
                },
                m = pushes.recv() => match m {
                    Some(push) => match push.kind {
                        redis::PushKind::Message
                            if near.as_ref().is_some_and(|n| {
                                n.on_message(
                                    push.data.first().and_then(bulk).unwrap_or_default(),
                                    push.data.get(1).and_then(bulk).unwrap_or_default(),
                                )
                            }) => {}
                        redis::PushKind::SMessage | redis::PushKind::Message => {
                            if let Some(scope) = push
                                .data
                                .first()
                                .and_then(bulk)
                                .and_then(|c| std::str::from_utf8(c).ok())
                                .and_then(|c| c.strip_prefix(prefix.as_str()))
                            {
                                waiters.wake(scope);
                            }
                        }
                        // A node's connection was lost (a failover, a restart): its
                        // subscriptions come back with the reconnection; check now. The near
                        // cache may have missed an invalidation: empty it, and serve again
                        // once the invalidation channel is subscribed again.
                        redis::PushKind::Disconnection => {
                            waiters.wake_all();
                            if let Some(n) = &near {
                                n.near.set_live(false);
                                let r = tokio::time::timeout(timeout, conn.subscribe(&n.channel))
                                    .await;
                                n.near.set_live(matches!(r, Ok(Ok(()))));
                            }
                        }
                        _ => {}
                    },
                    None => break,
                },
            }
        }
        tracing::debug!("idempotency: redis cluster pub/sub connection lost; reconnecting");
        if let Some(n) = &near {
            n.near.set_live(false);
        }
        waiters.wake_all();
    }
}

impl IdempotencyStore for RedisStore {
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
                self.pubsub();
                Some(ticket)
            }
            None => None,
        };
        self.claim(scope, fingerprint, lease, codec::new_token(), ticket)
            .await
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let bytes = codec::encode(&record)?;
        let s = self.scripts();
        self.run_flag_replicated(
            &s.complete,
            &scope,
            &[
                &token_bytes(token),
                &bytes,
                millis(ttl).to_string().as_bytes(),
            ],
        )
        .await
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let s = self.scripts();
        self.run_flag(&s.release, &scope, &[&token_bytes(token)])
            .await
    }

    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let s = self.scripts();
        let r = self
            .run_flag(
                &s.renew,
                &scope,
                &[
                    &token_bytes(token),
                    millis(lease).to_string().as_bytes(),
                    millis(LATE_COMPLETE_GRACE).to_string().as_bytes(),
                ],
            )
            .await;
        if let Err(e) = &r {
            self.inner.renewals_failed.fetch_add(1, Ordering::Relaxed);
            warn_renewal_failed(&self.key(&scope), e);
        }
        r
    }

    async fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> Vec<Result<(), StoreError>> {
        if self.cluster() {
            // A script's keys must share a slot, and a cluster spreads claims over all of
            // them: one `RENEW` per claim, concurrently, over the cluster's multiplexed
            // connections (no pool to queue for).
            return futures_util::future::join_all(
                claims
                    .iter()
                    .map(|&(scope, token, lease)| self.renew(scope, token, lease)),
            )
            .await;
        }
        let s = self.scripts();
        let grace = millis(LATE_COMPLETE_GRACE).to_string();
        let mut results = Vec::with_capacity(claims.len());
        for chunk in claims.chunks(RENEW_CHUNK) {
            let keys: Vec<String> = chunk.iter().map(|(scope, _, _)| self.key(scope)).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let fields: Vec<([u8; 16], String)> = chunk
                .iter()
                .map(|&(_, token, lease)| (token_bytes(token), millis(lease).to_string()))
                .collect();
            let mut args: Vec<&[u8]> = Vec::with_capacity(1 + 2 * chunk.len());
            args.push(grace.as_bytes());
            for (token, lease) in &fields {
                args.push(token);
                args.push(lease.as_bytes());
            }
            let flags = match self.run_keys(&s.renew_many, &keys, &args).await {
                Ok(Value::Array(flags)) if flags.len() == chunk.len() => Ok(flags),
                Ok(other) => Err(StoreError::Backend(
                    format!("unexpected script reply {other:?}").into(),
                )),
                Err(e) => Err(e),
            };
            match flags {
                Ok(flags) => results.extend(flags.iter().map(|f| match f {
                    Value::Int(1) => Ok(()),
                    _ => Err(StoreError::Fenced),
                })),
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
        for ((scope, _, _), r) in claims.iter().zip(&results) {
            if let Err(e) = r {
                self.inner.renewals_failed.fetch_add(1, Ordering::Relaxed);
                warn_renewal_failed(&self.key(scope), e);
            }
        }
        results
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        let hex = scope.to_hex();
        let key = self.key(&scope);
        let pubsub = self.pubsub();
        let guard = self
            .inner
            .waiters
            .register(hex.clone(), Some(pubsub.unsubscribe.clone()));
        // Subscribe before the first check, so a message published after it is not lost; if
        // the subscription is slow or the pub/sub connection is down, polling covers.
        let (ack, acked) = oneshot::channel();
        if pubsub
            .commands
            .send(Command::Subscribe(key.clone(), ack))
            .is_ok()
        {
            let _ = tokio::time::timeout(self.inner.timeout, acked).await;
        }
        guard
            .wait(self.inner.polling, || self.held(&key, observed))
            .await
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        let s = self.scripts();
        let channel = self.forget_channel();
        let hex = scope.to_hex();
        // Before (a begin of this instance in flight now must not cache what it reads) and
        // after (one that read before the removal may have cached it meanwhile); the other
        // instances hear it on the channel.
        if let Some(near) = &self.inner.near {
            near.invalidate(&scope);
        }
        let r = self
            .run(
                &s.forget,
                &self.key(&scope),
                &[channel.as_bytes(), hex.as_bytes()],
            )
            .await;
        if let Some(near) = &self.inner.near {
            near.invalidate(&scope);
        }
        match r? {
            Value::Int(n) => Ok(n > 0),
            other => Err(StoreError::Backend(
                format!("unexpected script reply {other:?}").into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use test_support::env::env_url;

    /// The claim command sent twice with one token (what a cluster connection's resend after a
    /// lost reply does): both sends answer "claimed", and the key holds that one claim. (Before,
    /// the resend answered "in flight" with the request's own token: it waited for itself, got
    /// 409, and its key stayed blocked for a lease.) Another token still sees it in flight.
    async fn resent_claim_is_ours(store: RedisStore) {
        let scope =
            ScopeKey(*blake3::hash(codec::new_token().0.to_le_bytes().as_slice()).as_bytes());
        let fp = Fingerprint([5; 32]);
        let lease = Duration::from_secs(60);
        let token = codec::new_token();
        for send in ["first send", "resend"] {
            match store.claim(scope, fp, lease, token, None).await {
                Ok(Begin::New(t)) => assert_eq!(t, token, "{send}"),
                other => panic!("{send} of the same claim must answer New, got {other:?}"),
            }
        }
        match store.begin(scope, fp, lease).await {
            Ok(Begin::InFlight { token: t, .. }) => assert_eq!(t, token),
            other => panic!("another call must see the claim in flight, got {other:?}"),
        }
        store
            .release(scope, token)
            .await
            .expect("the one claim is released");
    }

    #[tokio::test]
    async fn a_resent_claim_is_the_senders_own_claim() {
        let Some(url) = env_url("REDIS_URL") else {
            return;
        };
        let store = RedisStore::builder(url)
            .prefix(format!("idem-resend-{}:", codec::new_token().0))
            .connect()
            .await
            .expect("REDIS_URL is set, so Redis must be reachable");
        resent_claim_is_ours(store).await;
    }

    #[cfg(feature = "redis-cluster")]
    #[tokio::test]
    async fn a_resent_claim_is_the_senders_own_claim_on_a_cluster() {
        let Some(urls) = env_url("REDIS_CLUSTER_URLS") else {
            return;
        };
        let store = RedisStore::builder_cluster(urls.split(',').map(str::trim))
            .prefix(format!("idem-resend-{}:", codec::new_token().0))
            .connect()
            .await
            .expect("REDIS_CLUSTER_URLS is set, so the cluster must be reachable");
        resent_claim_is_ours(store).await;
    }

    /// Only an error that may follow a sent claim arms the orphan release: a refused
    /// connection sent nothing, so no release task is spawned for it.
    #[test]
    fn a_refused_connection_never_ran_the_claim() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!may_have_run(&backend(refused)));
        let reset = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(may_have_run(&backend(reset)));
        assert!(may_have_run(&timed_out(Duration::from_secs(1))));
        assert!(!may_have_run(&StoreError::Fenced));
    }

    #[test]
    fn tokens_round_trip_and_bad_lengths_are_corrupt() {
        let t = Token(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(token_from(&token_bytes(t)).unwrap(), t);
        assert!(matches!(token_from(b"short"), Err(StoreError::Corrupt(_))));
    }

    #[test]
    fn cluster_urls_name_their_nodes() {
        assert_eq!(
            RedisStore::cluster_nodes_from_url("redis+cluster://a:7000,b:7001/").unwrap(),
            ["redis://a:7000", "redis://b:7001/"]
        );
        assert_eq!(
            RedisStore::cluster_nodes_from_url("rediss+cluster://redis://a:1, b:2").unwrap(),
            ["redis://a:1", "rediss://b:2"]
        );
        assert!(RedisStore::cluster_nodes_from_url("redis://a:1").is_none());
        assert!(RedisStore::cluster_nodes_from_url("memory").is_none());
    }

    #[test]
    fn cluster_scripts_publish_on_the_shard() {
        assert!(scripts(true).complete.source.contains("'SPUBLISH'"));
        assert!(scripts(false).complete.source.contains("'PUBLISH'"));
        assert!(!scripts(false).forget.source.contains("SPUBLISH"));
    }

    #[test]
    fn durations_are_at_least_one_millisecond() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_secs(2)), 2000);
    }
}

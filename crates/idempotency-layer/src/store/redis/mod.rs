//! [`RedisStore`]: claims and records in Redis, shared by every instance of a service.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use tokio::sync::{mpsc, oneshot};

use super::near_cache::{Near, NearCacheStats, Ticket};
use super::wake::{Polling, Waiters};
use super::{codec, LATE_COMPLETE_GRACE};
use super::{
    Backend, Begin, Fingerprint, Held, IdempotencyStore, Record, ScopeKey, StoreError, Token,
};

mod builder;
mod conn;
mod lua;
mod nodes;
mod pubsub;
mod redial;
mod replicas;
#[cfg(feature = "redis-sentinel")]
mod sentinel;

pub use self::builder::RedisStoreBuilder;
use self::conn::*;
use self::lua::*;
pub use self::nodes::maxmemory_policy_can_evict;
use self::pubsub::*;

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
/// - **Failures**: commands go through a [`ConnectionManager`](redis::aio::ConnectionManager) that reconnects on its own;
///   every operation is bounded by [`RedisStoreBuilder::timeout`], so an unreachable server
///   answers [`StoreError::Backend`] quickly (the layer then fails closed with 503 /
///   UNAVAILABLE). A connection on which a command went unanswered for that timeout is
///   replaced (at most once per timeout; [`redials`](RedisStore::redials) counts them): one
///   gone half-open, behind an expired NAT entry or to a frozen host, reports no error, and
///   would otherwise time out every command until TCP keepalive gave up on it, hours by
///   default. An entry that does not decode is [`StoreError::Corrupt`].
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
///   `maxmemory-policy` is read from every node, replicas included (a failover promotes one): set `noeviction` on every node. A prefix must
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
///   runs. A replay waits for the replicas too until its record is known to be replicated
///   (a record whose `complete` was not acknowledged is still on the primary). It costs a
///   primary-replica round trip per operation; the `WAIT`s run on connections
///   of their own, so renewals, releases and replays of acknowledged records never queue
///   behind them: BENCHMARKS.md ("Redis wait_for_replicas")
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
    /// Connections replaced after a command went unanswered (shared likewise).
    redials: Arc<AtomicU64>,
    /// The server's `maxmemory-policy` as read at connect, if it could be read.
    maxmemory_policy: Option<String>,
    /// Completed records kept here, if the builder asked for a near cache.
    near: Option<Arc<Near>>,
    /// [`RedisStoreBuilder::wait_for_replicas`], if asked for.
    wait_for_replicas: Option<replicas::WaitForReplicas>,
    /// The connections replicated writes (and their `WAIT`s) run on, with `wait_for_replicas`.
    waits: Option<replicas::WaitConns>,
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
    /// How many times the store moved to another primary since it connected (a store made
    /// with `builder_sentinel`, feature `redis-sentinel`; 0 for any other).
    pub fn primary_switches(&self) -> u64 {
        match &self.inner.conn {
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.switches(),
            _ => 0,
        }
    }

    /// How many times the store replaced a connection on which a command went unanswered for
    /// its [timeout](RedisStoreBuilder::timeout) (a half-open connection, or a server that
    /// froze); on a cluster, the cluster client reconnects its nodes by itself and this stays 0.
    pub fn redials(&self) -> u64 {
        self.inner.redials.load(Ordering::Relaxed)
    }

    /// A command on `conn` went unanswered for the store's timeout.
    fn unanswered(&self, conn: &Conn) {
        if conn.unanswered() {
            self.inner.redials.fetch_add(1, Ordering::Relaxed);
        }
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

    /// Lease renewals that failed (the server was unreachable) or were refused (the claim had
    /// been taken over or forgotten) since the store was made; each is also logged. A rising
    /// count means leaders are at risk of losing their claims: check the server and the
    /// layer's [`lease`](crate::IdempotencyLayer::lease).
    pub fn renewals_failed(&self) -> u64 {
        self.inner.renewals_failed.load(Ordering::Relaxed)
    }

    /// The server's `maxmemory-policy` as read at connect, and on a Sentinel-managed primary
    /// again after each move to another primary; `None` if the server did not allow `CONFIG
    /// GET`. Anything but `noeviction` can evict this store's keys (see
    /// [`maxmemory_policy_can_evict`]).
    pub fn maxmemory_policy(&self) -> Option<String> {
        match &self.inner.conn {
            #[cfg(feature = "redis-sentinel")]
            Conn::Sentinel(c) => c.maxmemory_policy(),
            _ => self.inner.maxmemory_policy.clone(),
        }
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

    /// The key (and pub/sub channel) of `scope`: the [`prefix`](Self::prefix) + its 64 hex
    /// characters ([`ScopeKey::to_hex`]).
    pub(crate) fn key(&self, scope: &ScopeKey) -> String {
        format!("{}{}", self.inner.prefix, scope.to_hex())
    }

    /// The key prefix: a scope's entry is at the prefix + [`ScopeKey::to_hex`], and its
    /// pub/sub channel has the same name.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// A store on the same connections with another key prefix (cheap: no new connection until
    /// a waiter needs the pub/sub one). On a cluster, a prefix with a brace is refused, as
    /// [`connect`](RedisStoreBuilder::connect) refuses it.
    pub fn with_prefix(&self, prefix: impl Into<String>) -> Result<RedisStore, StoreError> {
        let prefix = prefix.into();
        #[cfg(feature = "redis-cluster")]
        if self.cluster() {
            if let Some(problem) = builder::cluster_prefix_problem(&prefix) {
                return Err(StoreError::Backend(problem.into()));
            }
        }
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn: self.inner.conn.clone(),
                client: self.inner.client.clone(),
                prefix,
                timeout: self.inner.timeout,
                polling: self.inner.polling,
                waiters: Arc::default(),
                pubsub: OnceLock::new(),
                renewals_failed: self.inner.renewals_failed.clone(),
                redials: self.inner.redials.clone(),
                maxmemory_policy: self.inner.maxmemory_policy.clone(),
                // Another prefix is other keys and another invalidation channel.
                near: self.inner.near.as_ref().map(|n| Near::new(n.config())),
                wait_for_replicas: self.inner.wait_for_replicas,
                waits: self.inner.waits.clone(),
            }),
        })
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
            Ok(Err(e)) if e.is_timeout() => {
                self.unanswered(&self.inner.conn);
                Err(backend(e))
            }
            Ok(r) => r.map_err(backend),
            Err(_) => {
                self.unanswered(&self.inner.conn);
                Err(timed_out(self.inner.timeout))
            }
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
        let outcome = self
            .run_claim_replicated(
                &s.claim,
                &self.key(&scope),
                &[
                    &token_bytes(token),
                    &fingerprint.0,
                    millis(lease).to_string().as_bytes(),
                    millis(LATE_COMPLETE_GRACE).to_string().as_bytes(),
                ],
            )
            .await;
        // With wait_for_replicas: a claim too few replicas acknowledged is an error, and an
        // orphan like any claim nobody knows they hold (released in the background); a record
        // too few acknowledged is not replayed (an error too, but nothing was claimed).
        let (reply, replicated, written) = match outcome {
            Ok((reply, Err(e))) if replicas::is_new_claim(&reply) => (Err(e), Ok(()), true),
            Ok((reply, replicated)) => (Ok(reply), replicated, false),
            Err(e) => {
                let written = may_have_run(&e);
                (Err(e), Ok(()), written)
            }
        };
        if written {
            drop(orphan);
        } else {
            orphan.disarm();
        }
        let reply = reply?;
        replicated?;
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
        // Boxed: the round trip's future (about 1.6 KB) would otherwise size every write's
        // future, a near-cache hit's included, past the allocator's fast sizes.
        Box::pin(self.claim(scope, fingerprint, lease, codec::new_token(), ticket)).await
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
        // Boxed, as `begin`'s round trip is: it would otherwise size the layer's completion
        // future past the allocator's fast sizes.
        Box::pin(self.run_flag_replicated(
            &s.complete,
            &scope,
            &[
                &token_bytes(token),
                &bytes,
                millis(ttl).to_string().as_bytes(),
            ],
        ))
        .await?;
        if self.inner.wait_for_replicas.is_some() {
            // Acknowledged by the replicas: its replays need not wait for them again.
            self.mark_acknowledged(&self.key(&scope), token_bytes(token).to_vec());
        }
        Ok(())
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let s = self.scripts();
        self.run_flag(
            &s.release,
            &scope,
            &[
                &token_bytes(token),
                lua::RELEASED_TOMBSTONE_MS.to_string().as_bytes(),
            ],
        )
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

    async fn lookup(&self, scope: ScopeKey) -> Result<Option<Held>, StoreError> {
        let key = self.key(&scope);
        let reply = self.run(&self.scripts().lookup, &key, &[]).await?;
        let Value::Array(items) = reply else {
            return Err(StoreError::Backend(
                format!("unexpected lookup reply {reply:?}").into(),
            ));
        };
        let corrupt = || StoreError::Corrupt("malformed lookup reply".to_owned());
        match items.first() {
            Some(Value::Int(0)) => Ok(None),
            Some(Value::Int(2)) => {
                let t = items.get(1).and_then(bulk).ok_or_else(corrupt)?;
                let f = items.get(2).and_then(bulk).ok_or_else(corrupt)?;
                Ok(Some(Held::InFlight {
                    token: token_from(t)?,
                    fingerprint: codec::fingerprint(f)?,
                }))
            }
            Some(Value::Int(3)) => {
                let r = items.get(1).and_then(bulk).ok_or_else(corrupt)?;
                Ok(Some(Held::Completed(Arc::new(codec::decode(r)?))))
            }
            Some(Value::Int(4)) => {
                let why = items.get(1).and_then(bulk).unwrap_or(b"unknown");
                Err(StoreError::Corrupt(format!(
                    "redis key {key}: {}",
                    String::from_utf8_lossy(why)
                )))
            }
            _ => Err(corrupt()),
        }
    }

    fn backend(&self) -> Backend {
        Backend::Redis
    }
}

#[cfg(test)]
mod tests;

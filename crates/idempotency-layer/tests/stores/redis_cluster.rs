//! `RedisStore` on a real Redis Cluster (`REDIS_CLUSTER_URLS`, comma-separated node URLs, e.g.
//! `redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002`, as
//! `.ci/redis-cluster.sh` prints: three masters, each with a replica found through `CLUSTER
//! SLOTS`): the store conformance suite, two instances sharing the cluster with their keys
//! spread over several masters, waiters woken by sharded pub/sub, and `wait_for_replicas`
//! waiting for the replica of each key's own master.
//! Unset: each test says so and passes, unless `IDEMPOTENCY_TESTS_STRICT` is set (then a skip is a failure).

#[allow(unused_imports)] // the proxy helpers are for the other stores' tests
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{AnyStore, Begin, Fingerprint, NearCache};
use idempotency_layer::{conformance, IdempotencyStore, RedisStore};

/// The cluster's node URLs, or `None` (skip) when `REDIS_CLUSTER_URLS` is unset outside CI.
fn cluster_urls() -> Option<Vec<String>> {
    match std::env::var("REDIS_CLUSTER_URLS") {
        Ok(v) if !v.trim().is_empty() => Some(v.split(',').map(|u| u.trim().to_owned()).collect()),
        _ => {
            assert!(
                !test_support::env::strict(),
                "IDEMPOTENCY_TESTS_STRICT is set but REDIS_CLUSTER_URLS is not: start the cluster with \
                 .ci/redis-cluster.sh (as .ci/run does) and export what it prints"
            );
            eprintln!(
                "skipped: REDIS_CLUSTER_URLS is not set; run `export REDIS_CLUSTER_URLS=$(.ci/redis-cluster.sh)`"
            );
            None
        }
    }
}

async fn cluster_store(urls: &[String], prefix: &str) -> RedisStore {
    cluster_store_with(urls, prefix, Tuning::default()).await
}

/// [`cluster_store`], with a near cache and slow polling as `tuning` says.
async fn cluster_store_with(urls: &[String], prefix: &str, tuning: Tuning) -> RedisStore {
    let mut b = RedisStore::builder_cluster(urls.iter().cloned())
        .prefix(prefix)
        // 2 000 concurrent requests on a shared 2-core box: this is about exactly-once.
        .timeout(Duration::from_secs(10));
    if tuning.near_cache {
        b = b.near_cache(NearCache::new(16 << 20));
    }
    if tuning.slow_polling {
        b = b.poll_interval(SLOW_POLL, SLOW_POLL);
    }
    b.connect()
        .await
        .expect("REDIS_CLUSTER_URLS is set, so the cluster must be reachable")
}

/// A plain connection to one node.
async fn node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connection to a cluster node")
}

/// How many keys starting with `prefix` each node holds (a master owns the keys of its slots).
async fn keys_per_node(urls: &[String], prefix: &str) -> Vec<usize> {
    let mut counts = Vec::new();
    for url in urls {
        let mut conn = node(url).await;
        let mut cursor = 0u64;
        let mut n = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .unwrap();
            n += keys.len();
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        counts.push(n);
    }
    counts
}

/// Shard-channel subscribers of `channel` on each node (`PUBSUB SHARDNUMSUB` counts the node's
/// own clients only).
async fn shard_subscribers(urls: &[String], channel: &str) -> Vec<i64> {
    let mut counts = Vec::new();
    for url in urls {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("SHARDNUMSUB")
            .arg(channel)
            .query_async(&mut node(url).await)
            .await
            .unwrap();
        counts.push(n);
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_is_three_masters_with_every_slot() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut node(&urls[0]).await)
        .await
        .unwrap();
    assert!(info.contains("cluster_state:ok"), "{info}");
    assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
    assert!(urls.len() >= 2, "a cluster of several masters: {urls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite_on_the_cluster() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let prefix = unique("test:idem:");
    let base = cluster_store_with(&urls, &prefix, Tuning::conformance()).await;
    assert!(base.is_cluster());
    let n = AtomicUsize::new(0);
    conformance::run_all(|| {
        base.with_prefix(format!(
            "{}{}:",
            base.prefix(),
            n.fetch_add(1, Ordering::Relaxed)
        ))
        .expect("a prefix without braces")
    })
    .await;
    let spread = keys_per_node(&urls, &prefix).await;
    assert!(
        spread.iter().filter(|&&n| n > 0).count() >= 2,
        "the suite's keys land on several masters: {spread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_the_cluster_execute_each_key_once() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let prefix = unique("test:idem:");
    // Two store clients (separate cluster connections) sharing the cluster and one prefix.
    let a = cluster_store(&urls, &prefix).await;
    let b = cluster_store(&urls, &prefix).await;
    multi_instance(a, b).await;
    // The 50 records are spread over the masters by their keys' slots.
    let spread = keys_per_node(&urls, &prefix).await;
    assert_eq!(spread.iter().sum::<usize>(), 50, "{spread:?}");
    assert!(
        spread.iter().filter(|&&n| n > 0).count() >= 2,
        "the keys land on several masters: {spread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite_on_the_cluster_with_near_cache() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let tuning = Tuning {
        slow_polling: true,
        ..Tuning::near()
    };
    let store = cluster_store_with(&urls, &unique("test:idem:"), tuning).await;
    conformance::run_all(|| store.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_near_caches_on_the_cluster_execute_each_key_once() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let prefix = unique("test:idem:");
    let a = cluster_store_with(&urls, &prefix, Tuning::near()).await;
    let b = cluster_store_with(&urls, &prefix, Tuning::near()).await;
    multi_instance(a, b).await;
}

/// `forget` publishes on the invalidation channel with a plain `PUBLISH`, which the cluster bus
/// carries to every node: the other instance's near cache hears it whichever node it
/// subscribed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_on_the_cluster_drops_the_record_from_every_near_cache() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let prefix = unique("test:idem:");
    let a = cluster_store_with(&urls, &prefix, Tuning::near()).await;
    let b = cluster_store_with(&urls, &prefix, Tuning::near()).await;
    near_cache_forget_reaches_every_instance(a, b, RedisStore::near_cache_stats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_the_cluster_is_woken_by_sharded_pub_sub() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    // Polling so slow that only the SPUBLISHed message can wake the waiters within the bound.
    let slow = Duration::from_secs(120);
    let prefix = unique("test:idem:");
    let connect = || {
        RedisStore::builder_cluster(urls.iter().cloned())
            .prefix(&prefix)
            .poll_interval(slow, slow)
            .connect()
    };
    let leader = connect().await.unwrap();
    let other = connect().await.unwrap();
    // Scopes on at least two masters (their keys' slots say which).
    let mut scopes = Vec::new();
    let mut owners = std::collections::BTreeSet::new();
    for i in 0..16 {
        let scope = order_scope(&unique(&format!("sharded-{i}-")));
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(entry_key(&leader, &scope))
            .query_async(&mut node(&urls[0]).await)
            .await
            .unwrap();
        owners.insert(slot * 3 / 16384); // the three equal ranges .ci/redis-cluster.sh makes
        scopes.push(scope);
        if owners.len() >= 2 && scopes.len() >= 4 {
            break;
        }
    }
    assert!(owners.len() >= 2, "scopes on several masters: {owners:?}");

    let fp = Fingerprint([7; 32]);
    let mut tokens = Vec::new();
    let mut waiters = Vec::new();
    for &scope in &scopes {
        let Ok(Begin::New(token)) = leader.begin(scope, fp, conformance::LONG).await else {
            panic!("fresh scope");
        };
        tokens.push(token);
        // The waiter is another instance (its own cluster connection).
        let other = other.clone();
        waiters.push(tokio::spawn(async move { other.wait(scope, token).await }));
    }
    for &scope in &scopes {
        let channel = entry_key(&leader, &scope);
        wait::until_async(
            Duration::from_secs(5),
            &format!("one SSUBSCRIBE on the key's shard ({channel})"),
            || async { shard_subscribers(&urls, &channel).await.iter().sum::<i64>() == 1 },
        )
        .await;
    }
    for (&scope, &token) in scopes.iter().zip(&tokens) {
        leader
            .complete(
                scope,
                token,
                conformance::sample_record(fp).into(),
                conformance::LONG,
            )
            .await
            .unwrap();
    }
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("the SPUBLISHed message wakes the waiter (polling would take 120 s)")
            .unwrap()
            .unwrap();
    }
    // Woken waiters see the record.
    for &scope in &scopes {
        assert!(matches!(
            other.begin(scope, fp, conformance::LONG).await,
            Ok(Begin::Completed(_))
        ));
    }
    // The last waiter gone, each shard channel is unsubscribed.
    for &scope in &scopes {
        let channel = entry_key(&leader, &scope);
        wait::until_async(
            Duration::from_secs(5),
            &format!("the last waiter gone, no subscriber on the key's shard ({channel})"),
            || async { shard_subscribers(&urls, &channel).await.iter().sum::<i64>() == 0 },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_store_from_a_redis_cluster_url() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let hosts: Vec<&str> = urls
        .iter()
        .map(|u| u.trim_start_matches("redis://").trim_end_matches('/'))
        .collect();
    let url = format!("redis+cluster://{}", hosts.join(","));
    let store = AnyStore::from_url(&url).await.unwrap();
    let AnyStore::Redis(redis) = &store else {
        panic!("a redis store from {url}");
    };
    assert!(redis.is_cluster());
    let scope = order_scope(&unique("any-"));
    let fp = Fingerprint([3; 32]);
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    store
        .complete(
            scope,
            token,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .unwrap();
    assert!(matches!(
        store.begin(scope, fp, conformance::LONG).await,
        Ok(Begin::Completed(_))
    ));
    assert!(store.forget(scope).await.unwrap());
}

/// Sets a node's `maxmemory-policy` back to `noeviction` when dropped (the test changes one
/// master of the shared cluster).
struct RestorePolicy(String);

impl Drop for RestorePolicy {
    fn drop(&mut self) {
        let _ = std::process::Command::new("redis-cli")
            .args([
                "-u",
                &self.0,
                "CONFIG",
                "SET",
                "maxmemory-policy",
                "noeviction",
            ])
            .output();
    }
}

/// `require_noeviction(true)` on a cluster checks every node, not the one a plain `CONFIG GET`
/// would reach: one master, or one replica (a failover would promote it), with an evicting
/// policy refuses the store, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_noeviction_checks_every_master_and_replica() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let ok = RedisStore::builder_cluster(urls.iter().cloned())
        .prefix(unique("test:idem:"))
        .require_noeviction(true)
        .connect()
        .await
        .expect("every master runs noeviction");
    assert_eq!(ok.maxmemory_policy().as_deref(), Some("noeviction"));
    // The masters, and the replica of the first master's slots.
    let mut nodes = urls.clone();
    let (_, replica) = master_and_replica_of(&urls[0], "any").await;
    let replica = replica.expect("CI's cluster has a replica per master (.ci/redis-cluster.sh)");
    nodes.push(format!("redis://127.0.0.1:{replica}"));
    for (i, url) in nodes.iter().enumerate() {
        let _restore = RestorePolicy(url.clone());
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("volatile-ttl")
            .query_async(&mut node(url).await)
            .await
            .unwrap();
        let refused = RedisStore::builder_cluster(urls.iter().cloned())
            .require_noeviction(true)
            .connect()
            .await
            .expect_err("one evicting node refuses the store");
        let message = refused.to_string();
        let port = url.rsplit(':').next().unwrap().trim_end_matches('/');
        assert!(
            message.contains("volatile-ttl") && message.contains(port),
            "node {i} ({url}): the error names the node and its policy: {message}"
        );
    }
}

/// The port of the master that owns `key`'s slot, and of its replica if it has one (as
/// `CLUSTER SLOTS` names them).
async fn master_and_replica_of(url: &str, key: &str) -> (u16, Option<u16>) {
    let mut conn = node(url).await;
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap();
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .unwrap();
    let port = |v: &redis::Value| match v {
        redis::Value::Array(node) => match node.get(1) {
            Some(redis::Value::Int(p)) => u16::try_from(*p).ok(),
            _ => None,
        },
        _ => None,
    };
    for range in &ranges {
        let redis::Value::Array(items) = range else {
            continue;
        };
        let (Some(redis::Value::Int(start)), Some(redis::Value::Int(end))) =
            (items.first(), items.get(1))
        else {
            continue;
        };
        if (*start..=*end).contains(&slot) {
            let master = items.get(2).and_then(port).expect("a master for the slot");
            return (master, items.get(3).and_then(port));
        }
    }
    panic!("no node owns slot {slot}")
}

/// Stops the process of the node on `port` (SIGSTOP) until dropped.
struct Stopped(String);

impl Stopped {
    async fn node(port: u16) -> Stopped {
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut node(&format!("redis://127.0.0.1:{port}")).await)
            .await
            .unwrap();
        let pid = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .expect("INFO server names the process")
            .trim()
            .to_owned();
        let stopped = Stopped(pid);
        stopped.signal("-STOP");
        stopped
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.0])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} {}", self.0);
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        self.signal("-CONT");
    }
}

/// `wait_for_replicas` on a cluster whose masters have a replica each: a claim or a record
/// waits for the replica of its own key's master (its `{key}:acked` marker lands in the key's
/// slot), so a stopped replica fails closed the keys of its master only; and a record that
/// master wrote without the replica's acknowledgement is not replayed until the replica has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_on_the_cluster_waits_for_the_replica_of_the_keys_own_master() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let store = RedisStore::builder_cluster(urls.iter().cloned())
        .prefix(unique("test:idem:"))
        .timeout(Duration::from_secs(3))
        .wait_for_replicas(1, Duration::from_millis(500))
        .connect()
        .await
        .expect("the cluster is reachable");
    let fp = Fingerprint([5; 32]);
    // A key on each of two masters.
    let mut keys: Vec<(u16, u16, idempotency_layer::store::ScopeKey)> = Vec::new();
    while keys.len() < 2 {
        let scope = order_scope(&unique("replicated-"));
        let (master, replica) = master_and_replica_of(&urls[0], &entry_key(&store, &scope)).await;
        let replica = replica.unwrap_or_else(|| {
            panic!(
                "master {master} has no replica: run the cluster .ci/redis-cluster.sh makes \
                 (three masters, one replica each)"
            )
        });
        if keys.iter().all(|&(m, _, _)| m != master) {
            keys.push((master, replica, scope));
        }
    }
    let [(_, replica, stalled), (_, _, healthy)] = keys[..] else {
        unreachable!()
    };
    let record = || conformance::sample_record(fp).into();
    let t_stalled = claim_acknowledged(&store, stalled, fp).await;
    let t_healthy = claim_acknowledged(&store, healthy, fp).await;

    let stopped = Stopped::node(replica).await;
    assert!(
        store
            .complete(stalled, t_stalled, record(), conformance::LONG)
            .await
            .is_err(),
        "the stopped replica acknowledges nothing of its master"
    );
    let replay = store.begin(stalled, fp, conformance::LONG).await;
    assert!(
        replay.is_err(),
        "a duplicate was answered from a record no replica acknowledged: {:?}",
        replay.map(|b| matches!(b, Begin::Completed(_)))
    );
    store
        .complete(healthy, t_healthy, record(), conformance::LONG)
        .await
        .expect("another master's replica acknowledges its record");
    assert!(matches!(
        store.begin(healthy, fp, conformance::LONG).await,
        Ok(Begin::Completed(_))
    ));

    drop(stopped);
    until_replayed(&store, stalled, fp).await;
}

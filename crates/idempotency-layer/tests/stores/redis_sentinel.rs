//! `RedisStore` on a Sentinel-managed primary (`REDIS_SENTINEL_URL`,
//! `redis+sentinel://127.0.0.1:26380/idem` as `.ci/redis-sentinel.sh` prints): the conformance
//! suite through the Sentinel, and a forced failover that would lose acknowledged records
//! without `wait_for_replicas` and loses none with it. The failover kills the primary's process
//! and restarts it as a replica (through `.ci/redis-sentinel.sh`), so these tests need the nodes
//! on this machine, with `DEBUG` enabled for local connections (as the script starts them).
//! Unset: each test says so and passes, unless `IDEMPOTENCY_TESTS_STRICT` is set (then a skip is a failure).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint, ScopeKey, Token};
use idempotency_layer::{conformance, IdempotencyStore, RedisStore, StoreError};
use test_support::wait::until_async;
use tokio::time::Instant;

/// The tests of this file change the topology: one at a time.
static TOPOLOGY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long the replica sleeps in the failover test: everything is written, and the primary
/// killed, well before it wakes (it would then catch up).
const GAP: Duration = Duration::from_secs(5);

/// How long a forced failover may take (Sentinel: down-after 1 s, then the election).
const FAILOVER: Duration = Duration::from_secs(60);

fn sentinel() -> Option<(Vec<String>, String)> {
    let url = env_url("REDIS_SENTINEL_URL")?;
    Some(test_support::env::sentinel_parts(&url).unwrap_or_else(|| {
        panic!("REDIS_SENTINEL_URL={url} is not redis+sentinel://HOST:PORT/MASTER")
    }))
}

async fn store(sentinels: &[String], master: &str, wait: Option<Duration>) -> RedisStore {
    store_on(sentinels, master, &unique("test:sentinel:"), wait).await
}

/// [`store`] under a given key prefix (two stores with different `wait_for_replicas` bounds
/// on the same records).
async fn store_on(
    sentinels: &[String],
    master: &str,
    prefix: &str,
    wait: Option<Duration>,
) -> RedisStore {
    store_with(sentinels, master, prefix, wait, Tuning::default()).await
}

/// [`store_on`], polling slowly as `tuning` says (for the conformance suite).
async fn store_with(
    sentinels: &[String],
    master: &str,
    prefix: &str,
    wait: Option<Duration>,
    tuning: Tuning,
) -> RedisStore {
    let mut b = RedisStore::builder_sentinel(sentinels.iter().cloned(), master)
        .prefix(prefix)
        .timeout(Duration::from_secs(2));
    if let Some(timeout) = wait {
        b = b.wait_for_replicas(1, timeout);
    }
    if tuning.slow_polling {
        b = b.poll_interval(SLOW_POLL, SLOW_POLL);
    }
    b.connect()
        .await
        .expect("REDIS_SENTINEL_URL is set, so the Sentinel and its primary must be reachable")
}

async fn conn(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("redis on port {port}: {e}"))
}

/// The port of the primary the Sentinel names now.
async fn primary_port(sentinels: &[String], master: &str) -> u16 {
    let mut s = redis::Client::open(sentinels[0].as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("the Sentinel answers");
    let (_, port): (String, u16) = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(master)
        .query_async(&mut s)
        .await
        .expect("the Sentinel names a primary");
    port
}

/// `field:value` from an `INFO` section.
async fn info(port: u16, section: &str, field: &str) -> Option<String> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(&mut conn(port).await)
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(str::to_owned)
}

/// The primary's port and its replica's, once both sides see the link up and no sync is in
/// progress (after a failover the demoted node resyncs: until then a `WAIT` gets no replica).
async fn healthy_pair(sentinels: &[String], master: &str) -> (u16, u16) {
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let primary = primary_port(sentinels, master).await;
        let replica: Option<u16> = info(primary, "replication", "slave0").await.and_then(|l| {
            l.contains("state=online")
                .then(|| {
                    l.split(',')
                        .find_map(|kv| kv.strip_prefix("port=")?.parse().ok())
                })
                .flatten()
        });
        if let Some(replica) = replica {
            let link = info(replica, "replication", "master_link_status").await;
            let syncing = info(replica, "replication", "master_sync_in_progress").await;
            let follows = info(replica, "replication", "master_port").await;
            if link.as_deref() == Some("up")
                && syncing.as_deref() == Some("0")
                && follows == Some(primary.to_string())
            {
                return (primary, replica);
            }
        }
        assert!(
            Instant::now() < give_up,
            "no primary with a synced replica within 30 s (primary {primary}, replica {replica:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Puts the topology right after a test: the killed node back as a replica of the new primary.
fn restore() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.ci/redis-sentinel.sh");
    let out = std::process::Command::new(script)
        .output()
        .expect("run .ci/redis-sentinel.sh");
    assert!(
        out.status.success(),
        ".ci/redis-sentinel.sh could not restore the topology: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Restores the topology when dropped (also when the test fails).
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.ci/redis-sentinel.sh");
            let _ = std::process::Command::new(script).output();
        } else {
            restore();
        }
    }
}

/// `begin` until the store answers (it follows the failover), at most [`FAILOVER`].
async fn begin_through_failover(store: &RedisStore, scope: ScopeKey) -> Begin {
    let give_up = Instant::now() + FAILOVER;
    loop {
        match store.begin(scope, Fingerprint([1; 32]), LEASE).await {
            Ok(b) => return b,
            Err(StoreError::Backend(e)) if Instant::now() < give_up => {
                eprintln!("begin during the failover: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("begin after the failover: {e}"),
        }
    }
}

const LEASE: Duration = Duration::from_secs(60);

fn record() -> std::sync::Arc<idempotency_layer::store::Record> {
    conformance::sample_record(Fingerprint([1; 32])).into()
}

async fn claim(store: &RedisStore, scope: ScopeKey) -> Token {
    match store.begin(scope, Fingerprint([1; 32]), LEASE).await {
        Ok(Begin::New(token)) => token,
        other => panic!("a fresh scope is claimed: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_store_opens_it_from_its_url() {
    let Some(url) = env_url("REDIS_SENTINEL_URL") else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let store = idempotency_layer::store::AnyStore::from_url(&url)
        .await
        .expect("a redis+sentinel:// URL opens a RedisStore");
    let s = conformance::scope("any-store");
    let Ok(Begin::New(t)) = store.begin(s, Fingerprint([1; 32]), LEASE).await else {
        panic!("a fresh scope is claimed");
    };
    store.complete(s, t, record(), LEASE).await.unwrap();
    assert!(matches!(
        idempotency_layer::store::AnyStore::from_url("redis+sentinel://127.0.0.1:1").await,
        Err(StoreError::Config(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_suite_through_the_sentinel() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    for wait in [None, Some(Duration::from_secs(1))] {
        let base = store_with(
            &sentinels,
            &master,
            &unique("test:sentinel:"),
            wait,
            Tuning::conformance(),
        )
        .await;
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
    }
}

/// The replication gap, made deterministic: the replica drops its link to the primary and
/// sleeps (`DEBUG SLEEP`, so it cannot reconnect), records are written on the primary alone,
/// the primary's process is killed, and the Sentinel promotes the replica.
///
/// - Records completed before, with `wait_for_replicas(1, ..)`: all on the new primary.
/// - During the gap, with `wait_for_replicas`: `complete` and a new claim fail (not `Ok`).
/// - During the gap, without it: `complete` answers `Ok`, and every such record is missing on
///   the new primary (the key would execute again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_keeps_acknowledged_records_through_a_failover() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let (primary, replica) = healthy_pair(&sentinels, &master).await;
    let prefix = unique("test:sentinel:");
    // Before the gap the replica is up: a generous WAIT bound, so a loaded machine's slow
    // acknowledgement is not mistaken for a lost replica.
    let steady = store_on(&sentinels, &master, &prefix, Some(Duration::from_secs(10))).await;
    // During the gap: short, as each WAIT holds the store's connection this long, and
    // everything must be written before the replica wakes. Same records as `steady`.
    let waiting = store_on(
        &sentinels,
        &master,
        &prefix,
        Some(Duration::from_millis(250)),
    )
    .await;
    let plain = store(&sentinels, &master, None).await;
    // From here on, the topology is put right however the test ends.
    let _restore = Restore;

    // Before the gap: replicated records.
    let before: Vec<ScopeKey> = (0..20)
        .map(|i| conformance::scope(&format!("before-{i}")))
        .collect();
    for &s in &before {
        let t = claim(&steady, s).await;
        steady
            .complete(s, t, record(), LEASE)
            .await
            .expect("replicated");
    }
    // Claimed before the gap, completed during it.
    let pending: Vec<(ScopeKey, Token)> = {
        let mut v = Vec::new();
        for i in 0..5 {
            let s = conformance::scope(&format!("pending-{i}"));
            v.push((s, claim(&steady, s).await));
        }
        v
    };

    // The gap: the replica drops its link and sleeps (the reply comes when it wakes).
    let gap_started = Instant::now();
    let sleeper = tokio::spawn(async move {
        let mut r = conn(replica).await;
        let _: Result<Vec<redis::Value>, _> = redis::pipe()
            .cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("master")
            .cmd("DEBUG")
            .arg("SLEEP")
            .arg(GAP.as_secs())
            .query_async(&mut r)
            .await;
    });
    until_async(
        Duration::from_secs(5),
        "the primary lost its replica",
        || async {
            info(primary, "replication", "connected_slaves")
                .await
                .as_deref()
                == Some("0")
        },
    )
    .await;

    // The plain store first (fast), then the waiting one (a WAIT timeout per operation).
    let acknowledged: Vec<ScopeKey> = (0..10)
        .map(|i| conformance::scope(&format!("gap-{i}")))
        .collect();
    for &s in &acknowledged {
        let t = claim(&plain, s).await;
        plain
            .complete(s, t, record(), LEASE)
            .await
            .expect("without wait_for_replicas the primary alone acknowledges");
    }
    for &(s, t) in &pending {
        let r = waiting.complete(s, t, record(), LEASE).await;
        assert!(
            matches!(r, Err(StoreError::Backend(_))),
            "a record no replica acknowledged is not Ok: {r:?}"
        );
    }
    let refused = waiting
        .begin(conformance::scope("gap-claim"), Fingerprint([1; 32]), LEASE)
        .await;
    assert!(
        matches!(refused, Err(StoreError::Backend(_))),
        "a claim no replica acknowledged is an error: {refused:?}"
    );
    assert_eq!(
        info(primary, "replication", "connected_slaves")
            .await
            .as_deref(),
        Some("0"),
        "the replica stayed cut off while the records were written"
    );
    assert!(
        gap_started.elapsed() < GAP - Duration::from_secs(1),
        "the writes took {:?}: too close to the replica's wake-up for a deterministic loss",
        gap_started.elapsed()
    );

    // The failover: the primary's process dies; the Sentinel promotes the replica.
    let pid = info(primary, "server", "process_id")
        .await
        .expect("the primary's pid");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    until_async(FAILOVER, "the Sentinel promoted the replica", || async {
        primary_port(&sentinels, &master).await == replica
    })
    .await;
    let _ = sleeper.await;

    // The new primary, through the same stores (they follow the Sentinel).
    for &s in &before {
        assert!(
            matches!(
                begin_through_failover(&waiting, s).await,
                Begin::Completed(_)
            ),
            "a record acknowledged with wait_for_replicas survived the failover"
        );
    }
    let mut lost = 0;
    for &s in &acknowledged {
        if matches!(begin_through_failover(&plain, s).await, Begin::New(_)) {
            lost += 1;
        }
    }
    assert_eq!(
        lost,
        acknowledged.len(),
        "every record acknowledged by the primary alone was lost with it"
    );
    assert!(waiting.primary_switches() >= 1 && plain.primary_switches() >= 1);
    drop((steady, waiting, plain, _restore));
    healthy_pair(&sentinels, &master).await;
}

/// A `SENTINEL FAILOVER` (the old primary stays up and is demoted): the store moves to the new
/// primary, and its writes land there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_sentinel_failover() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let (primary, replica) = healthy_pair(&sentinels, &master).await;
    let store = store(&sentinels, &master, None).await;
    let _restore = Restore;
    let s = conformance::scope("before");
    let t = claim(&store, s).await;
    store.complete(s, t, record(), LEASE).await.unwrap();
    failover_then_write(&store, &sentinels, &master, (primary, replica), "after").await;
}

/// Forces a `SENTINEL FAILOVER` from `primary` to `replica` (the old primary demoted), then
/// checks that `store` moved to the new primary: a claim of `name` and its record land there.
async fn failover_then_write(
    store: &RedisStore,
    sentinels: &[String],
    master: &str,
    (primary, replica): (u16, u16),
    name: &str,
) {
    let mut sc = redis::Client::open(sentinels[0].as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: String = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(master)
        .query_async(&mut sc)
        .await
        .expect("SENTINEL FAILOVER");
    until_async(FAILOVER, "the Sentinel promoted the replica", || async {
        primary_port(sentinels, master).await == replica
    })
    .await;
    // The old primary demoted (the Sentinel does it when it next sees it; the script now).
    restore();
    assert_eq!(
        info(primary, "replication", "role").await.as_deref(),
        Some("slave")
    );

    let after = conformance::scope(name);
    let t = match begin_through_failover(store, after).await {
        Begin::New(t) => t,
        other => panic!("a fresh scope is claimed: {other:?}"),
    };
    store.complete(after, t, record(), LEASE).await.unwrap();
    assert!(
        store.primary_switches() >= 1,
        "the store moved to the new primary"
    );
    let state: Option<String> = redis::cmd("HGET")
        .arg(entry_key(store, &after))
        .arg("s")
        .query_async(&mut conn(replica).await)
        .await
        .unwrap();
    assert_eq!(
        state.as_deref(),
        Some("c"),
        "the record is on the new primary"
    );
}

/// Runs `ACL SETUSER` for the test user on `port` (a data node or the Sentinel).
async fn add_acl_user(port: u16, user: &str, password: &str) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg("on")
        .arg(format!(">{password}"))
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .query_async(&mut conn(port).await)
        .await
        .unwrap_or_else(|e| panic!("ACL SETUSER on {port}: {e}"));
}

/// The data nodes are reached with the credentials of the Sentinel URL, as the Sentinels are:
/// the store's connections to the primary are the URL's user's. (Before, the primary was
/// reached with none: as the default user, or refused where it needs a password.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_is_reached_with_the_urls_credentials() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let (primary, replica) = healthy_pair(&sentinels, &master).await;
    let user = "idem_sentinel_test";
    let password = "s3cret-for-the-data-nodes";
    let sentinel_port: u16 = sentinels[0]
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("the Sentinel's port");
    for port in [primary, replica, sentinel_port] {
        add_acl_user(port, user, password).await;
    }
    let url = format!("redis+sentinel://{user}:{password}@127.0.0.1:{sentinel_port}/{master}");
    let store = RedisStore::builder(url)
        .prefix(unique("test:sentinel:"))
        .connect()
        .await
        .expect("the Sentinel and the primary take the URL's credentials");
    let s = conformance::scope("credentials");
    let t = claim(&store, s).await;
    store.release(s, t).await.unwrap();
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn(primary).await)
        .await
        .unwrap();
    assert!(
        clients
            .lines()
            .any(|l| l.contains(&format!(" user={user} "))),
        "the store's connections to the primary authenticate as {user}: {clients}"
    );
}

/// After a failover, the new primary's `maxmemory-policy` is read again: an evicting one is
/// reported by `maxmemory_policy()` (and logged); with `require_noeviction` the store does not
/// follow the move (its writes fail closed) until the policy is put right. (Before, the policy
/// was read only at connect: a failover to an evicting node went unnoticed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_new_primary_is_noticed_after_a_failover() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let (_, replica) = healthy_pair(&sentinels, &master).await;
    let plain = store(&sentinels, &master, None).await;
    let strict = RedisStore::builder_sentinel(sentinels.iter().cloned(), &master)
        .prefix(unique("test:sentinel:"))
        .timeout(Duration::from_secs(2))
        .require_noeviction(true)
        .connect()
        .await
        .expect("the primary does not evict");
    assert_eq!(plain.maxmemory_policy().as_deref(), Some("noeviction"));
    let _restore = Restore;
    // Put back on the node whatever happens.
    struct Policy(u16);
    impl Drop for Policy {
        fn drop(&mut self) {
            let _ = std::process::Command::new("redis-cli")
                .args([
                    "-p",
                    &self.0.to_string(),
                    "config",
                    "set",
                    "maxmemory-policy",
                    "noeviction",
                ])
                .output();
        }
    }
    let _policy = Policy(replica);
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut conn(replica).await)
        .await
        .unwrap();
    let mut sc = redis::Client::open(sentinels[0].as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: String = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(&master)
        .query_async(&mut sc)
        .await
        .expect("SENTINEL FAILOVER");
    until_async(FAILOVER, "the Sentinel promoted the replica", || async {
        primary_port(&sentinels, &master).await == replica
    })
    .await;
    restore();
    // The plain store follows, and says what it found there.
    let s = conformance::scope("evicting");
    let t = match begin_through_failover(&plain, s).await {
        Begin::New(t) => t,
        other => panic!("a fresh scope is claimed: {other:?}"),
    };
    plain.release(s, t).await.unwrap();
    assert!(plain.primary_switches() >= 1);
    assert_eq!(plain.maxmemory_policy().as_deref(), Some("allkeys-lru"));
    // The strict one does not follow: its writes fail closed.
    for _ in 0..3 {
        assert!(
            strict
                .begin(conformance::scope("strict"), Fingerprint([1; 32]), LEASE)
                .await
                .is_err(),
            "a store that requires noeviction does not write to an evicting primary"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(strict.primary_switches(), 0);
    assert_eq!(strict.maxmemory_policy().as_deref(), Some("noeviction"));
}

/// The store reaches the Sentinel through a fault proxy whose connections all go half-open (no
/// reply, no FIN, no RST ever) before a `SENTINEL FAILOVER`: the store still follows the
/// failover, asking the Sentinel again on a new connection, and its writes land on the new
/// primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_failover_after_its_sentinel_link_went_half_open() {
    let Some((sentinels, master)) = sentinel() else {
        return;
    };
    let _one = TOPOLOGY.lock().await;
    let (primary, replica) = healthy_pair(&sentinels, &master).await;
    let link = Proxy::start(authority(&sentinels[0])).await;
    let via_link = [via(&sentinels[0], link.addr())];
    let store = store(&via_link, &master, None).await;
    let _restore = Restore;
    let s = conformance::scope("before-half-open");
    let t = claim(&store, s).await;
    store.complete(s, t, record(), LEASE).await.unwrap();

    link.half_open();
    // The Sentinel client's cached connection, silent from now on.
    test_support::wait::until("the store's Sentinel connection went half-open", || {
        link.stats().frozen.load(Ordering::SeqCst) >= 1
    })
    .await;
    failover_then_write(
        &store,
        &sentinels,
        &master,
        (primary, replica),
        "after-half-open",
    )
    .await;
}

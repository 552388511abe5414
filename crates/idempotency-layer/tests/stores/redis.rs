//! `RedisStore` against a real Redis (`REDIS_URL`, e.g. redis://127.0.0.1:6379): the store
//! conformance suite, two instances sharing one Redis, lease takeover, an outage through a
//! proxy, and a corrupt entry. Unset `REDIS_URL`: each test says so and passes; set but
//! unreachable: each test fails.

use std::time::Duration;

use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint, ScopeKey};
use idempotency_layer::{conformance, IdempotencyStore, RedisStore, StoreError};
use redis::AsyncCommands;

/// A store on `REDIS_URL` with a prefix of its own, or `None` (skip) when it is unset.
async fn store(url: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(unique("test:idem:"))
        .connect()
        .await
        .expect("REDIS_URL is set, so Redis must be reachable")
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection to REDIS_URL")
}

/// The shared store suite on Redis: a key prefix per test.
struct Redis;

impl Backend for Redis {
    type Store = RedisStore;
    const URL_VAR: &'static str = "REDIS_URL";

    fn namespace() -> String {
        unique("test:idem:")
    }

    async fn connect(url: String, namespace: String, tuning: Tuning) -> RedisStore {
        let mut b = RedisStore::builder(&url).prefix(namespace);
        if let Some(t) = tuning.timeout {
            b = b.timeout(t);
        }
        if tuning.near_cache {
            b = b.near_cache(idempotency_layer::store::NearCache::new(16 << 20));
        }
        if tuning.slow_polling {
            b = b.poll_interval(SLOW_POLL, SLOW_POLL);
        }
        // One multiplexed connection per store already: `single_connection` holds.
        b.connect()
            .await
            .expect("REDIS_URL is set, so Redis must be reachable")
    }

    async fn drop_namespace(_url: String, _namespace: String) {
        // Every key the suite writes expires on its own (claims by their lease, records by
        // their TTL).
    }

    fn near_stats(store: &RedisStore) -> Option<idempotency_layer::store::NearCacheStats> {
        store.near_cache_stats()
    }

    async fn holds(store: &RedisStore, url: &str, scope: ScopeKey) -> bool {
        // A claim (state `i`), not the tombstone a release or a forget leaves.
        let state: Option<String> = raw(url)
            .await
            .hget(entry_key(store, &scope), "s")
            .await
            .unwrap_or(None);
        state.as_deref() == Some("i")
    }
}

shared_store_suite!(Redis, idempotency_layer::store::AnyStore::Redis);

/// A complete or a release resent after its reply was lost (a cluster connection resends; the
/// layer retries through an outage) is answered as the first one was, for its own token, and
/// never "fenced": wrong warnings and counters, and a settle that says "unknown" for a claim
/// that did end. A release stays answered once a new claim took the key; another token's
/// complete or release is still fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_complete_or_release_is_answered_as_the_first() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let store = store(&url).await;
    let fp = Fingerprint([5; 32]);
    let record = || std::sync::Arc::new(conformance::sample_record(fp));

    let done = order_scope(&unique("resent-complete-"));
    let Ok(Begin::New(t)) = store.begin(done, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    store
        .complete(done, t, record(), conformance::LONG)
        .await
        .unwrap();
    store
        .complete(done, t, record(), conformance::LONG)
        .await
        .expect("the same complete, resent, is answered completed");
    let other = idempotency_layer::store::Token(t.0 ^ 1);
    assert!(matches!(
        store
            .complete(done, other, record(), conformance::LONG)
            .await,
        Err(idempotency_layer::StoreError::Fenced)
    ));
    match store.begin(done, fp, conformance::LONG).await {
        Ok(Begin::Completed(r)) => assert_eq!(*r, *record()),
        other => panic!("the record replays: {other:?}"),
    }

    let gone = order_scope(&unique("resent-release-"));
    let Ok(Begin::New(t)) = store.begin(gone, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    store.release(gone, t).await.unwrap();
    store
        .release(gone, t)
        .await
        .expect("the same release, resent, is answered released");
    assert!(matches!(
        store
            .release(gone, idempotency_layer::store::Token(t.0 ^ 1))
            .await,
        Err(idempotency_layer::StoreError::Fenced)
    ));
    // The key is free at once, and a resent release does not free the new claim.
    let Ok(Begin::New(next)) = store.begin(gone, fp, conformance::LONG).await else {
        panic!("a released key is claimed at once");
    };
    store
        .release(gone, t)
        .await
        .expect("the old release, resent after a new claim, is still answered released");
    assert!(
        matches!(store.begin(gone, fp, conformance::LONG).await, Ok(Begin::InFlight { token, .. }) if token == next),
        "the new claim still holds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_entry_is_a_clear_error() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let s = store(&url).await;
    let key_of = {
        let s = s.clone();
        move |scope| entry_key(&s, &scope)
    };
    // A record that does not decode.
    let url2 = url.clone();
    let k1 = key_of.clone();
    corrupt_entry(s.clone(), move |scope| {
        let (url, key) = (url2.clone(), k1(scope));
        async move {
            let mut c = raw(&url).await;
            let _: () = c.hset(&key, "r", b"\xff\x00garbage").await.unwrap();
        }
    })
    .await;
    // A key of another type altogether.
    corrupt_entry(s.clone(), move |scope| {
        let (url, key) = (url.clone(), key_of(scope));
        async move {
            let mut c = raw(&url).await;
            let _: () = c.del(&key).await.unwrap();
            let _: () = c.set(&key, "garbage").await.unwrap();
        }
    })
    .await;
}

async fn subscribers(conn: &mut redis::aio::MultiplexedConnection, channel: &str) -> i64 {
    let v: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    v.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_pub_sub_not_by_polling() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    // Polling so slow that only the pub/sub message can wake the waiter within the bound.
    let slow = Duration::from_secs(60);
    let store = RedisStore::builder(&url)
        .prefix(unique("test:idem:"))
        .poll_interval(slow, slow)
        .connect()
        .await
        .unwrap();
    let scope = order_scope(&unique("pubsub-"));
    let fp = Fingerprint([1; 32]);
    let Ok(Begin::New(token)) = store.begin(scope, fp, conformance::LONG).await else {
        panic!("fresh scope");
    };
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, token).await })
    };
    let conn = raw(&url).await;
    let channel = entry_key(&store, &scope);
    let subscribed = |n: i64| {
        let (mut conn, channel) = (conn.clone(), channel.clone());
        async move { subscribers(&mut conn, &channel).await == n }
    };
    wait::until_async(wait::LIMIT, "the waiter subscribed", || subscribed(1)).await;
    store
        .complete(
            scope,
            token,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the published message wakes the waiter")
        .unwrap()
        .unwrap();
    // The last waiter gone, the channel is unsubscribed.
    wait::until_async(wait::LIMIT, "the channel is unsubscribed", || subscribed(0)).await;
}

/// A claim that ends without a message (as if it were lost) is noticed by the waiter's polling.
/// The claim is removed by hand (`DEL`, which publishes nothing) only once the server has run
/// the waiter's first check (seen through `MONITOR`): the waiter found it held, and only a later
/// poll can tell it that it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_message_does_not_hang_a_waiter() {
    use futures_util::StreamExt;

    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let store = store(&url).await;
    let scope = order_scope(&unique("lost-"));
    let Ok(Begin::New(token)) = store
        .begin(scope, Fingerprint([1; 32]), conformance::LONG)
        .await
    else {
        panic!("fresh scope");
    };
    let key = entry_key(&store, &scope);
    // Every command the server runs from now on, as MONITOR prints them.
    let mut monitor = redis::Client::open(url.as_str())
        .unwrap()
        .get_async_monitor()
        .await
        .unwrap()
        .into_on_message::<String>();
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(scope, token).await })
    };
    // The waiter's check: the only script run on the key after the begin.
    let checked = async {
        while let Some(line) = monitor.next().await {
            let lower = line.to_ascii_lowercase();
            let script = lower.contains("\"evalsha\"") || lower.contains("\"eval\"");
            if script && line.contains(&format!("\"{key}\"")) {
                return;
            }
        }
        panic!("the MONITOR connection closed");
    };
    tokio::time::timeout(test_support::wait::LIMIT, checked)
        .await
        .expect("the server runs the waiter's first check");
    let _: () = raw(&url).await.del(&key).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("polling wakes the waiter")
        .unwrap()
        .unwrap();
}

/// The store reads `maxmemory-policy` at connect (a policy that can evict our keys is logged
/// as an error), and a server that forbids `CONFIG` is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxmemory_policy_is_read_at_connect_and_config_may_be_forbidden() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let mut admin = raw(&url).await;
    let current: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut admin)
        .await
        .unwrap();
    let s = store(&url).await;
    assert_eq!(s.maxmemory_policy().as_deref(), Some(current[1].as_str()));
    assert!(!idempotency_layer::store::maxmemory_policy_can_evict(
        "noeviction"
    ));
    for p in [
        "volatile-ttl",
        "allkeys-lru",
        "volatile-lru",
        "allkeys-random",
    ] {
        assert!(
            idempotency_layer::store::maxmemory_policy_can_evict(p),
            "{p}"
        );
    }

    // A user that may not run CONFIG (as on managed services): the store still connects.
    let (user, user_url) = user_without_config(&mut admin, &url, "idem_noconfig_").await;
    let limited = RedisStore::builder(&user_url)
        .prefix(unique("test:idem:"))
        .connect()
        .await;
    let worked = match &limited {
        Ok(store) => {
            let scope = order_scope(&unique("noconfig-"));
            matches!(
                store
                    .begin(scope, Fingerprint([1; 32]), conformance::LONG)
                    .await,
                Ok(Begin::New(_))
            )
        }
        Err(_) => false,
    };
    // Deleting the user disconnects its clients: only after the store was used.
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await
        .unwrap();
    let limited = limited.expect("a server that forbids CONFIG is accepted");
    assert_eq!(limited.maxmemory_policy().as_deref(), None);
    assert!(worked, "the store works without CONFIG");
}

/// A user of the server at `url` that may run every command but `CONFIG` (as on managed
/// services), and the URL that logs in as it; delete it with `ACL DELUSER` when done.
async fn user_without_config(
    admin: &mut redis::aio::MultiplexedConnection,
    url: &str,
    prefix: &str,
) -> (String, String) {
    let user = unique(prefix);
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(">secret-pass")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-config")
        .query_async(admin)
        .await
        .unwrap();
    let (scheme, rest) = url.split_once("://").unwrap();
    let rest = rest.split_once('@').map_or(rest, |(_, h)| h);
    let user_url = format!("{scheme}://{user}:secret-pass@{rest}");
    (user, user_url)
}

/// A plain redis-server of the test's own on a free port, with `maxmemory-policy` `policy`
/// (killed when dropped), for what must not be changed on the shared server.
struct OwnRedis {
    child: std::process::Child,
    url: String,
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl OwnRedis {
    async fn start(policy: &str) -> OwnRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--maxmemory-policy", policy])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is installed (the Redis store tests start their own)");
        let own = OwnRedis {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        takes_connections(port).await;
        own
    }
}

/// `require_noeviction(true)`: the store refuses to start on a server whose policy can evict
/// (the error names the policy and says what to do), and on one that will not say (CONFIG
/// forbidden); it starts on `noeviction`. Off (the default), the evicting server is accepted
/// and its policy reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_noeviction_refuses_an_evicting_server() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let evicting = OwnRedis::start("allkeys-lru").await;
    let refused = RedisStore::builder(&evicting.url)
        .require_noeviction(true)
        .connect()
        .await
        .expect_err("an evicting server is refused");
    assert!(
        matches!(refused, StoreError::Config(_)),
        "a setting to change, not an outage: {refused:?}"
    );
    let message = refused.to_string();
    assert!(
        message.contains("allkeys-lru") && message.contains("noeviction"),
        "the error names the policy and the fix: {message}"
    );
    let accepted = RedisStore::builder(&evicting.url)
        .connect()
        .await
        .expect("off by default: an evicting server is accepted (and logged)");
    assert_eq!(accepted.maxmemory_policy().as_deref(), Some("allkeys-lru"));

    let shared = RedisStore::builder(&url)
        .prefix(unique("test:idem:"))
        .require_noeviction(true)
        .connect()
        .await
        .expect("the shared test server runs noeviction");
    assert_eq!(shared.maxmemory_policy().as_deref(), Some("noeviction"));

    // A user that may not run CONFIG: the policy cannot be checked, so it is refused.
    let mut admin = raw(&url).await;
    let (user, user_url) = user_without_config(&mut admin, &url, "idem_noconfig_req_").await;
    let limited = RedisStore::builder(&user_url)
        .require_noeviction(true)
        .connect()
        .await;
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await
        .unwrap();
    let message = limited
        .expect_err("an unreadable policy is refused")
        .to_string();
    assert!(
        message.contains("cannot read maxmemory-policy"),
        "{message}"
    );
}

/// A store on the application's own client and connection manager.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_your_own_client_and_connection_manager() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let client = redis::Client::open(url.as_str()).unwrap();
    let manager = client.get_connection_manager().await.unwrap();
    let store = RedisStore::builder_from_client(client)
        .connection_manager(manager.clone())
        .prefix(unique("test:idem:"))
        .connect()
        .await
        .unwrap();
    conformance::run_all(|| store.clone()).await;
    // The application's manager still works alongside.
    let mut m = manager;
    let pong: String = redis::cmd("PING").query_async(&mut m).await.unwrap();
    assert_eq!(pong, "PONG");
}

/// Failed and refused lease renewals are counted (and logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_renewals_are_counted() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let s = store(&url).await;
    let scope = order_scope(&unique("renew-"));
    let Ok(Begin::New(t)) = s
        .begin(scope, Fingerprint([1; 32]), conformance::LONG)
        .await
    else {
        panic!("fresh scope");
    };
    s.renew(scope, t, conformance::LONG).await.unwrap();
    assert_eq!(s.renewals_failed(), 0);
    assert!(s.forget(scope).await.unwrap());
    assert!(
        matches!(
            s.renew(scope, t, conformance::LONG).await,
            Err(idempotency_layer::StoreError::Fenced)
        ),
        "a forgotten claim's renewal is refused as fenced"
    );
    assert_eq!(s.renewals_failed(), 1, "a refused renewal is counted");
}

/// A store chosen at run time from its URL.
/// A `redis-server` with TLS only, on a free loopback port, with a CA and a server certificate
/// for 127.0.0.1 this test makes with `openssl`; killed when dropped.
#[cfg(feature = "redis-tls")]
struct TlsRedis {
    child: std::process::Child,
    dir: std::path::PathBuf,
    port: u16,
}

#[cfg(feature = "redis-tls")]
impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(feature = "redis-tls")]
impl TlsRedis {
    async fn start() -> TlsRedis {
        use std::process::{Command, Stdio};
        let dir = std::env::temp_dir().join(unique("idem-redis-tls-"));
        std::fs::create_dir_all(&dir).unwrap();
        let run = |args: &[&str]| {
            let ok = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .stderr(Stdio::null())
                .status()
                .expect("openssl")
                .success();
            assert!(ok, "openssl {args:?}");
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=idempotency test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:FALSE",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-keyout",
            "server.key",
            "-out",
            "server.pem",
        ]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
            .args([
                "--tls-cert-file",
                "server.pem",
                "--tls-key-file",
                "server.key",
            ])
            .args([
                "--tls-ca-cert-file",
                "ca.pem",
                "--maxmemory-policy",
                "noeviction",
            ])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (with TLS support) is installed");
        let tls = TlsRedis { child, dir, port };
        takes_connections(port).await;
        tls
    }
}

/// `rediss://` works: through a client that trusts the test's CA (the certificate is
/// checked), and through the URL alone with `#insecure` (encrypted, not checked); a client
/// that does not trust the CA is refused.
#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_connects_over_tls() {
    if env_url("REDIS_URL").is_none() {
        return;
    }
    let server = TlsRedis::start().await;
    let url = format!("rediss://127.0.0.1:{}", server.port);
    let ca = std::fs::read(server.dir.join("ca.pem")).unwrap();
    let client = redis::Client::build_with_tls(
        url.as_str(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )
    .unwrap();
    let store = RedisStore::builder_from_client(client)
        .prefix(unique("test:idem:"))
        .connect()
        .await
        .expect("rediss with the test CA");
    assert_eq!(store.maxmemory_policy().as_deref(), Some("noeviction"));
    conformance::run_all(|| store.clone()).await;

    let insecure = RedisStore::builder(format!("{url}/#insecure"))
        .prefix(unique("test:idem:"))
        .connect()
        .await
        .expect("rediss://...#insecure");
    let scope = order_scope(&unique("tls-"));
    assert!(matches!(
        insecure
            .begin(scope, Fingerprint([1; 32]), conformance::LONG)
            .await,
        Ok(Begin::New(_))
    ));

    let untrusted = RedisStore::builder(&url).connect().await;
    assert!(
        untrusted.is_err(),
        "a certificate from an unknown CA is refused"
    );
}

/// Waits until a redis-server this test started takes connections on `port`.
async fn takes_connections(port: u16) {
    wait::until_async(
        wait::LIMIT,
        "the test's redis-server takes connections",
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
}

/// A replica of the server at `REDIS_URL`, run by this test (`redis-server` on a free port),
/// that the test can stop (`SIGSTOP`: it acknowledges nothing) and resume; killed on drop.
struct Replica {
    child: std::process::Child,
    port: u16,
}

/// A `redis-server` of this test's own on a free port, with `args`: its process and its port.
fn spawn_redis(args: &[&str]) -> Option<(std::process::Child, u16)> {
    let free = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
    let port = free.local_addr().ok()?.port();
    drop(free);
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        // A replica writes the primary's snapshot to its directory when it syncs.
        .args(["--dir", &std::env::temp_dir().to_string_lossy()])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    Some((child, port))
}

impl Replica {
    fn start(primary: &str) -> Option<Replica> {
        let authority = primary
            .trim_start_matches("redis://")
            .split('/')
            .next()
            .unwrap_or("127.0.0.1:6379");
        let (host, port) = authority.rsplit_once(':').unwrap_or((authority, "6379"));
        let (child, port) = spawn_redis(&["--replicaof", host, port])?;
        Some(Replica { child, port })
    }

    /// A primary of this test's own, which nothing else writes to, as a `Replica` (killed on
    /// drop), and its URL.
    fn private_primary() -> Option<(Replica, String)> {
        let (child, port) = spawn_redis(&[])?;
        Some((Replica { child, port }, format!("redis://127.0.0.1:{port}")))
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// With `wait_for_replicas`, a replica that stops acknowledging holds back no renewal, release
/// or replay of a record it acknowledged: claims and completes wait for it (and fail closed) on
/// connections of their own.
/// (Before, every `WAIT` held the store's one multiplexed connection for its whole timeout, and
/// renewals queued behind them until they timed out: leases lapsed, and a retry could take a
/// live leader's key over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_holds_back_no_renewal_or_replay() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let Some(replica) = Replica::start(&url) else {
        assert!(
            !test_support::env::strict(),
            "redis-server is needed to run a replica"
        );
        eprintln!("skipped: no redis-server to run a replica with");
        return;
    };
    let wait = Duration::from_millis(300);
    let store = RedisStore::builder(&url)
        .prefix(unique("test:idem:"))
        .timeout(Duration::from_secs(1))
        .wait_for_replicas(1, wait)
        .connect()
        .await
        .unwrap();
    let fp = Fingerprint([7; 32]);
    // Until the replica has synced and acknowledges: a claim then succeeds.
    let live = order_scope(&unique("replica-live-"));
    let token = claim_acknowledged(&store, live, fp).await;
    // Claimed and completed while the replica acknowledges (each tried again if the replica,
    // busy with the suite's other writes on this server, lags past the WAIT's 300 ms).
    let done = order_scope(&unique("replica-done-"));
    let d = claim_acknowledged(&store, done, fp).await;
    wait::some(wait::LIMIT, "the record is acknowledged", || async {
        store
            .complete(
                done,
                d,
                conformance::sample_record(fp).into(),
                conformance::LONG,
            )
            .await
            .ok()
    })
    .await;
    // Its acknowledgement is marked on the record (in the background): replays of it need
    // not wait for the replica again.
    let done_key = entry_key(&store, &done);
    wait::until_async(wait::LIMIT, "the record is marked acknowledged", || {
        let (url, done_key) = (url.clone(), done_key.clone());
        async move {
            let mut c = redis::Client::open(url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            c.hget::<_, _, Option<String>>(&done_key, "a")
                .await
                .ok()
                .flatten()
                .is_some()
        }
    })
    .await;

    replica.signal("-STOP");
    // Claims that wait for the stopped replica, many more than there are connections for them.
    let claims: Vec<_> = (0..24)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .begin(
                        order_scope(&unique(&format!("replica-{i}-"))),
                        fp,
                        conformance::LONG,
                    )
                    .await
            })
        })
        .collect();
    // Until a WAIT is blocked on the server (the claims' writes are waiting for the replica).
    let admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    wait::until_async(wait::LIMIT, "a WAIT is blocked", || {
        let mut admin = admin.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("clients")
                .query_async(&mut admin)
                .await
                .unwrap_or_default();
            info.lines()
                .find_map(|l| l.strip_prefix("blocked_clients:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .is_some_and(|n| n >= 1)
        }
    })
    .await;
    for _ in 0..5 {
        store
            .renew(live, token, conformance::LONG)
            .await
            .expect("a renewal does not queue behind the WAITs");
        assert!(
            matches!(
                store.begin(done, fp, conformance::LONG).await,
                Ok(Begin::Completed(_))
            ),
            "a replay does not queue behind the WAITs"
        );
    }
    for claim in claims {
        assert!(
            !matches!(claim.await.unwrap(), Ok(Begin::New(_))),
            "no claim counts as written while no replica acknowledges"
        );
    }
    replica.signal("-CONT");
    store.release(live, token).await.unwrap();
}

/// One `INFO` section of the server at `url`.
async fn info(url: &str, section: &str) -> String {
    let mut admin = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("INFO")
        .arg(section)
        .query_async(&mut admin)
        .await
        .unwrap()
}

/// How many `HSET`s the server at `url` ran (a replica counts those its primary sends it).
async fn hsets(url: &str) -> u64 {
    info(url, "commandstats")
        .await
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_hset:calls="))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A `complete` or `release` resent (its reply was lost; here, from another store, so on
/// another connection, as a cluster client or a reconnect resends) writes something that
/// replicates, so that the `WAIT` after it covers the record: the replica applies a write for
/// each resend, and with the replica stopped a resent `complete` is not acknowledged. (Before,
/// the resend wrote nothing. From Redis 7.2 a connection's `WAIT` covers only that connection's
/// own last replicated write, so a resend on another connection was acknowledged at once while
/// the replica lacked the record; 7.0, on this machine, still waits for the primary's whole
/// offset, which is why only the replica's applied writes show the difference here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_complete_or_release_writes_what_its_wait_covers() {
    let Some((_primary, replica, url, replica_url)) = private_primary_and_replica().await else {
        return;
    };
    let prefix = unique("test:idem:");
    let store = |prefix: String| {
        let url = url.clone();
        async move {
            RedisStore::builder(&url)
                .prefix(prefix)
                // Bounds that a loaded machine (the suite runs in parallel) keeps within.
                .timeout(Duration::from_secs(3))
                .wait_for_replicas(1, Duration::from_secs(2))
                .connect()
                .await
                .unwrap()
        }
    };
    let (a, b) = (store(prefix.clone()).await, store(prefix).await);
    let fp = Fingerprint([8; 32]);
    // A claim acknowledged by the replica, once it has synced.
    let claim = |name: &'static str| {
        let a = a.clone();
        async move {
            let scope = order_scope(&unique(name));
            (scope, claim_acknowledged(&a, scope, fp).await)
        }
    };
    let record = || conformance::sample_record(fp).into();

    // Each resend is a write the replica applies. (Not the primary's replication offset: on
    // 7.0 every blocked `WAIT` moves it, with the `REPLCONF GETACK` it sends the replicas.)
    let replicated = |what: &'static str, before: u64| {
        let replica_url = replica_url.clone();
        async move {
            wait::until_async(wait::LIMIT, what, || {
                let replica_url = replica_url.clone();
                async move { hsets(&replica_url).await > before }
            })
            .await;
        }
    };
    let (scope, t) = claim("resent-complete-").await;
    a.complete(scope, t, record(), conformance::LONG)
        .await
        .unwrap();
    for _ in 0..3 {
        let before = hsets(&replica_url).await;
        b.complete(scope, t, record(), conformance::LONG)
            .await
            .expect("the resend is answered done");
        replicated("a resent complete writes something that replicates", before).await;
    }
    let (scope, t) = claim("resent-release-").await;
    a.release(scope, t).await.unwrap();
    for _ in 0..3 {
        let before = hsets(&replica_url).await;
        b.release(scope, t)
            .await
            .expect("the resend is answered done");
        replicated("a resent release writes something that replicates", before).await;
    }

    let (scope, t) = claim("resent-unacknowledged-").await;
    replica.signal("-STOP");
    assert!(
        a.complete(scope, t, record(), conformance::LONG)
            .await
            .is_err(),
        "the stopped replica acknowledges nothing"
    );
    assert!(
        b.complete(scope, t, record(), conformance::LONG)
            .await
            .is_err(),
        "a resend on another connection is not acknowledged either"
    );
    replica.signal("-CONT");
}

/// A redis-server primary of the test's own and a replica of it, in sync: the primary's
/// process, the replica, the primary's URL and the replica's. `None` (skip) without REDIS_URL
/// or outside CI without a redis-server binary.
async fn private_primary_and_replica() -> Option<(Replica, Replica, String, String)> {
    env_url("REDIS_URL")?;
    let started = Replica::private_primary()
        .and_then(|(primary, url)| Some((primary, Replica::start(&url)?, url)));
    let Some((primary, replica, url)) = started else {
        assert!(
            !test_support::env::strict(),
            "redis-server is needed to run a primary and its replica"
        );
        eprintln!("skipped: no redis-server to run a primary and a replica with");
        return None;
    };
    wait::until_async(wait::LIMIT, "the private primary answers", || {
        let url = url.clone();
        async move {
            match redis::Client::open(url.as_str()) {
                Ok(c) => c.get_multiplexed_async_connection().await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    // The replica in sync before any claim (a claim refused before then is released in the
    // background: writes the checks would see).
    let replica_url = format!("redis://127.0.0.1:{}", replica.port);
    wait::until_async(wait::LIMIT, "the replica is in sync", || {
        let replica_url = replica_url.clone();
        async move {
            redis::Client::open(replica_url.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .is_ok()
                && info(&replica_url, "replication")
                    .await
                    .contains("master_link_status:up")
        }
    })
    .await;
    Some((primary, replica, url, replica_url))
}

/// A record whose `complete` no replica acknowledged stays on the primary (Redis cannot take a
/// write back). A duplicate that read it and were answered at once would be replayed a record a
/// failover to the replica loses, and the next duplicate after it would run the write again:
/// with `wait_for_replicas`, a replay too waits for the replicas, and fails closed while they do
/// not acknowledge; once they do, it is replayed (the near cache keeps nothing meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_replicas_a_record_no_replica_acknowledged_is_not_replayed() {
    let Some((_primary, replica, url, _)) = private_primary_and_replica().await else {
        return;
    };
    let prefix = unique("test:idem:");
    let store = |near: bool| {
        let (url, prefix) = (url.clone(), prefix.clone());
        async move {
            let builder = RedisStore::builder(&url)
                .prefix(prefix)
                .timeout(Duration::from_secs(3))
                .wait_for_replicas(1, Duration::from_millis(500));
            let builder = if near {
                builder.near_cache(idempotency_layer::store::NearCache::new(1 << 20))
            } else {
                builder
            };
            builder.connect().await.unwrap()
        }
    };
    let (leader, duplicate) = (store(false).await, store(true).await);
    let fp = Fingerprint([8; 32]);
    let scope = order_scope(&unique("unacknowledged-record-"));
    let token = claim_acknowledged(&leader, scope, fp).await;

    replica.signal("-STOP");
    let completed = leader
        .complete(
            scope,
            token,
            conformance::sample_record(fp).into(),
            conformance::LONG,
        )
        .await;
    assert!(
        completed.is_err(),
        "the stopped replica acknowledges nothing"
    );
    for store in [&leader, &duplicate] {
        let replay = store.begin(scope, fp, conformance::LONG).await;
        assert!(
            replay.is_err(),
            "a duplicate was answered from a record no replica acknowledged: {:?}",
            replay.map(|b| matches!(b, Begin::Completed(_)))
        );
    }
    replica.signal("-CONT");
    until_replayed(&leader, scope, fp).await;
    until_replayed(&duplicate, scope, fp).await;
}

/// With `wait_for_replicas`, a claim written on the primary that too few replicas acknowledged
/// is refused (an error: nothing may run on it), and the store releases it in the background
/// like any claim nobody knows they hold: its key is free again well before its lease (read by
/// a store that does not wait for replicas, while the replica is still stopped). (Before, the
/// claim was left on the primary and blocked its key for the whole lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_no_replica_acknowledged_is_released_at_once() {
    let Some((_primary, replica, url, _)) = private_primary_and_replica().await else {
        return;
    };
    let prefix = unique("test:idem:");
    let waiting = RedisStore::builder(&url)
        .prefix(&prefix)
        .timeout(Duration::from_secs(3))
        .wait_for_replicas(1, Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let plain = RedisStore::builder(&url)
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let fp = Fingerprint([9; 32]);
    // The replica has synced: a claim is acknowledged.
    let warm = order_scope(&unique("orphan-warm-"));
    let t = claim_acknowledged(&waiting, warm, fp).await;
    waiting.release(warm, t).await.unwrap();

    replica.signal("-STOP");
    let scope = order_scope(&unique("orphan-unacknowledged-"));
    let lease = Duration::from_secs(600);
    let refused = waiting.begin(scope, fp, lease).await;
    assert!(
        refused.is_err(),
        "a claim no replica acknowledged is not the caller's: {refused:?}"
    );
    // Written on the primary all the same, and released: the key can be claimed at once, a
    // lease of ten minutes notwithstanding.
    let token = wait::some(
        wait::LIMIT,
        "the refused claim is released: its key can be claimed",
        || async {
            match plain.begin(scope, fp, lease).await {
                Ok(Begin::New(t)) => Some(t),
                Ok(Begin::InFlight { .. }) => None,
                other => panic!("{other:?}"),
            }
        },
    )
    .await;
    plain.release(scope, token).await.unwrap();
    replica.signal("-CONT");
}

/// A connection gone half-open (no reply, no FIN, no RST ever: a NAT entry expired, a host
/// froze) is replaced once a command went unanswered for the store's timeout: the operations
/// after it work again, on a new connection. (Before, redis-rs's connection manager, which
/// reconnects only on an error saying the connection dropped, kept it: every command timed
/// out, for as long as the test ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_half_open_is_replaced() {
    let Some(url) = env_url("REDIS_URL") else {
        return;
    };
    let proxy = Proxy::start(authority(&url)).await;
    let store = RedisStore::builder(via(&url, proxy.addr()))
        .prefix(unique("test:idem:"))
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let fp = Fingerprint([1; 32]);
    let claim = || {
        let store = store.clone();
        async move {
            store
                .begin(order_scope(&unique("half-open-")), fp, conformance::LONG)
                .await
        }
    };
    assert!(matches!(claim().await, Ok(Begin::New(_))));
    proxy.half_open();
    assert!(
        claim().await.is_err(),
        "the half-open connection answers nothing"
    );
    wait::some(
        wait::LIMIT,
        "a claim succeeds on a new connection",
        || async { matches!(claim().await, Ok(Begin::New(_))).then_some(()) },
    )
    .await;
    assert!(store.redials() >= 1, "the store replaced the connection");
    assert!(
        proxy
            .stats()
            .relayed
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 2
    );
}

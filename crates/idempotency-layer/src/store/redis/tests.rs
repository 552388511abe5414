//! RedisStore's own tests against a real server (`REDIS_URL`); the shared contract runs in
//! the stores' integration tests.

use super::*;

use test_support::env::env_url;

/// The claim command sent twice with one token (what a cluster connection's resend after a
/// lost reply does): both sends answer "claimed", and the key holds that one claim. (Before,
/// the resend answered "in flight" with the request's own token: it waited for itself, got
/// 409, and its key stayed blocked for a lease.) Another token still sees it in flight.
async fn resent_claim_is_ours(store: RedisStore) {
    let scope = ScopeKey(*blake3::hash(codec::new_token().0.to_le_bytes().as_slice()).as_bytes());
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
        super::builder::cluster_nodes_from_url("redis+cluster://a:7000,b:7001/").unwrap(),
        ["redis://a:7000", "redis://b:7001/"]
    );
    assert_eq!(
        super::builder::cluster_nodes_from_url("rediss+cluster://redis://a:1, b:2").unwrap(),
        ["redis://a:1", "rediss://b:2"]
    );
    assert!(super::builder::cluster_nodes_from_url("redis://a:1").is_none());
    assert!(super::builder::cluster_nodes_from_url("memory").is_none());
}

/// `RedisStore::builder` reads the cluster and Sentinel schemes; a URL of theirs it cannot
/// serve is refused at connect (before any connection) with what to do.
#[tokio::test]
async fn the_builder_reads_every_redis_url_and_says_what_it_cannot_serve() {
    let refused = |url: &'static str| async move {
        match RedisStore::builder(url).connect().await {
            Err(StoreError::Config(e)) => e,
            other => panic!("{url}: {other:?}"),
        }
    };
    let why = refused("redis://127.0.0.1:1/?protocol=nonsense").await;
    assert!(why.contains("not a redis URL"), "{why}");
    for (bad, says) in [
        (
            RedisStore::builder("redis://127.0.0.1:1").timeout(Duration::ZERO),
            "timeout",
        ),
        (
            RedisStore::builder("redis://127.0.0.1:1").wait_for_replicas(0, Duration::from_secs(1)),
            "wait_for_replicas",
        ),
        (
            RedisStore::builder("redis://127.0.0.1:1").wait_for_replicas(1, Duration::ZERO),
            "WAIT 0",
        ),
    ] {
        match bad.connect().await {
            Err(StoreError::Config(why)) => assert!(why.contains(says), "{why}"),
            other => panic!("{says}: {:?}", other.map(|_| ())),
        }
    }
    let why = refused("redis+sentinel://127.0.0.1:1").await;
    if cfg!(feature = "redis-sentinel") {
        assert!(why.contains("names its master"), "{why}");
    } else {
        assert!(why.contains("redis-sentinel"), "{why}");
    }
    if !cfg!(feature = "redis-cluster") {
        let why = refused("redis+cluster://127.0.0.1:1").await;
        assert!(why.contains("redis-cluster"), "{why}");
    }
    #[cfg(feature = "redis-cluster")]
    assert!(matches!(
        RedisStore::builder("redis+cluster://a:7000,b:7001").source,
        super::builder::Source::Cluster(ref nodes) if nodes == &["redis://a:7000", "redis://b:7001"]
    ));
    #[cfg(feature = "redis-sentinel")]
    assert!(matches!(
        RedisStore::builder("redis+sentinel://a:26379/idem").source,
        super::builder::Source::Sentinel(ref nodes, ref master)
            if nodes == &["redis://a:26379"] && master == "idem"
    ));
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

#[test]
fn a_hash_tag_in_the_prefix_is_found_as_redis_cluster_reads_it() {
    use super::builder::hash_tag;
    assert_eq!(hash_tag("idempotency:"), None);
    assert_eq!(hash_tag("{orders}:idem:"), Some("orders"));
    assert_eq!(hash_tag("app:{x}"), Some("x"));
    // Empty braces, or no closing brace: Redis hashes the whole key.
    assert_eq!(hash_tag("app:{}:idem:"), None);
    assert_eq!(hash_tag("app:{idem:"), None);
    // The first `{` and the first `}` after it.
    assert_eq!(hash_tag("a}{b}{c}"), Some("b"));
}

/// Any brace in the prefix is a problem on a cluster: a hash tag, or braces that would hash a
/// key and its `{key}:acked` marker to different slots (`app:{}:idem:` hashes the key whole, and
/// its marker by `app:{`). None is one without.
#[test]
fn a_prefix_with_a_brace_is_a_problem_on_a_cluster() {
    use super::builder::cluster_prefix_problem;
    assert_eq!(cluster_prefix_problem("idempotency:"), None);
    assert_eq!(cluster_prefix_problem("app:orders:idem:"), None);
    let tag = cluster_prefix_problem("{orders}:idem:").unwrap();
    assert!(tag.contains("hash tag {orders}"), "{tag}");
    for prefix in ["app:{}:idem:", "app:{idem:", "app}:idem:"] {
        let problem = cluster_prefix_problem(prefix).expect(prefix);
        assert!(
            problem.contains("holds a brace") && problem.contains("without braces"),
            "{problem}"
        );
    }
}

/// On a cluster, a prefix with a brace is refused at connect and by `with_prefix`, with what to
/// do.
#[cfg(feature = "redis-cluster")]
#[tokio::test]
async fn a_hash_tag_prefix_is_refused_on_a_cluster() {
    let Some(urls) = env_url("REDIS_CLUSTER_URLS") else {
        return;
    };
    let nodes: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let err = RedisStore::builder_cluster(nodes.clone())
        .prefix("{orders}:idem:")
        .connect()
        .await
        .expect_err("a hash-tag prefix is refused on a cluster");
    let message = err.to_string();
    assert!(
        message.contains("hash tag {orders}") && message.contains("without braces"),
        "{message}"
    );
    // Empty braces are no hash tag, but the `wait_for_replicas` marker `{key}:acked` of a key
    // under this prefix would hash by `app:{`, away from its key: refused too.
    let err = RedisStore::builder_cluster(nodes.clone())
        .prefix("app:{}:idem:")
        .wait_for_replicas(1, std::time::Duration::from_millis(100))
        .connect()
        .await
        .expect_err("a prefix with a brace is refused on a cluster");
    assert!(err.to_string().contains("holds a brace"), "{err}");
    // And by `with_prefix`, which makes a store on the same connections.
    let store = RedisStore::builder_cluster(nodes)
        .prefix("app:idem:")
        .connect()
        .await
        .expect("a prefix without braces");
    let err = store
        .with_prefix("app:{}:idem:")
        .expect_err("with_prefix refuses a prefix with a brace on a cluster");
    assert!(err.to_string().contains("holds a brace"), "{err}");
    assert!(store.with_prefix("app:other:").is_ok());
}

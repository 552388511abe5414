//! What the Redis and PostgreSQL store tests share: the environment check, a cuttable TCP
//! proxy, axum servers on 127.0.0.1:0, and the store-independent scenarios (multi-instance,
//! lease takeover, outage, corrupt entry).
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotency_layer::conformance::{self, Fault, FaultStore, Op, Reply, Rule};
use idempotency_layer::store::{Begin, Fingerprint, NearCacheStats, Record, ScopeKey};
use idempotency_layer::{IdempotencyLayer, IdempotencyStore, Scope, StoreError};
pub use test_support::wait;
use tokio::sync::Notify;

/// The URL in `var`, or `None` (skip) outside CI.
pub use test_support::env::env_url;

/// A name unique to this call: `prefix` + 12 hex characters.
/// The Redis key (and pub/sub channel) of `scope` in `store`: its prefix + the scope in hex.
#[cfg(feature = "redis")]
pub fn entry_key(store: &idempotency_layer::RedisStore, scope: &ScopeKey) -> String {
    format!("{}{}", store.prefix(), scope.to_hex())
}

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

// The store fault proxy lives in the workspace's test-support crate (it depends on none of
// ours).
pub use test_support::fault_proxy::{authority, via, FaultProxy as Proxy, LinkFault};

pub use test_support::net::{serve, HttpClient};

/// An HTTP/1.1 keep-alive client.
pub fn client() -> HttpClient {
    test_support::net::client_h1()
}

/// A response read to the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
    pub replayed: bool,
}

/// POSTs `body` to `http://{addr}/orders` with idempotency key `key`, bounded by 30 s.
pub async fn post_order(client: &HttpClient, addr: SocketAddr, key: &str, body: &str) -> Answer {
    let req = Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("the server answers within 30 s")
        .expect("HTTP request");
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    Answer {
        status,
        body,
        replayed,
    }
}

/// The scope the layer uses for `POST /orders` with `key` in tenant `shop`.
pub fn order_scope(key: &str) -> ScopeKey {
    let method = Scope::http_operation(&http::Method::POST, "/orders");
    Scope::new("shop", &method, key).key()
}

/// Counts executions per idempotency key.
#[derive(Clone, Default)]
pub struct Executions {
    total: Arc<AtomicUsize>,
    per_key: Arc<Mutex<HashMap<String, usize>>>,
}

impl Executions {
    pub fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    pub fn of(&self, key: &str) -> usize {
        self.per_key.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub fn record(&self, headers: &HeaderMap) -> (usize, String) {
        let key = headers
            .get("x-idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        *self.per_key.lock().unwrap().entry(key.clone()).or_default() += 1;
        (self.total.fetch_add(1, Ordering::SeqCst) + 1, key)
    }
}

/// An orders service on `store`: each execution answers `{name} executed #{n} for {key}` after
/// `work`, so every execution's response differs.
pub fn orders_app<S: IdempotencyStore>(
    layer: IdempotencyLayer<S>,
    name: &'static str,
    executions: Executions,
    work: Duration,
) -> Router {
    Router::new()
        .route(
            "/orders",
            post(move |headers: HeaderMap| {
                let executions = executions.clone();
                async move {
                    let (n, key) = executions.record(&headers);
                    tokio::time::sleep(work).await;
                    (
                        StatusCode::CREATED,
                        format!("{name} executed #{n} for {key}"),
                    )
                }
            }),
        )
        // Records of test runs need not outlive them.
        .layer(
            layer
                .ttl(Duration::from_secs(600))
                .tenant(idempotency_layer::TenantSource::fixed("shop")),
        )
}

/// 50 keys x 40 duplicates, split over two instances `a` and `b` sharing one store: what each
/// key's requests got, and how often each key ran.
async fn two_instances_under_load<S: IdempotencyStore>(
    a: S,
    b: S,
) -> (Vec<String>, HashMap<String, Vec<Answer>>, Executions) {
    let executions = Executions::default();
    let work = Duration::from_millis(50);
    let addr_a = serve(orders_app(
        IdempotencyLayer::new(a),
        "a",
        executions.clone(),
        work,
    ))
    .await;
    let addr_b = serve(orders_app(
        IdempotencyLayer::new(b),
        "b",
        executions.clone(),
        work,
    ))
    .await;
    let client = client();
    let run = unique("");
    let keys: Vec<String> = (0..50).map(|k| format!("order-{run}-{k:02}")).collect();
    let mut tasks = Vec::new();
    for key in &keys {
        for d in 0..40 {
            let (client, key) = (client.clone(), key.clone());
            let addr = if d % 2 == 0 { addr_a } else { addr_b };
            tasks.push(tokio::spawn(async move {
                let answer = post_order(&client, addr, &key, r#"{"sku":"b1","qty":1}"#).await;
                (key, answer)
            }));
        }
    }
    let mut by_key: HashMap<String, Vec<Answer>> = HashMap::new();
    for t in tasks {
        let (key, answer) = t.await.expect("request task");
        by_key.entry(key).or_default().push(answer);
    }
    (keys, by_key, executions)
}

/// Two instances (separate listeners, separate store clients `a` and `b` on one server); 50
/// keys x 40 concurrent duplicates spread over both: exactly 50 executions, and every
/// duplicate of a key gets the same response.
pub async fn multi_instance<S: IdempotencyStore>(a: S, b: S) {
    let (keys, by_key, executions) = two_instances_under_load(a, b).await;
    for key in &keys {
        let answers = &by_key[key];
        assert_eq!(answers.len(), 40);
        for a in answers {
            assert_eq!(a.status, StatusCode::CREATED, "{key}: {a:?}");
            assert_eq!(
                a.body, answers[0].body,
                "{key}: every duplicate gets the same response"
            );
        }
        assert_eq!(
            answers.iter().filter(|a| !a.replayed).count(),
            1,
            "{key}: one original response, the rest replays"
        );
        assert_eq!(executions.of(key), 1, "{key} executed once");
    }
    assert_eq!(executions.total(), 50, "exactly 50 executions");
}

/// [`multi_instance`] with the stores' production timeouts: under this load on a small machine
/// some requests may find the store too slow and get 503 (fail closed, nothing executed), but
/// no key ever runs twice and every success for a key is the same response.
pub async fn multi_instance_at_production_timeouts<S: IdempotencyStore>(a: S, b: S) {
    let (keys, by_key, executions) = two_instances_under_load(a, b).await;
    let mut created = 0;
    for key in &keys {
        let answers = &by_key[key];
        assert_eq!(answers.len(), 40);
        let successes: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .collect();
        for a in answers {
            assert!(
                matches!(
                    a.status,
                    StatusCode::CREATED | StatusCode::SERVICE_UNAVAILABLE
                ),
                "{key}: only a success or a fail-closed 503: {a:?}"
            );
        }
        for a in &successes {
            assert_eq!(
                a.body, successes[0].body,
                "{key}: every success is the same response"
            );
        }
        assert!(
            executions.of(key) <= 1,
            "{key} executed {} times",
            executions.of(key)
        );
        if !successes.is_empty() {
            assert_eq!(
                executions.of(key),
                1,
                "{key}: a success means one execution"
            );
        }
        created += successes.len();
    }
    assert!(created > 0, "the store answered some requests in time");
}

/// Instance A's leader stalls past its lease (its handler hangs, its renewals do not arrive);
/// instance B takes over and executes; A's late complete is refused (fenced) and B's record
/// stays.
pub async fn lease_takeover<S: IdempotencyStore>(a: S, b: S) {
    let executions = Executions::default();
    // A's renewals never arrive (a leader stuck in a GC pause or a partition): acknowledged
    // without reaching the store.
    let a = FaultStore::new(a);
    a.inject(Rule::new(Op::Renew, Fault::Ack));
    a.inject(Rule::new(Op::RenewMany, Fault::Ack));
    let go = Arc::new(Notify::new());
    let started = Arc::new(Notify::new());
    let app_a = {
        let (go, started, executions) = (go.clone(), started.clone(), executions.clone());
        Router::new()
            .route(
                "/orders",
                post(move |headers: HeaderMap| {
                    let (go, started, executions) =
                        (go.clone(), started.clone(), executions.clone());
                    async move {
                        let notified = go.notified();
                        executions.record(&headers);
                        started.notify_one();
                        notified.await;
                        (StatusCode::CREATED, "from the stalled leader a")
                    }
                }),
            )
            .layer(
                IdempotencyLayer::new(a.clone())
                    .lease(Duration::from_millis(300))
                    .tenant(idempotency_layer::TenantSource::fixed("shop")),
            )
    };
    let addr_a = serve(app_a).await;
    let addr_b = serve(orders_app(
        IdempotencyLayer::new(b),
        "b",
        executions.clone(),
        Duration::ZERO,
    ))
    .await;
    let client = client();
    let key = unique("takeover-");
    let body = r#"{"sku":"t1"}"#;

    let first = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move { post_order(&client, addr_a, &key, body).await })
    };
    tokio::time::timeout(Duration::from_secs(10), started.notified())
        .await
        .expect("A's handler starts");
    // B finds the claim in flight, waits for it, and takes over when A's lease lapses.
    let took_over = post_order(&client, addr_b, &key, body).await;
    assert_eq!(took_over.status, StatusCode::CREATED, "{took_over:?}");
    assert!(!took_over.replayed, "B executed itself");
    assert!(took_over.body.starts_with(b"b executed"), "{took_over:?}");
    assert_eq!(
        executions.of(&key),
        2,
        "A (stalled) and B each executed once"
    );

    // A wakes up and answers its own client; its record is refused.
    go.notify_one();
    let late = first.await.unwrap();
    assert_eq!(&late.body[..], b"from the stalled leader a");
    a.until(wait::LIMIT, "A's layer tries to complete", |a| {
        !a.answers(Op::Complete).is_empty()
    })
    .await;
    assert_eq!(
        a.answers(Op::Complete),
        [Reply::Fenced],
        "the stalled leader's late complete is fenced"
    );
    for addr in [addr_a, addr_b] {
        let replay = post_order(&client, addr, &key, body).await;
        assert!(replay.replayed, "{replay:?}");
        assert_eq!(
            replay.body, took_over.body,
            "B's record was not overwritten"
        );
    }
    assert_eq!(executions.of(&key), 2);
}

/// The store is reached through `proxy`: cut, the layer (fail closed) answers 503 at once and
/// executes nothing; restored, the same service works again.
pub async fn outage<S: IdempotencyStore>(store: S, proxy: &Proxy) {
    let executions = Executions::default();
    let addr = serve(orders_app(
        IdempotencyLayer::new(store),
        "svc",
        executions.clone(),
        Duration::ZERO,
    ))
    .await;
    let client = client();
    let body = r#"{"sku":"o1"}"#;
    let before = post_order(&client, addr, &unique("outage-before-"), body).await;
    assert_eq!(before.status, StatusCode::CREATED, "{before:?}");
    assert_eq!(executions.total(), 1);

    proxy.cut();
    for i in 0..3 {
        let started = Instant::now();
        let a = post_order(&client, addr, &unique(&format!("outage-cut{i}-")), body).await;
        eprintln!("cut: answered {} in {:?}", a.status, started.elapsed());
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
    }
    assert_eq!(
        executions.total(),
        1,
        "nothing executes while the store is cut off"
    );

    proxy.restore();
    let key = unique("outage-after-");
    let answer = wait::some(
        wait::LIMIT,
        "the service works again after the store is back",
        || async {
            let a = post_order(&client, addr, &key, body).await;
            if a.status == StatusCode::CREATED {
                return Some(a);
            }
            assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{a:?}");
            None
        },
    )
    .await;
    assert!(!answer.replayed);
    assert_eq!(executions.total(), 2);
    let replay = post_order(&client, addr, &key, body).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(replay.body, answer.body);
    assert_eq!(executions.total(), 2);
}

/// The layer reaches its store through `proxy`; for each [`LinkFault`], 6 keys x 3 duplicates
/// are sent at once and, once every key's handler has started, the fault is inflicted for two
/// store timeouts, then cleared. Every
/// request is answered (within [`post_order`]'s 30 s), with the execution's response or a
/// retryable refusal (503 store unavailable, 409 in flight); once the link is healthy again,
/// each key is answered within [`wait::LIMIT`] with the response of its one execution, and
/// nothing ever ran twice. `timeout` is the store's.
pub async fn duplicates_through_link_faults<S: IdempotencyStore>(
    store: S,
    proxy: &Proxy,
    timeout: Duration,
) {
    let executions = Executions::default();
    let addr = serve(orders_app(
        IdempotencyLayer::new(store),
        "svc",
        executions.clone(),
        Duration::from_millis(100),
    ))
    .await;
    let client = client();
    let body = r#"{"sku":"f1"}"#;
    for fault in LinkFault::ALL {
        let keys: Vec<String> = (0..6)
            .map(|i| unique(&format!("link-{fault:?}-{i}-")))
            .collect();
        let requests: Vec<_> = keys
            .iter()
            .flat_map(|key| std::iter::repeat_n(key.clone(), 3))
            .map(|key| {
                let client = client.clone();
                tokio::spawn(async move {
                    let a = post_order(&client, addr, &key, body).await;
                    (key, a)
                })
            })
            .collect();
        // Into the fault once every key's handler has started: the completes, and the
        // duplicates waiting on the claims, meet it.
        wait::until("every key's handler started", || {
            keys.iter().all(|k| executions.of(k) >= 1)
        })
        .await;
        proxy.inflict(fault, timeout * 2).await;
        let mut answered: HashMap<String, Vec<Answer>> = HashMap::new();
        for r in requests {
            let (key, a) = r.await.expect("request task");
            assert!(
                matches!(
                    a.status,
                    StatusCode::CREATED | StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
                ),
                "{fault:?} {key}: an execution's response or a retryable refusal: {a:?}"
            );
            answered.entry(key).or_default().push(a);
        }
        for key in &keys {
            let settled = wait::some(
                wait::LIMIT,
                &format!("{fault:?} {key}: answered with its response once the link is healthy"),
                || async {
                    let a = post_order(&client, addr, key, body).await;
                    (a.status == StatusCode::CREATED).then_some(a)
                },
            )
            .await;
            for a in &answered[key] {
                if a.status == StatusCode::CREATED {
                    assert_eq!(
                        a.body, settled.body,
                        "{fault:?} {key}: every success is the one execution's response"
                    );
                }
            }
            assert_eq!(
                executions.of(key),
                1,
                "{fault:?} {key}: executed once through the fault"
            );
        }
    }
}

/// Records a response for `key` through the layer on `store`, lets `spoil` write garbage into
/// its entry, then checks the store says [`StoreError::Corrupt`] and the layer answers an error
/// without executing.
pub async fn corrupt_entry<S, F, Fut>(store: S, spoil: F)
where
    S: IdempotencyStore,
    F: Fn(ScopeKey) -> Fut,
    Fut: Future<Output = ()>,
{
    let executions = Executions::default();
    let addr = serve(orders_app(
        IdempotencyLayer::new(store.clone()),
        "svc",
        executions.clone(),
        Duration::ZERO,
    ))
    .await;
    let client = client();
    let key = unique("corrupt-");
    let body = r#"{"sku":"c1"}"#;
    let first = post_order(&client, addr, &key, body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let scope = order_scope(&key);
    // The record lands as the response body ends; the client may have read it a moment before.
    wait::until_async(wait::LIMIT, "the first response is recorded", || async {
        match store
            .begin(scope, Fingerprint([0; 32]), Duration::from_secs(5))
            .await
        {
            Ok(Begin::Completed(_)) => true,
            Ok(Begin::InFlight { .. }) => false,
            other => panic!("expected the record, got {other:?}"),
        }
    })
    .await;

    spoil(scope).await;
    match store
        .begin(scope, Fingerprint([0; 32]), Duration::from_secs(5))
        .await
    {
        Err(e @ StoreError::Corrupt(_)) => {
            assert!(e.to_string().contains("corrupt"), "{e}");
            eprintln!("corrupt entry reported as: {e}");
        }
        other => panic!("a garbage entry must be StoreError::Corrupt, got {other:?}"),
    }
    let answer = post_order(&client, addr, &key, body).await;
    // Not a retryable 503: retrying cannot repair the entry. The answer says what to do.
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert!(
        String::from_utf8_lossy(&answer.body).contains("corrupt"),
        "{answer:?}"
    );
    assert_eq!(executions.total(), 1, "nothing executes on a corrupt entry");
    // Forgetting the key makes it usable again.
    store.forget(scope).await.expect("forget a corrupt entry");
    let again = post_order(&client, addr, &key, body).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert_eq!(executions.total(), 2);
}

/// Found by the chaos soak: a `begin` whose reply is lost (it ran on the server, the client
/// timed out) left a claim nobody held, blocking its key for a whole lease (30 s here). The
/// store now releases such a claim, fenced by its token, as soon as it can.
///
/// `via_slow` times out while `slow` holds the reply. The claim is seen on the server (read
/// without claiming, [`Backend::holds`]) while the begin waits for its reply: the begin did run,
/// so a key that is free afterwards was released, not never claimed.
pub async fn lost_begin_reply<B: Backend>(
    via_slow: B::Store,
    direct: B::Store,
    slow: &Proxy,
    url: &str,
) {
    let scope = order_scope(&unique("lost-begin-"));
    let fp = Fingerprint([7; 32]);
    let lease = Duration::from_secs(30);
    warm_up(&via_slow, fp, lease).await;
    slow.hold_replies();
    let begin = tokio::spawn(async move { via_slow.begin(scope, fp, lease).await });
    claim_reached_the_server::<B>(&direct, url, scope).await;
    match begin.await.unwrap() {
        Err(StoreError::Backend(e)) => eprintln!("begin failed as intended: {e}"),
        other => panic!("the slow reply must time out, got {other:?}"),
    }
    slow.release_replies();
    // Well before the 30 s lease, the orphan is gone and the key can be claimed.
    claimable_soon(
        &direct,
        scope,
        fp,
        lease,
        "the orphan claim is released: the key can be claimed",
    )
    .await;
}

/// Claims and releases a scope of its own through `store`: its connections made and its
/// statements prepared, so that under `hold` only the claim's reply is late.
async fn warm_up<S: IdempotencyStore>(store: &S, fp: Fingerprint, lease: Duration) {
    let warm = order_scope(&unique("warm-up-"));
    if let Ok(Begin::New(t)) = store.begin(warm, fp, lease).await {
        store.release(warm, t).await.unwrap();
    }
}

/// Waits until the server holds a claim on `scope` (the begin under test ran there).
async fn claim_reached_the_server<B: Backend>(store: &B::Store, url: &str, scope: ScopeKey) {
    wait::until_async(
        wait::LIMIT,
        "the begin's claim is written on the server",
        || B::holds(store, url, scope),
    )
    .await;
}

/// Waits until `scope` can be claimed again (an orphaned claim was released: `released` says
/// which), at most 15 s: half the 30 s lease it would otherwise block its key for.
async fn claimable_soon<S: IdempotencyStore>(
    store: &S,
    scope: ScopeKey,
    fp: Fingerprint,
    lease: Duration,
    released: &str,
) {
    let token = wait::some(Duration::from_secs(15), released, || async {
        match store.begin(scope, fp, lease).await {
            Ok(Begin::New(token)) => Some(token),
            Ok(Begin::InFlight { .. }) => None,
            other => panic!("{released}: {other:?}"),
        }
    })
    .await;
    store.release(scope, token).await.unwrap();
}

/// A `begin` whose request was dropped while the store ran it (the client went away): the
/// claim is written on the server with nobody to release it. The store's guard releases it, so
/// the key is free again well before its 30 s lease. `via_slow` waits longer for a reply than
/// the proxy holds it, so the begin is dropped, not timed out; it is dropped once the
/// server holds its claim ([`Backend::holds`]), so the key was claimed and then released.
pub async fn dropped_begin<B: Backend>(
    via_slow: B::Store,
    direct: B::Store,
    slow: &Proxy,
    url: &str,
) {
    let scope = order_scope(&unique("dropped-begin-"));
    let fp = Fingerprint([8; 32]);
    let lease = Duration::from_secs(30);
    warm_up(&via_slow, fp, lease).await;
    slow.hold_replies();
    let begin = tokio::spawn(async move { via_slow.begin(scope, fp, lease).await });
    // The claim runs on the server; its reply is held back. Then the request goes away.
    claim_reached_the_server::<B>(&direct, url, scope).await;
    begin.abort();
    assert!(
        begin.await.unwrap_err().is_cancelled(),
        "the begin was still in flight"
    );
    slow.release_replies();
    claimable_soon(
        &direct,
        scope,
        fp,
        lease,
        "the dropped begin's claim is released: the key can be claimed",
    )
    .await;
}

/// How the shared suite ([`shared_store_suite!`]) reaches one backend: a namespace of the test's
/// own on the server (a Redis key prefix, a PostgreSQL schema), and stores on it.
pub trait Backend {
    /// The store under test.
    type Store: IdempotencyStore;
    /// The environment variable with the server's URL.
    const URL_VAR: &'static str;
    /// A fresh namespace.
    fn namespace() -> String;
    /// A store of its own (its own connections) on `namespace`, through `url` (the server's, or
    /// a proxy's in front of it), migrated if the store needs it.
    fn connect(
        url: String,
        namespace: String,
        tuning: Tuning,
    ) -> impl Future<Output = Self::Store> + Send;
    /// Removes what the namespace holds on the server.
    fn drop_namespace(url: String, namespace: String) -> impl Future<Output = ()> + Send;
    /// What the store's near cache did, if it has one.
    fn near_stats(store: &Self::Store) -> Option<NearCacheStats>;
    /// Whether the server (at `url`) holds a claim on `scope` of `store`'s namespace, read
    /// without claiming: the server's own view, for tests that must know an operation ran.
    fn holds(store: &Self::Store, url: &str, scope: ScopeKey) -> impl Future<Output = bool> + Send;
    /// Whether the store's listening connection goes where its URL says (through the test's
    /// proxy, when the URL names one): `false` for a store behind a transaction pooler, whose
    /// listener connects to the server directly.
    const LISTENER_FOLLOWS_URL: bool = true;
}

/// How a test wants its store connected.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tuning {
    /// How long the store waits for the server; `None`: its production default.
    pub timeout: Option<Duration>,
    /// One connection only (so a test that warms it up knows which connection runs next).
    pub single_connection: bool,
    /// With a near cache (`near_cache(NearCache::new(16 MiB))`).
    pub near_cache: bool,
    /// Waiters poll every [`SLOW_POLL`] only: what the conformance suite needs, so that only a
    /// wake-up can wake a waiter within its `WAKE` bound.
    pub slow_polling: bool,
}

/// The fallback polling of stores run through the conformance suite: far slower than
/// `conformance::WAKE`, so that a store whose wake-ups were broken would fail there.
pub const SLOW_POLL: Duration = Duration::from_secs(60);

impl Tuning {
    /// The production defaults with a near cache.
    pub fn near() -> Tuning {
        Tuning {
            near_cache: true,
            ..Tuning::default()
        }
    }

    /// For the conformance suite: the production defaults but polling every [`SLOW_POLL`].
    pub fn conformance() -> Tuning {
        Tuning {
            slow_polling: true,
            ..Tuning::default()
        }
    }
}

/// Begins on `scope` until `store`'s near cache answers a begin (the cache starts listening
/// at the first begin and caches only once it listens); every begin must find `record`.
pub async fn cached_on<S: IdempotencyStore>(
    store: &S,
    stats: impl Fn(&S) -> Option<NearCacheStats>,
    scope: ScopeKey,
    record: &Record,
) {
    wait::until_async(wait::LIMIT, "the near cache answers a begin", || async {
        let hits = stats(store).expect("a near cache").hits;
        match store
            .begin(scope, record.fingerprint(), conformance::LONG)
            .await
        {
            Ok(Begin::Completed(r)) => assert_eq!(*r, *record),
            other => panic!("a completed record, got {other:?}"),
        }
        stats(store).unwrap().hits > hits
    })
    .await;
}

/// Two instances with near caches, over HTTP: a record replayed on `b` is served from `b`'s
/// cache; forgetting it through `a`'s layer drops it from `b`'s cache too, and `b` then
/// executes the key again.
pub async fn near_cache_forget_reaches_every_instance<S: IdempotencyStore>(
    a: S,
    b: S,
    stats: impl Fn(&S) -> Option<NearCacheStats>,
) {
    let executions = Executions::default();
    let layer_a = IdempotencyLayer::new(a).tenant(idempotency_layer::TenantSource::fixed("shop"));
    let addr_a = serve(orders_app(
        layer_a.clone(),
        "a",
        executions.clone(),
        Duration::ZERO,
    ))
    .await;
    let addr_b = serve(orders_app(
        IdempotencyLayer::new(b.clone()),
        "b",
        executions.clone(),
        Duration::ZERO,
    ))
    .await;
    let client = client();
    let key = unique("near-");
    let body = r#"{"sku":"n1"}"#;
    let first = post_order(&client, addr_a, &key, body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed);

    // Replays on b until b's cache answers one: no round trip, same response.
    wait::until_async(wait::LIMIT, "b's near cache answers a replay", || async {
        let hits = stats(&b).unwrap().hits;
        let replay = post_order(&client, addr_b, &key, body).await;
        assert!(replay.replayed, "{replay:?}");
        assert_eq!(replay.body, first.body);
        stats(&b).unwrap().hits > hits
    })
    .await;
    assert_eq!(executions.of(&key), 1);

    let invalidations = stats(&b).unwrap().invalidations;
    let method = Scope::http_operation(&http::Method::POST, "/orders");
    assert!(layer_a
        .forget(Scope::new("shop", &method, &key))
        .await
        .unwrap());
    wait::until("b's near cache hears the forget", || {
        stats(&b).unwrap().invalidations > invalidations
    })
    .await;
    let again = post_order(&client, addr_b, &key, body).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed, "a forgotten key executes again: {again:?}");
    assert!(again.body.starts_with(b"b executed #2"), "{again:?}");
    assert_eq!(executions.of(&key), 2);
}

/// A near-cached store `via_proxy` loses its connections (the proxy is cut) while `direct`
/// forgets a record it had cached: the invalidation is lost with the connection, so the cache
/// must have been emptied and turned off; once the store is back, the forgotten record is gone.
pub async fn near_cache_lost_subscription<S: IdempotencyStore>(
    via_proxy: S,
    direct: S,
    proxy: &Proxy,
    stats: impl Fn(&S) -> Option<NearCacheStats>,
) {
    let mut scope = [0u8; 32];
    scope[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    scope[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    let scope = ScopeKey(scope);
    let record = conformance::sample_record(Fingerprint([9; 32]));
    let Ok(Begin::New(t)) = direct
        .begin(scope, record.fingerprint(), conformance::LONG)
        .await
    else {
        panic!("a new scope is claimed")
    };
    direct
        .complete(scope, t, record.clone().into(), Duration::from_secs(600))
        .await
        .unwrap();
    cached_on(&via_proxy, &stats, scope, &record).await;

    proxy.cut();
    wait::until("the cut empties the near cache", || {
        let s = stats(&via_proxy).unwrap();
        s.resets >= 1 && s.entries == 0
    })
    .await;
    assert!(direct.forget(scope).await.unwrap());
    // While cut off, the cache serves nothing: the begin fails closed.
    let cut_off = via_proxy
        .begin(scope, record.fingerprint(), conformance::LONG)
        .await;
    assert!(
        matches!(cut_off, Err(StoreError::Backend(_))),
        "no stale replay while the store is unreachable: {cut_off:?}"
    );

    proxy.restore();
    let back = wait::some(wait::LIMIT, "the store is reachable again", || async {
        match via_proxy
            .begin(scope, record.fingerprint(), conformance::LONG)
            .await
        {
            Err(StoreError::Backend(_)) => None,
            other => Some(other),
        }
    })
    .await;
    match back {
        Ok(Begin::New(t)) => via_proxy.release(scope, t).await.unwrap(),
        other => panic!("the forgotten record must not come back from the cache: {other:?}"),
    }
}

/// The tests every shared store passes, one `#[tokio::test]` each, for backend `$backend`
/// ([`Backend`]): the conformance suite, two instances under load (generous and production
/// timeouts), lease takeover with fencing, an outage through a cut proxy, a begin whose reply
/// was lost, a begin dropped in flight, and the store opened from its URL by `AnyStore`.
#[allow(unused_macros)] // the cluster tests include this module but bring their own tests
macro_rules! shared_store_suite {
    ($backend:ty, $any_variant:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn conformance_suite() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let store =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::conformance())
                    .await;
            // Every check uses scopes of its own, so one namespace serves them all.
            conformance::run_all(|| store.clone()).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_instances_execute_each_key_once() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            // Separate store clients sharing one namespace. 2 000 concurrent requests on a
            // shared 2-core CI box can exceed the production timeout without anything being
            // wrong; this test is about exactly-once (the next one keeps the production timeout).
            let tuning = Tuning {
                timeout: Some(Duration::from_secs(10)),
                ..Tuning::default()
            };
            let a = <$backend as Backend>::connect(url.clone(), ns.clone(), tuning).await;
            let b = <$backend as Backend>::connect(url.clone(), ns.clone(), tuning).await;
            multi_instance(a, b).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_instances_at_production_timeouts_never_run_a_key_twice() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let a =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            let b =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            multi_instance_at_production_timeouts(a, b).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_stalled_leader_is_taken_over_and_fenced() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let a =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            let b =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            lease_takeover(a, b).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn outage_fails_closed_and_recovers_without_restart() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let proxy = Proxy::start(authority(&url)).await;
            let store = <$backend as Backend>::connect(
                via(&url, proxy.addr()),
                ns.clone(),
                Tuning::default(),
            )
            .await;
            outage(store, &proxy).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn duplicates_run_once_through_every_fault_of_the_store_link() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let proxy = Proxy::start(authority(&url)).await;
            let timeout = Duration::from_secs(1);
            let tuning = Tuning {
                timeout: Some(timeout),
                ..Tuning::default()
            };
            let store =
                <$backend as Backend>::connect(via(&url, proxy.addr()), ns.clone(), tuning).await;
            duplicates_through_link_faults(store, &proxy, timeout).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_claim_whose_begin_reply_was_lost_is_released() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            // The begin times out after 2 s, its reply held at the proxy until then: the claim
            // is on the server for those 2 s (and until the guard releases it), long enough to
            // be seen there.
            let slow = Proxy::start(authority(&url)).await;
            let tuning = Tuning {
                timeout: Some(Duration::from_secs(2)),
                single_connection: true,
                ..Tuning::default()
            };
            let via_slow =
                <$backend as Backend>::connect(via(&url, slow.addr()), ns.clone(), tuning).await;
            let direct =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            lost_begin_reply::<$backend>(via_slow, direct, &slow, &url).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_claim_whose_begin_was_dropped_in_flight_is_released() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let slow = Proxy::start(authority(&url)).await;
            let tuning = Tuning {
                timeout: Some(Duration::from_secs(10)),
                single_connection: true,
                ..Tuning::default()
            };
            let via_slow =
                <$backend as Backend>::connect(via(&url, slow.addr()), ns.clone(), tuning).await;
            let direct =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            dropped_begin::<$backend>(via_slow, direct, &slow, &url).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn conformance_suite_with_near_cache() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let tuning = Tuning {
                slow_polling: true,
                ..Tuning::near()
            };
            let store = <$backend as Backend>::connect(url.clone(), ns.clone(), tuning).await;
            conformance::run_all(|| store.clone()).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn two_instances_with_near_caches_execute_each_key_once() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let tuning = Tuning {
                timeout: Some(Duration::from_secs(10)),
                ..Tuning::near()
            };
            let a = <$backend as Backend>::connect(url.clone(), ns.clone(), tuning).await;
            let b = <$backend as Backend>::connect(url.clone(), ns.clone(), tuning).await;
            multi_instance(a.clone(), b.clone()).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_forget_drops_the_record_from_every_instance_near_cache() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let ns = <$backend as Backend>::namespace();
            let a = <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::near()).await;
            let b = <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::near()).await;
            near_cache_forget_reaches_every_instance(a, b, <$backend as Backend>::near_stats).await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_lost_invalidation_channel_empties_the_near_cache() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            if !<$backend as Backend>::LISTENER_FOLLOWS_URL {
                eprintln!(
                    "skipped: this store's listener does not go through the URL the test cuts \
                     (the store behind the pooler listens on the server directly; the test runs \
                     on the direct store)"
                );
                return;
            }
            let ns = <$backend as Backend>::namespace();
            let proxy = Proxy::start(authority(&url)).await;
            let tuning = Tuning {
                timeout: Some(Duration::from_millis(500)),
                ..Tuning::near()
            };
            let via_proxy =
                <$backend as Backend>::connect(via(&url, proxy.addr()), ns.clone(), tuning).await;
            let direct =
                <$backend as Backend>::connect(url.clone(), ns.clone(), Tuning::default()).await;
            near_cache_lost_subscription(
                via_proxy,
                direct,
                &proxy,
                <$backend as Backend>::near_stats,
            )
            .await;
            <$backend as Backend>::drop_namespace(url, ns).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn any_store_opens_it_from_its_url() {
            let Some(url) = env_url(<$backend as Backend>::URL_VAR) else {
                return;
            };
            let store = idempotency_layer::store::AnyStore::from_url(&url)
                .await
                .unwrap();
            assert!(matches!(store, $any_variant(_)), "{store:?}");
            store.migrate().await.unwrap();
            conformance::run_all(|| store.clone()).await;
        }
    };
}
#[allow(unused_imports)]
pub(crate) use shared_store_suite;

/// A claim of `scope` that the store answers `New`, tried until one is (with
/// `wait_for_replicas`, a claim made before a replica has synced is refused, and released in
/// the background); its token.
pub async fn claim_acknowledged<S: IdempotencyStore + Clone>(
    store: &S,
    scope: ScopeKey,
    fp: Fingerprint,
) -> idempotency_layer::store::Token {
    let claimed = Arc::new(Mutex::new(None));
    wait::until_async(wait::LIMIT, "the store acknowledges a claim", || {
        let (store, claimed) = (store.clone(), claimed.clone());
        async move {
            if let Ok(Begin::New(t)) = store.begin(scope, fp, conformance::LONG).await {
                *claimed.lock().unwrap() = Some(t);
            }
            claimed.lock().unwrap().is_some()
        }
    })
    .await;
    let token = claimed.lock().unwrap().expect("claimed");
    token
}

/// Waits until `begin` on `scope` answers with a replay of its record (once the store may
/// serve it: replicated, or confirmed by a standby).
pub async fn until_replayed<S: IdempotencyStore>(store: &S, scope: ScopeKey, fp: Fingerprint) {
    wait::until_async(wait::LIMIT, "the record is replayed", || async {
        matches!(
            store.begin(scope, fp, conformance::LONG).await,
            Ok(Begin::Completed(_))
        )
    })
    .await;
}

//! `RedisStore` on a Redis Cluster whose nodes are cut off and come back: a cluster of the
//! test's own ([`ProxiedCluster`]), every node behind a cuttable proxy that it announces as its
//! address. During the cut the layer answers what it cannot know with a classified 503 (store
//! unavailable, `Retry-After`) and runs nothing; after it, it works again without a restart,
//! and no key runs twice: not one answered before the cut, nor one whose handler ran across it.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use idempotency_layer::{IdempotencyLayer, RedisStore, RejectReason};
use test_support::fault_proxy::FaultProxy;
use tokio::sync::Semaphore;

use crate::proxied_cluster::{can_run, ProxiedCluster};
use crate::support::*;

/// `POST /orders` with `key`: status, `Retry-After`, body, replayed.
async fn post(client: &HttpClient, addr: std::net::SocketAddr, key: &str) -> (Answer, bool) {
    let req = Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("x-idempotency-key", key)
        .body(Full::new(bytes::Bytes::from_static(b"{\"sku\":\"c1\"}")))
        .unwrap();
    let res = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("the server answers within 30 s")
        .expect("HTTP request");
    let retry_after = res.headers().contains_key("retry-after");
    let (status, replayed) = (
        res.status(),
        res.headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
    );
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (
        Answer {
            status,
            body,
            replayed,
        },
        retry_after,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_classified_503s_through_a_cut_and_recovers_without_running_twice() {
    if !can_run() {
        return;
    }
    let cluster = ProxiedCluster::start("idem-cluster-cuts-", |node| async move {
        let proxy = FaultProxy::start(&node.to_string()).await;
        let addr = proxy.addr();
        (proxy, addr)
    })
    .await;
    let cut = |on: bool| {
        for p in &cluster.proxies {
            if on {
                p.cut()
            } else {
                p.restore()
            }
        }
    };
    let store = RedisStore::builder_cluster(cluster.urls())
        .prefix(unique("cuts-"))
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("the test's cluster, through its proxies");

    // `/orders` runs at once, except the key "held", whose handler waits for `go`.
    let executions = Executions::default();
    let go = Arc::new(Semaphore::new(0));
    let layer = IdempotencyLayer::new(store).tenant(idempotency_layer::TenantSource::fixed("shop"));
    let app = {
        let (executions, go) = (executions.clone(), go.clone());
        Router::new()
            .route(
                "/orders",
                axum::routing::post(move |headers: HeaderMap| {
                    let (executions, go) = (executions.clone(), go.clone());
                    async move {
                        let (n, key) = executions.record(&headers);
                        if key.starts_with("held-") {
                            go.acquire().await.unwrap().forget();
                        }
                        (StatusCode::CREATED, format!("executed #{n} for {key}"))
                    }
                }),
            )
            .layer(layer.clone())
    };
    let addr = serve(app).await;
    let client = client();
    let run = unique("");
    let (before, held, during) = (
        format!("before-{run}"),
        format!("held-{run}"),
        format!("during-{run}"),
    );

    let (first, _) = post(&client, addr, &before).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // A handler runs as the cut comes: its record must land after it.
    let held_call = {
        let (client, held) = (client.clone(), held.clone());
        tokio::spawn(async move { post(&client, addr, &held).await })
    };
    wait::until("the held key's handler runs", || executions.of(&held) == 1).await;

    cut(true);
    go.add_permits(1);
    for key in [&before, &during] {
        let (a, retry_after) = post(&client, addr, key).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{key}: {a:?}");
        assert!(retry_after, "{key}: the 503 says when to retry");
        assert!(
            String::from_utf8_lossy(&a.body).contains("Idempotency store unavailable"),
            "{key}: the 503 says why: {a:?}"
        );
    }
    assert!(layer.stats().rejected(RejectReason::StoreUnavailable) >= 2);
    assert_eq!(
        (executions.of(&before), executions.of(&during)),
        (1, 0),
        "nothing runs while the store is cut off"
    );

    cut(false);
    // Back: the new key runs once, the old ones replay (the held one once its record, stored
    // through the outage, is there: a duplicate meanwhile waits for it).
    let after = wait::some(wait::LIMIT, "the service works again", || async {
        let (a, _) = post(&client, addr, &during).await;
        (a.status != StatusCode::SERVICE_UNAVAILABLE).then_some(a)
    })
    .await;
    assert_eq!(after.status, StatusCode::CREATED, "{after:?}");
    assert!(!after.replayed, "{after:?}");
    let (held_answer, _) = held_call.await.unwrap();
    assert_eq!(held_answer.status, StatusCode::CREATED, "{held_answer:?}");
    for (key, original) in [(&before, &first), (&held, &held_answer), (&during, &after)] {
        let (replay, _) = post(&client, addr, key).await;
        assert!(replay.replayed, "{key}: {replay:?}");
        assert_eq!(replay.body, original.body, "{key}");
        assert_eq!(executions.of(key), 1, "{key} ran once");
    }
    assert_eq!(executions.total(), 3);
}

//! `RedisStore` on a Redis Cluster whose reply to a claim is lost: a cluster of the test's own
//! ([`ProxiedCluster`]: each node reached through a proxy that it announces as its address), one
//! proxy forwards the claim to its node and closes the connection before the reply. The
//! cluster client reconnects and sends the claim again; that resend finds the claim it wrote
//! itself the first time.
//!
//! Runs where the shared cluster tests run (`REDIS_CLUSTER_URLS` set: `redis-server` and
//! `redis-cli` are installed); it does not touch that cluster.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::proxied_cluster::ProxiedCluster;
use crate::support::*;
use idempotency_layer::store::{Begin, Fingerprint};
use idempotency_layer::{IdempotencyStore, RedisStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A proxy to `upstream` that relays a connection both ways, except that once armed, the first
/// chunk from a client that contains `marker` is forwarded to the server and then the connection
/// is closed without relaying anything more from the server: the command runs, its reply is
/// lost.
struct LoseReplyProxy {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
    lost: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for LoseReplyProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl LoseReplyProxy {
    async fn start(upstream: SocketAddr, marker: Vec<u8>) -> LoseReplyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (armed, lost) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let accept = {
            let (armed, lost, marker) = (armed.clone(), lost.clone(), Arc::new(marker));
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let (armed, lost, marker) = (armed.clone(), lost.clone(), marker.clone());
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(upstream).await {
                            relay(client, server, &armed, &lost, &marker).await;
                        }
                    });
                }
            })
        };
        LoseReplyProxy {
            addr,
            armed,
            lost,
            accept,
        }
    }
}

async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    armed: &AtomicBool,
    lost: &AtomicUsize,
    marker: &[u8],
) {
    let severed = AtomicBool::new(false);
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let lose = chunk.windows(marker.len()).any(|w| w == marker)
                && armed.swap(false, Ordering::SeqCst);
            if lose {
                severed.store(true, Ordering::SeqCst);
            }
            if sw.write_all(chunk).await.is_err() {
                return;
            }
            if lose {
                // Forwarded: let the server run it, then close both sides, its reply unsent.
                tokio::time::sleep(Duration::from_millis(100)).await;
                lost.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if severed.load(Ordering::SeqCst) {
                // Nothing reaches the client once the marked command went out.
                std::future::pending::<()>().await;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// The test's own cluster, each node behind a [`LoseReplyProxy`].
type Cluster = ProxiedCluster<LoseReplyProxy>;

async fn start_cluster(marker: &[u8]) -> Cluster {
    ProxiedCluster::start("idem-lost-reply-", |node| async move {
        let proxy = LoseReplyProxy::start(node, marker.to_vec()).await;
        let addr = proxy.addr;
        (proxy, addr)
    })
    .await
}

fn arm(cluster: &Cluster) {
    for p in &cluster.proxies {
        p.armed.store(true, Ordering::SeqCst);
    }
}

fn lost(cluster: &Cluster) -> usize {
    cluster
        .proxies
        .iter()
        .map(|p| p.lost.load(Ordering::SeqCst))
        .sum()
}

/// The reply to a claim is lost and the cluster client sends it again: the resend answers
/// "claimed" (the claim holds the request's own token), so the request runs its handler at
/// once, the key holds that one claim, and its release frees it. (Before, the resend answered
/// "in flight" with the request's own token: the request waited for itself until its wait gave
/// up with 409, and the key stayed blocked for a whole lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_is_resent_and_is_still_ours() {
    if !crate::proxied_cluster::can_run() {
        return;
    }
    let prefix = unique("lost-reply-");
    let cluster = start_cluster(prefix.as_bytes()).await;
    let store = RedisStore::builder_cluster(cluster.urls())
        .prefix(&prefix)
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("the test's cluster, through its proxies");
    let fp = Fingerprint([9; 32]);
    let lease = Duration::from_secs(600);
    // Every node has run the scripts (64 keys spread over three masters): the claim whose reply
    // is lost below runs the first time, rather than answer NOSCRIPT.
    for i in 0..64 {
        let scope = order_scope(&format!("warm-up-{i}"));
        let Ok(Begin::New(t)) = store.begin(scope, fp, lease).await else {
            panic!("warm-up claim {i}");
        };
        store.release(scope, t).await.unwrap();
    }
    for i in 0..3 {
        let scope = order_scope(&format!("lost-reply-{i}"));
        arm(&cluster);
        let lost_before = lost(&cluster);
        let token = match store.begin(scope, fp, lease).await {
            Ok(Begin::New(t)) => t,
            other => panic!("claim {i}: a resent claim must be the sender's own, got {other:?}"),
        };
        assert!(
            lost(&cluster) > lost_before,
            "claim {i}: its first reply was lost"
        );
        match store.begin(scope, fp, lease).await {
            Ok(Begin::InFlight { token: t, .. }) => assert_eq!(t, token, "claim {i}"),
            other => panic!("claim {i}: another request sees the claim in flight: {other:?}"),
        }
        store.release(scope, token).await.expect("the one claim");
        assert!(
            matches!(store.begin(scope, fp, lease).await, Ok(Begin::New(_))),
            "claim {i}: released, the key is free"
        );
    }
}

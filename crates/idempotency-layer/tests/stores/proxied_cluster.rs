//! A Redis Cluster of a test's own: three masters, each reached through a proxy of the test's
//! choosing that the node announces as its address, so that every connection a cluster client
//! makes (to the seed nodes, and to the ones it finds through `CLUSTER SLOTS`) goes through a proxy.
//! Killed when dropped. Needs `redis-server` and `redis-cli` (installed where
//! `REDIS_CLUSTER_URLS` is set); it does not touch that cluster.

use std::future::Future;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use test_support::wait;
use tokio::net::TcpStream;

use crate::support::unique;

/// A free port on loopback (bound and let go).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Three cluster nodes, each behind its proxy `P`.
pub(crate) struct ProxiedCluster<P> {
    nodes: Vec<Child>,
    dir: std::path::PathBuf,
    /// The proxies, one per node.
    pub(crate) proxies: Vec<P>,
    /// Where each proxy listens (the address its node announces).
    addrs: Vec<SocketAddr>,
}

impl<P> Drop for ProxiedCluster<P> {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            let _ = n.kill();
            let _ = n.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the test's cluster can run here: `REDIS_CLUSTER_URLS` is set (where it is, the
/// Redis binaries are installed). Unset: says so and skips, except in CI.
pub(crate) fn can_run() -> bool {
    if std::env::var_os("REDIS_CLUSTER_URLS").is_some() {
        return true;
    }
    assert!(
        !test_support::env::strict(),
        "IDEMPOTENCY_TESTS_STRICT is set but REDIS_CLUSTER_URLS is not"
    );
    eprintln!("skipped: REDIS_CLUSTER_URLS is not set (this test needs redis-server)");
    false
}

impl<P> ProxiedCluster<P> {
    /// Starts the nodes, each behind the proxy `proxy(node)` makes (the proxy and where it
    /// listens), and makes them one cluster; `name` names its folder.
    pub(crate) async fn start<F, Fut>(name: &str, mut proxy: F) -> Self
    where
        F: FnMut(SocketAddr) -> Fut,
        Fut: Future<Output = (P, SocketAddr)>,
    {
        let dir = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cluster = ProxiedCluster {
            nodes: Vec::new(),
            dir,
            proxies: Vec::new(),
            addrs: Vec::new(),
        };
        let mut node_addrs = Vec::new();
        for i in 0..3 {
            let (port, bus) = (free_port(), free_port());
            let (p, addr) = proxy(SocketAddr::from(([127, 0, 0, 1], port))).await;
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--cluster-port",
                    &bus.to_string(),
                ])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                .args(["--cluster-config-file", &format!("nodes-{i}.conf")])
                .args(["--cluster-announce-ip", "127.0.0.1"])
                .args(["--cluster-announce-port", &addr.port().to_string()])
                .args(["--cluster-announce-bus-port", &bus.to_string()])
                .current_dir(&cluster.dir)
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            cluster.nodes.push(child);
            cluster.proxies.push(p);
            cluster.addrs.push(addr);
            node_addrs.push(format!("127.0.0.1:{port}"));
        }
        for addr in &node_addrs {
            wait::until_async(
                Duration::from_secs(10),
                &format!("cluster node {addr} listens"),
                || async { TcpStream::connect(addr.as_str()).await.is_ok() },
            )
            .await;
        }
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&node_addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .output()
            .expect("redis-cli is installed");
        assert!(
            created.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&created.stderr)
        );
        wait::until(
            "every node of the test's cluster says cluster_state:ok",
            || {
                node_addrs.iter().all(|addr| {
                    let info = Command::new("redis-cli")
                        .args(["-u", &format!("redis://{addr}"), "cluster", "info"])
                        .output()
                        .unwrap();
                    String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok")
                })
            },
        )
        .await;
        cluster
    }

    /// The proxies' URLs: where a cluster client starts.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.addrs.iter().map(|a| format!("redis://{a}")).collect()
    }
}

//! A TCP proxy between a store client (Redis, PostgreSQL) and its server that can be cut and
//! restored: the store outage of the chaos soak and the store tests.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A cuttable proxy. Cut: every open connection is closed and new ones are closed at once;
/// restored: new connections are relayed again. Held: every open connection stops relaying but
/// stays open (half-open, as behind a dead NAT entry: no reset ever comes), new ones are relayed.
/// Stops when dropped.
#[derive(Debug)]
pub struct CutProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    hold: Arc<tokio::sync::Notify>,
    cuts: AtomicUsize,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl CutProxy {
    /// Starts a proxy on 127.0.0.1:0 to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> CutProxy {
        let upstream = tokio::net::lookup_host(upstream)
            .await
            .expect("resolve upstream")
            .next()
            .expect("an upstream address");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(AtomicBool::new(false));
        let hold = Arc::new(tokio::sync::Notify::new());
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (cut, hold, conns) = (cut.clone(), hold.clone(), conns.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((mut client, _)) = listener.accept().await else {
                        return;
                    };
                    if cut.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let held = hold.clone().notified_owned();
                    let task = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(upstream).await {
                            tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                                // Held: relay nothing more, close nothing.
                                _ = held => std::future::pending::<()>().await,
                            }
                        }
                    });
                    let mut conns = conns.lock().unwrap();
                    conns.retain(|c| !c.is_finished());
                    conns.push(task);
                }
            })
        };
        CutProxy {
            addr,
            cut,
            hold,
            cuts: AtomicUsize::new(0),
            conns,
            accept,
        }
    }

    /// Where store clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection and refuses new ones until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.cuts.fetch_add(1, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// Every open connection stops relaying and stays open (half-open); new connections are
    /// relayed as before.
    pub fn hold(&self) {
        self.hold.notify_waiters();
    }

    /// Relays new connections again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// How many times the proxy was cut.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

/// The `host:port` of a URL such as `redis://127.0.0.1:6379/0` or `postgres://u@h:5432/db`.
pub fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    rest.rsplit_once('@').map_or(rest, |(_, hp)| hp)
}

/// `url` with its `host:port` replaced by `addr`.
pub fn via(url: &str, addr: SocketAddr) -> String {
    url.replacen(authority(url), &addr.to_string(), 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authority_and_via() {
        assert_eq!(authority("redis://127.0.0.1:6379/0"), "127.0.0.1:6379");
        assert_eq!(authority("postgres://u@h:5432/db?x=1"), "h:5432");
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(
            via("postgres://u@h:5432/db", addr),
            "postgres://u@127.0.0.1:1/db"
        );
    }
}

//! A TCP fault proxy between a client and its server, in Toxiproxy's model: what the store
//! tests and the chaos runs put in front of Redis, Sentinel, PostgreSQL, PgBouncer and a
//! standby's replication link.
//!
//! Each fault is switched on and off while connections are open, and acts on them at once:
//!
//! | fault | what the client sees |
//! |---|---|
//! | [`latency`](FaultProxy::latency) | every chunk one way arrives that much later |
//! | [`hold_replies`](FaultProxy::hold_replies) | requests reach the server and run; their replies stop at the proxy until [`release_replies`](FaultProxy::release_replies) |
//! | [`throttle`](FaultProxy::throttle) | a slow reader: at most so many bytes a second one way, the rest waits in the sender's socket buffers |
//! | [`reset`](FaultProxy::reset) | every open connection is reset (RST, not FIN); new ones are relayed |
//! | [`half_open`](FaultProxy::half_open) | every open connection stops relaying and stays open, no FIN or RST ever comes (a dead NAT entry); new ones are relayed |
//! | [`cut`](FaultProxy::cut) | every open connection is reset and new ones are closed at once, until [`restore`](FaultProxy::restore) |
//!
//! ```no_run
//! # async fn demo() {
//! use std::time::Duration;
//! use test_support::fault_proxy::{via, Direction, FaultProxy};
//!
//! let proxy = FaultProxy::start("127.0.0.1:6379").await;
//! let url = via("redis://127.0.0.1:6379", proxy.addr());
//! proxy.latency(Direction::Replies, Duration::from_millis(50));
//! proxy.hold_replies();
//! // ... a command sent now runs on the server; its reply waits at the proxy.
//! proxy.release_replies();
//! proxy.clear();
//! # let _ = url;
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Which way a fault acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server: requests.
    Requests,
    /// Server to client: replies.
    Replies,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::Requests => 0,
            Direction::Replies => 1,
        }
    }
}

/// The faults in force, read by every relay at each chunk.
#[derive(Debug, Clone, Default)]
struct Faults {
    /// New connections are closed at once.
    refuse: bool,
    /// Connections numbered below this are reset.
    reset_below: u64,
    /// Connections numbered below this relay nothing more (half-open).
    frozen_below: u64,
    /// Per direction: each chunk is delayed this long.
    latency: [Duration; 2],
    /// Per direction: chunks read are held until this is cleared.
    held: [bool; 2],
    /// Per direction: at most this many bytes a second.
    rate: [Option<u64>; 2],
}

/// What the proxy did, for tests to check that a fault acted.
#[derive(Debug, Default)]
pub struct FaultStats {
    /// Connections accepted and relayed.
    pub relayed: AtomicU64,
    /// Connections reset by [`FaultProxy::reset`] or [`FaultProxy::cut`].
    pub resets: AtomicU64,
    /// Connections left half-open by [`FaultProxy::half_open`].
    pub frozen: AtomicU64,
    /// Connections closed at once because the proxy was cut.
    pub refused: AtomicU64,
    /// Chunks of replies that waited while replies were held.
    pub held_replies: AtomicU64,
}

/// A TCP proxy to one upstream whose faults are switched while it runs. Stops, and closes every
/// connection, when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    next_conn: Arc<AtomicU64>,
    stats: Arc<FaultStats>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1:0 to `upstream` (`host:port`), relaying faithfully.
    pub async fn start(upstream: &str) -> FaultProxy {
        let upstream = tokio::net::lookup_host(upstream)
            .await
            .expect("resolve upstream")
            .next()
            .expect("an upstream address");
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("addr");
        let (faults, _) = watch::channel(Faults::default());
        let next_conn = Arc::new(AtomicU64::new(0));
        let stats = Arc::new(FaultStats::default());
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (faults, next_conn, stats, conns) = (
                faults.clone(),
                next_conn.clone(),
                stats.clone(),
                conns.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    if faults.borrow().refuse {
                        stats.refused.fetch_add(1, Ordering::Relaxed);
                        reset_now(&client);
                        drop(client);
                        continue;
                    }
                    let id = next_conn.fetch_add(1, Ordering::SeqCst);
                    let task = tokio::spawn(connection(
                        id,
                        client,
                        upstream,
                        faults.subscribe(),
                        stats.clone(),
                    ));
                    let mut conns = conns.lock().unwrap();
                    conns.retain(|c| !c.is_finished());
                    conns.push(task);
                }
            })
        };
        FaultProxy {
            addr,
            faults,
            next_conn,
            stats,
            conns,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the proxy did so far.
    pub fn stats(&self) -> &FaultStats {
        &self.stats
    }

    /// Every chunk going `direction` is delayed by `by` (zero: none), open connections included.
    pub fn latency(&self, direction: Direction, by: Duration) {
        self.faults
            .send_modify(|f| f.latency[direction.index()] = by);
    }

    /// Replies stop at the proxy (requests still reach the server and run), until
    /// [`release_replies`](Self::release_replies) delivers them in order.
    pub fn hold_replies(&self) {
        self.faults.send_modify(|f| f.held[1] = true);
    }

    /// Delivers the held replies, and relays replies again.
    pub fn release_replies(&self) {
        self.faults.send_modify(|f| f.held[1] = false);
    }

    /// A slow reader: at most `bytes_per_sec` go `direction`, in slices every 50 ms; the rest
    /// waits in the sender's socket buffers (`None`: no limit).
    pub fn throttle(&self, direction: Direction, bytes_per_sec: Option<u64>) {
        self.faults
            .send_modify(|f| f.rate[direction.index()] = bytes_per_sec);
    }

    /// Resets (RST) every open connection, both sides; new connections are relayed.
    pub fn reset(&self) {
        let below = self.next_conn.load(Ordering::SeqCst);
        self.faults.send_modify(|f| f.reset_below = below);
    }

    /// Every open connection stops relaying and stays open, forever (no FIN, no RST: as behind
    /// a dead NAT entry); new connections are relayed.
    pub fn half_open(&self) {
        let below = self.next_conn.load(Ordering::SeqCst);
        self.faults.send_modify(|f| f.frozen_below = below);
    }

    /// Resets every open connection and closes new ones at once until
    /// [`restore`](Self::restore).
    pub fn cut(&self) {
        let below = self.next_conn.load(Ordering::SeqCst);
        self.faults.send_modify(|f| {
            f.refuse = true;
            f.reset_below = below;
        });
    }

    /// Relays new connections again after a [`cut`](Self::cut).
    pub fn restore(&self) {
        self.faults.send_modify(|f| f.refuse = false);
    }

    /// Ends every fault that is switched on (latency, held replies, throttles, a cut); open
    /// connections left half-open stay so.
    pub fn clear(&self) {
        self.faults.send_modify(|f| {
            f.refuse = false;
            f.latency = [Duration::ZERO; 2];
            f.held = [false; 2];
            f.rate = [None; 2];
        });
    }
}

/// One fault of a link, as the store tests and the chaos runs inflict it in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFault {
    /// 100 ms each way, on every chunk.
    Latency,
    /// Requests reach the server and run; their replies wait at the proxy, then arrive.
    HeldReplies,
    /// A slow reader: replies at 2 KB/s.
    SlowReader,
    /// Every open connection reset.
    Reset,
    /// Every open connection silent and open, forever.
    HalfOpen,
    /// Every open connection reset, and new ones refused.
    Cut,
}

impl LinkFault {
    /// Every fault, in the order they are inflicted in turn: those that leave a command's
    /// outcome unknown first.
    pub const ALL: [LinkFault; 6] = [
        LinkFault::HalfOpen,
        LinkFault::HeldReplies,
        LinkFault::Reset,
        LinkFault::Cut,
        LinkFault::SlowReader,
        LinkFault::Latency,
    ];

    /// The short name reports use.
    pub fn name(self) -> &'static str {
        match self {
            LinkFault::Latency => "latency",
            LinkFault::HeldReplies => "held replies",
            LinkFault::SlowReader => "slow reader",
            LinkFault::Reset => "reset",
            LinkFault::HalfOpen => "half-open",
            LinkFault::Cut => "cut",
        }
    }
}

impl FaultProxy {
    /// Inflicts `fault` on the proxy's link for `lasting` (a reset or a half-open acts at
    /// once, on the connections open then), then clears it: the proxy relays again, apart from
    /// the connections left half-open.
    pub async fn inflict(&self, fault: LinkFault, lasting: Duration) {
        match fault {
            LinkFault::Latency => {
                self.latency(Direction::Requests, Duration::from_millis(100));
                self.latency(Direction::Replies, Duration::from_millis(100));
            }
            LinkFault::HeldReplies => self.hold_replies(),
            LinkFault::SlowReader => self.throttle(Direction::Replies, Some(2_000)),
            LinkFault::Reset => self.reset(),
            LinkFault::HalfOpen => self.half_open(),
            LinkFault::Cut => self.cut(),
        }
        if !matches!(fault, LinkFault::Reset | LinkFault::HalfOpen) {
            tokio::time::sleep(lasting).await;
        }
        self.clear();
    }
}

/// Closes with a reset rather than a FIN when dropped.
fn reset_now(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Relays one connection under the faults in force.
async fn connection(
    id: u64,
    mut client: TcpStream,
    upstream: SocketAddr,
    mut faults: watch::Receiver<Faults>,
    stats: Arc<FaultStats>,
) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        reset_now(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    stats.relayed.fetch_add(1, Ordering::Relaxed);
    let mut reset = faults.clone();
    let mut frozen = faults.clone();
    {
        let (cr, cw) = client.split();
        let (sr, sw) = server.split();
        let relay = async {
            let _ = tokio::try_join!(
                pump(cr, sw, Direction::Requests, faults.clone(), &stats),
                pump(sr, cw, Direction::Replies, faults.clone(), &stats),
            );
        };
        tokio::select! {
            // Both ways done (or one failed): the streams close normally.
            () = relay => return,
            () = until(&mut reset, |f| f.reset_below > id) => {}
            () = until(&mut frozen, |f| f.frozen_below > id) => {
                stats.frozen.fetch_add(1, Ordering::Relaxed);
                // Nothing more is relayed and nothing closes, until a reset or a cut.
                until(&mut faults, |f| f.reset_below > id).await;
            }
        }
    }
    stats.resets.fetch_add(1, Ordering::Relaxed);
    reset_now(&client);
    reset_now(&server);
}

/// Until the faults satisfy `cond` (never, once the proxy is gone: it aborts its connections).
async fn until(faults: &mut watch::Receiver<Faults>, cond: impl FnMut(&Faults) -> bool) {
    if faults.wait_for(cond).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Relays one direction chunk by chunk, each delivered under the faults in force when it was
/// read; at the end of the input, the output is shut down (a FIN passes through).
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    direction: Direction,
    mut faults: watch::Receiver<Faults>,
    stats: &FaultStats,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let d = direction.index();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // A throttled direction reads no more than one slice at a time: the rest stays in the
        // sender's buffers, as with a slow reader.
        let rate = faults.borrow().rate[d];
        let want = rate.map_or(buf.len(), |r| slice_len(r).min(buf.len()));
        let n = from.read(&mut buf[..want]).await?;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        let mut counted_hold = false;
        let f = loop {
            let f = faults.borrow_and_update().clone();
            if !f.held[d] {
                break f;
            }
            if !counted_hold {
                counted_hold = true;
                stats.held_replies.fetch_add(1, Ordering::Relaxed);
            }
            if faults.changed().await.is_err() {
                return Ok(());
            }
        };
        if !f.latency[d].is_zero() {
            tokio::time::sleep(f.latency[d]).await;
        }
        match f.rate[d] {
            None => to.write_all(&buf[..n]).await?,
            Some(r) => {
                for slice in buf[..n].chunks(slice_len(r)) {
                    to.write_all(slice).await?;
                    tokio::time::sleep(THROTTLE_TICK).await;
                }
            }
        }
    }
}

/// A throttled direction moves one slice per tick.
const THROTTLE_TICK: Duration = Duration::from_millis(50);

fn slice_len(bytes_per_sec: u64) -> usize {
    ((bytes_per_sec as f64 * THROTTLE_TICK.as_secs_f64()) as usize).max(1)
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
    use std::io::ErrorKind;

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

    /// An echo server that counts the bytes it received.
    async fn echo() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(AtomicU64::new(0));
        let r = received.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let r = r.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        r.fetch_add(n as u64, Ordering::SeqCst);
                        if s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, received)
    }

    async fn proxy_to_echo() -> (FaultProxy, Arc<AtomicU64>) {
        let (addr, received) = echo().await;
        (FaultProxy::start(&addr.to_string()).await, received)
    }

    async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).await?;
        Ok(back)
    }

    /// Bounded: a fault under test must not hang the test.
    async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("within 10 s")
    }

    #[tokio::test]
    async fn relays_faithfully_until_a_fault_is_set() {
        let (proxy, _) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(within(round_trip(&mut s, b"ping")).await.unwrap(), b"ping");
        assert_eq!(proxy.stats().relayed.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn held_replies_arrive_after_the_request_ran() {
        let (proxy, received) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        within(round_trip(&mut s, b"warm")).await.unwrap();
        proxy.hold_replies();
        s.write_all(b"held").await.unwrap();
        // The request reaches the server ...
        crate::wait::until("the held request reached the server", || {
            received.load(Ordering::SeqCst) >= 8
        })
        .await;
        // ... its reply does not reach the client.
        let mut back = [0u8; 4];
        let early = tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut back)).await;
        assert!(early.is_err(), "a held reply was delivered: {early:?}");
        assert!(proxy.stats().held_replies.load(Ordering::SeqCst) >= 1);
        proxy.release_replies();
        within(s.read_exact(&mut back)).await.unwrap();
        assert_eq!(&back, b"held");
    }

    #[tokio::test]
    async fn reset_sends_a_reset_and_new_connections_are_relayed() {
        let (proxy, _) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        within(round_trip(&mut s, b"a")).await.unwrap();
        proxy.reset();
        let mut buf = [0u8; 1];
        let e = within(s.read(&mut buf)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
        let mut t = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(within(round_trip(&mut t, b"b")).await.unwrap(), b"b");
        assert_eq!(proxy.stats().resets.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn half_open_relays_nothing_and_closes_nothing() {
        let (proxy, received) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        within(round_trip(&mut s, b"a")).await.unwrap();
        proxy.half_open();
        crate::wait::until("the open connection is frozen", || {
            proxy.stats().frozen.load(Ordering::SeqCst) >= 1
        })
        .await;
        s.write_all(b"lost").await.unwrap();
        let mut buf = [0u8; 4];
        let r = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await;
        assert!(r.is_err(), "a half-open connection answered: {r:?}");
        assert_eq!(
            received.load(Ordering::SeqCst),
            1,
            "nothing reached the server"
        );
        // A new connection is relayed.
        let mut t = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(within(round_trip(&mut t, b"b")).await.unwrap(), b"b");
    }

    #[tokio::test]
    async fn cut_refuses_until_restored() {
        let (proxy, _) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        within(round_trip(&mut s, b"a")).await.unwrap();
        proxy.cut();
        assert!(within(round_trip(&mut s, b"b")).await.is_err());
        let mut t = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(within(round_trip(&mut t, b"c")).await.is_err());
        proxy.restore();
        let mut u = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(within(round_trip(&mut u, b"d")).await.unwrap(), b"d");
    }

    #[tokio::test]
    async fn latency_delays_each_chunk() {
        let (proxy, _) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.latency(Direction::Replies, Duration::from_secs(2));
        s.write_all(b"slow").await.unwrap();
        let mut back = [0u8; 4];
        let early = tokio::time::timeout(Duration::from_millis(200), s.read_exact(&mut back)).await;
        assert!(early.is_err(), "a delayed reply came early: {early:?}");
        within(s.read_exact(&mut back)).await.unwrap();
        assert_eq!(&back, b"slow");
        proxy.clear();
        assert_eq!(within(round_trip(&mut s, b"fast")).await.unwrap(), b"fast");
    }

    #[tokio::test]
    async fn a_throttled_reply_arrives_in_slices() {
        let (proxy, _) = proxy_to_echo().await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        // 2 000 bytes a second: 100-byte slices, one every 50 ms.
        proxy.throttle(Direction::Replies, Some(2_000));
        s.write_all(&[7u8; 1000]).await.unwrap();
        let (mut got, mut reads, mut largest) = (Vec::new(), 0, 0);
        while got.len() < 1000 {
            let mut buf = [0u8; 4096];
            let n = within(s.read(&mut buf)).await.unwrap();
            assert!(n > 0, "closed early");
            got.extend_from_slice(&buf[..n]);
            reads += 1;
            largest = largest.max(n);
        }
        assert_eq!(got, vec![7u8; 1000]);
        assert!(largest <= 100, "a read of {largest} bytes: not throttled");
        assert!(reads >= 10, "{reads} reads");
    }
}

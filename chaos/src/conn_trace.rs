//! The client's side of each connection the soak's hyper-util clients make: its local port
//! (the fault proxy sees it as the peer), the bytes it wrote and read, whether it read the end
//! of the stream, and whether hyper still holds it. A watchdog report lists the connections
//! still held when an attempt is stuck (a stranded request).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tower::Service;

/// What the client saw of one connection.
#[derive(Debug)]
struct ConnInfo {
    id: u64,
    port: u16,
    opened: Instant,
    written: AtomicU64,
    read: AtomicU64,
    eof: AtomicBool,
    write_error: AtomicBool,
    shutdown: AtomicBool,
}

/// How many dropped connections [`ConnLog`] remembers.
const DROPPED_KEPT: usize = 100_000;

/// The connections hyper still holds, by id, and when the last ones it dropped were dropped.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnLog {
    held: Arc<Mutex<BTreeMap<u64, Arc<ConnInfo>>>>,
    dropped: Arc<Mutex<BTreeMap<u64, Instant>>>,
    next: Arc<AtomicU64>,
}

impl ConnLog {
    /// True when hyper still holds the connection `id`.
    pub(crate) fn holds(&self, id: u64) -> bool {
        self.held.lock().unwrap().contains_key(&id)
    }

    /// When hyper dropped the connection `id` (its IO), if it has.
    pub(crate) fn dropped_at(&self, id: u64) -> Option<Instant> {
        self.dropped.lock().unwrap().get(&id).copied()
    }

    /// Every connection hyper holds now, one line each.
    pub(crate) fn report(&self) -> String {
        let now = Instant::now();
        let held = self.held.lock().unwrap();
        let mut out = format!("{} client connections held\n", held.len());
        for c in held.values() {
            out.push_str(&format!(
                "client connection {} from port {}: opened {:?} ago, {} bytes written, {} read, end of stream read: {}, write failed: {}, shut down: {}\n",
                c.id,
                c.port,
                now - c.opened,
                c.written.load(Ordering::Relaxed),
                c.read.load(Ordering::Relaxed),
                c.eof.load(Ordering::Relaxed),
                c.write_error.load(Ordering::Relaxed),
                c.shutdown.load(Ordering::Relaxed),
            ));
        }
        out
    }
}

/// An `HttpConnector` whose connections are logged in a [`ConnLog`].
#[derive(Debug, Clone)]
pub(crate) struct TracedConnector {
    inner: HttpConnector,
    log: ConnLog,
}

impl TracedConnector {
    pub(crate) fn new(log: ConnLog) -> Self {
        TracedConnector {
            inner: HttpConnector::new(),
            log,
        }
    }
}

type ConnectFuture = Pin<
    Box<
        dyn Future<Output = Result<TokioIo<TracedIo>, Box<dyn std::error::Error + Send + Sync>>>
            + Send,
    >,
>;

impl Service<Uri> for TracedConnector {
    type Response = TokioIo<TracedIo>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connect = self.inner.call(uri);
        let log = self.log.clone();
        Box::pin(async move {
            let io = connect.await?.into_inner();
            let port = io.local_addr().map_or(0, |a| a.port());
            let id = log.next.fetch_add(1, Ordering::Relaxed);
            let info = Arc::new(ConnInfo {
                id,
                port,
                opened: Instant::now(),
                written: AtomicU64::new(0),
                read: AtomicU64::new(0),
                eof: AtomicBool::new(false),
                write_error: AtomicBool::new(false),
                shutdown: AtomicBool::new(false),
            });
            log.held.lock().unwrap().insert(id, info.clone());
            tracing::trace!("conn {id} (port {port}) connected");
            Ok(TokioIo::new(TracedIo { io, info, log, id }))
        })
    }
}

/// A connection whose reads, writes and end are logged; removed from the log when hyper drops
/// it.
#[derive(Debug)]
pub(crate) struct TracedIo {
    io: TcpStream,
    info: Arc<ConnInfo>,
    log: ConnLog,
    id: u64,
}

impl Drop for TracedIo {
    fn drop(&mut self) {
        self.log.held.lock().unwrap().remove(&self.id);
        let mut dropped = self.log.dropped.lock().unwrap();
        if dropped.len() >= DROPPED_KEPT {
            dropped.pop_first();
        }
        dropped.insert(self.id, Instant::now());
        let (id, port) = (self.id, self.info.port);
        tracing::trace!("conn {id} (port {port}) dropped by hyper");
    }
}

/// The connection a request went out on (its id in the [`ConnLog`] and its local port), as
/// `Connected` extra data.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnTag {
    pub(crate) id: u64,
    pub(crate) port: u16,
}

impl Connection for TracedIo {
    fn connected(&self) -> Connected {
        self.io.connected().extra(ConnTag {
            id: self.id,
            port: self.info.port,
        })
    }
}

impl AsyncRead for TracedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &result {
            let n = buf.filled().len() - before;
            if n == 0 && buf.remaining() > 0 && !this.info.eof.swap(true, Ordering::Relaxed) {
                let id = this.id;
                tracing::trace!("conn {id} read the end of stream");
            }
            this.info.read.fetch_add(n as u64, Ordering::Relaxed);
        }
        if let Poll::Ready(Err(e)) = &result {
            let id = this.id;
            tracing::trace!("conn {id} read failed: {e}");
        }
        result
    }
}

impl AsyncWrite for TracedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        match &result {
            Poll::Ready(Ok(n)) => {
                this.info.written.fetch_add(*n as u64, Ordering::Relaxed);
            }
            Poll::Ready(Err(e)) => {
                if !this.info.write_error.swap(true, Ordering::Relaxed) {
                    let id = this.id;
                    tracing::trace!("conn {id} write failed: {e}");
                }
            }
            Poll::Pending => {}
        }
        result
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.info.shutdown.swap(true, Ordering::Relaxed) {
            let id = this.id;
            tracing::trace!("conn {id} shut down by hyper");
        }
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

//! A request hyper's client strands, reproduced with hyper, hyper-util and tokio alone.
//!
//! A hyper-util legacy client (HTTP/2 only: one shared connection, as the soak's) sends POSTs
//! from many tasks to a hyper HTTP/2 server that drops a connection (closes its socket) after
//! 10 % of the requests, as the soak's fault proxy does. The runtime has more worker threads
//! than the machine has cores, so the OS preempts workers at arbitrary instructions; that
//! widens the window of the race below, which the soak hits about once per 100 000 calls.
//!
//! A request that has no answer after `--wait` seconds is reported with the connection
//! hyper-util handed it, whether hyper had dropped that connection's socket, whether hyper's
//! connection task ever took the request (it looks at the body before h2 opens a stream),
//! and whether the request outlived its own response future. A request stranded in the
//! connection's dispatch channel is never taken, its connection is gone, and it is dropped
//! only when the last sender of that channel goes: the response futures of the requests
//! stranded with it hold those senders (hyper-util's `Pooled`), so it waits forever unless
//! the caller gives up.
//!
//! The race: hyper's HTTP/2 connection task drops its request receiver when the connection
//! ends (hyper 1.12.0 src/proto/h2/client.rs:782-790, dispatch.rs:215-221), counting on the
//! tokio channel's drop to drop, and so answer ("connection closed"), every queued request
//! (dispatch.rs:225-233). tokio's unbounded send is two steps, a count then a write of the
//! slot (tokio 1.54.1 src/sync/mpsc/unbounded.rs:559-566); the receiver's drop drains only up
//! to the first slot not written yet (chan.rs:503-545, list.rs:326-355), so a send caught
//! between the two steps, and every message behind it, stays in the channel until the last
//! sender is dropped (chan.rs:576-589). hyper-util's legacy client keeps a sender (the
//! `Pooled` connection) alive while it awaits the answer (hyper-util 0.1.21
//! src/client/legacy/client.rs:279-359).
//!
//! ```text
//! cargo run --release --manifest-path repro/hyper-dispatch-race/Cargo.toml -- \
//!     --secs 180 --workers 8 --tasks 32 [--keep-alive]
//! ```

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::{
    capture_connection, Connected, Connection, HttpConnector,
};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

/// What became of one request inside hyper.
#[derive(Default)]
struct Watch {
    /// hyper's connection task looked at the body (`size_hint`, `is_end_stream`).
    taken: AtomicBool,
    /// When the request (its body) was dropped.
    dropped: Mutex<Option<Instant>>,
}

/// A request body that tells its [`Watch`] when hyper takes it and when it is dropped.
struct Watched {
    inner: Full<Bytes>,
    watch: Arc<Watch>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        *self.watch.dropped.lock().unwrap() = Some(Instant::now());
    }
}

impl Body for Watched {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.watch.taken.store(true, SeqCst);
        Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.watch.taken.store(true, SeqCst);
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.watch.taken.store(true, SeqCst);
        self.inner.size_hint()
    }
}

/// The connections whose socket hyper has dropped, by id.
static SOCKETS_DROPPED: Mutex<Vec<u64>> = Mutex::new(Vec::new());
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

/// A connection's id, as `Connected` extra data (read back through `capture_connection`).
#[derive(Clone, Copy)]
struct ConnectionId(u64);

/// A socket that notes when hyper drops it.
struct TaggedIo {
    inner: TokioIo<tokio::net::TcpStream>,
    id: u64,
}

impl Drop for TaggedIo {
    fn drop(&mut self) {
        SOCKETS_DROPPED.lock().unwrap().push(self.id);
    }
}

impl Connection for TaggedIo {
    fn connected(&self) -> Connected {
        Connected::new().extra(ConnectionId(self.id))
    }
}

impl hyper::rt::Read for TaggedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TaggedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// `HttpConnector`, with an id for each connection.
#[derive(Clone)]
struct Tagging(HttpConnector);

impl tower_service::Service<Uri> for Tagging {
    type Response = TaggedIo;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<TaggedIo, Self::Error>> + Send>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }
    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            let id = NEXT_CONNECTION.fetch_add(1, SeqCst);
            Ok(TaggedIo { inner: io, id })
        })
    }
}

/// An HTTP/2 server that answers every request, except that after `drop_p` of them it drops
/// the whole connection (closes its socket) without answering.
async fn server(listener: tokio::net::TcpListener, drop_p: f64) {
    loop {
        let (io, _) = listener.accept().await.expect("accept");
        let _ = io.set_nodelay(true);
        tokio::spawn(async move {
            let (cut_tx, mut cut_rx) = tokio::sync::mpsc::channel::<()>(1);
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let cut = cut_tx.clone();
                async move {
                    let _ = req.into_body().collect().await;
                    if fastrand::f64() < drop_p {
                        let _ = cut.try_send(());
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }
            });
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(io), svc);
            tokio::select! {
                _ = conn => {}
                _ = cut_rx.recv() => {}
            }
        });
    }
}

struct Options {
    secs: u64,
    workers: usize,
    tasks: usize,
    wait: u64,
    keep_alive: bool,
}

fn options() -> Options {
    let mut o = Options {
        secs: 180,
        workers: 8,
        tasks: 32,
        wait: 20,
        keep_alive: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = || -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{a} takes a number"))
        };
        match a.as_str() {
            "--secs" => o.secs = num(),
            "--workers" => o.workers = num() as usize,
            "--tasks" => o.tasks = num() as usize,
            "--wait" => o.wait = num(),
            "--keep-alive" => o.keep_alive = true,
            _ => {
                eprintln!(
                    "usage: hyper-dispatch-race [--secs 180] [--workers 8] [--tasks 32] [--wait 20] [--keep-alive]\n\
                     --keep-alive: HTTP/2 PING every 10 s (5 s to answer, also while idle) and a 5 s pool idle timeout"
                );
                std::process::exit(2);
            }
        }
    }
    o
}

fn main() {
    let o = options();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.workers)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run(o));
}

async fn run(o: Options) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(server(listener, 0.10));
    let mut builder = Client::builder(TokioExecutor::new());
    builder.http2_only(true);
    if o.keep_alive {
        builder
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Some(Duration::from_secs(10)))
            .http2_keep_alive_timeout(Duration::from_secs(5))
            .http2_keep_alive_while_idle(true);
    }
    let client: Client<Tagging, Watched> = builder.build(Tagging(HttpConnector::new()));
    let (answered, failed, unanswered) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let stop = Instant::now() + Duration::from_secs(o.secs);
    let wait = Duration::from_secs(o.wait);
    let mut tasks = Vec::new();
    for t in 0..o.tasks {
        let client = client.clone();
        let (answered, failed, unanswered) = (answered.clone(), failed.clone(), unanswered.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < stop {
                n += 1;
                let watch = Arc::new(Watch::default());
                let mut req = Request::post(format!("http://{addr}/op"))
                    .body(Watched {
                        inner: Full::new(Bytes::from(format!("op {t} {n}"))),
                        watch: watch.clone(),
                    })
                    .expect("request");
                let captured = capture_connection(&mut req);
                let response = client.request(req);
                tokio::pin!(response);
                let answer = tokio::select! {
                    r = &mut response => Some(r),
                    _ = tokio::time::sleep(wait) => None,
                };
                match answer {
                    Some(Ok(res)) => {
                        let _ = res.into_body().collect().await;
                        answered.fetch_add(1, SeqCst);
                    }
                    Some(Err(_)) => {
                        failed.fetch_add(1, SeqCst);
                    }
                    None => {
                        unanswered.fetch_add(1, SeqCst);
                        let connection = captured.connection_metadata().as_ref().map(|c| {
                            let mut ext = http::Extensions::new();
                            c.get_extras(&mut ext);
                            ext.get::<ConnectionId>().map_or(0, |c| c.0)
                        });
                        let socket_dropped = connection
                            .map(|id| SOCKETS_DROPPED.lock().unwrap().contains(&id));
                        let taken = watch.taken.load(SeqCst);
                        let pending_dropped = watch.dropped.lock().unwrap().is_some();
                        // Give up on it, as a caller's timeout does: this drops hyper-util's
                        // `Pooled`, one sender of the connection's dispatch channel.
                        let gave_up = Instant::now();
                        drop(response);
                        tokio::spawn(async move {
                            while watch.dropped.lock().unwrap().is_none()
                                && gave_up.elapsed() < Duration::from_secs(300)
                            {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            let dropped = *watch.dropped.lock().unwrap();
                            eprintln!(
                                "task {t} request {n}: no answer in {wait:?}; handed connection {connection:?}, whose socket hyper {}; request taken by hyper's connection task: {taken}; request dropped while its response future was pending: {pending_dropped}; request dropped {} after the caller gave up",
                                match socket_dropped {
                                    Some(true) => "had dropped",
                                    Some(false) => "still held",
                                    None => "(none handed)",
                                },
                                dropped.map_or("not within 300 s".to_owned(), |d| format!(
                                    "{:?}",
                                    d.saturating_duration_since(gave_up)
                                )),
                            );
                        });
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!(
        "{} s, {} worker threads, {} tasks, HTTP/2 keep-alive {}: answered {}, failed {}, no answer within {:?} {}",
        o.secs,
        o.workers,
        o.tasks,
        if o.keep_alive { "on" } else { "off" },
        answered.load(SeqCst),
        failed.load(SeqCst),
        wait,
        unanswered.load(SeqCst)
    );
}

//! hyper on turmoil's simulated network: a client connector that dials
//! `turmoil::net::TcpStream`, and a server loop that serves a tower service on a
//! `turmoil::net::TcpListener` with hyper-util's `auto` builder (HTTP/1.1 and h2c).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower_service::Service;

/// The port every simulated server listens on.
pub const PORT: u16 = 80;

/// A simulated TCP connection, as hyper-util's client wants it.
#[derive(Debug)]
pub struct SimStream(turmoil::net::TcpStream);

impl SimStream {
    /// An accepted connection.
    pub fn accepted((stream, _): (turmoil::net::TcpStream, std::net::SocketAddr)) -> SimStream {
        SimStream(stream)
    }
}

impl Connection for SimStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for SimStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Dials the URI's host (a turmoil host name) on its port over the simulated network.
#[derive(Clone, Copy, Debug, Default)]
pub struct SimConnector;

impl Service<Uri> for SimConnector {
    type Response = TokioIo<SimStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host in URI"))?
                .to_owned();
            let port = uri.port_u16().unwrap_or(PORT);
            let stream = turmoil::net::TcpStream::connect((host.as_str(), port)).await?;
            Ok(TokioIo::new(SimStream(stream)))
        })
    }
}

/// A server's drain request, from the driver: the server stops serving gracefully.
#[derive(Debug)]
pub struct DrainSignal(Option<tokio::sync::watch::Receiver<u64>>);

impl DrainSignal {
    /// The signal of a server whose drains `drains` counts; only a drain asked for after this
    /// is heard (a restarted server serves again).
    pub fn new(drains: &tokio::sync::watch::Sender<u64>) -> DrainSignal {
        DrainSignal(Some(drains.subscribe()))
    }

    /// The signal of a server that is never drained.
    pub fn never() -> DrainSignal {
        DrainSignal(None)
    }

    /// Resolves when a drain is asked for.
    pub async fn requested(&mut self) {
        if let Some(drains) = &mut self.0 {
            if drains.changed().await.is_ok() {
                return;
            }
        }
        // Never drained, or the driver is gone with the simulation: no drain will come.
        std::future::pending::<()>().await;
    }
}

/// Serves `service` on [`PORT`], one task per connection, HTTP/1.1 and HTTP/2 (prior
/// knowledge) both accepted, as `axum::serve` does over tokio's sockets, until the host crashes
/// or `drain` is asked for: then it stops accepting and shuts its connections down gracefully
/// (GOAWAY over HTTP/2; an HTTP/1.1 connection closes after its request in flight), and
/// returns when they have ended.
pub async fn serve<S, B>(
    service: S,
    mut drain: DrainSignal,
) -> Result<(), Box<dyn std::error::Error>>
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?;
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            biased;
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                let service = TowerToHyperService::new(service.clone());
                let conn = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            () = drain.requested() => break,
        }
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

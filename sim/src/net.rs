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

/// Serves `service` on [`PORT`] until the host crashes: one task per connection, HTTP/1.1 and
/// HTTP/2 (prior knowledge) both accepted, as `axum::serve` does over tokio's sockets.
pub async fn serve<S, B>(service: S) -> Result<(), Box<dyn std::error::Error>>
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
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

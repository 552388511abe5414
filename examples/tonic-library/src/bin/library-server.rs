//! `library-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]
//! [--shutdown-grace-ms N] [--metrics-listen ADDR] [--forward-to URL]`
//!
//! Prints exactly one line on stdout when ready: `listening on IP:PORT`. With `--forward-to`, it
//! is a gateway: a second hop that forwards every call (with the caller's idempotency key and
//! tenant) to the Library server at URL through a retrying channel. On SIGTERM (or Ctrl-C) it
//! drains: new writes are refused retryably, the writes in flight finish and store their
//! records within the grace, then it exits.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::cli::{init_tracing, ServerOpts};
use axum_orders::inventory::Inventory;
use axum_orders::shutdown::serve_until_signal;
use axum_orders::{metrics, server, store};
use clap::Parser;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_library::client::{connect_lazy, gateway_policy};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The plume.linkd.v3.Library gRPC service: writes run once per idempotency key.
#[derive(Debug, Parser)]
#[command(name = "library-server", version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    #[command(flatten)]
    opts: ServerOpts,
    /// On SIGTERM (or Ctrl-C), how long the writes in flight get to finish and store their
    /// records before the process exits, in milliseconds (new writes are refused at once).
    #[arg(long, default_value_t = 30_000)]
    shutdown_grace_ms: u64,
    /// Serve the layers' metrics in the Prometheus text format at http://ADDR/metrics.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Run as a gateway to the Library server at this URL instead of serving a Library.
    #[arg(long)]
    forward_to: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    init_tracing();
    let args = Args::parse();
    if let Some(addr) = args.metrics_listen {
        let handle = metrics::install()?;
        let (listener, _) = server::bind(addr).await?;
        tokio::spawn(server::serve(listener, metrics::routes(handle)));
    }
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let incoming = TcpListenerStream::new(listener);
    if let Some(url) = &args.forward_to {
        let (downstream, _layer) = connect_lazy(url, gateway_policy())?;
        println!("listening on {addr}");
        tonic_library::serve_gateway(downstream, incoming, axum_orders::shutdown::signal()).await?;
        return Ok(());
    }
    let inventory = Inventory::seeded(Duration::from_millis(args.opts.work_ms));
    let store = store::open(&args.opts.store).await?;
    let idempotency = tonic_library::idempotency(store);
    println!("listening on {addr}");
    let grace = Duration::from_millis(args.shutdown_grace_ms);
    serve_until_signal(idempotency.clone(), grace, |stop| async move {
        tonic_library::serve(inventory, idempotency, incoming, stop)
            .await
            .map_err(BoxError::from)
    })
    .await
}

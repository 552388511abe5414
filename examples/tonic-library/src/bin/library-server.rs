//! `library-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]`
//!
//! Prints exactly one line on stdout when ready: `listening on IP:PORT`.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::cli::{init_tracing, ServerOpts};
use axum_orders::inventory::Inventory;
use axum_orders::store;
use clap::Parser;
use tokio_stream::wrappers::TcpListenerStream;

/// The plume.linkd.v3.Library gRPC service: writes run once per idempotency key.
#[derive(Debug, Parser)]
#[command(name = "library-server", version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    #[command(flatten)]
    opts: ServerOpts,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    init_tracing();
    let args = Args::parse();
    let inventory = Inventory::seeded(Duration::from_millis(args.opts.work_ms));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let incoming = TcpListenerStream::new(listener);
    let store = store::open(&args.opts.store).await?;
    println!("listening on {addr}");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    tonic_library::serve(
        inventory,
        tonic_library::idempotency(store),
        incoming,
        shutdown,
    )
    .await?;
    Ok(())
}

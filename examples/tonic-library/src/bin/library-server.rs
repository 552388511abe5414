//! `library-server [--listen ADDR] [--store memory|redis://...|postgres://...] [--work-ms N]`
//!
//! Prints exactly one line on stdout when ready: `listening on IP:PORT`.

use std::net::SocketAddr;
use std::time::Duration;

use axum_orders::inventory::Inventory;
use axum_orders::store::StoreArg;
use clap::Parser;
use idempotency_layer::MemoryStore;
use tokio_stream::wrappers::TcpListenerStream;

/// The plume.linkd.v3.Library gRPC service: writes run once per idempotency key.
#[derive(Debug, Parser)]
#[command(name = "library-server", version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// The idempotency store: memory, redis://HOST:PORT or postgres://USER@HOST/DB.
    #[arg(long, default_value = "memory")]
    store: StoreArg,
    /// Make each write take this many milliseconds.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let inventory = Inventory::seeded(Duration::from_millis(args.work_ms));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let incoming = TcpListenerStream::new(listener);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match args.store {
        StoreArg::Memory => {
            println!("listening on {addr}");
            let layer = tonic_library::idempotency(MemoryStore::new());
            tonic_library::serve(inventory, layer, incoming, shutdown).await?;
        }
        other => return Err(format!("store {other:?} is not available in this build yet").into()),
    }
    Ok(())
}

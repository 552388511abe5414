//! What the example binaries share: their common options and the loop that sends `--count`
//! calls, `--concurrency` at a time.

use std::future::Future;
use std::process::ExitCode;

use futures_util::stream::{self, StreamExt};

use crate::store::StoreArg;

/// Options every example server takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerOpts {
    /// The idempotency store: memory, redis://HOST:PORT or postgres://USER@HOST/DB.
    #[arg(long, default_value = "memory")]
    pub store: StoreArg,
    /// Make each write take this many milliseconds (to show duplicates waiting).
    #[arg(long, default_value_t = 0)]
    pub work_ms: u64,
}

/// Options every example client takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientOpts {
    /// The tenant (x-tenant-id, read by the demo auth layer).
    #[arg(long, default_value = "public")]
    pub tenant: String,
    /// Use this idempotency key for every call (to demonstrate duplicates).
    #[arg(long)]
    pub key: Option<String>,
    /// How many calls to make.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// How many to make at once.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
}

impl ClientOpts {
    /// Makes `count` calls, `concurrency` at a time; each prints its own line and says whether
    /// it succeeded. The exit code is success when every call did.
    pub async fn make_calls<F, Fut>(&self, call: F) -> ExitCode
    where
        F: Fn() -> Fut,
        Fut: Future<Output = bool>,
    {
        let results: Vec<bool> = stream::iter(0..self.count)
            .map(|_| call())
            .buffer_unordered(self.concurrency.max(1))
            .collect()
            .await;
        if results.iter().all(|ok| *ok) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr (stdout carries the binaries' output), at `RUST_LOG` or `warn`.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

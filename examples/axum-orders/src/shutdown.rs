//! Graceful shutdown for the example servers, HTTP and gRPC alike: on SIGTERM (what a deploy
//! sends) or Ctrl-C, the server stops taking connections while the idempotency layer
//! [drains](IdempotencyLayer::drain): new writes are refused retryably, and the handlers running
//! finish and store their records within a grace. A process that exits between a side effect
//! and its record makes the client's retry run it again; the drain closes that window.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idempotency_layer::IdempotencyLayer;

/// The future a server is given to know when to stop taking connections.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How long the server gets, after the drain, to send its last responses before the process
/// goes on without it (a connection a client keeps open does not hold the process).
const LAST_RESPONSES: Duration = Duration::from_secs(1);

/// Runs `serve` (given the signal to stop taking connections) until SIGTERM or Ctrl-C, then
/// drains `idempotency` within `grace` and returns once the server is done (at most `grace`
/// and a second after the signal). A server that ends by itself first returns its result.
pub async fn serve_until_signal<St, F, Fut, E>(
    idempotency: IdempotencyLayer<St>,
    grace: Duration,
    serve: F,
) -> Result<(), E>
where
    St: Send + Sync + 'static,
    F: FnOnce(StopSignal) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: From<tokio::task::JoinError> + Send + 'static,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut serving = tokio::spawn(serve(Box::pin(async move {
        let _ = stopped.await;
    })));
    tokio::select! {
        served = &mut serving => return served?,
        () = signal() => {}
    }
    tracing::info!(
        ?grace,
        "shutting down: no new connections; draining the writes in flight"
    );
    let _ = stop.send(());
    let drained = idempotency.drain(grace).await;
    if drained.left > 0 {
        tracing::warn!(
            left = drained.left,
            "writes still in flight at the end of the grace"
        );
    }
    match tokio::time::timeout(LAST_RESPONSES, serving).await {
        Ok(served) => served?,
        Err(_) => Ok(()),
    }
}

/// SIGTERM or Ctrl-C, whichever comes first.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

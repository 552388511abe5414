//! The store's background tasks: the listening connection that wakes waiters and keeps the
//! near cache coherent, and the periodic cleanup of expired rows.

use super::*;

/// The payload prefix of a forgotten record's notification (then the scope in hex); any other
/// payload is a claim's end, for waiters.
pub(super) const FORGET_PREFIX: &str = "forget:";

pub(super) struct Listener {
    /// Dropped with the store: the listener task ends.
    pub(super) _stop: oneshot::Sender<()>,
}

pub(super) async fn cleanup_task(inner: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let store = PostgresStore { inner };
        match store.remove_expired().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(rows = n, "idempotency: removed expired rows"),
            Err(e) => {
                #[cfg(feature = "metrics")]
                metrics::counter!("idempotency_layer_store_cleanup_failures_total", "store" => "postgres")
                    .increment(1);
                tracing::warn!(
                    error = %e,
                    "idempotency: removing expired rows failed; the table grows until a later \
                     run succeeds (check the store's timeout and the role's DELETE privilege)"
                );
            }
        }
    }
}

/// Owns the store's listening connection: `LISTEN`s on the table's channel, wakes local
/// waiters on notifications, and reconnects when the connection is lost (waking every waiter,
/// so they poll for what they may have missed). Ends when the store is dropped.
pub(super) async fn listen_task<T>(
    config: tokio_postgres::Config,
    tls: T,
    channel: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<Arc<Near>>,
    mut stop: oneshot::Receiver<()>,
) where
    T: MakeTlsConnect<Socket> + Clone + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = tokio::select! {
            _ = &mut stop => return,
            c = tokio::time::timeout(timeout, config.connect(tls.clone())) => c,
        };
        if let Ok(Ok((client, mut connection))) = connected {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let driver = tokio::spawn(async move {
                let mut messages = futures_util::stream::poll_fn(|cx| connection.poll_message(cx));
                while let Some(m) = messages.next().await {
                    match m {
                        Ok(AsyncMessage::Notification(n)) => {
                            if tx.send(Some(n.payload().to_owned())).is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                let _ = tx.send(None);
            });
            let listened = tokio::time::timeout(
                timeout,
                client.batch_execute(&format!("LISTEN \"{channel}\"")),
            )
            .await;
            if matches!(listened, Ok(Ok(()))) {
                backoff = Duration::from_millis(50);
                // Anything that ended before the LISTEN took effect: let the waiters look.
                waiters.wake_all();
                if let Some(near) = &near {
                    near.set_live(true);
                }
                loop {
                    tokio::select! {
                        _ = &mut stop => {
                            driver.abort();
                            return;
                        }
                        m = rx.recv() => match m {
                            Some(Some(payload)) => match payload.strip_prefix(FORGET_PREFIX) {
                                Some(hex) => {
                                    if let Some(near) = &near {
                                        match scope_from_hex(hex) {
                                            Some(scope) => near.invalidate(&scope),
                                            None => {
                                                near.set_live(false);
                                                near.set_live(true);
                                            }
                                        }
                                    }
                                }
                                None => waiters.wake(&payload),
                            },
                            _ => break,
                        },
                    }
                }
                if let Some(near) = &near {
                    near.set_live(false);
                }
            }
            driver.abort();
            drop(client);
            tracing::debug!("idempotency: postgres listener connection lost; reconnecting");
        }
        waiters.wake_all();
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl PostgresStore {
    pub(super) fn listener(&self) -> &Listener {
        self.inner.listener.get_or_init(|| {
            let (stop, stop_rx) = oneshot::channel();
            let (config, channel) = (self.inner.config.clone(), self.inner.channel.clone());
            let (timeout, waiters) = (self.inner.timeout, self.inner.waiters.clone());
            let near = self.inner.near.clone();
            match &self.inner.tls {
                Connector::Plain => tokio::spawn(listen_task(
                    config, NoTls, channel, timeout, waiters, near, stop_rx,
                )),
                #[cfg(feature = "postgres-tls")]
                Connector::Rustls(t) => tokio::spawn(listen_task(
                    config,
                    t.clone(),
                    channel,
                    timeout,
                    waiters,
                    near,
                    stop_rx,
                )),
            };
            Listener { _stop: stop }
        })
    }
}

//! The store's background tasks: the listening connection that wakes waiters and keeps the
//! near cache coherent, and the periodic cleanup of expired rows.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, NoTls, Socket};

use crate::store::near_cache::scope_from_hex;

use super::{Connector, FORGET_PREFIX};
use super::{Inner, PostgresStore, DEAF, HEARS};

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

/// How often the listener proves it hears: a notification the store sends itself.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// The payload prefix of the listener's heartbeat (then a number).
const HEARTBEAT_PREFIX: &str = "heartbeat:";

/// Owns the store's listening connection: `LISTEN`s on the table's channel, wakes local
/// waiters on notifications, and reconnects when the connection is lost (waking every waiter,
/// so they poll for what they may have missed). Every [`HEARTBEAT_EVERY`] it sends a
/// notification through the store's pool and must hear it within twice the store's timeout:
/// until it does, and whenever it misses one, the listener counts as deaf (the near cache is
/// off; waiters poll). A listener behind a pooler in transaction mode is deaf for good. Ends
/// when the store is dropped.
pub(super) async fn listen_task<T>(store: Weak<Inner>, tls: T, mut stop: oneshot::Receiver<()>)
where
    T: MakeTlsConnect<Socket> + Clone + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let Some((Some(config), channel, timeout, waiters, near)) = store.upgrade().map(|i| {
        (
            i.listen_config.clone(),
            i.channel.clone(),
            i.timeout,
            i.waiters.clone(),
            i.near.clone(),
        )
    }) else {
        return;
    };
    let deaf = |store: &Weak<Inner>, why: &str| {
        if let Some(inner) = store.upgrade() {
            if inner.hears.swap(DEAF, Ordering::Relaxed) == HEARS || why == "never" {
                tracing::warn!(
                    channel = %channel,
                    "idempotency: the postgres listener hears no notifications ({}); waiters poll \
                     and the near cache is off until it does. Behind a pooler in transaction \
                     mode, give the store a listen_url that reaches the server directly",
                    if why == "never" { "its first heartbeat never arrived" } else { why }
                );
            }
            #[cfg(feature = "metrics")]
            metrics::gauge!("idempotency_layer_store_listener_hears", "store" => "postgres")
                .set(0.0);
        }
        if let Some(near) = &near {
            near.set_live(false);
        }
    };
    let mut backoff = Duration::from_millis(50);
    let mut beats: u64 = 0;
    // A listener that never heard is warned of once, not at each reconnect.
    let mut warned_never = false;
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
                // Anything that ended before the LISTEN took effect: let the waiters look.
                waiters.wake_all();
                let mut beat = tokio::time::interval(HEARTBEAT_EVERY);
                beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                // The heartbeat awaited, and by when.
                let mut awaited: Option<(String, tokio::time::Instant)> = None;
                // No heartbeat heard on this connection yet.
                let mut first = true;
                loop {
                    let overdue = async {
                        match &awaited {
                            Some((_, by)) => tokio::time::sleep_until(*by).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = &mut stop => {
                            driver.abort();
                            return;
                        }
                        _ = overdue => {
                            awaited = None;
                            if first {
                                // Never heard on this connection: most likely a pooler in
                                // transaction mode the store was not told of. Reconnecting
                                // would only leave its LISTEN on more of the pooler's
                                // sessions: stay, and keep proving.
                                deaf(&store, if warned_never { "a heartbeat was missed" } else { "never" });
                                warned_never = true;
                                continue;
                            }
                            // It heard, and no longer does: a connection gone half-open (no reset
                            // ever comes, until TCP keepalive, hours later). Reconnect.
                            deaf(&store, "a heartbeat was missed");
                            break;
                        }
                        _ = beat.tick(), if awaited.is_none() => {
                            beats += 1;
                            let payload = format!("{HEARTBEAT_PREFIX}{beats}");
                            let Some(inner) = store.upgrade() else { return };
                            let sent = PostgresStore { inner }
                                .query(
                                    "SELECT pg_notify($1, $2)",
                                    &[(&channel.as_str(), Type::TEXT), (&payload.as_str(), Type::TEXT)],
                                )
                                .await;
                            // A store that cannot send cannot tell whether the listener
                            // hears: until a heartbeat is heard again, nothing relies on it.
                            match sent {
                                Ok(_) => awaited = Some((payload, tokio::time::Instant::now() + timeout * 2)),
                                Err(_) => deaf(&store, "its heartbeat could not be sent"),
                            }
                        }
                        m = rx.recv() => match m {
                            Some(Some(payload)) => {
                                if let Some(beat) = payload.strip_prefix(HEARTBEAT_PREFIX) {
                                    if awaited.as_ref().is_some_and(|(p, _)| p.strip_prefix(HEARTBEAT_PREFIX) == Some(beat)) {
                                        awaited = None;
                                        first = false;
                                        backoff = Duration::from_millis(50);
                                        if let Some(inner) = store.upgrade() {
                                            if inner.hears.swap(HEARS, Ordering::Relaxed) != HEARS {
                                                tracing::debug!("idempotency: the postgres listener hears");
                                            }
                                        }
                                        #[cfg(feature = "metrics")]
                                        metrics::gauge!("idempotency_layer_store_listener_hears", "store" => "postgres").set(1.0);
                                        if let Some(near) = &near {
                                            near.set_live(true);
                                        }
                                    }
                                    continue;
                                }
                                match payload.strip_prefix(FORGET_PREFIX) {
                                    Some(hex) => {
                                        if let Some(near) = &near {
                                            match scope_from_hex(hex) {
                                                Some(scope) => near.invalidate(&scope),
                                                None => {
                                                    near.set_live(false);
                                                    near.set_live(store.upgrade().is_some_and(|i| i.hears.load(Ordering::Relaxed) == HEARS));
                                                }
                                            }
                                        }
                                    }
                                    None => waiters.wake(&payload),
                                }
                            }
                            _ => break,
                        },
                    }
                }
                if let Some(inner) = store.upgrade() {
                    inner.hears.store(DEAF, Ordering::Relaxed);
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
            let store = Arc::downgrade(&self.inner);
            match &self.inner.tls {
                Connector::Plain => tokio::spawn(listen_task(store, NoTls, stop_rx)),
                #[cfg(feature = "postgres-tls")]
                Connector::Rustls(t) => tokio::spawn(listen_task(store, t.clone(), stop_rx)),
            };
            Listener { _stop: stop }
        })
    }
}

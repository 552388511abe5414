//! The store's pub/sub connection: wakes waiters when a claim ends and keeps the near cache
//! coherent, resubscribing after a reconnect.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};

use crate::store::near_cache::{scope_from_hex, Near};
use crate::store::wake::Waiters;

#[cfg(feature = "redis-cluster")]
use super::bulk;
use super::conn::PubSubSource;
use super::{PubSub, RedisStore};

pub(super) enum Command {
    Subscribe(String, oneshot::Sender<()>),
}

/// What the pub/sub task does for a near cache: subscribe to its invalidation channel and drop
/// the scopes published there.
pub(super) struct NearListener {
    pub(super) near: Arc<Near>,
    pub(super) channel: String,
}

impl NearListener {
    /// Handles a message on `channel`; true if it was an invalidation.
    pub(super) fn on_message(&self, channel: &[u8], payload: &[u8]) -> bool {
        if channel != self.channel.as_bytes() {
            return false;
        }
        match std::str::from_utf8(payload).ok().and_then(scope_from_hex) {
            Some(scope) => self.near.invalidate(&scope),
            None => {
                // Not ours to read; to be safe, forget everything.
                tracing::warn!(
                    channel = %self.channel,
                    "idempotency: unreadable near-cache invalidation; emptying the near cache"
                );
                self.near.set_live(false);
                self.near.set_live(true);
            }
        }
        true
    }
}

/// Owns the store's pub/sub connection: subscribes and unsubscribes channels as waiters come
/// and go, wakes local waiters on messages, and reconnects (resubscribing every channel that
/// still has waiters) when the connection is lost. Ends when the store is dropped.
/// Waits out `backoff` before the pub/sub connection is tried again, doubling it up to 2 s, while
/// dropping the subscribe and unsubscribe requests that arrive meanwhile (their waiters poll).
/// False when the store is gone (a channel closed): the task ends.
pub(super) async fn wait_out_backoff(
    backoff: &mut Duration,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    unsubscribe: &mut mpsc::UnboundedReceiver<String>,
) -> bool {
    let sleep = tokio::time::sleep(*backoff);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => break,
            c = commands.recv() => if c.is_none() { return false },
            u = unsubscribe.recv() => if u.is_none() { return false },
        }
    }
    *backoff = (*backoff * 2).min(Duration::from_secs(2));
    true
}

pub(super) async fn pubsub_task(
    client: PubSubSource,
    prefix: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<NearListener>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut unsubscribe: mpsc::UnboundedReceiver<String>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = match tokio::time::timeout(timeout, client.open_pubsub()).await {
            Ok(Ok(ps)) => Some(ps.split()),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "idempotency: redis pub/sub connect failed");
                None
            }
            Err(_) => None,
        };
        let Some((mut sink, mut stream)) = connected else {
            // Waiters poll meanwhile; pending subscriptions are dropped (their waiters poll).
            waiters.wake_all();
            if !wait_out_backoff(&mut backoff, &mut commands, &mut unsubscribe).await {
                return;
            }
            continue;
        };
        backoff = Duration::from_millis(50);
        let mut ok = true;
        if let Some(n) = &near {
            let r = tokio::time::timeout(timeout, sink.subscribe(&n.channel)).await;
            ok = matches!(r, Ok(Ok(())));
            // Served from only once every later invalidation is sure to arrive.
            n.near.set_live(ok);
        }
        for scope in waiters.scopes() {
            if sink.subscribe(format!("{prefix}{scope}")).await.is_err() {
                ok = false;
                break;
            }
        }
        while ok {
            tokio::select! {
                c = commands.recv() => match c {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let r = tokio::time::timeout(timeout, sink.subscribe(&channel)).await;
                        ok = matches!(r, Ok(Ok(())));
                        if ok {
                            let _ = ack.send(());
                        }
                    }
                },
                u = unsubscribe.recv() => match u {
                    None => return,
                    // A new waiter may have come since: keep the subscription then.
                    Some(scope) if !waiters.has(&scope) => {
                        let r = tokio::time::timeout(
                            timeout,
                            sink.unsubscribe(format!("{prefix}{scope}")),
                        )
                        .await;
                        ok = matches!(r, Ok(Ok(())));
                    }
                    Some(_) => {}
                },
                m = stream.next() => match m {
                    Some(msg) => {
                        let channel = msg.get_channel_name();
                        let invalidation = near.as_ref().is_some_and(|n| {
                            n.on_message(channel.as_bytes(), msg.get_payload_bytes())
                        });
                        if invalidation {
                            continue;
                        }
                        if let Some(scope) = channel.strip_prefix(prefix.as_str()) {
                            waiters.wake(scope);
                        }
                    }
                    None => ok = false,
                },
            }
        }
        tracing::debug!("idempotency: redis pub/sub connection lost; reconnecting");
        if let Some(n) = &near {
            n.near.set_live(false);
        }
        waiters.wake_all();
    }
}

/// The cluster's counterpart of [`pubsub_task`]: one RESP3 cluster connection per store whose
/// pushes come back on a channel. `SSUBSCRIBE` goes to the master of the channel's slot (the
/// key's: the scripts `SPUBLISH` there); the client reconnects to a lost node and resubscribes
/// its channels by itself, and a disconnection wakes every waiter so that they check at once.
#[cfg(feature = "redis-cluster")]
pub(super) async fn cluster_pubsub_task(
    nodes: Arc<[String]>,
    prefix: String,
    timeout: Duration,
    waiters: Arc<Waiters>,
    near: Option<NearListener>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut unsubscribe: mpsc::UnboundedReceiver<String>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let (tx, mut pushes) = mpsc::unbounded_channel();
        let connected = match super::builder::cluster_client(&nodes, timeout, Some(tx)) {
            Ok(client) => {
                match tokio::time::timeout(timeout * 4, client.get_async_connection()).await {
                    Ok(Ok(conn)) => Some(conn),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "idempotency: redis cluster pub/sub connect failed");
                        None
                    }
                    Err(_) => None,
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "idempotency: redis cluster pub/sub client");
                None
            }
        };
        let Some(mut conn) = connected else {
            waiters.wake_all();
            if !wait_out_backoff(&mut backoff, &mut commands, &mut unsubscribe).await {
                return;
            }
            continue;
        };
        backoff = Duration::from_millis(50);
        if let Some(n) = &near {
            // A plain (not sharded) subscription: `forget` publishes with `PUBLISH`, which the
            // cluster bus carries to every node.
            let r = tokio::time::timeout(timeout, conn.subscribe(&n.channel)).await;
            n.near.set_live(matches!(r, Ok(Ok(()))));
        }
        for scope in waiters.scopes() {
            let r =
                tokio::time::timeout(timeout, conn.ssubscribe(format!("{prefix}{scope}"))).await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::debug!("idempotency: redis cluster ssubscribe failed; the waiter polls");
            }
        }
        loop {
            tokio::select! {
                c = commands.recv() => match c {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        let r = tokio::time::timeout(timeout, conn.ssubscribe(&channel)).await;
                        if matches!(r, Ok(Ok(()))) {
                            let _ = ack.send(());
                        } else {
                            // The client reconnects by itself; meanwhile this waiter polls.
                            tracing::debug!(
                                channel,
                                "idempotency: redis cluster ssubscribe failed; the waiter polls"
                            );
                        }
                    }
                },
                u = unsubscribe.recv() => match u {
                    None => return,
                    Some(scope) if !waiters.has(&scope) => {
                        let _ = tokio::time::timeout(
                            timeout,
                            conn.sunsubscribe(format!("{prefix}{scope}")),
                        )
                        .await;
                    }
                    Some(_) => {}
                },
                m = pushes.recv() => match m {
                    Some(push) => match push.kind {
                        redis::PushKind::Message
                            if near.as_ref().is_some_and(|n| {
                                n.on_message(
                                    push.data.first().and_then(bulk).unwrap_or_default(),
                                    push.data.get(1).and_then(bulk).unwrap_or_default(),
                                )
                            }) => {}
                        redis::PushKind::SMessage | redis::PushKind::Message => {
                            if let Some(scope) = push
                                .data
                                .first()
                                .and_then(bulk)
                                .and_then(|c| std::str::from_utf8(c).ok())
                                .and_then(|c| c.strip_prefix(prefix.as_str()))
                            {
                                waiters.wake(scope);
                            }
                        }
                        // A node's connection was lost (a failover, a restart): its
                        // subscriptions come back with the reconnection; check now. The near
                        // cache may have missed an invalidation: empty it, and serve again
                        // once the invalidation channel is subscribed again.
                        redis::PushKind::Disconnection => {
                            waiters.wake_all();
                            if let Some(n) = &near {
                                n.near.set_live(false);
                                let r = tokio::time::timeout(timeout, conn.subscribe(&n.channel))
                                    .await;
                                n.near.set_live(matches!(r, Ok(Ok(()))));
                            }
                        }
                        _ => {}
                    },
                    None => break,
                },
            }
        }
        tracing::debug!("idempotency: redis cluster pub/sub connection lost; reconnecting");
        if let Some(n) = &near {
            n.near.set_live(false);
        }
        waiters.wake_all();
    }
}

impl RedisStore {
    pub(super) fn near_listener(&self) -> Option<NearListener> {
        self.inner.near.as_ref().map(|near| NearListener {
            near: near.clone(),
            channel: self.forget_channel(),
        })
    }

    pub(super) fn pubsub(&self) -> &PubSub {
        self.inner.pubsub.get_or_init(|| {
            let (commands, rx) = mpsc::unbounded_channel();
            let (unsubscribe, unsub_rx) = mpsc::unbounded_channel();
            match &self.inner.client {
                #[cfg(feature = "redis-sentinel")]
                PubSubSource::Sentinel(_) => {
                    tokio::spawn(pubsub_task(
                        self.inner.client.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
                PubSubSource::Single(_) => {
                    tokio::spawn(pubsub_task(
                        self.inner.client.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
                #[cfg(feature = "redis-cluster")]
                PubSubSource::Cluster(nodes) => {
                    tokio::spawn(cluster_pubsub_task(
                        nodes.clone(),
                        self.inner.prefix.clone(),
                        self.inner.timeout,
                        self.inner.waiters.clone(),
                        self.near_listener(),
                        rx,
                        unsub_rx,
                    ));
                }
            }
            PubSub {
                commands,
                unsubscribe,
            }
        })
    }
}

//! A standalone server's connection manager that is replaced when a command on it goes
//! unanswered for the store's timeout ([`Redialing`]): the store's connection, its
//! replicated-write connections, and the one to a Sentinel-named primary.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

/// A connection manager replaced by a fresh one (connecting on its first command) when a
/// command on it goes unanswered for the store's timeout.
///
/// redis-rs's [`ConnectionManager`] reconnects when an error says the connection dropped; a
/// response timeout is not such an error, so a connection gone half-open (its packets dropped,
/// no FIN or RST ever coming: a NAT entry expired, a server host frozen) would time out every
/// command until TCP keepalive gives up on it, hours by default. At most one replacement per
/// timeout: the commands that were waiting on the old connection time out together, and a
/// command sent on the new one must wait a whole timeout before it says anything of it.
/// A manager the user gave the store ([`connection_manager`](super::RedisStoreBuilder::connection_manager))
/// is theirs, and is never replaced.
#[derive(Clone)]
pub(super) struct Redialing(Arc<RedialShared>);

struct RedialShared {
    /// `None`: the user's manager, kept as it is.
    dial: Option<(redis::Client, ConnectionManagerConfig)>,
    timeout: Duration,
    current: RwLock<(ConnectionManager, Instant)>,
}

impl Redialing {
    /// `conn`, made from `dial` (replaced when unanswered), or the user's (`dial`: `None`).
    pub(super) fn new(
        conn: ConnectionManager,
        dial: Option<(redis::Client, ConnectionManagerConfig)>,
        timeout: Duration,
    ) -> Redialing {
        Redialing(Arc::new(RedialShared {
            dial,
            timeout,
            current: RwLock::new((conn, Instant::now())),
        }))
    }

    /// The manager commands go through now.
    pub(super) fn current(&self) -> ConnectionManager {
        self.0
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Replaces the manager unless it is the user's or was made less than a timeout ago;
    /// answers whether it did.
    pub(super) fn unanswered(&self) -> bool {
        let Some((client, config)) = &self.0.dial else {
            return false;
        };
        let mut current = self.0.current.write().unwrap_or_else(|e| e.into_inner());
        if current.1.elapsed() < self.0.timeout {
            // Replaced since this command was sent.
            return false;
        }
        match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
            Ok(fresh) => {
                tracing::warn!(
                    server = %client.get_connection_info().addr(),
                    timeout = ?self.0.timeout,
                    "idempotency: redis: a command went unanswered for the store's timeout; \
                     replacing the connection (it may have gone half-open)"
                );
                *current = (fresh, Instant::now());
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "idempotency: redis: cannot replace the connection");
                false
            }
        }
    }
}

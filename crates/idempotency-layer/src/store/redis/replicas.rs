//! [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas): a
//! claim and a record count as written once `n` replicas acknowledged them (`WAIT`, sent in the
//! same round trip as the script, on a connection of its own).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{ServerErrorKind, Value};
use tokio::sync::Semaphore;

use super::{backend, millis, timed_out, Conn, Lua, RedisStore, StoreError};

/// The connections replicated writes run on, apart from the store's own: a `WAIT` blocks its
/// connection until the replicas answer, so each runs alone on one of these.
pub(super) const WAIT_CONNECTIONS: usize = 8;

/// [`WAIT_CONNECTIONS`] connections, each lent to one replicated write at a time.
#[derive(Clone)]
pub(super) struct WaitConns {
    free: Arc<Mutex<Vec<Conn>>>,
    permits: Arc<Semaphore>,
}

impl WaitConns {
    pub(super) fn new(conns: Vec<Conn>) -> WaitConns {
        WaitConns {
            permits: Arc::new(Semaphore::new(conns.len())),
            free: Arc::new(Mutex::new(conns)),
        }
    }

    /// A connection no other write is using; given back when the lease drops.
    async fn lend(&self) -> Option<Lent> {
        let permit = self.permits.clone().acquire_owned().await.ok()?;
        let conn = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        Some(Lent {
            conn: Some(conn),
            free: self.free.clone(),
            _permit: permit,
        })
    }
}

/// A connection lent by [`WaitConns::lend`].
struct Lent {
    conn: Option<Conn>,
    free: Arc<Mutex<Vec<Conn>>>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Back before the permit (dropped after this): the next borrower finds it.
            self.free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(conn);
        }
    }
}

/// How many replicas must acknowledge a claim or a record, and how long the primary waits
/// for them.
#[derive(Clone, Copy, Debug)]
pub(super) struct WaitForReplicas {
    pub(super) replicas: usize,
    pub(super) timeout: Duration,
}

/// Whether the replicas acknowledged what the script wrote: `Ok` also when the store does not
/// ask (no [`WaitForReplicas`]); the error says how many did.
pub(super) type Replicated = Result<(), StoreError>;

/// What a `WAIT` reply says: enough replicas acknowledged, or how many did.
fn acknowledged(acked: Option<Value>, wait: WaitForReplicas) -> Replicated {
    match acked {
        Some(Value::Int(n)) if usize::try_from(n).is_ok_and(|n| n >= wait.replicas) => Ok(()),
        Some(Value::Int(n)) => Err(StoreError::Backend(
            format!(
                "written on the redis primary, but acknowledged by {n} of the {} replicas \
                 wait_for_replicas asks for within {:?}: a failover now would lose it",
                wait.replicas, wait.timeout
            )
            .into(),
        )),
        Some(Value::ServerError(e)) => Err(backend(e.into())),
        other => Err(StoreError::Backend(
            format!("unexpected WAIT reply {other:?}").into(),
        )),
    }
}

/// A claim reply that wrote a claim (`{1}`).
pub(super) fn is_new_claim(reply: &Value) -> bool {
    matches!(reply, Value::Array(items) if matches!(items.first(), Some(Value::Int(1))))
}

/// A claim reply that found a record no `WAIT` is known to have covered (`{3, record, ttl,
/// 0, token}`; a record written without a token cannot be marked, and is always waited for).
fn is_unacknowledged_record(reply: &Value) -> bool {
    matches!(reply, Value::Array(items)
        if matches!((items.first(), items.get(3)), (Some(Value::Int(3)), Some(Value::Int(0)))))
}

/// A claim reply that found a record (`{3, ...}`).
fn is_record(reply: &Value) -> bool {
    matches!(reply, Value::Array(items) if matches!(items.first(), Some(Value::Int(3))))
}

/// The token that completed the record of a claim reply, if it found one that has a token.
fn record_token(reply: &Value) -> Option<Vec<u8>> {
    match reply {
        Value::Array(items) if is_record(reply) => match items.get(4) {
            Some(Value::BulkString(token)) => Some(token.clone()),
            _ => None,
        },
        _ => None,
    }
}

impl RedisStore {
    /// Runs `lua` on `key` like [`run`](RedisStore::run); with
    /// [`wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas), followed by
    /// `WAIT n timeout` in the same pipeline (one round trip; `WAIT` cannot run inside a
    /// script). `WAIT` covers every write this connection sent before it, the script's
    /// included. Answers the script's reply and whether enough replicas acknowledged.
    pub(super) async fn run_replicated(
        &self,
        lua: &Lua,
        key: &str,
        args: &[&[u8]],
    ) -> Result<(Value, Replicated), StoreError> {
        let Some(wait) = self.inner.wait_for_replicas else {
            return self.run(lua, key, args).await.map(|v| (v, Ok(())));
        };
        let pipeline = |name: &str, first: &str| {
            let mut p = redis::pipe();
            p.ignore_errors();
            p.cmd(name).arg(first).arg(1).arg(key);
            for a in args {
                p.arg(*a);
            }
            p.cmd("WAIT").arg(wait.replicas).arg(millis(wait.timeout));
            p
        };
        let values = self
            .pipe_on_wait_conn(
                wait,
                pipeline("EVALSHA", lua.script.get_hash()),
                Some(|| pipeline("EVAL", &lua.source)),
            )
            .await?;
        let mut values = values.into_iter();
        let (Some(reply), Some(acked)) = (values.next(), values.next()) else {
            return Err(StoreError::Backend(
                "redis answered a script and WAIT pipeline with fewer than 2 replies".into(),
            ));
        };
        let reply = match reply {
            Value::ServerError(e) => return Err(backend(e.into())),
            reply => reply,
        };
        let replicated = acknowledged(Some(acked), wait);
        Ok((reply, replicated))
    }

    /// The claim script `lua` on `key`: run on the store's own connection, like any script, so
    /// that a duplicate that finds the claim in flight, or a record the replicas acknowledged
    /// (which write nothing), never waits for a free replicated-write connection nor for a
    /// replica. A reply that wrote a claim is then made to wait for the replicas: on a
    /// connection of its own, a marker write in the key's slot and `WAIT` (the marker's
    /// replication offset is past the claim's, so its acknowledgement covers the claim).
    ///
    /// So is a reply that found a record not yet marked acknowledged: a record stays on the
    /// primary when its `complete` was not acknowledged (Redis cannot take a write back), and a
    /// duplicate answered from it at once would be replayed a record a failover can still
    /// lose (the next duplicate after the failover would run again). Once a `WAIT` covers it,
    /// the record is marked ([`mark_acknowledged`](Self::mark_acknowledged)), and its next
    /// replays wait for nothing.
    pub(super) async fn run_claim_replicated(
        &self,
        lua: &Lua,
        key: &str,
        args: &[&[u8]],
    ) -> Result<(Value, Replicated), StoreError> {
        let reply = self.run(lua, key, args).await?;
        let Some(wait) = self.inner.wait_for_replicas else {
            return Ok((reply, Ok(())));
        };
        if is_new_claim(&reply) {
            // The claim is written: a failure from here on is "not known to be replicated",
            // never "not written" (the caller then releases it in the background).
            let replicated = self.marker_and_wait(key, wait, None).await;
            return Ok((reply, replicated.and_then(|(_, r)| r)));
        }
        if !is_unacknowledged_record(&reply) {
            return Ok((reply, Ok(())));
        }
        // A record read on the shared connection could come from another server than the
        // one the `WAIT` would run on (a failover or a slot migration in between): the claim
        // is run again in the same pipeline as the marker and the `WAIT`, on one connection,
        // and its reply is the answer (a record, a claim this call wrote after all, or one in
        // flight, which needs no replica).
        let (again, replicated) = self.marker_and_wait(key, wait, Some((lua, args))).await?;
        let reply = again.unwrap_or(reply);
        if !is_new_claim(&reply) && !is_record(&reply) {
            return Ok((reply, Ok(())));
        }
        if let (Ok(()), Some(token)) = (&replicated, record_token(&reply)) {
            self.mark_acknowledged(key, token);
        }
        Ok((reply, replicated))
    }

    /// A marker write in `key`'s slot and `WAIT`, on a replicated-write connection of its own
    /// (the marker's replication offset is past every write before it, so its acknowledgement
    /// covers them), after the script `claim` on `key` when given (its reply comes back too).
    async fn marker_and_wait(
        &self,
        key: &str,
        wait: WaitForReplicas,
        claim: Option<(&Lua, &[&[u8]])>,
    ) -> Result<(Option<Value>, Replicated), StoreError> {
        let marker = format!("{{{key}}}:acked");
        let pipeline = |script: Option<(&str, &str)>| {
            let mut p = redis::pipe();
            p.ignore_errors();
            if let (Some((name, first)), Some((_, args))) = (script, claim) {
                p.cmd(name).arg(first).arg(1).arg(key);
                for a in args {
                    p.arg(*a);
                }
            }
            p.cmd("SET")
                .arg(&marker)
                .arg(1)
                .arg("PX")
                .arg(millis(self.inner.timeout + wait.timeout).max(1));
            p.cmd("WAIT").arg(wait.replicas).arg(millis(wait.timeout));
            p
        };
        let values = match claim {
            Some((lua, _)) => {
                self.pipe_on_wait_conn(
                    wait,
                    pipeline(Some(("EVALSHA", lua.script.get_hash()))),
                    Some(|| pipeline(Some(("EVAL", &lua.source)))),
                )
                .await?
            }
            None => {
                self.pipe_on_wait_conn(wait, pipeline(None), None::<fn() -> redis::Pipeline>)
                    .await?
            }
        };
        let mut values = values.into_iter();
        let script = match claim {
            Some(_) => match values.next() {
                Some(Value::ServerError(e)) => return Err(backend(e.into())),
                reply => reply,
            },
            None => None,
        };
        let (set, acked) = (values.next(), values.next());
        // Without its marker written, the `WAIT` would cover only older writes.
        if let Some(Value::ServerError(e)) = set {
            return Ok((script, Err(backend(e.into()))));
        }
        Ok((script, acknowledged(acked, wait)))
    }

    /// Marks the record `token` completed at `key` as acknowledged by the replicas, in the
    /// background (nothing waits for it: until it lands, a replay waits for the replicas once
    /// more, which is only slower).
    pub(super) fn mark_acknowledged(&self, key: &str, token: Vec<u8>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, key) = (self.clone(), key.to_owned());
        runtime.spawn(async move {
            let lua = &store.scripts().acknowledged;
            if let Err(e) = store.run(lua, &key, &[&token]).await {
                tracing::debug!(error = %e, "idempotency: marking a replicated record failed");
            }
        });
    }

    /// Sends `pipe` (which ends in a `WAIT`) on a replicated-write connection of its own (the
    /// store's shared one if it has none), and `on_noscript()` instead if the first reply says
    /// the script is not loaded. Waiting for a free connection counts against the bound: the
    /// store's timeout plus the `WAIT`'s.
    async fn pipe_on_wait_conn(
        &self,
        wait: WaitForReplicas,
        pipe: redis::Pipeline,
        on_noscript: Option<impl FnOnce() -> redis::Pipeline>,
    ) -> Result<Vec<Value>, StoreError> {
        // The connection the pipeline went out on: replaced if it goes unanswered.
        let sent_on: Mutex<Option<Conn>> = Mutex::new(None);
        let op = async {
            let mut lent = match &self.inner.waits {
                Some(waits) => waits.lend().await,
                None => None,
            };
            let mut shared = self.inner.conn.clone();
            let conn = match lent.as_mut().and_then(|l| l.conn.as_mut()) {
                Some(conn) => conn,
                None => &mut shared,
            };
            *sent_on.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
            let values = pipe.query_async::<Vec<Value>>(conn).await?;
            match on_noscript {
                Some(again) if matches!(values.first(), Some(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::NoScript)) => {
                    again().query_async::<Vec<Value>>(conn).await
                }
                _ => Ok(values),
            }
        };
        let bound = self.inner.timeout + wait.timeout;
        let outcome = tokio::time::timeout(bound, op).await;
        let unanswered = match &outcome {
            Ok(Err(e)) => e.is_timeout(),
            Ok(Ok(_)) => false,
            Err(_) => true,
        };
        if unanswered {
            if let Some(conn) = sent_on.lock().unwrap_or_else(|p| p.into_inner()).take() {
                self.unanswered(&conn);
            }
        }
        match outcome {
            Ok(r) => r.map_err(backend),
            Err(_) => Err(timed_out(bound)),
        }
    }

    /// [`run_flag`](RedisStore::run_flag) through [`run_replicated`](Self::run_replicated):
    /// a script that wrote (`1`) is `Ok` only if enough replicas acknowledged it.
    pub(super) async fn run_flag_replicated(
        &self,
        lua: &Lua,
        scope: &super::ScopeKey,
        args: &[&[u8]],
    ) -> Result<(), StoreError> {
        match self.run_replicated(lua, &self.key(scope), args).await? {
            (Value::Int(1), replicated) => replicated,
            (Value::Int(0), _) => Err(StoreError::Fenced),
            (other, _) => Err(StoreError::Backend(
                format!("unexpected script reply {other:?}").into(),
            )),
        }
    }
}

//! [`RedisStoreBuilder::wait_for_replicas`](super::RedisStoreBuilder::wait_for_replicas): a
//! claim and a record count as written once `n` replicas acknowledged them (`WAIT`, sent in the
//! same round trip as the script).

use std::time::Duration;

use redis::{ServerErrorKind, Value};

use super::{backend, millis, timed_out, Lua, RedisStore, StoreError};

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

/// A claim reply that wrote a claim (`{1}`): the one `begin` outcome that must be replicated.
pub(super) fn is_new_claim(reply: &Value) -> bool {
    matches!(reply, Value::Array(items) if matches!(items.first(), Some(Value::Int(1))))
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
        let mut conn = self.inner.conn.clone();
        let op = async {
            let mut values = pipeline("EVALSHA", lua.script.get_hash())
                .query_async::<Vec<Value>>(&mut conn)
                .await?;
            if matches!(values.first(), Some(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::NoScript))
            {
                values = pipeline("EVAL", &lua.source)
                    .query_async::<Vec<Value>>(&mut conn)
                    .await?;
            }
            Ok::<_, redis::RedisError>(values)
        };
        let bound = self.inner.timeout + wait.timeout;
        let values = match tokio::time::timeout(bound, op).await {
            Ok(r) => r.map_err(backend)?,
            Err(_) => return Err(timed_out(bound)),
        };
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
        let replicated = match acked {
            Value::Int(n) if usize::try_from(n).is_ok_and(|n| n >= wait.replicas) => Ok(()),
            Value::Int(n) => Err(StoreError::Backend(
                format!(
                    "written on the redis primary, but acknowledged by {n} of the {} replicas \
                     wait_for_replicas asks for within {:?}: a failover now would lose it",
                    wait.replicas, wait.timeout
                )
                .into(),
            )),
            Value::ServerError(e) => Err(backend(e.into())),
            other => Err(StoreError::Backend(
                format!("unexpected WAIT reply {other:?}").into(),
            )),
        };
        Ok((reply, replicated))
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

//! The store's SQL: its statements (made once per schema and table), their parameters, and
//! what their rows mean.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use uuid::Uuid;

use crate::store::{codec, Begin, ScopeKey, StoreError, Token};

use super::FORGET_PREFIX;
use super::{backend, millis};

/// True in a session whose commits wait for a synchronous standby to confirm them: one is
/// named, and `synchronous_commit` asks for more than the primary's own disk. Read by each
/// claim statement, so a standby configured (or removed) while the store runs counts at once.
const STANDBY_CONFIRMS: &str = "(current_setting('synchronous_standby_names') <> '' \
     AND current_setting('synchronous_commit') NOT IN ('off', 'local'))";

pub(super) struct Sql {
    pub(super) claim: String,
    pub(super) anchor: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew_many: String,
    pub(super) forget: String,
    pub(super) watch: String,
    pub(super) peek: String,
    pub(super) lookup: String,
    pub(super) cleanup: String,
    pub(super) migrate: String,
    pub(super) create_schema: String,
    pub(super) create_table: String,
    pub(super) add_watched: String,
    pub(super) create_index: String,
}

impl Sql {
    pub(super) fn new(schema: &str, table: &str, channel: &str) -> Sql {
        let t = format!("\"{schema}\".\"{table}\"");
        let lease = "now() + $4::bigint * interval '1 millisecond'";
        // `pg_notify` only for a claim a waiter marked `watched`: a transaction that has sent a
        // NOTIFY takes a cluster-wide lock through its commit (fsync included), which would
        // serialize every completion in the server with every other one.
        let notify_if_watched = |cte: &str| {
            format!(
                "notified AS (SELECT pg_notify('{channel}', encode(scope, 'hex')) FROM {cte} \
                   WHERE watched) \
                 SELECT (SELECT count(*) FROM {cte}) AS n, (SELECT count(*) FROM notified) AS woken"
            )
        };
        let create_schema = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
        let create_table = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\n\
             \x20   scope       bytea       PRIMARY KEY,\n\
             \x20   state       text        NOT NULL CHECK (state IN ('in_flight', 'completed')),\n\
             \x20   token       uuid        NOT NULL,\n\
             \x20   fingerprint bytea       NOT NULL,\n\
             \x20   expires_at  timestamptz NOT NULL,\n\
             \x20   record      bytea,\n\
             \x20   watched     boolean     NOT NULL DEFAULT false,\n\
             \x20   CHECK ((state = 'completed') = (record IS NOT NULL))\n\
             )"
        );
        let add_watched = format!(
            "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false"
        );
        let create_index =
            format!("CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON {t} (expires_at)");
        Sql {
            // A live row is read, never written: a replay (and a waiter that begins again)
            // takes no transaction id, writes no WAL and waits for no commit flush. Only when
            // the snapshot holds no live row does the INSERT run; `ON CONFLICT ... WHERE`
            // takes over an expired row, and a row a concurrent claim inserted after the
            // snapshot yields no row at all (`begin` then runs the statement again).
            //
            // Each row also says whether this session's commits wait for a synchronous standby
            // (`standby`, read at each statement): a replay is then anchored first (`anchor`).
            claim: format!(
                "WITH live AS (\
                   SELECT state, token, fingerprint, record, \
                     GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint AS ttl_ms \
                   FROM {t} WHERE scope = $1 AND expires_at > now()), \
                 claimed AS (\
                   INSERT INTO {t} AS e (scope, state, token, fingerprint, expires_at, record) \
                   SELECT $1, 'in_flight', $2::uuid, $3::bytea, {lease}, NULL \
                   WHERE NOT EXISTS (SELECT 1 FROM live) \
                   ON CONFLICT (scope) DO UPDATE SET state = 'in_flight', token = excluded.token, \
                     fingerprint = excluded.fingerprint, expires_at = excluded.expires_at, record = NULL, \
                     watched = false \
                   WHERE e.expires_at <= now() \
                   RETURNING e.state, e.token, e.fingerprint, e.record) \
                 SELECT true AS claimed, state, token, fingerprint, record, 0::bigint AS ttl_ms, \
                   false AS standby \
                 FROM claimed \
                 UNION ALL \
                 SELECT false, state, token, fingerprint, record, ttl_ms, {STANDBY_CONFIRMS} \
                 FROM live"
            ),
            // With a synchronous standby, a record is replayed only once the standby has it.
            // A commit whose wait for the standby was cancelled (the store's own timeout
            // cancels a statement it gave up on) is visible on the primary at once, though the
            // standby may lack it; a replay that only read it would publish it, and a failover
            // then would lose a record a client was already answered with. So the record the
            // claim found ($1 scope, $2 the token that completed it) is locked `FOR SHARE`: the
            // lock gives the statement a transaction of its own, whose commit waits for the
            // standby to confirm WAL past the record's commit. A standby that does not confirm
            // then fails the replay closed at the store's timeout, as it fails every write. No
            // row: the record was removed or replaced meanwhile, and `begin` claims again.
            anchor: format!(
                "SELECT 1 FROM {t} WHERE scope = $1 AND token = $2 AND state = 'completed' \
                   AND expires_at > now() FOR SHARE"
            ),
            // A complete resent by its own token (its reply was lost, or its commit's wait for
            // a synchronous standby was cancelled: committed on the primary, perhaps not on the
            // standby) finds the record it already wrote and writes that row again, unchanged:
            // a statement that writes nothing commits without waiting for any standby, and
            // would acknowledge a record a failover can still lose.
            complete: format!(
                "WITH done AS (\
                   UPDATE {t} SET state = 'completed', record = $3, \
                     expires_at = {lease} \
                   WHERE scope = $1 AND token = $2 AND state = 'in_flight' RETURNING scope, watched), \
                 again AS (\
                   UPDATE {t} SET expires_at = expires_at \
                   WHERE scope = $1 AND token = $2 AND state = 'completed' AND expires_at > now() \
                   RETURNING scope), \
                 notified AS (SELECT pg_notify('{channel}', encode(scope, 'hex')) FROM done \
                   WHERE watched) \
                 SELECT (SELECT count(*) FROM done) + (SELECT count(*) FROM again) \
                   AS n, (SELECT count(*) FROM notified) AS woken"
            ),
            release: format!(
                "WITH gone AS (\
                   DELETE FROM {t} WHERE scope = $1 AND token = $2 AND state = 'in_flight' \
                   RETURNING scope, watched), \
                 {}",
                notify_if_watched("gone")
            ),
            // Every claim of a renewal tick in one statement: ($1, $2, $3) are the claims'
            // scopes, tokens and leases (ms). Rows another transaction holds locked (a
            // `TxCompletion` transaction, a commit waiting for a standby) are skipped, not
            // waited for: one locked row must not hold up, or time out, the whole batch.
            // Returns each claim still held, with `true` when renewed, `false` when skipped.
            renew_many: format!(
                "WITH c AS (\
                   SELECT * FROM unnest($1::bytea[], $2::uuid[], $3::bigint[]) AS c(scope, token, ms)), \
                 free AS (\
                   SELECT e.scope FROM {t} AS e JOIN c ON e.scope = c.scope \
                   WHERE e.token = c.token AND e.state = 'in_flight' \
                   FOR UPDATE OF e SKIP LOCKED), \
                 renewed AS (\
                   UPDATE {t} AS e SET expires_at = now() + c.ms * interval '1 millisecond' \
                   FROM c WHERE e.scope = c.scope AND e.token = c.token \
                     AND e.scope IN (SELECT scope FROM free) \
                   RETURNING e.token) \
                 SELECT token, true FROM renewed \
                 UNION ALL \
                 SELECT e.token, false FROM {t} AS e JOIN c ON e.scope = c.scope \
                 WHERE e.token = c.token AND e.state = 'in_flight' \
                   AND e.scope NOT IN (SELECT scope FROM free)"
            ),
            // A forgotten record is always announced (rare, so the NOTIFY's lock costs
            // nothing that matters), for the near caches of every instance.
            forget: format!(
                "WITH gone AS (DELETE FROM {t} WHERE scope = $1 RETURNING scope, watched, state), \
                 invalidated AS (SELECT pg_notify('{channel}', '{FORGET_PREFIX}' || encode(scope, 'hex')) \
                   FROM gone WHERE state = 'completed'), \
                 notified AS (SELECT pg_notify('{channel}', encode(scope, 'hex')) FROM gone \
                   WHERE watched) \
                 SELECT (SELECT count(*) FROM gone) AS n, (SELECT count(*) FROM notified) AS woken, \
                   (SELECT count(*) FROM invalidated) AS invalidated"
            ),
            watch: format!(
                "UPDATE {t} SET watched = true \
                 WHERE scope = $1 AND token = $2 AND state = 'in_flight' AND expires_at > now() \
                 RETURNING GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint"
            ),
            lookup: format!(
                "SELECT state, token, fingerprint, record FROM {t} \
                 WHERE scope = $1 AND expires_at > now()"
            ),
            peek: format!(
                "SELECT GREATEST(0, extract(epoch FROM expires_at - now()) * 1000)::bigint \
                 FROM {t} \
                 WHERE scope = $1 AND token = $2 AND state = 'in_flight' AND expires_at > now()"
            ),
            // Records past their TTL; claims only once their lease lapsed longer than
            // `LATE_COMPLETE_GRACE` ago ($2 ms): a late leader that was never taken over can
            // still complete its claim and store its record, as on Redis.
            // By primary key, not by `ctid`: a `ctid` is unique only within one partition, so
            // on a partitioned table `ctid IN (...)` would delete live rows of the others.
            cleanup: format!(
                "WITH gone AS (DELETE FROM {t} WHERE scope IN (\
                   SELECT scope FROM {t} WHERE expires_at <= now() \
                     AND (state = 'completed' \
                          OR expires_at <= now() - $2::bigint * interval '1 millisecond') \
                   LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING 1) \
                 SELECT count(*) FROM gone"
            ),
            migrate: format!(
                "{create_schema};\n{create_table};\n{add_watched};\n{create_index};\n"
            ),
            create_schema,
            create_table,
            add_watched,
            create_index,
        }
    }
}

/// The rows a complete, release or forget changed (its one result row's first column).
pub(crate) fn affected(rows: &[Row]) -> i64 {
    rows.first()
        .and_then(|r| r.try_get::<_, i64>(0).ok())
        .unwrap_or(0)
}

/// A fenced complete or release that changed no row: the token no longer holds the claim.
pub(super) fn fenced_unless_affected(rows: &[Row]) -> Result<(), StoreError> {
    if affected(rows) == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

/// The parameters of the fenced `complete` statement, in its order (`$1`..`$4`): one list,
/// whether the store runs the statement on a pooled connection or a handler runs it in its own
/// transaction ([`TxCompletion`](crate::TxCompletion)).
pub(crate) struct CompleteParams<'a> {
    scope: &'a [u8],
    token: Uuid,
    record: &'a [u8],
    ttl_ms: i64,
}

impl<'a> CompleteParams<'a> {
    pub(crate) fn new(scope: &'a ScopeKey, token: Token, record: &'a [u8], ttl: Duration) -> Self {
        CompleteParams {
            scope: &scope.0,
            token: Uuid::from_u128(token.0),
            record,
            ttl_ms: millis(ttl),
        }
    }

    /// With their types: for the store's statements (prepared, or sent unnamed behind a
    /// transaction pooler), and for a handler's transaction (`query_typed`: one round trip, no
    /// statement left on the connection).
    pub(crate) fn typed(&self) -> [(&(dyn ToSql + Sync), Type); 4] {
        [
            (&self.scope, Type::BYTEA),
            (&self.token, Type::UUID),
            (&self.record, Type::BYTEA),
            (&self.ttl_ms, Type::INT8),
        ]
    }

    /// Bound to a sqlx `query` of the statement, in the same order
    /// ([`TxCompletion::complete_in_sqlx`](crate::TxCompletion::complete_in_sqlx)).
    #[cfg(feature = "sqlx")]
    pub(crate) fn bind<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>
    where
        'a: 'q,
    {
        query
            .bind(self.scope)
            .bind(self.token)
            .bind(self.record)
            .bind(self.ttl_ms)
    }
}

/// A migration statement failed: say what to do when it is a missing privilege.
pub(super) fn migrate_error(e: tokio_postgres::Error, what: &str, statement: &str) -> StoreError {
    if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
        StoreError::Backend(
            format!(
                "migrate: this role may not {what} ({e}); run `{statement}` once as the owner \
                 (PostgresStore::migration_sql has it all), then grant this role USAGE on the \
                 schema and SELECT, INSERT, UPDATE, DELETE on the table"
            )
            .into(),
        )
    } else {
        backend(e)
    }
}

/// Whether the claim statement's row says this session's commits wait for a synchronous
/// standby (a replay must then be anchored: [`Sql::anchor`]).
pub(super) fn standby_confirms(row: &Row) -> bool {
    row.try_get::<_, bool>(6).unwrap_or(false)
}

/// The claim statement's row as a [`Begin`], and for a completed record the time it has left to
/// live (for the near cache).
pub(super) fn decode_row(row: &Row, ours: Token) -> Result<(Begin, Duration), StoreError> {
    let corrupt = |e: tokio_postgres::Error| StoreError::Corrupt(format!("row: {e}"));
    let claimed: bool = row.try_get(0).map_err(corrupt)?;
    let state: &str = row.try_get(1).map_err(corrupt)?;
    let token: Uuid = row.try_get(2).map_err(corrupt)?;
    let token = Token(token.as_u128());
    if claimed {
        return if token == ours {
            Ok((Begin::New(token), Duration::ZERO))
        } else {
            Err(StoreError::Corrupt("claimed row has another token".into()))
        };
    }
    match state {
        "in_flight" => {
            let fp: &[u8] = row.try_get(3).map_err(corrupt)?;
            Ok((
                Begin::InFlight {
                    token,
                    fingerprint: codec::fingerprint(fp)?,
                },
                Duration::ZERO,
            ))
        }
        "completed" => {
            let record: Option<&[u8]> = row.try_get(4).map_err(corrupt)?;
            let record =
                record.ok_or_else(|| StoreError::Corrupt("completed row has no record".into()))?;
            let ttl_ms: i64 = row.try_get(5).map_err(corrupt)?;
            Ok((
                Begin::Completed(Arc::new(codec::decode(record)?)),
                Duration::from_millis(ttl_ms.max(0) as u64),
            ))
        }
        other => Err(StoreError::Corrupt(format!("row state {other:?}"))),
    }
}

//! A pooled connection while one of the store's statements runs on it.
//!
//! Dropping a `tokio-postgres` query future does not stop the statement: the server runs it on,
//! and the connection answers nothing else until it ends. Returned to the pool as it is, that
//! connection would stall the next statements handed to it (behind a lock held by an open
//! `TxCompletion` transaction, say, for as long as that transaction lasts), and a claim
//! abandoned at the store's timeout could still land later, after its orphan release had found
//! nothing to release.
//!
//! So a statement that does not end on its own (its caller's timeout fired, or its caller went
//! away) takes its connection out of the pool and cancels the statement on the server
//! (a `CancelRequest` on a connection of its own, in the background); the session's
//! `statement_timeout` and `lock_timeout` (set on the store's own pools) end it on the server
//! even if the cancel is lost, except a commit waiting for a synchronous standby, which only a
//! cancel ends: so every abandoned statement is cancelled, at most [`CANCEL_CONNECTIONS`] at once
//! per store, and its connection is closed once it answers again ([`Canceller::end`]). A
//! connection whose statement failed in a way that says the
//! connection itself is no good (the server is read-only after a failover, or shutting down,
//! or the socket closed) is also dropped, not pooled: the next statement gets a fresh
//! connection, to the new primary.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object, Pool};
use tokio::sync::Semaphore;
use tokio_postgres::error::SqlState;
use tokio_postgres::{CancelToken, NoTls};

use super::Connector;

/// The most cancel requests one store sends at once (each on a connection of its own, for at
/// most the store's timeout): a stalled server times out every statement at once, and a cancel
/// connection for each would double the connections the store holds open to it.
pub(super) const CANCEL_CONNECTIONS: usize = 4;

/// How the store's abandoned statements are cancelled: the connector and a bound on the
/// cancels in flight ([`CANCEL_CONNECTIONS`]); see [`Canceller::end`].
#[derive(Clone)]
pub(super) struct Canceller {
    pub(super) tls: Connector,
    pub(super) permits: Arc<Semaphore>,
    /// The one TCP server of the configuration, where cancels are sent on a [`KeepOpen`]
    /// connection, as libpq sends them; `None`: several hosts or a Unix socket, where
    /// `tokio-postgres` sends them.
    pub(super) tcp_server: Option<(String, u16)>,
}

impl Canceller {
    pub(super) fn new(tls: Connector, config: &tokio_postgres::Config) -> Canceller {
        let tcp_server = match (config.get_hosts(), config.get_ports()) {
            ([tokio_postgres::config::Host::Tcp(host)], ports) => {
                Some((host.clone(), ports.first().copied().unwrap_or(5432)))
            }
            _ => None,
        };
        Canceller {
            tls,
            permits: Arc::new(Semaphore::new(CANCEL_CONNECTIONS)),
            tcp_server,
        }
    }

    /// Sends one cancel request for `token`'s session.
    async fn send(&self, token: &CancelToken) -> Result<(), BoxError> {
        let Some((host, port)) = &self.tcp_server else {
            match &self.tls {
                Connector::Plain => token.cancel_query(NoTls).await?,
                #[cfg(feature = "postgres-tls")]
                Connector::Rustls(tls) => token.cancel_query(tls.clone()).await?,
            }
            return Ok(());
        };
        let stream = KeepOpen(tokio::net::TcpStream::connect((host.as_str(), *port)).await?);
        match &self.tls {
            Connector::Plain => token.cancel_query_raw(stream, NoTls).await?,
            #[cfg(feature = "postgres-tls")]
            Connector::Rustls(tls) => {
                use tokio_postgres::tls::MakeTlsConnect;
                let connect = MakeTlsConnect::<KeepOpen>::make_tls_connect(&mut tls.clone(), host)?;
                token.cancel_query_raw(stream, connect).await?
            }
        }
        Ok(())
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The connection a cancel request is sent on, closed as libpq closes it: after the request,
/// nothing until the server closes the connection (it has passed the cancel on). Its
/// `shutdown`, which `tokio-postgres` calls right after the request, waits for that instead of
/// closing this side (FIN). PgBouncer 1.18 (Debian 12's; its issues #801 and #1376 report it
/// up to 1.24) frees a cancel client that closes first while its cancel is still being
/// forwarded, and exits on a fatal error ("bad client state: 0" in `disconnect_client`) once
/// the forwarding ends: the store's cancels, one per statement abandoned at its timeout,
/// crashed it in every run of the store test that checks this. The caller bounds the whole
/// (the store's timeout).
struct KeepOpen(tokio::net::TcpStream);

impl tokio::io::AsyncRead for KeepOpen {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for KeepOpen {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    /// Until the server closes the connection (an end of stream, or a reset).
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let mut rest = [0u8; 64];
        loop {
            let mut buf = tokio::io::ReadBuf::new(&mut rest);
            match tokio::io::AsyncRead::poll_read(std::pin::Pin::new(&mut self.0), cx, &mut buf) {
                std::task::Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                    return std::task::Poll::Ready(Ok(()))
                }
                std::task::Poll::Ready(Ok(())) => continue,
                std::task::Poll::Ready(Err(_)) => return std::task::Poll::Ready(Ok(())),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            }
        }
    }
}

/// A pooled connection with a statement in flight: dropped before [`finish`](Busy::finish),
/// the connection leaves the pool and the statement is cancelled.
pub(super) struct Busy<'a> {
    conn: Option<Object>,
    pool: &'a Pool,
    cancel: &'a Canceller,
    timeout: Duration,
}

impl<'a> Busy<'a> {
    pub(super) fn new(
        conn: Object,
        pool: &'a Pool,
        cancel: &'a Canceller,
        timeout: Duration,
    ) -> Self {
        Busy {
            conn: Some(conn),
            pool,
            cancel,
            timeout,
        }
    }

    pub(super) fn client(&self) -> &Object {
        self.conn
            .as_ref()
            .expect("present until finish, a failed step, or drop")
    }

    /// The statement ended with `result`: the connection goes back to the pool, unless the
    /// error says the connection is no good.
    pub(super) fn finish<T>(
        mut self,
        result: Result<T, tokio_postgres::Error>,
    ) -> Result<T, tokio_postgres::Error> {
        self.release(&result);
        result
    }

    /// A step before the statement (preparing it) ended with `result`: on an error, the
    /// connection is released as by [`finish`](Self::finish); on success it stays busy.
    pub(super) fn finish_if_err<T>(
        &mut self,
        result: Result<T, tokio_postgres::Error>,
    ) -> Result<T, tokio_postgres::Error> {
        if result.is_err() {
            self.release(&result);
        }
        result
    }

    fn release<T>(&mut self, result: &Result<T, tokio_postgres::Error>) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        let Err(e) = result else { return };
        if discards_connection(e) {
            tracing::debug!(
                error = %e,
                "idempotency: postgres connection dropped from the pool after this error"
            );
            drop(Object::take(conn));
        }
        if server_changed_role(e) {
            // Every idle connection went to the same server: drop them all now rather than
            // fail one request on each.
            tracing::warn!(
                error = %e,
                "idempotency: postgres server is read-only or shutting down (a failover?); \
                 dropping the pool's idle connections, new ones go to the current primary"
            );
            self.pool.retain(|_, _| false);
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        // Out of the pool at once: nothing else is handed this connection.
        let client = Object::take(conn);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (timeout, cancel) = (self.timeout, self.cancel.clone());
        runtime.spawn(async move { cancel.end(client, timeout).await });
    }
}

/// How many times one abandoned statement is cancelled before its connection is closed
/// regardless: a cancel that reached the server before the statement did cancels nothing.
const CANCEL_ROUNDS: usize = 3;

impl Canceller {
    /// Ends the statement running on `client`, which its caller abandoned: cancels it, and
    /// checks that the connection answers again (the statement ended), once more if not.
    ///
    /// Every abandoned statement is cancelled, not only the first few: a commit waiting for a
    /// synchronous standby ends only on a cancel (or the backend's termination), never when
    /// its connection closes, so a statement closed without one would keep its backend, its
    /// locks and a connection slot until the standby confirms (and the pool, replacing the
    /// connection, would do it again at every timeout until the server refused connections).
    /// At most [`CANCEL_CONNECTIONS`] are sent at once; the others wait for a turn, up to
    /// `timeout`: a server that answers cancels clears thousands a second, and one that
    /// does not (stalled) is not helped by more connections; past that wait, the connection is
    /// closed without a cancel, and the session's `statement_timeout` ends what is not a commit.
    async fn end(self, client: ClientWrapper, timeout: Duration) {
        let permit = match tokio::time::timeout(timeout, self.permits.clone().acquire_owned()).await
        {
            Ok(Ok(permit)) => permit,
            _ => {
                #[cfg(feature = "metrics")]
                metrics::counter!("idempotency_layer_store_cancels_skipped_total", "store" => "postgres")
                    .increment(1);
                tracing::warn!(
                    "idempotency: no postgres cancel could be sent within {timeout:?} ({} in \
                     flight); closing this abandoned statement's connection without one",
                    CANCEL_CONNECTIONS
                );
                return;
            }
        };
        let token = client.cancel_token();
        for _ in 0..CANCEL_ROUNDS {
            match tokio::time::timeout(timeout, self.send(&token)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "idempotency: cancelling an abandoned postgres statement failed");
                    break;
                }
                Err(_) => {
                    tracing::debug!(
                        "idempotency: cancelling an abandoned postgres statement timed out"
                    );
                    break;
                }
            }
            // An empty query is answered once the statement before it ended.
            if let Ok(Ok(_)) = tokio::time::timeout(timeout, client.simple_query("")).await {
                break;
            }
        }
        drop(permit);
    }
}

/// True for an error after which the connection should not be reused: the server is
/// read-only (a primary that failed over and is now a standby: SQLSTATE 25006), is shutting
/// down or was shut down (57P01, 57P02, 57P03), or the connection itself is closed.
pub(super) fn discards_connection(e: &tokio_postgres::Error) -> bool {
    e.is_closed() || server_changed_role(e)
}

/// True for an error that says the server is no longer a primary this store can write to.
fn server_changed_role(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::READ_ONLY_SQL_TRANSACTION
            || *c == SqlState::ADMIN_SHUTDOWN
            || *c == SqlState::CRASH_SHUTDOWN
            || *c == SqlState::CANNOT_CONNECT_NOW
    )
}

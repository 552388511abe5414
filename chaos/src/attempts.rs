//! Each HTTP attempt an operation's retry layer sends, while the operation runs: when it
//! started and how it ended, the connection hyper-util handed it, whether hyper's connection
//! task ever took its request, and when its request body was dropped. A watchdog reports
//! attempts that wait far longer than any answer should take, and attempts still pending after
//! their connection is gone, with what the fault proxy saw at that moment (a stranded request).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};

use crate::conn_trace::ConnTag;
use tower::Service;
use tracing::Instrument;

/// What became of one attempt's request inside hyper.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    /// When hyper's connection task first looked at the request body: it does when it takes
    /// the request from its dispatch channel (`size_hint`, `is_end_stream`), before h2 opens a
    /// stream for it.
    body_taken: Mutex<Option<Instant>>,
    /// When the request body was dropped.
    body_dropped: Mutex<Option<Instant>>,
    /// When the attempt's future was dropped before it finished (the layer gave up on it).
    future_dropped: Mutex<Option<Instant>>,
}

/// One attempt: when it was handed to the transport, and how it ended.
#[derive(Debug, Clone)]
struct Attempt {
    started: Instant,
    ended: Option<(Instant, String)>,
    reported: bool,
    suspect: bool,
    /// The connection hyper-util hands the request to, once it does.
    connection: CaptureConnection,
    watch: Arc<Watch>,
}

/// An attempt still pending after the connection it was handed to is gone.
#[derive(Debug, Clone)]
pub(crate) struct Suspect {
    pub(crate) key: String,
    pub(crate) n: usize,
    pub(crate) started: Instant,
    pub(crate) conn: ConnTag,
    pub(crate) conn_dropped: Instant,
    pub(crate) watch: Arc<Watch>,
}

impl Suspect {
    /// One line: what became of the attempt, times from its start.
    pub(crate) fn describe(&self) -> String {
        let since = |t: Option<Instant>| {
            t.map_or("never".to_owned(), |t| {
                format!("+{:?}", t.saturating_duration_since(self.started))
            })
        };
        format!(
            "{} attempt {}: handed to connection {} (port {}); connection dropped by hyper {}; request taken by hyper's connection task: {}; body dropped: {}; attempt future dropped unfinished: {}",
            self.key,
            self.n,
            self.conn.id,
            self.conn.port,
            since(Some(self.conn_dropped)),
            since(*self.watch.body_taken.lock().unwrap()),
            since(*self.watch.body_dropped.lock().unwrap()),
            since(*self.watch.future_dropped.lock().unwrap()),
        )
    }

    /// True once the attempt's request body is gone.
    pub(crate) fn body_dropped(&self) -> bool {
        self.watch.body_dropped.lock().unwrap().is_some()
    }
}

/// The connection a capture holds, if hyper-util handed one.
fn tag(connection: &CaptureConnection) -> Option<ConnTag> {
    connection.connection_metadata().as_ref().map(|c| {
        let mut ext = http::Extensions::new();
        c.get_extras(&mut ext);
        ext.get::<ConnTag>()
            .copied()
            .unwrap_or(ConnTag { id: 0, port: 0 })
    })
}

/// The attempts of the operations in flight, by idempotency key.
#[derive(Debug, Clone, Default)]
pub(crate) struct AttemptLog {
    ops: Arc<Mutex<HashMap<String, Vec<Attempt>>>>,
    off: bool,
    /// The client's connections, as the client sees them.
    pub(crate) conns: crate::conn_trace::ConnLog,
}

impl AttemptLog {
    /// A log that records nothing (for clients whose operations do not report their end).
    pub(crate) fn off() -> Self {
        AttemptLog {
            off: true,
            ..AttemptLog::default()
        }
    }

    fn started(&self, key: &str, connection: CaptureConnection, watch: Arc<Watch>) -> usize {
        let mut ops = self.ops.lock().unwrap();
        let attempts = ops.entry(key.to_owned()).or_default();
        attempts.push(Attempt {
            started: Instant::now(),
            ended: None,
            reported: false,
            suspect: false,
            connection,
            watch,
        });
        attempts.len() - 1
    }

    fn ended(&self, key: &str, n: usize, how: String) {
        if let Some(a) = self
            .ops
            .lock()
            .unwrap()
            .get_mut(key)
            .and_then(|a| a.get_mut(n))
        {
            a.ended = Some((Instant::now(), how));
        }
    }

    /// The operation ended: its attempts are forgotten.
    pub(crate) fn finish(&self, key: &str) {
        self.ops.lock().unwrap().remove(key);
    }

    /// Attempts not reported yet that are still pending although the connection hyper-util
    /// handed them was dropped by hyper more than `gone_for` ago: once a connection is gone,
    /// every request on it must fail at once, so these wait for something that cannot come.
    pub(crate) fn suspects(&self, gone_for: Duration) -> Vec<Suspect> {
        let now = Instant::now();
        let mut out = Vec::new();
        for (key, attempts) in self.ops.lock().unwrap().iter_mut() {
            for (n, a) in attempts.iter_mut().enumerate() {
                if a.ended.is_some() || a.suspect {
                    continue;
                }
                let Some(conn) = tag(&a.connection) else {
                    continue;
                };
                let Some(dropped) = self.conns.dropped_at(conn.id) else {
                    continue;
                };
                if now.saturating_duration_since(dropped) < gone_for {
                    continue;
                }
                a.suspect = true;
                out.push(Suspect {
                    key: key.clone(),
                    n,
                    started: a.started,
                    conn,
                    conn_dropped: dropped,
                    watch: a.watch.clone(),
                });
            }
        }
        out
    }

    /// Operations with an attempt pending longer than `longer_than` not reported yet, with
    /// every attempt of theirs (each reported once), and when the earliest pending one started.
    pub(crate) fn stuck(&self, longer_than: Duration) -> (Vec<String>, Option<Instant>) {
        let now = Instant::now();
        let mut out = Vec::new();
        let mut earliest: Option<Instant> = None;
        for (key, attempts) in self.ops.lock().unwrap().iter_mut() {
            let stuck = attempts
                .iter()
                .any(|a| a.ended.is_none() && !a.reported && now - a.started > longer_than);
            if !stuck {
                continue;
            }
            for a in attempts.iter().filter(|a| a.ended.is_none()) {
                earliest = Some(earliest.map_or(a.started, |e| e.min(a.started)));
            }
            let lines: Vec<String> = attempts
                .iter_mut()
                .enumerate()
                .map(|(i, a)| {
                    a.reported = true;
                    match &a.ended {
                        Some((at, how)) => format!(
                            "attempt {i}: started {:?} ago, ended after {:?}: {how}",
                            now - a.started,
                            *at - a.started
                        ),
                        None => {
                            let on = match tag(&a.connection) {
                                None => {
                                    "no connection handed to it yet (hyper-util's pool)".to_owned()
                                }
                                Some(c) => format!(
                                    "sent to connection {} (port {}), which hyper {}; its request {}",
                                    c.id,
                                    c.port,
                                    if self.conns.holds(c.id) {
                                        "still holds"
                                    } else {
                                        "has dropped"
                                    },
                                    if a.watch.body_taken.lock().unwrap().is_some() {
                                        "was taken by hyper's connection task"
                                    } else {
                                        "was never taken by hyper's connection task"
                                    }
                                ),
                            };
                            format!(
                                "attempt {i}: started {:?} ago, pending: {on}",
                                now - a.started
                            )
                        }
                    }
                })
                .collect();
            out.push(format!("{key}:\n  {}", lines.join("\n  ")));
        }
        (out, earliest)
    }
}

/// Records every attempt sent through it in an [`AttemptLog`], and wraps its body in a
/// [`TracedBody`].
#[derive(Debug, Clone)]
pub(crate) struct Attempts<S> {
    inner: S,
    log: AttemptLog,
}

impl<S> Attempts<S> {
    pub(crate) fn new(inner: S, log: AttemptLog) -> Self {
        Attempts { inner, log }
    }
}

impl<S, B, R> Service<Request<B>> for Attempts<S>
where
    S: Service<Request<TracedBody<B>>, Response = Response<R>>,
    S::Error: std::fmt::Debug,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let key = req
            .headers()
            .get("x-idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let watch = Arc::new(Watch::default());
        let (parts, body) = req.into_parts();
        let mut req = Request::from_parts(
            parts,
            TracedBody {
                inner: body,
                watch: watch.clone(),
                key: key.clone(),
            },
        );
        if self.log.off {
            return Box::pin(self.inner.call(req));
        }
        let connection = capture_connection(&mut req);
        let n = self.log.started(&key, connection, watch.clone());
        let span = tracing::trace_span!("attempt", key = %key, n);
        let future = span
            .in_scope(|| self.inner.call(req))
            .instrument(span.clone());
        span.in_scope(|| tracing::trace!("attempt {key}#{n} handed to hyper-util"));
        let mut guard = Unfinished {
            watch,
            key,
            n,
            done: false,
        };
        let log = self.log.clone();
        Box::pin(async move {
            let result = future.await;
            let how = match &result {
                Ok(res) => format!("HTTP {}", res.status().as_u16()),
                Err(e) => format!("error: {e:?}"),
            };
            tracing::trace!("attempt {}#{} ended: {how}", guard.key, guard.n);
            log.ended(&guard.key, guard.n, how);
            guard.disarm();
            result
        })
    }
}

/// Notes when an attempt's future is dropped before it finished.
struct Unfinished {
    watch: Arc<Watch>,
    key: String,
    n: usize,
    done: bool,
}

impl Unfinished {
    /// The attempt finished: nothing to note at the drop.
    fn disarm(&mut self) {
        self.done = true;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.done {
            *self.watch.future_dropped.lock().unwrap() = Some(Instant::now());
            let (key, n) = (&self.key, self.n);
            tracing::trace!("attempt {key}#{n} future dropped unfinished");
        }
    }
}

/// A request body that notes when hyper first looks at it and when it is dropped.
#[derive(Debug)]
pub(crate) struct TracedBody<B> {
    inner: B,
    watch: Arc<Watch>,
    key: String,
}

impl<B> TracedBody<B> {
    fn taken(&self) {
        let mut taken = self.watch.body_taken.lock().unwrap();
        if taken.is_none() {
            *taken = Some(Instant::now());
            drop(taken);
            let key = &self.key;
            tracing::trace!("attempt {key} body taken by hyper");
        }
    }
}

impl<B> Drop for TracedBody<B> {
    fn drop(&mut self) {
        *self.watch.body_dropped.lock().unwrap() = Some(Instant::now());
        let key = &self.key;
        tracing::trace!("attempt {key} body dropped");
    }
}

impl<B: Body + Unpin> Body for TracedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        this.taken();
        Pin::new(&mut this.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.taken();
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.taken();
        self.inner.size_hint()
    }
}

/// Spawns hyper's tasks (a connection's tasks, a request's response task) on tokio in a span
/// that is a child of the span current at the spawn: the attempt that opened the connection or
/// sent the request, so that a trace tells a connection's events from another's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpanExec;

impl<F> hyper::rt::Executor<F> for SpanExec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let span = tracing::trace_span!("spawned");
        tokio::spawn(fut.instrument(span));
    }
}

//! Each HTTP attempt an operation's retry layer sends, while the operation runs: when it
//! started and how it ended. A watchdog reports attempts that wait far longer than any answer
//! should take, with what the fault proxy saw at that moment (F7).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection};

use crate::conn_trace::LocalPort;
use tower::Service;

/// One attempt: when it was handed to the transport, and how it ended.
#[derive(Debug, Clone)]
struct Attempt {
    started: Instant,
    ended: Option<(Instant, String)>,
    reported: bool,
    /// The connection hyper-util hands the request to, once it does.
    connection: CaptureConnection,
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

    fn started(&self, key: &str, connection: CaptureConnection) -> usize {
        let mut ops = self.ops.lock().unwrap();
        let attempts = ops.entry(key.to_owned()).or_default();
        attempts.push(Attempt {
            started: Instant::now(),
            ended: None,
            reported: false,
            connection,
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
                            let port = a.connection.connection_metadata().as_ref().map(|c| {
                                let mut ext = http::Extensions::new();
                                c.get_extras(&mut ext);
                                ext.get::<LocalPort>().map_or(0, |p| p.0)
                            });
                            let on = match port {
                                None => {
                                    "no connection handed to it yet (hyper-util's pool)".to_owned()
                                }
                                Some(p) => format!(
                                    "sent on the connection from port {p}, which hyper {}",
                                    if self.conns.holds(p) {
                                        "still holds"
                                    } else {
                                        "has dropped"
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

/// Records every attempt sent through it in an [`AttemptLog`].
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
    S: Service<Request<B>, Response = Response<R>>,
    S::Error: std::fmt::Debug,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let key = req
            .headers()
            .get("x-idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        if self.log.off {
            return Box::pin(self.inner.call(req));
        }
        let connection = capture_connection(&mut req);
        let future = self.inner.call(req);
        let n = self.log.started(&key, connection);
        let log = self.log.clone();
        Box::pin(async move {
            let result = future.await;
            let how = match &result {
                Ok(res) => format!("HTTP {}", res.status().as_u16()),
                Err(e) => format!("error: {e:?}"),
            };
            log.ended(&key, n, how);
            result
        })
    }
}

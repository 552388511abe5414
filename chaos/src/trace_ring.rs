//! With `CHAOS_TRACE=<filter>` (for example `h2=trace,hyper=trace,hyper_util=trace,chaos=trace`),
//! the soak keeps the last events of those crates in memory (`CHAOS_TRACE_KEEP` events, default
//! 1 000 000). With `chaos=trace` the soak's own events come too: each client connection's
//! open, end of stream and drop, and each HTTP attempt's start, the moment hyper's connection
//! task takes its request (it looks at the body), the body's drop and the attempt's end; every
//! event of a task hyper spawns carries the span of the attempt that spawned it (so a
//! connection's tasks carry the span of the attempt that opened it). The watchdog writes the
//! events around a stuck attempt to a file (a stranded request): what the client's HTTP/2 stack did then.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The ring's size in events, unless `CHAOS_TRACE_KEEP` says otherwise.
const KEPT: usize = 1_000_000;

/// The events kept, each with when it happened.
type Ring = Arc<Mutex<VecDeque<(Instant, String)>>>;

static RING: OnceLock<(Ring, usize)> = OnceLock::new();

/// Installs the ring as the global subscriber when `CHAOS_TRACE` is set.
pub(crate) fn install_from_env() {
    let Ok(filter) = std::env::var("CHAOS_TRACE") else {
        return;
    };
    let kept = std::env::var("CHAOS_TRACE_KEEP")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(KEPT);
    let ring = RING.get_or_init(|| (Arc::default(), kept)).0.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_thread_ids(true)
        .without_time()
        .with_writer(move || RingWriter {
            ring: ring.clone(),
            line: Vec::new(),
        })
        .finish();
    let _ = tracing_subscriber::util::SubscriberInitExt::try_init(subscriber);
}

/// True when the ring keeps events.
pub(crate) fn enabled() -> bool {
    RING.get().is_some()
}

fn push(ring: &Ring, kept: usize, line: String) {
    let mut ring = ring.lock().unwrap();
    if ring.len() >= kept {
        ring.pop_front();
    }
    ring.push_back((Instant::now(), line));
}

/// The events from `at - before` to `at + after`, one per line with its offset from `at`.
pub(crate) fn around(at: Instant, before: Duration, after: Duration) -> String {
    between(at, at - before, at + after)
}

/// The events from `from` to `to`, one per line with its offset from `at`; and first, when the
/// ring no longer holds events from `from` on, a line that says so.
pub(crate) fn between(at: Instant, from: Instant, to: Instant) -> String {
    let Some((ring, _)) = RING.get() else {
        return String::new();
    };
    let ring = ring.lock().unwrap();
    let mut out = String::new();
    if let Some((oldest, _)) = ring.front() {
        if *oldest > from {
            out.push_str(&format!(
                "(the ring's oldest event is {:?} after the window's start)\n",
                *oldest - from
            ));
        }
    }
    for (t, line) in ring.iter() {
        if *t >= from && *t <= to {
            let offset = if *t >= at {
                format!("+{:?}", *t - at)
            } else {
                format!("-{:?}", at - *t)
            };
            out.push_str(&format!("{offset} {line}"));
        }
    }
    out
}

struct RingWriter {
    ring: Ring,
    line: Vec<u8>,
}

impl Write for RingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        let line = String::from_utf8_lossy(&self.line).into_owned();
        let kept = RING.get().map_or(KEPT, |(_, k)| *k);
        push(&self.ring, kept, line);
    }
}

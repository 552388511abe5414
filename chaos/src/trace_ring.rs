//! With `CHAOS_TRACE=<filter>` (for example `h2=trace,hyper=trace,hyper_util=trace`), the
//! soak keeps the last events of those crates in memory, and the watchdog prints the ones
//! around a stuck attempt's start (F7): what the client's HTTP/2 stack did then.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The ring's size in events.
const KEPT: usize = 400_000;

/// The events kept, each with when it happened.
type Ring = Arc<Mutex<VecDeque<(Instant, String)>>>;

static RING: OnceLock<Ring> = OnceLock::new();

/// Installs the ring as the global subscriber when `CHAOS_TRACE` is set.
pub(crate) fn install_from_env() {
    let Ok(filter) = std::env::var("CHAOS_TRACE") else {
        return;
    };
    let ring = RING.get_or_init(Arc::default).clone();
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

/// The events from `from` to `to` after `at`, one per line with its offset from `at`.
pub(crate) fn around(at: Instant, before: Duration, after: Duration) -> String {
    let Some(ring) = RING.get() else {
        return String::new();
    };
    let ring = ring.lock().unwrap();
    let mut out = String::new();
    for (t, line) in ring.iter() {
        if *t + before >= at && *t <= at + after {
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
    ring: Arc<Mutex<VecDeque<(Instant, String)>>>,
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
        let mut ring = self.ring.lock().unwrap();
        if ring.len() == KEPT {
            ring.pop_front();
        }
        ring.push_back((Instant::now(), line));
    }
}

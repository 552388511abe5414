//! The call's deadline: where it comes from ([`Deadline`], `grpc-timeout`, `total_timeout`),
//! the `grpc-timeout` each attempt carries, and the one timer a response future waits on.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use http::request::Parts;
use http::HeaderValue;
use reason_code::{encode_grpc_timeout, parse_grpc_timeout, single, GRPC_TIMEOUT};
use tokio::time::{sleep_until, Instant, Sleep};

/// A deadline for the whole call, retries included, set as a request extension. It takes
/// precedence over `grpc-timeout` and the policy's `total_timeout`.
///
/// ```
/// use std::time::Duration;
/// use retry_layer::Deadline;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Deadline::after(Duration::from_millis(300)));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(pub Instant);

impl Deadline {
    /// A deadline `d` from now (tokio's clock: paused time in tests moves it). A `d` too large
    /// for the clock (`Duration::MAX`) means "no deadline in practice": about 30 years.
    pub fn after(d: Duration) -> Self {
        Deadline(instant_after(Instant::now(), d))
    }
}

/// `now + d` without overflow: a sum the clock cannot hold becomes about 30 years from now.
pub(crate) fn instant_after(now: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    now.checked_add(d.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// The call's deadline: the [`Deadline`] extension, else `grpc-timeout` (gRPC only), else the
/// policy's total timeout.
pub(crate) fn deadline_of(parts: &Parts, grpc: bool, total: Option<Duration>) -> Option<Instant> {
    if let Some(Deadline(d)) = parts.extensions.get::<Deadline>() {
        return Some(*d);
    }
    if grpc {
        match single(&parts.headers, "grpc-timeout") {
            Ok(Some(v)) => match parse_grpc_timeout(v) {
                Ok(d) => return Some(instant_after(Instant::now(), d)),
                Err(e) => tracing::warn!(error = %e, "ignoring malformed grpc-timeout"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "ignoring repeated grpc-timeout"),
        }
    }
    total.map(|t| instant_after(Instant::now(), t))
}

/// Writes an attempt's `grpc-timeout`: the time left before the deadline, capped at the
/// attempt timeout (the client abandons the attempt then, so the server should stop too).
/// Without either, the header is left as it is.
pub(crate) fn rewrite_grpc_timeout(
    parts: &mut Parts,
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
) {
    if let Some(t) = grpc_timeout(deadline, attempt_timeout) {
        parts.headers.insert(GRPC_TIMEOUT, t);
    }
}

fn grpc_timeout(
    deadline: Option<Instant>,
    attempt_timeout: Option<Duration>,
) -> Option<HeaderValue> {
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    let t = match (left, attempt_timeout) {
        (Some(l), Some(a)) => l.min(a),
        (l, a) => l.or(a)?,
    };
    Some(encode_grpc_timeout(t))
}

/// The one timer of a response future: the attempt's end while an attempt runs, the backoff
/// while waiting, the deadline while waiting for readiness or the rebuild hook.
///
/// Boxed: a `Sleep` is larger than the rest of the future, and the common path (no deadline, no
/// attempt timeout, first attempt succeeds) never makes one, so the future that is moved on
/// every call stays small.
#[derive(Debug, Default)]
pub(crate) struct Timer(Option<Pin<Box<Sleep>>>);

impl Timer {
    /// An attempt's timer: the earlier of the deadline and the attempt timeout; none without
    /// either.
    pub(crate) fn for_attempt(
        deadline: Option<Instant>,
        attempt_timeout: Option<Duration>,
    ) -> Self {
        let per_attempt = attempt_timeout.map(|t| instant_after(Instant::now(), t));
        let end = match (deadline, per_attempt) {
            (Some(d), Some(a)) => Some(d.min(a)),
            (d, a) => d.or(a),
        };
        Timer(end.map(|end| Box::pin(sleep_until(end))))
    }

    /// Points the timer at `until`, making it if there is none yet.
    pub(crate) fn set(&mut self, until: Instant) {
        match self.0.as_mut() {
            Some(t) => t.as_mut().reset(until),
            None => self.0 = Some(Box::pin(sleep_until(until))),
        }
    }

    /// Points the timer at the deadline, or removes it when there is none: what waiting for
    /// readiness and for the rebuild hook is bounded by.
    pub(crate) fn set_to_deadline(&mut self, deadline: Option<Instant>) {
        match deadline {
            Some(d) => self.set(d),
            None => self.0 = None,
        }
    }

    /// True when the timer exists and has fired (registers a wake-up otherwise).
    pub(crate) fn fired(&mut self, cx: &mut Context<'_>) -> bool {
        match self.0.as_mut() {
            Some(t) => t.as_mut().poll(cx).is_ready(),
            None => false,
        }
    }

    /// True when there is no timer or it has fired: a wait on it is over.
    pub(crate) fn elapsed_or_unset(&mut self, cx: &mut Context<'_>) -> bool {
        self.0.is_none() || self.fired(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&'static str, &'static str)]) -> Parts {
        let mut req = http::Request::new(());
        for (k, v) in headers {
            req.headers_mut().insert(*k, HeaderValue::from_static(v));
        }
        req.into_parts().0
    }

    #[tokio::test(start_paused = true)]
    async fn where_the_deadline_comes_from() {
        let now = Instant::now();
        let total = Some(Duration::from_secs(9));
        // The extension wins over grpc-timeout and the total timeout.
        let mut p = parts(&[("grpc-timeout", "1S")]);
        p.extensions.insert(Deadline(now + Duration::from_secs(3)));
        assert_eq!(
            deadline_of(&p, true, total),
            Some(now + Duration::from_secs(3))
        );
        // grpc-timeout, on gRPC calls only.
        let p = parts(&[("grpc-timeout", "1S")]);
        assert_eq!(
            deadline_of(&p, true, total),
            Some(now + Duration::from_secs(1))
        );
        assert_eq!(
            deadline_of(&p, false, total),
            Some(now + Duration::from_secs(9))
        );
        // A malformed grpc-timeout is ignored.
        let p = parts(&[("grpc-timeout", "soon")]);
        assert_eq!(
            deadline_of(&p, true, total),
            Some(now + Duration::from_secs(9))
        );
        assert_eq!(deadline_of(&p, true, None), None);
    }

    #[tokio::test(start_paused = true)]
    async fn grpc_timeout_is_what_is_left_capped_at_the_attempt_timeout() {
        let deadline = Some(Instant::now() + Duration::from_millis(800));
        let mut p = parts(&[("grpc-timeout", "10S")]);
        rewrite_grpc_timeout(&mut p, deadline, None);
        assert_eq!(
            p.headers[GRPC_TIMEOUT],
            encode_grpc_timeout(Duration::from_millis(800))
        );
        rewrite_grpc_timeout(&mut p, deadline, Some(Duration::from_millis(300)));
        assert_eq!(
            p.headers[GRPC_TIMEOUT],
            encode_grpc_timeout(Duration::from_millis(300))
        );
        let mut p = parts(&[("grpc-timeout", "10S")]);
        rewrite_grpc_timeout(&mut p, None, None);
        assert_eq!(p.headers[GRPC_TIMEOUT], "10S", "nothing to rewrite with");
    }

    #[test]
    fn instant_after_never_overflows() {
        let now = Instant::now();
        assert!(instant_after(now, Duration::MAX) > now);
        assert_eq!(
            instant_after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}

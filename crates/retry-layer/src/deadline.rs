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

/// The call's deadline: the earliest of the [`Deadline`] extension, `grpc-timeout` (gRPC only)
/// and the policy's total timeout. A source never extends a shorter one.
pub(crate) fn deadline_of(parts: &Parts, grpc: bool, total: Option<Duration>) -> Option<Instant> {
    let extension = parts.extensions.get::<Deadline>().map(|d| d.0);
    let inbound = if grpc { grpc_timeout_of(parts) } else { None };
    let total = total.map(|t| instant_after(Instant::now(), t));
    [extension, inbound, total].into_iter().flatten().min()
}

/// The deadline a request's `grpc-timeout` sets; a malformed or repeated one is ignored with a
/// warning.
fn grpc_timeout_of(parts: &Parts) -> Option<Instant> {
    match single(&parts.headers, "grpc-timeout") {
        Ok(Some(v)) => match parse_grpc_timeout(v) {
            Ok(d) => Some(instant_after(Instant::now(), d)),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring malformed grpc-timeout");
                None
            }
        },
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, "ignoring repeated grpc-timeout");
            None
        }
    }
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

/// What a [`Timer`] bounds when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Bound {
    /// The call's deadline.
    #[default]
    Deadline,
    /// The policy's `attempt_timeout`.
    Attempt,
    /// The policy's `response_head_timeout`, counted from when the wait began.
    Head,
    /// A backoff or pushback delay.
    Delay,
}

/// An attempt's bounds before its first wait: the earlier of the deadline and the attempt
/// timeout (with which it is), and the head bound, counted from that wait.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttemptBounds {
    end: Option<(Instant, Bound)>,
    head_timeout: Duration,
}

impl AttemptBounds {
    /// The bounds of an attempt sent now: the earliest of the deadline, the attempt timeout and
    /// the head bound (counted from the attempt's first wait).
    pub(crate) fn new(
        deadline: Option<Instant>,
        attempt_timeout: Option<Duration>,
        head_timeout: Duration,
    ) -> Self {
        let per_attempt = attempt_timeout.map(|t| instant_after(Instant::now(), t));
        let end = match (deadline, per_attempt) {
            (Some(d), Some(a)) if a < d => Some((a, Bound::Attempt)),
            (Some(d), _) => Some((d, Bound::Deadline)),
            (None, a) => a.map(|a| (a, Bound::Attempt)),
        };
        AttemptBounds { end, head_timeout }
    }

    /// The bound of a wait for the inner service to become ready: the call's deadline, else
    /// the head bound (counted from the wait's start).
    pub(crate) fn readiness(deadline: Option<Instant>, head_timeout: Duration) -> Self {
        match deadline {
            Some(d) => AttemptBounds {
                end: Some((d, Bound::Deadline)),
                head_timeout: Duration::MAX,
            },
            None => AttemptBounds {
                end: None,
                head_timeout,
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// The one timer of a response future: the attempt's end while an attempt runs, the
    /// backoff while waiting, the deadline (or the head bound) while waiting for readiness or
    /// the rebuild hook.
    ///
    /// Made only when a wait begins (an inner service whose future is ready at once, a mock or
    /// a cache, never touches the timer wheel), in place in the pinned future, and kept for the
    /// call's later waits (reset, not made again): no allocation, and the only timer-wheel
    /// work is the registration itself.
    #[derive(Debug, Default)]
    pub(crate) struct Timer {
        #[pin]
        sleep: Option<Sleep>,
        // The attempt's bounds until its first wait arms them.
        unarmed: Option<AttemptBounds>,
        bound: Bound,
    }
}

impl Timer {
    /// An attempt's timer, armed at its first wait.
    pub(crate) fn for_attempt(bounds: AttemptBounds) -> Self {
        Timer {
            sleep: None,
            unarmed: Some(bounds),
            bound: Bound::Deadline,
        }
    }

    /// The next attempt's bounds, armed at its first wait (the timer itself is kept).
    pub(crate) fn next_attempt(self: Pin<&mut Self>, bounds: AttemptBounds) {
        let this = self.project();
        *this.unarmed = Some(bounds);
        *this.bound = Bound::Deadline;
    }

    /// What the timer bounds (once it has fired: what ended the wait).
    pub(crate) fn bound(&self) -> Bound {
        self.bound
    }

    /// Points the timer at `until`, a wait that `bound` ends, making it if there is none yet.
    fn arm(self: Pin<&mut Self>, until: Instant, bound: Bound) {
        let mut this = self.project();
        *this.unarmed = None;
        *this.bound = bound;
        match this.sleep.as_mut().as_pin_mut() {
            Some(t) => t.reset(until),
            None => this.sleep.set(Some(sleep_until(until))),
        }
    }

    /// Points the timer at the end of a backoff or pushback delay.
    pub(crate) fn set_delay(self: Pin<&mut Self>, until: Instant) {
        self.arm(until, Bound::Delay);
    }

    /// Points the timer at the bound of a wait for the inner service to become ready: the
    /// call's deadline, else `head_timeout` from now.
    pub(crate) fn set_to_ready_bound(
        self: Pin<&mut Self>,
        deadline: Option<Instant>,
        head_timeout: Duration,
    ) {
        match deadline {
            Some(d) => self.arm(d, Bound::Deadline),
            None => self.arm(instant_after(Instant::now(), head_timeout), Bound::Head),
        }
    }

    /// Points the timer at the deadline, or at `head_timeout` from now if that is earlier or
    /// there is no deadline: what waiting for the rebuild hook is bounded by.
    pub(crate) fn set_to_deadline(
        self: Pin<&mut Self>,
        deadline: Option<Instant>,
        head_timeout: Duration,
    ) {
        let head = instant_after(Instant::now(), head_timeout);
        match deadline {
            Some(d) if d <= head => self.arm(d, Bound::Deadline),
            _ => self.arm(head, Bound::Head),
        }
    }

    /// True when the timer has fired (registers a wake-up otherwise). An attempt's timer is
    /// armed here, at its first wait.
    pub(crate) fn fired(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> bool {
        if let Some(bounds) = self.as_mut().project().unarmed.take() {
            let head = instant_after(Instant::now(), bounds.head_timeout);
            match bounds.end {
                Some((end, bound)) if end <= head => self.as_mut().arm(end, bound),
                _ => self.as_mut().arm(head, Bound::Head),
            }
        }
        match self.project().sleep.as_pin_mut() {
            Some(t) => t.poll(cx).is_ready(),
            None => false,
        }
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
        // The earliest source wins: an extension never extends a shorter grpc-timeout.
        let mut p = parts(&[("grpc-timeout", "1S")]);
        p.extensions.insert(Deadline(now + Duration::from_secs(3)));
        assert_eq!(
            deadline_of(&p, true, total),
            Some(now + Duration::from_secs(1))
        );
        p.extensions
            .insert(Deadline(now + Duration::from_millis(500)));
        assert_eq!(
            deadline_of(&p, true, total),
            Some(now + Duration::from_millis(500))
        );
        assert_eq!(
            deadline_of(&p, true, Some(Duration::from_millis(200))),
            Some(now + Duration::from_millis(200))
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

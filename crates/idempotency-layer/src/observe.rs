//! What the layer tells the outside: a span per write and metrics (feature `metrics`).
//!
//! Without the `metrics` feature the metric functions are empty and inlined away, and
//! [`timed`] returns the store's future as it is. With it, each counter is incremented under a
//! `static` key (the label values are the reasons' and stores' own `&'static str`), so counting
//! allocates nothing; a store operation reads the clock twice.

use std::future::Future;

use tracing::field::Empty;
use tracing::Span;

use crate::reject::RejectReason;
use crate::store::Backend;

/// A store operation: the `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Begin,
    Wait,
    Complete,
    Release,
    /// A lease renewed by the write itself (a `begin` answered late); the renewal task's own
    /// batches are not timed.
    Renew,
}

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
impl Op {
    const ALL: [Op; 5] = [Op::Begin, Op::Wait, Op::Complete, Op::Release, Op::Renew];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Op::Begin => "begin",
            Op::Wait => "wait",
            Op::Complete => "complete",
            Op::Release => "release",
            Op::Renew => "renew",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The span of a write

/// How a write ended: the `idempotency.outcome` attribute of its span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    /// The handler ran (this request led, or the store failed and `fail_open` is set).
    Executed,
    /// The recorded response was replayed at once.
    Replayed,
    /// The request waited for the one in flight, then replayed its record.
    Waited,
    /// The request waited for the one in flight, which failed: it got the same failure.
    SharedFailure,
    /// The layer answered with a rejection.
    Rejected,
}

impl WriteOutcome {
    const fn as_str(self) -> &'static str {
        match self {
            WriteOutcome::Executed => "executed",
            WriteOutcome::Replayed => "replayed",
            WriteOutcome::Waited => "waited",
            WriteOutcome::SharedFailure => "shared_failure",
            WriteOutcome::Rejected => "rejected",
        }
    }
}

/// The span of one write (a request the layer manages): `Span::none()`, with no field
/// evaluated, unless a subscriber enables DEBUG for this crate.
pub(crate) fn write_span(method: &http::Method, path: &str, grpc: bool) -> Span {
    // No tracing subscriber at all: no span. (With tracing's `log` feature, which axum's
    // default `tower-log` turns on, a disabled span would otherwise evaluate every field and
    // hand it to `log`: a few hundred instructions a write, for lines nobody asked for.
    // Events still reach `log`.)
    if !tracing::dispatcher::has_been_set() {
        return Span::none();
    }
    if grpc {
        tracing::debug_span!(
            "idempotency_layer.write",
            rpc.system = "grpc",
            rpc.method = path,
            idempotency.outcome = Empty,
            idempotency.reject_reason = Empty,
        )
    } else {
        tracing::debug_span!(
            "idempotency_layer.write",
            http.request.method = %method,
            url.path = path,
            idempotency.outcome = Empty,
            idempotency.reject_reason = Empty,
        )
    }
}

/// Records how the write of `span` ended.
pub(crate) fn record_outcome(span: &Span, outcome: WriteOutcome) {
    span.record("idempotency.outcome", outcome.as_str());
}

/// Records that the write of `span` was rejected for `reason`.
pub(crate) fn record_rejection(span: &Span, reason: RejectReason) {
    if !span.is_disabled() {
        span.record("idempotency.outcome", WriteOutcome::Rejected.as_str());
        span.record("idempotency.reject_reason", reason.as_str());
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics

#[cfg(feature = "metrics")]
mod keys {
    //! Every key is a `static`, its hash computed at compile time.

    use metrics::{Key, Label, Level, Metadata};

    use super::{Backend, Op};
    use crate::reject::RejectReason;

    pub(super) static META: Metadata<'static> =
        Metadata::new("idempotency_layer", Level::INFO, Some("idempotency_layer"));

    pub(super) static EXECUTIONS: Key = Key::from_static_name("idempotency_layer_executions_total");
    pub(super) static REPLAYS: Key = Key::from_static_name("idempotency_layer_replays_total");
    pub(super) static WAITS: Key = Key::from_static_name("idempotency_layer_waits_total");
    pub(super) static RECORDS: Key = Key::from_static_name("idempotency_layer_records_total");
    pub(super) static RELEASES: Key = Key::from_static_name("idempotency_layer_releases_total");
    pub(super) static FAILED_OPEN: Key =
        Key::from_static_name("idempotency_layer_failed_open_total");
    pub(super) static SHARED_FAILURES: Key =
        Key::from_static_name("idempotency_layer_shared_failures_total");
    pub(super) static LAPSED: Key = Key::from_static_name("idempotency_layer_lapsed_total");
    pub(super) static DETACHED_REFUSED: Key =
        Key::from_static_name("idempotency_layer_detached_refused_total");
    pub(super) static IN_FLIGHT: Key = Key::from_static_name("idempotency_layer_in_flight");

    const fn reason(i: usize) -> [Label; 1] {
        [Label::from_static_parts(
            "reason",
            RejectReason::ALL[i].as_str(),
        )]
    }
    // Sized by `RejectReason::ALL`: a reason added there and not here does not compile.
    static REASON: [[Label; 1]; RejectReason::ALL.len()] = [
        reason(0),
        reason(1),
        reason(2),
        reason(3),
        reason(4),
        reason(5),
        reason(6),
        reason(7),
        reason(8),
        reason(9),
        reason(10),
        reason(11),
        reason(12),
        reason(13),
    ];
    macro_rules! by_reason {
        ($name:literal, [$($i:literal)*]) => {
            [$(Key::from_static_parts($name, &REASON[$i])),*]
        };
    }
    pub(super) static REJECTIONS: [Key; RejectReason::ALL.len()] =
        by_reason!("idempotency_layer_rejections_total", [0 1 2 3 4 5 6 7 8 9 10 11 12 13]);

    const fn op_store(op: usize, store: usize) -> [Label; 2] {
        [
            Label::from_static_parts("op", Op::ALL[op].as_str()),
            Label::from_static_parts("store", Backend::ALL[store].as_str()),
        ]
    }
    static OP_STORE: [[[Label; 2]; 4]; 5] = [
        [
            op_store(0, 0),
            op_store(0, 1),
            op_store(0, 2),
            op_store(0, 3),
        ],
        [
            op_store(1, 0),
            op_store(1, 1),
            op_store(1, 2),
            op_store(1, 3),
        ],
        [
            op_store(2, 0),
            op_store(2, 1),
            op_store(2, 2),
            op_store(2, 3),
        ],
        [
            op_store(3, 0),
            op_store(3, 1),
            op_store(3, 2),
            op_store(3, 3),
        ],
        [
            op_store(4, 0),
            op_store(4, 1),
            op_store(4, 2),
            op_store(4, 3),
        ],
    ];
    macro_rules! by_op_store {
        ($name:literal) => {
            by_op_store!(@ $name, [0 1 2 3 4])
        };
        (@ $name:literal, [$($op:literal)*]) => {
            [$([
                Key::from_static_parts($name, &OP_STORE[$op][0]),
                Key::from_static_parts($name, &OP_STORE[$op][1]),
                Key::from_static_parts($name, &OP_STORE[$op][2]),
                Key::from_static_parts($name, &OP_STORE[$op][3]),
            ]),*]
        };
    }
    pub(super) static STORE_ERRORS: [[Key; 4]; 5] =
        by_op_store!("idempotency_layer_store_errors_total");
    pub(super) static STORE_SECONDS: [[Key; 4]; 5] =
        by_op_store!("idempotency_layer_store_duration_seconds");
}

#[cfg(feature = "metrics")]
#[inline]
fn increment(key: &'static metrics::Key) {
    metrics::with_recorder(|r| r.register_counter(key, &keys::META).increment(1));
}

macro_rules! counter_fns {
    ($($(#[$doc:meta])* $name:ident => $key:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name() {
            #[cfg(feature = "metrics")]
            increment(&keys::$key);
        }
    )*};
}

counter_fns! {
    /// `idempotency_layer_executions_total`
    executed => EXECUTIONS;
    /// `idempotency_layer_replays_total`
    replayed => REPLAYS;
    /// `idempotency_layer_waits_total`
    waited => WAITS;
    /// `idempotency_layer_records_total`
    recorded => RECORDS;
    /// `idempotency_layer_releases_total`
    released => RELEASES;
    /// `idempotency_layer_failed_open_total`
    failed_open => FAILED_OPEN;
    /// `idempotency_layer_shared_failures_total`
    shared_failure => SHARED_FAILURES;
    /// `idempotency_layer_lapsed_total`
    lapsed => LAPSED;
    /// `idempotency_layer_detached_refused_total`
    detached_refused => DETACHED_REFUSED;
}

/// `idempotency_layer_in_flight` (a gauge): one more claim held (`+1`) or one fewer (`-1`).
#[inline]
pub(crate) fn in_flight(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|r| {
        r.register_gauge(&keys::IN_FLIGHT, &keys::META)
            .increment(delta)
    });
    #[cfg(not(feature = "metrics"))]
    let _ = delta;
}

/// `idempotency_layer_rejections_total{reason}`
#[inline]
pub(crate) fn rejected(reason: RejectReason) {
    #[cfg(feature = "metrics")]
    increment(&keys::REJECTIONS[reason.index()]);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}

/// `idempotency_layer_store_errors_total{op,store}`
#[inline]
pub(crate) fn store_error(op: Op, store: Backend) {
    #[cfg(feature = "metrics")]
    increment(&keys::STORE_ERRORS[op as usize][store as usize]);
    #[cfg(not(feature = "metrics"))]
    let _ = (op, store);
}

/// Times a store operation into `idempotency_layer_store_duration_seconds{op,store}` (successes and
/// failures alike), from its first poll to its answer. Without the `metrics` feature: `fut`
/// itself.
#[cfg(feature = "metrics")]
pub(crate) fn timed<F: Future>(op: Op, store: Backend, fut: F) -> Timed<F> {
    Timed {
        fut,
        start: None,
        key: &keys::STORE_SECONDS[op as usize][store as usize],
    }
}

#[cfg(feature = "metrics")]
pin_project_lite::pin_project! {
    /// [`timed`]'s future: the operation's own future and its start, with no more room. (An
    /// `async fn` held the operation twice, as its argument and as what it awaited: that put
    /// the boxed completion of a first execution past the allocator's fast sizes.)
    pub(crate) struct Timed<F> {
        #[pin]
        fut: F,
        start: Option<tokio::time::Instant>,
        key: &'static metrics::Key,
    }
}

#[cfg(feature = "metrics")]
impl<F: Future> Future for Timed<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let start = *this.start.get_or_insert_with(tokio::time::Instant::now);
        let out = std::task::ready!(this.fut.poll(cx));
        let seconds = start.elapsed().as_secs_f64();
        let key = *this.key;
        metrics::with_recorder(|r| r.register_histogram(key, &keys::META).record(seconds));
        std::task::Poll::Ready(out)
    }
}

/// Times a store operation into `idempotency_layer_store_duration_seconds{op,store}` (successes and
/// failures alike). Without the `metrics` feature: `fut` itself.
#[cfg(not(feature = "metrics"))]
#[inline]
pub(crate) fn timed<F: Future>(op: Op, store: Backend, fut: F) -> F {
    let _ = (op, store);
    fut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_enums_index_their_tables() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i);
        }
        for (i, s) in Backend::ALL.into_iter().enumerate() {
            assert_eq!(s as usize, i);
        }
        for (i, r) in RejectReason::ALL.into_iter().enumerate() {
            assert_eq!(r.index(), i);
        }
    }
}

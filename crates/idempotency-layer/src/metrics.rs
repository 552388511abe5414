//! Counters the layer keeps, readable at any time (for export to a metrics system).

use std::sync::atomic::{AtomicU64, Ordering};

/// Why a request was answered by the layer instead of the handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// A write without an idempotency key (400 / INVALID_ARGUMENT).
    MissingKey,
    /// A key that breaks a rule (400 / INVALID_ARGUMENT).
    InvalidKey,
    /// No tenant where one is required (401 / UNAUTHENTICATED).
    NoTenant,
    /// The key was used with another request (422 / FAILED_PRECONDITION).
    Mismatch,
    /// The request body is larger than `max_request_bytes` (413 / RESOURCE_EXHAUSTED).
    TooLarge,
    /// The request body could not be read (400 / INVALID_ARGUMENT).
    BadBody,
    /// A duplicate is in flight and the layer rejects, or the wait ran out (409 / ABORTED).
    InFlight,
    /// The store failed and the layer fails closed (503 / UNAVAILABLE).
    StoreUnavailable,
    /// The handler panicked or its task was lost (500 / INTERNAL).
    Internal,
}

impl RejectReason {
    /// Every reason, in declaration order.
    pub const ALL: [RejectReason; 9] = [
        RejectReason::MissingKey,
        RejectReason::InvalidKey,
        RejectReason::NoTenant,
        RejectReason::Mismatch,
        RejectReason::TooLarge,
        RejectReason::BadBody,
        RejectReason::InFlight,
        RejectReason::StoreUnavailable,
        RejectReason::Internal,
    ];

    /// A short snake_case name for metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::MissingKey => "missing_key",
            RejectReason::InvalidKey => "invalid_key",
            RejectReason::NoTenant => "no_tenant",
            RejectReason::Mismatch => "mismatch",
            RejectReason::TooLarge => "too_large",
            RejectReason::BadBody => "bad_body",
            RejectReason::InFlight => "in_flight",
            RejectReason::StoreUnavailable => "store_unavailable",
            RejectReason::Internal => "internal",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    executed: AtomicU64,
    replayed: AtomicU64,
    waited: AtomicU64,
    recorded: AtomicU64,
    released: AtomicU64,
    store_errors: AtomicU64,
    failed_open: AtomicU64,
    rejected: [AtomicU64; 9],
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn executed(&self) {
        inc(&self.executed)
    }
    pub(crate) fn replayed(&self) {
        inc(&self.replayed)
    }
    pub(crate) fn waited(&self) {
        inc(&self.waited)
    }
    pub(crate) fn recorded(&self) {
        inc(&self.recorded)
    }
    pub(crate) fn released(&self) {
        inc(&self.released)
    }
    pub(crate) fn store_error(&self) {
        inc(&self.store_errors)
    }
    pub(crate) fn failed_open(&self) {
        inc(&self.failed_open)
    }
    pub(crate) fn rejected(&self, reason: RejectReason) {
        inc(&self.rejected[reason.index()])
    }

    pub(crate) fn snapshot(&self) -> Metrics {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Metrics {
            executed: get(&self.executed),
            replayed: get(&self.replayed),
            waited: get(&self.waited),
            recorded: get(&self.recorded),
            released: get(&self.released),
            store_errors: get(&self.store_errors),
            failed_open: get(&self.failed_open),
            rejected: std::array::from_fn(|i| get(&self.rejected[i])),
        }
    }
}

/// A snapshot of the layer's counters, shared by every service the layer made.
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, RejectReason};
///
/// let layer = IdempotencyLayer::default();
/// let m = layer.metrics();
/// assert_eq!(m.executed, 0);
/// assert_eq!(m.rejected(RejectReason::MissingKey), 0);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metrics {
    /// Handler executions the layer led (first requests of a scope).
    pub executed: u64,
    /// Responses replayed from a record.
    pub replayed: u64,
    /// Times a duplicate waited for a request in flight.
    pub waited: u64,
    /// Records stored.
    pub recorded: u64,
    /// Claims released without a record (not recordable, error, panic, cancellation).
    pub released: u64,
    /// Store operations that failed.
    pub store_errors: u64,
    /// Requests executed without protection because the store failed and `fail_open` is set.
    pub failed_open: u64,
    rejected: [u64; 9],
}

impl Metrics {
    /// How many requests were rejected for `reason`.
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason.index()]
    }

    /// How many requests were rejected, for every reason.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().sum()
    }
}

//! Counters the layer keeps, readable at any time with `stats()` (for export to a metrics
//! system).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::observe;
use crate::reject::RejectReason;

#[derive(Debug, Default)]
pub(crate) struct Counters {
    executed: AtomicU64,
    replayed: AtomicU64,
    waited: AtomicU64,
    recorded: AtomicU64,
    released: AtomicU64,
    store_errors: AtomicU64,
    failed_open: AtomicU64,
    shared_failures: AtomicU64,
    lapsed: AtomicU64,
    detached_refused: AtomicU64,
    in_flight: AtomicU64,
    rejected: [AtomicU64; RejectReason::ALL.len()],
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    // Each count also goes to the `metrics` facade (a no-op without the feature).
    pub(crate) fn executed(&self) {
        inc(&self.executed);
        observe::executed();
    }
    pub(crate) fn replayed(&self) {
        inc(&self.replayed);
        observe::replayed();
    }
    pub(crate) fn waited(&self) {
        inc(&self.waited);
        observe::waited();
    }
    pub(crate) fn recorded(&self) {
        inc(&self.recorded);
        observe::recorded();
    }
    pub(crate) fn released(&self) {
        inc(&self.released);
        observe::released();
    }
    pub(crate) fn store_error(&self) {
        inc(&self.store_errors)
    }
    pub(crate) fn failed_open(&self) {
        inc(&self.failed_open);
        observe::failed_open();
    }
    pub(crate) fn shared_failure(&self) {
        inc(&self.shared_failures);
        observe::shared_failure();
    }
    pub(crate) fn lapsed(&self) {
        inc(&self.lapsed);
        observe::lapsed();
    }
    pub(crate) fn detached_refused(&self) {
        inc(&self.detached_refused);
        observe::detached_refused();
    }
    /// A claim is held from now on (a leader runs).
    pub(crate) fn claim_held(&self) {
        inc(&self.in_flight);
        observe::in_flight(1.0);
    }
    /// A claim is held no more; how many are held now.
    pub(crate) fn claim_ended(&self) -> u64 {
        observe::in_flight(-1.0);
        self.in_flight.fetch_sub(1, Ordering::AcqRel) - 1
    }

    /// How many claims are held now.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }
    pub(crate) fn rejected(&self, reason: RejectReason) {
        inc(&self.rejected[reason.index()]);
        observe::rejected(reason);
    }

    /// The counts, with the gauges read by the caller.
    pub(crate) fn snapshot(&self, gauges: Gauges) -> IdempotencyStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        IdempotencyStats {
            executed: get(&self.executed),
            replayed: get(&self.replayed),
            waited: get(&self.waited),
            recorded: get(&self.recorded),
            released: get(&self.released),
            store_errors: get(&self.store_errors),
            failed_open: get(&self.failed_open),
            shared_failures: get(&self.shared_failures),
            lapsed: get(&self.lapsed),
            detached_refused: get(&self.detached_refused),
            detached: gauges.detached,
            in_flight: get(&self.in_flight),
            response_buffer_bytes: gauges.response_buffer_bytes,
            waiting_bytes: gauges.waiting_bytes,
            rejected: std::array::from_fn(|i| get(&self.rejected[i])),
        }
    }
}

/// The gauges a snapshot reads beside the counters.
pub(crate) struct Gauges {
    /// Detached work running now.
    pub(crate) detached: u64,
    /// Response bytes held for clients, beyond each response's first part.
    pub(crate) response_buffer_bytes: u64,
    /// Bytes held by waiters.
    pub(crate) waiting_bytes: u64,
}

/// A snapshot of the layer's counters, shared by every service the layer made.
///
/// ```
/// use idempotency_layer::{IdempotencyLayer, RejectReason};
///
/// let layer = IdempotencyLayer::default();
/// let m = layer.stats();
/// assert_eq!(m.executed, 0);
/// assert_eq!(m.rejected(RejectReason::MissingKey), 0);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyStats {
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
    /// Duplicates that waited for a request in flight which failed without a record, and got
    /// its failure instead of running the handler again (the key is then free for the
    /// client's retry).
    pub shared_failures: u64,
    /// Claims held past [`max_claim_lifetime`](crate::IdempotencyLayer::max_claim_lifetime):
    /// their lease was no longer renewed.
    pub lapsed: u64,
    /// Pieces of detached work (a handler or a response body whose client went away, a
    /// background release) not run because
    /// [`max_detached`](crate::IdempotencyLayer::max_detached) were running.
    pub detached_refused: u64,
    /// Pieces of detached work running now (a gauge).
    pub detached: u64,
    /// Claims this layer holds now (a gauge): writes whose handler runs or whose response is
    /// being recorded, here.
    pub in_flight: u64,
    /// Response bytes held now for clients that have not read them, beyond each response's
    /// first 64 KiB (a gauge; bounded by
    /// [`max_response_buffer_bytes`](crate::IdempotencyLayer::max_response_buffer_bytes), over
    /// it by at most one frame per response).
    pub response_buffer_bytes: u64,
    /// Bytes held now by the duplicates waiting for a write in flight, each charged its request
    /// body and 1 KiB for its head and state (a gauge; bounded by
    /// [`max_waiting_bytes`](crate::IdempotencyLayer::max_waiting_bytes)).
    pub waiting_bytes: u64,
    rejected: [u64; RejectReason::ALL.len()],
}

impl IdempotencyStats {
    /// How many requests were rejected for `reason`.
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected[reason.index()]
    }

    /// How many requests were rejected, for every reason.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().sum()
    }
}

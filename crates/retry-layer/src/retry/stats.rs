//! Counters a caller can read and export.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters shared by all clones of a layer; [`RetryLayer::stats`](crate::RetryLayer::stats)
/// reads them.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    requests: AtomicU64,
    attempts: AtomicU64,
    retries: AtomicU64,
    budget_refusals: AtomicU64,
    exhausted: AtomicU64,
    deadline_stops: AtomicU64,
    pushback_stops: AtomicU64,
    inbound_retry_stops: AtomicU64,
    declined: AtomicU64,
}

/// The counters of a layer and every service it made, as read by
/// [`RetryLayer::stats`](crate::RetryLayer::stats) or [`Retry::stats`](crate::Retry::stats): a
/// point-in-time copy. (`idempotency-layer` has `IdempotencyStats`, read the same way.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryStats {
    /// Logical requests (calls of the service).
    pub requests: u64,
    /// Attempts sent, first attempts included.
    pub attempts: u64,
    /// Retries sent.
    pub retries: u64,
    /// Retries the budget refused.
    pub budget_refusals: u64,
    /// Retryable outcomes returned because no attempt was left.
    pub exhausted: u64,
    /// Calls the deadline stopped: a retryable outcome returned because the deadline could not
    /// fit another attempt, or a call the deadline ended with
    /// [`DeadlineExceeded`](crate::DeadlineExceeded) (before its first attempt, during an
    /// attempt, or while waiting for the inner service or the rebuild hook).
    pub deadline_stops: u64,
    /// Retryable outcomes returned because the server's pushback said stop or was too long (a
    /// hop below that gave up answers with such a pushback).
    pub pushback_stops: u64,
    /// Retryable outcomes returned because the request being served is itself a retry of the
    /// hop above ([`InboundRetry::SendOnce`](crate::InboundRetry::SendOnce)).
    pub inbound_retry_stops: u64,
    /// Retryable outcomes returned because the caller said no: the
    /// [`retry_if`](crate::RetryPolicyBuilder::retry_if) predicate declined, or the request
    /// carried [`NoRetry`](crate::NoRetry).
    pub declined: u64,
    /// Request-body bytes kept for replay right now, by every call in flight (bounded by
    /// [`max_replay_bytes_total`](crate::RetryPolicyBuilder::max_replay_bytes_total)).
    pub replay_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Requests,
    Attempts,
    Retries,
    BudgetRefusals,
    Exhausted,
    DeadlineStops,
    PushbackStops,
    InboundRetryStops,
    Declined,
}

impl Counters {
    pub(crate) fn incr(&self, c: Counter) {
        let counter = match c {
            Counter::Requests => &self.requests,
            Counter::Attempts => &self.attempts,
            Counter::Retries => &self.retries,
            Counter::BudgetRefusals => &self.budget_refusals,
            Counter::Exhausted => &self.exhausted,
            Counter::DeadlineStops => &self.deadline_stops,
            Counter::PushbackStops => &self.pushback_stops,
            Counter::InboundRetryStops => &self.inbound_retry_stops,
            Counter::Declined => &self.declined,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The current values.
    pub(crate) fn snapshot(&self) -> RetryStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RetryStats {
            requests: get(&self.requests),
            attempts: get(&self.attempts),
            retries: get(&self.retries),
            budget_refusals: get(&self.budget_refusals),
            exhausted: get(&self.exhausted),
            deadline_stops: get(&self.deadline_stops),
            pushback_stops: get(&self.pushback_stops),
            inbound_retry_stops: get(&self.inbound_retry_stops),
            declined: get(&self.declined),
            replay_bytes: 0,
        }
    }
}

//! The `begin`s this layer has sent and not yet acted on, by scope: what a write that would fail
//! open must know besides the claims held. A duplicate's `begin` in flight may have been granted
//! already (the store took the claim and its answer is on its way): its leader would then run
//! beside a write run unprotected.
//!
//! Kept only by layers that fail open (no other decision reads it): one lock and one map entry
//! per write. A `begin` is counted from before it is sent ([`BeginsInFlight::enter`]) until its
//! answer is acted on: a refusal or a failure as soon as [`Counted`] sees it; a claim granted
//! once [`Claim::new`](super::claim::Claim::new) holds it and the renewals know it
//! ([`BeginsInFlight::leave`]), so that no moment passes in which neither says the scope is in
//! flight.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use crate::store::{Begin, ScopeKey, StoreError};

/// The scopes with a `begin` of this layer in flight, and how many.
#[derive(Debug, Default)]
pub(crate) struct BeginsInFlight(Mutex<HashMap<ScopeKey, usize>>);

impl BeginsInFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<ScopeKey, usize>> {
        // A count is whole after any panic (each change is one statement).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A `begin` of `scope` is about to be sent: counted until the guard is dropped, or, if its
    /// claim is granted, until the claim is held ([`leave`](Self::leave)).
    pub(crate) fn enter(self: &Arc<Self>, scope: ScopeKey) -> Asking {
        *self.lock().entry(scope).or_default() += 1;
        Asking(Box::new(Entry {
            set: self.clone(),
            scope,
            handed_over: false,
        }))
    }

    /// The count of one `begin` of `scope` ends: its answer was acted on (for a claim granted,
    /// the claim is held now, and known by the renewals).
    pub(crate) fn leave(&self, scope: &ScopeKey) {
        let mut map = self.lock();
        if let Some(n) = map.get_mut(scope) {
            *n -= 1;
            if *n == 0 {
                map.remove(scope);
            }
        }
    }

    /// Whether a `begin` of `scope` is in flight (or granted, and its claim not yet held). A
    /// caller whose own `begin` failed asks this after [`Counted`] ended its count.
    pub(crate) fn any(&self, scope: &ScopeKey) -> bool {
        self.lock().contains_key(scope)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// One `begin` in flight: uncounted when dropped, unless handed over to the claim it was
/// granted. Boxed, and carried in the `begin`'s own boxed future (see [`Counted`]): a write's
/// future, which must stay within the allocator's small blocks
/// (`the_write_future_and_the_response_body_stay_small`), never carries it.
#[derive(Debug)]
pub(crate) struct Asking(Box<Entry>);

impl Asking {
    /// Its claim was granted: the count ends when the claim is held
    /// ([`BeginsInFlight::leave`]), not now.
    fn hand_over(mut self) {
        self.0.handed_over = true;
    }
}

#[derive(Debug)]
struct Entry {
    set: Arc<BeginsInFlight>,
    scope: ScopeKey,
    handed_over: bool,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if !self.handed_over {
            self.set.leave(&self.scope);
        }
    }
}

/// What a `begin` bounded by a lease and timed answers: `None` when the lease passed first.
type Answered = Option<(Result<Begin, StoreError>, Duration)>;

pin_project_lite::pin_project! {
    /// A `begin` (bounded by a lease, and timed) carrying its count: a refusal or a failure
    /// ends the count as it is answered; a claim granted hands it over to the claim.
    pub(crate) struct Counted<F> {
        #[pin]
        inner: F,
        asking: Option<Asking>,
    }
}

impl<F> Counted<F> {
    /// `inner`, the `begin` that `asking` counts.
    pub(crate) fn new(inner: F, asking: Asking) -> Self {
        Counted {
            inner,
            asking: Some(asking),
        }
    }
}

impl<F: Future<Output = Answered>> Future for Counted<F> {
    type Output = Answered;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answered> {
        let this = self.project();
        let out = ready!(this.inner.poll(cx));
        if let Some(asking) = this.asking.take() {
            if matches!(out, Some((Ok(Begin::New(_)), _))) {
                asking.hand_over();
            }
        }
        Poll::Ready(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_begin_is_counted_until_it_is_answered_or_its_claim_is_held() {
        let set = Arc::new(BeginsInFlight::default());
        let (a, b) = (ScopeKey([1; 32]), ScopeKey([2; 32]));
        let first = set.enter(a);
        assert!(set.any(&a));
        let other_scope = set.enter(b);
        drop(first);
        assert!(!set.any(&a), "counted until its begin is answered");
        assert!(set.any(&b));
        drop(other_scope);
        assert_eq!(set.len(), 0, "nothing is left once every begin is answered");
        // A begin granted is handed over, and counted until its claim is held.
        let granted = set.enter(a);
        granted.hand_over();
        assert!(set.any(&a), "the claim granted is not held yet");
        set.leave(&a);
        assert!(!set.any(&a));
        assert_eq!(set.len(), 0);
    }

    /// The count rides with the `begin`: a refusal ends it as it is answered, a grant keeps it
    /// for the claim, and a `begin` dropped before its answer (its request went away) ends it.
    #[tokio::test]
    async fn a_counted_begin_ends_its_count_unless_granted() {
        let set = Arc::new(BeginsInFlight::default());
        let scope = ScopeKey([3; 32]);
        let refused: Answered = Some((Err(StoreError::Full), Duration::ZERO));
        let _ = Counted::new(std::future::ready(refused), set.enter(scope)).await;
        assert_eq!(set.len(), 0);
        let granted: Answered = Some((Ok(Begin::New(crate::store::Token(7))), Duration::ZERO));
        let _ = Counted::new(std::future::ready(granted), set.enter(scope)).await;
        assert_eq!(set.len(), 1, "counted until its claim is held");
        set.leave(&scope);
        let never = Counted::new(std::future::pending::<Answered>(), set.enter(scope));
        drop(never);
        assert_eq!(set.len(), 0);
    }
}

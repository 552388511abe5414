//! The `begin`s this layer has sent and not yet seen answered, by scope: what a write that would
//! fail open must know besides the claims held. A duplicate's `begin` in flight may have been
//! granted already (the store took the claim and its answer is on its way): its leader would
//! then run beside a write run unprotected.
//!
//! Kept only by layers that fail open (no other decision reads it): one lock and one map entry
//! per write, taken before the `begin` is sent and given back when the request asks again (after
//! a wait) or its future ends: a leader stays counted while its handler runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::ScopeKey;

/// The scopes with a `begin` of this layer in flight, and how many.
#[derive(Debug, Default)]
pub(crate) struct BeginsInFlight(Mutex<HashMap<ScopeKey, usize>>);

impl BeginsInFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<ScopeKey, usize>> {
        // A count is whole after any panic (each change is one statement).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A `begin` of `scope` is about to be sent: counted until the guard is dropped.
    pub(crate) fn enter(self: &Arc<Self>, scope: ScopeKey) -> Asking {
        *self.lock().entry(scope).or_default() += 1;
        Asking {
            set: self.clone(),
            scope,
        }
    }

    /// Whether another `begin` of `scope` than the caller's own is in flight.
    pub(crate) fn others(&self, scope: &ScopeKey) -> bool {
        self.lock().get(scope).is_some_and(|n| *n > 1)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// One `begin` in flight: uncounted when dropped.
#[derive(Debug)]
pub(crate) struct Asking {
    set: Arc<BeginsInFlight>,
    scope: ScopeKey,
}

impl Drop for Asking {
    fn drop(&mut self) {
        let mut map = self.set.lock();
        if let Some(n) = map.get_mut(&self.scope) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_begin_sees_the_others_of_its_scope_only_while_they_are_in_flight() {
        let set = Arc::new(BeginsInFlight::default());
        let (a, b) = (ScopeKey([1; 32]), ScopeKey([2; 32]));
        let first = set.enter(a);
        assert!(!set.others(&a), "its own begin is not another");
        let second = set.enter(a);
        let other_scope = set.enter(b);
        assert!(set.others(&a));
        assert!(!set.others(&b));
        drop(first);
        assert!(!set.others(&a));
        drop((second, other_scope));
        assert_eq!(set.len(), 0, "nothing is left once every begin is answered");
    }
}

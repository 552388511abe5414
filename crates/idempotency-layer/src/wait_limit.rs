//! The bound on duplicates waiting for one scope ([`IdempotencyLayer::max_waiters`]).
//!
//! [`IdempotencyLayer::max_waiters`]: crate::IdempotencyLayer::max_waiters

use std::sync::{Arc, Mutex};

use crate::store::{FastMap, ScopeKey};

const SHARDS: usize = 16;

/// How many duplicates wait per scope, shared by every clone of a layer. Only scopes with a
/// waiter have an entry, so its size is bounded by the waiters themselves.
#[derive(Debug, Default)]
pub(crate) struct WaitLimit {
    shards: [Mutex<FastMap<ScopeKey, usize>>; SHARDS],
}

impl WaitLimit {
    fn shard(&self, scope: &ScopeKey) -> &Mutex<FastMap<ScopeKey, usize>> {
        &self.shards[usize::from(scope.0[0]) % SHARDS]
    }

    /// A place among the waiters of `scope`, or `None` when `max` already wait.
    pub(crate) fn enter(self: &Arc<Self>, scope: ScopeKey, max: usize) -> Option<WaiterSlot> {
        let mut map = self.shard(&scope).lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(scope).or_insert(0);
        if *n >= max {
            if *n == 0 {
                map.remove(&scope);
            }
            return None;
        }
        *n += 1;
        Some(WaiterSlot {
            waiters: self.clone(),
            scope,
        })
    }

    /// How many wait for `scope` now.
    #[cfg(test)]
    pub(crate) fn count(&self, scope: &ScopeKey) -> usize {
        let map = self.shard(scope).lock().unwrap_or_else(|e| e.into_inner());
        map.get(scope).copied().unwrap_or(0)
    }
}

/// One waiter's place; leaving (drop, including cancellation) frees it.
#[derive(Debug)]
pub(crate) struct WaiterSlot {
    waiters: Arc<WaitLimit>,
    scope: ScopeKey,
}

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        let mut map = self
            .waiters
            .shard(&self.scope)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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
    fn bounded_per_scope_and_freed_on_drop() {
        let w = Arc::new(WaitLimit::default());
        let (a, b) = (ScopeKey([1; 32]), ScopeKey([2; 32]));
        let slots: Vec<_> = (0..3).map(|_| w.enter(a, 3).expect("a place")).collect();
        assert!(
            w.enter(a, 3).is_none(),
            "the fourth waiter of one scope is refused"
        );
        let other = w.enter(b, 3).expect("other scopes are unaffected");
        assert_eq!(w.count(&a), 3);
        drop(slots);
        assert_eq!(w.count(&a), 0);
        assert!(
            w.shards
                .iter()
                .map(|s| s.lock().unwrap().len())
                .sum::<usize>()
                == 1
        );
        drop(other);
        assert!(w.shards.iter().all(|s| s.lock().unwrap().is_empty()));
        assert!(w.enter(a, 0).is_none(), "max 0: nobody waits");
        assert!(w.shards.iter().all(|s| s.lock().unwrap().is_empty()));
    }
}

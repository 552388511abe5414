//! [`MutexStore`]: the store a user would hand-roll, one `Mutex<HashMap>` doing the same claim
//! and record work as `MemoryStore`, without shards, TTL index, capacity or waiter channels.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_layer::store::{Begin, Fingerprint, Record, ScopeKey, Token};
use idempotency_layer::{IdempotencyStore, StoreError};

enum Entry {
    InFlight {
        token: Token,
        fingerprint: Fingerprint,
    },
    Completed(Arc<Record>),
}

/// One `Mutex<HashMap<ScopeKey, Entry>>`: claim if free, report a claim or a record, replace a
/// claim by its record. Waiters poll every millisecond.
#[derive(Clone, Default)]
pub struct MutexStore {
    map: Arc<Mutex<HashMap<ScopeKey, Entry>>>,
    next: Arc<AtomicU64>,
}

impl std::fmt::Debug for MutexStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MutexStore").finish_non_exhaustive()
    }
}

impl MutexStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopeKey, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn holds(map: &HashMap<ScopeKey, Entry>, scope: &ScopeKey, token: Token) -> bool {
        matches!(map.get(scope), Some(Entry::InFlight { token: t, .. }) if *t == token)
    }
}

impl IdempotencyStore for MutexStore {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        _lease: Duration,
    ) -> Result<Begin, StoreError> {
        let token = Token(u128::from(self.next.fetch_add(1, Ordering::Relaxed)));
        let mut map = self.lock();
        match map.get(&scope) {
            Some(Entry::Completed(r)) => Ok(Begin::Completed(r.clone())),
            Some(Entry::InFlight { token, fingerprint }) => Ok(Begin::InFlight {
                token: *token,
                fingerprint: *fingerprint,
            }),
            None => {
                map.insert(scope, Entry::InFlight { token, fingerprint });
                Ok(Begin::New(token))
            }
        }
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        _ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut map = self.lock();
        if !Self::holds(&map, &scope, token) {
            return Err(StoreError::Fenced);
        }
        map.insert(scope, Entry::Completed(record));
        Ok(())
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        let mut map = self.lock();
        if !Self::holds(&map, &scope, token) {
            return Err(StoreError::Fenced);
        }
        map.remove(&scope);
        Ok(())
    }

    async fn renew(&self, scope: ScopeKey, token: Token, _: Duration) -> Result<(), StoreError> {
        if Self::holds(&self.lock(), &scope, token) {
            Ok(())
        } else {
            Err(StoreError::Fenced)
        }
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        while Self::holds(&self.lock(), &scope, observed) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        Ok(self.lock().remove(&scope).is_some())
    }
}

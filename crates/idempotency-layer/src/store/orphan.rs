//! Claims whose owner stopped caring: a claim statement abandoned mid-flight (a timeout, a
//! dropped caller) may still land on the server, and would hold its key for a whole lease.
//! [`OrphanGuard`] releases such a claim in the background, bounded process-wide.

use std::time::Duration;

use super::{retry_through_outage, IdempotencyStore, ScopeKey, StoreError, Token};

/// The most orphan releases ([`OrphanGuard`]) running at once in this process. During an
/// outage at R requests/s there would otherwise be about R x lease of them, all hitting the
/// recovering store; past the bound an orphan is left to lapse with its lease (logged).
pub(crate) const MAX_ORPHAN_RELEASES: usize = 1024;

type Limiter = &'static std::sync::atomic::AtomicUsize;

/// The orphan releases running in this process, bounded by [`MAX_ORPHAN_RELEASES`].
static ORPHAN_RELEASES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Guards a shared store's `begin` whose claim may be written without anyone knowing it.
///
/// The claim is written by the server with a token this process chose; if the reply is lost
/// (the connection dropped or timed out after the server ran the command) or the request that
/// sent it was dropped (its client went away) before the reply, nobody knows they hold that
/// claim, and it would block its key for a whole lease (30 s by default) while every retry
/// waited for it. Armed, the guard releases it in the background when dropped, fenced by its
/// token (so it removes nothing but that orphan), through a brief outage, for at most one
/// lease. If that finds nothing to release, the claim may still be on its way (a statement the
/// server had not run yet, a command queued on a connection): the guard releases once more
/// when it can no longer arrive (`settle` after its sender gave up). [`disarm`](Self::disarm)
/// it once the claim's fate is known: a reply arrived, or the error proves the command was
/// never sent (no connection, pool exhausted).
pub(crate) struct OrphanGuard<St: IdempotencyStore> {
    armed: Option<Orphan<St>>,
    running: Limiter,
}

struct Orphan<St> {
    store: St,
    scope: ScopeKey,
    token: Token,
    lease: Duration,
    settle: Duration,
}

impl<St: IdempotencyStore> OrphanGuard<St> {
    /// `settle`: how long after its sender gave up the claim may still be written (the server
    /// may not have run it yet); past it, it was written or never will be.
    pub(crate) fn new(
        store: &St,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
        settle: Duration,
    ) -> Self {
        OrphanGuard {
            armed: Some(Orphan {
                store: store.clone(),
                scope,
                token,
                lease,
                settle,
            }),
            running: &ORPHAN_RELEASES,
        }
    }

    /// Counts its release in `running` instead of the process's count (tests).
    #[cfg(test)]
    fn counted_in(mut self, running: Limiter) -> Self {
        self.running = running;
        self
    }

    /// The claim's fate is known: nothing to release.
    pub(crate) fn disarm(mut self) {
        self.armed = None;
    }
}

impl<St: IdempotencyStore> Drop for OrphanGuard<St> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;

        let Some(Orphan {
            store,
            scope,
            token,
            lease,
            settle,
        }) = self.armed.take()
        else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let count = self.running;
        if count.fetch_add(1, Ordering::Relaxed) >= MAX_ORPHAN_RELEASES {
            count.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(
                ?scope,
                "idempotency: too many orphaned claims being released; this one lapses with its lease"
            );
            return;
        }
        /// Counts the release as running until its task ends (or is dropped with its runtime).
        struct Running(Limiter);
        impl Drop for Running {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        let running = Running(count);
        runtime.spawn(async move {
            let _running = running;
            let started = tokio::time::Instant::now();
            let first =
                retry_through_outage(lease, "release orphan", || store.release(scope, token)).await;
            // Fenced: nothing held the token yet; once `settle` has passed since its sender gave
            // up, the claim has landed or never will: release once more. (Released, or out of
            // time: done.)
            if let Err(StoreError::Fenced) = first {
                tokio::time::sleep_until(started + settle).await;
                let left = lease.saturating_sub(started.elapsed());
                let _ = retry_through_outage(left, "release orphan (second)", || {
                    store.release(scope, token)
                })
                .await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::conformance::{Fault, FaultStore, Op, Rule};
    use crate::store::{Begin, Fingerprint, MemoryStore, Record};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn orphan_releases_are_bounded_and_a_disarmed_guard_releases_nothing() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        // A store whose `release` never answers (a store that went away).
        let store = FaultStore::new(MemoryStore::new());
        store.inject(Rule::new(Op::Release, Fault::Hang));
        let releases = || store.calls(Op::Release).made;
        let lease = Duration::from_secs(30);
        let guard = |scope, i| {
            OrphanGuard::new(&store, ScopeKey([scope; 32]), Token(i), lease, lease)
                .counted_in(&RUNNING)
        };
        for i in 0..10u128 {
            guard(1, i).disarm();
        }
        for i in 0..(MAX_ORPHAN_RELEASES as u128 * 3) {
            drop(guard(2, i));
        }
        // Let every spawned release start (bounded: a few yields per task at most).
        for _ in 0..10_000 {
            if releases() >= MAX_ORPHAN_RELEASES {
                break;
            }
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            releases(),
            MAX_ORPHAN_RELEASES,
            "only the bound's worth of releases run; disarmed guards release nothing"
        );
        assert_eq!(RUNNING.load(Ordering::Relaxed), MAX_ORPHAN_RELEASES);
    }

    /// A store whose claim lands late: `release` finds nothing (fenced) until `landed`, then
    /// releases it. Counts the calls and the releases.
    #[derive(Clone, Default)]
    struct LateClaim {
        landed: Arc<std::sync::atomic::AtomicBool>,
        calls: Arc<AtomicUsize>,
        released: Arc<AtomicUsize>,
    }

    impl IdempotencyStore for LateClaim {
        async fn begin(
            &self,
            _: ScopeKey,
            _: Fingerprint,
            _: Duration,
        ) -> Result<Begin, StoreError> {
            unreachable!()
        }
        async fn complete(
            &self,
            _: ScopeKey,
            _: Token,
            _: Arc<Record>,
            _: Duration,
        ) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn release(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.landed.load(Ordering::SeqCst) {
                self.released.fetch_add(1, Ordering::SeqCst);
                Ok(())
            } else {
                Err(StoreError::Fenced)
            }
        }
        async fn renew(&self, _: ScopeKey, _: Token, _: Duration) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn wait(&self, _: ScopeKey, _: Token) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn forget(&self, _: ScopeKey) -> Result<bool, StoreError> {
            unreachable!()
        }
    }

    /// The first release finds nothing (the claim has not landed); the claim lands; the second
    /// release, `settle` after the guard fired, removes it. A release that removed the claim the
    /// first time is not repeated.
    #[tokio::test(start_paused = true)]
    async fn an_orphan_that_lands_after_the_first_release_is_released_by_the_second() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let store = LateClaim::default();
        let (lease, settle) = (Duration::from_secs(30), Duration::from_secs(2));
        drop(
            OrphanGuard::new(&store, ScopeKey([3; 32]), Token(1), lease, settle)
                .counted_in(&RUNNING),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            1,
            "the first release ran"
        );
        store.landed.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(store.calls.load(Ordering::SeqCst), 1, "not before `settle`");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            store.released.load(Ordering::SeqCst),
            1,
            "the second release removed it"
        );
        assert_eq!(RUNNING.load(Ordering::SeqCst), 0, "and the release ended");

        drop(
            OrphanGuard::new(&store, ScopeKey([4; 32]), Token(2), lease, settle)
                .counted_in(&RUNNING),
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            store.calls.load(Ordering::SeqCst),
            3,
            "released at once: no second try"
        );
    }
}

//! Waking waiters of a shared store: a registry of local waiters per scope (woken by the
//! store's notification channel) and the bounded polling loop that backs it up, so a lost
//! notification delays a waiter by at most one poll interval and never hangs it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use super::StoreError;

/// How a waiter polls when no notification comes: the first interval, doubled after each poll
/// up to the last.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Polling {
    pub(crate) first: Duration,
    pub(crate) max: Duration,
}

impl Polling {
    /// Polls `first` after the first check, doubling up to `max` (each at least 1 ms, `max` at
    /// least `first`).
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        let first = first.max(Duration::from_millis(1));
        Polling {
            first,
            max: max.max(first),
        }
    }
}

impl Default for Polling {
    fn default() -> Self {
        Polling {
            first: Duration::from_millis(25),
            max: Duration::from_secs(1),
        }
    }
}

struct Slot {
    notify: Arc<Notify>,
    count: usize,
}

/// The local waiters, by scope hex.
#[derive(Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<String, Slot>>,
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a waiter for `scope`; the guard unregisters it. `on_last` hears the scope
    /// when its last waiter leaves (to unsubscribe).
    pub(crate) fn register(
        self: &Arc<Self>,
        scope: String,
        on_last: Option<mpsc::UnboundedSender<String>>,
    ) -> WaiterGuard {
        let notify = {
            let mut map = self.lock();
            let slot = map.entry(scope.clone()).or_insert_with(|| Slot {
                notify: Arc::new(Notify::new()),
                count: 0,
            });
            slot.count += 1;
            slot.notify.clone()
        };
        WaiterGuard {
            waiters: self.clone(),
            scope,
            notify,
            on_last,
        }
    }

    /// Wakes the waiters of `scope`, if any.
    pub(crate) fn wake(&self, scope: &str) {
        if let Some(slot) = self.lock().get(scope) {
            slot.notify.notify_waiters();
        }
    }

    /// Wakes every waiter (the notification channel was lost: they poll now).
    pub(crate) fn wake_all(&self) {
        for slot in self.lock().values() {
            slot.notify.notify_waiters();
        }
    }

    /// True when `scope` has local waiters.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn has(&self, scope: &str) -> bool {
        self.lock().contains_key(scope)
    }

    /// The scopes that have local waiters.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn scopes(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

/// One registered waiter.
pub(crate) struct WaiterGuard {
    waiters: Arc<Waiters>,
    scope: String,
    notify: Arc<Notify>,
    on_last: Option<mpsc::UnboundedSender<String>>,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let last = {
            let mut map = self.waiters.lock();
            match map.get_mut(&self.scope) {
                Some(slot) if slot.count > 1 => {
                    slot.count -= 1;
                    false
                }
                Some(_) => {
                    map.remove(&self.scope);
                    true
                }
                None => false,
            }
        };
        if last {
            if let Some(tx) = &self.on_last {
                let _ = tx.send(std::mem::take(&mut self.scope));
            }
        }
    }
}

impl WaiterGuard {
    /// Waits until the claim ends: `held` reports whether it still holds (and for how long its
    /// lease runs at most); between checks the waiter sleeps until a notification or the next
    /// poll, whichever comes first. Returns early on any notification (the caller begins again).
    pub(crate) async fn wait<F, Fut>(&self, polling: Polling, mut held: F) -> Result<(), StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Option<Duration>, StoreError>>,
    {
        let mut delay = polling.first;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Enabled before the check: a notification between the check and the sleep counts.
            notified.as_mut().enable();
            let Some(lease_left) = held().await? else {
                return Ok(());
            };
            let nap = delay.min(lease_left + Duration::from_millis(1));
            // Biased: the same order every time (a simulation's seed replays exactly).
            tokio::select! {
                biased;
                _ = &mut notified => return Ok(()),
                _ = tokio::time::sleep(nap) => {}
            }
            delay = (delay * 2).min(polling.max);
        }
    }
}

//! The waker a request body is polled with before any transport polls it, and how its
//! wake-ups reach the transport's task once one does.
//!
//! [`ReplayBody::new`](super::ReplayBody::new) reads what a body has at hand when the request
//! is wrapped, before the transport has polled anything. A body that returns `Pending` then
//! registers the waker of that read; most bodies register the newest waker at every poll, but a
//! body built on a one-shot registration keeps the first one. So the read polls with a
//! [`WakeSlot`], and the reader that polls the body for the transport later tells the slot its
//! own waker: a wake-up of the body always reaches whoever reads it now.

use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};

/// Forwards a body's wake-ups to the waker of the reader that polls it now.
#[derive(Debug, Default)]
pub(super) struct WakeSlot {
    waker: Mutex<Option<Waker>>,
}

impl WakeSlot {
    /// From now on, the body's wake-ups go to `waker`.
    pub(super) fn forward_to(&self, waker: &Waker) {
        let mut current = self.waker.lock().unwrap_or_else(|p| p.into_inner());
        if !current.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *current = Some(waker.clone());
        }
    }
}

impl Wake for WakeSlot {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Cloned out, so that the lock is not held while the reader's task runs.
        let waker = self.waker.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

thread_local! {
    /// A slot no body kept, for the next wrap on this thread: a body whose frames are at hand
    /// (the common case) never keeps the waker, and then wrapping allocates nothing.
    static SPARE: Cell<Option<Arc<WakeSlot>>> = const { Cell::new(None) };
}

/// Runs `read` with a context whose waker is a [`WakeSlot`]. Returns `read`'s result, and the
/// slot if the body kept its waker (the slot must then be told each reader's waker).
pub(super) fn read_with_slot<R>(
    read: impl FnOnce(&mut Context<'_>) -> R,
) -> (R, Option<Arc<WakeSlot>>) {
    let slot = SPARE.take().unwrap_or_default();
    let waker = Waker::from(slot.clone());
    let result = read(&mut Context::from_waker(&waker));
    drop(waker);
    if Arc::strong_count(&slot) == 1 {
        // Nobody kept a clone, and nobody can make one any more: reuse it.
        SPARE.set(Some(slot));
        (result, None)
    } else {
        (result, Some(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_waker_forwards_and_an_unkept_one_is_reused() {
        let (kept, slot) = read_with_slot(|cx| cx.waker().clone());
        let slot = slot.expect("the waker was kept");
        let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        kept.wake_by_ref();
        assert!(
            !woken.load(std::sync::atomic::Ordering::SeqCst),
            "nobody to wake yet"
        );
        slot.forward_to(&Waker::from(Arc::new(Flag(woken.clone()))));
        kept.wake();
        assert!(woken.load(std::sync::atomic::Ordering::SeqCst));

        let (_, none) = read_with_slot(|_| ());
        assert!(none.is_none());
        let spare = || {
            let slot = SPARE.take();
            let ptr = slot.as_ref().map(|a| Arc::as_ptr(a) as usize);
            SPARE.set(slot);
            ptr
        };
        let first = spare();
        let (_, none) = read_with_slot(|_| ());
        assert!(none.is_none());
        let second = spare();
        assert_eq!(first, second, "the spare slot is reused");
    }
}

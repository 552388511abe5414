//! Waiting for an event: the one set of wait helpers of the workspace's tests.
//!
//! Every wait is bounded by wall-clock time ([`LIMIT`] unless told), never by a number of polls
//! or yields, and panics naming what it waited for: a test that fails instead of hanging, and
//! says why. A wait is for an *event* (a counter moved, a server saw a command, a handler
//! started); it is never a head start for a race.
//!
//! - [`until`] / [`until_within`] / [`until_async`]: tests on real sockets and real time. They
//!   check every few milliseconds with `tokio::time::sleep`.
//! - [`until_yielding`]: tests under `tokio::time::pause()`. It yields to the runtime between
//!   checks and never sleeps, so the paused clock does not move while it waits (a sleep there
//!   would advance the clock, and leases and timers with it).

use std::future::Future;
use std::time::{Duration, Instant};

/// How long a wait lasts before it fails, unless told otherwise: long enough for a loaded
/// 2-core machine, short enough that a broken test fails well within CI's time.
pub const LIMIT: Duration = Duration::from_secs(20);

/// How often the real-time waits check.
const EVERY: Duration = Duration::from_millis(5);

fn never(what: &str, limit: Duration) -> ! {
    panic!("waited {limit:?} for: {what}; it never happened")
}

/// Waits until `cond` holds, checking every few milliseconds; panics naming `what` after
/// [`LIMIT`]. For real time (tests on sockets); under paused time use [`until_yielding`].
pub async fn until(what: &str, cond: impl FnMut() -> bool) {
    until_within(LIMIT, what, cond).await
}

/// [`until`] with another bound.
pub async fn until_within(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = Instant::now() + limit;
    while !cond() {
        if Instant::now() >= give_up {
            never(what, limit);
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// [`until`] for a check that is itself async (it asks a server); each check runs to its end
/// before the next. Panics naming `what` after `limit`.
pub async fn until_async<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let give_up = Instant::now() + limit;
    while !check().await {
        if Instant::now() >= give_up {
            never(what, limit);
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// Waits until `check` returns a value, and returns it; panics naming `what` after `limit`.
pub async fn some<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let give_up = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= give_up {
            never(what, limit);
        }
        tokio::time::sleep(EVERY).await;
    }
}

/// Waits until `cond` holds, yielding to the runtime between checks (never sleeping, so a
/// paused clock stays where it is); panics naming `what` after [`LIMIT`] of wall-clock time.
/// For tests under `tokio::time::pause()`, waiting for spawned tasks to do what they can do
/// without time passing.
pub async fn until_yielding(what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = Instant::now() + LIMIT;
    while !cond() {
        if Instant::now() >= give_up {
            never(what, LIMIT);
        }
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_yielding_wait_sees_spawned_work_and_the_clock_stays() {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        tokio::spawn(async move { m.store(1, Ordering::SeqCst) });
        let before = tokio::time::Instant::now();
        until_yielding("the task ran", || n.load(Ordering::SeqCst) == 1).await;
        assert_eq!(tokio::time::Instant::now(), before, "no time passed");
    }

    #[tokio::test]
    #[should_panic(expected = "waited 50ms for: nothing; it never happened")]
    async fn a_wait_that_never_ends_panics_naming_it() {
        until_within(Duration::from_millis(50), "nothing", || false).await;
    }

    #[tokio::test]
    async fn some_returns_the_value() {
        let mut n = 0;
        let v = some(LIMIT, "the third try", || {
            n += 1;
            std::future::ready((n == 3).then_some(n))
        })
        .await;
        assert_eq!(v, 3);
    }
}

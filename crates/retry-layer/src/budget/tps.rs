//! [`TpsBudget`]: retries as a ratio of requests over a sliding window of one-second slots.

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Budget, InvalidBudget};

/// The default budget: retries may be at most `ratio` of requests deposited over a sliding
/// `window`, plus `min_per_sec` retries per second that are always allowed.
///
/// The window is split into one-second slots of atomic counters; no lock is taken. A
/// withdrawal debits first and then checks the balance, taking its debit back if that went
/// below zero: concurrent withdrawals never grant more than the budget holds (a race may
/// refuse one that a serial order would have granted).
///
/// ```
/// use std::time::Duration;
/// use retry_layer::budget::{Budget, TpsBudget};
///
/// let budget = TpsBudget::new(Duration::from_secs(10), 0, 0.1).unwrap();
/// for _ in 0..100 {
///     budget.deposit();
/// }
/// let granted = (0..100).filter(|_| budget.withdraw()).count();
/// assert_eq!(granted, 10);
/// ```
pub struct TpsBudget {
    start: Instant,
    slots: Box<[Slot]>,
    /// Retries a deposit buys, in thousandths.
    ratio_milli: i64,
    /// Free retries per second, in thousandths.
    floor_milli: i64,
}

#[derive(Default)]
struct Slot {
    /// The second this slot holds, plus one (0: never used).
    epoch: AtomicU64,
    /// Deposits in thousandths of a retry.
    credit: AtomicI64,
    /// Withdrawals in thousandths.
    debit: AtomicI64,
}

impl fmt::Debug for TpsBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TpsBudget")
            .field("window_secs", &self.slots.len())
            .field("ratio", &(self.ratio_milli as f64 / 1000.0))
            .field("min_per_sec", &(self.floor_milli / 1000))
            .finish()
    }
}

impl TpsBudget {
    /// A budget of `ratio` retries per request (0.0 to 1000.0) over `window` (1 to 60 s,
    /// rounded to whole seconds), plus `min_per_sec` retries per second.
    pub fn new(window: Duration, min_per_sec: u32, ratio: f64) -> Result<Self, InvalidBudget> {
        let secs = window.as_secs();
        if !(1..=60).contains(&secs) {
            return Err(InvalidBudget("the window must be between 1 and 60 seconds"));
        }
        if !(0.0..=1000.0).contains(&ratio) || ratio.is_nan() {
            return Err(InvalidBudget(
                "the retry ratio must be between 0.0 and 1000.0",
            ));
        }
        Ok(TpsBudget {
            start: Instant::now(),
            slots: (0..secs).map(|_| Slot::default()).collect(),
            ratio_milli: (ratio * 1000.0).round() as i64,
            floor_milli: i64::from(min_per_sec) * 1000,
        })
    }

    fn now_epoch(&self) -> u64 {
        self.start.elapsed().as_secs() + 1
    }

    /// The slot of the current second, reset if it last held an older second.
    fn current(&self) -> (&Slot, u64) {
        let epoch = self.now_epoch();
        let slot = &self.slots[(epoch % self.slots.len() as u64) as usize];
        let seen = slot.epoch.load(Ordering::Acquire);
        if seen != epoch
            && slot
                .epoch
                .compare_exchange(seen, epoch, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            slot.credit.store(0, Ordering::Release);
            slot.debit.store(0, Ordering::Release);
        }
        (slot, epoch)
    }

    /// Retries (in thousandths) left in the window.
    fn balance(&self, epoch: u64) -> i64 {
        let window = self.slots.len() as u64;
        let mut credit = 0;
        let mut debit = 0;
        let mut live_secs = 0;
        for slot in self.slots.iter() {
            let e = slot.epoch.load(Ordering::Acquire);
            if e != 0 && e + window > epoch {
                credit += slot.credit.load(Ordering::Relaxed);
                debit += slot.debit.load(Ordering::Relaxed);
                live_secs += 1;
            }
        }
        credit * self.ratio_milli / 1000 + self.floor_milli * live_secs.max(1) - debit
    }
}

impl Default for TpsBudget {
    /// 10 % of requests over 10 s, plus 10 retries per second.
    fn default() -> Self {
        TpsBudget::new(Duration::from_secs(10), 10, 0.1).expect("valid default budget")
    }
}

impl Budget for TpsBudget {
    fn deposit(&self) {
        let (slot, _) = self.current();
        slot.credit.fetch_add(1000, Ordering::Relaxed);
    }

    fn record(&self, _failed: bool) {}

    fn withdraw(&self) -> bool {
        let (slot, epoch) = self.current();
        // Debit first, then look: every racing withdrawal sees the others' debits, so together
        // they never take more than the balance.
        slot.debit.fetch_add(1000, Ordering::AcqRel);
        if self.balance(epoch) >= 0 {
            return true;
        }
        Self::take_back(slot);
        false
    }

    fn refund(&self) {
        let (slot, _) = self.current();
        Self::take_back(slot);
    }
}

impl TpsBudget {
    /// Takes one debit back from `slot`, never below zero (the slot may have been reset for a
    /// new second since: the debit went with it).
    fn take_back(slot: &Slot) {
        let _ = slot
            .debit
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d >= 1000).then_some(d - 1000)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn window_slides() {
        let budget = TpsBudget::new(Duration::from_secs(2), 0, 0.5).unwrap();
        for _ in 0..10 {
            budget.deposit();
        }
        assert_eq!((0..10).filter(|_| budget.withdraw()).count(), 5);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!budget.withdraw(), "deposits still in the window are spent");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!budget.withdraw(), "old deposits expired");
        budget.deposit();
        budget.deposit();
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }

    #[tokio::test(start_paused = true)]
    async fn floor_allows_a_quiet_client_to_retry() {
        let budget = TpsBudget::new(Duration::from_secs(10), 2, 0.0).unwrap();
        assert!(budget.withdraw());
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(TpsBudget::new(Duration::ZERO, 1, 0.1).is_err());
        assert!(TpsBudget::new(Duration::from_secs(61), 1, 0.1).is_err());
        assert!(TpsBudget::new(Duration::from_secs(1), 1, f64::NAN).is_err());
        assert!(TpsBudget::new(Duration::from_secs(1), 1, -0.1).is_err());
    }

    #[test]
    fn concurrent_withdrawals_never_grant_more_than_the_budget() {
        // 100 retries in the budget, eight threads asking for 1 000 each at once, over and
        // over: checked before debited, the grants overshot by up to the racing threads.
        for _ in 0..50 {
            let budget =
                std::sync::Arc::new(TpsBudget::new(Duration::from_secs(60), 0, 0.1).unwrap());
            for _ in 0..1_000 {
                budget.deposit();
            }
            let start = std::sync::Barrier::new(8);
            let granted: usize = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        let (b, start) = (budget.clone(), &start);
                        s.spawn(move || {
                            start.wait();
                            (0..1_000).filter(|_| b.withdraw()).count()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert!(granted <= 100, "granted {granted} of a budget of 100");
            assert!(granted >= 1, "granted {granted}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refund_gives_a_withdrawal_back() {
        let budget = TpsBudget::new(Duration::from_secs(10), 0, 0.1).unwrap();
        for _ in 0..10 {
            budget.deposit();
        }
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
        budget.refund();
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }

    #[test]
    fn contention_from_two_threads_stays_bounded() {
        let budget = std::sync::Arc::new(TpsBudget::new(Duration::from_secs(10), 0, 0.1).unwrap());
        let granted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let b = budget.clone();
                    s.spawn(move || {
                        let mut granted = 0;
                        for _ in 0..10_000 {
                            b.deposit();
                            if b.withdraw() {
                                granted += 1;
                            }
                        }
                        granted
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        // 10 % of 20 000, give or take the racing threads (and a second boundary).
        assert!(granted <= 2_000 + 2, "granted {granted}");
        assert!(granted >= 1_900, "granted {granted}");
    }
}

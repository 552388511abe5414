//! Exponential backoff with jitter.
//!
//! The delay after failed attempt `n` (n >= 1) is `min(base * multiplier^(n-1), max_delay)`,
//! then shaped by a [`Jitter`]. The computation saturates: it never overflows or panics, for any
//! `n` up to `u32::MAX`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the computed delay is randomized, so that clients that failed together do not retry
/// together.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Jitter {
    /// No randomization.
    None,
    /// Multiply by a uniform factor in `[1 - r, 1 + r]` (the default, with r = 0.2). The delay
    /// may then exceed `max_delay` by the factor.
    Proportional(f64),
    /// A uniform delay in `[0, d]` ("full jitter", gRFC A6 and the AWS backoff study).
    Full,
    /// A uniform delay in `[d/2, d]` ("equal jitter").
    Equal,
    /// `min(max_delay, uniform(base, 3 * previous))` ("decorrelated jitter"); ignores the
    /// multiplier.
    Decorrelated,
}

impl Default for Jitter {
    fn default() -> Self {
        Jitter::Proportional(0.2)
    }
}

/// The backoff schedule of a [`RetryPolicy`](crate::RetryPolicy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub(crate) base: Duration,
    pub(crate) multiplier: f64,
    pub(crate) max_delay: Duration,
    pub(crate) jitter: Jitter,
}

impl Default for Backoff {
    /// 20 ms base, x2, 1 s cap, +-20 % jitter.
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(20),
            multiplier: 2.0,
            max_delay: Duration::from_secs(1),
            jitter: Jitter::default(),
        }
    }
}

impl Backoff {
    /// The delay before jitter after failed attempt `n` (n >= 1): `min(base * multiplier^(n-1),
    /// max_delay)`, saturating.
    ///
    /// ```
    /// use std::time::Duration;
    /// use retry_layer::backoff::Backoff;
    ///
    /// let b = Backoff::default();
    /// assert_eq!(b.ceiling(1), Duration::from_millis(20));
    /// assert_eq!(b.ceiling(3), Duration::from_millis(80));
    /// assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
    /// ```
    pub fn ceiling(&self, n: u32) -> Duration {
        let base = self.base.as_secs_f64();
        let max = self.max_delay.as_secs_f64();
        if base == 0.0 {
            return Duration::ZERO;
        }
        // multiplier >= 1 is validated; powi of a large exponent is +inf, which min() caps.
        let exp = n.saturating_sub(1).min(i32::MAX as u32) as i32;
        let d = (base * self.multiplier.powi(exp)).min(max);
        Duration::try_from_secs_f64(d).unwrap_or(self.max_delay)
    }

    /// The jittered delay after failed attempt `n`, given a uniform sample `u` in `[0, 1)` and the
    /// previous delay (for decorrelated jitter).
    pub fn delay(&self, n: u32, u: f64, previous: Duration) -> Duration {
        let u = if u.is_finite() {
            u.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let d = self.ceiling(n);
        match self.jitter {
            Jitter::None => d,
            Jitter::Proportional(r) => scale(d, 1.0 - r + 2.0 * r * u),
            Jitter::Full => scale(d, u),
            Jitter::Equal => (d / 2).saturating_add(scale(d / 2, u)),
            Jitter::Decorrelated => {
                let lo = self.base;
                let hi = previous.max(self.base).saturating_mul(3);
                lo.saturating_add(scale(hi.saturating_sub(lo), u))
                    .min(self.max_delay)
            }
        }
    }
}

/// `d * factor`, saturating at `Duration::MAX` instead of panicking.
fn scale(d: Duration, factor: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() * factor).unwrap_or(Duration::MAX)
}

/// Where jitter samples come from: the thread-local generator, or a seeded one shared by all
/// clones of a layer (deterministic, for tests).
#[derive(Debug, Clone, Default)]
pub(crate) enum JitterRng {
    #[default]
    ThreadLocal,
    Seeded(Arc<Mutex<fastrand::Rng>>),
}

impl JitterRng {
    pub(crate) fn seeded(seed: u64) -> Self {
        JitterRng::Seeded(Arc::new(Mutex::new(fastrand::Rng::with_seed(seed))))
    }

    pub(crate) fn sample(&self) -> f64 {
        match self {
            JitterRng::ThreadLocal => fastrand::f64(),
            JitterRng::Seeded(rng) => match rng.lock() {
                Ok(mut rng) => rng.f64(),
                Err(poisoned) => poisoned.into_inner().f64(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_schedule() {
        let b = Backoff::default();
        let ms = |n| b.ceiling(n).as_millis();
        assert_eq!(
            [ms(1), ms(2), ms(3), ms(4), ms(5), ms(6), ms(7)],
            [20, 40, 80, 160, 320, 640, 1000]
        );
        assert_eq!(b.delay(1, 0.0, Duration::ZERO), Duration::from_millis(16));
        assert_eq!(b.delay(1, 1.0, Duration::ZERO), Duration::from_millis(24));
        assert_eq!(b.delay(1, 0.5, Duration::ZERO), Duration::from_millis(20));
    }

    #[test]
    fn jitter_shapes() {
        let mut b = Backoff {
            jitter: Jitter::Full,
            ..Backoff::default()
        };
        assert_eq!(b.delay(2, 0.25, Duration::ZERO), Duration::from_millis(10));
        b.jitter = Jitter::Equal;
        assert_eq!(b.delay(2, 0.5, Duration::ZERO), Duration::from_millis(30));
        b.jitter = Jitter::Decorrelated;
        assert_eq!(
            b.delay(9, 1.0, Duration::from_millis(100)),
            Duration::from_millis(300)
        );
        assert_eq!(
            b.delay(9, 1.0, Duration::from_secs(5)),
            Duration::from_secs(1)
        );
        b.jitter = Jitter::None;
        assert_eq!(b.delay(2, 0.9, Duration::ZERO), Duration::from_millis(40));
        // Garbage samples are clamped, never a panic.
        assert_eq!(
            b.delay(2, f64::NAN, Duration::ZERO),
            Duration::from_millis(40)
        );
    }

    #[test]
    fn zero_base_and_huge_cap_do_not_panic() {
        let b = Backoff {
            base: Duration::ZERO,
            ..Backoff::default()
        };
        assert_eq!(b.ceiling(u32::MAX), Duration::ZERO);
        let b = Backoff {
            max_delay: Duration::MAX,
            ..Backoff::default()
        };
        assert_eq!(b.ceiling(u32::MAX), Duration::MAX);
        let _ = b.delay(u32::MAX, 0.999, Duration::MAX);
    }

    #[test]
    fn seeded_rng_is_deterministic() {
        let a = JitterRng::seeded(7);
        let b = JitterRng::seeded(7);
        let xs: Vec<f64> = (0..5).map(|_| a.sample()).collect();
        let ys: Vec<f64> = (0..5).map(|_| b.sample()).collect();
        assert_eq!(xs, ys);
    }

    proptest! {
        #[test]
        fn default_delay_within_bounds(n in 1u32..=u32::MAX, u in 0.0f64..1.0) {
            let b = Backoff::default();
            let ceiling = Duration::from_millis(20)
                .saturating_mul(2u32.saturating_pow(n.saturating_sub(1).min(31)))
                .min(Duration::from_secs(1));
            let d = b.delay(n, u, Duration::ZERO);
            prop_assert!(d >= ceiling.mul_f64(0.8) && d <= ceiling.mul_f64(1.2), "n={} d={:?}", n, d);
        }

        /// Any valid backoff, any attempt, any sample (even NaN or infinite) and any previous
        /// delay: no panic, the ceiling grows with n up to max_delay, and every jitter shape
        /// stays within its bounds.
        #[test]
        fn every_shape_within_bounds(
            base_ms in 0u64..20_000,
            multiplier in 1.0f64..16.0,
            max_ms in 0u64..120_000,
            r in 0.0f64..=1.0,
            shape in 0usize..5,
            n in any::<u32>(),
            u in prop_oneof![0.0f64..1.0, Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), Just(7.0)],
            previous_ms in any::<u64>(),
        ) {
            let jitter = [Jitter::None, Jitter::Proportional(r), Jitter::Full, Jitter::Equal, Jitter::Decorrelated][shape];
            let b = Backoff {
                base: Duration::from_millis(base_ms),
                multiplier,
                max_delay: Duration::from_millis(max_ms),
                jitter,
            };
            let ceiling = b.ceiling(n);
            prop_assert!(ceiling <= b.max_delay);
            prop_assert!(b.ceiling(n.saturating_add(1)) >= ceiling);
            let d = b.delay(n, u, Duration::from_millis(previous_ms));
            let slack = Duration::from_nanos(1);
            match jitter {
                Jitter::None => prop_assert_eq!(d, ceiling),
                Jitter::Proportional(r) => {
                    prop_assert!(d + slack >= ceiling.mul_f64(1.0 - r), "{:?} < {:?}", d, ceiling);
                    prop_assert!(d <= ceiling.mul_f64(1.0 + r) + slack, "{:?} > {:?}", d, ceiling);
                }
                Jitter::Full => prop_assert!(d <= ceiling + slack),
                Jitter::Equal => prop_assert!(d + slack >= ceiling / 2 && d <= ceiling + slack),
                Jitter::Decorrelated => prop_assert!(d <= b.max_delay.max(b.base)),
            }
        }
    }
}

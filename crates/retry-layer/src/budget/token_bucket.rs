//! [`TokenBucket`]: gRFC A6 retry throttling.

use std::sync::atomic::{AtomicI64, Ordering};

use super::{Budget, InvalidBudget};

/// gRFC A6 retry throttling: a token bucket that starts full at `max_tokens`; every failed
/// attempt takes one token, every success adds `token_ratio`; retries are allowed only while more
/// than half the tokens are left.
///
/// ```
/// use retry_layer::budget::{Budget, TokenBucket};
///
/// let bucket = TokenBucket::new(10, 0.1).unwrap();
/// assert!(bucket.withdraw());
/// for _ in 0..5 {
///     bucket.record(true);
/// }
/// assert!(!bucket.withdraw()); // 5 tokens left: not more than half
/// for _ in 0..20 {
///     bucket.record(false); // +0.1 each
/// }
/// assert!(bucket.withdraw());
/// ```
#[derive(Debug)]
pub struct TokenBucket {
    /// Tokens in thousandths.
    tokens: AtomicI64,
    max: i64,
    ratio: i64,
}

impl TokenBucket {
    /// A bucket of `max_tokens` (1 to 1000) refilled by `token_ratio` (0.001 to 1000) per success.
    pub fn new(max_tokens: u32, token_ratio: f64) -> Result<Self, InvalidBudget> {
        if !(1..=1000).contains(&max_tokens) {
            return Err(InvalidBudget("maxTokens must be between 1 and 1000"));
        }
        if !(0.001..=1000.0).contains(&token_ratio) || token_ratio.is_nan() {
            return Err(InvalidBudget("tokenRatio must be between 0.001 and 1000"));
        }
        let max = i64::from(max_tokens) * 1000;
        Ok(TokenBucket {
            tokens: AtomicI64::new(max),
            max,
            ratio: (token_ratio * 1000.0).round() as i64,
        })
    }

    fn add(&self, delta: i64) {
        // A full bucket stays full on a success: read, do not write (the common case of a
        // healthy backend touches no shared cache line for writing).
        if delta > 0 && self.tokens.load(Ordering::Relaxed) >= self.max {
            return;
        }
        let _ = self
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some((t + delta).clamp(0, self.max))
            });
    }
}

impl Budget for TokenBucket {
    fn deposit(&self) {}

    fn record(&self, failed: bool) {
        self.add(if failed { -1000 } else { self.ratio });
    }

    fn withdraw(&self) -> bool {
        self.tokens.load(Ordering::Acquire) > self.max / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_parameters() {
        assert!(TokenBucket::new(0, 0.1).is_err());
        assert!(TokenBucket::new(1001, 0.1).is_err());
        assert!(TokenBucket::new(10, 0.0).is_err());
        assert!(TokenBucket::new(10, f64::NAN).is_err());
    }
}

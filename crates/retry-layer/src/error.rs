//! Errors the retry layer returns, and the deadline extension it reads.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// The call's deadline passed before a response arrived. Returned instead of waiting longer;
/// downcast a `BoxError` to this type to tell it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeadlineExceeded {
    _p: (),
}

impl DeadlineExceeded {
    pub(crate) fn new() -> Self {
        DeadlineExceeded { _p: () }
    }
}

impl fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the call's deadline passed before a response arrived; \
             raise the Deadline, grpc-timeout or total_timeout if the server needs longer",
        )
    }
}

impl std::error::Error for DeadlineExceeded {}

/// The last attempt hit `attempt_timeout`; earlier ones, if any, failed too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttemptTimedOut {
    _p: (),
}

impl AttemptTimedOut {
    pub(crate) fn new() -> Self {
        AttemptTimedOut { _p: () }
    }
}

impl fmt::Display for AttemptTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the attempt timed out (attempt_timeout); the server may have executed it")
    }
}

impl std::error::Error for AttemptTimedOut {}

/// A deadline for the whole call, retries included, set as a request extension. It takes
/// precedence over `grpc-timeout` and the policy's `total_timeout`.
///
/// ```
/// use std::time::Duration;
/// use retry_layer::Deadline;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Deadline::after(Duration::from_millis(300)));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(pub Instant);

impl Deadline {
    /// A deadline `d` from now (tokio's clock: paused time in tests moves it).
    pub fn after(d: Duration) -> Self {
        Deadline(Instant::now() + d)
    }
}

/// What the layer did for a response, as a response extension: present when the response took
/// more than one attempt or the layer generated its idempotency key; absent means one attempt.
///
/// ```
/// use retry_layer::RetryInfo;
///
/// let res = http::Response::new(());
/// assert_eq!(RetryInfo::attempts_of(&res), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryInfo {
    /// Attempts sent, the first included.
    pub attempts: u32,
    /// The key [`ensure_idempotency_key`](crate::RetryPolicyBuilder::ensure_idempotency_key)
    /// generated for this request, if it did.
    pub idempotency_key: Option<http::HeaderValue>,
}

impl RetryInfo {
    /// The info of a response, if the layer added any.
    pub fn of<B>(res: &http::Response<B>) -> Option<&RetryInfo> {
        res.extensions().get::<RetryInfo>()
    }

    /// Attempts a response took (1 when the layer added no info).
    pub fn attempts_of<B>(res: &http::Response<B>) -> u32 {
        RetryInfo::of(res).map_or(1, |i| i.attempts)
    }
}

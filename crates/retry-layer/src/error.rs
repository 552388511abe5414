//! Errors the retry layer returns, and what it tells about a response ([`RetryInfo`]).

use std::error::Error as StdError;
use std::fmt;

use reason_code::BoxError;

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

/// The inner service did not become ready within
/// [`response_head_timeout`](crate::RetryPolicyBuilder::response_head_timeout) (the bound on a
/// call's wait for readiness when it has no `total_timeout`): nothing was sent. A tonic
/// `Channel` stays not ready while it cannot connect; a `ConcurrencyLimit`, while its permits
/// are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceNotReady {
    waited: std::time::Duration,
}

impl ServiceNotReady {
    pub(crate) fn new(waited: std::time::Duration) -> Self {
        ServiceNotReady { waited }
    }

    /// How long the call waited for the service.
    pub fn waited(&self) -> std::time::Duration {
        self.waited
    }
}

impl fmt::Display for ServiceNotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the inner service did not become ready within {:?}; nothing was sent (is the \
             backend reachable? set total_timeout to bound the wait by the call's deadline)",
            self.waited
        )
    }
}

impl std::error::Error for ServiceNotReady {}

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

/// An attempt got no response head within
/// [`response_head_timeout`](crate::RetryPolicyBuilder::response_head_timeout); earlier
/// attempts, if any, failed too. The server may have executed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeadTimedOut {
    timeout: std::time::Duration,
}

impl ResponseHeadTimedOut {
    pub(crate) fn new(timeout: std::time::Duration) -> Self {
        ResponseHeadTimedOut { timeout }
    }

    /// The bound that was reached.
    pub fn timeout(&self) -> std::time::Duration {
        self.timeout
    }
}

impl fmt::Display for ResponseHeadTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no response head within {:?} (response_head_timeout); the server may have executed              the request; raise RetryPolicyBuilder::response_head_timeout for endpoints that take              longer to start answering",
            self.timeout
        )
    }
}

impl std::error::Error for ResponseHeadTimedOut {}

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

/// The error of a call the layer gave up on: the last attempt's error (or
/// [`DeadlineExceeded`]), with the attempts sent and the idempotency key the layer generated.
///
/// Every error [`Retry`](crate::Retry) returns is a `RetryError` inside the [`BoxError`]:
/// downcast to it, then look at [`inner`](RetryError::inner) (also its
/// [`source`](std::error::Error::source)) for the cause. Keep the
/// [`idempotency_key`](RetryError::idempotency_key): a retry of your own that carries it is the
/// same intent, which the server executes at most once.
///
/// ```
/// use retry_layer::{ReplayBody, RetryError, RetryErrorKind, RetryLayer, RetryPolicy};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let policy = RetryPolicy::builder().ensure_idempotency_key().build().unwrap();
/// let client = ServiceBuilder::new()
///     .layer(RetryLayer::new(policy))
///     .service_fn(|_req: http::Request<ReplayBody<String>>| async {
///         // The connection drops after every request was sent: it may have executed.
///         Err::<http::Response<String>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
///     });
/// let req = http::Request::post("http://orders/orders").body(String::from("{}")).unwrap();
/// let err = client.oneshot(req).await.unwrap_err();
///
/// let err = RetryError::of(&*err).expect("every error of the layer is a RetryError");
/// assert_eq!(err.attempts(), 3);
/// assert!(err.is::<std::io::Error>());
/// // The connection was lost after the request went out: it may have run.
/// assert_eq!(err.kind(), RetryErrorKind::Ambiguous);
/// assert!(err.may_have_executed());
/// // Resend later with this key: the server runs the order at most once.
/// assert!(err.idempotency_key().is_some());
/// # }
/// ```
#[derive(Debug)]
pub struct RetryError {
    info: RetryInfo,
    source: BoxError,
    /// Attempts that may have reached the server (not provably unsent).
    reached: u32,
    /// How the last attempt's error was classified.
    kind: RetryErrorKind,
}

/// How a call the layer gave up on ended ([`RetryError::kind`]): what a caller decides on
/// (resend now, later, or find out first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryErrorKind {
    /// The call's deadline passed ([`DeadlineExceeded`]).
    DeadlineExceeded,
    /// The inner service never became ready for the attempt ([`ServiceNotReady`]).
    NotReady,
    /// The last attempt provably never left (a refused connection, an HTTP/2 `REFUSED_STREAM`
    /// or a GOAWAY beyond its stream).
    NotSent,
    /// The last attempt timed out ([`AttemptTimedOut`], [`ResponseHeadTimedOut`]) after it was
    /// sent: the server may have executed it.
    TimedOut,
    /// The last attempt failed after it may have reached the server (a connection lost after
    /// sending, an error of the inner service): it may have executed.
    Ambiguous,
}

impl RetryError {
    pub(crate) fn new(source: BoxError, attempts: u32, key: Option<http::HeaderValue>) -> Self {
        RetryError {
            info: RetryInfo {
                attempts,
                idempotency_key: key,
            },
            source,
            reached: attempts,
            kind: RetryErrorKind::Ambiguous,
        }
    }

    /// The error classified as `kind` (by `classify::error_kind`).
    pub(crate) fn classified(mut self, kind: RetryErrorKind) -> Self {
        self.kind = kind;
        self
    }

    /// Of its attempts, `reached` may have reached the server (the others provably never left).
    pub(crate) fn reached(mut self, reached: u32) -> Self {
        self.reached = reached.min(self.info.attempts);
        self
    }

    /// How the call ended.
    pub fn kind(&self) -> RetryErrorKind {
        self.kind
    }

    /// Whether the server may have executed the request: false only when no attempt can have
    /// reached it (each was refused before it left, or none was sent). A write for which this
    /// is true is resent safely only with its idempotency key
    /// ([`idempotency_key`](Self::idempotency_key)).
    pub fn may_have_executed(&self) -> bool {
        match self.kind() {
            // The deadline may have ended an attempt in flight.
            RetryErrorKind::DeadlineExceeded => self.info.attempts > 0,
            _ => self.reached > 0,
        }
    }

    /// The `RetryError` in an error returned by the layer, if it is one.
    pub fn of<'a>(err: &'a (dyn StdError + Send + Sync + 'static)) -> Option<&'a RetryError> {
        err.downcast_ref::<RetryError>()
    }

    /// Attempts sent, the first included (0 when the inner service failed before any was sent).
    pub fn attempts(&self) -> u32 {
        self.info.attempts
    }

    /// The key [`ensure_idempotency_key`](crate::RetryPolicyBuilder::ensure_idempotency_key)
    /// generated for this request, if it did: resend with it to stay one intent.
    pub fn idempotency_key(&self) -> Option<&http::HeaderValue> {
        self.info.idempotency_key.as_ref()
    }

    /// Attempts and key, as [`RetryInfo`] (the same type successful responses carry).
    pub fn info(&self) -> &RetryInfo {
        &self.info
    }

    /// The error of the last attempt, or [`DeadlineExceeded`].
    pub fn inner(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.source
    }

    /// True when the inner error is an `E`.
    pub fn is<E: StdError + 'static>(&self) -> bool {
        self.source.is::<E>()
    }

    /// The inner error as an `E`, if it is one.
    pub fn downcast_ref<E: StdError + 'static>(&self) -> Option<&E> {
        self.source.downcast_ref::<E>()
    }

    /// The inner error.
    pub fn into_inner(self) -> BoxError {
        self.source
    }
}

impl fmt::Display for RetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (after {} attempt", self.source, self.info.attempts)?;
        if self.info.attempts != 1 {
            f.write_str("s")?;
        }
        if let Some(key) = &self.info.idempotency_key {
            write!(
                f,
                "; the request carried the generated idempotency key {}: resend with it to keep \
                 one intent",
                String::from_utf8_lossy(key.as_bytes())
            )?;
        }
        f.write_str(")")
    }
}

impl StdError for RetryError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

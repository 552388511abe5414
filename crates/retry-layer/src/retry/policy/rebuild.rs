//! The rebuild hook: how a caller turns a conflict (409, ABORTED, `STOCK_CONFLICT`) into the next
//! attempt's request, after re-reading what changed.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use reason_code::Code;

/// The future a [`Rebuild`] hook returns.
pub type RebuildFuture = Pin<Box<dyn Future<Output = Option<http::Request<Bytes>>> + Send>>;

/// What a [`Rebuild`] hook receives after an ABORTED outcome (409, `STOCK_CONFLICT`, ...).
#[derive(Debug)]
#[non_exhaustive]
pub struct Conflict {
    /// The request as it was last sent, with its whole body.
    pub request: http::Request<Bytes>,
    /// The code the response was classified as.
    pub code: Code,
    /// The status and headers of the response (its body was not read).
    pub response: http::response::Parts,
}

/// A hook that rebuilds a request after a conflict, for example by re-reading the current state
/// and recomputing the write. Returning `None` gives the conflict response back to the caller.
///
/// Implemented for every `Fn(Conflict) -> impl Future<Output = Option<http::Request<Bytes>>>`.
pub trait Rebuild: Send + Sync + 'static {
    /// Builds the next attempt's request, or `None` to stop.
    fn rebuild(&self, conflict: Conflict) -> RebuildFuture;
}

impl<F, Fut> Rebuild for F
where
    F: Fn(Conflict) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<http::Request<Bytes>>> + Send + 'static,
{
    fn rebuild(&self, conflict: Conflict) -> RebuildFuture {
        Box::pin(self(conflict))
    }
}

impl fmt::Debug for dyn Rebuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rebuild hook")
    }
}

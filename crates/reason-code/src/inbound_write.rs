//! [`InboundWrite`]: the write a handler is executing, for the keys of its outbound writes.

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

tokio::task_local! {
    static CURRENT: InboundWrite;
}

/// Calls made so far, per target (few targets per handler: a list, not a map).
type Calls = Arc<Mutex<Vec<(Box<str>, u32)>>>;

/// The inbound write whose handler is running: its scope (a hash of its tenant, method and
/// idempotency key), and a count of the outbound calls the handler has made so far, per target.
///
/// Each hop is effectively-once on its own; a chain is not, unless a handler that runs a second
/// time (its leader crashed and the claim was taken over, its claim lapsed, a failure released
/// it) sends its downstream writes with the same keys as the first time. `idempotency-layer`
/// runs the handler of every write it executes in an [`InboundWrite::scope`]; a client
/// `RetryLayer` inside that handler, when it derives keys, makes each outbound write's key from
/// the inbound scope and the call's place in the handler ([`next_call`](Self::next_call)): the
/// same handler run again sends the same keys in the same order, and the downstream service
/// replays instead of executing again.
///
/// ```
/// use reason_code::InboundWrite;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// assert!(InboundWrite::current().is_none());
/// let run = || async {
///     let here = InboundWrite::current().expect("in scope");
///     let first = here.next_call("POST inventory/deduct");
///     // A task of the handler's own, in a handle of the same write: counted together.
///     let spawned = tokio::spawn(here.scope(async {
///         InboundWrite::with_current(|w| w.next_call("POST inventory/deduct"))
///     }));
///     (first, spawned.await.unwrap().unwrap())
/// };
/// let first = InboundWrite::new([7; 32]).scope(run()).await;
/// let again = InboundWrite::new([7; 32]).scope(run()).await;
/// assert_eq!(first, (0, 1));
/// assert_eq!(first, again, "a second run numbers its calls the same way");
/// # }
/// ```
#[derive(Debug)]
pub struct InboundWrite {
    scope: Scope,
    /// Shared by the handles [`current`](Self::current) gives out, made on first use (a
    /// handler that derives no key allocates nothing).
    calls: OnceLock<Calls>,
}

/// An inbound write's scope: known, or made when first asked.
#[derive(Clone)]
enum Scope {
    Known([u8; 32]),
    Deferred(Arc<dyn ScopeSource>),
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Known(bytes) => f.debug_tuple("Known").field(&&bytes[..8]).finish(),
            Scope::Deferred(_) => f.write_str("Deferred"),
        }
    }
}

/// Where the scope of an [`InboundWrite::deferred`] comes from, made only when a handler
/// derives a key (most derive none).
///
/// It must answer the same bytes on every call, and the same bytes for one write on every run,
/// in every process: they are what the derived keys of the handler's outbound writes are made
/// from. (`idempotency-layer`'s `IdempotentWrite` is one: the write's stable scope key,
/// computed once when first asked.)
pub trait ScopeSource: Send + Sync + 'static {
    /// The scope: a hash of the write's tenant, method and idempotency key.
    fn scope_bytes(&self) -> [u8; 32];
}

impl InboundWrite {
    /// The inbound write of `scope` (its tenant, method and key, hashed), no call made yet.
    pub fn new(scope: [u8; 32]) -> Self {
        InboundWrite {
            scope: Scope::Known(scope),
            calls: OnceLock::new(),
        }
    }

    /// The inbound write whose scope `source` makes when first asked
    /// ([`scope_bytes`](Self::scope_bytes)), so a handler that derives no key never pays for
    /// the hash.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use reason_code::{InboundWrite, ScopeSource};
    ///
    /// struct Hashed;
    /// impl ScopeSource for Hashed {
    ///     fn scope_bytes(&self) -> [u8; 32] {
    ///         [7; 32] // a hash of tenant, method and key
    ///     }
    /// }
    ///
    /// let write = InboundWrite::deferred(Arc::new(Hashed));
    /// assert_eq!(write.scope_bytes(), InboundWrite::new([7; 32]).scope_bytes());
    /// ```
    pub fn deferred(source: Arc<dyn ScopeSource>) -> Self {
        InboundWrite {
            scope: Scope::Deferred(source),
            calls: OnceLock::new(),
        }
    }

    /// The inbound write's scope.
    pub fn scope_bytes(&self) -> [u8; 32] {
        match &self.scope {
            Scope::Known(bytes) => *bytes,
            Scope::Deferred(source) => source.scope_bytes(),
        }
    }

    fn calls(&self) -> &Calls {
        self.calls.get_or_init(Arc::default)
    }

    /// The place of the next call to `target` among this handler's calls to it: 0 for the
    /// first, then 1, 2, ...
    pub fn next_call(&self, target: &str) -> u32 {
        let mut calls = self.calls().lock().unwrap_or_else(|e| e.into_inner());
        match calls.iter_mut().find(|(t, _)| &**t == target) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                calls.push((target.into(), 0));
                0
            }
        }
    }

    /// Runs `future` with this write as the current one. A handler that makes outbound calls
    /// from a task of its own (`tokio::spawn`) runs that task in a handle of the same write
    /// ([`current`](Self::current) before the spawn): task-locals do not cross `spawn`, and a
    /// new `InboundWrite` would number its calls from 0 again.
    pub fn scope<F: Future>(
        self,
        future: F,
    ) -> tokio::task::futures::TaskLocalFuture<InboundWrite, F> {
        CURRENT.scope(self, future)
    }

    /// A handle of the inbound write the current task runs in, if any: the same scope, and the
    /// same count of calls (a call numbered through one handle is counted in all).
    pub fn current() -> Option<InboundWrite> {
        CURRENT
            .try_with(|w| InboundWrite {
                scope: w.scope.clone(),
                calls: OnceLock::from(w.calls().clone()),
            })
            .ok()
    }

    /// Calls `f` with the inbound write the current task runs in, if any (no handle made).
    pub fn with_current<R>(f: impl FnOnce(&InboundWrite) -> R) -> Option<R> {
        CURRENT.try_with(f).ok()
    }
}

//! Work the layer runs for requests whose client went away: a handler finished after its client
//! left ([`OnDisconnect::Complete`](crate::OnDisconnect::Complete)), a response body read to its
//! end to record it, a store operation that must not be cut in half, a claim released in the
//! background. It runs outside any limit of the server (its connection is gone), so the layer
//! bounds it: at most [`max_detached`](crate::IdempotencyLayer::max_detached) pieces of work
//! (handlers, bodies) at once, layer-wide, each also ended at its claim's lifetime; and as many
//! store operations (a record, a release), each bounded by the store's own retries. The two are
//! counted apart so that a handler cancelled past the bound still has its claim released.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;

use crate::shared::{Detached, Shared};
use crate::store::Token;

/// A claim's store operation, boxed once (the store type is erased).
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What detached work is: each kind has `max_detached` places of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A handler, or a response body read to its end.
    Work = 0,
    /// A claim's store operation: storing a record, releasing a claim.
    StoreOp = 1,
}

impl Detached {
    /// Pieces of detached work of either kind running now.
    pub(crate) fn running(&self) -> usize {
        self.running.iter().map(|r| r.load(Ordering::Relaxed)).sum()
    }
}

/// One running piece of detached work: its place among the `max_detached` of its kind, freed on
/// drop.
pub(crate) struct DetachedPermit(Arc<Detached>, Kind);

impl fmt::Debug for DetachedPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DetachedPermit")
    }
}

impl Drop for DetachedPermit {
    fn drop(&mut self) {
        self.0.running[self.1 as usize].fetch_sub(1, Ordering::Relaxed);
    }
}

/// A place for one more piece of detached work of `kind` (`what`, for the log), or `None`
/// (counted and logged) when `max` of its kind already run.
pub(crate) fn permit(
    shared: &Arc<Shared>,
    max: usize,
    kind: Kind,
    what: &'static str,
) -> Option<DetachedPermit> {
    let permit = place(shared, max, kind);
    if permit.is_none() {
        shared.counters.detached_refused();
        tracing::warn!(
            what,
            max,
            "idempotency: max_detached pieces of work already run for clients that went away; \
             this one is not run"
        );
    }
    permit
}

/// A place for one more piece of detached work of `kind`, or `None` when `max` of its kind
/// already run.
fn place(shared: &Arc<Shared>, max: usize, kind: Kind) -> Option<DetachedPermit> {
    let running = &shared.detached.running[kind as usize];
    if running.fetch_add(1, Ordering::Relaxed) >= max {
        running.fetch_sub(1, Ordering::Relaxed);
        return None;
    }
    Some(DetachedPermit(shared.detached.clone(), kind))
}

/// Spawns `fut` as detached work of `kind` if a place is free and a tokio runtime runs; else
/// hands it back, not started, for its caller to run (nothing is logged or counted: the work is
/// not refused).
pub(crate) fn spawn_or_hand_back<F>(
    shared: &Arc<Shared>,
    max: usize,
    kind: Kind,
    fut: F,
) -> Result<(), F>
where
    F: Future<Output = ()> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Err(fut);
    };
    let Some(permit) = place(shared, max, kind) else {
        return Err(fut);
    };
    runtime.spawn(async move {
        let _permit = permit;
        fut.await
    });
    Ok(())
}

/// Spawns `fut` as detached work of `kind` (`what`, for the log) if a place is free and a tokio
/// runtime runs; else hands it back, not started.
pub(crate) fn spawn<F>(
    shared: &Arc<Shared>,
    max: usize,
    kind: Kind,
    what: &'static str,
    fut: F,
) -> Result<(), F>
where
    F: Future<Output = ()> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            what,
            "idempotency: no tokio runtime to run work for a client that went away"
        );
        return Err(fut);
    };
    let Some(permit) = permit(shared, max, kind, what) else {
        return Err(fut);
    };
    runtime.spawn(async move {
        let _permit = permit;
        fut.await
    });
    Ok(())
}

/// Where detached work goes, and when it must end: what [`DetachOnDrop`] needs.
#[derive(Debug)]
pub(crate) struct DetachTo {
    pub(crate) shared: Arc<Shared>,
    pub(crate) max: usize,
    pub(crate) kind: Kind,
    /// The claim this work serves, and the end of its lifetime: the work is cancelled there,
    /// and the claim counted as lapsed.
    pub(crate) lifetime: Option<(Token, Instant)>,
    pub(crate) what: &'static str,
}

impl DetachTo {
    /// A store operation: counted apart from handlers and bodies, and not ended at the claim's
    /// lifetime (it is bounded by its own retries; a record cut off half-way would leave the
    /// claim to lapse).
    pub(crate) fn store_op(mut self) -> Self {
        self.kind = Kind::StoreOp;
        self.lifetime = None;
        self
    }
}

/// A claim's store operation that completes even if its client goes away.
pub(crate) type StoreOp = DetachOnDrop<dyn Future<Output = ()> + Send + 'static>;

/// `op`, detached to `to` if dropped before it completes.
pub(crate) fn store_op(op: BoxFuture, to: Option<DetachTo>) -> StoreOp {
    DetachOnDrop::new(op, to.map(DetachTo::store_op))
}

/// Polls a future; if dropped before it completes (its client went away), finishes it as
/// detached work, cancelled at its claim's lifetime; when no place is free, drops it (which
/// cancels it: whatever it holds, a claim say, cleans up after itself).
pub(crate) struct DetachOnDrop<F: Future + Send + ?Sized + 'static>
where
    F::Output: Send + 'static,
{
    fut: Option<Pin<Box<F>>>,
    to: Option<DetachTo>,
}

impl<F: Future + Send + ?Sized + 'static> DetachOnDrop<F>
where
    F::Output: Send + 'static,
{
    /// `fut`, detached to `to` if dropped before it completes (`None`: dropped, which cancels
    /// it).
    pub(crate) fn new(fut: Pin<Box<F>>, to: Option<DetachTo>) -> Self {
        DetachOnDrop { fut: Some(fut), to }
    }
}

impl<F: Future + Send + ?Sized + 'static> Future for DetachOnDrop<F>
where
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let fut = self
            .fut
            .as_mut()
            .expect("DetachOnDrop polled after completion");
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<F: Future + Send + ?Sized + 'static> Drop for DetachOnDrop<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let (Some(fut), Some(to)) = (self.fut.take(), self.to.take()) else {
            return;
        };
        let DetachTo {
            shared,
            max,
            kind,
            lifetime,
            what,
        } = to;
        let bounded = {
            let shared = shared.clone();
            async move {
                let Some((token, end)) = lifetime else {
                    drop(fut.await);
                    return;
                };
                if tokio::time::timeout_at(end, fut).await.is_err() {
                    shared.renewals.expire(token);
                    tracing::warn!(
                        what,
                        "idempotency: detached work reached max_claim_lifetime; cancelled"
                    );
                }
            }
        };
        // The work goes on in a task of its own, outside the request's: the hop it was served
        // in (a tokio task-local of `HopLayer`'s, set while the request's future drops) goes
        // with it, so that a handler serving an inbound retry still sends its outbound calls
        // once.
        let bounded = match reason_code::Hop::current() {
            Some(hop) => futures_util::future::Either::Left(hop.scope(bounded)),
            None => futures_util::future::Either::Right(bounded),
        };
        // Refused: dropped here, which cancels it.
        let _ = spawn(&shared, max, kind, what, bounded);
    }
}

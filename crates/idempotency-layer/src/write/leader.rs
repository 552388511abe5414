//! The leader of a scope: it runs the handler, records its response as it streams, and
//! settles the claim (stored, left to the handler's transaction, or released on a failure).

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Waker};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{Request, Response, Version};
use http_body::Body;
use reason_code::InboundWrite;
use tower_service::Service;

use crate::body::{IdempotencyBody, RequestBody};
use crate::config::{Config, OnDisconnect};
use crate::observe;
use crate::observe::WriteOutcome;
use crate::reject::{respond, RejectReason};
use crate::store::{Fingerprint, IdempotencyStore, Record};
use crate::tx::{TxLedger, TxOutcome};
use crate::write::claim::{Claim, Settled};
use crate::write::detached::{DetachOnDrop, DetachTo};
use crate::write::record_rules;
use crate::write::record_rules::AtHead;
use crate::write::recorder::ResponseRecorder;
use crate::write::waiters::SharedFailure;
use reason_code::BoxError;

use super::replay::replay;
use super::{Answer, Inner, Write};

/// Why the leader's handler produced no response.
pub(super) struct Panicked;

impl<S, St> Write<S, St>
where
    St: IdempotencyStore,
{
    /// Runs the handler as the leader of the scope, and records its response as it streams
    /// (unless the handler recorded it in its own transaction: `ledger`).
    ///
    /// A plain function: the handler's call and the recording are boxed here, before anything
    /// is awaited, and the future returned holds only that box and what it needs after it, so
    /// the write's future (which holds this one) stays small and cheap to move.
    pub(super) fn run_as_leader<ReqB, ResB>(
        self,
        req: Request<RequestBody<ReqB>>,
        claim: Claim,
        ledger: Option<Arc<TxLedger>>,
        (inbound, fp): (InboundWrite, Fingerprint),
    ) -> impl Future<Output = Answer<ResB, S::Error>> + Send + 'static
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Send + 'static,
        ResB: Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        self.shared.counters.executed();
        observe::record_outcome(&self.span, WriteOutcome::Executed);
        tracing::debug!("idempotency: executing");
        let Write {
            inner,
            config,
            shared,
            protocol,
            ..
        } = self;
        // Dropped first (the client went away), `Complete` finishes the call and its recording
        // as detached work (bounded by `max_detached` and the claim's lifetime); `Release`
        // drops it (the claim is released). The handler runs in this future until then: a task
        // per execution cost more than the rest of the layer (see BENCHMARKS.md).
        let detach = match config.on_disconnect {
            OnDisconnect::Complete => claim.detach_to("finish a handler whose client went away"),
            OnDisconnect::Release => None,
        };
        let grpc = protocol.is_grpc();
        let run = Box::pin(call_and_record(
            inner,
            req,
            claim,
            ledger,
            config.clone(),
            (inbound, fp),
            grpc,
        ));
        let run = DetachOnDrop::new(run, detach);
        async move {
            match run.await {
                Ok(answer) => answer,
                Err(Panicked) => {
                    shared.counters.rejected(RejectReason::Internal);
                    Ok(respond(
                        RejectReason::Internal,
                        "the handler failed; nothing was recorded, a retry executes again",
                        &protocol,
                        config.reasons.header_name(),
                        config.rejection_body.as_ref(),
                    ))
                }
            }
        }
    }
}

/// Calls the inner service, readying it first unless `poll_ready` already did.
pub(super) fn call_inner<S, R>(
    inner: Inner<S>,
    req: R,
) -> impl Future<Output = Result<S::Response, S::Error>>
where
    S: Service<R>,
{
    let (mut inner, ready) = match inner {
        Inner::Ready(s) => (s, true),
        Inner::NotReady(s) => (s, false),
    };
    async move {
        if !ready {
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
        }
        inner.call(req).await
    }
}

/// Calls the inner service and records its response with a [`ResponseRecorder`] (storing the record
/// at once when the body is already whole; when the head says the outcome is not recordable,
/// answering at once and releasing the claim in the background). When the handler recorded its
/// response in its own transaction (`ledger`), the claim is left as that transaction left it.
/// A handler that fails (an error, a panic) releases the claim, and its failure is the answer
/// of the duplicates that were waiting for it.
///
/// A plain function returning a future, so the request and the service are held once (by the
/// call), not twice (by the outer future too): the future stays small enough for the allocator's
/// fast path when it is boxed.
pub(super) fn call_and_record<S, ReqB, ResB>(
    inner: Inner<S>,
    req: Request<RequestBody<ReqB>>,
    claim: Claim,
    ledger: Option<Arc<TxLedger>>,
    cfg: Arc<Config>,
    (inbound, fp): (InboundWrite, Fingerprint),
    grpc: bool,
) -> impl Future<Output = Result<Answer<ResB, S::Error>, Panicked>>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let http1 = req.version() < Version::HTTP_2;
    // The handler runs as the inbound write of its scope: a `RetryLayer` inside it that derives
    // keys gives its outbound writes the same keys on every run of this write.
    let call = AssertUnwindSafe(inbound.scope(call_inner(inner, req))).catch_unwind();
    // `then`, not an `async` block awaiting `call`: the handler's call and what follows it are
    // the two states of one future, so the request is held once, not also by an `.await` slot
    // beside the captured call.
    call.then(move |called| async move {
        let res = match called {
            Ok(Ok(res)) => res,
            Ok(Err(e)) => {
                // The handler's error goes to its own client; its waiters have nothing to share
                // but the failure itself.
                let failed = || SharedFailure::Reject(RejectReason::InFlightFailed);
                return Ok(
                    match end_without_response(claim, ledger, fp, failed).await {
                        Some(record) => Ok(replay(&record, grpc, cfg.max_record_bytes)),
                        None => Err(e),
                    },
                );
            }
            Err(_) => {
                tracing::error!("idempotency: handler panicked");
                // Its waiters get what its own client gets: 500 / INTERNAL.
                let panicked = || SharedFailure::Reject(RejectReason::Internal);
                return match end_without_response(claim, ledger, fp, panicked).await {
                    Some(record) => Ok(Ok(replay(&record, grpc, cfg.max_record_bytes))),
                    None => Err(Panicked),
                };
            }
        };
        let (mut parts, body) = res.into_parts();
        let verdict = ledger.map_or(TxOutcome::Unused, |l| l.judge(Some(&mut parts.extensions)));
        match verdict {
            TxOutcome::Unused => {}
            TxOutcome::Committed => {
                claim.recorded_in_transaction();
                return Ok(Ok(Response::from_parts(
                    parts,
                    IdempotencyBody::inner(body),
                )));
            }
            TxOutcome::InDoubt => {
                // Dropped mid-way (the client went away), the store operations still complete.
                let detach = claim.detach_to("settle a transactional completion");
                let settled =
                    DetachOnDrop::new(claim.settle(fp), detach.map(DetachTo::store_op)).await;
                return Ok(Ok(match settled {
                    Settled::Recorded(record) => {
                        tracing::warn!(
                            "idempotency: the handler recorded a response in its transaction, \
                             committed, then returned another; answering with the recorded one"
                        );
                        replay(&record, grpc, cfg.max_record_bytes)
                    }
                    Settled::Released | Settled::Unknown => {
                        Response::from_parts(parts, IdempotencyBody::inner(body))
                    }
                }));
            }
        }
        let head_code = match record_rules::at_head(&cfg, grpc, parts.status, &parts.headers) {
            AtHead::NotRecordable(code) if !claim.has_waiters() => {
                // Answered at once; the store (which may be slow, or down) is told after.
                tracing::debug!(%code, "idempotency: outcome not recordable; releasing");
                if let Some(release) = claim.release() {
                    release.await;
                }
                return Ok(Ok(Response::from_parts(
                    parts,
                    IdempotencyBody::inner(body),
                )));
            }
            // Duplicates wait for it: read like a record (never stored), so they get it too.
            AtHead::NotRecordable(code) => Some(code),
            AtHead::Record(head_code) => head_code,
        };
        // Poll the body once before the head goes out. A body the handler made whole (a `Full`,
        // a `String`, an empty body, which a server never polls) is recorded now, and its head
        // and its one frame then leave together: one write, with no pause between the head and
        // a small last packet while a shared store records it (Nagle and delayed ACKs would
        // stretch that to tens of milliseconds); such a body is answered as it is. A streaming
        // body is read to its end by a task of its own and recorded when it ends. The poll's
        // waker is a no-op: a body not ready now is polled again by that task.
        let started = ResponseRecorder::new(
            body,
            claim,
            cfg,
            fp,
            parts.status,
            parts.headers.clone(),
            http1,
            head_code,
        )
        .start(&mut Context::from_waker(Waker::noop()));
        if let Some(store) = started.store {
            // Dropped mid-store (the client went away), the store operation still completes.
            store.await;
        }
        Ok(Ok(Response::from_parts(parts, started.body)))
    })
}

/// The handler returned no response (an error, a panic): the duplicates waiting for it get
/// `failure`, and the claim is released in the background; unless the handler recorded a
/// response in its own transaction, which may have committed: then the record it stored, to
/// answer with instead (the client gets what every duplicate will get).
pub(super) async fn end_without_response(
    claim: Claim,
    ledger: Option<Arc<TxLedger>>,
    fp: Fingerprint,
    failure: impl FnOnce() -> SharedFailure,
) -> Option<Arc<Record>> {
    match ledger.map_or(TxOutcome::Unused, |l| l.judge(None)) {
        TxOutcome::Unused => {
            claim.share_failure(failure);
            if let Some(release) = claim.release() {
                release.await;
            }
            None
        }
        // Dropped mid-way (the client went away), the store operations still complete.
        _ => {
            let detach = claim.detach_to("settle a transactional completion");
            match DetachOnDrop::new(claim.settle(fp), detach.map(DetachTo::store_op)).await {
                Settled::Recorded(record) => Some(record),
                Settled::Released | Settled::Unknown => None,
            }
        }
    }
}

//! A client on one connection, as hyper's `SendRequest` on one HTTP/1.1 connection: ready for
//! its next request only once the answer before it is read to its end or let go.
//!
//! A layer that keeps a failed answer, unread, while it waits to send its next attempt waits
//! for a connection only it holds. The service sees that happen (the wait and the holder are
//! both its own facts: a call asks for the connection while its own unread answer holds it, and
//! asks again, still so, at a later time of the simulation's clock) and the ledger records it;
//! the invariants call it a violation. A layer that asks once and, not ready, answers the
//! failure in hand does not wait.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower_service::Service;

use crate::client::call_of;
use crate::ledger::{now, Ledger};

tokio::task_local! {
    /// The call whose task is running: set around each call of a client, so that a wait for
    /// the connection knows whose it is (a `Buffer`'s worker, polling for its own task, has
    /// none).
    pub static CALL: usize;
}

/// Who has the connection.
#[derive(Clone, Copy, Debug)]
enum Holder {
    /// A service that was ready and has not called yet.
    Reserved,
    /// A request in flight.
    InFlight,
    /// An answer's body (its serial number), of this call; `read` once anyone polled it.
    Body(u64, Option<usize>, bool),
}

#[derive(Debug, Default)]
struct Slot {
    holder: Option<Holder>,
    wakers: Vec<Waker>,
    /// Answers given so far: each body's serial number.
    bodies: u64,
    /// A call that asked for the connection while its own unread answer (this serial) held
    /// it, and when it first did.
    asked_held: Option<(usize, u64, Duration)>,
}

/// The one connection, shared by every clone of the service.
#[derive(Clone, Debug, Default)]
struct Connection(Arc<Mutex<Slot>>);

impl Connection {
    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.0.lock().expect("the connection's slot")
    }

    fn set(&self, holder: Holder) {
        self.slot().holder = Some(holder);
    }

    /// The connection is free: whoever waits for it is woken.
    fn release(&self) {
        let wakers = {
            let mut slot = self.slot();
            slot.holder = None;
            std::mem::take(&mut slot.wakers)
        };
        for w in wakers {
            w.wake();
        }
    }
}

/// Holds the connection until dropped.
#[derive(Debug)]
struct Lease(Connection);

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// `inner` on one connection (`one`), or as it is (every request at once, as a pool does).
#[derive(Debug)]
pub struct OneConnection<S> {
    inner: S,
    connection: Option<Connection>,
    /// This clone was ready: the connection is its to call on.
    reserved: Option<Lease>,
    ledger: Ledger,
}

impl<S: Clone> Clone for OneConnection<S> {
    fn clone(&self) -> Self {
        // As tower's `ConcurrencyLimit`: a clone is not ready until it is polled.
        OneConnection {
            inner: self.inner.clone(),
            connection: self.connection.clone(),
            reserved: None,
            ledger: self.ledger.clone(),
        }
    }
}

impl<S> OneConnection<S> {
    /// `inner`, on one connection if `one`.
    pub fn new(inner: S, one: bool, ledger: Ledger) -> Self {
        OneConnection {
            inner,
            connection: one.then(Connection::default),
            reserved: None,
            ledger,
        }
    }
}

impl<S, B, R> Service<Request<B>> for OneConnection<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    R: Body,
{
    type Response = Response<Held<R>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if let (Some(connection), None) = (&self.connection, &self.reserved) {
            let mut slot = connection.slot();
            match slot.holder {
                None => {
                    slot.holder = Some(Holder::Reserved);
                    drop(slot);
                    self.reserved = Some(Lease(connection.clone()));
                }
                Some(holder) => {
                    slot.wakers.push(cx.waker().clone());
                    // Asked while its own call's answer holds the connection, unread: asked
                    // again, still so, later, the call is waiting for itself (a wait only a
                    // bound or the call's end can end).
                    let mut since = None;
                    if let (Holder::Body(serial, Some(holder), false), Ok(waiter)) =
                        (holder, CALL.try_with(|c| *c))
                    {
                        if holder == waiter {
                            let now = now();
                            match slot.asked_held {
                                Some((c, s, first)) if c == waiter && s == serial => {
                                    if now > first {
                                        since = Some((waiter, first));
                                    }
                                }
                                _ => slot.asked_held = Some((waiter, serial, now)),
                            }
                        }
                    }
                    drop(slot);
                    if let Some((call, first)) = since {
                        self.ledger.call_waited_on_itself(call, first);
                    }
                    return Poll::Pending;
                }
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let lease = match &self.connection {
            Some(_) => {
                let lease = self
                    .reserved
                    .take()
                    .expect("OneConnection called before it was ready");
                lease.0.set(Holder::InFlight);
                Some(lease)
            }
            None => None,
        };
        let call = call_of(req.headers());
        let future = self.inner.call(req);
        Box::pin(async move {
            let res = future.await?;
            // An answer whose body is known to be empty frees its connection with its head,
            // as hyper's does.
            let lease = lease.filter(|_| !res.body().is_end_stream());
            if let Some(lease) = &lease {
                let mut slot = lease.0.slot();
                slot.bodies += 1;
                slot.holder = Some(Holder::Body(slot.bodies, call, false));
            }
            Ok(res.map(|body| Held { body, lease }))
        })
    }
}

pin_project_lite::pin_project! {
    /// An answer's body, holding the connection until it ends or is let go.
    #[derive(Debug)]
    pub struct Held<B> {
        #[pin]
        body: B,
        lease: Option<Lease>,
    }
}

impl<B: Body> Body for Held<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        if let Some(lease) = this.lease.as_ref() {
            let mut slot = lease.0.slot();
            if let Some(Holder::Body(serial, call, _)) = slot.holder {
                slot.holder = Some(Holder::Body(serial, call, true));
            }
        }
        let frame = this.body.poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = frame {
            // Read to its end (or broken off): the connection is free.
            *this.lease = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

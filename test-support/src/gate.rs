//! A gate in front of a service: requests wait at it until the test opens it, and the test can
//! see how many wait. It turns "the handler is running now" into an event a test can wait for,
//! instead of a slow handler and a head start.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::Semaphore;
use tower_layer::Layer;
use tower_service::Service;

/// A layer whose services hold each request until a permit is given ([`open`](Self::open)).
/// Clones share the gate.
#[derive(Debug, Clone)]
pub struct Gate {
    permits: Arc<Semaphore>,
    waiting: Arc<AtomicUsize>,
    passed: Arc<AtomicUsize>,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Gate {
            permits: Arc::new(Semaphore::new(0)),
            waiting: Arc::default(),
            passed: Arc::default(),
        }
    }

    /// A gate that lets every request through (for a server that takes a gate it does not
    /// need).
    pub fn opened() -> Self {
        let gate = Gate::new();
        gate.open_wide();
        gate
    }

    /// Lets `n` more requests through.
    pub fn open(&self, n: usize) {
        self.permits.add_permits(n);
    }

    /// Lets every request through from now on.
    pub fn open_wide(&self) {
        self.permits
            .add_permits(Semaphore::MAX_PERMITS - self.permits.available_permits());
    }

    /// Requests waiting at the gate now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Requests that went through.
    pub fn passed(&self) -> usize {
        self.passed.load(Ordering::SeqCst)
    }
}

impl<S> Layer<S> for Gate {
    type Service = Gated<S>;
    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            gate: self.clone(),
        }
    }
}

/// The service of [`Gate`].
#[derive(Debug, Clone)]
pub struct Gated<S> {
    inner: S,
    gate: Gate,
}

/// Counts a request as waiting while it exists.
struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<S, R> Service<R> for Gated<S>
where
    S: Service<R> + Clone + Send + 'static,
    S::Future: Send,
    R: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        // The clone is ready in `self`'s place (tower's "clone and swap").
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = self.gate.clone();
        gate.waiting.fetch_add(1, Ordering::SeqCst);
        let waiting = Waiting(gate.waiting.clone());
        Box::pin(async move {
            gate.permits
                .acquire()
                .await
                .expect("the gate's semaphore is never closed")
                .forget();
            drop(waiting);
            gate.passed.fetch_add(1, Ordering::SeqCst);
            inner.call(req).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_wait_until_opened() {
        let gate = Gate::new();
        let mut svc = gate.layer(echo());
        let call = tokio::spawn(svc.call(7));
        crate::wait::until("the request waits", || gate.waiting() == 1).await;
        assert_eq!(gate.passed(), 0);
        gate.open(1);
        assert_eq!(call.await.unwrap(), Ok(7));
        assert_eq!((gate.waiting(), gate.passed()), (0, 1));
    }

    /// An echo service.
    fn echo() -> Echo {
        Echo
    }

    #[derive(Clone)]
    struct Echo;

    impl Service<u32> for Echo {
        type Response = u32;
        type Error = ();
        type Future = std::future::Ready<Result<u32, ()>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ()>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: u32) -> Self::Future {
            std::future::ready(Ok(req))
        }
    }
}

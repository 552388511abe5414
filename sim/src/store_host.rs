//! The shared store on a host of its own.
//!
//! Every server instance reaches one `FaultStore<MemoryStore>` through a [`StoreLink`], which
//! hands each operation to the store host's runtime and awaits its answer. Running every
//! operation there gives the store one clock: turmoil gives each host a tokio runtime of its
//! own, whose `Instant`s differ from another's (and start again when a host restarts), so a
//! store called from several hosts' runtimes would compare leases across clocks.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_layer::conformance::FaultStore;
use idempotency_layer::store::{Backend, Begin, Fingerprint, Record, ScopeKey, TenantKey, Token};
use idempotency_layer::{IdempotencyStore, MemoryStore, StoreError};
use tokio::sync::{mpsc, oneshot};

use crate::tag::AttemptTags;

/// The store the simulation shares: the real `MemoryStore` behind the conformance suite's
/// fault injector.
pub type Backing = FaultStore<MemoryStore>;

type Job = Box<dyn FnOnce(Backing) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// What a server's layer holds: a handle that runs each operation on the store host.
#[derive(Clone, Debug)]
pub struct StoreLink {
    jobs: mpsc::UnboundedSender<Job>,
    tags: AttemptTags,
}

/// The store host's end: the queue of operations it runs.
#[derive(Clone, Debug)]
pub struct StoreHost {
    store: Backing,
    jobs: Arc<Mutex<Option<mpsc::UnboundedReceiver<Job>>>>,
}

/// A store host and the link the servers use to reach it.
pub fn store_pair(store: Backing, tags: AttemptTags) -> (StoreHost, StoreLink) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        StoreHost {
            store,
            jobs: Arc::new(Mutex::new(Some(rx))),
        },
        StoreLink { jobs: tx, tags },
    )
}

impl StoreHost {
    /// The host's software: runs each operation in a task of its own (a `wait` must not hold
    /// up the others). The store host is never crashed, so this runs once.
    pub async fn run(self) -> turmoil::Result {
        let mut jobs = self
            .jobs
            .lock()
            .expect("store host lock")
            .take()
            .expect("the store host runs once");
        while let Some(job) = jobs.recv().await {
            tokio::spawn(job(self.store.clone()));
        }
        Ok(())
    }
}

impl StoreLink {
    fn run<T, F, Fut>(&self, op: F) -> impl Future<Output = Result<T, StoreError>> + Send + 'static
    where
        T: Send + 'static,
        F: FnOnce(Backing) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |store| {
            Box::pin(async move {
                let _ = tx.send(op(store).await);
            })
        });
        let sent = self.jobs.send(job);
        async move {
            if sent.is_err() {
                return Err(StoreError::Backend("the store host is gone".into()));
            }
            rx.await.unwrap_or_else(|_| {
                Err(StoreError::Backend(
                    "the store host dropped the call".into(),
                ))
            })
        }
    }
}

impl IdempotencyStore for StoreLink {
    fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        self.run(move |s| async move { s.begin(scope, fingerprint, lease).await })
    }

    fn begin_for_tenant(
        &self,
        tenant: TenantKey,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        let attempt = AttemptTags::current();
        let tags = self.tags.clone();
        let call = self.run(move |s| async move {
            s.begin_for_tenant(tenant, scope, fingerprint, lease).await
        });
        async move {
            let begun = call.await;
            tags.note(attempt, |seen| match &begun {
                Ok(Begin::New(_)) => seen.claimed = true,
                Ok(Begin::InFlight { .. }) => seen.in_flight = true,
                Ok(_) => {}
                Err(_) => seen.failed = true,
            });
            begun
        }
    }

    fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(move |s| async move { s.complete(scope, token, record, ttl).await })
    }

    fn release(
        &self,
        scope: ScopeKey,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(move |s| async move { s.release(scope, token).await })
    }

    fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(move |s| async move { s.renew(scope, token, lease).await })
    }

    fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        let claims = claims.to_vec();
        let n = claims.len();
        let call = self.run(move |s| async move { Ok(s.renew_many(&claims).await) });
        async move {
            call.await.unwrap_or_else(|e| {
                (0..n)
                    .map(|_| Err(StoreError::Backend(e.to_string().into())))
                    .collect()
            })
        }
    }

    fn wait(
        &self,
        scope: ScopeKey,
        observed: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(move |s| async move { s.wait(scope, observed).await })
    }

    fn forget(&self, scope: ScopeKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.run(move |s| async move { s.forget(scope).await })
    }

    fn backend(&self) -> Backend {
        Backend::Memory
    }
}

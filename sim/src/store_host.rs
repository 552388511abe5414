//! The shared store on a host of its own, its faults, and the facts it records.
//!
//! Every server instance reaches one `MemoryStore` through a [`StoreLink`] of its own, which
//! hands each operation to the store host's runtime and awaits its answer. Running every
//! operation there gives the store one clock: turmoil gives each host a tokio runtime of its
//! own, whose `Instant`s differ from another's (and start again when a host restarts), so a
//! store called from several hosts' runtimes would compare leases across clocks.
//!
//! The store host applies the schedule's store faults ([`Injector`]: the conformance suite's
//! fault kinds, aimed at one operation, one server's calls and one key at a time, one-shot or
//! until healed) and records what the store did ([`Facts`]): each claim, each renewal that
//! reached the store, each fault that hit a call, each record landing, each release, and each
//! takeover of a claim that had neither completed nor been released. The judge grants its
//! exceptions from these facts only.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use idempotency_layer::conformance::{Fault as StoreFault, Op};
use idempotency_layer::store::{Backend, Begin, Fingerprint, Record, ScopeKey, TenantKey, Token};
use idempotency_layer::{IdempotencyStore, MemoryStore, StoreError};
use tokio::sync::{mpsc, oneshot};

use crate::ledger::now;
use crate::tag::AttemptTags;

/// The store the simulation shares: the real `MemoryStore`.
pub type Backing = MemoryStore;

/// The server index the downstream tier's link carries.
pub const DOWNSTREAM: usize = 1000;

type Job = Box<dyn FnOnce(Backing) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// One fault rule on the store host: which calls it hits and what it does to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreRule {
    /// The operation (`None`: every operation).
    pub op: Option<Op>,
    /// Only calls from this server's link.
    pub server: Option<usize>,
    /// Only calls on this scope (a `renew_many` when any of its claims is on it).
    pub scope: Option<ScopeKey>,
    /// What it does.
    pub fault: StoreFault,
    /// Only the next `n` calls it matches.
    pub times: Option<usize>,
}

impl StoreRule {
    fn matches(&self, op: Op, server: usize, scopes: &[ScopeKey]) -> bool {
        self.op.is_none_or(|o| o == op)
            && self.server.is_none_or(|s| s == server)
            && self.scope.is_none_or(|s| scopes.contains(&s))
            && self.times != Some(0)
    }
}

/// The rules in force, each under the id of the timed fault that put it there; a call takes
/// the fault of the first rule it matches, in the order they were added.
#[derive(Clone, Debug, Default)]
pub struct Injector(Arc<Mutex<Vec<(usize, StoreRule)>>>);

impl Injector {
    fn lock(&self) -> MutexGuard<'_, Vec<(usize, StoreRule)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `rule` under `id`.
    pub fn inject(&self, id: usize, rule: StoreRule) {
        self.lock().push((id, rule));
    }

    /// Removes the rule(s) of `id`.
    pub fn heal(&self, id: usize) {
        self.lock().retain(|(i, _)| *i != id);
    }

    /// Removes every rule.
    pub fn heal_all(&self) {
        self.lock().clear();
    }

    fn take(&self, op: Op, server: usize, scopes: &[ScopeKey]) -> Option<StoreFault> {
        let mut rules = self.lock();
        let i = rules
            .iter()
            .position(|(_, r)| r.matches(op, server, scopes))?;
        let fault = rules[i].1.fault;
        if let Some(left) = &mut rules[i].1.times {
            *left -= 1;
            if *left == 0 {
                rules.remove(i);
            }
        }
        Some(fault)
    }
}

/// One claim the store granted (a `begin` that answered `New`).
#[derive(Clone, Debug)]
pub struct Claim {
    /// Its scope.
    pub scope: ScopeKey,
    /// Its token.
    pub token: u128,
    /// The server whose link claimed it.
    pub server: usize,
    /// The attempt whose `begin` claimed it.
    pub attempt: Option<u64>,
    /// When the `begin` ran on the store.
    pub begun: Duration,
    /// Each time the store set its lease (the `begin`, then each renewal that reached the store
    /// and succeeded), with the lease set.
    pub touched: Vec<(Duration, Duration)>,
    /// Each injected fault that hit a `renew_many` carrying its token: when, and which.
    pub renewal_faults: Vec<(Duration, StoreFault)>,
    /// Each injected `Ack` that answered for it without reaching the store (a `complete`, a
    /// `renew_many`, a `release`): the store lied.
    pub acked: Vec<(Duration, Op)>,
    /// When its record landed.
    pub recorded: Option<Duration>,
    /// When it was released.
    pub released: Option<Duration>,
    /// When another `begin` took it over, and that claim's token.
    pub taken_over: Option<(Duration, u128)>,
    /// The claim it took over, if it did.
    pub took_over: Option<u128>,
    /// The record of the scope that had landed before it (it had expired: the store answered
    /// `New`), with when it landed.
    pub after_record: Option<Duration>,
    /// When the store answered the `begin` that made it to a caller that had gone (the layer
    /// dropped the call): no layer ever knew it held it.
    pub reply_unheard: Option<Duration>,
    /// When the layer that made it received that answer (a reply held back comes late).
    pub heard: Option<Duration>,
    /// When its layer sent its release (its write ended without a record), whatever became of
    /// it: the layer holds it no more.
    pub let_go: Option<Duration>,
}

impl Claim {
    /// When its lease ran out, as the store last set it.
    pub fn expires(&self) -> Duration {
        self.touched
            .last()
            .map_or(self.begun, |(at, lease)| *at + *lease)
    }

    /// Whether the store held it at `t`: begun, not ended, and its lease not run out.
    pub fn live_at(&self, t: Duration) -> bool {
        let ended = [
            self.recorded,
            self.released,
            self.taken_over.map(|(at, _)| at),
        ]
        .into_iter()
        .flatten()
        .min();
        let lease_end = self
            .touched
            .iter()
            .filter(|(at, _)| *at <= t)
            .map(|(at, lease)| *at + *lease)
            .max()
            .unwrap_or(self.begun);
        self.begun <= t && ended.is_none_or(|e| e > t) && lease_end > t
    }
}

/// A record that landed in the store.
#[derive(Clone, Debug)]
pub struct Landed {
    /// Its scope.
    pub scope: ScopeKey,
    /// The claim's token.
    pub token: u128,
    /// When.
    pub at: Duration,
    /// Its status.
    pub status: u16,
    /// Its body.
    pub body: Bytes,
    /// Whether its body was omitted.
    pub body_omitted: bool,
    /// Its `content-type`, if any.
    pub content_type: Option<String>,
    /// The execution its `x-sim-execution` header names, if any.
    pub execution: Option<String>,
}

/// A fault that hit a call.
#[derive(Clone, Debug)]
pub struct FaultHit {
    /// When.
    pub at: Duration,
    /// The server whose call it hit.
    pub server: usize,
    /// The operation.
    pub op: Op,
    /// The fault.
    pub fault: StoreFault,
    /// The scopes of the call.
    pub scopes: Vec<ScopeKey>,
}

/// What the store did, as the store host recorded it.
#[derive(Clone, Debug, Default)]
pub struct StoreFacts {
    /// Every claim, in the order they were granted.
    pub claims: Vec<Claim>,
    /// Every record that landed.
    pub records: Vec<Landed>,
    /// `complete`s the store answered `Ok` for a claim it no longer held (taken over, or its
    /// scope completed by another claim): a store that acknowledged a write it fenced off.
    pub stale_completes: Vec<(Duration, ScopeKey, u128)>,
    /// Every injected fault, in order.
    pub faults: Vec<FaultHit>,
    /// Calls made, by operation name and server.
    pub calls: BTreeMap<(String, usize), u64>,
}

impl StoreFacts {
    /// The claim of `token`.
    pub fn claim(&self, token: u128) -> Option<&Claim> {
        self.claims.iter().find(|c| c.token == token)
    }

    fn claim_mut(&mut self, token: u128) -> Option<&mut Claim> {
        self.claims.iter_mut().find(|c| c.token == token)
    }

    fn current(&mut self, scope: ScopeKey) -> Option<&mut Claim> {
        self.claims.iter_mut().rev().find(|c| c.scope == scope)
    }
}

/// The facts the store host records, shared with the judge after the run.
#[derive(Clone, Debug, Default)]
pub struct Facts(Arc<Mutex<StoreFacts>>);

impl Facts {
    /// The facts so far.
    pub fn lock(&self) -> MutexGuard<'_, StoreFacts> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begun(
        &self,
        scope: ScopeKey,
        server: usize,
        attempt: Option<u64>,
        begin: &Begin,
        lease: Duration,
    ) {
        let Begin::New(token) = begin else {
            return;
        };
        let at = now();
        let mut f = self.lock();
        let mut took_over = None;
        if let Some(prev) = f.current(scope) {
            if prev.recorded.is_none() && prev.released.is_none() && prev.taken_over.is_none() {
                prev.taken_over = Some((at, token.0));
                took_over = Some(prev.token);
            }
        }
        let after_record = f
            .records
            .iter()
            .rev()
            .find(|r| r.scope == scope)
            .map(|r| r.at);
        f.claims.push(Claim {
            scope,
            token: token.0,
            server,
            attempt,
            begun: at,
            touched: vec![(at, lease)],
            renewal_faults: Vec::new(),
            acked: Vec::new(),
            recorded: None,
            released: None,
            taken_over: None,
            took_over,
            after_record,
            reply_unheard: None,
            heard: None,
            let_go: None,
        });
    }

    /// The answer `begin` gave was handed back: to its caller (`heard`), or to nobody (its
    /// caller had gone).
    fn delivered(&self, begin: &Begin, heard: bool) {
        if let Begin::New(token) = begin {
            let at = now();
            if let Some(c) = self.lock().claim_mut(token.0) {
                if heard {
                    c.heard = Some(at);
                } else {
                    c.reply_unheard = Some(at);
                }
            }
        }
    }

    fn renewed(&self, claims: &[(ScopeKey, Token, Duration)], answers: &[Result<(), StoreError>]) {
        let at = now();
        let mut f = self.lock();
        for ((_, token, lease), answer) in claims.iter().zip(answers) {
            if answer.is_ok() {
                if let Some(c) = f.claim_mut(token.0) {
                    c.touched.push((at, *lease));
                }
            }
        }
    }

    fn completed(
        &self,
        scope: ScopeKey,
        token: Token,
        record: &Record,
        answer: &Result<(), StoreError>,
    ) {
        if answer.is_err() {
            return;
        }
        let at = now();
        let mut f = self.lock();
        let stale = match f.claim_mut(token.0) {
            Some(c) if c.recorded.is_some() => return,
            Some(c) if c.taken_over.is_none() && c.released.is_none() => {
                c.recorded = Some(at);
                false
            }
            _ => true,
        };
        if stale {
            f.stale_completes.push((at, scope, token.0));
            return;
        }
        f.records.push(Landed {
            scope,
            token: token.0,
            at,
            status: record.status().as_u16(),
            body: record.body().clone(),
            body_omitted: record.body_omitted(),
            content_type: record
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            execution: record
                .headers()
                .get(crate::app::EXECUTION_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        });
    }

    fn released(&self, token: Token, answer: &Result<(), StoreError>) {
        if answer.is_ok() {
            let at = now();
            if let Some(c) = self.lock().claim_mut(token.0) {
                if c.released.is_none() && c.recorded.is_none() {
                    c.released = Some(at);
                }
            }
        }
    }

    /// A release of these claims was sent: their layer let go of them (their write ended
    /// without a record), whatever the store then did with it.
    fn release_sent(&self, tokens: &[u128]) {
        let at = now();
        let mut f = self.lock();
        for t in tokens {
            if let Some(c) = f.claim_mut(*t) {
                c.let_go.get_or_insert(at);
            }
        }
    }

    fn hit(&self, server: usize, op: Op, fault: StoreFault, scopes: &[ScopeKey], tokens: &[u128]) {
        let at = now();
        let mut f = self.lock();
        f.faults.push(FaultHit {
            at,
            server,
            op,
            fault,
            scopes: scopes.to_vec(),
        });
        for t in tokens {
            if let Some(c) = f.claim_mut(*t) {
                if op == Op::RenewMany || op == Op::Renew {
                    c.renewal_faults.push((at, fault));
                }
                if fault == StoreFault::Ack {
                    c.acked.push((at, op));
                }
            }
        }
    }
}

/// What a server's layer holds: a handle that runs each operation on the store host, as this
/// server.
#[derive(Clone, Debug)]
pub struct StoreLink {
    jobs: mpsc::UnboundedSender<Job>,
    tags: AttemptTags,
    facts: Facts,
    injector: Injector,
    server: usize,
}

/// The store host's end: the queue of operations it runs.
#[derive(Clone, Debug)]
pub struct StoreHost {
    store: Backing,
    jobs: Arc<Mutex<Option<mpsc::UnboundedReceiver<Job>>>>,
}

/// A store host and the link the servers use to reach it (as server 0: see
/// [`StoreLink::for_server`]).
pub fn store_pair(
    store: Backing,
    tags: AttemptTags,
    facts: Facts,
    injector: Injector,
) -> (StoreHost, StoreLink) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        StoreHost {
            store,
            jobs: Arc::new(Mutex::new(Some(rx))),
        },
        StoreLink {
            jobs: tx,
            tags,
            facts,
            injector,
            server: 0,
        },
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

/// The answer an `Ack` gives, for the operations whose success carries nothing.
trait Acked: Sized {
    fn acked() -> Option<Self>;
}

impl Acked for () {
    fn acked() -> Option<()> {
        Some(())
    }
}

impl Acked for Begin {
    fn acked() -> Option<Begin> {
        None
    }
}

impl Acked for bool {
    fn acked() -> Option<bool> {
        None
    }
}

impl Acked for Vec<Result<(), StoreError>> {
    fn acked() -> Option<Self> {
        None
    }
}

impl StoreLink {
    /// The same link, as server `server`'s: its calls are recorded as that server's, and the
    /// rules aimed at that server hit them.
    pub fn for_server(&self, server: usize) -> StoreLink {
        StoreLink {
            server,
            ..self.clone()
        }
    }

    /// One operation on the store host: the fault of the first rule it matches, else `op`.
    fn run<T, F, Fut>(
        &self,
        kind: Op,
        scopes: Vec<ScopeKey>,
        tokens: Vec<u128>,
        ack: impl FnOnce() -> Option<T> + Send + 'static,
        op: F,
    ) -> impl Future<Output = Result<T, StoreError>> + Send + 'static
    where
        T: Send + 'static,
        F: FnOnce(Backing, Facts) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        self.run_noting_unheard(kind, scopes, tokens, ack, op, |_, _, _| {})
    }

    /// [`run`](Self::run), and `delivered` with the answer once it is handed back: `true` when
    /// its caller received it, `false` when the caller had gone (the layer dropped the call: it
    /// never learned what the store did).
    fn run_noting_unheard<T, F, Fut>(
        &self,
        kind: Op,
        scopes: Vec<ScopeKey>,
        tokens: Vec<u128>,
        ack: impl FnOnce() -> Option<T> + Send + 'static,
        op: F,
        delivered: impl FnOnce(&Facts, &T, bool) + Send + 'static,
    ) -> impl Future<Output = Result<T, StoreError>> + Send + 'static
    where
        T: Send + 'static,
        F: FnOnce(Backing, Facts) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let (facts, injector, server) = (self.facts.clone(), self.injector.clone(), self.server);
        let job: Job = Box::new(move |store| {
            Box::pin(async move {
                let noted = facts.clone();
                *facts
                    .lock()
                    .calls
                    .entry((format!("{kind:?}"), server))
                    .or_default() += 1;
                if kind == Op::Release {
                    facts.release_sent(&tokens);
                }
                let fault = injector.take(kind, server, &scopes);
                if let Some(fault) = fault {
                    facts.hit(server, kind, fault, &scopes, &tokens);
                }
                let injected = |what: &str| {
                    Err(StoreError::Backend(
                        format!("{kind:?}: {what} (injected fault)").into(),
                    ))
                };
                let answer = match fault {
                    None => op(store, facts).await,
                    Some(StoreFault::Fail) => injected("the store is unreachable"),
                    Some(StoreFault::Corrupt) => Err(StoreError::Corrupt(format!(
                        "{kind:?}: the entry does not decode (injected fault)"
                    ))),
                    Some(StoreFault::Full) => Err(StoreError::Full),
                    Some(StoreFault::Hang) => std::future::pending().await,
                    Some(StoreFault::Delay(d)) => {
                        tokio::time::sleep(d).await;
                        op(store, facts).await
                    }
                    Some(StoreFault::DelayReply(d)) => {
                        let r = op(store, facts).await;
                        tokio::time::sleep(d).await;
                        r
                    }
                    Some(StoreFault::LoseReply) => {
                        let _ = op(store, facts).await;
                        injected("the reply was lost after the operation ran")
                    }
                    Some(StoreFault::HangAfter) => {
                        let _ = op(store, facts).await;
                        std::future::pending().await
                    }
                    Some(StoreFault::Ack) => match ack() {
                        Some(v) => Ok(v),
                        None => injected("the store is unreachable"),
                    },
                    Some(_) => injected("an unknown fault"),
                };
                // One thread runs the simulation: nothing closes the channel between the look
                // and the send.
                if let Ok(value) = &answer {
                    delivered(&noted, value, !tx.is_closed());
                }
                let _ = tx.send(answer);
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

fn ack<T: Acked>() -> Option<T> {
    T::acked()
}

impl IdempotencyStore for StoreLink {
    fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        let (server, attempt) = (self.server, AttemptTags::current());
        self.run(
            Op::Begin,
            vec![scope],
            vec![],
            ack,
            move |s, f| async move {
                let r = s.begin(scope, fingerprint, lease).await;
                if let Ok(b) = &r {
                    f.begun(scope, server, attempt, b, lease);
                }
                r
            },
        )
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
        let server = self.server;
        let call = self.run_noting_unheard(
            Op::Begin,
            vec![scope],
            vec![],
            ack,
            move |s, f| async move {
                let r = s.begin_for_tenant(tenant, scope, fingerprint, lease).await;
                if let Ok(b) = &r {
                    f.begun(scope, server, attempt, b, lease);
                }
                r
            },
            |f, begin, heard| f.delivered(begin, heard),
        );
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
        self.run(
            Op::Complete,
            vec![scope],
            vec![token.0],
            ack,
            move |s, f| async move {
                let r = s.complete(scope, token, record.clone(), ttl).await;
                f.completed(scope, token, &record, &r);
                r
            },
        )
    }

    fn release(
        &self,
        scope: ScopeKey,
        token: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(
            Op::Release,
            vec![scope],
            vec![token.0],
            ack,
            move |s, f| async move {
                let r = s.release(scope, token).await;
                f.released(token, &r);
                r
            },
        )
    }

    fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(
            Op::Renew,
            vec![scope],
            vec![token.0],
            ack,
            move |s, f| async move {
                let r = s.renew(scope, token, lease).await;
                f.renewed(&[(scope, token, lease)], std::slice::from_ref(&r));
                r
            },
        )
    }

    fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> impl Future<Output = Vec<Result<(), StoreError>>> + Send {
        let claims = claims.to_vec();
        let n = claims.len();
        let scopes = claims.iter().map(|(s, _, _)| *s).collect();
        let tokens = claims.iter().map(|(_, t, _)| t.0).collect();
        let call = self.run(
            Op::RenewMany,
            scopes,
            tokens,
            move || Some((0..n).map(|_| Ok(())).collect()),
            move |s, f| async move {
                let r = s.renew_many(&claims).await;
                f.renewed(&claims, &r);
                Ok(r)
            },
        );
        async move {
            call.await.unwrap_or_else(|e| {
                (0..n)
                    .map(|_| {
                        Err(match &e {
                            StoreError::Full => StoreError::Full,
                            StoreError::Corrupt(w) => StoreError::Corrupt(w.clone()),
                            StoreError::Fenced => StoreError::Fenced,
                            e => StoreError::Backend(e.to_string().into()),
                        })
                    })
                    .collect()
            })
        }
    }

    fn wait(
        &self,
        scope: ScopeKey,
        observed: Token,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.run(Op::Wait, vec![scope], vec![], ack, move |s, _| async move {
            s.wait(scope, observed).await
        })
    }

    fn forget(&self, scope: ScopeKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.run(
            Op::Forget,
            vec![scope],
            vec![],
            ack,
            move |s, _| async move { s.forget(scope).await },
        )
    }

    fn backend(&self) -> Backend {
        Backend::Memory
    }
}

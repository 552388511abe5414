//! [`FaultStore`]: any store, with faults injected per operation, and what each operation did
//! counted.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::store::StoreError;
use crate::store::{
    Backend, Begin, Fingerprint, Held, IdempotencyStore, Record, ScopeKey, ScopeKeys, TenantKey,
    Token,
};

/// One operation of [`IdempotencyStore`], to aim a fault at and to count.
///
/// `begin` and `begin_for_tenant` are both [`Op::Begin`]: the layer calls the one, direct
/// callers the other, and both claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// `begin` and `begin_for_tenant`.
    Begin,
    /// `complete`.
    Complete,
    /// `release`.
    Release,
    /// `renew`.
    Renew,
    /// `renew_many`.
    RenewMany,
    /// `wait`.
    Wait,
    /// `forget`.
    Forget,
}

/// What an injected fault does to a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Fails at once with [`StoreError::Backend`], without reaching the inner store: the store
    /// is unreachable.
    Fail,
    /// Fails at once with [`StoreError::Corrupt`], without reaching the inner store: an entry
    /// that does not decode.
    Corrupt,
    /// Fails at once with [`StoreError::Full`], without reaching the inner store.
    Full,
    /// Never answers, and never reaches the inner store: a store that went away.
    Hang,
    /// Reaches the inner store after this long: a slow network.
    Delay(Duration),
    /// Runs on the inner store at once, then answers this long after: the operation ran, and
    /// its reply is late (a slow network on the way back, a `WAIT` for replicas in the same
    /// round trip, a busy pool's queue).
    DelayReply(Duration),
    /// Runs on the inner store, then fails with [`StoreError::Backend`]: the operation ran but
    /// its reply was lost (a connection dropped, a timeout).
    LoseReply,
    /// Runs on the inner store, then never answers: the reply never arrives, and the caller
    /// must give up on it (time out, or be dropped).
    HangAfter,
    /// Answers success without reaching the inner store: an acknowledgement of work never done
    /// (a renewal that never arrives, from a leader stalled in a partition). For the operations
    /// whose success carries nothing (`complete`, `release`, `renew`, `renew_many`, `wait`);
    /// a `begin` or `forget` it hits panics.
    Ack,
}

/// Which calls a fault hits: every call of one operation (or of all), optionally of one scope
/// only, optionally only the next `n` of them.
///
/// ```
/// use idempotency_layer::conformance::{Fault, Op, Rule};
///
/// let _always = Rule::new(Op::Begin, Fault::Fail);
/// let _twice = Rule::new(Op::Complete, Fault::LoseReply).times(2);
/// let _down = Rule::every_op(Fault::Fail);
/// ```
#[derive(Clone, Debug)]
pub struct Rule {
    op: Option<Op>,
    scope: Option<ScopeKey>,
    fault: Fault,
    left: Option<usize>,
}

impl Rule {
    /// `fault` on every call of `op`.
    pub fn new(op: Op, fault: Fault) -> Rule {
        Rule {
            op: Some(op),
            scope: None,
            fault,
            left: None,
        }
    }

    /// `fault` on every call of every operation.
    pub fn every_op(fault: Fault) -> Rule {
        Rule {
            op: None,
            ..Rule::new(Op::Begin, fault)
        }
    }

    /// Only the next `n` calls it matches; then the rule is gone.
    pub fn times(mut self, n: usize) -> Rule {
        self.left = Some(n);
        self
    }

    /// Only calls on `scope` (a `renew_many` when any of its claims is on it).
    pub fn scope(mut self, scope: ScopeKey) -> Rule {
        self.scope = Some(scope);
        self
    }

    fn matches(&self, op: Op, scopes: &[ScopeKey]) -> bool {
        self.op.is_none_or(|o| o == op)
            && self.scope.is_none_or(|s| scopes.contains(&s))
            && self.left != Some(0)
    }
}

/// How a call answered, as [`FaultStore::answers`] keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// Success (for `begin`, any [`Begin`]).
    Ok,
    /// [`StoreError::Fenced`].
    Fenced,
    /// [`StoreError::Full`].
    Full,
    /// [`StoreError::Backend`].
    Backend,
    /// [`StoreError::Corrupt`].
    Corrupt,
    /// [`StoreError::Config`].
    Config,
}

impl Reply {
    fn of<T>(r: &Result<T, StoreError>) -> Reply {
        match r {
            Ok(_) => Reply::Ok,
            Err(StoreError::Fenced) => Reply::Fenced,
            Err(StoreError::Full) => Reply::Full,
            Err(StoreError::Backend(_)) => Reply::Backend,
            Err(StoreError::Corrupt(_)) => Reply::Corrupt,
            Err(StoreError::Config(_)) => Reply::Config,
        }
    }
}

/// What one operation did so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Calls {
    /// Calls made (each counted as it starts).
    pub made: usize,
    /// Calls that reached the inner store (no fault, or a fault that runs the operation).
    pub reached: usize,
    /// The answers given, in order (a `renew_many` gives one per claim; a call that hangs gives
    /// none).
    pub answers: Vec<Reply>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Notified at every change of the counts.
    changed: Notify,
}

#[derive(Default)]
struct State {
    rules: Vec<Rule>,
    calls: HashMap<Op, Calls>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, op: Op, f: impl FnOnce(&mut Calls)) {
        f(self.lock().calls.entry(op).or_default());
        self.changed.notify_waiters();
    }

    /// Counts a call of `op` and takes the fault of the first rule it matches.
    fn start(&self, op: Op, scopes: &[ScopeKey]) -> Option<Fault> {
        let mut st = self.lock();
        st.calls.entry(op).or_default().made += 1;
        let hit = st.rules.iter().position(|r| r.matches(op, scopes));
        let fault = hit.map(|i| {
            let rule = &mut st.rules[i];
            let fault = rule.fault;
            if let Some(left) = &mut rule.left {
                *left -= 1;
                if *left == 0 {
                    st.rules.remove(i);
                }
            }
            fault
        });
        drop(st);
        self.changed.notify_waiters();
        fault
    }
}

/// A store that delegates every operation to `S`, with faults injected by [`Rule`]s, and counts
/// what each operation did ([`calls`](Self::calls)): the one test double for a store that
/// fails, hangs, is slow, loses a reply after the operation ran, or acknowledges work it never
/// did, around any real store.
///
/// Every method of [`IdempotencyStore`] is forwarded to `S`, the ones with a default too
/// (`begin_for_tenant`, `renew_many`), so the inner store's own versions run. Clones share the
/// rules and the counts.
///
/// ```
/// use idempotency_layer::conformance::{self, Reply, Fault, FaultStore, Op, Rule};
/// use idempotency_layer::store::{Fingerprint, IdempotencyStore};
/// use idempotency_layer::MemoryStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = FaultStore::new(MemoryStore::new());
/// store.inject(Rule::new(Op::Begin, Fault::LoseReply).times(1));
/// let scope = conformance::scope("doc");
/// let lost = store.begin(scope, Fingerprint([1; 32]), conformance::LONG).await;
/// assert!(lost.is_err(), "the reply was lost...");
/// let begins = store.calls(Op::Begin);
/// assert_eq!((begins.reached, begins.answers), (1, vec![Reply::Backend]), "...after it ran");
/// # }
/// ```
pub struct FaultStore<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: Clone> Clone for FaultStore<S> {
    fn clone(&self) -> Self {
        FaultStore {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: Default> Default for FaultStore<S> {
    fn default() -> Self {
        FaultStore::new(S::default())
    }
}

impl<S: fmt::Debug> fmt::Debug for FaultStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("FaultStore")
            .field("inner", &self.inner)
            .field("rules", &st.rules)
            .field("calls", &st.calls)
            .finish()
    }
}

impl<S> FaultStore<S> {
    /// `inner`, with no fault yet.
    pub fn new(inner: S) -> Self {
        FaultStore {
            inner,
            shared: Arc::default(),
        }
    }

    /// The store it delegates to (calls on it are neither faulted nor counted).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Adds a rule. A call takes the fault of the first rule it matches, in the order they were
    /// added; a call no rule matches reaches the inner store.
    pub fn inject(&self, rule: Rule) {
        self.shared.lock().rules.push(rule);
    }

    /// Removes every rule: calls reach the inner store again.
    pub fn heal(&self) {
        self.shared.lock().rules.clear();
    }

    /// What calls of `op` did so far.
    pub fn calls(&self, op: Op) -> Calls {
        self.shared
            .lock()
            .calls
            .get(&op)
            .cloned()
            .unwrap_or_default()
    }

    /// The answers calls of `op` gave so far, in order.
    pub fn answers(&self, op: Op) -> Vec<Reply> {
        self.calls(op).answers
    }

    /// Resolves once `cond` holds, checked now and at every call's start, arrival at the inner
    /// store and answer (no polling). Panics naming `what` if it does not hold within `limit`
    /// (of the runtime's clock: under paused time, only once nothing else can run).
    pub async fn until(&self, limit: Duration, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let wait = async {
            loop {
                let changed = self.shared.changed.notified();
                let mut changed = std::pin::pin!(changed);
                changed.as_mut().enable();
                if cond(self) {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            panic!("FaultStore: waited {limit:?} for: {what}; it never happened");
        }
    }

    /// Keeps the reply of a call of `op`, and passes it on.
    fn replied<T>(&self, op: Op, r: Result<T, StoreError>) -> Result<T, StoreError> {
        let reply = Reply::of(&r);
        self.shared.update(op, |c| c.answers.push(reply));
        r
    }

    /// One call of `op`: its fault if a rule matches, else `call` on the inner store.
    async fn faulted<T, Fut>(
        &self,
        op: Op,
        scopes: &[ScopeKey],
        ack: impl FnOnce() -> T,
        call: impl FnOnce() -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let fault = self.shared.start(op, scopes);
        let reach = |call: Fut| {
            self.shared.update(op, |c| c.reached += 1);
            call
        };
        match fault {
            None => reach(call()).await,
            Some(Fault::Fail) => Err(backend(op, "the store is unreachable")),
            Some(Fault::Corrupt) => Err(StoreError::Corrupt(format!(
                "{op:?}: the entry does not decode (injected fault)"
            ))),
            Some(Fault::Full) => Err(StoreError::Full),
            Some(Fault::Hang) => std::future::pending().await,
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                reach(call()).await
            }
            Some(Fault::DelayReply(d)) => {
                let r = reach(call()).await;
                tokio::time::sleep(d).await;
                r
            }
            Some(Fault::LoseReply) => {
                let _ = reach(call()).await;
                Err(backend(op, "the reply was lost after the operation ran"))
            }
            Some(Fault::HangAfter) => {
                let _ = reach(call()).await;
                std::future::pending().await
            }
            Some(Fault::Ack) => Ok(ack()),
        }
    }
}

fn backend(op: Op, what: &str) -> StoreError {
    StoreError::Backend(format!("{op:?}: {what} (injected fault)").into())
}

/// The same result again (`StoreError` is not `Clone`; a backend error keeps its text).
fn copy(r: &Result<(), StoreError>) -> Result<(), StoreError> {
    match r {
        Ok(()) => Ok(()),
        Err(StoreError::Fenced) => Err(StoreError::Fenced),
        Err(StoreError::Full) => Err(StoreError::Full),
        Err(StoreError::Corrupt(what)) => Err(StoreError::Corrupt(what.clone())),
        Err(e) => Err(StoreError::Backend(e.to_string().into())),
    }
}

fn no_ack<T>(op: Op) -> impl FnOnce() -> T {
    move || {
        panic!("Fault::Ack has no answer for {op:?}: use it on operations whose success carries nothing")
    }
}

impl<S: IdempotencyStore> IdempotencyStore for FaultStore<S> {
    async fn begin(
        &self,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        self.replied(
            Op::Begin,
            self.faulted(Op::Begin, &[scope], no_ack(Op::Begin), || {
                self.inner.begin(scope, fingerprint, lease)
            })
            .await,
        )
    }

    async fn begin_for_tenant(
        &self,
        tenant: TenantKey,
        scope: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin, StoreError> {
        self.replied(
            Op::Begin,
            self.faulted(Op::Begin, &[scope], no_ack(Op::Begin), || {
                self.inner
                    .begin_for_tenant(tenant, scope, fingerprint, lease)
            })
            .await,
        )
    }

    async fn complete(
        &self,
        scope: ScopeKey,
        token: Token,
        record: Arc<Record>,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.replied(
            Op::Complete,
            self.faulted(
                Op::Complete,
                &[scope],
                || (),
                || self.inner.complete(scope, token, record, ttl),
            )
            .await,
        )
    }

    async fn release(&self, scope: ScopeKey, token: Token) -> Result<(), StoreError> {
        self.replied(
            Op::Release,
            self.faulted(
                Op::Release,
                &[scope],
                || (),
                || self.inner.release(scope, token),
            )
            .await,
        )
    }

    async fn renew(
        &self,
        scope: ScopeKey,
        token: Token,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.replied(
            Op::Renew,
            self.faulted(
                Op::Renew,
                &[scope],
                || (),
                || self.inner.renew(scope, token, lease),
            )
            .await,
        )
    }

    async fn renew_many(
        &self,
        claims: &[(ScopeKey, Token, Duration)],
    ) -> Vec<Result<(), StoreError>> {
        let scopes: Vec<ScopeKey> = claims.iter().map(|(s, _, _)| *s).collect();
        let every = |r: &Result<(), StoreError>| claims.iter().map(|_| copy(r)).collect();
        // One call, forwarded whole (the inner store's own renew_many); a fault answers every
        // claim alike.
        let results = self
            .faulted(
                Op::RenewMany,
                &scopes,
                || every(&Ok(())),
                || async { Ok(self.inner.renew_many(claims).await) },
            )
            .await
            .unwrap_or_else(|e| every(&Err(e)));
        self.shared.update(Op::RenewMany, |c| {
            c.answers.extend(results.iter().map(Reply::of))
        });
        results
    }

    async fn wait(&self, scope: ScopeKey, observed: Token) -> Result<(), StoreError> {
        self.replied(
            Op::Wait,
            self.faulted(
                Op::Wait,
                &[scope],
                || (),
                || self.inner.wait(scope, observed),
            )
            .await,
        )
    }

    async fn forget(&self, scope: ScopeKey) -> Result<bool, StoreError> {
        self.replied(
            Op::Forget,
            self.faulted(Op::Forget, &[scope], no_ack(Op::Forget), || {
                self.inner.forget(scope)
            })
            .await,
        )
    }

    /// Forwarded as it is: a tool's read, which the faults (of the layer's operations) leave
    /// alone.
    async fn lookup(&self, scope: ScopeKey) -> Result<Option<Held>, StoreError> {
        self.inner.lookup(scope).await
    }
    fn scope_keys(&self) -> ScopeKeys {
        self.inner.scope_keys()
    }

    fn backend(&self) -> Backend {
        self.inner.backend()
    }

    #[cfg(feature = "postgres")]
    fn postgres(&self) -> Option<&crate::store::PostgresStore> {
        self.inner.postgres()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{sample_record, scope, LONG};
    use crate::MemoryStore;

    const FP: Fingerprint = Fingerprint([3; 32]);

    /// The wrapper without faults is the store it wraps: the conformance suite passes through it.
    #[tokio::test(start_paused = true)]
    async fn without_faults_it_passes_the_conformance_suite() {
        crate::conformance::run_all(|| FaultStore::new(MemoryStore::new())).await;
    }

    #[tokio::test(start_paused = true)]
    async fn each_fault_does_what_it_says() {
        let store = FaultStore::new(MemoryStore::new());
        let s = scope("fault");

        store.inject(Rule::new(Op::Begin, Fault::Fail).times(1));
        assert!(matches!(
            store.begin(s, FP, LONG).await,
            Err(StoreError::Backend(_))
        ));
        assert_eq!(store.calls(Op::Begin).reached, 0, "a failed call never ran");

        store.inject(Rule::new(Op::Begin, Fault::LoseReply).times(1));
        assert!(store.begin(s, FP, LONG).await.is_err());
        let Ok(Begin::InFlight { token, .. }) = store.begin(s, FP, LONG).await else {
            panic!("the lost begin had claimed the scope")
        };
        let begins = store.calls(Op::Begin);
        assert_eq!(
            (begins.made, begins.reached, begins.answers),
            (3, 2, vec![Reply::Backend, Reply::Backend, Reply::Ok])
        );

        // Ack: the renewal never reaches the store.
        store.inject(Rule::new(Op::Renew, Fault::Ack));
        store.renew(s, token, LONG).await.unwrap();
        assert_eq!(store.calls(Op::Renew).reached, 0);

        // Hang and HangAfter never answer; the second has run.
        store.inject(Rule::new(Op::Release, Fault::HangAfter).times(1));
        let release = tokio::time::timeout(Duration::from_secs(60), store.release(s, token));
        assert!(release.await.is_err(), "never answered");
        assert_eq!(store.calls(Op::Release).reached, 1);
        assert!(matches!(store.begin(s, FP, LONG).await, Ok(Begin::New(_))));

        // A rule on one scope leaves the others alone; the first rule that matches applies.
        let (a, b) = (scope("fault-a"), scope("fault-b"));
        store.inject(Rule::new(Op::Begin, Fault::Corrupt).scope(a));
        store.inject(Rule::every_op(Fault::Full));
        assert!(matches!(
            store.begin(a, FP, LONG).await,
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            store.begin(b, FP, LONG).await,
            Err(StoreError::Full)
        ));
        store.heal();
        assert!(matches!(store.begin(b, FP, LONG).await, Ok(Begin::New(_))));

        // DelayReply reaches the store at once and answers after the delay.
        let c = scope("fault-c");
        store.inject(Rule::new(Op::Begin, Fault::DelayReply(Duration::from_secs(3))).times(1));
        let started = tokio::time::Instant::now();
        let late = tokio::spawn({
            let store = store.clone();
            async move { store.begin(c, FP, LONG).await }
        });
        store
            .until(Duration::from_secs(1), "the late begin ran", |st| {
                st.calls(Op::Begin).reached == 5
            })
            .await;
        assert_eq!(started.elapsed(), Duration::ZERO, "it ran at once");
        assert!(matches!(late.await.unwrap(), Ok(Begin::New(_))));
        assert_eq!(started.elapsed(), Duration::from_secs(3), "answered late");

        // Delay reaches the store after the delay.
        let started = tokio::time::Instant::now();
        store.inject(Rule::new(Op::Forget, Fault::Delay(Duration::from_secs(5))));
        assert!(store.forget(b).await.unwrap());
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    /// `renew_many` is forwarded as one call (the inner store's own), faults apply to it whole,
    /// and each claim's answer is kept.
    #[tokio::test(start_paused = true)]
    async fn renew_many_is_forwarded_and_faulted_whole() {
        let store = FaultStore::new(MemoryStore::new());
        let (a, b) = (scope("many-a"), scope("many-b"));
        let Ok(Begin::New(ta)) = store.begin(a, FP, LONG).await else {
            panic!()
        };
        let claims = [(a, ta, LONG), (b, Token(9), LONG)];
        let r = store.renew_many(&claims).await;
        assert!(r[0].is_ok() && matches!(r[1], Err(StoreError::Fenced)));
        store.inject(Rule::new(Op::RenewMany, Fault::LoseReply).scope(b));
        let r = store.renew_many(&claims).await;
        assert!(r.iter().all(|r| matches!(r, Err(StoreError::Backend(_)))));
        let many = store.calls(Op::RenewMany);
        assert_eq!((many.made, many.reached), (2, 2));
        assert_eq!(
            many.answers,
            [Reply::Ok, Reply::Fenced, Reply::Backend, Reply::Backend]
        );
        assert_eq!(
            store.calls(Op::Renew),
            Calls::default(),
            "not split into renews"
        );
        store
            .complete(a, ta, sample_record(FP).into(), LONG)
            .await
            .unwrap();
    }

    /// `until` resolves on the event itself, here a begin that reached the store.
    #[tokio::test(start_paused = true)]
    async fn until_wakes_on_the_event() {
        let store = FaultStore::new(MemoryStore::new());
        store.inject(Rule::new(Op::Begin, Fault::HangAfter));
        let s = scope("until");
        let begin = tokio::spawn({
            let store = store.clone();
            async move { store.begin(s, FP, LONG).await }
        });
        store
            .until(
                Duration::from_secs(1),
                "the begin reached the store",
                |st| st.calls(Op::Begin).reached == 1,
            )
            .await;
        begin.abort();
        assert!(matches!(
            store.inner().begin(s, FP, LONG).await,
            Ok(Begin::InFlight { .. })
        ));
    }
}

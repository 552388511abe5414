//! The retry storm: a three-tier chain client -> A -> B -> C, each hop calling the next through
//! its own `RetryLayer`, with C failing every request (503). How many attempts reach C per
//! client request, with the default budget, with the budget disabled (3 x 3 x 3 = 27), and with
//! retries at the outer hop only.
//!
//! The hops are in-process tower services (no sockets), so the run is exact and can use tokio's
//! paused clock: `cargo run --release -p chaos --bin storm`.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
use tower::{Service, ServiceExt};

/// The retry configuration of every hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budgets {
    /// Every hop: the default policy (3 attempts, 10 % of requests + 10 retries/s budget).
    Default,
    /// Every hop: 3 attempts, no budget.
    Disabled,
    /// The client retries (default policy); A and B send each request once.
    OuterOnly,
}

/// What reached each tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Storm {
    /// The configuration.
    pub budgets: Budgets,
    /// Client requests (logical).
    pub requests: usize,
    /// Attempts that reached A, B and C.
    pub reached: [usize; 3],
    /// Seconds the storm lasted (tokio time).
    pub secs: f64,
}

impl Storm {
    /// Attempts reaching C per client request.
    pub fn amplification(&self) -> f64 {
        self.reached[2] as f64 / self.requests as f64
    }
}

impl fmt::Display for Storm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per = |n: usize| n as f64 / self.requests as f64;
        write!(
            f,
            "{:<10} {:>6} requests over {:>5.1} s: A {:>6} ({:.2}x)  B {:>6} ({:.2}x)  C {:>6} ({:.2}x)",
            format!("{:?}", self.budgets),
            self.requests,
            self.secs,
            self.reached[0],
            per(self.reached[0]),
            self.reached[1],
            per(self.reached[1]),
            self.reached[2],
            per(self.reached[2]),
        )
    }
}

type Body = Full<Bytes>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn policy(budgets: Budgets, outer: bool) -> RetryPolicy {
    let b = RetryPolicy::builder();
    let b = match (budgets, outer) {
        (Budgets::Default, _) | (Budgets::OuterOnly, true) => b,
        (Budgets::Disabled, _) => b.no_budget(),
        (Budgets::OuterOnly, false) => b.max_attempts(1),
    };
    b.build().expect("a valid policy")
}

fn request() -> Request<Body> {
    Request::get("http://tier/books/b1")
        .body(Full::new(Bytes::new()))
        .expect("a request")
}

/// A tier: counts what reaches it and answers with what `next` answers (503 when C).
fn tier<S>(
    count: Arc<AtomicUsize>,
    next: Option<S>,
) -> impl Service<
    Request<ReplayBody<Body>>,
    Response = Response<Body>,
    Error = BoxError,
    Future = impl Send,
> + Clone
       + Send
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    tower::service_fn(move |_req: Request<ReplayBody<Body>>| {
        count.fetch_add(1, Ordering::Relaxed);
        let next = next.clone();
        async move {
            let status = match next {
                Some(next) => next.oneshot(request()).await?.status(),
                None => StatusCode::SERVICE_UNAVAILABLE,
            };
            let mut res = Response::new(Full::new(Bytes::new()));
            *res.status_mut() = status;
            Ok::<_, BoxError>(res)
        }
    })
}

/// Sends `requests` client requests at `per_sec` (one at a time at that pace, so the budgets'
/// windows see a steady rate) through the chain and counts what reached each tier.
pub async fn storm(budgets: Budgets, requests: usize, per_sec: u32) -> Storm {
    let counts: [Arc<AtomicUsize>; 3] = Default::default();
    // Built from the bottom: C, then B calling C through its layer, then A calling B.
    let c = tier::<Never>(counts[2].clone(), None);
    let to_c = tower::Layer::layer(&RetryLayer::new(policy(budgets, false)), c).map_err(Into::into);
    let b = tier(counts[1].clone(), Some(erase(to_c)));
    let to_b = tower::Layer::layer(&RetryLayer::new(policy(budgets, false)), b).map_err(Into::into);
    let a = tier(counts[0].clone(), Some(erase(to_b)));
    let client =
        tower::Layer::layer(&RetryLayer::new(policy(budgets, true)), a).map_err(Into::into);
    let client = erase(client);

    let started = tokio::time::Instant::now();
    let gap = Duration::from_secs(1) / per_sec.max(1);
    let mut tasks = Vec::with_capacity(requests);
    for _ in 0..requests {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let res = client.oneshot(request()).await.expect("the chain answers");
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        }));
        tokio::time::sleep(gap).await;
    }
    for t in tasks {
        t.await.expect("a client request");
    }
    Storm {
        budgets,
        requests,
        reached: counts.map(|c| c.load(Ordering::Relaxed)),
        secs: started.elapsed().as_secs_f64(),
    }
}

type Erased = tower::util::BoxCloneSyncService<Request<Body>, Response<Body>, BoxError>;

/// Boxes a hop so the chain's types stay nameable.
fn erase<S>(svc: S) -> Erased
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    tower::util::BoxCloneSyncService::new(svc)
}

/// The type of C's (absent) next hop.
type Never = Erased;

//! The retry storm: a chain of tiers, client -> T1 -> T2 -> ... -> bottom, each hop calling the
//! next through its own `RetryLayer`, with the bottom failing (every request, or a share of them
//! at random). How many attempts reach each tier per client request, and how many client
//! requests succeed, with:
//!
//! - the default policy at every hop, hops unaware of each other (`Default`);
//! - 3 attempts at every hop and no budget: 3^tiers at the bottom (`Disabled`);
//! - the client retrying with the default policy, every other hop sending once (`OuterOnly`);
//! - the default policy at every hop, each hop's server with `retry_layer::hop::HopLayer`
//!   (`OneTier`): a hop that gave up answers "do not retry", and a request that arrived as a
//!   retry is sent once underneath.
//!
//! The hops are in-process tower services (no sockets), so the run is exact and can use tokio's
//! paused clock: `cargo run --release -p chaos --bin storm`.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retry_layer::hop::HopLayer;
use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
use tower::{Layer, ServiceExt};

/// The retry configuration of every hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budgets {
    /// Every hop: the default policy (3 attempts, 10 % of requests + 10 retries/s budget),
    /// hops unaware of each other.
    Default,
    /// Every hop: 3 attempts, no budget.
    Disabled,
    /// The client retries (default policy); every other hop sends each request once.
    OuterOnly,
    /// Every hop: the default policy, and `HopLayer` on every hop's server.
    OneTier,
}

/// How the bottom tier fails.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Failure {
    /// 503 to every request: a dead backend.
    Always,
    /// 503 to this share of requests, at random (seeded), 200 to the others.
    Transient(f64),
}

/// One storm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setup {
    /// The hops' retry configuration.
    pub budgets: Budgets,
    /// Tiers behind the client (3: client -> A -> B -> C).
    pub tiers: usize,
    /// How the bottom tier fails.
    pub failure: Failure,
    /// Client requests (logical).
    pub requests: usize,
    /// Client requests per second (tokio time).
    pub per_sec: u32,
}

impl Setup {
    /// Three tiers, a dead bottom, 2 000 requests at 100/s.
    pub fn new(budgets: Budgets) -> Self {
        Setup {
            budgets,
            tiers: 3,
            failure: Failure::Always,
            requests: 2_000,
            per_sec: 100,
        }
    }
}

/// What reached each tier.
#[derive(Debug, Clone, PartialEq)]
pub struct Storm {
    /// The storm's setup.
    pub setup: Setup,
    /// Attempts that reached each tier, top first.
    pub reached: Vec<usize>,
    /// Client requests answered 200.
    pub succeeded: usize,
    /// Seconds the storm lasted (tokio time).
    pub secs: f64,
}

impl Storm {
    /// Attempts reaching the bottom tier per client request.
    pub fn amplification(&self) -> f64 {
        self.reached[self.reached.len() - 1] as f64 / self.setup.requests as f64
    }

    /// The share of client requests that succeeded.
    pub fn success_rate(&self) -> f64 {
        self.succeeded as f64 / self.setup.requests as f64
    }
}

impl fmt::Display for Storm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failure = match self.setup.failure {
            Failure::Always => "dead".to_owned(),
            Failure::Transient(p) => format!("{:.0}% 503", p * 100.0),
        };
        write!(
            f,
            "{:<10} {} tiers, bottom {:<7} {:>6} requests over {:>5.1} s:",
            format!("{:?}", self.setup.budgets),
            self.setup.tiers,
            failure,
            self.setup.requests,
            self.secs,
        )?;
        for (i, n) in self.reached.iter().enumerate() {
            let per = *n as f64 / self.setup.requests as f64;
            write!(f, "  T{} {n:>6} ({per:.2}x)", i + 1)?;
        }
        write!(
            f,
            "  success {}/{} ({:.2} %)",
            self.succeeded,
            self.setup.requests,
            100.0 * self.success_rate()
        )
    }
}

type Body = Full<Bytes>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The policy of the client (`outer`) or of a hop calling the next tier.
fn policy(budgets: Budgets, outer: bool) -> RetryPolicy {
    let b = RetryPolicy::builder();
    let b = match (budgets, outer) {
        (Budgets::Default | Budgets::OneTier, _) | (Budgets::OuterOnly, true) => b,
        (Budgets::Disabled, _) => b.budget(retry_layer::budget::RetryBudget::unlimited()),
        (Budgets::OuterOnly, false) => b.max_attempts(1),
    };
    b.build().expect("a valid policy")
}

fn request() -> Request<Body> {
    Request::get("http://tier/books/b1")
        .body(Full::new(Bytes::new()))
        .expect("a request")
}

fn answer(status: StatusCode) -> Response<Body> {
    let mut res = Response::new(Full::new(Bytes::new()));
    *res.status_mut() = status;
    res
}

/// A hop's client: what it calls the next tier with.
type Client = tower::util::BoxCloneSyncService<Request<Body>, Response<Body>, BoxError>;
/// A tier as its caller's retry layer sees it.
type Tier = tower::util::BoxCloneSyncService<Request<ReplayBody<Body>>, Response<Body>, BoxError>;

/// A tier that counts what reaches it and answers with what `next` answers.
fn hop(count: Arc<AtomicUsize>, next: Client, with_hop_layer: bool) -> Tier {
    let svc = tower::service_fn(move |_req: Request<ReplayBody<Body>>| {
        count.fetch_add(1, Ordering::Relaxed);
        let next = next.clone();
        async move {
            // The hop's own answer carries the status it got, not the headers: a plain hop
            // knows nothing of what the tier below said about retrying.
            let status = next.oneshot(request()).await?.status();
            Ok::<_, BoxError>(answer(status))
        }
    });
    if with_hop_layer {
        Tier::new(HopLayer::new().layer(svc))
    } else {
        Tier::new(svc)
    }
}

/// The bottom tier: counts what reaches it and fails as `failure` says.
fn bottom(count: Arc<AtomicUsize>, failure: Failure) -> Tier {
    let rng = Arc::new(Mutex::new(fastrand::Rng::with_seed(7)));
    Tier::new(tower::service_fn(move |_req: Request<ReplayBody<Body>>| {
        count.fetch_add(1, Ordering::Relaxed);
        let failed = match failure {
            Failure::Always => true,
            Failure::Transient(p) => rng.lock().expect("the rng").f64() < p,
        };
        let status = if failed {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::OK
        };
        std::future::ready(Ok::<_, BoxError>(answer(status)))
    }))
}

/// Sends the setup's client requests at its pace (one at a time at that pace, so the budgets'
/// windows see a steady rate) through the chain and counts what reached each tier.
pub async fn storm(setup: Setup) -> Storm {
    assert!(setup.tiers >= 1, "at least one tier");
    let counts: Vec<Arc<AtomicUsize>> = (0..setup.tiers).map(|_| Arc::default()).collect();
    let one_tier = setup.budgets == Budgets::OneTier;
    // Built from the bottom: each tier is called through its caller's retry layer.
    let mut below = bottom(counts[setup.tiers - 1].clone(), setup.failure);
    for i in (0..setup.tiers - 1).rev() {
        let to_below = RetryLayer::new(policy(setup.budgets, false))
            .layer(below)
            .map_err(Into::into);
        below = hop(counts[i].clone(), Client::new(to_below), one_tier);
    }
    let client = Client::new(
        RetryLayer::new(policy(setup.budgets, true))
            .layer(below)
            .map_err(Into::<BoxError>::into),
    );

    let succeeded = Arc::new(AtomicUsize::new(0));
    let started = tokio::time::Instant::now();
    let gap = Duration::from_secs(1) / setup.per_sec.max(1);
    let mut tasks = Vec::with_capacity(setup.requests);
    for _ in 0..setup.requests {
        let client = client.clone();
        let succeeded = succeeded.clone();
        tasks.push(tokio::spawn(async move {
            let res = client.oneshot(request()).await.expect("the chain answers");
            if res.status() == StatusCode::OK {
                succeeded.fetch_add(1, Ordering::Relaxed);
            }
        }));
        tokio::time::sleep(gap).await;
    }
    for t in tasks {
        t.await.expect("a client request");
    }
    Storm {
        setup,
        reached: counts.iter().map(|c| c.load(Ordering::Relaxed)).collect(),
        succeeded: succeeded.load(Ordering::Relaxed),
        secs: started.elapsed().as_secs_f64(),
    }
}

//! Hedging against a slow replica, over real sockets: two hyper servers on 127.0.0.1 (the
//! replicas), one of which delays 10 % of its responses by 200 ms (5 % of all requests), and a
//! hyper-util client that sends requests to them in turn, with and without `HedgeLayer`. Prints
//! p50, p99, p99.9 and max latency, and the extra load hedging costs (attempts that reached a
//! replica per request).
//!
//! ```text
//! cargo run --release -p benchmarks --bin hedging -- --requests 20000 --concurrency 8
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use retry_layer::ReplayBody;
use tower::{Layer, Service, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = ReplayBody<Full<Bytes>>;

#[derive(Parser, Debug)]
#[command(
    about = "Hedged reads against one slow replica of two: latency percentiles and extra load"
)]
struct Args {
    /// Requests per scenario.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Share of the slow replica's responses it delays.
    #[arg(long, default_value_t = 0.10)]
    slow_share: f64,
    /// How long a delayed response takes, in milliseconds.
    #[arg(long, default_value_t = 200)]
    slow_ms: u64,
    /// The hedging delay, in milliseconds.
    #[arg(long, default_value_t = 10)]
    hedging_delay_ms: u64,
    /// Attempts at most per hedged request.
    #[arg(long, default_value_t = 2)]
    max_attempts: u32,
}

/// Serves a replica: answers 200 at once, or after `slow` for `share` of requests (seeded).
async fn replica(share: f64, slow: Duration, seed: u64, hits: Arc<AtomicUsize>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let rng = Arc::new(Mutex::new(fastrand::Rng::with_seed(seed)));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (rng, hits) = (rng.clone(), hits.clone());
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                        hits.fetch_add(1, Ordering::Relaxed);
                        let delayed = rng.lock().expect("rng").f64() < share;
                        async move {
                            if delayed {
                                tokio::time::sleep(slow).await;
                            }
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(
                                b"book",
                            ))))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// Sends each request to the next replica in turn (a round-robin balancer, as a client-side
/// load balancer would): a hedge goes to the other replica than the attempt before it.
#[derive(Clone)]
struct RoundRobin<S> {
    inner: S,
    replicas: Arc<[SocketAddr]>,
    next: Arc<AtomicUsize>,
}

impl<S> Service<Request<Body>> for RoundRobin<S>
where
    S: Service<Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> S::Future {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.replicas.len();
        let uri: Uri = format!("http://{}{}", self.replicas[i], req.uri().path())
            .parse()
            .expect("a valid URI");
        *req.uri_mut() = uri;
        self.inner.call(req)
    }
}

struct Outcome {
    latencies: Vec<Duration>,
    attempts: usize,
}

async fn run<S>(svc: S, requests: usize, concurrency: usize, hits: &[Arc<AtomicUsize>]) -> Outcome
where
    S: Service<Request<Full<Bytes>>, Response = Response<hyper::body::Incoming>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let before: usize = hits.iter().map(|h| h.load(Ordering::Relaxed)).sum();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (svc, next) = (svc.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < requests {
                let req = Request::get("http://replica/books/b1")
                    .body(Full::new(Bytes::new()))
                    .expect("a request");
                let started = Instant::now();
                let res = svc.clone().oneshot(req).await.expect("an answer");
                res.into_body().collect().await.expect("a body");
                latencies.push(started.elapsed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::with_capacity(requests);
    for t in tasks {
        latencies.extend(t.await.expect("a client task"));
    }
    // Let cancelled attempts that were still being served land in the count.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after: usize = hits.iter().map(|h| h.load(Ordering::Relaxed)).sum();
    latencies.sort();
    Outcome {
        latencies,
        attempts: after - before,
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let hits: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
    let slow = Duration::from_millis(args.slow_ms);
    let fast = replica(0.0, slow, 1, hits[0].clone()).await;
    let slowish = replica(args.slow_share, slow, 2, hits[1].clone()).await;
    let replicas: Arc<[SocketAddr]> = Arc::from(vec![fast, slowish]);
    let client = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let balanced = RoundRobin {
        inner: client,
        replicas,
        next: Arc::default(),
    };
    let policy = HedgePolicy::builder()
        .max_attempts(args.max_attempts)
        .hedging_delay(Duration::from_millis(args.hedging_delay_ms))
        .build()
        .expect("a valid hedging policy");
    let hedge = HedgeLayer::new(policy);

    println!(
        "two replicas, one delaying {:.0} % of its responses by {} ms ({:.1} % of all); {} requests, {} in flight; hedging delay {} ms, at most {} attempts",
        args.slow_share * 100.0,
        args.slow_ms,
        args.slow_share * 50.0,
        args.requests,
        args.concurrency,
        args.hedging_delay_ms,
        args.max_attempts
    );
    println!("| scenario | p50 ms | p99 ms | p99.9 ms | max ms | attempts per request |");
    println!("|---|---|---|---|---|---|");
    // Unhedged: the same stack with one attempt per request (so both scenarios use the same
    // client and body type).
    let once = HedgeLayer::new(
        HedgePolicy::builder()
            .max_attempts(1)
            .build()
            .expect("a valid policy"),
    );
    let unhedged = tower::util::BoxCloneService::new(
        once.layer(balanced.clone()).map_err(Into::<BoxError>::into),
    );
    let hedged = tower::util::BoxCloneService::new(
        hedge
            .layer(balanced.clone())
            .map_err(Into::<BoxError>::into),
    );
    for (name, svc) in [("no hedging", unhedged), ("HedgeLayer", hedged)] {
        // Warm the connections up.
        let _ = run(svc.clone(), 200, args.concurrency, &hits).await;
        let o = run(svc, args.requests, args.concurrency, &hits).await;
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} |",
            pct(&o.latencies, 0.50),
            pct(&o.latencies, 0.99),
            pct(&o.latencies, 0.999),
            pct(&o.latencies, 1.0),
            o.attempts as f64 / args.requests as f64,
        );
    }
    let s = hedge.stats();
    println!(
        "HedgeLayer: {} requests, {} hedges, {} won by a hedge, {} refused by the budget",
        s.requests, s.hedges, s.won_by_hedge, s.budget_refusals
    );
}

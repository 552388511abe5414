//! A client with `RetryLayer` against a local flaky server that prints each attempt.
//!
//! ```text
//! cargo run -p retry-layer --example flaky_server
//! ```
//!
//! The server answers 503 to the first two attempts of every idempotency key; the client sends
//! POSTs through `RetryLayer` with `ensure_idempotency_key()`, so every write is retried under
//! one key, with exponential backoff and jitter (the DEBUG lines).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use retry_layer::{RetryLayer, RetryPolicy};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), reason_code::BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "retry_layer=debug".into()),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("flaky server listening on http://{addr}");
    let attempts: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let attempts = attempts.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let attempts = attempts.clone();
                    async move { Ok::<_, Infallible>(flaky(req, &attempts).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });

    let layer = RetryLayer::new(RetryPolicy::builder().ensure_idempotency_key().build()?);
    let client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(Client::builder(TokioExecutor::new()).build_http());

    for order in 1..=3 {
        let req = Request::post(format!("http://{addr}/orders"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"book_id":"b{order}","quantity":1}}"#
            ))))?;
        let res = client.clone().oneshot(req).await?;
        let status = res.status();
        let body = res.into_body().collect().await?.to_bytes();
        println!(
            "client: order {order} -> {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    let s = layer.stats();
    println!(
        "client stats: requests={} attempts={} retries={} budget_refusals={}",
        s.requests, s.attempts, s.retries, s.budget_refusals
    );
    Ok(())
}

async fn flaky(
    req: Request<Incoming>,
    attempts: &Mutex<HashMap<String, u32>>,
) -> Response<Full<Bytes>> {
    let key = req
        .headers()
        .get("x-idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let previous = req
        .headers()
        .get("x-previous-attempts")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("0")
        .to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let n = {
        let mut a = attempts.lock().unwrap();
        let n = a.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    let status = if n <= 2 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::CREATED
    };
    println!(
        "server: attempt {n} key={key} previous-attempts={previous} body={} -> {status}",
        String::from_utf8_lossy(&body)
    );
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::from(if n <= 2 {
            "try again"
        } else {
            "created"
        })))
        .unwrap()
}

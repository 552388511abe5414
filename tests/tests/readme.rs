//! The README's Rust blocks compile. Each block is copied below, in the README's order,
//! between a `// README block` line and an `// end README block` line, inside a function that
//! gives it what it uses (a handler, a store, a channel) and is compiled, not run. The test
//! fails when a block of the README and its copy here differ: change both together.

#![allow(dead_code, unused_variables, unused_imports)]

use std::net::SocketAddr;

use axum::extract::Request;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::Full;
use idempotency_layer::{PostgresStore, Tenant, TxCompletion};
use reason_code::BoxError;
use retry_layer::RetryPolicy;
use tower::ServiceBuilder;

async fn create_order() -> &'static str {
    "created"
}

async fn insert_tenant(mut req: Request) -> Request {
    req.extensions_mut().insert(Tenant::new("acme"));
    req
}

#[rustfmt::skip]
fn axum_server() {
    let auth_layer = axum::middleware::map_request(insert_tenant);
    // README block
    use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource};

    // A single-tenant service: every key belongs to one tenant.
    let app: Router = Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("orders")));

    // Several tenants: keys are scoped per tenant, read from the `Tenant` extension that your
    // auth layer inserts (`req.extensions_mut().insert(Tenant::new(account_id))`) before this
    // layer runs. Without a tenant, a write is answered 401 (see `TenantSource`).
    let app: Router = Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(auth_layer); // outermost: runs first
    // end README block
}

#[rustfmt::skip]
async fn tonic_server(addr: SocketAddr) -> Result<(), BoxError> {
    use idempotency_layer::reason_code::GrpcMethods;
    use idempotency_layer::{IdempotencyLayer, MemoryStore, Writes};
    use tonic::transport::Server;
    use tonic_library::pb::library_server::LibraryServer;
    let store = MemoryStore::new();
    let service = tonic_library::LibraryService::new(axum_orders::inventory::Inventory::seeded(
        std::time::Duration::ZERO,
    ));
    let auth_layer = tower::layer::util::Identity::new();
    // README block
    Server::builder()
        .layer(auth_layer)
        .layer(
            IdempotencyLayer::new(store)
                .writes(Writes::default().idempotent_grpc_methods(GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"])?)),
        )
        .add_service(LibraryServer::new(service))
        .serve(addr)
        .await?;
    // end README block
    Ok(())
}

#[rustfmt::skip]
async fn hyper_util_client() -> Result<(), BoxError> {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tower::ServiceExt;
    // README block
    use retry_layer::{RetryLayer, RetryPolicy};

    let policy = RetryPolicy::builder().ensure_idempotency_key().build()?;
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(Client::builder(TokioExecutor::new()).build_http());
    // end README block
    let req = http::Request::post("http://127.0.0.1:3000/orders")
        .body(Full::new(Bytes::from_static(b"{}")))?;
    let _ = client.oneshot(req).await?;
    Ok(())
}

#[rustfmt::skip]
async fn tonic_channel(channel: tonic::transport::Channel) -> Result<(), BoxError> {
    use tonic_library::pb::library_client::LibraryClient;
    // README block
    use retry_layer::{GrpcMethods, RetryLayer, RetryPolicy};

    let reads = GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"])?;
    let policy = RetryPolicy::builder()
        .idempotent_grpc_methods(reads)
        .ensure_idempotency_key()
        .build()?;
    // With the `tonic` feature, a nameable type: `retry_layer::tonic::RetryChannel<Channel>`.
    let svc = RetryLayer::new(policy).tonic_channel(channel);
    let client = LibraryClient::new(svc);
    // end README block
    Ok(())
}

#[rustfmt::skip]
async fn reqwest_client(policy: RetryPolicy, url: &str, order_json: String) -> Result<(), BoxError> {
    // README block
    use retry_layer::reqwest::RetryMiddleware;

    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy))
        .build();
    let res = client.post(url).body(order_json).send().await?;
    // end README block
    Ok(())
}

#[rustfmt::skip]
fn across_hops() {
    use retry_layer::hop::HopLayer;
    // README block
    let app: Router = Router::new().route("/orders", post(create_order)).layer(HopLayer::new());
    // end README block
}

#[rustfmt::skip]
async fn pgbouncer() -> Result<(), BoxError> {
    // README block
    let store = PostgresStore::builder("postgres://app@pgbouncer:6432/app?pooling=transaction")
        .listen_url("postgres://app@db:5432/app")
        .connect()
        .await?;
    // end README block
    Ok(())
}

#[rustfmt::skip]
async fn tx_completion(
    store: PostgresStore,
    completion: TxCompletion,
    response: http::Response<Full<Bytes>>,
    order_id: String,
) -> Result<http::Response<idempotency_layer::IdempotencyBody<Full<Bytes>>>, BoxError> {
    let mut db = store.pool().get().await?;
    // README block
    let tx = db.transaction().await?;                              // db: from store.pool()
    tx.execute("INSERT INTO orders (id) VALUES ($1)", &[&order_id]).await?;
    let response = completion.complete_in(&tx, response).await?;  // Err: roll back (e.g. Fenced)
    tx.commit().await?;
    Ok(response)                                                   // the layer writes nothing more
    // end README block
}

#[rustfmt::skip]
async fn tx_completion_sqlx(
    pool: sqlx::PgPool,
    completion: TxCompletion,
    response: http::Response<Full<Bytes>>,
    order_id: String,
) -> Result<http::Response<idempotency_layer::IdempotencyBody<Full<Bytes>>>, BoxError> {
    // README block
    let mut tx = pool.begin().await?;                                   // pool: sqlx::PgPool
    sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(&order_id).execute(&mut *tx).await?;
    let response = completion.complete_in_sqlx(&mut tx, response).await?; // Err: roll back
    tx.commit().await?;
    Ok(response)
    // end README block
}

/// The Rust blocks of `markdown` (fenced with ```` ```rust ````), each with its lines.
fn rust_blocks(markdown: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in markdown.lines() {
        match &mut current {
            None if line.trim_start().starts_with("```rust") => current = Some(Vec::new()),
            Some(block) if line.trim_start() == "```" => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some(block) => block.push(line.to_owned()),
            None => {}
        }
    }
    blocks
}

/// The copies in `source`: the lines between each `// README block` and `// end README block`,
/// less the indentation they share.
fn copies(source: &str) -> Vec<Vec<String>> {
    let mut copies = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in source.lines() {
        match &mut current {
            None if line.trim() == "// README block" => current = Some(Vec::new()),
            Some(copy) if line.trim() == "// end README block" => {
                let indent = copy
                    .iter()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| l.len() - l.trim_start().len())
                    .min()
                    .unwrap_or(0);
                copies.push(
                    copy.iter()
                        .map(|l| l.get(indent..).unwrap_or("").trim_end().to_owned())
                        .collect(),
                );
                current = None;
            }
            Some(copy) => copy.push(line.to_owned()),
            None => {}
        }
    }
    copies
}

#[test]
fn readme_blocks_are_the_ones_compiled_here() {
    let readme = include_str!("../../README.md");
    let source = include_str!("readme.rs");
    let blocks: Vec<Vec<String>> = rust_blocks(readme)
        .into_iter()
        .map(|b| b.into_iter().map(|l| l.trim_end().to_owned()).collect())
        .collect();
    let copies = copies(source);
    assert!(!blocks.is_empty(), "the README's Rust blocks are found");
    assert_eq!(
        blocks.len(),
        copies.len(),
        "the README has {} Rust blocks and tests/tests/readme.rs compiles {}: copy each new \
         block here, inside a function that gives it what it uses",
        blocks.len(),
        copies.len()
    );
    for (i, (block, copy)) in blocks.iter().zip(&copies).enumerate() {
        assert_eq!(
            block,
            copy,
            "README Rust block {} differs from its compiled copy in tests/tests/readme.rs",
            i + 1
        );
    }
}

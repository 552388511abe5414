//! The Rust blocks of the README and of the guide (`docs/guide.md`) compile. Each block is copied
//! below, in its document's order, between a `// README block` (or `// guide block`) line and an
//! `// end README block` (or `// end guide block`) line, and is compiled, not run. The README's
//! blocks are whole programs (each a `src/main.rs`), so each copy is a module of its own; a guide
//! block sits inside a function that gives it what it uses (a handler, a store, an auth layer).
//! The tests fail when a block and its copy here differ: change both together.

#![allow(dead_code, unused_variables, unused_imports)]

use std::net::SocketAddr;

use axum::extract::Request;
use bytes::Bytes;
use http_body_util::Full;
use idempotency_layer::{PostgresStore, Tenant, TxCompletion};
use reason_code::BoxError;

// The README's blocks: whole programs.

#[rustfmt::skip]
mod axum_server {
    // README block
    use std::sync::atomic::{AtomicU64, Ordering};

    use axum::routing::post;
    use axum::Router;
    use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource};

    static ORDERS: AtomicU64 = AtomicU64::new(0);

    async fn create_order() -> String {
        let n = ORDERS.fetch_add(1, Ordering::Relaxed) + 1;
        format!("order {n} created\n")
    }

    #[tokio::main]
    async fn main() -> std::io::Result<()> {
        let app = Router::new()
            .route("/orders", post(create_order))
            // One tenant for the whole service.
            .layer(IdempotencyLayer::new(MemoryStore::new()).tenant(TenantSource::fixed("orders")));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
        axum::serve(listener, app).await
    }
    // end README block
}

#[rustfmt::skip]
mod tonic_server {
    // README block
    use idempotency_layer::reason_code::GrpcMethods;
    use idempotency_layer::{IdempotencyLayer, MemoryStore, TenantSource, Writes};
    use tonic::service::Routes;
    use tonic::transport::Server;

    #[tokio::main]
    async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        // Your generated services: `Routes::new(LibraryServer::new(service))`.
        let routes = Routes::default();
        let reads = GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"])?;
        let idempotency = IdempotencyLayer::new(MemoryStore::new())
            .tenant(TenantSource::fixed("library"))
            .writes(Writes::default().idempotent_grpc_methods(reads));
        Server::builder()
            .layer(idempotency)
            .add_routes(routes)
            .serve("127.0.0.1:50051".parse()?)
            .await?;
        Ok(())
    }
    // end README block
}

#[rustfmt::skip]
mod hyper_client {
    // README block
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
    use tower::{ServiceBuilder, ServiceExt};

    #[tokio::main]
    async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        // A POST is not idempotent: with a key (the same on every attempt) it is retried.
        let policy = RetryPolicy::builder().ensure_idempotency_key().build()?;
        let client = ServiceBuilder::new()
            .layer(RetryLayer::new(policy))
            .service(Client::builder(TokioExecutor::new()).build_http::<ReplayBody<Full<Bytes>>>());
        let order = http::Request::post("http://127.0.0.1:3000/orders")
            .body(Full::new(Bytes::from_static(b"one book")))?;
        let response = client.oneshot(order).await?;
        println!("{}", response.status());
        Ok(())
    }
    // end README block
}

#[rustfmt::skip]
mod reqwest_client {
    // README block
    use retry_layer::reqwest::RetryMiddleware;
    use retry_layer::RetryPolicy;

    #[tokio::main]
    async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let policy = RetryPolicy::builder().ensure_idempotency_key().build()?;
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(policy))
            .build();
        let response = client
            .post("http://127.0.0.1:3000/orders")
            .body("one book")
            .send()
            .await?;
        println!("{}", response.status());
        Ok(())
    }
    // end README block
}

#[rustfmt::skip]
mod tonic_client {
    // README block
    use retry_layer::tonic::RetryChannel;
    use retry_layer::{GrpcMethods, RetryLayer, RetryPolicy};
    use tonic::transport::Channel;

    #[tokio::main]
    async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let reads = GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"])?;
        let policy = RetryPolicy::builder()
            .idempotent_grpc_methods(reads)
            .ensure_idempotency_key()
            .build()?;
        let channel = Channel::from_static("http://127.0.0.1:50051").connect_lazy();
        let channel: RetryChannel<Channel> = RetryLayer::new(policy).tonic_channel(channel);
        // Your generated client over it: `LibraryClient::new(channel)`.
        Ok(())
    }
    // end README block
}

// The guide's blocks, each inside a function that gives it what it uses.

async fn create_order() -> &'static str {
    "created"
}

async fn insert_tenant(mut req: Request) -> Request {
    req.extensions_mut().insert(Tenant::new("acme"));
    req
}

#[rustfmt::skip]
fn several_tenants() {
    let auth_layer = axum::middleware::map_request(insert_tenant);
    // guide block
    use axum::routing::post;
    use axum::Router;
    use idempotency_layer::{IdempotencyLayer, MemoryStore};

    // Several tenants: keys are scoped per tenant, read from the `Tenant` extension that your
    // auth layer inserts (`req.extensions_mut().insert(Tenant::new(account_id))`) before this
    // layer runs. Without a tenant, a write is answered 401 (see `TenantSource`).
    let app: Router = Router::new()
        .route("/orders", post(create_order))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(auth_layer); // outermost: runs first
    // end guide block
}

#[rustfmt::skip]
async fn tonic_server_behind_auth(addr: SocketAddr) -> Result<(), BoxError> {
    let store = idempotency_layer::MemoryStore::new();
    let service = tonic_library::LibraryService::new(axum_orders::inventory::Inventory::seeded(
        std::time::Duration::ZERO,
    ));
    let auth_layer = tower::layer::util::Identity::new();
    // guide block
    use idempotency_layer::reason_code::GrpcMethods;
    use idempotency_layer::{IdempotencyLayer, Writes};
    use tonic::transport::Server;
    use tonic_library::pb::library_server::LibraryServer;

    Server::builder()
        .layer(auth_layer)
        .layer(
            IdempotencyLayer::new(store)
                .writes(Writes::default().idempotent_grpc_methods(GrpcMethods::new(["/plume.linkd.v3.Library/GetBook"])?)),
        )
        .add_service(LibraryServer::new(service))
        .serve(addr)
        .await?;
    // end guide block
    Ok(())
}

#[rustfmt::skip]
fn across_hops() {
    // guide block
    use axum::routing::post;
    use axum::Router;
    use retry_layer::hop::HopLayer;

    let app: Router = Router::new().route("/orders", post(create_order)).layer(HopLayer::new());
    // end guide block
}

#[rustfmt::skip]
async fn pgbouncer() -> Result<(), BoxError> {
    // guide block
    use idempotency_layer::PostgresStore;

    let store = PostgresStore::builder("postgres://app@pgbouncer:6432/app?pooling=transaction")
        .listen_url("postgres://app@db:5432/app")
        .connect()
        .await?;
    // end guide block
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
    // guide block
    let tx = db.transaction().await?;                              // db: from store.pool()
    tx.execute("INSERT INTO orders (id) VALUES ($1)", &[&order_id]).await?;
    let response = completion.complete_in(&tx, response).await?;  // Err: roll back (e.g. Fenced)
    tx.commit().await?;
    Ok(response)                                                   // the layer writes nothing more
    // end guide block
}

#[rustfmt::skip]
async fn tx_completion_sqlx(
    pool: sqlx::PgPool,
    completion: TxCompletion,
    response: http::Response<Full<Bytes>>,
    order_id: String,
) -> Result<http::Response<idempotency_layer::IdempotencyBody<Full<Bytes>>>, BoxError> {
    // guide block
    let mut tx = pool.begin().await?;                                   // pool: sqlx::PgPool
    sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(&order_id).execute(&mut *tx).await?;
    let response = completion.complete_in_sqlx(&mut tx, response).await?; // Err: roll back
    tx.commit().await?;
    Ok(response)
    // end guide block
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

/// The copies in `source` of one document's blocks: the lines between each `// {doc} block` and
/// `// end {doc} block`, less the indentation they share.
fn copies(source: &str, doc: &str) -> Vec<Vec<String>> {
    let (open, close) = (format!("// {doc} block"), format!("// end {doc} block"));
    let mut copies = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in source.lines() {
        match &mut current {
            None if line.trim() == open => current = Some(Vec::new()),
            Some(copy) if line.trim() == close => {
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

/// Every Rust block of `markdown` (the document `path`, whose copies here are marked
/// `// {doc} block`) is the same as its compiled copy, in the same order.
fn blocks_are_compiled_here(markdown: &str, path: &str, doc: &str) {
    let source = include_str!("readme.rs");
    let blocks: Vec<Vec<String>> = rust_blocks(markdown)
        .into_iter()
        .map(|b| b.into_iter().map(|l| l.trim_end().to_owned()).collect())
        .collect();
    let copies = copies(source, doc);
    assert!(!blocks.is_empty(), "the Rust blocks of {path} are found");
    assert_eq!(
        blocks.len(),
        copies.len(),
        "{path} has {} Rust blocks and tests/tests/readme.rs compiles {}: copy each new \
         block here (marked `// {doc} block`), where it has what it uses",
        blocks.len(),
        copies.len()
    );
    for (i, (block, copy)) in blocks.iter().zip(&copies).enumerate() {
        assert_eq!(
            block,
            copy,
            "{path} Rust block {} differs from its compiled copy in tests/tests/readme.rs",
            i + 1
        );
    }
}

#[test]
fn readme_blocks_are_the_ones_compiled_here() {
    blocks_are_compiled_here(include_str!("../../README.md"), "README.md", "README");
}

#[test]
fn guide_blocks_are_the_ones_compiled_here() {
    blocks_are_compiled_here(
        include_str!("../../docs/guide.md"),
        "docs/guide.md",
        "guide",
    );
}

/// A README block is a whole program: it shows every `use` it needs and has its `main`, so
/// that a newcomer can copy it into a new crate's `src/main.rs` as it is.
#[test]
fn readme_blocks_are_whole_programs() {
    let readme = include_str!("../../README.md");
    for (i, block) in rust_blocks(readme).iter().enumerate() {
        assert!(
            block.iter().any(|l| l.starts_with("use ")),
            "README Rust block {} shows its imports",
            i + 1
        );
        assert!(
            block.iter().any(|l| l.starts_with("async fn main()")),
            "README Rust block {} has its `main`",
            i + 1
        );
        assert!(
            block.iter().all(|l| !l.trim_start().starts_with("# ")),
            "README Rust block {} hides no line",
            i + 1
        );
    }
}

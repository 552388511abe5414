//! The HTTP service: routes, layers, and serving.

use std::net::SocketAddr;

use axum::body::{Body, Bytes};
use axum::extract::{FromRef, Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
#[cfg(feature = "postgres")]
use idempotency_layer::TxCompletion;
use idempotency_layer::{IdempotencyLayer, IdempotencyStore, Tenant};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::auth::demo_auth_layer;
use crate::inventory::{Inventory, InventoryError};
#[cfg(feature = "postgres")]
use crate::pg_orders::PgOrders;
use crate::stock::Stock;

/// Where created orders are kept.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum OrderBook {
    /// Counted by the [`Inventory`] only (the in-memory and Redis modes).
    #[default]
    Memory,
    /// In the PostgreSQL `orders` table, each order committed with its idempotency record in one
    /// transaction (`--store postgres://...`).
    #[cfg(feature = "postgres")]
    Postgres(PgOrders),
}

/// What the handlers share.
#[derive(Debug, Clone)]
struct Shop {
    inventory: Inventory,
    orders: OrderBook,
    stock: Stock,
}

impl FromRef<Shop> for Inventory {
    fn from_ref(shop: &Shop) -> Inventory {
        shop.inventory.clone()
    }
}

/// The routes, without layers, with orders counted by the inventory ([`OrderBook::Memory`]).
pub fn routes(inventory: Inventory) -> Router {
    routes_with(inventory, OrderBook::Memory, Stock::Local)
}

/// The routes, without layers, with orders kept in `orders` and their stock taken from `stock`.
pub fn routes_with(inventory: Inventory, orders: OrderBook, stock: Stock) -> Router {
    Router::new()
        .route("/books/{book_id}", get(get_book))
        .route("/books/{book_id}/deduct", post(deduct))
        .route("/orders", post(create_order))
        .route("/stats", get(stats))
        .with_state(Shop {
            inventory,
            orders,
            stock,
        })
}

/// The service: routes, then the idempotency layer, then the demo auth layer in front of it
/// (orders counted by the inventory).
pub fn app<St: IdempotencyStore>(
    inventory: Inventory,
    idempotency: IdempotencyLayer<St>,
) -> Router {
    app_with(inventory, OrderBook::Memory, Stock::Local, idempotency)
}

/// [`app`] with orders kept in `orders` and their stock taken from `stock` (another server's
/// inventory: a chain, see [`crate::stock`]).
pub fn app_with<St: IdempotencyStore>(
    inventory: Inventory,
    orders: OrderBook,
    stock: Stock,
    idempotency: IdempotencyLayer<St>,
) -> Router {
    routes_with(inventory, orders, stock)
        .layer(idempotency)
        .layer(demo_auth_layer::<Body>())
        // One tier of retries: a handler calling other services through `RetryLayer` sends a
        // request that arrived as a retry once, and says when it retried below.
        .layer(retry_layer::hop::HopLayer::new())
}

/// Serves `app` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(listener, app).await
}

/// Serves `app` on `listener` until SIGTERM (or Ctrl-C), then shuts down gracefully: the
/// server stops accepting connections and lets the responses in flight go out, while
/// `idempotency` [drains](IdempotencyLayer::drain) within `grace`
/// ([`serve_until_signal`](crate::shutdown::serve_until_signal)).
pub async fn serve_until_sigterm<St>(
    listener: TcpListener,
    app: Router,
    idempotency: IdempotencyLayer<St>,
    grace: std::time::Duration,
) -> std::io::Result<()>
where
    St: Send + Sync + 'static,
{
    crate::shutdown::serve_until_signal(idempotency, grace, |stop| {
        std::future::IntoFuture::into_future(
            axum::serve(listener, app).with_graceful_shutdown(stop),
        )
    })
    .await
}

/// Binds `addr` (port 0 picks one) and returns the listener and its real address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

#[derive(Deserialize)]
struct CreateOrder {
    book_id: String,
    quantity: i64,
}

#[derive(Deserialize)]
struct Deduct {
    quantity: i64,
    /// The book's version the caller read; the deduction is refused with `STOCK_CONFLICT` if
    /// the book changed since.
    #[serde(default)]
    expected_version: Option<u64>,
    /// The caller's reference of the order the deduction is for, kept with the deduction (in
    /// the `deductions` table, with orders in PostgreSQL).
    #[serde(default)]
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    order_ref: Option<String>,
}

fn bad_request(detail: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": "bad_request", "detail": detail.into()})),
    )
        .into_response()
}

fn inventory_error(e: InventoryError) -> Response {
    match &e {
        InventoryError::NoSuchBook(_) => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "not_found", "detail": e.to_string()})),
        )
            .into_response(),
        // A failed precondition: a retry would get the same answer (FAILED_PRECONDITION).
        InventoryError::NotEnoughStock { .. } => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "out_of_stock", "detail": e.to_string()})),
        )
            .into_response(),
        // A conflict (ABORTED): the client re-reads the book and rebuilds the write.
        InventoryError::VersionConflict { current, .. } => {
            let mut res = (
                StatusCode::CONFLICT,
                Json(json!({"error": "stock_conflict", "detail": e.to_string(),
                    "current_version": current})),
            )
                .into_response();
            res.headers_mut()
                .insert("x-reason-code", HeaderValue::from_static("STOCK_CONFLICT"));
            res
        }
        InventoryError::BadQuantity(_) => bad_request(e.to_string()),
        InventoryError::Refused { status, .. } => (
            StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_REQUEST),
            Json(json!({"error": "refused_by_inventory", "detail": e.to_string()})),
        )
            .into_response(),
        // Not recorded (a 503): the order's retry runs it again.
        InventoryError::Unavailable(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "unavailable", "detail": e.to_string()})),
        )
            .into_response(),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))
}

async fn get_book(State(inv): State<Inventory>, Path(book_id): Path<String>) -> Response {
    match inv.book(&book_id) {
        Some(book) => Json(book).into_response(),
        None => inventory_error(InventoryError::NoSuchBook(book_id)),
    }
}

/// `POST /orders`. With orders in PostgreSQL, the order row and the request's idempotency
/// record commit in one transaction: the layer offers the handler a [`TxCompletion`] for that.
/// The stock comes from this server's inventory or, with `--inventory-url`, another's
/// ([`Stock`]), for the request's tenant.
async fn create_order(
    State(shop): State<Shop>,
    #[cfg(feature = "postgres")] completion: Option<Extension<TxCompletion>>,
    tenant: Option<Extension<Tenant>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let req: CreateOrder = match parse(&body) {
        Ok(r) => r,
        Err(detail) => return bad_request(detail),
    };
    let tenant = tenant.as_ref().map_or("public", |t| t.as_str());
    let key = request_key(&headers);
    let created = match &shop.orders {
        OrderBook::Memory => shop
            .stock
            .reserve(&shop.inventory, tenant, key, &req.book_id, req.quantity)
            .await
            .map(|order| {
                shop.inventory.confirm(&order);
                (StatusCode::CREATED, Json(order)).into_response()
            }),
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pg) => {
            let completion = completion.as_ref().map(|Extension(c)| c);
            pg.create_order(
                &shop.stock,
                &shop.inventory,
                completion,
                tenant,
                key,
                &req.book_id,
                req.quantity,
            )
            .await
        }
    };
    created.unwrap_or_else(inventory_error)
}

/// The request's idempotency key as the layer read it (`x-idempotency-key`, else the IETF
/// `Idempotency-Key`, quoted or bare), to store with the order.
fn request_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    ["x-idempotency-key", "idempotency-key"]
        .iter()
        .find_map(|h| headers.get(*h)?.to_str().ok())
        .map(|k| k.trim_matches('"'))
}

/// `POST /books/{id}/deduct`. With orders in PostgreSQL, each executed deduction is a row of
/// `deductions`, committed with the request's idempotency record.
async fn deduct(
    State(shop): State<Shop>,
    #[cfg(feature = "postgres")] completion: Option<Extension<TxCompletion>>,
    #[cfg(feature = "postgres")] tenant: Option<Extension<Tenant>>,
    #[cfg(feature = "postgres")] headers: axum::http::HeaderMap,
    Path(book_id): Path<String>,
    body: Bytes,
) -> Response {
    let req: Deduct = match parse(&body) {
        Ok(r) => r,
        Err(detail) => return bad_request(detail),
    };
    let inv = &shop.inventory;
    let deducted = match &shop.orders {
        OrderBook::Memory => inv
            .deduct(&book_id, req.quantity, req.expected_version)
            .await
            .map(|d| {
                Json(json!({"book_id": book_id, "remaining": d.remaining, "version": d.version}))
                    .into_response()
            }),
        #[cfg(feature = "postgres")]
        OrderBook::Postgres(pg) => {
            let tenant = tenant.as_ref().map_or("public", |t| t.as_str());
            let completion = completion.as_ref().map(|Extension(c)| c);
            pg.deduct(
                inv,
                completion,
                tenant,
                request_key(&headers),
                req.order_ref.as_deref(),
                &book_id,
                req.quantity,
                req.expected_version,
            )
            .await
        }
    };
    deducted.unwrap_or_else(inventory_error)
}

async fn stats(State(inv): State<Inventory>) -> Response {
    Json(inv.stats()).into_response()
}

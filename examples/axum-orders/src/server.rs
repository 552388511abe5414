//! The HTTP service: routes, layers, and serving.

use std::net::SocketAddr;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency_layer::{IdempotencyLayer, IdempotencyStore};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::auth::demo_auth_layer;
use crate::inventory::{Inventory, InventoryError};

/// The routes, without layers.
pub fn routes(inventory: Inventory) -> Router {
    Router::new()
        .route("/books/{book_id}", get(get_book))
        .route("/books/{book_id}/deduct", post(deduct))
        .route("/orders", post(create_order))
        .route("/stats", get(stats))
        .with_state(inventory)
}

/// The service: routes, then the idempotency layer, then the demo auth layer in front of it.
pub fn app<St: IdempotencyStore>(
    inventory: Inventory,
    idempotency: IdempotencyLayer<St>,
) -> Router {
    routes(inventory)
        .layer(idempotency)
        .layer(demo_auth_layer::<Body>())
}

/// Serves `app` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(listener, app).await
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
        InventoryError::NotEnoughStock { .. } => {
            let mut res = (
                StatusCode::CONFLICT,
                Json(json!({"error": "stock_conflict", "detail": e.to_string()})),
            )
                .into_response();
            res.headers_mut()
                .insert("x-reason-code", HeaderValue::from_static("STOCK_CONFLICT"));
            res
        }
        InventoryError::BadQuantity(_) => bad_request(e.to_string()),
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

async fn create_order(State(inv): State<Inventory>, body: Bytes) -> Response {
    let req: CreateOrder = match parse(&body) {
        Ok(r) => r,
        Err(detail) => return bad_request(detail),
    };
    match inv.create_order(&req.book_id, req.quantity).await {
        Ok(order) => (StatusCode::CREATED, Json(order)).into_response(),
        Err(e) => inventory_error(e),
    }
}

async fn deduct(
    State(inv): State<Inventory>,
    Path(book_id): Path<String>,
    body: Bytes,
) -> Response {
    let req: Deduct = match parse(&body) {
        Ok(r) => r,
        Err(detail) => return bad_request(detail),
    };
    match inv.deduct(&book_id, req.quantity).await {
        Ok(remaining) => Json(json!({"book_id": book_id, "remaining": remaining})).into_response(),
        Err(e) => inventory_error(e),
    }
}

async fn stats(State(inv): State<Inventory>) -> Response {
    Json(inv.stats()).into_response()
}

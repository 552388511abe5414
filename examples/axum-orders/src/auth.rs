//! A demo authentication layer: the tenant comes from `x-tenant-id` (default `public`) and is put
//! in the request's [`Tenant`] extension, where `IdempotencyLayer` reads it.
//!
//! A real service authenticates first (a token, mTLS) and sets the tenant from the verified
//! identity; the point is that the idempotency layer reads an extension set by auth, never a raw
//! header of its own.

use http::Request;
use idempotency_layer::Tenant;
use tower::util::MapRequestLayer;

/// The demo tenant header.
pub const TENANT_HEADER: &str = "x-tenant-id";

/// Sets the [`Tenant`] extension from `x-tenant-id`, or `public`.
pub fn demo_auth<B>(mut req: Request<B>) -> Request<B> {
    let tenant = req
        .headers()
        .get(TENANT_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty() && t.len() <= 128)
        .unwrap_or("public")
        .to_owned();
    req.extensions_mut().insert(Tenant::new(tenant));
    req
}

/// The layer form of [`demo_auth`].
pub type DemoAuthLayer<B> = MapRequestLayer<fn(Request<B>) -> Request<B>>;

/// The demo auth layer for request bodies of type `B`.
pub fn demo_auth_layer<B>() -> DemoAuthLayer<B> {
    MapRequestLayer::new(demo_auth::<B> as fn(Request<B>) -> Request<B>)
}

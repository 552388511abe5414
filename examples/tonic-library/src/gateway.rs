//! A second hop: a Library service that forwards every call to another Library server through
//! a retrying channel, with `HopLayer` on its own server, so that retries stay at one tier.
//!
//! `client -> gateway -> library`: the gateway retries the library as its policy allows. When
//! those retries run out, its answer says so (`x-reason-code: RETRIES_DEFERRED`), and the
//! client retries only within its adaptive budget; a call that reaches the gateway as a retry
//! is forwarded once. Without `HopLayer` the client's and the gateway's retries multiply.
//!
//! A write keeps its caller's idempotency key all the way down, and a write without one is
//! refused: the gateway's channel retries with [`gateway_policy`](crate::client::gateway_policy),
//! which never makes a key.

use tonic::{Request, Response, Status};

use crate::client::RetryChannel;
use crate::pb;
use crate::pb::library_client::LibraryClient;
use crate::pb::library_server::Library;

/// The forwarding Library service.
#[derive(Debug, Clone)]
pub struct Gateway {
    downstream: LibraryClient<RetryChannel>,
}

impl Gateway {
    /// Forwards to `downstream`.
    pub fn new(downstream: LibraryClient<RetryChannel>) -> Self {
        Gateway { downstream }
    }
}

/// The metadata that scopes a write and goes down with it: every idempotency key header the
/// server layer accepts (`x-idempotency-key`, and the IETF draft's `idempotency-key`), and the
/// tenant (`x-tenant-id`, which the demo auth layer reads). Forwarding the key without the
/// tenant would scope every caller's key to one tenant below: two tenants' writes that happen
/// to share a key would get each other's replays.
const FORWARDED: [&str; 3] = [
    "x-idempotency-key",
    "idempotency-key",
    axum_orders::auth::TENANT_HEADER,
];

/// The caller's message as a request to the downstream service, with only the caller's
/// [`FORWARDED`] metadata (its deadline goes down as the channel's `grpc-timeout`).
fn downstream<T>(caller: Request<T>) -> Request<T> {
    let (metadata, _, msg) = caller.into_parts();
    let mut down = Request::new(msg);
    for name in FORWARDED {
        if let Some(value) = metadata.get(name) {
            down.metadata_mut().insert(name, value.clone());
        }
    }
    down
}

/// A write goes down only with its caller's key. A hop that made one would give each of the
/// caller's resends a key of its own, and the library would run every one of them: only the
/// caller knows which calls are the same write. So a keyless write is refused here, as the
/// library would refuse it.
fn keyed<T>(caller: Request<T>) -> Result<Request<T>, Status> {
    let has_key = ["x-idempotency-key", "idempotency-key"]
        .iter()
        .any(|name| caller.metadata().contains_key(*name));
    if !has_key {
        return Err(Status::invalid_argument(
            "write operations require x-idempotency-key (or Idempotency-Key): set one per \
             logical write and resend it unchanged; the gateway forwards the caller's key and \
             never makes one",
        ));
    }
    Ok(downstream(caller))
}

/// The downstream call's outcome as this hop's answer: the status with its message and
/// metadata (a reason code from below travels up as it is).
fn forward<T>(result: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
    result.map(|res| Response::new(res.into_inner()))
}

#[tonic::async_trait]
impl Library for Gateway {
    async fn get_book(
        &self,
        req: Request<pb::GetBookRequest>,
    ) -> Result<Response<pb::Book>, Status> {
        let down = downstream(req);
        forward(self.downstream.clone().get_book(down).await)
    }

    async fn create_order(
        &self,
        req: Request<pb::CreateOrderRequest>,
    ) -> Result<Response<pb::Order>, Status> {
        // The caller's key and tenant go down with the order, so the library runs it once per
        // tenant and key.
        let down = keyed(req)?;
        forward(self.downstream.clone().create_order(down).await)
    }

    async fn deduct_stock(
        &self,
        req: Request<pb::DeductStockRequest>,
    ) -> Result<Response<pb::Stock>, Status> {
        let down = keyed(req)?;
        forward(self.downstream.clone().deduct_stock(down).await)
    }

    async fn get_stats(
        &self,
        req: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::Stats>, Status> {
        let down = downstream(req);
        forward(self.downstream.clone().get_stats(down).await)
    }
}

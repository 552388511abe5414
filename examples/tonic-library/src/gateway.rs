//! A second hop: a Library service that forwards every call to another Library server through
//! a retrying channel, with `HopLayer` on its own server, so that retries stay at one tier.
//!
//! `client -> gateway -> library`: the gateway retries the library as its policy allows. When
//! those retries run out, its answer says so (`x-reason-code: RETRIES_DEFERRED`), and the
//! client retries only within its adaptive budget; a call that reaches the gateway as a retry
//! is forwarded once. Without `HopLayer` the client's and the gateway's retries multiply.

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

/// The metadata that scopes a write and goes down with it: the idempotency key, and the tenant
/// (`x-tenant-id`, which the demo auth layer reads). Forwarding the key without the tenant would
/// scope every caller's key to one tenant below (the seed's mistake 2): two tenants' writes that
/// happen to share a key would get each other's replays.
const FORWARDED: [&str; 2] = ["x-idempotency-key", axum_orders::auth::TENANT_HEADER];

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
        let down = downstream(req);
        forward(self.downstream.clone().create_order(down).await)
    }

    async fn deduct_stock(
        &self,
        req: Request<pb::DeductStockRequest>,
    ) -> Result<Response<pb::Stock>, Status> {
        let down = downstream(req);
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

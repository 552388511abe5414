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
        forward(self.downstream.clone().get_book(req.into_inner()).await)
    }

    async fn create_order(
        &self,
        req: Request<pb::CreateOrderRequest>,
    ) -> Result<Response<pb::Order>, Status> {
        // The caller's idempotency key goes down with the order, so the library runs it once.
        let key = req.metadata().get("x-idempotency-key").cloned();
        let mut down = Request::new(req.into_inner());
        if let Some(key) = key {
            down.metadata_mut().insert("x-idempotency-key", key);
        }
        forward(self.downstream.clone().create_order(down).await)
    }

    async fn deduct_stock(
        &self,
        req: Request<pb::DeductStockRequest>,
    ) -> Result<Response<pb::Stock>, Status> {
        let key = req.metadata().get("x-idempotency-key").cloned();
        let mut down = Request::new(req.into_inner());
        if let Some(key) = key {
            down.metadata_mut().insert("x-idempotency-key", key);
        }
        forward(self.downstream.clone().deduct_stock(down).await)
    }

    async fn get_stats(
        &self,
        req: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::Stats>, Status> {
        forward(self.downstream.clone().get_stats(req.into_inner()).await)
    }
}

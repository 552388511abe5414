//! The Library client: a tonic `Channel` through `RetryLayer`.

use std::time::Duration;

use retry_layer::{BoxError, RetryLayer, RetryPolicy};
use tonic::transport::{Channel, Endpoint};

use crate::idempotent_methods;
use crate::pb::library_client::LibraryClient;

/// The channel stack: a tonic `Channel` behind `RetryLayer`, a plain nameable type.
pub type RetryChannel = retry_layer::tonic::RetryChannel<Channel>;

/// The retry policy of the example client: defaults, reads declared idempotent (the same
/// [`IDEMPOTENT_METHODS`](crate::IDEMPOTENT_METHODS) the server declares), writes keyed.
pub fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .idempotent_grpc_methods(idempotent_methods())
        .build()
        .expect("a valid policy")
}

/// A Library client for `url` whose calls retry safely, and the layer (for its counters).
pub fn connect_lazy(
    url: &str,
    policy: RetryPolicy,
) -> Result<(LibraryClient<RetryChannel>, RetryLayer), BoxError> {
    let channel = Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    let layer = RetryLayer::new(policy);
    let svc = layer.tonic_channel(channel);
    Ok((LibraryClient::new(svc), layer))
}

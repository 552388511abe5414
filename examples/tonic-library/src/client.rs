//! The Library client: a tonic `Channel` through `RetryLayer`.

use std::time::Duration;

use retry_layer::reason_code::BoxError;
use retry_layer::{RetryLayer, RetryPolicy};
use tonic::transport::{Channel, Endpoint};

use crate::idempotent_methods;
use crate::pb::library_client::LibraryClient;

/// The channel stack: a tonic `Channel` behind `RetryLayer`, a plain nameable type.
pub type RetryChannel = retry_layer::tonic::RetryChannel<Channel>;

/// The deadline of every call of the example client, retries included (sent as
/// `grpc-timeout`, so the server stops working when the client stops waiting).
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);

/// The retry policy of the example client: defaults, reads declared idempotent (the same
/// [`IDEMPOTENT_METHODS`](crate::IDEMPOTENT_METHODS) the server declares), writes keyed, and a
/// deadline of [`CALL_DEADLINE`] for every call: a caller should always say how long it waits.
pub fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .ensure_idempotency_key()
        .idempotent_grpc_methods(idempotent_methods())
        .total_timeout(CALL_DEADLINE)
        .build()
        .expect("a valid policy")
}

/// The retry policy of a hop that forwards other callers' calls (the gateway): as
/// [`policy`], except that it never makes an idempotency key. A key made at a hop would be new
/// for each of the caller's resends, and the server would run every one; a hop forwards the
/// caller's key, and a write without one is refused before it gets here.
pub fn gateway_policy() -> RetryPolicy {
    RetryPolicy::builder()
        .idempotent_grpc_methods(idempotent_methods())
        .total_timeout(CALL_DEADLINE)
        .build()
        .expect("a valid policy")
}

/// A Library client for `url` whose calls retry safely, and the layer (for its counters).
pub fn connect_lazy(
    url: &str,
    policy: RetryPolicy,
) -> Result<(LibraryClient<RetryChannel>, RetryLayer), BoxError> {
    // HTTP/2 keep-alive: a connection whose peer went away without a word is found by its
    // missed PING and closed, and its calls fail (and are retried) instead of waiting on it.
    let channel = Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .connect_lazy();
    let layer = RetryLayer::new(policy);
    let svc = layer.tonic_channel(channel);
    Ok((LibraryClient::new(svc), layer))
}

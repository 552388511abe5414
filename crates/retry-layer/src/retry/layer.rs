//! [`RetryLayer`]: makes the shared state once and hands it to every service it makes.

use std::sync::Arc;

use tower_layer::Layer;

use crate::retry::policy::RetryPolicy;
use crate::retry::service::Retry;
use crate::retry::shared::Shared;
use crate::retry::stats::RetryStats;

/// Applies [`Retry`] to services. All services made by one layer (and their clones) share one
/// retry budget and one set of counters: cloning the layer does not make a new budget.
///
/// ```
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use retry_layer::{ReplayBody, RetryLayer, RetryPolicy};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = RetryLayer::new(RetryPolicy::default());
/// let svc = ServiceBuilder::new()
///     .layer(layer.clone())
///     .service_fn(|_req: http::Request<ReplayBody<Full<Bytes>>>| async {
///         Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
///     });
/// let res = svc.oneshot(http::Request::new(Full::new(Bytes::new()))).await.unwrap();
/// assert_eq!(res.status(), 200);
/// assert_eq!(layer.stats().requests, 1);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RetryLayer {
    shared: Arc<Shared>,
}

impl RetryLayer {
    /// A layer with `policy`, creating the budget the policy describes.
    pub fn new(policy: RetryPolicy) -> Self {
        RetryLayer {
            shared: Arc::new(Shared::new(policy)),
        }
    }

    /// The counters of every service this layer made.
    pub fn stats(&self) -> RetryStats {
        self.shared.snapshot()
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.shared.policy
    }

    /// The policy, budget and counters this layer shares with every service it made.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry::from_shared(inner, self.shared.clone())
    }
}

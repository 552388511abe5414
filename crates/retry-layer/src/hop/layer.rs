//! [`HopLayer`]: the layer, and the reason codes its services mark answers with.

use reason_code::ReasonCodes;
use tower_layer::Layer;

use super::HopScope;

/// The server half of one-tier retries: see the [module docs](super).
#[derive(Debug, Clone, Default)]
pub struct HopLayer {
    reasons: ReasonCodes,
}

impl HopLayer {
    /// Marks HTTP answers in `x-reason-code` ([`ReasonCodes::default`]).
    pub fn new() -> Self {
        HopLayer::default()
    }

    /// The reason codes (and their header) the hop's HTTP answers are classified and marked
    /// with: the same as its callers' `RetryPolicy` reads.
    pub fn reason_codes(mut self, reasons: ReasonCodes) -> Self {
        self.reasons = reasons;
        self
    }
}

impl<S> Layer<S> for HopLayer {
    type Service = HopScope<S>;

    fn layer(&self, inner: S) -> HopScope<S> {
        HopScope::new(inner, self.reasons.clone())
    }
}

//! The errors a replayed body's readers get.

use std::fmt;

/// A retry attempt read past what could be kept of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyNotReplayable;

impl fmt::Display for BodyNotReplayable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the request body was not kept for replay: it exceeded max_replay_bytes, or the \
             layer's max_replay_bytes_total was in use by other calls; raise \
             RetryPolicyBuilder::max_replay_bytes (or max_replay_bytes_total) to retry such \
             requests",
        )
    }
}

impl std::error::Error for BodyNotReplayable {}

/// The error a stale attempt's body gets once a newer attempt of the same request started. Only
/// transports see it (the stale attempt's response was already handled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Superseded;

impl fmt::Display for Superseded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a newer attempt of this request is sending its body; this attempt is abandoned",
        )
    }
}

impl std::error::Error for Superseded {}

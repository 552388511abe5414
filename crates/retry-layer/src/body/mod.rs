//! Replayable request bodies.
//!
//! [`ReplayBody`] wraps any [`http_body::Body`]. The first attempt streams the original body as
//! it arrives (nothing waits for the whole body) while a copy of each chunk is kept, up to
//! `max_replay_bytes`. A retry replays the kept chunks (and the trailers), then continues reading
//! the original body where the earlier attempt stopped. A body that grows past the limit stops
//! being kept and makes the request non-retryable: it is never truncated and never buffered
//! without bound. What the body has at hand when it is wrapped (polled without waiting) is read
//! right then: a body that is whole at that point (a `Full<Bytes>`, a tonic unary request) is
//! sent and replayed from those bytes, with no shared state, and ends with its last data frame.
//!
//! Real transports stop polling a body early: hyper stops once `is_end_stream()` is true after
//! the last data frame, once a Content-Length is written, or after the trailers frame. So the
//! copy is marked complete when the last frame is *produced*, not when the original returns
//! `None`. And a transport may keep reading an attempt's body after its response arrived (h2
//! streams on, HTTP/1 keeps writing after an early answer): each new attempt therefore cuts the
//! readers of earlier attempts off, so that only the live attempt reads the original body (and
//! is woken by it), and a stale reader can never change what the live one replays.

mod error;
mod handle;
mod kept;
mod memory;
mod replay;
mod wake;
mod wrap;

#[cfg(test)]
mod tests;

pub use error::BodyNotReplayable;
pub(crate) use handle::BodyHandle;
pub(crate) use memory::ReplayMemory;
pub use replay::ReplayBody;

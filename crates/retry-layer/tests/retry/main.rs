//! Integration tests of the retry layer: scripted backends under paused time, and real sockets.

mod support;

mod backpressure;
mod bad_input;
mod bodies;
mod bounds;
mod budget;
mod contract;
mod deadline;
mod early_read;
mod grpc;
mod grpc_wire;
mod hedging;
mod hooks;
mod hops;
#[cfg(feature = "metrics")]
mod metrics;
mod on_the_wire;
mod readiness;
mod replay_memory;
#[cfg(feature = "reqwest")]
mod reqwest_client;
mod sockets;
mod table;
mod timing;
mod wire;

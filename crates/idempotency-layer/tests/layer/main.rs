//! The layer's integration tests, one binary: axum routers over real sockets (HTTP/1.1 and
//! HTTP/2, every body shape and mode), tonic over a `Channel`, hostile input, every bound the
//! server holds, the service's contract, and its metrics. Helpers in `support`.

mod support;

mod bounds;
mod extend;
mod grpc;
#[cfg(feature = "axum")]
mod handler_view;
mod hostile;
mod http;
#[cfg(feature = "metrics")]
mod metrics;
mod service;
mod wire;

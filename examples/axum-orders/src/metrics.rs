//! `/metrics`: the layers' metrics (their `metrics` feature) in the Prometheus text format,
//! rendered by an axum handler. The exporter's own HTTP listener is not used (its feature is
//! off): the service's router serves the page, beside the routes, outside the idempotency and
//! auth layers.

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{
    BuildError, Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

/// Buckets of `idempotency_layer_store_duration_seconds`, from an in-memory store's
/// microseconds to a shared store's slow round trips.
const STORE_SECONDS: [f64; 12] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// A Prometheus recorder with the example's histogram buckets, not yet installed, and the
/// handle that renders it.
pub fn recorder() -> Result<(PrometheusRecorder, PrometheusHandle), BuildError> {
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &STORE_SECONDS)?
        .build_recorder();
    let handle = recorder.handle();
    Ok((recorder, handle))
}

/// Installs [`recorder`] as the process's recorder and returns its handle. Call it once, in a
/// tokio runtime: a task runs the exporter's upkeep every 5 s.
pub fn install() -> Result<PrometheusHandle, Box<dyn std::error::Error + Send + Sync>> {
    let (recorder, handle) = recorder()?;
    metrics::set_global_recorder(recorder)?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// `GET /metrics`: the handle's metrics in the Prometheus text format.
pub fn routes(handle: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move { handle.render() }
        }),
    )
}

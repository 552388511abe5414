//! What the layer tells the outside: spans for calls and attempts, metrics (feature `metrics`),
//! and the rate-limited summary of give-ups and budget refusals.
//!
//! Everything here costs nothing measurable when nobody listens: spans are made with
//! `debug_span!`, which returns [`Span::none`] before evaluating any field when no subscriber
//! enables DEBUG; without the `metrics` feature the metric functions are empty and inlined
//! away; with it, each one increments a counter under a `static` key (no allocation).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::request::Parts;
use http::Response;
use reason_code::{BoxError, Code, Outcome};
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::Span;

/// Why a retryable outcome was returned to the caller: the `reason` label of
/// `retry_layer_give_ups_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GiveUp {
    /// No attempt left.
    Exhausted,
    /// The deadline cannot fit another attempt, or it ended the call.
    Deadline,
    /// The server's pushback said stop, or was longer than `max_pushback`.
    Pushback,
    /// The request's head or body could not be kept.
    NotReplayable,
    /// The request being served is itself a retry of the hop above.
    InboundRetry,
    /// The caller declined the retry (`retry_if`, or `NoRetry` on the request).
    Declined,
}

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
impl GiveUp {
    const ALL: [GiveUp; 6] = [
        GiveUp::Exhausted,
        GiveUp::Deadline,
        GiveUp::Pushback,
        GiveUp::NotReplayable,
        GiveUp::InboundRetry,
        GiveUp::Declined,
    ];

    /// The label value.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            GiveUp::Exhausted => "exhausted",
            GiveUp::Deadline => "deadline",
            GiveUp::Pushback => "pushback",
            GiveUp::NotReplayable => "not_replayable",
            GiveUp::InboundRetry => "inbound_retry",
            GiveUp::Declined => "declined",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Spans

/// The span of one call, across its attempts. gRPC calls carry OpenTelemetry's RPC attributes,
/// others its HTTP client attributes.
pub(crate) fn call_span(parts: &Parts, grpc: bool) -> Span {
    // No tracing subscriber at all: no span. (With tracing's `log` feature, which axum's
    // default `tower-log` turns on, a disabled span would otherwise evaluate every field and
    // hand it to `log`: some 900 instructions a call, for lines nobody asked for. Events still
    // reach `log`.)
    if !tracing::dispatcher::has_been_set() {
        return Span::none();
    }
    if grpc {
        tracing::debug_span!(
            "retry_layer.call",
            rpc.system = "grpc",
            rpc.service = grpc_service(parts.uri.path()),
            rpc.method = grpc_method(parts.uri.path()),
            server.address = parts.uri.host(),
            rpc.grpc.status_code = Empty,
            retry.attempts = Empty,
            retry.code = Empty,
        )
    } else {
        tracing::debug_span!(
            "retry_layer.call",
            http.request.method = %parts.method,
            url.full = %RedactedUrl(&parts.uri),
            server.address = parts.uri.host(),
            http.response.status_code = Empty,
            retry.attempts = Empty,
            retry.code = Empty,
        )
    }
}

/// A URI as spans record it (`url.full`), written only when a span is enabled: user info
/// becomes `REDACTED:REDACTED@` (as OpenTelemetry's HTTP conventions ask) and every query value
/// `REDACTED` (keys kept): a URL's secrets (passwords, signatures, tokens in query strings)
/// never reach the logs.
struct RedactedUrl<'a>(&'a http::Uri);

impl std::fmt::Display for RedactedUrl<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let uri = self.0;
        if let Some(scheme) = uri.scheme_str() {
            write!(f, "{scheme}://")?;
        }
        if let Some(authority) = uri.authority() {
            match authority.as_str().rsplit_once('@') {
                Some((_, host)) => write!(f, "REDACTED:REDACTED@{host}")?,
                None => f.write_str(authority.as_str())?,
            }
        }
        f.write_str(uri.path())?;
        if let Some(query) = uri.query() {
            f.write_str("?")?;
            for (i, pair) in query.split('&').enumerate() {
                if i > 0 {
                    f.write_str("&")?;
                }
                match pair.split_once('=') {
                    Some((key, _)) => write!(f, "{key}=REDACTED")?,
                    None => f.write_str(pair)?,
                }
            }
        }
        Ok(())
    }
}

/// The span of one attempt, a child of the call's span. `resend_count` is 0 for the first
/// attempt (OpenTelemetry's `http.request.resend_count`; gRPC's `grpc-previous-rpc-attempts`).
pub(crate) fn attempt_span(call: &Span, grpc: bool, resend_count: u32) -> Span {
    if !tracing::dispatcher::has_been_set() {
        return Span::none();
    }
    if grpc {
        tracing::debug_span!(
            parent: call,
            "retry_layer.attempt",
            rpc.system = "grpc",
            grpc.previous_rpc_attempts = resend_count,
            rpc.grpc.status_code = Empty,
            retry.code = Empty,
            error.type = Empty,
        )
    } else {
        tracing::debug_span!(
            parent: call,
            "retry_layer.attempt",
            http.request.resend_count = resend_count,
            http.response.status_code = Empty,
            retry.code = Empty,
            error.type = Empty,
        )
    }
}

/// Records how an attempt ended on its span.
pub(crate) fn record_attempt<R>(
    span: &Span,
    result: &Result<Response<R>, BoxError>,
    outcome: Outcome,
    grpc: bool,
) {
    if span.is_disabled() {
        return;
    }
    record_status(span, result, grpc);
    span.record("retry.code", outcome.code().as_str());
    match outcome {
        Outcome::Unsent => span.record("error.type", "unsent"),
        Outcome::Ambiguous => span.record("error.type", "ambiguous"),
        _ => span,
    };
}

/// Records the call's answer on its span.
pub(crate) fn record_call<R>(
    span: &Span,
    result: &Result<Response<R>, BoxError>,
    grpc: bool,
    attempts: u32,
) {
    if span.is_disabled() {
        return;
    }
    record_status(span, result, grpc);
    span.record("retry.attempts", attempts);
}

fn record_status<R>(span: &Span, result: &Result<Response<R>, BoxError>, grpc: bool) {
    let Ok(res) = result else { return };
    if grpc {
        // Only a trailers-only answer has its status in the headers; a streamed one has it in
        // the trailers, which the layer does not wait for.
        if let Some(code) = res
            .headers()
            .get(reason_code::GRPC_STATUS)
            .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
        {
            span.record("rpc.grpc.status_code", code);
        }
    } else {
        span.record("http.response.status_code", res.status().as_u16());
    }
}

/// `package.Service` of `/package.Service/Method`.
fn grpc_service(path: &str) -> &str {
    let path = path.strip_prefix('/').unwrap_or(path);
    path.rsplit_once('/').map_or(path, |(service, _)| service)
}

/// `Method` of `/package.Service/Method`.
fn grpc_method(path: &str) -> &str {
    path.rsplit_once('/').map_or(path, |(_, method)| method)
}

// ---------------------------------------------------------------------------------------------
// Rate-limited WARN summary

/// How often, at most, a layer logs its WARN summary of give-ups and budget refusals.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// Counts give-ups and budget refusals since the last WARN summary, and writes at most one
/// summary per [`SUMMARY_EVERY`] per layer: a dead backend makes one line per period, not one
/// per request. Each single event is logged at DEBUG. (Tokio's clock, so paused-time tests can
/// step through a period.)
#[derive(Debug)]
pub(crate) struct WarnSummary {
    start: Instant,
    /// Milliseconds after `start` when the last summary was written; `u64::MAX`: never.
    last: AtomicU64,
    gave_up: AtomicU64,
    refused: AtomicU64,
}

impl Default for WarnSummary {
    fn default() -> Self {
        WarnSummary {
            start: Instant::now(),
            last: AtomicU64::new(u64::MAX),
            gave_up: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }
}

impl WarnSummary {
    /// Notes a give-up (`refused` false) or a budget refusal (`refused` true), and writes the
    /// summary if none was written in the last period.
    pub(crate) fn note(&self, refused: bool) {
        let counter = if refused {
            &self.refused
        } else {
            &self.gave_up
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if !tracing::enabled!(tracing::Level::WARN) {
            return;
        }
        let now = self.start.elapsed().as_millis() as u64;
        let last = self.last.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= SUMMARY_EVERY.as_millis() as u64;
        // One writer per period: whoever moves `last` writes.
        if !due
            || self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let gave_up = self.gave_up.swap(0, Ordering::Relaxed);
        let refused = self.refused.swap(0, Ordering::Relaxed);
        let period_s = if last == u64::MAX {
            0
        } else {
            (now - last) / 1000
        };
        tracing::warn!(
            gave_up,
            budget_refusals = refused,
            period_s,
            "retry layer: calls returned a retryable failure (retries exhausted or refused); \
             each one is logged at DEBUG"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Metrics

#[cfg(feature = "metrics")]
mod keys {
    //! Every key is a `static`: the label values are the codes' and reasons' own `&'static str`
    //! and the hashes are computed at compile time, so counting allocates nothing.

    use metrics::{Key, Label, Level, Metadata};
    use reason_code::Code;

    use super::GiveUp;

    pub(super) static META: Metadata<'static> =
        Metadata::new("retry_layer", Level::INFO, Some("retry_layer"));

    const fn code(i: usize) -> [Label; 1] {
        [Label::from_static_parts("code", Code::ALL[i].as_str())]
    }

    const fn reason_code(r: usize, i: usize) -> [Label; 2] {
        [
            Label::from_static_parts("reason", GiveUp::ALL[r].as_str()),
            Label::from_static_parts("code", Code::ALL[i].as_str()),
        ]
    }

    /// One entry per [`Code`], in `Code::ALL` order: `$f(i)` for every index `i`.
    macro_rules! per_code {
        (@ $f:ident [$($i:literal)*]) => {
            [$($f($i)),*]
        };
        ($f:ident) => {
            per_code!(@ $f [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16])
        };
    }

    static CODE: [[Label; 1]; 17] = per_code!(code);
    static EXHAUSTED: [[Label; 2]; 17] = per_code!(reason_code_0);
    static DEADLINE: [[Label; 2]; 17] = per_code!(reason_code_1);
    static PUSHBACK: [[Label; 2]; 17] = per_code!(reason_code_2);
    static NOT_REPLAYABLE: [[Label; 2]; 17] = per_code!(reason_code_3);
    static INBOUND_RETRY: [[Label; 2]; 17] = per_code!(reason_code_4);
    static DECLINED: [[Label; 2]; 17] = per_code!(reason_code_5);
    const fn reason_code_0(i: usize) -> [Label; 2] {
        reason_code(0, i)
    }
    const fn reason_code_1(i: usize) -> [Label; 2] {
        reason_code(1, i)
    }
    const fn reason_code_2(i: usize) -> [Label; 2] {
        reason_code(2, i)
    }
    const fn reason_code_3(i: usize) -> [Label; 2] {
        reason_code(3, i)
    }
    const fn reason_code_4(i: usize) -> [Label; 2] {
        reason_code(4, i)
    }
    const fn reason_code_5(i: usize) -> [Label; 2] {
        reason_code(5, i)
    }

    /// The keys of metric `$name` labelled by `$labels`, one per code.
    macro_rules! keys {
        (@ $name:literal, $labels:ident, [$($i:literal)*]) => {
            [$(Key::from_static_parts($name, &$labels[$i])),*]
        };
        ($name:literal, $labels:ident) => {
            keys!(@ $name, $labels, [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16])
        };
    }

    pub(super) static REQUESTS: Key = Key::from_static_name("retry_layer_requests_total");
    pub(super) static ATTEMPTS: [Key; 17] = keys!("retry_layer_attempts_total", CODE);
    pub(super) static RETRIES: [Key; 17] = keys!("retry_layer_retries_total", CODE);
    pub(super) static BUDGET_REFUSALS: [Key; 17] = keys!("retry_layer_budget_refusals_total", CODE);
    pub(super) static GIVE_UPS: [[Key; 17]; GiveUp::ALL.len()] = [
        keys!("retry_layer_give_ups_total", EXHAUSTED),
        keys!("retry_layer_give_ups_total", DEADLINE),
        keys!("retry_layer_give_ups_total", PUSHBACK),
        keys!("retry_layer_give_ups_total", NOT_REPLAYABLE),
        keys!("retry_layer_give_ups_total", INBOUND_RETRY),
        keys!("retry_layer_give_ups_total", DECLINED),
    ];
}

/// Adds one to the counter under `key`.
#[cfg(feature = "metrics")]
#[inline]
fn increment(key: &'static metrics::Key) {
    metrics::with_recorder(|r| r.register_counter(key, &keys::META).increment(1));
}

/// `retry_layer_requests_total`: a call started.
#[inline]
pub(crate) fn call_started() {
    #[cfg(feature = "metrics")]
    increment(&keys::REQUESTS);
}

/// `retry_layer_attempts_total{code}`: an attempt ended with `code`.
#[inline]
pub(crate) fn attempt_ended(code: Code) {
    #[cfg(feature = "metrics")]
    increment(&keys::ATTEMPTS[code.as_i32() as usize]);
    #[cfg(not(feature = "metrics"))]
    let _ = code;
}

/// `retry_layer_retries_total{code}`: a retry follows an attempt that ended with `code`.
#[inline]
pub(crate) fn retried(code: Code) {
    #[cfg(feature = "metrics")]
    increment(&keys::RETRIES[code.as_i32() as usize]);
    #[cfg(not(feature = "metrics"))]
    let _ = code;
}

/// `retry_layer_budget_refusals_total{code}`: the budget refused a retry of `code`.
#[inline]
pub(crate) fn budget_refused(code: Code) {
    #[cfg(feature = "metrics")]
    increment(&keys::BUDGET_REFUSALS[code.as_i32() as usize]);
    #[cfg(not(feature = "metrics"))]
    let _ = code;
}

/// `retry_layer_give_ups_total{reason,code}`: a retryable `code` was returned for `reason`.
#[inline]
pub(crate) fn gave_up(reason: GiveUp, code: Code) {
    #[cfg(feature = "metrics")]
    increment(&keys::GIVE_UPS[reason as usize][code.as_i32() as usize]);
    #[cfg(not(feature = "metrics"))]
    let _ = (reason, code);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redacted(uri: &str) -> String {
        RedactedUrl(&uri.parse().unwrap()).to_string()
    }

    #[test]
    fn a_urls_user_info_and_query_values_are_redacted() {
        assert_eq!(
            redacted("https://orders.example/orders/1"),
            "https://orders.example/orders/1"
        );
        assert_eq!(
            redacted("https://app:s3cret@orders.example:8443/orders?token=abc&page=2&flag"),
            "https://REDACTED:REDACTED@orders.example:8443/orders?token=REDACTED&page=REDACTED&flag"
        );
        assert_eq!(redacted("/orders?sig=x"), "/orders?sig=REDACTED");
    }

    #[test]
    fn give_up_reasons_index_their_table() {
        for (i, r) in GiveUp::ALL.into_iter().enumerate() {
            assert_eq!(r as usize, i);
        }
        for (i, c) in Code::ALL.into_iter().enumerate() {
            assert_eq!(c.as_i32() as usize, i);
        }
    }

    #[test]
    fn grpc_paths_split_into_service_and_method() {
        assert_eq!(grpc_service("/pkg.Library/GetBook"), "pkg.Library");
        assert_eq!(grpc_method("/pkg.Library/GetBook"), "GetBook");
        assert_eq!(grpc_service("odd"), "odd");
    }
}

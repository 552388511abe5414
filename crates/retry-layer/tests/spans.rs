//! Spans and the WARN summary, seen by a capturing subscriber. A test binary of its own: the
//! subscriber is process-wide (a thread-local one races tracing's per-callsite interest cache
//! with other tests' threads), and there is one test, so nothing else writes to it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{Service, ServiceBuilder, ServiceExt};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

#[derive(Debug, Clone)]
struct SpanSeen {
    id: u64,
    name: &'static str,
    parent: Option<u64>,
    fields: BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
struct EventSeen {
    level: tracing::Level,
    fields: BTreeMap<String, String>,
}

#[derive(Default)]
struct Seen {
    spans: Vec<SpanSeen>,
    events: Vec<EventSeen>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Seen>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let parent = ctx
            .span(id)
            .and_then(|s| s.parent())
            .map(|p| p.id().into_u64());
        self.0.lock().unwrap().spans.push(SpanSeen {
            id: id.into_u64(),
            name: attrs.metadata().name(),
            parent,
            fields,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut seen = self.0.lock().unwrap();
        if let Some(span) = seen.spans.iter_mut().find(|s| s.id == id.into_u64()) {
            values.record(&mut Fields(&mut span.fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().events.push(EventSeen {
            level: *event.metadata().level(),
            fields,
        });
    }
}

fn field<'a>(span: &'a SpanSeen, name: &str) -> Option<&'a str> {
    span.fields.get(name).map(String::as_str)
}

/// A backend that answers 503 `failures` times, then 201.
fn flaky(
    failures: u32,
) -> impl Service<
    Request<retry_layer::ReplayBody<Full<Bytes>>>,
    Response = Response<http_body_util::Empty<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    let calls = Arc::new(AtomicU32::new(0));
    tower::service_fn(move |_req| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        async move {
            let status = if n < failures {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CREATED
            };
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .body(http_body_util::Empty::new())
                    .unwrap(),
            )
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_retried_call_has_a_call_span_and_a_span_per_attempt() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .unwrap();

    // A retried call: two 503s, then 201.
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(flaky(2));
    let req = Request::put("http://app:s3cret@orders.example/orders/1?sig=abc")
        .body(Full::new(Bytes::from("{}")))
        .unwrap();
    let res = client.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);

    let spans = capture.0.lock().unwrap().spans.clone();
    let calls: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "retry_layer.call")
        .collect();
    assert_eq!(calls.len(), 1, "{spans:#?}");
    let call = calls[0];
    assert_eq!(field(call, "http.request.method"), Some("PUT"));
    assert_eq!(
        field(call, "url.full"),
        Some("http://REDACTED:REDACTED@orders.example/orders/1?sig=REDACTED"),
        "no credential or query value reaches the logs"
    );
    assert_eq!(field(call, "server.address"), Some("orders.example"));
    assert_eq!(field(call, "http.response.status_code"), Some("201"));
    assert_eq!(field(call, "retry.attempts"), Some("3"));

    let attempts: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "retry_layer.attempt")
        .collect();
    assert_eq!(attempts.len(), 3, "{spans:#?}");
    for (n, attempt) in attempts.iter().enumerate() {
        assert_eq!(
            attempt.parent,
            Some(call.id),
            "attempt {n} is a child of the call"
        );
        assert_eq!(
            field(attempt, "http.request.resend_count"),
            Some(n.to_string().as_str())
        );
        let (status, code) = if n < 2 {
            ("503", "UNAVAILABLE")
        } else {
            ("201", "OK")
        };
        assert_eq!(field(attempt, "http.response.status_code"), Some(status));
        assert_eq!(field(attempt, "retry.code"), Some(code));
    }

    // A gRPC call carries the RPC attributes.
    let grpc_backend = tower::service_fn(|_req: Request<_>| async {
        Ok::<_, Infallible>(
            Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", "5")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap(),
        )
    });
    let mut client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .service(grpc_backend);
    let req = Request::post("http://library.example/plume.Library/GetBook")
        .header("content-type", "application/grpc")
        .body(Full::new(Bytes::new()))
        .unwrap();
    client.ready().await.unwrap().call(req).await.unwrap();
    let spans = capture.0.lock().unwrap().spans.clone();
    let call = spans
        .iter()
        .find(|s| s.name == "retry_layer.call" && s.fields.contains_key("rpc.system"))
        .expect("a gRPC call span");
    assert_eq!(field(call, "rpc.system"), Some("grpc"));
    assert_eq!(field(call, "rpc.service"), Some("plume.Library"));
    assert_eq!(field(call, "rpc.method"), Some("GetBook"));
    assert_eq!(field(call, "rpc.grpc.status_code"), Some("5"));
    let attempt = spans
        .iter()
        .find(|s| s.name == "retry_layer.attempt" && s.parent == Some(call.id))
        .expect("a gRPC attempt span");
    assert_eq!(field(attempt, "rpc.grpc.status_code"), Some("5"));
    assert_eq!(field(attempt, "retry.code"), Some("NOT_FOUND"));

    // Give-ups: each at DEBUG, and at most one WARN summary per 10 s per layer.
    let layer = RetryLayer::new(RetryPolicy::builder().max_attempts(1).build().unwrap());
    let mut client = ServiceBuilder::new().layer(layer).service(flaky(u32::MAX));
    let warnings = || {
        capture
            .0
            .lock()
            .unwrap()
            .events
            .iter()
            .filter(|e| e.level == tracing::Level::WARN)
            .cloned()
            .collect::<Vec<_>>()
    };
    for _ in 0..3 {
        let req = Request::get("http://orders.example/orders/1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = client.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let warned = warnings();
    assert_eq!(
        warned.len(),
        1,
        "one summary for three give-ups: {warned:#?}"
    );
    assert_eq!(
        warned[0].fields.get("gave_up").map(String::as_str),
        Some("1")
    );
    let debug_give_ups = capture
        .0
        .lock()
        .unwrap()
        .events
        .iter()
        .filter(|e| {
            e.level == tracing::Level::DEBUG
                && e.fields.get("message").map(String::as_str) == Some("giving up: no attempt left")
        })
        .count();
    assert_eq!(debug_give_ups, 3);

    tokio::time::advance(std::time::Duration::from_secs(10)).await;
    let req = Request::get("http://orders.example/orders/1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    client.ready().await.unwrap().call(req).await.unwrap();
    let warned = warnings();
    assert_eq!(warned.len(), 2, "a new period, a new summary: {warned:#?}");
    assert_eq!(
        warned[1].fields.get("gave_up").map(String::as_str),
        Some("3"),
        "the summary counts the give-ups since the last one"
    );
}

//! The write flow's own tests: what it reads, and the size of what it allocates.

use std::convert::Infallible;

use http_body_util::Full;
use tower::{service_fn, Layer};

use super::*;
use crate::layer::IdempotencyLayer;
use crate::store::MemoryStore;

async fn created(
    _: Request<RequestBody<Full<Bytes>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"{}"))))
}

fn frames(frames: Vec<http_body::Frame<Bytes>>) -> impl Body<Data = Bytes, Error = Infallible> {
    http_body_util::StreamBody::new(futures_util::stream::iter(
        frames.into_iter().map(Ok::<_, Infallible>),
    ))
}

/// The size of what `f` returns: a future's, with no instance made (no store to connect).
fn returned_size<A, B, C, R>(_: fn(A, B, C) -> R) -> usize {
    std::mem::size_of::<R>()
}

/// The body read for the fingerprint: every data frame in order, trailers left out, one
/// frame taken as it is (the same bytes, not a copy), and a body over the limit refused.
#[tokio::test]
async fn the_request_body_is_read_whole() {
    use http_body::Frame;
    let one = Bytes::from_static(b"{\"sku\":\"b1\"}");
    let read = read_whole(frames(vec![Frame::data(one.clone())]), 64, None, || ())
        .await
        .unwrap();
    assert_eq!(read, one);
    assert_eq!(read.as_ptr(), one.as_ptr(), "one frame is not copied");

    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
    let many = vec![
        Frame::data(Bytes::new()),
        Frame::data(Bytes::from_static(b"ab")),
        Frame::data(Bytes::new()),
        Frame::data(Bytes::from_static(b"cd")),
        Frame::data(Bytes::from_static(b"e")),
        Frame::trailers(trailers),
    ];
    assert_eq!(
        read_whole(frames(many), 64, None, || ()).await.unwrap(),
        "abcde"
    );
    assert_eq!(
        read_whole(frames(vec![]), 64, None, || ()).await.unwrap(),
        ""
    );

    let big = vec![
        Frame::data(Bytes::from_static(b"abc")),
        Frame::data(Bytes::from_static(b"def")),
    ];
    let err = read_whole(frames(big), 5, None, || ()).await.unwrap_err();
    assert!(err.is::<LengthLimitError>(), "{err}");
}

/// Every write's future is boxed once and moved and polled on every request, and every
/// response the layer answers is moved through the stack above it: both stay small. (The
/// write's future was 3.5 KB while the handler's call was inline in it, and a recording
/// response's body some hundreds of bytes while the recorder was.)
#[test]
fn the_write_future_and_the_response_body_stay_small() {
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(created));
    let write = Write {
        inner: Inner::Ready(svc.inner),
        store: svc.store.clone(),
        config: svc.config.clone(),
        shared: svc.shared.clone(),
        scope: ScopeKey([0; 32]),
        tenant: TenantKey::default(),
        protocol: Protocol::of(&http::HeaderMap::new()),
        grpc_timeout: None,
        span: Span::none(),
    };
    let (parts, body) = Request::post("/orders")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
        .into_parts();
    // What `Idempotency::call` boxes: the write's flow, instrumented with its span. Within
    // glibc's tcache (blocks up to 1 032 bytes) with room to spare: at 1 032 bytes it went to
    // the allocator's slow path on every write (+170 instructions per request, callgrind).
    let boxed = tracing::Instrument::instrument(write.handle(parts, body), Span::none());
    let size = std::mem::size_of_val(&boxed);
    assert!(size <= 1024, "the write's boxed future is {size} bytes");
    // With a plain `service_fn` handler, on every store, within tcache's own bound (this
    // test's debug build lays the future out a little larger than a release build: 1 032
    // bytes against 1 024). The shared stores' `begin` boxes its round trip, so a near-cache
    // hit (no round trip) does not pay for one in its size (2 552 bytes on Redis while it did).
    type Handler = tower::util::ServiceFn<
        fn(
            Request<RequestBody<Full<Bytes>>>,
        ) -> std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>,
    >;
    fn write_future_size<St: IdempotencyStore>() -> usize {
        returned_size(Write::<Handler, St>::handle::<Full<Bytes>, Full<Bytes>>)
            + std::mem::size_of::<Span>()
    }
    #[cfg(feature = "redis")]
    {
        let size = write_future_size::<crate::RedisStore>();
        assert!(
            size <= 1032,
            "the write's boxed future on Redis is {size} bytes"
        );
    }
    #[cfg(feature = "postgres")]
    {
        let size = write_future_size::<crate::PostgresStore>();
        assert!(
            size <= 1032,
            "the write's boxed future on PostgreSQL is {size} bytes"
        );
    }
    let size = write_future_size::<MemoryStore>();
    assert!(size <= 1032, "the write's boxed future is {size} bytes");
    let body = std::mem::size_of::<IdempotencyBody<Full<Bytes>>>();
    assert!(body <= 48, "the response body is {body} bytes");
    // The leader's call and recording, boxed once per first execution: within the
    // allocator's per-thread cache (glibc's tcache serves blocks up to 1 032 bytes; it was
    // 1 480 bytes while the request sat both in the call and in the `.await` beside it).
    // 784 since the handler runs as an `InboundWrite` (its scope, kept in the task-local's
    // slot: 40 bytes, cheaper than allocating it apart; see BENCHMARKS.md).
    fn returned<A, B, C, D, E, F, G, R>(_: fn(A, B, C, D, E, F, G) -> R) -> usize {
        std::mem::size_of::<R>()
    }
    fn call_and_record_size<S>(_: &S) -> usize
    where
        S: Service<Request<RequestBody<Full<Bytes>>>, Response = Response<Full<Bytes>>>,
    {
        returned(call_and_record::<S, Full<Bytes>, Full<Bytes>>)
    }
    let run = call_and_record_size(&service_fn(created));
    assert!(run <= 800, "the leader's call and recording is {run} bytes");
}

/// A first execution's completion (the store operation and what follows a refusal), boxed once
/// per write: within glibc's tcache with room to spare. It was 1 040 bytes while it captured
/// the `Record` itself beside the `Arc` it makes of it, and each write then took the
/// allocator's slow path (about 630 instructions per first execution, callgrind).
#[tokio::test]
async fn the_completion_future_stays_small() {
    let svc = IdempotencyLayer::new(MemoryStore::new()).layer(service_fn(created));
    let claim = Claim::new(
        svc.store.clone(),
        ScopeKey([1; 32]),
        crate::store::Token(1),
        &svc.config,
        &svc.shared,
    );
    let record = crate::store::Record::new(
        crate::store::Fingerprint([0; 32]),
        http::StatusCode::CREATED,
        http::HeaderMap::new(),
        Bytes::from_static(b"{}"),
    );
    let completion = claim.complete(record);
    let size = std::mem::size_of_val(&*completion);
    assert!(size <= 960, "the completion's boxed future is {size} bytes");
    // On the shared stores too, within tcache's bound: their `complete` boxes its round trip
    // (the completion was 3 KB on Redis while it did not), and `within_lease` holds the store's
    // operation once (an `async fn` held it twice).
    fn completion_size<St: IdempotencyStore>() -> usize {
        returned_size(claim::completion::<St>)
    }
    assert_eq!(completion_size::<MemoryStore>(), size);
    #[cfg(feature = "redis")]
    {
        let size = completion_size::<crate::RedisStore>();
        assert!(size <= 1032, "the completion on Redis is {size} bytes");
    }
    #[cfg(feature = "postgres")]
    {
        let size = completion_size::<crate::PostgresStore>();
        assert!(size <= 1032, "the completion on PostgreSQL is {size} bytes");
    }
}

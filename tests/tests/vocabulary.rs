//! One vocabulary: the same string declares the same gRPC methods idempotent on the client
//! (`RetryPolicyBuilder::idempotent_grpc_methods`) and on the server
//! (`IdempotencyLayer::idempotent_grpc_methods`), both taking `reason_code::GrpcMethods`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use idempotency_layer::{IdempotencyLayer, MemoryStore, RequestBody};
use reason_code::GrpcMethods;
use retry_layer::{ReplayBody, RetryInfo, RetryLayer, RetryPolicy};
use tower::{Layer, ServiceExt};

/// A whole service, and one method of it.
const WHOLE_SERVICE: &str = "/plume.linkd.v3.Library/";
const GET_BOOK: &str = "/plume.linkd.v3.Library/GetBook";

/// (declaration, called method, declared idempotent?)
const CASES: &[(&str, &str, bool)] = &[
    (WHOLE_SERVICE, GET_BOOK, true),
    (WHOLE_SERVICE, "/plume.linkd.v3.Library/CreateOrder", true),
    (WHOLE_SERVICE, "/plume.linkd.v3.Shelf/GetBook", false),
    (GET_BOOK, GET_BOOK, true),
    (GET_BOOK, "/plume.linkd.v3.Library/CreateOrder", false),
    (GET_BOOK, "/plume.linkd.v3.Library/GetBooks", false),
];

fn grpc_call(path: &str) -> Request<Full<Bytes>> {
    Request::post(format!("http://library{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

/// Client side: a declared method is retried after UNAVAILABLE without any idempotency key; an
/// undeclared one is returned after one attempt (it may have executed).
#[tokio::test]
async fn the_client_retries_exactly_the_declared_methods() {
    for &(declared, path, idempotent) in CASES {
        let methods = GrpcMethods::new([declared]).unwrap();
        let policy = RetryPolicy::builder()
            .idempotent_grpc_methods(methods)
            .base_delay(Duration::from_millis(1))
            .build()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let keyed = Arc::new(AtomicUsize::new(0));
        let backend = {
            let (calls, keyed) = (calls.clone(), keyed.clone());
            tower::service_fn(move |req: Request<ReplayBody<Full<Bytes>>>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                if req.headers().contains_key("x-idempotency-key")
                    || req.headers().contains_key("idempotency-key")
                {
                    keyed.fetch_add(1, Ordering::SeqCst);
                }
                // UNAVAILABLE (trailers-only), then OK.
                let status = if n == 0 { "14" } else { "0" };
                async move {
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", status)
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                }
            })
        };
        let svc = RetryLayer::new(policy).layer(backend);
        let res = tokio::time::timeout(Duration::from_secs(10), svc.oneshot(grpc_call(path)))
            .await
            .expect("the call ends")
            .unwrap();
        let case = format!("declared {declared:?}, called {path}");
        let (attempts, grpc_status) = if idempotent { (2, "0") } else { (1, "14") };
        assert_eq!(calls.load(Ordering::SeqCst), attempts, "{case}");
        assert_eq!(RetryInfo::attempts_of(&res), attempts as u32, "{case}");
        assert_eq!(res.headers()["grpc-status"], grpc_status, "{case}");
        assert_eq!(keyed.load(Ordering::SeqCst), 0, "{case}: no key was added");
    }
}

/// Server side: a declared method is a read that passes through to its handler without a key;
/// an undeclared one is a write, refused with INVALID_ARGUMENT before its handler runs.
#[tokio::test]
async fn the_server_passes_exactly_the_declared_methods_without_a_key() {
    for &(declared, path, idempotent) in CASES {
        let methods = GrpcMethods::new([declared]).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let handler = {
            let ran = ran.clone();
            tower::service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
                ran.fetch_add(1, Ordering::SeqCst);
                async move {
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", "0")
                            .body(Full::new(Bytes::new()))
                            .unwrap(),
                    )
                }
            })
        };
        let server = IdempotencyLayer::new(MemoryStore::new())
            .tenant(idempotency_layer::TenantSource::fixed("t"))
            .writes(idempotency_layer::Writes::default().idempotent_grpc_methods(methods))
            .layer(handler);
        let res = tokio::time::timeout(Duration::from_secs(10), server.oneshot(grpc_call(path)))
            .await
            .expect("the call ends")
            .unwrap();
        let case = format!("declared {declared:?}, called {path}");
        let (runs, grpc_status) = if idempotent { (1, "0") } else { (0, "3") };
        assert_eq!(ran.load(Ordering::SeqCst), runs, "{case}");
        assert_eq!(res.headers()["grpc-status"], grpc_status, "{case}");
    }
}

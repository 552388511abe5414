//! A hedge whose request body is not complete when the hedge is due, over real sockets
//! (axum::serve, hyper-util client over HTTP/1.1 and h2c). The hedge module promises that a
//! hedge carries the whole body, and that a request whose body is not complete when a hedge is
//! due is not hedged: no attempt ever reaches the server with part of the body.
//!
//! The body's second half is held until a hedge is surely due: a second call on the same layer,
//! started after the streamed one with the same hedging delay and a whole body, has had its
//! hedge reach the server (the streamed call's hedge timer fired before that one's).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::routing::put;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use retry_layer::hedge::{HedgeLayer, HedgePolicy};
use test_support::net::serve;
use test_support::wait;
use tokio::sync::{mpsc, Semaphore};
use tower::{Layer, ServiceExt};

/// What the server saw of one attempt: the call, the attempt number, the body bytes so far, and
/// whether the body ended.
#[derive(Clone, Debug, Default)]
struct Seen {
    call: String,
    attempt: u32,
    body: Vec<u8>,
    ended: bool,
}

/// The server: `PUT /books/{call}` reads its body frame by frame (noting each in `seen`), then
/// answers once `gate` lets it.
#[derive(Clone)]
struct Server {
    seen: Arc<Mutex<Vec<Seen>>>,
    gate: Arc<Semaphore>,
}

impl Server {
    fn new() -> Self {
        Server {
            seen: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn attempts(&self, call: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|s| s.call == call).cloned().collect()
    }

    fn router(&self) -> Router {
        let server = self.clone();
        Router::new().route(
            "/books/{call}",
            put(move |headers: HeaderMap, req: Request| {
                let server = server.clone();
                async move {
                    let call = req.uri().path().trim_start_matches("/books/").to_owned();
                    let attempt = headers
                        .get("x-previous-attempts")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(0);
                    let i = {
                        let mut seen = server.seen.lock().unwrap();
                        seen.push(Seen {
                            call,
                            attempt,
                            ..Seen::default()
                        });
                        seen.len() - 1
                    };
                    let mut body = req.into_body();
                    while let Some(frame) = body.frame().await {
                        let Ok(frame) = frame else {
                            return (StatusCode::BAD_REQUEST, "the body broke off");
                        };
                        if let Some(data) = frame.data_ref() {
                            server.seen.lock().unwrap()[i].body.extend_from_slice(data);
                        }
                    }
                    server.seen.lock().unwrap()[i].ended = true;
                    server.gate.acquire().await.unwrap().forget();
                    (StatusCode::OK, "stored")
                }
            }),
        )
    }
}

type ClientBody = Either<StreamBody<ChannelFrames>, Full<Bytes>>;

/// A request body fed by the test, one data frame per message.
struct ChannelFrames(mpsc::Receiver<Bytes>);

impl futures_util::Stream for ChannelFrames {
    type Item = Result<Frame<Bytes>, Infallible>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

fn put_request(addr: SocketAddr, call: &str, body: ClientBody) -> http::Request<ClientBody> {
    http::Request::put(format!("http://{addr}/books/{call}"))
        .header("content-type", "application/octet-stream")
        .body(body)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_never_carries_part_of_a_body_that_was_not_complete_when_it_was_due() {
    for http2 in [false, true] {
        let case = if http2 { "HTTP/2" } else { "HTTP/1.1" };
        let server = Server::new();
        let addr = serve(server.router()).await;
        let mut builder =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
        builder.http2_only(http2);
        let client = builder.build_http::<retry_layer::ReplayBody<ClientBody>>();
        let policy = HedgePolicy::builder()
            .max_attempts(2)
            .hedging_delay(Duration::from_millis(20))
            .hedge_writes()
            .budget(retry_layer::budget::RetryBudget::unlimited())
            .build()
            .unwrap();
        let layer = HedgeLayer::new(policy);
        let svc = layer.layer(client);

        // The streamed call: its first half goes out, its second is held.
        let (half, frames) = mpsc::channel(2);
        half.send(Bytes::from_static(b"first half;")).await.unwrap();
        let streamed = tokio::spawn({
            let svc = svc.clone();
            let req = put_request(
                addr,
                "streamed",
                Either::Left(StreamBody::new(ChannelFrames(frames))),
            );
            async move { svc.oneshot(req).await }
        });
        wait::until("the server has the streamed call's first half", || {
            server
                .attempts("streamed")
                .first()
                .is_some_and(|s| s.body == b"first half;")
        })
        .await;

        // A call with a whole body, started after it with the same delay: its hedge reaches the
        // server, so the streamed call's hedge was due before, with half of its body.
        let control = tokio::spawn({
            let svc = svc.clone();
            let req = put_request(
                addr,
                "control",
                Either::Right(Full::new(Bytes::from_static(b"whole"))),
            );
            async move { svc.oneshot(req).await }
        });
        wait::until("the control call is hedged", || {
            server.attempts("control").iter().any(|s| s.attempt == 1)
        })
        .await;

        half.send(Bytes::from_static(b" second half"))
            .await
            .unwrap();
        drop(half);
        // The first attempt's body, and any hedge's, is read to its end before anyone answers.
        wait::until(
            "every attempt of the streamed call has its body at the server",
            || {
                let attempts = server.attempts("streamed");
                attempts.first().is_some_and(|s| s.ended) && attempts.iter().all(|s| s.ended)
            },
        )
        .await;
        server.gate.add_permits(Semaphore::MAX_PERMITS / 2);
        let (streamed, control) = (streamed.await.unwrap(), control.await.unwrap());
        assert_eq!(streamed.expect(case).status(), StatusCode::OK, "{case}");
        assert_eq!(control.expect(case).status(), StatusCode::OK, "{case}");

        // Every attempt of the streamed call carried the whole body: the first, and a hedge if
        // one was sent once the body was whole. None carried half of it as if it were all.
        for a in server.attempts("streamed") {
            assert_eq!(a.body, b"first half; second half", "{case}: {a:?}");
        }
        assert_eq!(layer.stats().requests, 2, "{case}");
    }
}

//! The retry success path as one loop, for instruction counts under callgrind (which counts
//! instructions, not seconds: the same on a loaded machine as on an idle one). `bare`, `tower`
//! (`tower::retry` with the cloning policy a user writes) or `ours` (`RetryLayer` with
//! `RetryPolicy::default()`), each on the retry bench's trivial backend and 1 KiB request; and
//! the same three over gRPC, `grpc_bare`, `grpc_tower` ([`TowerRetryChannel`]) and `grpc_ours`
//! (`RetryLayer::tonic_channel`), a generated client's `CreateOrder` on [`in_process_backend`]
//! (no wire):
//!
//! ```text
//! cargo build --profile bench -p benchmarks --bin retry_profile
//! for w in bare tower ours grpc_bare grpc_tower grpc_ours; do
//!   valgrind --tool=callgrind --callgrind-out-file=cg.$w target/release/retry_profile $w 20000
//! done
//! callgrind_annotate --inclusive=yes cg.ours | head -80
//! ```
//!
//! Instructions per call = (total - the `bare` or `grpc_bare` total) / calls; see
//! BENCHMARKS.md.

use benchmarks::grpc::{create_order_on, in_process_backend, TowerRetryChannel};
use benchmarks::retry::{drive, ok, CloneOn503};
use bytes::Bytes;
use retry_layer::{RetryLayer, RetryPolicy};
use tower::{service_fn, Layer};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let calls: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().expect("calls: a number"))
        .unwrap_or(20_000);
    let body = Bytes::from(vec![b'x'; 1024]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        match which.as_str() {
            "ours" => {
                let mut svc = RetryLayer::new(RetryPolicy::default()).layer(service_fn(ok));
                for _ in 0..calls {
                    drive(&mut svc, &body).await;
                }
            }
            "tower" => {
                let mut svc = tower::retry::RetryLayer::new(CloneOn503(2)).layer(service_fn(ok));
                for _ in 0..calls {
                    drive(&mut svc, &body).await;
                }
            }
            "bare" => {
                let mut svc = service_fn(ok);
                for _ in 0..calls {
                    drive(&mut svc, &body).await;
                }
            }
            "grpc_bare" => {
                let svc = in_process_backend();
                for _ in 0..calls {
                    assert!(create_order_on(svc.clone(), "order-7f3a9c21-5b1e").await);
                }
            }
            "grpc_tower" => {
                let svc = TowerRetryChannel::new(in_process_backend());
                for _ in 0..calls {
                    assert!(create_order_on(svc.clone(), "order-7f3a9c21-5b1e").await);
                }
            }
            "grpc_ours" => {
                let layer = RetryLayer::new(RetryPolicy::default());
                let svc = layer.tonic_channel(in_process_backend());
                for _ in 0..calls {
                    assert!(create_order_on(svc.clone(), "order-7f3a9c21-5b1e").await);
                }
            }
            other => panic!(
                "usage: retry_profile bare|tower|ours|grpc_bare|grpc_tower|grpc_ours [calls], \
                 not {other:?}"
            ),
        }
    });
}

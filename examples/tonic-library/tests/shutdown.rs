//! A rolling deploy's SIGTERM between a write's side effect and its record, over gRPC:
//! `library-server` drains (new writes refused, the write in flight finishes and stores its
//! record) before it exits, so the client gets its answer, and its retry on the server started
//! next on the same shared store (Redis, `REDIS_URL`) is the replay: one order, executed once.
//!
//! Unset `REDIS_URL`: the test says so and passes, except with `IDEMPOTENCY_TESTS_STRICT` set, where it fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use test_support::process::ServerProcess;

struct Server {
    process: ServerProcess,
    url: String,
    metrics: SocketAddr,
}

/// A port free at the time of asking, for the metrics listener.
fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

impl Server {
    fn start(store: &str) -> Server {
        let metrics = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_library-server"));
        cmd.args(["--listen", "127.0.0.1:0", "--store", store])
            .args(["--metrics-listen", &metrics.to_string()])
            // Each order takes 2 s: long enough to send SIGTERM while it runs.
            .args(["--work-ms", "2000", "--shutdown-grace-ms", "20000"]);
        let process = ServerProcess::start(cmd);
        let url = process.url();
        Server {
            process,
            url,
            metrics,
        }
    }

    /// Whether the idempotency layer holds a write in flight (its `/metrics` gauge).
    fn write_in_flight(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(self.metrics) else {
            return false;
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = write!(s, "GET /metrics HTTP/1.0\r\nhost: {}\r\n\r\n", self.metrics);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("idempotency_layer_in_flight 1")
    }

    fn sigterm(&self) {
        self.process.signal("-TERM");
    }

    /// Waits (at most 30 s) for the process to end by itself.
    fn wait_for_exit(&mut self) -> std::process::ExitStatus {
        self.process.wait_for_exit(Duration::from_secs(30))
    }
}

fn create_order(url: &str, key: &str) -> (bool, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_library-client"))
        .args(["--url", url, "--key", key])
        .args(["create-order", "--book", "b1", "--quantity", "1"])
        .output()
        .expect("library-client runs");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout.lines().next().expect("a JSON line");
    (out.status.success(), serde_json::from_str(line).unwrap())
}

fn redis_url() -> Option<String> {
    test_support::env::env_url("REDIS_URL")
}

#[test]
fn sigterm_mid_handler_drains_and_the_retry_replays() {
    let Some(store) = redis_url() else {
        return;
    };
    let key = format!("grpc-sigterm-{}", uuid::Uuid::new_v4());
    let mut server = Server::start(&store);
    let first = {
        let (url, key) = (server.url.clone(), key.clone());
        std::thread::spawn(move || create_order(&url, &key))
    };
    // SIGTERM once the handler runs (the layer holds its claim), not on a timer.
    let give_up = Instant::now() + Duration::from_secs(20);
    while !server.write_in_flight() {
        assert!(Instant::now() < give_up, "the order never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    server.sigterm();
    let (ok, first) = first.join().unwrap();
    assert!(ok, "the order in flight is answered: {first}");
    assert!(
        server.wait_for_exit().success(),
        "a clean exit after the drain"
    );

    let server = Server::start(&store);
    let (ok, retry) = create_order(&server.url, &key);
    assert!(ok, "{retry}");
    assert_eq!(
        retry["order_id"], first["order_id"],
        "the retry is the replay of the order that ran before the shutdown"
    );
}

//! The binaries as the README runs them: `orders-server` prints its address, `orders-client`
//! prints one JSON line per order, and a repeated key executes once.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server() -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_orders-server"))
        .args(["--listen", "127.0.0.1:0", "--work-ms", "50"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("orders-server starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    (Server(child), url)
}

/// Runs `orders-client`; returns whether it succeeded and its stdout lines, raw and parsed.
fn client_raw(url: &str, args: &[&str]) -> (bool, Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_orders-client"))
        .args(["--url", url])
        .args(args)
        .output()
        .expect("orders-client runs");
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    (out.status.success(), lines)
}

fn client(url: &str, args: &[&str]) -> (bool, Vec<serde_json::Value>) {
    let (ok, raw) = client_raw(url, args);
    let lines = raw
        .iter()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    (ok, lines)
}

#[test]
fn a_repeated_key_creates_one_order_and_fresh_keys_create_one_each() {
    let (_server, url) = start_server();

    let (ok, lines) = client(
        &url,
        &[
            "--key",
            "demo-key-0001",
            "--count",
            "5",
            "--concurrency",
            "5",
            "create",
            "--book",
            "b1",
            "--quantity",
            "2",
        ],
    );
    assert!(ok);
    assert_eq!(lines.len(), 5);
    let first = &lines[0];
    for l in &lines {
        assert_eq!(l["status"], 201);
        assert_eq!(
            l["order_id"], first["order_id"],
            "duplicates get the recorded response"
        );
        assert_eq!(l["key"], "demo-key-0001");
        assert_eq!(l["attempts"], 1);
    }

    let (ok, lines) = client(
        &url,
        &["--count", "3", "create", "--book", "b2", "--quantity", "1"],
    );
    assert!(ok);
    let ids: std::collections::HashSet<_> =
        lines.iter().map(|l| l["order_id"].to_string()).collect();
    assert_eq!(ids.len(), 3, "a generated key per order");
    assert!(lines.iter().all(|l| l["key"].as_str().unwrap().len() == 36));

    // The fields come in the documented order.
    let (_, raw) = client_raw(&url, &["create", "--book", "b3", "--quantity", "1"]);
    assert!(
        raw[0].starts_with("{\"status\":201,\"order_id\":\""),
        "{}",
        raw[0]
    );
    assert!(raw[0].contains("\"attempts\":1,\"key\":\""), "{}", raw[0]);
}

#[test]
fn a_client_exits_non_zero_when_an_order_fails() {
    let (_server, url) = start_server();
    let (ok, lines) = client(&url, &["create", "--book", "nope", "--quantity", "1"]);
    assert!(!ok);
    assert_eq!(lines[0]["status"], 404);
}

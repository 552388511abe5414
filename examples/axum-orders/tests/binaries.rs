//! The binaries as the README runs them: `orders-server` prints its address, `orders-client`
//! prints one JSON line per order, and a repeated key executes once.

use std::process::Command;

use test_support::process::ServerProcess;

fn start_server() -> (ServerProcess, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_orders-server"));
    cmd.args(["--listen", "127.0.0.1:0", "--work-ms", "50"]);
    let server = ServerProcess::start(cmd);
    let url = server.url();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    (server, url)
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

/// The server's side-effect counters, as `orders-client stats` prints them.
fn stats(url: &str) -> serde_json::Value {
    let (ok, lines) = client(url, &["stats"]);
    assert!(ok, "{lines:?}");
    lines[0].clone()
}

#[test]
fn a_repeated_deduction_key_deducts_once() {
    let (_server, url) = start_server();
    let args = [
        "--key",
        "deduct-key-0001",
        "--count",
        "4",
        "--concurrency",
        "4",
        "deduct",
        "--book",
        "b1",
        "--quantity",
        "3",
    ];
    let (ok, lines) = client(&url, &args);
    assert!(ok, "{lines:?}");
    assert_eq!(lines.len(), 4);
    for l in &lines {
        assert_eq!(l["status"], 200, "{l}");
        assert_eq!(
            l["remaining"],
            1_000_000 - 3,
            "every duplicate gets the one deduction"
        );
        assert_eq!(l["version"], lines[0]["version"]);
        assert_eq!(l["key"], "deduct-key-0001");
    }
    assert_eq!(stats(&url)["deductions"], 1, "the stock was deducted once");
}

/// The rule for STOCK_CONFLICT: the client does not resend the conflicting write; its
/// rebuild hook re-reads the book's version and rebuilds the deduction from it.
#[test]
fn a_stale_version_is_re_read_and_the_deduction_rebuilt() {
    let (_server, url) = start_server();
    // Another writer moves the book from version 1 to 2.
    let (ok, lines) = client(
        &url,
        &[
            "deduct",
            "--book",
            "b2",
            "--quantity",
            "5",
            "--expected-version",
            "1",
        ],
    );
    assert!(ok, "{lines:?}");
    assert_eq!(lines[0]["version"], 2);

    // A deduction computed from version 1: a conflict, then a rebuild from version 2.
    let (ok, lines) = client(
        &url,
        &[
            "deduct",
            "--book",
            "b2",
            "--quantity",
            "2",
            "--expected-version",
            "1",
        ],
    );
    assert!(ok, "the rebuilt deduction succeeds: {lines:?}");
    let line = &lines[0];
    assert_eq!(line["status"], 200);
    assert_eq!(
        line["attempts"], 2,
        "the conflict, then the rebuilt deduction"
    );
    assert_eq!(line["remaining"], 1_000_000 - 5 - 2);
    assert_eq!(line["version"], 3);
    assert_eq!(stats(&url)["deductions"], 2, "each deduction ran once");
}

#[test]
fn not_enough_stock_is_a_failed_precondition_and_is_not_retried() {
    let (_server, url) = start_server();
    let (ok, lines) = client(&url, &["deduct", "--book", "b3", "--quantity", "2000000"]);
    assert!(!ok);
    assert_eq!(lines[0]["status"], 422, "{lines:?}");
    assert_eq!(lines[0]["attempts"], 1, "a retry would get the same answer");
    assert_eq!(stats(&url)["deductions"], 0);
}

/// A server that accepts connections and never answers: the client's deadline ends the call
/// with an error that names it, instead of waiting forever.
#[test]
fn the_client_gives_up_at_its_deadline_on_a_server_that_never_answers() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let silent = std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().take(8) {
            match conn {
                Ok(conn) => held.push(conn),
                Err(_) => break,
            }
        }
        held
    });
    let (ok, lines) = client(&url, &["create", "--book", "b1", "--quantity", "1"]);
    assert!(!ok);
    let error = lines[0]["error"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(error.contains("deadline"), "{lines:?}");
    drop(silent);
}

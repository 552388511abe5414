//! The binaries as the README runs them: `library-server` prints its address; `library-client`
//! prints one JSON line per call; a repeated key executes once; reads need no key.

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
    let mut child = Command::new(env!("CARGO_BIN_EXE_library-server"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("library-server starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (Server(child), format!("http://{addr}"))
}

fn client(url: &str, args: &[&str]) -> (bool, Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_library-client"))
        .args(["--url", url])
        .args(args)
        .output()
        .expect("library-client runs");
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    (out.status.success(), lines)
}

fn parse(line: &str) -> serde_json::Value {
    serde_json::from_str(line).expect("a JSON object")
}

#[test]
fn create_order_once_per_key_and_get_book() {
    let (_server, url) = start_server();
    let (ok, lines) = client(
        &url,
        &[
            "--key",
            "grpc-key-0001",
            "--count",
            "4",
            "--concurrency",
            "4",
            "create-order",
            "--book",
            "b1",
            "--quantity",
            "1",
        ],
    );
    assert!(ok);
    assert_eq!(lines.len(), 4);
    assert!(
        lines[0].starts_with("{\"status\":0,\"order_id\":\""),
        "{}",
        lines[0]
    );
    let first = parse(&lines[0]);
    for l in &lines {
        let l = parse(l);
        assert_eq!(l["order_id"], first["order_id"]);
        assert_eq!(l["key"], "grpc-key-0001");
    }

    let (ok, lines) = client(&url, &["get-book", "--book", "b1"]);
    assert!(ok);
    let book = parse(&lines[0]);
    assert_eq!(book["stock"], 999_999, "one order of one copy executed");

    // The same key for another request: FAILED_PRECONDITION (9), and a failing exit.
    let (ok, lines) = client(
        &url,
        &[
            "--key",
            "grpc-key-0001",
            "create-order",
            "--book",
            "b2",
            "--quantity",
            "1",
        ],
    );
    assert!(!ok);
    assert_eq!(parse(&lines[0])["status"], 9);
}

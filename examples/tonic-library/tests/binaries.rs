//! The binaries as the README runs them: `library-server` prints its address; `library-client`
//! prints one JSON line per call; a repeated key executes once; reads need no key; a gateway
//! (`library-server --forward-to`) keeps each caller's tenant and key and makes no key; a call
//! has a deadline.

use std::process::Command;

use test_support::process::ServerProcess;

fn start_server() -> (ServerProcess, String) {
    start_server_with(&[])
}

fn start_server_with(args: &[&str]) -> (ServerProcess, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_library-server"));
    cmd.args(["--listen", "127.0.0.1:0"]).args(args);
    let server = ServerProcess::start(cmd);
    let url = server.url();
    (server, url)
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

/// The Library's side-effect counters, as `library-client get-stats` prints them.
fn stats(url: &str) -> serde_json::Value {
    let (ok, lines) = client(url, &["get-stats"]);
    assert!(ok, "{lines:?}");
    parse(&lines[0])
}

#[test]
fn deduct_stock_once_per_key_and_a_stale_version_is_a_conflict() {
    let (_server, url) = start_server();
    let args = [
        "--key",
        "grpc-deduct-0001",
        "--count",
        "3",
        "--concurrency",
        "3",
        "deduct-stock",
        "--book",
        "b1",
        "--quantity",
        "4",
    ];
    let (ok, lines) = client(&url, &args);
    assert!(ok, "{lines:?}");
    for l in &lines {
        let l = parse(l);
        assert_eq!(l["remaining"], 1_000_000 - 4, "{l}");
        assert_eq!(l["version"], 2);
    }
    assert_eq!(stats(&url)["deductions"], 1, "the stock was deducted once");

    // Computed from version 1, the book now at 2: ABORTED (10) with STOCK_CONFLICT, which a
    // client never resends as it was.
    let (ok, lines) = client(
        &url,
        &[
            "deduct-stock",
            "--book",
            "b1",
            "--quantity",
            "1",
            "--expected-version",
            "1",
        ],
    );
    assert!(!ok);
    let line = parse(&lines[0]);
    assert_eq!(line["status"], 10, "{line}");
    assert_eq!(line["reason"], "STOCK_CONFLICT");
    assert_eq!(stats(&url)["deductions"], 1);

    // Not enough stock: FAILED_PRECONDITION (9).
    let (ok, lines) = client(
        &url,
        &["deduct-stock", "--book", "b2", "--quantity", "2000000"],
    );
    assert!(!ok);
    assert_eq!(parse(&lines[0])["status"], 9, "{lines:?}");
}

/// A gateway that forwards the key but not the tenant would scope every
/// caller's key to one tenant below, so two tenants sharing a key get each other's order.
#[test]
fn a_gateway_forwards_the_tenant_with_the_key() {
    let (_library, library_url) = start_server();
    let (_gateway, url) = start_server_with(&["--forward-to", &library_url]);
    let order = |tenant: &str| {
        let (ok, lines) = client(
            &url,
            &[
                "--tenant",
                tenant,
                "--key",
                "shared-key-0001",
                "create-order",
                "--book",
                "b1",
                "--quantity",
                "1",
            ],
        );
        assert!(ok, "{lines:?}");
        parse(&lines[0])["order_id"].as_str().unwrap().to_owned()
    };
    let acme = order("acme");
    let globex = order("globex");
    assert_ne!(acme, globex, "each tenant's key is its own");
    assert_eq!(
        order("acme"),
        acme,
        "a tenant's retry is the replay of its own order"
    );
    assert_eq!(stats(&library_url)["orders_created"], 2);
}

/// A server that accepts connections and never answers: the client's deadline ends the call
/// with DEADLINE_EXCEEDED (4) instead of waiting forever.
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
    let (ok, lines) = client(&url, &["create-order", "--book", "b1", "--quantity", "1"]);
    assert!(!ok);
    assert_eq!(parse(&lines[0])["status"], 4, "{lines:?}");
    drop(silent);
}

/// A gateway keeps its caller's key: a resend with the same key runs once below, whichever key
/// header it came in (`x-idempotency-key` or the IETF draft's `idempotency-key`), and a write
/// without a key is refused with INVALID_ARGUMENT, as the library refuses it. (Before, the
/// gateway's channel made a fresh key for a keyless write on each call, and dropped an
/// `idempotency-key`: each resend through it ran again.)
#[tokio::test]
async fn a_gateway_keeps_the_callers_key_and_makes_none() {
    use tonic_library::pb::library_client::LibraryClient;
    use tonic_library::pb::CreateOrderRequest;

    let (_library, library_url) = start_server();
    let (_gateway, url) = start_server_with(&["--forward-to", &library_url]);
    let channel = tonic::transport::Endpoint::from_shared(url)
        .unwrap()
        .connect()
        .await
        .expect("the gateway answers");
    let mut gateway = LibraryClient::new(channel);
    let order = |header: Option<(&'static str, &'static str)>| {
        let mut req = tonic::Request::new(CreateOrderRequest {
            book_id: "b1".into(),
            quantity: 1,
        });
        req.metadata_mut()
            .insert("x-tenant-id", "acme".parse().unwrap());
        if let Some((name, key)) = header {
            req.metadata_mut().insert(name, key.parse().unwrap());
        }
        req
    };
    for header in [
        ("x-idempotency-key", "gateway-key-0001"),
        ("idempotency-key", "\"gateway-key-0002\""),
    ] {
        let first = gateway.create_order(order(Some(header))).await.unwrap();
        let resent = gateway.create_order(order(Some(header))).await.unwrap();
        assert_eq!(
            first.get_ref().order_id,
            resent.get_ref().order_id,
            "{}: a resend through the gateway is the replay of the first",
            header.0
        );
    }
    let keyless = gateway.create_order(order(None)).await.unwrap_err();
    assert_eq!(keyless.code(), tonic::Code::InvalidArgument, "{keyless:?}");
    assert_eq!(
        stats(&library_url)["orders_created"],
        2,
        "one order per key; the keyless write ran nowhere"
    );
}

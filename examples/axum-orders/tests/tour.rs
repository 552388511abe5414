//! The guide's tour (`docs/guide.md`, "A 30-second tour"), run as the guide shows it against the
//! built binaries: its `curl` commands (each answer's status, the replay header and the JSON body
//! where the guide shows them), the metrics it shows, and its `orders-client` commands (their
//! JSON lines, `…` standing for any value). A change to what a user sees fails here until the
//! guide says it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use serde_json::Value;
use test_support::process::ServerProcess;

const GUIDE: &str = include_str!("../../../docs/guide.md");

/// `orders-server` as the README's first command (which the tour names) starts it (the memory
/// store), on a free port; its address (`127.0.0.1:PORT`).
fn start_server() -> (ServerProcess, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_orders-server"));
    cmd.args(["--listen", "127.0.0.1:0"]);
    let server = ServerProcess::start(cmd);
    let addr = server.addr().to_owned();
    (server, addr)
}

/// The lines of the first block fenced with ```` ```kind ```` after `marker` in the guide.
fn block_after(marker: &str, kind: &str) -> Vec<String> {
    let at = GUIDE
        .find(marker)
        .unwrap_or_else(|| panic!("the guide says {marker:?}"));
    let rest = &GUIDE[at..];
    let fence = format!("```{kind}\n");
    let start = rest.find(&fence).expect("a block") + fence.len();
    let end = rest[start..].find("```").expect("its end") + start;
    rest[start..end].lines().map(str::to_owned).collect()
}

/// A command of a block: its words (shell quoting: `'...'` and `"..."`), the comments on the
/// lines before it, and the comment after it on its own line.
struct Step {
    words: Vec<String>,
    before: String,
    after: Option<String>,
}

fn steps(block: &[String]) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut before = String::new();
    let mut command = String::new();
    for line in block {
        let trimmed = line.trim();
        if command.is_empty() && trimmed.starts_with('#') {
            let text = trimmed.trim_start_matches('#').trim();
            // A comment that starts with an object shows what the command before printed.
            if let Some(previous) = steps.last_mut().filter(|_| text.starts_with('{')) {
                let previous: &mut Step = previous;
                if previous.after.is_none() {
                    previous.after = Some(text.to_owned());
                    continue;
                }
            }
            before.push_str(text);
            before.push(' ');
            continue;
        }
        if trimmed.is_empty() {
            continue;
        }
        command.push_str(trimmed.trim_end_matches('\\'));
        command.push(' ');
        if trimmed.ends_with('\\') {
            continue;
        }
        let (words, after) = split(&command);
        steps.push(Step {
            words,
            before: std::mem::take(&mut before),
            after,
        });
        command.clear();
    }
    steps
}

/// Shell words, and the comment that ends the line (outside quotes).
fn split(line: &str) -> (Vec<String>, Option<String>) {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    word.push(q);
                }
            }
            '#' if !in_word => {
                let comment: String = chars.collect();
                return (words, Some(comment.trim().to_owned()));
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    (words, None)
}

/// An HTTP/1.1 answer: status, headers (lowercase names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

/// Runs a `curl` command of the guide against `addr` (in place of `localhost:3000`).
fn curl(words: &[String], addr: &str) -> Answer {
    assert_eq!(words[0], "curl");
    let (mut method, mut url, mut headers, mut data) = ("GET".to_owned(), None, Vec::new(), None);
    let mut args = words[1..].iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "-i" => {}
            "-X" => method = args.next().expect("-X METHOD").clone(),
            "-H" => headers.push(args.next().expect("-H HEADER").clone()),
            "-d" => data = Some(args.next().expect("-d DATA").clone()),
            other if other.starts_with('-') => panic!("curl flag {other} is not run by this test"),
            other => url = Some(other.to_owned()),
        }
    }
    if data.is_some() && method == "GET" {
        method = "POST".to_owned();
    }
    let url = url.expect("a URL");
    let path = url
        .strip_prefix("localhost:3000")
        .unwrap_or_else(|| panic!("the tour talks to localhost:3000, not {url}"));
    let body = data.unwrap_or_default();
    let mut request = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for h in &headers {
        request.push_str(h);
        request.push_str("\r\n");
    }
    request.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    let mut stream = TcpStream::connect(addr).expect("the server answers");
    stream.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("a text answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a head");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// `actual` against the guide's `expected` JSON, where `…` (quoted or bare) stands for any
/// value.
fn matches(expected: &str, actual: &Value) -> bool {
    let expected = expected.replace("\"…\"", "…").replace('…', "\"…\"");
    let expected: Value = serde_json::from_str(&expected)
        .unwrap_or_else(|e| panic!("the guide's {expected} is not JSON: {e}"));
    fn same(e: &Value, a: &Value) -> bool {
        match (e, a) {
            (Value::String(s), _) if s == "…" => true,
            (Value::Object(e), Value::Object(a)) => {
                e.len() == a.len()
                    && e.iter()
                        .all(|(k, v)| a.get(k).is_some_and(|av| same(v, av)))
            }
            _ => e == a,
        }
    }
    same(&expected, actual)
}

/// The JSON object at the start of a comment (`{...}`, then perhaps words after it).
fn json_in(comment: &str) -> Option<&str> {
    let start = comment.find('{')?;
    let end = comment.rfind('}')?;
    Some(&comment[start..=end])
}

/// Runs `orders-client` with the words after `--` of a guide command, against `url`.
fn orders_client(words: &[String], url: &str) -> Vec<Value> {
    let at = words
        .iter()
        .position(|w| w == "--")
        .expect("cargo run ... -- ARGS");
    assert!(
        words.contains(&"orders-client".to_owned()),
        "only orders-client commands are run here: {words:?}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_orders-client"))
        .args(["--url", url])
        .args(&words[at + 1..])
        .output()
        .expect("orders-client runs");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn the_guide_tour_shows_what_a_user_sees() {
    let (_server, addr) = start_server();
    let url = format!("http://{addr}");

    // The curl tour: the status each comment names, the replay header, the JSON shown.
    let tour = steps(&block_after("## A 30-second tour", "sh"));
    assert!(tour.len() >= 5, "the tour has its curl commands");
    for step in tour.iter().filter(|s| !s.words.is_empty()) {
        let answer = curl(&step.words, &addr);
        let said = &step.before;
        if let Some(status) = said
            .split(|c: char| !c.is_ascii_digit())
            .find(|w| w.len() == 3)
            .and_then(|w| w.parse::<u16>().ok())
        {
            assert_eq!(answer.status, status, "{said}: {}", answer.body);
        }
        if said.contains("idempotent-replayed: true") {
            assert!(
                answer
                    .headers
                    .iter()
                    .any(|(n, v)| n == "idempotent-replayed" && v == "true"),
                "{said}"
            );
        }
        if let Some(shown) = step.after.as_deref().and_then(json_in) {
            let body: Value = serde_json::from_str(&answer.body).expect("a JSON answer");
            assert!(
                matches(shown, &body),
                "the guide shows {shown}, the server answers {body}"
            );
        }
    }

    // The metrics after the tour: every counter line the guide shows (histograms' values are
    // timings, not shown exactly).
    let metrics = steps(&block_after("at `/metrics` for Prometheus", "sh"));
    let answer = curl(&metrics[0].words, &addr);
    for line in block_after("at `/metrics` for Prometheus", "text") {
        if line.trim().is_empty() || line.starts_with('#') || line.contains("_seconds") {
            continue;
        }
        assert!(
            answer.body.lines().any(|l| l.trim() == line.trim()),
            "the guide shows the metric line {line:?}; the server's /metrics:\n{}",
            answer.body
        );
    }

    // The retrying client: each line it prints as the comment after the commands shows.
    for marker in [
        "And the retrying client",
        "A conflict is never resent as it was",
    ] {
        let block = steps(&block_after(marker, "sh"));
        for step in &block {
            let last = orders_client(&step.words, &url);
            assert!(!last.is_empty(), "{:?} printed nothing", step.words);
            if let Some(shown) = step.after.as_deref().and_then(json_in) {
                for line in &last {
                    assert!(
                        matches(shown, line),
                        "the guide shows {shown} after {:?}; the client printed {line}",
                        step.words
                    );
                }
            }
        }
    }
}

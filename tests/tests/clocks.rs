//! Clock jumps: every lease, TTL, deadline, backoff and budget window in the crates runs on a
//! monotonic clock (`tokio::time::Instant`), or on the store server's own clock (Redis
//! `PEXPIRE`, PostgreSQL `now()`), so a wall-clock jump on an instance neither expires records
//! early nor keeps claims alive. This audit fails if a wall-clock or std `Instant` read appears
//! anywhere else in the crates' sources.

use std::path::{Path, PathBuf};

/// Where reading the wall clock is right, and why.
const ALLOWED: &[(&str, &str)] = &[
    // An HTTP-date Retry-After is a wall-clock time by definition; a jump changes one pushback,
    // which max_pushback caps.
    ("retry-layer/src/classify.rs", "SystemTime::now()"),
    // A nonce for store names in the conformance suite, not a time.
    (
        "idempotency-layer/src/conformance/mod.rs",
        "SystemTime::now()",
    ),
];

const WALL_CLOCK: &[&str] = &[
    "SystemTime::now",
    "std::time::Instant",
    "UNIX_EPOCH",
    "chrono::",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The wall-clock reads in one source file `text` (named `rel`), allowed or not: each is
/// `(allowed, "rel:line: code")`. A read is a line naming one of [`WALL_CLOCK`], or a `use` of
/// `std::time` that brings `Instant` in (after `use std::time::{Duration, Instant};`, a plain
/// `Instant::now()` reads the std clock, and names none of them).
fn wall_clock_reads(rel: &str, text: &str) -> Vec<(bool, String)> {
    let mut found = Vec::new();
    // Unit tests (the `#[cfg(test)]` module at the end of a file) may use any clock.
    let lines: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("#[cfg(test)]"))
        .collect();
    let mut n = 0;
    while n < lines.len() {
        let code = lines[n].split("//").next().unwrap_or("");
        // A `use std::time...;` statement, over as many lines as it takes.
        if code.trim_start().starts_with("use std::time") {
            let mut statement = code.to_owned();
            let mut end = n;
            while !statement.contains(';') && end + 1 < lines.len() {
                end += 1;
                statement.push_str(lines[end].split("//").next().unwrap_or(""));
            }
            let brings_instant = statement
                .split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|word| word == "Instant");
            if brings_instant {
                found.push((false, format!("{rel}:{}: {}", n + 1, statement.trim())));
            }
            n = end + 1;
            continue;
        }
        if WALL_CLOCK.iter().any(|w| code.contains(w)) {
            let allowed = ALLOWED
                .iter()
                .any(|(f, what)| rel == *f && code.contains(what));
            found.push((allowed, format!("{rel}:{}: {}", n + 1, lines[n].trim())));
        }
        n += 1;
    }
    found
}

/// The audit itself catches what it is meant to: a grouped import of std's `Instant`, a
/// multi-line one, a path, and the wall clock; it passes `tokio::time::Instant` and a
/// `SystemTime` that is not read.
#[test]
fn the_audit_finds_std_instant_however_it_is_imported() {
    let flagged = |text: &str| wall_clock_reads("x/src/lib.rs", text).len();
    assert_eq!(
        flagged("use std::time::{Duration, Instant};\nfn f() { Instant::now(); }"),
        1
    );
    assert_eq!(
        flagged("use std::time::{\n    Duration,\n    Instant,\n};"),
        1
    );
    assert_eq!(flagged("use std::time::Instant;"), 1);
    assert_eq!(flagged("fn f() { std::time::Instant::now(); }"), 1);
    assert_eq!(flagged("fn f() { std::time::SystemTime::now(); }"), 1);
    assert_eq!(
        flagged("use tokio::time::Instant;\nfn f() { Instant::now(); }"),
        0
    );
    assert_eq!(
        flagged("use std::time::{Duration, SystemTime};\nfn f(_: SystemTime) {}"),
        0
    );
    assert_eq!(
        flagged("fn f() {}\n#[cfg(test)]\nmod tests { use std::time::Instant; }"),
        0
    );
}

#[test]
fn only_monotonic_time_outside_the_allowed_places() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    let mut files = Vec::new();
    for krate in ["reason-code", "retry-layer", "idempotency-layer"] {
        sources(&crates.join(krate).join("src"), &mut files);
    }
    assert!(files.len() > 20, "found the sources: {}", files.len());
    let mut offending = Vec::new();
    let mut allowed_seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a source file");
        let rel = file
            .strip_prefix(&crates)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        for (allowed, read) in wall_clock_reads(&rel, &text) {
            if allowed {
                allowed_seen += 1;
            } else {
                offending.push(read);
            }
        }
    }
    assert!(
        offending.is_empty(),
        "wall-clock reads:\n{}",
        offending.join("\n")
    );
    assert_eq!(allowed_seen, ALLOWED.len(), "the allow-list is up to date");
}

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
    ("idempotency-layer/src/conformance.rs", "SystemTime::now()"),
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
        // Unit tests (the `#[cfg(test)]` module at the end of a file) may use any clock.
        let lines = text.lines().take_while(|l| !l.starts_with("#[cfg(test)]"));
        for (n, line) in lines.enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if !WALL_CLOCK.iter().any(|w| code.contains(w)) {
                continue;
            }
            if ALLOWED
                .iter()
                .any(|(f, what)| rel == *f && code.contains(what))
            {
                allowed_seen += 1;
            } else {
                offending.push(format!("{rel}:{}: {}", n + 1, line.trim()));
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

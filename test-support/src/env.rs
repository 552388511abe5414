//! The real servers the store tests run against, named by environment variables.

/// The URL in `var` (`REDIS_URL`, `DATABASE_URL`, ...), or `None` after printing why the test
/// skips. With `CI` set (`.ci/run` sets it, and every URL), a missing one is a failure instead:
/// libtest hides a passing test's output, so a skip in CI would go unseen.
pub fn env_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{var} is not set, but CI is: .ci/run must set it (the store tests never skip in CI)")
        }
        _ => {
            eprintln!(
                "skipped: {var} is not set; set it (e.g. in .ci/run) to run this test against \
                 a real server"
            );
            None
        }
    }
}

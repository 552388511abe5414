//! The real servers the store tests run against, named by environment variables.

/// The variable that makes a store test fail rather than skip when its server is missing.
/// `.ci/run` sets it (with every URL); it is this project's own, so a user's CI, which sets
/// `CI`, runs the tests it has servers for and skips the others.
pub const STRICT: &str = "IDEMPOTENCY_TESTS_STRICT";

/// Whether a store test must fail rather than skip when its server is missing ([`STRICT`]):
/// libtest hides a passing test's output, so a skip in this project's CI would go unseen.
pub fn strict() -> bool {
    std::env::var_os(STRICT).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The URL in `var` (`REDIS_URL`, `DATABASE_URL`, ...), or `None` after printing why the test
/// skips. With [`STRICT`] set, a missing one is a failure instead.
pub fn env_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ if strict() => {
            panic!("{var} is not set, but {STRICT} is: .ci/run must set it (the store tests never skip in this project's CI)")
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

/// The Sentinels and the master name of a `redis+sentinel://host1:port1,host2:port2/master`
/// URL (`REDIS_SENTINEL_URL`), for tests that talk to the Sentinels themselves (a forced
/// failover): `(["redis://host1:port1", ...], "master")`. A store takes the URL as it is
/// (`RedisStore::builder`).
pub fn sentinel_parts(url: &str) -> Option<(Vec<String>, String)> {
    let rest = url.strip_prefix("redis+sentinel://")?;
    let (hosts, master) = rest.split_once('/')?;
    let master = master.trim_end_matches('/');
    if master.is_empty() {
        return None;
    }
    let sentinels = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| format!("redis://{h}"))
        .collect();
    Some((sentinels, master.to_owned()))
}

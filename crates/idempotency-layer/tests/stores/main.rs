//! The stores' integration tests, one binary: `MemoryStore`, and `RedisStore` (standalone and
//! Cluster, and on a Sentinel-managed primary) and `PostgresStore` against the real servers named
//! by `REDIS_URL`, `REDIS_CLUSTER_URLS`, `REDIS_SENTINEL_URL`, `DATABASE_URL`,
//! `PGBOUNCER_URL` and `PG_REPLICA_URL`. The Redis and PostgreSQL suites share their tests
//! through `support::shared_store_suite!`. Unset URLs: a test says so and passes, except in CI,
//! where it fails.

// The shared stores' helpers (the `conformance` feature is always on for the tests: the crate's
// dev-dependency on itself turns it on).
#[cfg(all(feature = "conformance", any(feature = "redis", feature = "postgres")))]
mod support;

mod memory;
#[cfg(all(feature = "postgres", feature = "conformance"))]
mod pgbouncer;
#[cfg(all(feature = "postgres", feature = "conformance"))]
mod postgres;
#[cfg(all(feature = "postgres", feature = "conformance"))]
mod postgres_replica;
#[cfg(all(feature = "redis-cluster", feature = "conformance"))]
mod proxied_cluster;
#[cfg(all(feature = "redis", feature = "conformance"))]
mod redis;
#[cfg(all(feature = "redis-cluster", feature = "conformance"))]
mod redis_cluster;
#[cfg(all(feature = "redis-cluster", feature = "conformance"))]
mod redis_cluster_cuts;
#[cfg(all(feature = "redis-cluster", feature = "conformance"))]
mod redis_cluster_lost_reply;
#[cfg(all(feature = "redis-sentinel", feature = "conformance"))]
mod redis_sentinel;

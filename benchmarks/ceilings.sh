#!/usr/bin/env bash
# Where the shared stores stop scaling on this machine (BENCHMARKS.md, "Beyond one server"), in
# one run: the load test's Redis scenarios on a Redis Cluster of one master and of three, and its
# PostgreSQL first executions beside pgbench's ceiling for the same work done by hand (two
# commits per write: a claim inserted, then completed), on the same server with as many
# connections. Run from the workspace root with REDIS_URL and DATABASE_URL set; it starts the
# clusters itself (.ci/redis-cluster.sh: ports 7000-7002, and 7010 for the one-master cluster).
set -euo pipefail
ROUNDS="${ROUNDS:-3}"
CONNECTIONS="${CONNECTIONS:-16}"
: "${DATABASE_URL:?DATABASE_URL is not set}"
cargo build --quiet --release -p benchmarks --bin loadtest
loadtest() { target/release/loadtest --connections "$CONNECTIONS" --records 0 --rounds "$ROUNDS" "$@"; }

one="$(REDIS_CLUSTER_PORTS=7010 REDIS_CLUSTER_REPLICA_PORTS="" REDIS_CLUSTER_DIR="${TMPDIR:-/tmp}/idempotency-redis-cluster-1" .ci/redis-cluster.sh)"
three="$(.ci/redis-cluster.sh)"   # three masters, one replica each (as in CI)
echo "== Redis Cluster, one master ($one)"
REDIS_CLUSTER_URLS="$one" loadtest --only no_layers,redis-cluster
echo "== Redis Cluster, three masters ($three)"
REDIS_CLUSTER_URLS="$three" loadtest --only no_layers,redis-cluster

echo "== PostgreSQL: the layer's first executions"
loadtest --only no_layers,postgres/first
echo "== PostgreSQL: pgbench, two commits per write ($CONNECTIONS connections, 10 s)"
psql -X -q "$DATABASE_URL" -c "DROP TABLE IF EXISTS ceiling_claims" \
  -c "CREATE TABLE ceiling_claims (scope bytea PRIMARY KEY, state text NOT NULL, token uuid NOT NULL, fingerprint bytea NOT NULL, expires_at timestamptz NOT NULL, record bytea)"
script="$(mktemp)"
cat > "$script" <<'SQL'
\set k random(1, 2000000000)
INSERT INTO ceiling_claims VALUES (int8send(:k) || int8send(:client_id), 'in_flight', gen_random_uuid(), '\x0707', now() + interval '30 seconds', NULL) ON CONFLICT DO NOTHING;
UPDATE ceiling_claims SET state = 'completed', record = repeat('x', 200)::bytea, expires_at = now() + interval '1 day' WHERE scope = int8send(:k) || int8send(:client_id);
SQL
pgbench -n -c "$CONNECTIONS" -j 2 -T 10 -f "$script" "$DATABASE_URL" | grep -E "^(tps|number of transactions|latency average)"
psql -X -q "$DATABASE_URL" -c "DROP TABLE ceiling_claims"
rm -f "$script"

#!/usr/bin/env bash
# PgBouncer in transaction pooling mode in front of the test PostgreSQL (127.0.0.1:5432), as
# most PostgreSQL deployments run it: on 127.0.0.1:6432, trust auth, database `test`. Installs
# Debian's package if it is missing; does nothing if it already answers. Prints the URL.
set -euo pipefail
PORT="${PGBOUNCER_PORT:-6432}"
URL="postgres://postgres@127.0.0.1:${PORT}/test?pooling=transaction"
if ! command -v pgbouncer >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer) >&2
fi
if ! pg_isready -h 127.0.0.1 -p "$PORT" >/dev/null 2>&1; then
  dir=/tmp/ci-pgbouncer
  mkdir -p "$dir"
  cat > "$dir/pgbouncer.ini" <<INI
[databases]
test = host=127.0.0.1 port=5432 dbname=test

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = ${PORT}
unix_socket_dir =
auth_type = trust
auth_file = ${dir}/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 10
server_idle_timeout = 5
logfile = ${dir}/pgbouncer.log
pidfile = ${dir}/pgbouncer.pid
INI
  echo '"postgres" ""' > "$dir/users.txt"
  chown -R postgres "$dir" 2>/dev/null || true
  if [ "$(id -u)" = 0 ]; then
    su postgres -s /bin/sh -c "pgbouncer -d '$dir/pgbouncer.ini'" >&2
  else
    pgbouncer -d "$dir/pgbouncer.ini" >&2
  fi
  for _ in $(seq 50); do
    pg_isready -h 127.0.0.1 -p "$PORT" >/dev/null 2>&1 && break
    sleep 0.1
  done
fi
echo "$URL"

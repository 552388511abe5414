#!/usr/bin/env bash
# A PostgreSQL primary with one streaming standby on loopback, for the failover tests and the
# `pg-failover` chaos binary: two clusters of this machine's PostgreSQL under $DIR, on ports
# 5433 and 5434 (either may be the primary: a failover promotes the standby), database `test`,
# user postgres, trust auth, no synchronous standby unless a test asks for one
# (`ALTER SYSTEM SET synchronous_standby_names`). Does nothing when a primary answers with a
# streaming standby; rebuilds the standby from the primary when only the primary is healthy
# (after a failover: the old primary comes back as a standby of the new one); builds both from
# scratch when there is no primary. Prints the URL for PG_REPLICA_URL (both hosts, with
# `target_session_attrs=read-write`: a client follows the primary). Used by .ci/run; a developer
# can run it too:
#   export PG_REPLICA_URL=$(.ci/postgres-replica.sh)
# Stop it with: for d in /tmp/idempotency-pg-replica/n*; do pg_ctl -D $d stop -m fast; done
set -euo pipefail

A="${PG_REPLICA_PORT_A:-5433}"
B="${PG_REPLICA_PORT_B:-5434}"
DIR="${PG_REPLICA_DIR:-${TMPDIR:-/tmp}/idempotency-pg-replica}"
url() { echo "postgres://postgres@127.0.0.1:$A,127.0.0.1:$B/test?target_session_attrs=read-write"; }

# The PostgreSQL binaries (initdb and pg_ctl are not on Debian's PATH).
if ! command -v pg_ctl >/dev/null || ! command -v initdb >/dev/null; then
  bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  [ -n "$bin" ] || { echo "no PostgreSQL server binaries on this machine (apt-get install postgresql)" >&2; exit 1; }
  export PATH="$bin:$PATH"
fi

# Runs a command as the postgres user (PostgreSQL refuses to run as root).
as_pg() {
  if [ "$(id -u)" = 0 ]; then
    su postgres -s /bin/sh -c "PATH='$PATH' $*"
  else
    sh -c "$*"
  fi
}
sql() { # port, query: one value, or nothing if the node does not answer
  psql -X -A -t -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2" 2>/dev/null || true
}
role() { # port: primary, standby, or down
  case "$(sql "$1" 'select pg_is_in_recovery()')" in
    f) echo primary ;;
    t) echo standby ;;
    *) echo down ;;
  esac
}
streaming() { # primary port: a standby streams from it
  [ "$(sql "$1" "select count(*) from pg_stat_replication where state = 'streaming'")" -ge 1 ] 2>/dev/null
}
dir_of() { echo "$DIR/n$1"; }
stop() { # port
  local d; d="$(dir_of "$1")"
  [ -f "$d/postmaster.pid" ] && as_pg "pg_ctl -D '$d' stop -m immediate -w" >/dev/null 2>&1 || true
}
start() { # port
  local d; d="$(dir_of "$1")"
  as_pg "pg_ctl -D '$d' -l '$DIR/n$1.log' -w -t 60 start" >/dev/null
}
wait_streaming() { # primary port
  for _ in $(seq 300); do streaming "$1" && return 0; sleep 0.1; done
  echo "no standby streams from 127.0.0.1:$1 (see $DIR/*.log)" >&2
  return 1
}
# Makes the node on $2 a fresh standby of the primary on $1.
standby_of() { # primary port, standby port
  stop "$2"
  rm -rf "$(dir_of "$2")"
  as_pg "pg_basebackup -h 127.0.0.1 -p $1 -U postgres -D '$(dir_of "$2")' -R -X stream -c fast" >&2
  cat >> "$(dir_of "$2")/postgresql.auto.conf" <<CONF
port = $2
primary_conninfo = 'host=127.0.0.1 port=$1 user=postgres application_name=n$2'
CONF
  start "$2"
  wait_streaming "$1"
}

ra="$(role "$A")"; rb="$(role "$B")"
if { [ "$ra" = primary ] && [ "$rb" = standby ] && streaming "$A"; } ||
   { [ "$rb" = primary ] && [ "$ra" = standby ] && streaming "$B"; }; then
  url
  exit 0
fi

mkdir -p "$DIR"
chown postgres "$DIR" 2>/dev/null || true
if [ "$ra" = primary ] && [ "$rb" != primary ]; then
  standby_of "$A" "$B"
elif [ "$rb" = primary ] && [ "$ra" != primary ]; then
  standby_of "$B" "$A"
else
  # No primary (or two, after a promotion with the old primary still up): start over.
  stop "$A"; stop "$B"
  rm -rf "$(dir_of "$A")" "$(dir_of "$B")"
  as_pg "initdb -D '$(dir_of "$A")' -U postgres --auth=trust -E UTF8 --no-sync" >/dev/null
  cat >> "$(dir_of "$A")/postgresql.conf" <<CONF
port = $A
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
wal_level = replica
max_wal_senders = 4
wal_keep_size = '256MB'
hot_standby = on
max_connections = 200
shared_buffers = '64MB'
synchronous_standby_names = ''
CONF
  echo "host replication postgres 127.0.0.1/32 trust" >> "$(dir_of "$A")/pg_hba.conf"
  start "$A"
  sql "$A" "create database test" >/dev/null
  standby_of "$A" "$B"
fi
url

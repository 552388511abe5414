#!/usr/bin/env bash
# Starts a local Sentinel-managed Redis on loopback, unless one is already up: a primary
# (127.0.0.1:6380), one replica (6381) and one Sentinel (26380) watching the master name `idem`
# (down-after-milliseconds 1000, failover-timeout 3000, quorum 1; no persistence; DEBUG allowed from
# loopback: the failover tests put a replica to sleep). Waits until the
# Sentinel names a master that answers and has a replica with its link up, and prints the URL for
# REDIS_SENTINEL_URL. Used by .ci/run; a developer can run it too:
#   export REDIS_SENTINEL_URL=$(.ci/redis-sentinel.sh)
# A failover (the tests and the `failover` chaos binary force some) may leave the primary on 6381:
# any healthy master + replica of `idem` counts as up.
# Stop it with: for p in 26380 6380 6381; do redis-cli -p $p shutdown nosave; done
set -euo pipefail

PRIMARY="${REDIS_SENTINEL_PRIMARY_PORT:-6380}"
REPLICA="${REDIS_SENTINEL_REPLICA_PORT:-6381}"
SENTINEL="${REDIS_SENTINEL_PORT:-26380}"
NAME="${REDIS_SENTINEL_MASTER:-idem}"
DIR="${REDIS_SENTINEL_DIR:-${TMPDIR:-/tmp}/idempotency-redis-sentinel}"
url() { echo "redis+sentinel://127.0.0.1:$SENTINEL/$NAME"; }

# The port of the master the Sentinel names, if that master answers as a master with a replica
# whose link is up.
healthy() {
  local port
  port="$(redis-cli -p "$SENTINEL" sentinel get-master-addr-by-name "$NAME" 2>/dev/null | tr -d '\r' | sed -n 2p)"
  [ -n "$port" ] || return 1
  local info
  info="$(redis-cli -p "$port" info replication 2>/dev/null | tr -d '\r')" || return 1
  grep -q '^role:master$' <<<"$info" || return 1
  grep -q '^slave[0-9]*:.*state=online' <<<"$info" || return 1
  # The Sentinel must know the replica too (it is what it promotes).
  [ "$(redis-cli -p "$SENTINEL" sentinel master "$NAME" 2>/dev/null | tr -d '\r' | sed -n '/^num-slaves$/{n;p}')" -ge 1 ] 2>/dev/null
}

if healthy; then
  url
  exit 0
fi

mkdir -p "$DIR"
start() { # port, extra args...
  local p="$1"; shift
  if ! redis-cli -p "$p" ping >/dev/null 2>&1; then
    redis-server --port "$p" --bind 127.0.0.1 --daemonize yes --save "" --appendonly no \
      --enable-debug-command local --dir "$DIR" --logfile "$DIR/redis-$p.log" "$@" >&2
  fi
  for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis on port $p did not start (see $DIR/redis-$p.log)" >&2
  return 1
}

# Which data node is the master now: the one the Sentinel names if it runs, else the primary.
master="$(redis-cli -p "$SENTINEL" sentinel get-master-addr-by-name "$NAME" 2>/dev/null | tr -d '\r' | sed -n 2p || true)"
master="${master:-$PRIMARY}"
if [ "$master" != "$PRIMARY" ] && [ "$master" != "$REPLICA" ]; then master="$PRIMARY"; fi
other=$([ "$master" = "$PRIMARY" ] && echo "$REPLICA" || echo "$PRIMARY")
start "$master"
start "$other" --replicaof 127.0.0.1 "$master"
# A master left as a replica of a dead node (or a replica of nothing) is put right.
[ "$(redis-cli -p "$master" info replication | tr -d '\r' | sed -n 's/^role://p')" = master ] ||
  redis-cli -p "$master" replicaof no one >/dev/null
[ "$(redis-cli -p "$other" info replication | tr -d '\r' | sed -n 's/^master_port://p')" = "$master" ] ||
  redis-cli -p "$other" replicaof 127.0.0.1 "$master" >/dev/null

if ! redis-cli -p "$SENTINEL" ping >/dev/null 2>&1; then
  # The Sentinel rewrites its config file: a fresh one each start.
  cat >"$DIR/sentinel.conf" <<EOF
port $SENTINEL
bind 127.0.0.1
daemonize yes
dir $DIR
logfile $DIR/sentinel.log
sentinel monitor $NAME 127.0.0.1 $master 1
sentinel down-after-milliseconds $NAME 1000
sentinel failover-timeout $NAME 3000
sentinel parallel-syncs $NAME 1
EOF
  redis-server "$DIR/sentinel.conf" --sentinel >&2
fi

for _ in $(seq 200); do
  if healthy; then url; exit 0; fi
  sleep 0.1
done
echo "redis sentinel on port $SENTINEL: no healthy master + replica of $NAME (see $DIR/*.log)" >&2
exit 1

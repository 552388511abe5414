#!/usr/bin/env bash
# Starts a local Redis Cluster on loopback: 3 masters (ports 7000-7002), each with one replica
# (7003-7005), no persistence, unless one is already up with that shape. REDIS_CLUSTER_PORTS
# names the masters and REDIS_CLUSTER_REPLICA_PORTS their replicas (empty: none;
# REDIS_CLUSTER_PORTS="7010" REDIS_CLUSTER_REPLICA_PORTS="" makes a one-master cluster, as
# BENCHMARKS.md's "Beyond one server" compares). Waits for `cluster_state:ok` and for every
# replica to be in sync, then prints the masters' URLs for REDIS_CLUSTER_URLS (the replicas are
# found through `CLUSTER SLOTS`). Used by .ci/run; a developer can run it too:
#   export REDIS_CLUSTER_URLS=$(.ci/redis-cluster.sh)
# Stop it with: for p in 7000 7001 7002 7003 7004 7005; do redis-cli -p $p shutdown nosave; done
set -euo pipefail

MASTERS=(${REDIS_CLUSTER_PORTS:-7000 7001 7002})
REPLICAS=(${REDIS_CLUSTER_REPLICA_PORTS-7003 7004 7005})
PORTS=("${MASTERS[@]}" ${REPLICAS[@]+"${REPLICAS[@]}"})
if [ "${#REPLICAS[@]}" != 0 ] && [ "${#REPLICAS[@]}" != "${#MASTERS[@]}" ]; then
  echo "REDIS_CLUSTER_REPLICA_PORTS names one replica per master, or none" >&2
  exit 1
fi
DIR="${REDIS_CLUSTER_DIR:-${TMPDIR:-/tmp}/idempotency-redis-cluster}"
# redis-cli, bounded: a node left stopped (SIGSTOP) must not hang the script.
rc() { timeout 5 redis-cli "$@"; }
urls() { local IFS=,; local u=(); for p in "${MASTERS[@]}"; do u+=("redis://127.0.0.1:$p"); done; echo "${u[*]}"; }
field() { # port, section, field
  rc -p "$1" $2 2>/dev/null | tr -d '\r' | sed -n "s/^$3://p" || true
}
state() { field "$1" "cluster info" cluster_state; }
# The whole cluster as asked for: every node sees every other and every slot served, and each
# replica follows its own master (by port) with its link up.
healthy() {
  local p i
  for p in "${PORTS[@]}"; do
    [ "$(state "$p")" = ok ] && [ "$(field "$p" "cluster info" cluster_known_nodes)" = "${#PORTS[@]}" ] || return 1
  done
  for i in ${REPLICAS[@]+"${!REPLICAS[@]}"}; do
    p="${REPLICAS[$i]}"
    [ "$(field "$p" "info replication" role)" = slave ] &&
      [ "$(field "$p" "info replication" master_port)" = "${MASTERS[$i]}" ] &&
      [ "$(field "$p" "info replication" master_link_status)" = up ] || return 1
  done
}

if healthy; then
  urls
  exit 0
fi

mkdir -p "$DIR"
for p in "${PORTS[@]}"; do
  if ! rc -p "$p" ping >/dev/null 2>&1; then
    # A fresh node each time: stale nodes.conf from a previous run would name old node ids.
    rm -f "$DIR/nodes-$p.conf"
    redis-server --port "$p" --cluster-enabled yes --cluster-config-file "$DIR/nodes-$p.conf" \
      --cluster-node-timeout 5000 --daemonize yes --save "" --appendonly no \
      --bind 127.0.0.1 --dir "$DIR" --logfile "$DIR/redis-$p.log" >&2
  fi
done
for p in "${PORTS[@]}"; do
  for _ in $(seq 50); do rc -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done

# Anything else (a half-made cluster, a node restarted empty, roles swapped by a failover) is
# reset and made again.
for p in "${PORTS[@]}"; do
  rc -p "$p" flushall >/dev/null 2>&1 || true
  rc -p "$p" cluster reset hard >/dev/null
done
nodes=(); for p in "${MASTERS[@]}"; do nodes+=("127.0.0.1:$p"); done
if [ "${#MASTERS[@]}" = 1 ]; then
  # `--cluster create` wants three masters; one node takes every slot itself.
  rc -p "${MASTERS[0]}" cluster addslotsrange 0 16383 >/dev/null
else
  timeout 60 redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >&2
fi
# Each replica joins and follows its master by node id (`--cluster create` would pair them as it
# likes; here the pairs are the ports' order).
for i in ${REPLICAS[@]+"${!REPLICAS[@]}"}; do
  m="${MASTERS[$i]}"; r="${REPLICAS[$i]}"
  rc -p "$r" cluster meet 127.0.0.1 "$m" >/dev/null
  id="$(rc -p "$m" cluster myid | tr -d '\r')"
  for _ in $(seq 100); do
    rc -p "$r" cluster replicate "$id" 2>/dev/null | grep -q OK && break
    sleep 0.1
  done
done

for _ in $(seq 300); do
  if healthy; then urls; exit 0; fi
  sleep 0.1
done
echo "redis cluster on ports ${PORTS[*]} did not reach cluster_state:ok with every replica in sync" >&2
exit 1

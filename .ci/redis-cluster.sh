#!/usr/bin/env bash
# Starts a local 3-master Redis Cluster on loopback (ports 7000-7002, no replicas, no
# persistence), unless one is already up (REDIS_CLUSTER_PORTS="7010" makes a one-master cluster,
# as BENCHMARKS.md's "Beyond one server" compares); waits for `cluster_state:ok` and prints the node URLs
# for REDIS_CLUSTER_URLS. Used by .ci/run; a developer can run it too:
#   export REDIS_CLUSTER_URLS=$(.ci/redis-cluster.sh)
# Stop it with: for p in 7000 7001 7002; do redis-cli -p $p shutdown nosave; done
set -euo pipefail

PORTS=(${REDIS_CLUSTER_PORTS:-7000 7001 7002})
DIR="${REDIS_CLUSTER_DIR:-${TMPDIR:-/tmp}/idempotency-redis-cluster}"
urls() { local IFS=,; local u=(); for p in "${PORTS[@]}"; do u+=("redis://127.0.0.1:$p"); done; echo "${u[*]}"; }
state() { redis-cli -p "$1" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p'; }

if [ "$(state "${PORTS[0]}")" = ok ]; then
  urls
  exit 0
fi

mkdir -p "$DIR"
for p in "${PORTS[@]}"; do
  if ! redis-cli -p "$p" ping >/dev/null 2>&1; then
    # A fresh node each time: stale nodes.conf from a previous run would name old node ids.
    rm -f "$DIR/nodes-$p.conf"
    redis-server --port "$p" --cluster-enabled yes --cluster-config-file "$DIR/nodes-$p.conf" \
      --cluster-node-timeout 5000 --daemonize yes --save "" --appendonly no \
      --bind 127.0.0.1 --dir "$DIR" --logfile "$DIR/redis-$p.log" >&2
  fi
done
for p in "${PORTS[@]}"; do
  for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done

# Assign the slots unless some node already knows of the others (a half-made cluster is reset).
info() { redis-cli -p "${PORTS[0]}" cluster info | tr -d '\r' | sed -n "s/^$1://p"; }
if [ "$(info cluster_known_nodes)" != "${#PORTS[@]}" ] || [ "$(info cluster_slots_assigned)" != 16384 ]; then
  for p in "${PORTS[@]}"; do redis-cli -p "$p" flushall >/dev/null; redis-cli -p "$p" cluster reset hard >/dev/null; done
  nodes=(); for p in "${PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
  if [ "${#PORTS[@]}" = 1 ]; then
    # `--cluster create` wants three masters; one node takes every slot itself.
    redis-cli -p "${PORTS[0]}" cluster addslotsrange 0 16383 >/dev/null
  else
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >&2
  fi
fi

for _ in $(seq 100); do
  ok=1
  for p in "${PORTS[@]}"; do [ "$(state "$p")" = ok ] || ok=0; done
  if [ "$ok" = 1 ]; then urls; exit 0; fi
  sleep 0.1
done
echo "redis cluster on ports ${PORTS[*]} did not reach cluster_state:ok" >&2
exit 1

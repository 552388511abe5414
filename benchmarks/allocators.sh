#!/usr/bin/env bash
# The allocator's share of what the layers cost on the wire (BENCHMARKS.md, "The allocator"):
# the load test's in-process scenarios (HTTP and gRPC; no layer, our layers, the hand-rolled
# references) built three times, on the system allocator, mimalloc and jemalloc (features of the
# benchmarks crate; the libraries never choose an allocator), and run in turns, system, mimalloc,
# jemalloc, for ROUNDS turns, so that a drift of the machine touches every allocator alike.
# Each run prints its own ratios (our layers over no layer, same binary, same run); compare the
# req/s of one scenario across allocators for the allocator's own effect.
set -euo pipefail
TURNS="${TURNS:-2}"
ROUNDS="${ROUNDS:-3}"
CONNECTIONS="${CONNECTIONS:-16}"
ONLY="${ONLY:-no_layers,client_retry,client_tower_retry,memory,naive,grpc}"
out="${TMPDIR:-/tmp}/allocators"
mkdir -p "$out"
for alloc in system mimalloc jemalloc; do
  features=""
  [ "$alloc" != system ] && features="--features $alloc"
  # shellcheck disable=SC2086
  cargo build --quiet --release -p benchmarks --bin loadtest $features
  cp target/release/loadtest "$out/loadtest-$alloc"
done
for turn in $(seq 1 "$TURNS"); do
  for alloc in system mimalloc jemalloc; do
    echo "== turn $turn: $alloc"
    "$out/loadtest-$alloc" --connections "$CONNECTIONS" --records 0 --rounds "$ROUNDS" --only "$ONLY" \
      | tee "$out/$alloc-$turn.txt"
  done
done

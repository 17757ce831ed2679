#!/usr/bin/env bash
# The main job (README): build mbal, then twice — the balancer off, then on — start a local
# cluster of 4 servers x 2 workers on loopback (`mbal cluster up`, each worker capped at an
# emulated capacity so that a hot worker queues as a saturated core would), drive it through the
# routing client at a fixed open-loop rate over a YCSB workload timeline A -> B -> C and then a
# hot partition (half the requests on 4 cachelets of one worker), and stop it. "Off" is
# `--balancer=off --hot-keys=off` on every server (no Phase 1, no Phase 2); "on" is the defaults.
# Prints the two runs side by side per phase (per-worker max/avg, p99, throughput, moves), what
# the balancer moved and each server's `stats balancer` in the "on" run. Writes the bench's
# results/run-off.json and results/run-on.json, and one plot, results/run.svg: throughput and
# p99 of both runs overlaid, then each run's per-worker load with the balancer's moves marked.
#   DURATION=N  seconds per YCSB phase (default 10); the hot partition runs 2 x DURATION
#   CAP=N       emulated requests/s per worker (default 2500); RATE=N offered ops/s (default 6000)
#   MODES="off on"  the runs, in order (e.g. MODES=on for the balancer's run alone)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
HOT=$((DURATION * 2))
CAP="${CAP:-2500}"
RATE="${RATE:-6000}"
mkdir -p results
# protoc: the etcd client crate (crates/coordinator) compiles etcd's .proto files at build time.
if ! command -v protoc >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq protobuf-compiler >/dev/null
fi
cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
TOTAL=$((DURATION * 3 + HOT))
MODES="${MODES:-off on}"
run_one() { # MODE: one cluster, one bench run, the cluster stopped
  local mode=$1 args=()
  [ "$mode" = off ] && args=(--server-arg=--balancer=off --server-arg=--hot-keys=off)
  rm -f results/cluster.toml
  "$BIN" cluster up --servers 4 --workers 2 -m 64 --worker-capacity "$CAP" --file results/cluster.toml "${args[@]}" &
  CLUSTER=$!
  for _ in $(seq 200); do [ -s results/cluster.toml ] && break; sleep 0.05; done
  FIRST=$(grep -m1 '^addr' results/cluster.toml | sed -E 's/.*"(.*)"/\1/')
  for _ in $(seq 200); do (exec 3<>"/dev/tcp/${FIRST%:*}/${FIRST#*:}") 2>/dev/null && break; sleep 0.05; done
  echo "==> balancer $mode: $TOTAL s of A -> B -> C -> hot partition at $RATE ops/s"
  "$BIN" bench --routed --server "$FIRST" --load --keys 100000 \
    --phases "a:${DURATION},b:${DURATION},c:${DURATION},hotpart:${HOT}" --hot-cachelets 4 --hot-ops 0.5 \
    --rate "$RATE" --max-ops $((RATE * TOTAL * 2)) --conns 8 --pipeline 64 \
    --json "results/run-$mode.json"
  if [ "$mode" = on ]; then
    python3 scripts/lib/run_summary.py --stats results/cluster.toml
  fi
  kill -INT $CLUSTER 2>/dev/null || true
  wait $CLUSTER 2>/dev/null || true
  CLUSTER=
}
CLUSTER=
trap '[ -n "$CLUSTER" ] && kill -INT $CLUSTER 2>/dev/null; wait 2>/dev/null' EXIT
jsons=()
for mode in $MODES; do
  run_one "$mode"
  jsons+=("results/run-$mode.json")
done
python3 scripts/lib/run_summary.py "${jsons[@]}"
"$BIN" bench --plot-only "${jsons[@]}" -o results/run.svg --quiet
echo "results: ${jsons[*]}, results/run.svg"

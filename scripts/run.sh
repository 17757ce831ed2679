#!/usr/bin/env bash
# The main job (README): build mbal, start a local cluster of 4 servers x 2 workers on loopback
# (`mbal cluster up`, each worker capped at an emulated capacity so that a hot worker queues as a
# saturated core would; the local balancer is on in a cluster), drive it through the routing
# client at a fixed open-loop rate over a YCSB workload timeline A -> B -> C and then a hot
# partition (half the requests on 4 cachelets of one worker), and print how the per-worker load
# spreads in each phase, what the balancer moved, and each server's `stats balancer`. Writes the
# bench's summary, results/run.json and results/run.svg (per-second throughput and latency, and
# the servers' per-worker load with the balancer's moves marked).
#   DURATION=N  seconds per YCSB phase (default 10); the hot partition runs 2 x DURATION
#   CAP=N       emulated requests/s per worker (default 2500); RATE=N offered ops/s (default 6000)
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
rm -f results/cluster.toml
"$BIN" cluster up --servers 4 --workers 2 -m 64 --worker-capacity "$CAP" --file results/cluster.toml &
CLUSTER=$!
trap 'kill -INT $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null' EXIT
for _ in $(seq 200); do [ -s results/cluster.toml ] && break; sleep 0.05; done
FIRST=$(grep -m1 '^addr' results/cluster.toml | sed -E 's/.*"(.*)"/\1/')
for _ in $(seq 200); do (exec 3<>"/dev/tcp/${FIRST%:*}/${FIRST#*:}") 2>/dev/null && break; sleep 0.05; done
TOTAL=$((DURATION * 3 + HOT))
"$BIN" bench --routed --server "$FIRST" --load --keys 100000 \
  --phases "a:${DURATION},b:${DURATION},c:${DURATION},hotpart:${HOT}" --hot-cachelets 4 --hot-ops 0.5 \
  --rate "$RATE" --max-ops $((RATE * TOTAL * 2)) --conns 8 --pipeline 64 \
  --json results/run.json --plot results/run.svg
python3 scripts/lib/run_summary.py results/run.json results/cluster.toml
echo "results: results/run.json, results/run.svg"

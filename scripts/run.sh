#!/usr/bin/env bash
# The main job (README): build mbal, start a local cluster of 4 servers x 2
# workers on loopback (`mbal cluster up`), drive it through the routing
# client with a YCSB workload timeline A -> B -> C (`mbal bench --routed`),
# and write the summary, JSON results and a plot to results/.
# The per-worker request counts and max/avg show the imbalance a skewed
# workload puts on the cluster.
#   DURATION=N  seconds per workload phase (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
mkdir -p results
cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
rm -f results/cluster.toml
"$BIN" cluster up --servers 4 --workers 2 -m 64 --file results/cluster.toml &
CLUSTER=$!
trap 'kill -INT $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null' EXIT
for _ in $(seq 200); do [ -s results/cluster.toml ] && break; sleep 0.05; done
FIRST=$(grep -m1 '^addr' results/cluster.toml | sed -E 's/.*"(.*)"/\1/')
for _ in $(seq 200); do (exec 3<>"/dev/tcp/${FIRST%:*}/${FIRST#*:}") 2>/dev/null && break; sleep 0.05; done
"$BIN" bench --routed --server "$FIRST" --load --keys 100000 \
  --phases "a:${DURATION},b:${DURATION},c:${DURATION}" \
  --conns 8 --pipeline 16 \
  --json results/run.json --plot results/run.svg
echo "results: results/run.json, results/run.svg"

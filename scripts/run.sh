#!/usr/bin/env bash
# The main job (README): build mbal, start a local mbal server on loopback,
# drive it with `mbal bench` (YCSB workload timeline A -> B -> C), and write
# the summary, JSON results and a plot to results/.
#   DURATION=N  seconds per workload phase (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-10}"
mkdir -p results
cargo build --release --bin mbal
BIN=target/release/mbal
PORTS=$(mktemp)
"$BIN" server -p 0 -t 2 -m 256 --print-ports >"$PORTS" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$PORTS"' EXIT
for _ in $(seq 100); do [ -s "$PORTS" ] && break; sleep 0.1; done
MAIN=$(sed -E 's/.*"main":"([^"]+)".*/\1/' "$PORTS")
echo "mbal server on $MAIN (pid $SERVER)"
"$BIN" bench --server "$MAIN" --load --keys 100000 \
  --phases "a:${DURATION},b:${DURATION},c:${DURATION}" \
  --conns 8 --pipeline 16 \
  --json results/run.json --plot results/run.svg
echo "results: results/run.json, results/run.svg"

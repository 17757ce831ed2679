#!/usr/bin/env bash
# Measure mbal-bench against a local memcached, each pinned to its own core:
#   memcached on core $SERVER_CPU (default 0), mbal-bench on core $CLIENT_CPU (default 1).
# Usage: crates/bench/scripts/vs-memcached.sh [BENCH_BINARY] [SECONDS]
# Prints one block per scenario plus memcached's CPU use during it; JSON lands in $OUT (default
# /tmp/mbal-bench-vs-memcached). Only talks to 127.0.0.1; kills only the memcached it started.
set -euo pipefail
B=${1:-target/release/mbal-bench}
SECS=${2:-5}
PORT=${PORT:-11999}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
OUT=${OUT:-/tmp/mbal-bench-vs-memcached}
mkdir -p "$OUT"
user=(); [ "$(id -u)" = 0 ] && user=(-u nobody)
taskset -c "$SERVER_CPU" memcached "${user[@]}" -l 127.0.0.1 -p "$PORT" -U 0 -t 1 -m 1024 &
MC=$!
trap 'kill $MC 2>/dev/null || true' EXIT
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
kill -0 $MC 2>/dev/null || { echo "memcached did not start (port $PORT busy?)" >&2; exit 1; }
cpu() { awk '{print $14+$15}' /proc/$MC/stat; }   # utime+stime in clock ticks
HZ=$(getconf CLK_TCK)
run() {
  local name=$1; shift
  local c0; c0=$(cpu)
  echo "== $name: $*"
  taskset -c "$CLIENT_CPU" "$B" --server 127.0.0.1:$PORT --duration "$SECS" --json "$OUT/$name.json" "$@"
  local c1; c1=$(cpu)
  awk -v a="$c0" -v b="$c1" -v hz="$HZ" -v s="$SECS" 'BEGIN{printf "  memcached CPU: %.0f%% of one core\n", (b-a)/hz/s*100}'
}
taskset -c "$CLIENT_CPU" "$B" --server 127.0.0.1:$PORT --load-only
run get_8x16        --workload a --conns 8 --pipeline 16
run set_8x16        --workload custom --read-ratio 0 --dist uniform --conns 8 --pipeline 16
run multiget100     --workload a --multiget 100 --conns 8 --pipeline 4
run zipf_95_5       --workload custom --read-ratio 0.95 --dist zipf
run zipf_50_50      --workload c
run open_loop_100k  --workload a --rate 100000
echo "== generator ceiling (in-process stub server, not pinned): "
"$B" --null-server --load --duration "$SECS" --json "$OUT/null.json"

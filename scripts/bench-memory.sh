#!/usr/bin/env bash
# Memory benchmark: memcached and mbal at the same -m, filled by the same
# SET-heavy Zipfian workload with 64-1024 B values over a key space several
# times larger than memory. Reports, per system, the hit ratio of the
# measured run and the resident memory (VmRSS, VmHWM) at its end, against
# the promise RSS <= -m + 10% + 32 MB.
#
#   scripts/bench-memory.sh [RUNS] [SECONDS]      (defaults 3, 20)
#   MEM=256 KEYS=2000000 THREADS=1 scripts/bench-memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-20}
MEM=${MEM:-256}
KEYS=${KEYS:-2000000}
THREADS=${THREADS:-1}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
OUT=${OUT:-results/memory}
mkdir -p "$OUT"
cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
user=(); [ "$(id -u)" = 0 ] && user=(-u nobody)
PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap cleanup EXIT
for r in $(seq "$RUNS"); do
  for sys in memcached mbal; do
    port=$((21000 + RANDOM % 20000))
    case $sys in
      memcached) taskset -c "$SERVER_CPU" memcached "${user[@]}" -l 127.0.0.1 -p $port -U 0 -t "$THREADS" -m "$MEM" & ;;
      mbal) taskset -c "$SERVER_CPU" "$BIN" server -l 127.0.0.1 -p $port -t "$THREADS" -m "$MEM" --worker-port-base $((port + 1)) & ;;
    esac
    PID=$!
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.05; done
    # Warm-up fills memory well past -m, then the measured run.
    for phase in warm run; do
      taskset -c "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:$port --keys "$KEYS" \
        --workload custom --dist zipf --zipf 0.99 --read-ratio 0.3 \
        --value-size 64 --value-size-max 1024 --conns 8 --pipeline 16 \
        --duration "$SECS" --quiet --json "$OUT/$sys.$r.$phase.json" >/dev/null
    done
    grep -E '^(VmRSS|VmHWM)' /proc/$PID/status | awk '{print $2}' | paste -sd' ' >"$OUT/$sys.$r.rss"
    cleanup
  done
done
python3 - "$OUT" "$RUNS" "$MEM" <<'PY'
import json, statistics, sys
out, runs, mem = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(f"-m {mem} MB; promise: RSS <= {mem * 1.1 + 32:.0f} MB")
res = {}
for s in ("memcached", "mbal"):
    hr, rss, hwm = [], [], []
    for r in range(1, runs + 1):
        t = json.load(open(f"{out}/{s}.{r}.run.json"))["totals"]
        hr.append(t["hit_ratio"] * 100)
        a, b = open(f"{out}/{s}.{r}.rss").read().split()
        rss.append(int(a) / 1024); hwm.append(int(b) / 1024)
    res[s] = (statistics.median(hr), statistics.median(rss), statistics.median(hwm))
    print(f"{s:10} hit ratio {res[s][0]:6.2f}%  RSS {res[s][1]:7.1f} MB  peak {res[s][2]:7.1f} MB  (runs: {', '.join(f'{x:.2f}' for x in hr)})")
print(f"hit ratio difference (mbal - memcached): {res['mbal'][0] - res['memcached'][0]:+.2f} points")
PY

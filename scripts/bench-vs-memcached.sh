#!/usr/bin/env bash
# Loopback benchmark, mbal against stock memcached, same generator, same run.
#
#   scripts/bench-vs-memcached.sh [RUNS] [SECONDS]
#
# Server pinned to core $SERVER_CPU (default 0) with one worker thread
# (memcached -t 1, mbal -t 1); the load generator (`mbal bench`, plain
# memcached text client) pinned to core $CLIENT_CPU (default 1). For each
# scenario, memcached and mbal alternate RUNS times (default 5); the script
# prints the median throughput of each, the ratio, the spread, and server
# CPU time per request (utime+stime from /proc/PID/stat over the run).
# JSON reports land in $OUT (default results/vs-memcached). Loopback only;
# kills only the servers it started.
#
# THREADS (default 1) sets -t of both servers; SERVER_CPU / CLIENT_CPU "-" leaves that side
# unpinned. MBAL_BASE=<path of another mbal binary> adds a third system, mbal-base, to every
# alternation (before/after a change, same run). A scenario's --key-size*/--value-size* options
# also shape its load.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
SECS=${2:-5}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
OUT=${OUT:-results/vs-memcached}
MEM=${MEM:-1024}
KEYS=${KEYS:-100000}
ONLY=${ONLY:-}
THREADS=${THREADS:-1}
source scripts/lib/loopback.sh
mkdir -p "$OUT"

scenario() { # name, bench args...
  local name=$1; shift
  [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]] && return 0
  echo "== $name: $*" >&2
  local shape=() a=("$@") i
  for ((i = 0; i < ${#a[@]}; i++)); do
    case ${a[i]} in --key-size|--key-size-max|--value-size|--value-size-max) shape+=("${a[i]}" "${a[i+1]}");; esac
  done
  for r in $(seq "$RUNS"); do
    for sys in memcached mbal ${MBAL_BASE:+mbal-base}; do
      start_server $sys "$THREADS" "$SERVER_CPU"
      local port=$PORT
      pin "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:$port --keys "$KEYS" --load-only --quiet "${shape[@]}" >/dev/null
      local c0; c0=$(cpu_ticks)
      pin "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:$port --keys "$KEYS" --duration "$SECS" --quiet \
        --json "$OUT/$name.$sys.$r.json" "$@" >/dev/null
      local c1; c1=$(cpu_ticks)
      echo "$(( c1 - c0 ))" >"$OUT/$name.$sys.$r.cpu"
      stop_server
    done
  done
}

scenario get_pipelined   --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario multiget_100    --workload uniform --read-ratio 1 --multiget 100 --conns 8 --pipeline 4
# Issue 37's fan-out client: few multi-gets in flight, keys of 10-24 B, values of 20-64 B.
scenario multiget_fanout --workload uniform --read-ratio 1 --multiget 100 --conns 4 --pipeline 2 \
  --key-size 10 --key-size-max 24 --value-size 20 --value-size-max 64
scenario set_pipelined   --workload uniform --read-ratio 0 --conns 8 --pipeline 16
scenario zipf_95_5       --workload custom --read-ratio 0.95 --dist zipf --zipf 0.99 --conns 8 --pipeline 16
scenario zipf_50_50      --workload c --conns 8 --pipeline 16
scenario ycsb_a          --workload a --conns 8 --pipeline 16

python3 - "$OUT" "$RUNS" "$HZ" <<'PY'
import json, statistics, sys, glob, os
out, runs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sorted({os.path.basename(p).split('.')[0] for p in glob.glob(f"{out}/*.json")})
print(f"{'scenario':16} {'memcached/s':>12} {'mbal/s':>12} {'ratio':>6} {'spread mc/mb':>13} {'cpu us/req mc':>14} {'mbal':>8} {'cpu ratio':>9}")
for n in names:
    row = {}
    for sys_ in ("memcached", "mbal", "mbal-base"):
        tput, cpu = [], []
        for r in range(1, runs + 1):
            p = f"{out}/{n}.{sys_}.{r}.json"
            if not os.path.exists(p):
                continue
            t = json.load(open(p))["totals"]
            # keys/s for multiget, ops/s otherwise
            v = t["keys_per_sec"] if "multiget" in n else t["ops_per_sec"]
            tput.append(v)
            ticks = int(open(f"{out}/{n}.{sys_}.{r}.cpu").read())
            reqs = max(t["requests"], 1)
            cpu.append(ticks / hz / reqs * 1e6)
        if tput:
            med = statistics.median(tput)
            spread = (max(tput) - min(tput)) / med * 100 if med else 0
            row[sys_] = (med, spread, statistics.median(cpu))
    if "memcached" in row and "mbal" in row:
        mc, mb = row["memcached"], row["mbal"]
        print(f"{n:16} {mc[0]:12.0f} {mb[0]:12.0f} {mb[0]/mc[0]:6.2f} {mc[1]:5.0f}%/{mb[1]:4.0f}% {mc[2]:14.2f} {mb[2]:8.2f} {mb[2]/mc[2] if mc[2] else 0:9.2f}")
        if "mbal-base" in row:
            ba = row["mbal-base"]
            print(f"{'  mbal-base':16} {'':12} {ba[0]:12.0f} {ba[0]/mc[0]:6.2f} {'':>6}{ba[1]:4.0f}% {'':14} {ba[2]:8.2f} {ba[2]/mc[2] if mc[2] else 0:9.2f}   mbal / mbal-base {mb[0]/ba[0]:.2f}x, cpu {mb[2]/ba[2] if ba[2] else 0:.2f}")
PY

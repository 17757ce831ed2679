#!/usr/bin/env bash
# Scale-up benchmark: mbal -t N against memcached -t N, plain memcached text
# clients (`mbal bench --plain`, the same generator for both), same run.
#
#   scripts/bench-scaling.sh [RUNS] [SECONDS]        (defaults 3 and 5)
#
# Rows (a row = thread count + where the server and the generator run):
#  * machines with >= 4 cores: N = 1, 2, 4, ... up to half the cores, the
#    server pinned to cores 0..N-1 and the generator (with as many threads as
#    it has cores) to the other half;
#  * machines with fewer: N = 1 .. cores, nothing pinned (the default
#    configuration a user runs: -t = cores, client and server share them);
#  * always: t1-pin1 and t4-pin1, the server pinned to core 0 with 1 and with
#    4 workers (oversubscribed), the generator pinned to core 1: the server
#    CPU per request of the two rows is the price of workers outnumbering cores.
# For each row and scenario memcached and mbal alternate RUNS times; the
# summary prints medians of throughput (keys/s for the multi-get), the ratio,
# server CPU time per request (utime+stime from /proc over the run) and the
# ratio of each mbal row to mbal's first row of the same pinning.
# Workload: 1M keys of 16 B, values 20-64 B (loaded first), 8 connections x
# 16 pipelined (multi-get: 100 keys, 8 x 4). Loopback only.
#   ONLY=get,set,...  scenarios to run;  ROWS="t1 t2 ..."  rows to run
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-5}
OUT=${OUT:-results/scaling}
KEYS=${KEYS:-1000000}
ONLY=${ONLY:-}
source scripts/lib/loopback.sh
rm -rf "$OUT"; mkdir -p "$OUT"
CORES=$(nproc)

# row name -> "threads server_cpus client_cpus client_threads"
declare -A ROW
order=()
if [ "$CORES" -ge 4 ]; then
  half=$((CORES / 2))
  n=1
  while [ $n -le $half ]; do
    ROW[t$n]="$n 0-$((n - 1)) $half-$((CORES - 1)) $half"; order+=(t$n)
    [ $n -lt $half ] && [ $((n * 2)) -gt $half ] && n=$half || n=$((n * 2))
  done
else
  for n in $(seq 1 "$CORES"); do ROW[t$n]="$n - - 1"; order+=(t$n); done
fi
if [ "$CORES" -ge 2 ]; then
  ROW[t1-pin1]="1 0 1 1"; ROW[t4-pin1]="4 0 1 1"; order+=(t1-pin1 t4-pin1)
fi
[ -n "${ROWS:-}" ] && read -r -a order <<<"$ROWS"

COMMON=(--keys "$KEYS" --key-size 16 --value-size 20 --value-size-max 64)
scenario() { # name, bench args...
  local name=$1; shift
  [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]] && return 0
  for row in "${order[@]}"; do
    read -r threads scpu ccpu cthreads <<<"${ROW[$row]}"
    echo "== $row ($threads threads, server cpus $scpu, client cpus $ccpu) $name: $*" >&2
    for r in $(seq "$RUNS"); do
      for sys in memcached mbal; do
        start_server $sys "$threads" "$scpu"
        pin "$ccpu" "$BIN" bench --server 127.0.0.1:$PORT "${COMMON[@]}" --load-only --quiet >/dev/null
        local c0; c0=$(cpu_ticks)
        pin "$ccpu" "$BIN" bench --server 127.0.0.1:$PORT "${COMMON[@]}" --threads "$cthreads" \
          --duration "$SECS" --quiet --json "$OUT/$name.$row.$sys.$r.json" "$@" >/dev/null
        local c1; c1=$(cpu_ticks)
        echo "$((c1 - c0))" >"$OUT/$name.$row.$sys.$r.cpu"
        stop_server
      done
    done
  done
}

scenario get        --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario set        --workload uniform --read-ratio 0 --conns 8 --pipeline 16
scenario multiget   --workload uniform --read-ratio 1 --multiget 100 --conns 8 --pipeline 4
scenario zipf_50_50 --workload c --conns 8 --pipeline 16

python3 - "$OUT" "$RUNS" "$HZ" "${order[*]}" <<'PY'
import json, statistics, sys, os
out, runs, hz, order = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
def med(name, row, sys_):
    tput, cpu = [], []
    for r in range(1, runs + 1):
        p = f"{out}/{name}.{row}.{sys_}.{r}.json"
        if not os.path.exists(p):
            continue
        t = json.load(open(p))["totals"]
        tput.append(t["keys_per_sec"] if name == "multiget" else t["ops_per_sec"])
        ticks = int(open(f"{out}/{name}.{row}.{sys_}.{r}.cpu").read())
        cpu.append(ticks / hz / max(t["requests"], 1) * 1e6)
    return (statistics.median(tput), statistics.median(cpu), tput) if tput else None
print(f"{'scenario':11} {'row':8} {'memcached/s':>12} {'mbal/s':>12} {'mbal/mc':>8} {'mbal/row1':>9}"
      f" {'cpu us/req mc':>13} {'mbal':>7} {'mbal cpu/row1':>13}   mbal runs")
for name in ("get", "set", "multiget", "zipf_50_50"):
    base = {}
    for row in order:
        mc, mb = med(name, row, "memcached"), med(name, row, "mbal")
        if not (mc and mb):
            continue
        key = "pin1" if row.endswith("-pin1") else "free"
        base.setdefault(key, mb)
        b = base[key]
        print(f"{name:11} {row:8} {mc[0]:12.0f} {mb[0]:12.0f} {mb[0]/mc[0]:8.2f} {mb[0]/b[0]:9.2f}"
              f" {mc[1]:13.2f} {mb[1]:7.2f} {mb[1]/b[1]:13.2f}   {' '.join(f'{x:.0f}' for x in mb[2])}")
PY

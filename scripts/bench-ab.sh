#!/usr/bin/env bash
# A/B of two mbal server binaries on the scale-up workloads (a change's native cost or gain):
#
#   scripts/bench-ab.sh OLD_BIN NEW_BIN [RUNS] [SECONDS]      (defaults 3 and 5)
#   ROWS="t2 t1-pin1 t4-pin1"  ONLY="get set multiget zipf"   (the defaults)
#
# Rows as scripts/bench-scaling.sh: t1/t2 = -t 1/-t 2 with nothing pinned; t1-pin1/t4-pin1 =
# the server pinned to core 0 with 1/4 workers, the generator to core 1. The two servers
# alternate run by run; the generator is NEW_BIN's `mbal bench --plain` for both. Prints, per
# scenario and row, the medians of throughput (keys/s for the multi-get) and server CPU per
# request (utime+stime from /proc over the run), and new/old ratios. Loopback only.
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,4p "$0" >&2; exit 2; }
OLD=$(realpath "$1"); NEW=$(realpath "$2")
RUNS=${3:-3}; SECS=${4:-5}
cd "$(dirname "$0")/.."
source scripts/lib/loopback.sh
OUT=${OUT:-results/ab}; rm -rf "$OUT"; mkdir -p "$OUT"
COMMON=(--keys 1000000 --key-size 16 --value-size 20 --value-size-max 64)
declare -A ROW=([t1]="1 - -" [t2]="2 - -" [t1-pin1]="1 0 1" [t4-pin1]="4 0 1")
scenario() { # name, bench args...
  local name=$1; shift
  for row in ${ROWS:-t2 t1-pin1 t4-pin1}; do
    read -r threads scpu ccpu <<<"${ROW[$row]}"
    echo "== $row $name: $*" >&2
    for r in $(seq "$RUNS"); do
      for v in old new; do
        if [ $v = old ]; then BIN=$OLD; else BIN=$NEW; fi
        start_server mbal "$threads" "$scpu"
        pin "$ccpu" "$NEW" bench --server 127.0.0.1:$PORT "${COMMON[@]}" --load-only --quiet >/dev/null
        local c0; c0=$(cpu_ticks)
        pin "$ccpu" "$NEW" bench --server 127.0.0.1:$PORT "${COMMON[@]}" --threads 1 --duration "$SECS" \
          --quiet --json "$OUT/$name.$row.$v.$r.json" "$@" >/dev/null
        local c1; c1=$(cpu_ticks)
        echo "$((c1 - c0))" >"$OUT/$name.$row.$v.$r.cpu"
        stop_server
      done
    done
  done
}
for s in ${ONLY:-get set multiget zipf}; do
  case $s in
    get) scenario get --workload uniform --read-ratio 1 --conns 8 --pipeline 16 ;;
    set) scenario set --workload uniform --read-ratio 0 --conns 8 --pipeline 16 ;;
    multiget) scenario multiget --workload uniform --read-ratio 1 --multiget 100 --conns 8 --pipeline 4 ;;
    zipf) scenario zipf --workload c --conns 8 --pipeline 16 ;;
    *) echo "unknown scenario $s" >&2; exit 2 ;;
  esac
done
python3 - "$OUT" "$HZ" <<'PY'
import glob, json, os, statistics, sys
out, hz = sys.argv[1], int(sys.argv[2])
rows = {}
for p in sorted(glob.glob(out + "/*.json")):
    name, row, v, _r, _ = os.path.basename(p).split(".")
    t = json.load(open(p))["totals"]
    tput = t["keys_per_sec"] if name == "multiget" else t["ops_per_sec"]
    cpu = int(open(p[:-5] + ".cpu").read()) / hz / max(t["requests"], 1) * 1e6
    rows.setdefault((name, row), {}).setdefault(v, []).append((tput, cpu))
print(f"{'scenario':9} {'row':8} {'old /s':>10} {'cpu us':>7} {'new /s':>10} {'cpu us':>7} {'tput new/old':>12} {'cpu new/old':>11}")
for (name, row), d in rows.items():
    m = lambda v, i: statistics.median(x[i] for x in d[v])
    print(f"{name:9} {row:8} {m('old',0):10.0f} {m('old',1):7.2f} {m('new',0):10.0f} {m('new',1):7.2f}"
          f" {m('new',0)/m('old',0):12.2f} {m('new',1)/m('old',1):11.2f}")
PY

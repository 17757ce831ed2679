#!/usr/bin/env bash
# Issue-3 figures, all with `mbal bench`:
#  1. routed vs plain GET against one mbal server with 2 workers (RUNS runs
#     each, alternating; median ops/s; the server's cross_worker_requests
#     added by each mode);
#  2. a 4-server x 2-worker local cluster under YCSB A (Zipfian 0.99),
#     routed: per-worker request counts, max/avg and NetKV's imbalance factor;
#  3. the generator's own ceiling (in-process null server).
# No pinning: server workers, cluster servers and the generator share both cores.
#   scripts/bench-cluster.sh [RUNS] [SECONDS]     (defaults 3, 5)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-5}
OUT=${OUT:-results/cluster}
mkdir -p "$OUT"
cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
PID=""
cleanup() { [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap cleanup EXIT
stat_of() { # host:port name
  python3 - "$1" "$2" <<'PY'
import socket, sys
h, p = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((h, int(p))); s.sendall(b"stats\r\n"); d = b""
while not d.endswith(b"END\r\n"): d += s.recv(65536)
print(dict(l.split()[1:3] for l in d.decode().splitlines() if l.startswith("STAT"))[sys.argv[2]])
PY
}

echo "== 1. routed vs plain, 1 server x 2 workers"
"$BIN" server -p 0 -t 2 -m 256 --print-ports >"$OUT/ports.json" &
PID=$!
for _ in $(seq 100); do [ -s "$OUT/ports.json" ] && break; sleep 0.05; done
MAIN=$(python3 -c "import json;print(json.load(open('$OUT/ports.json'))['main'])")
"$BIN" bench --server "$MAIN" --keys 100000 --load-only --quiet >/dev/null
for r in $(seq "$RUNS"); do
  for mode in plain routed; do
    before=$(stat_of "$MAIN" cross_worker_requests)
    flag=(); [ $mode = routed ] && flag=(--routed)
    "$BIN" bench "${flag[@]}" --server "$MAIN" --keys 100000 --workload uniform --read-ratio 1 \
      --conns 8 --pipeline 16 --duration "$SECS" --quiet --json "$OUT/$mode.$r.json" >/dev/null
    after=$(stat_of "$MAIN" cross_worker_requests)
    echo "$((after - before))" >"$OUT/$mode.$r.cross"
  done
done
cleanup
python3 - "$OUT" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
med = {}
for m in ("plain", "routed"):
    v = [json.load(open(f"{out}/{m}.{r}.json"))["totals"]["ops_per_sec"] for r in range(1, runs + 1)]
    x = [int(open(f"{out}/{m}.{r}.cross").read()) for r in range(1, runs + 1)]
    med[m] = statistics.median(v)
    print(f"  {m:7} median {med[m]:10.0f} GET/s  runs {[round(a) for a in v]}  cross_worker_requests added {x}")
print(f"  routed / plain = {med['routed'] / med['plain']:.2f}")
PY

echo "== 2. 4 servers x 2 workers, YCSB A (Zipfian 0.99), routed"
rm -f "$OUT/cluster.toml"
"$BIN" cluster up --servers 4 --workers 2 -m 64 --file "$OUT/cluster.toml" >/dev/null &
PID=$!
for _ in $(seq 200); do [ -s "$OUT/cluster.toml" ] && break; sleep 0.05; done
FIRST=$(grep -m1 '^addr' "$OUT/cluster.toml" | sed -E 's/.*"(.*)"/\1/')
for _ in $(seq 200); do (exec 3<>"/dev/tcp/${FIRST%:*}/${FIRST#*:}") 2>/dev/null && break; sleep 0.05; done
"$BIN" bench --routed --server "$FIRST" --load --keys 100000 --workload a --zipf 0.99 \
  --conns 8 --pipeline 16 --duration "$((SECS * 2))" --quiet --json "$OUT/ycsb_a_4x2.json" >/dev/null
cleanup
python3 - "$OUT/ycsb_a_4x2.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); b = r["balance"]
for t in b["targets"]:
    print(f"  {t['name']:7} {t['requests']:10d}")
print(f"  max/avg {b['max_over_avg']:.3f}  imbalance factor {b['imbalance_factor']:.3f}  total {r['totals']['ops_per_sec']:.0f} ops/s")
PY

echo "== 3. generator ceiling (null server, same settings)"
"$BIN" bench --null-server --load --keys 100000 --workload uniform --read-ratio 1 --conns 8 --pipeline 16 \
  --duration "$SECS" --quiet --json "$OUT/null.json" >/dev/null
python3 -c "
import json; t=json.load(open('$OUT/null.json'))
print(f\"  {t['totals']['ops_per_sec']:.0f} ops/s, {t['client']['ops_per_cpu_sec']:.0f} ops per client-CPU-second\")"

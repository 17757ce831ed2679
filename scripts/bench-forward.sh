#!/usr/bin/env bash
# What `mbal server --forward` costs the server (issue 11): one plain client
# (`mbal bench --plain`) against server 0 of a 2-server cluster (-t 1 each,
# server 0 with --forward), for keys server 0 owns vs keys server 1 owns
# (which server 0 forwards). Same workload both ways: 95% GET / 5% SET,
# uniform over the keys of one server's cachelets (`--workload hotpart
# --hot-ops 1 --hot-cachelet-ids` = that server's cachelets). Both servers
# pinned to core 0, the generator to core 1. Server CPU per request is
# utime+stime from /proc/PID/stat over the run / requests completed.
# RUNS runs of each mode, alternated; medians.
#   scripts/bench-forward.sh [RUNS] [SECONDS]     (defaults 3, 5)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-5}
OUT=${OUT:-results/forward}
mkdir -p "$OUT"
cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null && wait "$p" 2>/dev/null; done; PIDS=(); }
trap cleanup EXIT
read -r P0 P1 < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
cat >"$OUT/cluster.toml" <<EOF
vn_count = 16384
cachelets_per_worker = 16
workers = 1

[[servers]]
addr = "127.0.0.1:$P0"

[[servers]]
addr = "127.0.0.1:$P1"
EOF
taskset -c 0 "$BIN" server --cluster "$OUT/cluster.toml" --id 0 -m 512 --forward &
PIDS+=($!)
S0=$!
taskset -c 0 "$BIN" server --cluster "$OUT/cluster.toml" --id 1 -m 512 &
PIDS+=($!)
S1=$!
for port in $P0 $P1; do
  for _ in $(seq 200); do python3 -c "import socket;socket.create_connection(('127.0.0.1',$port))" 2>/dev/null && break; sleep 0.05; done
done
# The cachelets of each server, from the map.
python3 - "$OUT/cluster.toml" "$P0" >"$OUT/ids" <<'PY'
import json, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[2]))); s.sendall(b"mbal map\r\n"); d = b""
while True:
    d += s.recv(1 << 20)
    head, _, rest = d.partition(b"\r\n")
    n = int(head.split()[2])
    if len(rest) >= n: break
m = json.loads(rest[:n])
owners = m["layout"]["cachelet_owner"]
for srv in (0, 1):
    print(",".join(str(c) for c, o in enumerate(owners) if o[0] == srv))
PY
OWN=$(sed -n 1p "$OUT/ids")
FWD=$(sed -n 2p "$OUT/ids")
KEYS=200000
COMMON=(--server "127.0.0.1:$P0" --plain --keys $KEYS --server-load off)
taskset -c 1 "$BIN" bench "${COMMON[@]}" --load-only --quiet >/dev/null
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for r in $(seq "$RUNS"); do
  for mode in own fwd; do
    ids=$OWN; [ $mode = fwd ] && ids=$FWD
    a0=$(cpu $S0); a1=$(cpu $S1)
    taskset -c 1 "$BIN" bench "${COMMON[@]}" --workload hotpart --hot-ops 1 --hot-cachelet-ids "$ids" \
      --conns 8 --pipeline 16 --duration "$SECS" --quiet --json "$OUT/$mode.$r.json" >/dev/null
    b0=$(cpu $S0); b1=$(cpu $S1)
    echo "$((b0 - a0)) $((b1 - a1))" >"$OUT/$mode.$r.cpu"
  done
done
python3 - "$OUT" "$RUNS" "$(getconf CLK_TCK)" <<'PY'
import json, statistics, sys
out, runs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
med = {}
for m in ("own", "fwd"):
    rows = []
    for r in range(1, runs + 1):
        t = json.load(open(f"{out}/{m}.{r}.json"))["totals"]
        c0, c1 = (int(x) for x in open(f"{out}/{m}.{r}.cpu").read().split())
        ops = t["ops"]
        rows.append((t["ops_per_sec"], c0 / hz / ops * 1e6, c1 / hz / ops * 1e6, t["errors"]))
    med[m] = [statistics.median(x[i] for x in rows) for i in range(3)]
    print(f"  {m}: median {med[m][0]:10.0f} ops/s  server 0 {med[m][1]:.2f} µs CPU/op  server 1 {med[m][2]:.2f} µs CPU/op"
          f"  runs {[round(x[0]) for x in rows]}  errors {[x[3] for x in rows]}")
print(f"  fwd / own: throughput {med['fwd'][0] / med['own'][0]:.2f}x, server 0 CPU/op {med['fwd'][1] / med['own'][1]:.2f}x,"
      f" both servers CPU/op {(med['fwd'][1] + med['fwd'][2]) / (med['own'][1] + med['own'][2]):.2f}x")
PY

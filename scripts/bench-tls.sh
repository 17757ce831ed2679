#!/usr/bin/env bash
# What TLS costs per request on loopback: mbal plain, mbal TLS (-Z), memcached plain and
# memcached TLS (-Z; Debian's memcached 1.6 is built with TLS), the same generator in the same
# run.
#
#   scripts/bench-tls.sh [RUNS] [SECONDS]
#
# One server thread (-t 1) pinned to core $SERVER_CPU (default 0); `mbal bench` (plain
# memcached text client, with --tls-ca for the TLS servers) pinned to core $CLIENT_CPU
# (default 1). The four servers alternate RUNS times (default 3) per scenario; the script
# prints the median throughput, the spread, server CPU per request (utime+stime from
# /proc/PID/stat over the run) and the TLS/plain ratios. A test CA and a server certificate
# for 127.0.0.1 are made with openssl in $OUT/certs. Loopback only; kills only the servers it
# started.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-5}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
OUT=${OUT:-results/tls}
MEM=${MEM:-1024}
KEYS=${KEYS:-100000}
source scripts/lib/loopback.sh
memcached -h | grep -q -- '--enable-ssl' || { echo "this memcached is built without TLS" >&2; exit 1; }
mkdir -p "$OUT"
TLS_DIR=$OUT/certs
mkdir -p "$TLS_DIR"
(
  cd "$TLS_DIR"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
    -days 30 -subj "/CN=mbal bench CA" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server.key -out server.csr \
    -subj "/CN=localhost" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 30 \
    -extfile server.ext 2>/dev/null
)
export TLS_DIR

scenario() { # name, bench args...
  local name=$1; shift
  echo "== $name: $*" >&2
  for r in $(seq "$RUNS"); do
    for sys in mbal mbal-tls memcached memcached-tls; do
      local tls=()
      [[ $sys == *-tls ]] && tls=(--tls-ca "$TLS_DIR/ca.pem")
      start_server "$sys" 1 "$SERVER_CPU"
      local port=$PORT
      taskset -c "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:$port "${tls[@]}" --keys "$KEYS" --load-only --quiet >/dev/null
      local c0; c0=$(cpu_ticks)
      taskset -c "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:$port "${tls[@]}" --keys "$KEYS" --duration "$SECS" \
        --quiet --json "$OUT/$name.$sys.$r.json" "$@" >/dev/null
      local c1; c1=$(cpu_ticks)
      echo "$(( c1 - c0 ))" >"$OUT/$name.$sys.$r.cpu"
      stop_server
    done
  done
}

scenario get_pipelined --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario get_unpipelined --workload uniform --read-ratio 1 --conns 8 --pipeline 1

python3 - "$OUT" "$RUNS" "$HZ" <<'PY'
import json, statistics, sys, glob, os
out, runs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
systems = ("mbal", "mbal-tls", "memcached", "memcached-tls")
names = sorted({os.path.basename(p).split('.')[0] for p in glob.glob(f"{out}/*.json")})
for n in names:
    row = {}
    for s in systems:
        tput, cpu = [], []
        for r in range(1, runs + 1):
            p = f"{out}/{n}.{s}.{r}.json"
            if not os.path.exists(p):
                continue
            t = json.load(open(p))["totals"]
            tput.append(t["ops_per_sec"])
            ticks = int(open(f"{out}/{n}.{s}.{r}.cpu").read())
            cpu.append(ticks / hz / max(t["requests"], 1) * 1e6)
        if tput:
            med = statistics.median(tput)
            row[s] = (med, (max(tput) - min(tput)) / med * 100, statistics.median(cpu))
    print(f"{n}")
    print(f"  {'server':14} {'ops/s':>10} {'spread':>7} {'cpu us/req':>11}")
    for s, (t, sp, c) in row.items():
        print(f"  {s:14} {t:10.0f} {sp:6.0f}% {c:11.2f}")
    def ratio(a, b, i):
        return row[a][i] / row[b][i] if a in row and b in row and row[b][i] else float("nan")
    print(f"  mbal TLS/plain: throughput {ratio('mbal-tls', 'mbal', 0):.2f}, cpu/req {ratio('mbal-tls', 'mbal', 2):.2f}")
    print(f"  memcached TLS/plain: throughput {ratio('memcached-tls', 'memcached', 0):.2f}, cpu/req {ratio('memcached-tls', 'memcached', 2):.2f}")
    print(f"  mbal TLS / memcached TLS: throughput {ratio('mbal-tls', 'memcached-tls', 0):.2f}, cpu/req {ratio('mbal-tls', 'memcached-tls', 2):.2f}")
PY

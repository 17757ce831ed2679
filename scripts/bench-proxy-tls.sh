#!/usr/bin/env bash
# What TLS costs through `mbal proxy`: the plain path (plain server, plain
# proxy, plain client) against TLS on both of the proxy's sides (server -Z,
# proxy -Z with upstream TLS, client with --tls-ca), alternated in one run.
#
#   scripts/bench-proxy-tls.sh [RUNS] [SECONDS]
#
# Servers (`-t 1`) and the load generator (`mbal bench`) on core $SERVER_CPU
# (default 0), the proxy (`-t 1`) alone on core $PROXY_CPU (default 1).
# Reported as medians of RUNS (default 5): throughput, the proxy's CPU time
# per request, and the TLS/plain ratios. A test CA and a certificate for
# 127.0.0.1 are made with openssl in $OUT/certs. Loopback only; kills only
# the processes it started, by pid. Run it under `flock /tmp/bench.lock`.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
SECS=${2:-3}
SERVER_CPU=${SERVER_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
OUT=${OUT:-results/proxy-tls}
KEYS=${KEYS:-100000}
source scripts/lib/loopback.sh
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
SSL="ssl_chain_cert=$TLS_DIR/server.pem,ssl_key=$TLS_DIR/server.key"

start_server mbal 1 "$SERVER_CPU"; PLAIN_PID=$PID PLAIN_PORT=$PORT; PID=""
start_server mbal-tls 1 "$SERVER_CPU"; TLS_PID=$PID TLS_PORT=$PORT; PID=""
PPID_=""
stop_proxy() { if [ -n "$PPID_" ]; then kill "$PPID_" 2>/dev/null && { wait "$PPID_" 2>/dev/null || true; }; fi; PPID_=""; return 0; }
cleanup() { stop_proxy; for p in "$PLAIN_PID" "$TLS_PID"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done; return 0; }
trap cleanup EXIT
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }

start_proxy() { # plain|tls -> sets PPID_ and TPORT
  for _try in 1 2 3 4 5; do
    TPORT=$((21000 + RANDOM % 20000))
    if [ "$1" = plain ]; then
      taskset -c "$PROXY_CPU" "$BIN" proxy --server 127.0.0.1:"$PLAIN_PORT" -l 127.0.0.1 -p "$TPORT" -t 1 2>/dev/null &
    else
      taskset -c "$PROXY_CPU" "$BIN" proxy --server 127.0.0.1:"$TLS_PORT" --tls-ca "$TLS_DIR/ca.pem" \
        -l 127.0.0.1 -p "$TPORT" -t 1 -Z -o "$SSL" 2>/dev/null &
    fi
    PPID_=$!
    wait_port "$TPORT" && kill -0 "$PPID_" 2>/dev/null && return 0
    stop_proxy
  done
  echo "proxy $1 did not start" >&2
  exit 1
}
proxy_ticks() { awk '{print $14+$15}' "/proc/$PPID_/stat"; }

taskset -c "$SERVER_CPU" "$BIN" bench --server 127.0.0.1:"$PLAIN_PORT" --keys "$KEYS" --load-only --quiet >/dev/null
taskset -c "$SERVER_CPU" "$BIN" bench --server 127.0.0.1:"$TLS_PORT" --tls-ca "$TLS_DIR/ca.pem" --keys "$KEYS" \
  --load-only --quiet >/dev/null

scenario() { # name, bench args...
  local name=$1; shift
  echo "== $name: $*" >&2
  for r in $(seq "$RUNS"); do
    for side in plain tls; do
      start_proxy "$side"
      local tls=(); [ "$side" = tls ] && tls=(--tls-ca "$TLS_DIR/ca.pem")
      local c0; c0=$(proxy_ticks)
      taskset -c "$SERVER_CPU" "$BIN" bench --server 127.0.0.1:"$TPORT" "${tls[@]}" --keys "$KEYS" --duration "$SECS" \
        --quiet --json "$OUT/$name.$side.$r.json" "$@" >/dev/null
      local c1; c1=$(proxy_ticks)
      echo "$(( c1 - c0 ))" >"$OUT/$name.$side.$r.cpu"
      stop_proxy
    done
  done
}

scenario get     --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario set     --workload uniform --read-ratio 0 --conns 8 --pipeline 16
scenario lat_get --workload uniform --read-ratio 1 --conns 1 --pipeline 1

python3 scripts/lib/pair_summary.py "$OUT" "$RUNS" "$HZ" plain tls

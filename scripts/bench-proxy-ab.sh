#!/usr/bin/env bash
# A/B of `mbal proxy`'s plain path: two mbal binaries' proxies, alternated in
# one run against the same server and the same generator.
#
#   scripts/bench-proxy-ab.sh BEFORE_BIN [RUNS] [SECONDS]
#
# "after" is this tree's release build. One mbal server (`-t 1`, this tree's)
# and the load generator (`mbal bench`, plain text) on core $SERVER_CPU
# (default 0); the proxy under test alone on core $PROXY_CPU (default 1), one
# thread, no TLS, no login. For each scenario, before and after alternate
# RUNS times (default 5). Reported as medians: throughput and the proxy's CPU
# time per request (utime+stime from /proc/PID/stat over the run), and the
# after/before ratios. QUOTA=P holds each proxy to P% of one core (a CFS quota,
# scripts/lib/cpu_quota.sh) so that both are saturated: then only the
# pipelined scenarios run, and the throttled share of quota periods is shown
# (near 100%: the proxy was the bottleneck). Loopback only; kills only the
# processes it started, by pid. Run it under `flock /tmp/bench.lock` on a
# shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: scripts/bench-proxy-ab.sh BEFORE_BIN [RUNS] [SECONDS]}
RUNS=${2:-5}
SECS=${3:-3}
SERVER_CPU=${SERVER_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
OUT=${OUT:-results/proxy-ab}
[ -n "${QUOTA:-}" ] && OUT=${OUT%/}-quota
KEYS=${KEYS:-100000}
source scripts/lib/loopback.sh
source scripts/lib/cpu_quota.sh
AFTER=$BIN
mkdir -p "$OUT"

start_server mbal 1 "$SERVER_CPU"
SPID=$PID SPORT=$PORT
PID=""
PPID_=""
stop_proxy() { if [ -n "$PPID_" ]; then kill "$PPID_" 2>/dev/null && { wait "$PPID_" 2>/dev/null || true; }; fi; PPID_=""; return 0; }
cleanup() { stop_proxy; kill "$SPID" 2>/dev/null && wait "$SPID" 2>/dev/null; quota_cleanup; }
trap cleanup EXIT
quota_setup
wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }

start_proxy() { # binary -> sets PPID_ and TPORT
  for _try in 1 2 3 4 5; do
    TPORT=$((21000 + RANDOM % 20000))
    taskset -c "$PROXY_CPU" "$1" proxy --server 127.0.0.1:"$SPORT" -l 127.0.0.1 -p "$TPORT" -t 1 2>/dev/null &
    PPID_=$!
    quota_add "$PPID_"
    wait_port "$TPORT" && kill -0 "$PPID_" 2>/dev/null && return 0
    stop_proxy
  done
  echo "proxy $1 did not start" >&2
  exit 1
}
proxy_ticks() { awk '{print $14+$15}' "/proc/$PPID_/stat"; }

taskset -c "$SERVER_CPU" "$AFTER" bench --server 127.0.0.1:"$SPORT" --keys "$KEYS" --load-only --quiet >/dev/null

scenario() { # name, bench args...
  local name=$1; shift
  echo "== $name: $*" >&2
  for r in $(seq "$RUNS"); do
    for side in before after; do
      local bin=$BEFORE; [ "$side" = after ] && bin=$AFTER
      start_proxy "$bin"
      local c0 g0 g1; c0=$(proxy_ticks); g0=$(quota_periods)
      taskset -c "$SERVER_CPU" "$AFTER" bench --server 127.0.0.1:"$TPORT" --keys "$KEYS" --duration "$SECS" --quiet \
        --json "$OUT/$name.$side.$r.json" "$@" >/dev/null
      local c1; c1=$(proxy_ticks); g1=$(quota_periods)
      echo "$(( c1 - c0 ))" >"$OUT/$name.$side.$r.cpu"
      read -r p0 t0 <<<"$g0"; read -r p1 t1 <<<"$g1"
      echo "$(( p1 - p0 )) $(( t1 - t0 ))" >"$OUT/$name.$side.$r.periods"
      stop_proxy
    done
  done
}

scenario get     --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario set     --workload uniform --read-ratio 0 --conns 8 --pipeline 16
[ -z "${QUOTA:-}" ] && scenario lat_get --workload uniform --read-ratio 1 --conns 1 --pipeline 1

python3 scripts/lib/pair_summary.py "$OUT" "$RUNS" "$HZ" before after

#!/usr/bin/env bash
# Balancer experiments on one machine, with emulated per-worker capacity (issue 9):
#
#   scripts/bench-balance.sh capacity   one capped worker, open-loop rate sweep: throughput
#                                       levels off at the cap, p99 rises as the load nears it
#   scripts/bench-balance.sh balance    the local balancer (Phase 2) off and on, same run: for
#                                       each topology and workload, RUNS times each of
#                                       `--balancer off` and `--balancer on` on a fresh cluster
#                                       (every worker capped), the same keys, workload and
#                                       open-loop offered rate; reports per-worker max/avg at the
#                                       hotspot's onset and once settled (the servers' epochs,
#                                       `mbal load`), p99 and throughput at the fixed rate after
#                                       the settle period, the maximum throughput at a p99 target
#                                       (a rate sweep on the same cluster, after the fixed run),
#                                       the settle time, and the moves made; medians over the
#                                       runs and the on/off ratios
#   scripts/bench-balance.sh hotkeys    Phase 1 (hot-key replication) off and on, same run, as
#                                       `balance` does for Phase 2 (the local balancer off in both
#                                       modes): default 8x2, MBal's workload A (100% read, Zipf
#                                       0.99) and `shift` (the same, its hot set replaced by
#                                       another halfway: the time until max/avg is back under 1.2
#                                       is the reaction time); adds the keys replicated, the copies
#                                       made, their memory and the reads the copies served
#   scripts/bench-balance.sh proxy      an unmodified pymemcache client through `mbal proxy`
#                                       (issue 11), balancer off vs on, same run: YCSB workload A
#                                       (50% read / 50% update, YCSB's scrambled Zipfian 0.99,
#                                       scripts/lib/ycsb_driver.py, open loop) through
#                                       `mbal proxy --cluster` in front of a fresh 2 x 4 cluster
#                                       per run, every worker capped at CAP (default 500 here),
#                                       KEYS (default 10,000 here) loaded through the proxy first;
#                                       off = `--balancer off --hot-keys off`, on = both on
#                                       (Phase 2 and Phase 1); reports per-worker max/avg (the
#                                       servers' epochs, `mbal load`), throughput and p99 after
#                                       SETTLE, the moves made and the reads served by copies
#   scripts/bench-balance.sh all        capacity and balance (the default)
#
# The hotspot starts with the measured phase: the keys are loaded first (uniform SETs), then
# the workload runs at the fixed rate from t = 0. Settle time: from t = 0 to the start of the
# first window from which every window's per-worker max/avg stays <= SETTLED_AT (1.15), "never"
# if the last windows are above it (windows: the servers' epochs merged into at least 1 s, so
# two of the default 500 ms epochs); and the first second from which every second's p99 stays
# within P99_TARGET_US (the backlog built up before the moves has drained).
#
# Knobs (environment): CAP per-worker capacity, requests/s (default 2000; 4000 for hotkeys); LOAD offered load as
# a fraction of the cluster's total capacity (default 0.7); SECS seconds of the fixed-rate run
# (default 20); SETTLE seconds at its start left out of the "settled" figures (default 8);
# RUNS runs per mode (default 3); MODES (default "off on"); WORKLOADS (default "zipf hotpart");
# TOPOLOGIES (default "1x4 8x2"); SWEEP 1/0: the rate sweep after the fixed run (default 1);
# SWEEP_SECS seconds per rate (default 4); P99_TARGET_US (default 20000); KEYS (default 50000);
# HOT_CACHELETS and HOT_OPS for the hot partition (4, 0.5); CONNS and PIPELINE the bench's logical
# clients and each one's pipeline (default 8 and 64; 64 and 8 for hotkeys: each logical client
# has its own lease cache, so a hot key's reads spread over its copies only with many clients);
# WAIT_UP seconds to wait for `cluster up` (default 90); SERVER_ARGS more server arguments
# for both modes (e.g. "--balance-persistence 2"); OUT (default results/balance). Every run is
# bounded in time (--duration, --drain, a bounded load phase) and in requests (--max-ops).
# `proxy` mode knobs: TOPOLOGY_PROXY (default 2x4), PROXY_THREADS (`mbal proxy -t`, default 2),
# UPSTREAM_TIMEOUT_MS (default 30000: a saturated worker's backlog takes seconds, and the proxy
# fails what waits longer), DRIVER_PROCS x DRIVER_CONNS pymemcache clients (default 2 x 64: the
# requests the driver can have in flight), YCSB_DIST (scrambled: YCSB workload A's own key
# choice; zipfian, the default: YCSB's ZipfianGenerator over the records, whose steeper head
# saturates a worker at this load), and CAP, KEYS, LOAD, SECS, SETTLE, RUNS as above.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
if [ "$MODE" = proxy ]; then
  CAP=${CAP:-500}
  KEYS=${KEYS:-10000}
fi
# hotkeys: 4,000 req/s per worker (2,800 per worker and epoch at LOAD 0.7), so that Poisson noise
# alone (max of 16 workers ~1.8 sd, 1.9% each) leaves room under the 1.2 of the reaction time
# (at 1,000 it was ~1.07 of the 1.10 goal); the machine keeps up (docs/benchmarks-journal.md §15).
[ "$MODE" = hotkeys ] && CAP=${CAP:-4000}
CAP=${CAP:-2000}
LOAD=${LOAD:-0.7}
SECS=${SECS:-20}
SETTLE=${SETTLE:-8}
RUNS=${RUNS:-3}
MODES=${MODES:-"off on"}
WORKLOADS=${WORKLOADS:-"zipf hotpart"}
SWEEP=${SWEEP:-1}
P99_TARGET_US=${P99_TARGET_US:-20000}
SETTLED_AT=${SETTLED_AT:-1.15}
KEYS=${KEYS:-50000}
HOT_CACHELETS=${HOT_CACHELETS:-4}
HOT_OPS=${HOT_OPS:-0.5}
TOPOLOGIES=${TOPOLOGIES:-"1x4 8x2"}
SWEEP_SECS=${SWEEP_SECS:-4}
SERVER_ARGS=${SERVER_ARGS:-}
OUT=${OUT:-results/balance}
WAIT_UP=${WAIT_UP:-90}
# The server flag the modes toggle (`--KNOB off|on`).
KNOB=${KNOB:-balancer}
if [ "$MODE" = hotkeys ]; then
  KNOB=hot-keys
  WORKLOADS=${WORKLOADS_HOT:-"zipf shift"}
  TOPOLOGIES=${TOPOLOGIES_HOT:-"8x2"}
  SERVER_ARGS="--balancer off ${SERVER_ARGS}"
  OUT=${OUT_HOT:-results/hotkeys}
  CONNS=${CONNS:-64}
  PIPELINE=${PIPELINE:-8}
elif [ "$MODE" = balance ] || [ "$MODE" = all ]; then
  # Phase 2 alone: Phase 1 is on by default in a cluster of two or more servers, which would
  # balance in both modes (docs/benchmarks.md §10 isolates Phase 2; `both` runs them together).
  SERVER_ARGS="--hot-keys off ${SERVER_ARGS}"
fi
CONNS=${CONNS:-8}
PIPELINE=${PIPELINE:-64}
mkdir -p "$OUT"
# MONITOR=1 (default): record the machine alongside (scripts/lib/machine_monitor.py: CPU, CPU
# pressure and every other process's CPU, timestamped) in $OUT/machine.jsonl, so that a bad
# second of a run can be told apart from a busy machine (docs/benchmarks-journal.md §15, round 6).
MON_PID=""
if [ "${MONITOR:-1}" = 1 ]; then
  python3 scripts/lib/machine_monitor.py "$OUT/machine.jsonl" --mine $$ &
  MON_PID=$!
fi
# BIN: an mbal binary to use as is (default: build the release binary and use it).
if [ -z "${BIN:-}" ]; then
  cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
  BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
fi
PID=""
PROXY_PID=""
stop_proxy() { [ -n "$PROXY_PID" ] && kill -INT "$PROXY_PID" 2>/dev/null && wait "$PROXY_PID" 2>/dev/null; PROXY_PID=""; return 0; }
# Whether process $1 runs (not exited, nor exited and not yet waited for).
running() { local st; st=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ "$st" != Z ]; }
# Stops the cluster: SIGINT, again every 0.1 s while it runs, for up to 10 s (one sent while
# `cluster up` was still being forked is ignored), then waits for it.
cleanup() {
  stop_proxy
  if [ -n "$PID" ]; then
    for _ in $(seq 100); do
      running "$PID" || break
      kill -INT "$PID" 2>/dev/null
      sleep 0.1
    done
    wait "$PID" 2>/dev/null
  fi
  PID=""
  return 0
}
stop_monitor() { [ -n "$MON_PID" ] && kill -INT "$MON_PID" 2>/dev/null && wait "$MON_PID" 2>/dev/null; MON_PID=""; return 0; }
trap 'cleanup; stop_monitor' EXIT

# Start `mbal cluster up` for SERVERS x WORKERS with the capacity; sets PID and FIRST (the
# first server's address). Waits (up to WAIT_UP s) for it to say it is up.
cluster_up() {
  local servers=$1 workers=$2 tag=$3 args=${4:-$SERVER_ARGS}
  # Emptied here, not only by the background job's redirection: that one may
  # run after the first look below, which would then find the previous
  # invocation's "Ctrl-C stops" (same tag), give up on an empty log and
  # interrupt the cluster between fork and exec, where SIGINT is ignored.
  : >"$OUT/$tag.cluster.log"
  # shellcheck disable=SC2086 # args is a list of arguments
  "$BIN" cluster up --servers "$servers" --workers "$workers" --worker-capacity "$CAP" -m 128 \
    --file "$OUT/$tag.cluster.toml" $(for a in $args; do printf -- '--server-arg=%s ' "$a"; done) \
    >"$OUT/$tag.cluster.log" 2>&1 &
  PID=$!
  for _ in $(seq $((WAIT_UP * 10))); do
    grep -q "Ctrl-C stops" "$OUT/$tag.cluster.log" 2>/dev/null && break
    kill -0 "$PID" 2>/dev/null || { cat "$OUT/$tag.cluster.log"; exit 1; }
    sleep 0.1
  done
  grep -q "Ctrl-C stops" "$OUT/$tag.cluster.log" || { echo "cluster did not come up in ${WAIT_UP} s"; exit 1; }
  FIRST=$(sed -n 's/^  server 0: \([0-9.:]*\) .*/\1/p' "$OUT/$tag.cluster.log")
}

# `stats balancer`, `stats hotkeys` (prefixed hk_) and the Phase 1 counters of `stats` of every
# server in a cluster file, as one JSON object per server.
stats_balancer() { # cluster.toml out.json
  python3 - "$1" "$2" <<'PY'
import json, sys
sys.path.insert(0, "scripts/lib")
from mcstats import cluster_addrs, stats
out = []
for addr in cluster_addrs(sys.argv[1]):
    one = {}
    for group, prefix in (("balancer", ""), ("hotkeys", "hk_"), ("", "")):
        for k, v in stats(addr, group).items():
            if group or k.startswith(("replica_", "hot_")):
                one.setdefault(prefix + k, v)
    out.append(one)
json.dump(out, open(sys.argv[2], "w"))
PY
}

if [ "$MODE" = capacity ] || [ "$MODE" = all ]; then
  echo "== capacity: one worker capped at $CAP req/s, open-loop sweep 25%..150% of the cap"
  "$BIN" server -p 0 -t 1 -m 128 --worker-capacity "$CAP" --print-ports >"$OUT/cap.ports.json" &
  PID=$!
  for _ in $(seq 100); do [ -s "$OUT/cap.ports.json" ] && break; sleep 0.05; done
  MAIN=$(python3 -c "import json;print(json.load(open('$OUT/cap.ports.json'))['main'])")
  step=$((CAP / 4))
  "$BIN" bench --routed --server "$MAIN" --keys 10000 --load --load-timeout 60 --workload uniform \
    --read-ratio 0.95 --conns 4 --pipeline 256 --rate-sweep "$step:$((CAP * 3 / 2)):$step" \
    --p99-target-us "${P99_TARGET_US:-20000}" --duration "$SWEEP_SECS" --max-ops $((CAP * SWEEP_SECS * 2)) --drain 10 \
    --quiet --json "$OUT/capacity.json" --plot "$OUT/capacity.svg" >/dev/null
  cleanup
  python3 - "$OUT/capacity.json" "$CAP" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); cap = int(sys.argv[2]); sw = r["sweep"]
print(f"  {'offered':>8} {'ops/s':>8} {'of cap':>7} {'p50 us':>9} {'p99 us':>9} {'p99.9 us':>9}")
for s in sw["steps"]:
    print(f"  {s['offered_ops_per_sec']:8.0f} {s['ops_per_sec']:8.0f} {s['ops_per_sec'] / cap:7.2f} "
          f"{s['p50_us']:9.0f} {s['p99_us']:9.0f} {s['p999_us']:9.0f}")
print(f"  max throughput at p99 <= {sw['p99_target_us']:.0f} us: {sw['max_ops_per_sec_at_target']} ops/s")
PY
  echo "  plot: $OUT/capacity.svg"
fi

if [ "$MODE" = balance ] || [ "$MODE" = hotkeys ] || [ "$MODE" = all ]; then
  for topo in $TOPOLOGIES; do
    servers=${topo%x*}; workers=${topo#*x}
    total=$((servers * workers * CAP))
    rate=$(python3 -c "print(int($total * $LOAD))")
    step=$((total / 16))
    for wl in $WORKLOADS; do
      case $wl in
        zipf) wargs=(--workload a --zipf 0.99) ;;
        hotpart) wargs=(--workload hotpart --hot-cachelets "$HOT_CACHELETS" --hot-ops "$HOT_OPS") ;;
        shift) wargs=(--phases "a:$((SECS / 2)),a@1:$((SECS - SECS / 2))" --zipf 0.99) ;;
        *) echo "unknown workload $wl"; exit 1 ;;
      esac
      for run in $(seq "$RUNS"); do
        for mode in $MODES; do
          tag="$topo.$wl.$mode.$run"
          echo "== $tag: $servers servers x $workers workers at $CAP req/s each, $wl at $rate ops/s, $KNOB $mode ${SERVER_ARGS}"
          cluster_up "$servers" "$workers" "$tag" "--$KNOB $mode $SERVER_ARGS"
          "$BIN" bench --routed --server "$FIRST" --keys "$KEYS" --load --load-timeout 120 "${wargs[@]}" \
            --conns "$CONNS" --pipeline "$PIPELINE" --rate "$rate" --duration "$SECS" --settle "$SETTLE" \
            --max-ops $((rate * SECS * 2)) --drain 10 --quiet --json "$OUT/$tag.json" --plot "$OUT/$tag.svg" >/dev/null
          if [ "$SWEEP" = 1 ]; then
            # Same cluster, keys already loaded: the balancer (on) has settled during the run above.
            # The same hot cachelets as that run (by id: the hot worker's cachelets are others now).
            hot=()
            sw=("${wargs[@]}")
            # The sweep measures the hot set the run ended with.
            [ "$wl" = shift ] && sw=(--phases "a@1:$SWEEP_SECS" --zipf 0.99)
            if [ "$wl" = hotpart ]; then
              hot=(--hot-cachelet-ids "$(python3 -c "import json,sys;print(','.join(map(str,json.load(open(sys.argv[1]))['hot_cachelets'])))" "$OUT/$tag.json")")
            fi
            "$BIN" bench --routed --server "$FIRST" --keys "$KEYS" "${sw[@]}" "${hot[@]}" --conns "$CONNS" --pipeline "$PIPELINE" \
              --rate-sweep "$((step * 4)):$total:$step" --p99-target-us "$P99_TARGET_US" --duration "$SWEEP_SECS" \
              --max-ops $((total * SWEEP_SECS * 2)) --drain 10 --quiet --json "$OUT/$tag.sweep.json" >/dev/null
          fi
          stats_balancer "$OUT/$tag.cluster.toml" "$OUT/$tag.stats.json"
          cleanup
        done
      done
      KNOB=$KNOB SHIFT_AT=$([ "$wl" = shift ] && echo $((SECS / 2)) || echo "") \
        python3 scripts/lib/balance_report.py "$OUT" "$topo" "$wl" "$RUNS" "$MODES" "$SETTLED_AT" "$P99_TARGET_US" | tee "$OUT/$topo.$wl.report.md"
      # Each second of every run beside the machine (raw: machine.jsonl; every second: machine.md).
      if [ -n "$MON_PID" ]; then
        python3 scripts/lib/machine_report.py "$OUT" "$P99_TARGET_US" --all >"$OUT/machine.md" || true
        echo "machine (every second in $OUT/machine.md):"
        tail -n 11 "$OUT/machine.md"
      fi
    done
  done
fi

if [ "$MODE" = proxy ]; then
  python3 -c 'import pymemcache, hdrh' 2>/dev/null || python3 -m pip install -q pymemcache hdrhistogram
  python3 scripts/lib/ycsb_driver.py selftest >"$OUT/ycsb-selftest.txt" || { cat "$OUT/ycsb-selftest.txt"; exit 1; }
  topo=${TOPOLOGY_PROXY:-2x4}
  servers=${topo%x*}; workers=${topo#*x}
  total=$((servers * workers * CAP))
  rate=$(python3 -c "print(int($total * $LOAD))")
  PROXY_THREADS=${PROXY_THREADS:-2}
  UPSTREAM_TIMEOUT_MS=${UPSTREAM_TIMEOUT_MS:-30000}
  DRIVER_PROCS=${DRIVER_PROCS:-2}
  DRIVER_CONNS=${DRIVER_CONNS:-64}
  ptopo="proxy-$topo"
  YCSB_DIST=${YCSB_DIST:-zipfian}
  wl="ycsba-$YCSB_DIST"
  for run in $(seq "$RUNS"); do
    for mode in $MODES; do
      tag="$ptopo.$wl.$mode.$run"
      echo "== $tag: $servers servers x $workers workers at $CAP req/s each, YCSB A ($YCSB_DIST) through mbal proxy at $rate ops/s, balancer and hot keys $mode"
      cluster_up "$servers" "$workers" "$tag" "--balancer $mode --hot-keys $mode $SERVER_ARGS"
      "$BIN" proxy --cluster "$OUT/$tag.cluster.toml" -l 127.0.0.1 -p 0 -t "$PROXY_THREADS" \
        --upstream-timeout-ms "$UPSTREAM_TIMEOUT_MS" --print-ports >"$OUT/$tag.proxy.ports" 2>"$OUT/$tag.proxy.log" &
      PROXY_PID=$!
      for _ in $(seq 100); do [ -s "$OUT/$tag.proxy.ports" ] && break; kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.05; done
      PROXY=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['main'])" "$OUT/$tag.proxy.ports") ||
        { cat "$OUT/$tag.proxy.log"; exit 1; }
      python3 scripts/lib/ycsb_driver.py load --server "$PROXY" --records "$KEYS" --conns 8 --timeout 120
      python3 scripts/lib/ycsb_driver.py run --server "$PROXY" --records "$KEYS" --rate "$rate" --duration "$SECS" \
        --settle "$SETTLE" --max-ops $((rate * SECS * 2)) --drain 10 --procs "$DRIVER_PROCS" --conns "$DRIVER_CONNS" \
        --seed "$run" --distribution "$YCSB_DIST" --cluster "$OUT/$tag.cluster.toml" --json "$OUT/$tag.json"
      stats_balancer "$OUT/$tag.cluster.toml" "$OUT/$tag.stats.json"
      # The proxy's own counters (replica reads, upstream errors and timeouts).
      python3 scripts/lib/mcstats.py "$PROXY" "" "$OUT/$tag.proxystats.json"
      cleanup
    done
  done
  KNOB=balancer+hot-keys python3 scripts/lib/balance_report.py "$OUT" "$ptopo" "$wl" "$RUNS" "$MODES" "$SETTLED_AT" "$P99_TARGET_US" |
    tee "$OUT/$ptopo.$wl.report.md"
fi

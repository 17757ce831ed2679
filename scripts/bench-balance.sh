#!/usr/bin/env bash
# Balancer experiments on one machine, with emulated per-worker capacity (issue 9 §2):
#
#   scripts/bench-balance.sh capacity   one capped worker, open-loop rate sweep: throughput
#                                       levels off at the cap, p99 rises as the load nears it
#   scripts/bench-balance.sh balance    1 server x 4 workers and 8 servers x 2 workers, each
#                                       worker capped; Zipf 0.99 and the hot partition at a
#                                       fixed offered rate; per-worker max/avg (the client's
#                                       counts and the servers' own), p99, throughput
#   scripts/bench-balance.sh all        both (the default)
#
# The servers' arguments come from SERVER_ARGS, so a balancer-off and a balancer-on run are one
# line each (once `mbal server --balancer` exists):
#   SERVER_ARGS="--balancer off" scripts/bench-balance.sh balance
#   SERVER_ARGS="--balancer on"  scripts/bench-balance.sh balance
#
# Knobs (environment): CAP per-worker capacity, requests/s (default 2000); LOAD offered load as
# a fraction of the cluster's total capacity (default 0.6); SECS seconds per run (default 15);
# SETTLE seconds at the start of each run left out of the "settled" figures (default 5);
# KEYS (default 50000); HOT_CACHELETS and HOT_OPS for the hot partition (4, 0.5); TOPOLOGIES
# (default "1x4 8x2"); SWEEP_SECS seconds per rate of the capacity sweep (default 4);
# OUT (default results/balance). Every run is bounded in time (--duration, --drain, a bounded
# load phase) and in requests (--max-ops).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
CAP=${CAP:-2000}
LOAD=${LOAD:-0.6}
SECS=${SECS:-15}
SETTLE=${SETTLE:-5}
KEYS=${KEYS:-50000}
HOT_CACHELETS=${HOT_CACHELETS:-4}
HOT_OPS=${HOT_OPS:-0.5}
TOPOLOGIES=${TOPOLOGIES:-"1x4 8x2"}
SWEEP_SECS=${SWEEP_SECS:-4}
SERVER_ARGS=${SERVER_ARGS:-}
OUT=${OUT:-results/balance}
mkdir -p "$OUT"
cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
PID=""
cleanup() { [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; PID=""; }
trap cleanup EXIT

# Start `mbal cluster up` for SERVERS x WORKERS with the capacity; sets PID and FIRST (the
# first server's address). Waits (bounded) for it to say it is up.
cluster_up() {
  local servers=$1 workers=$2 tag=$3
  # shellcheck disable=SC2086 # SERVER_ARGS is a list of arguments
  "$BIN" cluster up --servers "$servers" --workers "$workers" --worker-capacity "$CAP" -m 128 \
    --file "$OUT/$tag.cluster.toml" $(for a in $SERVER_ARGS; do printf -- '--server-arg=%s ' "$a"; done) \
    >"$OUT/$tag.cluster.log" 2>&1 &
  PID=$!
  for _ in $(seq 300); do
    grep -q "Ctrl-C stops" "$OUT/$tag.cluster.log" 2>/dev/null && break
    kill -0 "$PID" 2>/dev/null || { cat "$OUT/$tag.cluster.log"; exit 1; }
    sleep 0.1
  done
  grep -q "Ctrl-C stops" "$OUT/$tag.cluster.log" || { echo "cluster did not come up"; exit 1; }
  FIRST=$(sed -n 's/^  server 0: \([0-9.:]*\) .*/\1/p' "$OUT/$tag.cluster.log")
}

summary() { # json settle
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); settle = float(sys.argv[2])
t, lat = r["totals"], r["latency"].get("all", {})
def spread(v):
    avg = sum(v) / len(v) if v else 0
    return (max(v) / avg if avg else 0, max(v) if v else 0, avg)
# the client's own counts per worker, over the settled seconds
secs = [s for s in r["timeline"] if s["t"] >= settle]
per = [sum(s["targets"][j] for s in secs) / max(len(secs), 1) for j in range(len(r["balance"]["targets"]))]
c = spread(per)
line = (f"  {t['ops_per_sec']:8.0f} ops/s (offered {t['target_rate']:.0f}), p50 {lat.get('p50_us', 0):8.0f} us, "
        f"p99 {lat.get('p99_us', 0):9.0f} us, unfinished {t['unfinished']}; "
        f"client per-worker max/avg {c[0]:.2f} (settled: max {c[1]:.0f} avg {c[2]:.0f} req/s)")
load = r.get("server_load") or {}
eps = [e for e in load.get("epochs", []) if e["t_end"] - e["secs"] >= settle]
if eps:
    ws = {}
    for e in eps:
        for w in e["workers"]:
            ws.setdefault((w["server"], w["worker"]), []).append(w["ops_per_sec"])
    s = spread([sum(v) / len(v) for v in ws.values()])
    line += f"; servers' per-worker max/avg {s[0]:.2f} (max {s[1]:.0f} avg {s[2]:.0f} req/s, {len(eps)} epochs)"
line += f"; moves {len(load.get('events', []))}"
print(line)
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

if [ "$MODE" = balance ] || [ "$MODE" = all ]; then
  for topo in $TOPOLOGIES; do
    servers=${topo%x*}; workers=${topo#*x}
    total=$((servers * workers * CAP))
    rate=$(python3 -c "print(int($total * $LOAD))")
    for wl in zipf hotpart; do
      tag="$topo.$wl"
      echo "== $topo ($servers servers x $workers workers, $CAP req/s each), $wl at $rate ops/s; server args: '${SERVER_ARGS}'"
      cluster_up "$servers" "$workers" "$tag"
      case $wl in
        zipf) wargs=(--workload a --zipf 0.99) ;;
        hotpart) wargs=(--workload hotpart --hot-cachelets "$HOT_CACHELETS" --hot-ops "$HOT_OPS") ;;
      esac
      "$BIN" bench --routed --server "$FIRST" --keys "$KEYS" --load --load-timeout 120 "${wargs[@]}" \
        --conns 8 --pipeline 64 --rate "$rate" --duration "$SECS" --max-ops $((rate * SECS * 2)) \
        --drain 10 --quiet --json "$OUT/$tag.json" --plot "$OUT/$tag.svg" >/dev/null
      cleanup
      summary "$OUT/$tag.json" "$SETTLE"
    done
  done
fi

#!/usr/bin/env bash
# Loopback benchmark of `mbal proxy` against twemproxy (nutcracker), same
# servers, same generator, same run.
#
#   scripts/bench-proxy.sh [RUNS] [SECONDS]
#
# One mbal server (`-t 1`) on core $SERVER_CPU (default 0) with the load
# generator (`mbal bench`, plain memcached text client) on the same core; the
# proxy under test alone on core $PROXY_CPU (default 1), one thread
# (`mbal proxy -t 1`; twemproxy is single-threaded). twemproxy is pointed at
# the same server (one pool, ketama, fnv1a_64). For each scenario the three
# targets -- the server directly, mbal proxy, twemproxy -- alternate RUNS
# times (default 3). Reported, as medians: throughput, the proxy's CPU time
# per request (utime+stime from /proc/PID/stat over the run; without QUOTA
# neither proxy is saturated, so this favours the busier one: for throughput
# per proxy core use QUOTA, below),
# and for the unloaded scenarios (one connection, one request at a time)
# p50/p99 latency and what the proxy adds to the direct figure.
# Placement knobs: PROXY_CPUS, a space-separated list of cores (default
# $PROXY_CPU), measures the proxies once per listed core in the same run
# (e.g. PROXY_CPUS="1 0": alone on core 1, then on the client's core 0 as a
# sidecar pinned with the application); CLIENT_CPU (default $SERVER_CPU) pins
# the generator. ONLY=lat_get,lat_set,... runs only the named scenarios.
# Throughput per proxy core: QUOTA=P holds each proxy to P% of one core (a
# CFS bandwidth quota: a cgroup of its own, cgroup v1 `cpu` or v2 `cpu.max`,
# created for the run and removed after; period QUOTA_PERIOD_US, default
# 20000), so that the proxy, not the server or the generator, is the
# bottleneck and both proxies are compared at the same CPU budget, both
# saturated. Then only the throughput scenarios run (unless ONLY says
# otherwise), and the summary adds how much of its quota each proxy used and
# how many quota periods ended throttled (near 100%: the proxy was the
# bottleneck); per-core throughput = ops/s / cores used.
# Fan-out: BACKENDS=N (N > 1) puts each proxy in front of N servers (`-t 1`
# each, all on $SERVER_CPU): mbal proxy in front of an N-server mbal cluster
# (`mbal cluster up --workers 1`, its cluster file), twemproxy in front of N
# standalone mbal servers started with the same flags (a cluster member
# answers a key another member owns as a miss, and twemproxy's ketama does not
# follow mbal's map, so the two proxies cannot share the N processes). "direct"
# is then mbal's routed client against the cluster. Each store is loaded
# through the target that reads it (the cluster by the routed client, the
# standalone servers through twemproxy), again whenever a scenario's key or
# value shape (--key-size* / --value-size*) differs from the last one loaded.
# The default scenarios then are the two multi-get configurations of issue 37
# (mget_8x4: 8 connections x 4 100-key gets in flight, 16 B keys; mget_fanout:
# 4 x 2 with 10-24 B keys and 20-64 B values).
# JSON reports land in $OUT (default results/proxy). Loopback only; kills
# only the processes it started, by pid.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
SECS=${2:-3}
SERVER_CPU=${SERVER_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
PROXY_CPUS=${PROXY_CPUS:-$PROXY_CPU}
CLIENT_CPU=${CLIENT_CPU:-$SERVER_CPU}
OUT=${OUT:-results/proxy}
[ -n "${QUOTA:-}" ] && OUT=${OUT%/}-quota
KEYS=${KEYS:-100000}
ONLY=${ONLY:-}
BACKENDS=${BACKENDS:-1}
[ "$BACKENDS" -gt 1 ] && OUT=${OUT%/}-x$BACKENDS
[ "$BACKENDS" -gt 1 ] && [ -z "$ONLY" ] && ONLY=mget_8x4,mget_fanout
[ -n "${QUOTA:-}" ] && [ -z "$ONLY" ] && ONLY=get,mget100,set
[ -z "$ONLY" ] && ONLY=get,mget100,set,lat_get,lat_mget100,lat_set
source scripts/lib/loopback.sh
source scripts/lib/cpu_quota.sh
command -v nutcracker >/dev/null || { echo "nutcracker is not installed (apt-get install nutcracker)" >&2; exit 1; }
mkdir -p "$OUT"

# SPIDS: every server process started here (the standalone servers, and `cluster up`);
# SPORT: the one server (BACKENDS=1); TWEM_PORTS: twemproxy's servers; CLUSTER, FIRST: the cluster.
SPIDS=() TWEM_PORTS=() CLUSTER="" FIRST="" SPORT=""
PPID_=""
stop_proxy() { if [ -n "$PPID_" ]; then kill "$PPID_" 2>/dev/null && { wait "$PPID_" 2>/dev/null || true; }; fi; PPID_=""; return 0; }
cleanup() {
  stop_proxy
  local p
  for p in "${SPIDS[@]}"; do kill -INT "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
  quota_cleanup
}
trap cleanup EXIT

if [ "$BACKENDS" = 1 ]; then
  start_server mbal 1 "$SERVER_CPU"
  SPIDS+=("$PID") SPORT=$PORT TWEM_PORTS=("$PORT")
  PID=""
else
  for _ in $(seq "$BACKENDS"); do
    start_server mbal 1 "$SERVER_CPU"
    SPIDS+=("$PID") TWEM_PORTS+=("$PORT")
    PID=""
  done
  CLUSTER=$OUT/cluster.toml
  : >"$OUT/cluster.log"
  # `cluster up` and every server it starts run on $SERVER_CPU (taskset's mask is inherited)
  taskset -c "$SERVER_CPU" "$BIN" cluster up --servers "$BACKENDS" --workers 1 -m "$MEM" --file "$CLUSTER" \
    >"$OUT/cluster.log" 2>&1 &
  SPIDS+=("$!")
  for _ in $(seq 300); do grep -q "Ctrl-C stops" "$OUT/cluster.log" && break; sleep 0.1; done
  grep -q "Ctrl-C stops" "$OUT/cluster.log" || { cat "$OUT/cluster.log" >&2; echo "the cluster did not come up" >&2; exit 1; }
  FIRST=$(sed -n 's/^  server 0: \([0-9.:]*\) .*/\1/p' "$OUT/cluster.log")
fi

quota_setup

wait_port() { for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }

start_proxy() { # kind, cpu -> sets PPID_ and TPORT
  local kind=$1 cpu=$2
  for _try in 1 2 3 4 5; do
    TPORT=$((21000 + RANDOM % 20000))
    case $kind in
      mbal)
        local up=(--server 127.0.0.1:"$SPORT"); [ -n "$CLUSTER" ] && up=(--cluster "$CLUSTER")
        taskset -c "$cpu" "$BIN" proxy "${up[@]}" -l 127.0.0.1 -p "$TPORT" -t 1 2>/dev/null & ;;
      twemproxy)
        local conf="$OUT/nutcracker.yml"
        cat >"$conf" <<EOF
mbal:
  listen: 127.0.0.1:$TPORT
  hash: fnv1a_64
  distribution: ketama
  timeout: 1000
  auto_eject_hosts: false
  servers:
$(for p in "${TWEM_PORTS[@]}"; do echo "   - 127.0.0.1:$p:1"; done)
EOF
        local sport=$((TPORT + 1))
        taskset -c "$cpu" nutcracker -c "$conf" -s "$sport" -a 127.0.0.1 -o "$OUT/nutcracker.log" \
          -p "$OUT/nutcracker.pid" 2>/dev/null & ;;
    esac
    PPID_=$!
    # every thread of the process moves (cgroup.procs), and threads it starts later follow
    quota_add "$PPID_"
    wait_port "$TPORT" && kill -0 "$PPID_" 2>/dev/null && return 0
    stop_proxy
  done
  echo "$kind did not start" >&2
  exit 1
}

proxy_ticks() { awk '{print $14+$15}' "/proc/$PPID_/stat"; }

# The generator's arguments for a target: where it sends (sets ADDR).
target_args() { # target port
  if [ "$1" = direct ] && [ -n "$CLUSTER" ]; then ADDR=(--routed --server "$FIRST")
  else ADDR=(--server 127.0.0.1:"$2"); fi
}
LOADED=unloaded
load_shape() { # shape args...: loads every store with KEYS keys of this shape, unless it is the last loaded
  local shape="$*"
  [ "$shape" = "$LOADED" ] && return 0
  if [ -z "$CLUSTER" ]; then
    taskset -c "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:"$SPORT" --keys "$KEYS" --load-only --quiet "$@" >/dev/null
  else
    taskset -c "$CLIENT_CPU" "$BIN" bench --routed --server "$FIRST" --keys "$KEYS" --load-only --quiet "$@" >/dev/null
    start_proxy twemproxy "${PROXY_CPUS%% *}"
    taskset -c "$CLIENT_CPU" "$BIN" bench --server 127.0.0.1:"$TPORT" --keys "$KEYS" --load-only --quiet "$@" >/dev/null
    stop_proxy
  fi
  LOADED=$shape
}

# Targets: direct, then mbal and twemproxy once per placement; with one
# placement they are named mbal/twemproxy (as before), else mbal-cpuN/twemproxy-cpuN.
TARGETS=(direct)
for c in $PROXY_CPUS; do
  if [ "$(wc -w <<<"$PROXY_CPUS")" = 1 ]; then TARGETS+=("mbal:$c" "twemproxy:$c")
  else TARGETS+=("mbal-cpu$c:$c" "twemproxy-cpu$c:$c"); fi
done

scenario() { # name, bench args...
  local name=$1; shift
  [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]] && return 0
  echo "== $name: $*" >&2
  local shape=() a=("$@") i
  for ((i = 0; i < ${#a[@]}; i++)); do
    case ${a[i]} in --key-size|--key-size-max|--value-size|--value-size-max) shape+=("${a[i]}" "${a[i+1]}");; esac
  done
  load_shape "${shape[@]}"
  for r in $(seq "$RUNS"); do
    for t in "${TARGETS[@]}"; do
      local target=${t%%:*} cpu=${t#*:} port=$SPORT
      if [ "$target" != direct ]; then start_proxy "${target%%-cpu*}" "$cpu"; port=$TPORT; fi
      local c0=0; [ "$target" != direct ] && c0=$(proxy_ticks)
      local g0; g0=$(quota_periods)
      target_args "$target" "$port"
      taskset -c "$CLIENT_CPU" "$BIN" bench "${ADDR[@]}" --keys "$KEYS" --duration "$SECS" --quiet \
        --json "$OUT/$name.$target.$r.json" "$@" >/dev/null
      local c1=0; [ "$target" != direct ] && c1=$(proxy_ticks)
      local g1; g1=$(quota_periods)
      echo "$(( c1 - c0 ))" >"$OUT/$name.$target.$r.cpu"
      read -r p0 t0 <<<"$g0"; read -r p1 t1 <<<"$g1"
      echo "$(( p1 - p0 )) $(( t1 - t0 ))" >"$OUT/$name.$target.$r.periods"
      stop_proxy
    done
  done
}

# throughput: 8 connections x 16 requests in flight
scenario get        --workload uniform --read-ratio 1 --conns 8 --pipeline 16
scenario mget100    --workload uniform --read-ratio 1 --multiget 100 --conns 8 --pipeline 4
scenario set        --workload uniform --read-ratio 0 --conns 8 --pipeline 16
# latency: one connection, one request at a time
scenario lat_get     --workload uniform --read-ratio 1 --conns 1 --pipeline 1
scenario lat_mget100 --workload uniform --read-ratio 1 --multiget 100 --conns 1 --pipeline 1
scenario lat_set     --workload uniform --read-ratio 0 --conns 1 --pipeline 1
# issue 37's two multi-get configurations (the default with BACKENDS > 1)
scenario mget_8x4    --workload uniform --read-ratio 1 --multiget 100 --conns 8 --pipeline 4 --key-size 16
scenario mget_fanout --workload uniform --read-ratio 1 --multiget 100 --conns 4 --pipeline 2 \
  --key-size 10 --key-size-max 24 --value-size 20 --value-size-max 64

QUOTA=$QUOTA SECS=$SECS python3 - "$OUT" "$RUNS" "$HZ" $PROXY_CPUS <<'PY'
import json, statistics, sys, os
out, runs, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cpus = sys.argv[4:]
quota, secs = os.environ.get("QUOTA", ""), float(os.environ["SECS"])
places = [("", "")] if len(cpus) == 1 else [(f"-cpu{c}", f" (proxy on core {c})") for c in cpus]
med = statistics.median
def load(n, t):
    rows = []
    for r in range(1, runs + 1):
        p = f"{out}/{n}.{t}.{r}.json"
        if os.path.exists(p):
            d = json.load(open(p))
            ticks = int(open(f"{out}/{n}.{t}.{r}.cpu").read())
            rows.append((d, ticks))
    return rows
def periods(n, t, r):
    p = f"{out}/{n}.{t}.{r}.periods"
    return [int(x) for x in open(p).read().split()] if os.path.exists(p) else [0, 0]
for sfx, label in places:
    M, W = "mbal" + sfx, "twemproxy" + sfx
    tput = ("get", "mget100", "set", "mget_8x4", "mget_fanout")
    if quota and any(load(n, M) for n in tput):
        print(f"PER PROXY CORE: each proxy held to {quota}% of one core (CFS quota), medians{label}")
        print("  per core = the client's rate / the proxy's cores used (utime+stime over the run);")
        print("  throttled = quota periods that ended with the proxy throttled; only runs with >= 90% (the proxy")
        print("  was the bottleneck, not a busy core 0) count: n = such runs / runs; same-round ratio: median (range)")
        print("  of mbal/twemproxy per core over the rounds where both runs count (adjacent in time)")
        print(f"{'scenario':10} {'direct':>10} {'mbal':>9} {'twemproxy':>9} {'used mbal':>9} {'twem':>5} "
              f"{'n mbal':>6} {'twem':>4} {'per core mbal':>13} {'twem':>9} {'mbal/twem':>9} {'same-round ratio (range)':>25}")
        for n in tput:
            key = "keys_per_sec" if n.startswith("mget") else "ops_per_sec"
            row = {}
            for t in ("direct", M, W):
                rows = [(d, ticks, periods(n, t, r)) for r, (d, ticks) in enumerate(load(n, t), 1)]
                if not rows:
                    continue
                ok = rows if t == "direct" else [x for x in rows if x[2][1] >= 0.9 * max(x[2][0], 1)]
                if not ok:
                    row[t] = None
                    continue
                row[t + "/runs"] = {r: d["totals"][key] / max(ticks / hz / secs, 1e-9)
                                    for r, (d, ticks, _) in enumerate(rows, 1) if (d, ticks, _) in ok}
                rate = med([d["totals"][key] for d, _, _ in ok])
                used = med([ticks / hz / secs for _, ticks, _ in ok])
                pc = med([d["totals"][key] / max(ticks / hz / secs, 1e-9) for d, ticks, _ in ok])
                row[t] = (rate, used, pc, f"{len(ok)}/{len(rows)}")
            if all(t in row for t in ("direct", M, W)):
                d, m, w = row["direct"], row[M], row[W]
                if m is None or w is None:
                    print(f"{n:10} no saturated runs (mbal {m is not None}, twemproxy {w is not None})")
                    continue
                # the two proxies' runs of the same round, one after the other: their ratio
                # cancels the machine's slow drift (other load on a shared VM)
                pm, pw = row[M + "/runs"], row[W + "/runs"]
                pair = [pm[r] / pw[r] for r in pm if r in pw]
                pr = f"{med(pair):9.2f} ({min(pair):.2f}-{max(pair):.2f})" if pair else ""
                print(f"{n:10} {d[0]:10.0f} {m[0]:9.0f} {w[0]:9.0f} {m[1]:9.3f} {w[1]:5.3f} "
                      f"{m[3]:>6} {w[3]:>4} {m[2]:13.0f} {w[2]:9.0f} {m[2]/w[2]:9.2f} {pr}")
        print()
    if any(load(n, M) for n in tput):
        print(f"throughput (keys/s for mget100, ops/s otherwise), medians; proxy CPU us per client request{label}")
        print(f"{'scenario':10} {'direct':>10} {'mbal':>10} {'twemproxy':>10} {'mbal/twem':>9} {'cpu us mbal':>11} {'twem':>7} {'per-core ratio':>14}")
    for n in tput:
        v, cpu = {}, {}
        for t in ("direct", M, W):
            rows = load(n, t)
            if not rows:
                continue
            key = "keys_per_sec" if n.startswith("mget") else "ops_per_sec"
            v[t] = med([d["totals"][key] for d, _ in rows])
            cpu[t] = med([ticks / hz / max(d["totals"]["requests"], 1) * 1e6 for d, ticks in rows])
        if len(v) == 3:
            pc = cpu[W] / cpu[M] if cpu[M] else 0
            print(f"{n:11} {v['direct']:10.0f} {v[M]:10.0f} {v[W]:10.0f} {v[M]/v[W]:9.2f} "
                  f"{cpu[M]:11.2f} {cpu[W]:7.2f} {pc:14.2f}")
    print()
    if not any(load(n, M) for n in ("lat_get", "lat_mget100", "lat_set")):
        continue
    print(f"latency, one request at a time (us, medians of runs): p50 / p99, and added over direct{label}")
    print(f"{'scenario':12} {'direct p50':>10} {'p99':>7} {'mbal p50':>9} {'p99':>7} {'twem p50':>9} {'p99':>7} {'added p50 mbal':>15} {'twem':>6} {'added p99 mbal':>15} {'twem':>6}")
    for n in ("lat_get", "lat_mget100", "lat_set"):
        l = {}
        for t in ("direct", M, W):
            rows = load(n, t)
            if rows:
                l[t] = (med([d["latency"]["all"]["p50_us"] for d, _ in rows]), med([d["latency"]["all"]["p99_us"] for d, _ in rows]))
        if len(l) == 3:
            d, m, w = l["direct"], l[M], l[W]
            print(f"{n:12} {d[0]:10.1f} {d[1]:7.1f} {m[0]:9.1f} {m[1]:7.1f} {w[0]:9.1f} {w[1]:7.1f} {m[0]-d[0]:15.1f} {w[0]-d[0]:6.1f} {m[1]-d[1]:15.1f} {w[1]-d[1]:6.1f}")
    print()
PY

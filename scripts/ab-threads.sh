#!/usr/bin/env bash
# A/B of server thread configurations, nothing pinned, the generator on the same machine:
# for each config, start mbal, load 1M keys, run `mbal bench` (1 thread, 8 connections x 16
# unless the arguments say otherwise) for 4 s, and print throughput, server CPU per request,
# the machine's idle CPUs, each server thread's run / run-queue wait time and timeslices
# (/proc/<pid>/task/*/schedstat), and the server's worker_thread* stats. Loopback only;
# kills only the servers it started.
#
#   CONFIGS="t1:-t 1|t2:-t 2|t2w1:-t 2 --worker-threads 1" scripts/ab-threads.sh RUNS BENCH-ARGS...
#   e.g. scripts/ab-threads.sh 2 --workload uniform --read-ratio 0 --conns 8 --pipeline 16
cd "$(dirname "$0")/.."
cargo build --release --bin mbal >/dev/null 2>&1 || cargo build --release --bin mbal
BIN=${CARGO_TARGET_DIR:-$PWD/target}/release/mbal
RUNS=$1; shift
J=$(mktemp); trap 'rm -f "$J"' EXIT
IFS='|' read -r -a CFGS <<<"${CONFIGS:-t1:-t 1|t2:-t 2|t2w1:-t 2 --worker-threads 1}"
COMMON=(--keys 1000000 --key-size 16 --value-size 20 --value-size-max 64)
for r in $(seq $RUNS); do
 for c in "${CFGS[@]}"; do
  name=${c%%:*}; args=${c#*:}
  PORT=$((21000 + RANDOM % 20000))
  $BIN server -l 127.0.0.1 -p $PORT -m 1024 $args 2>/dev/null & PID=$!
  for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.05; done
  $BIN bench --server 127.0.0.1:$PORT "${COMMON[@]}" --load-only --quiet >/dev/null
  c0=$(awk '{print $14+$15}' /proc/$PID/stat); i0=$(awk '/^cpu /{print $5+$6}' /proc/stat)
  declare -A S0=()
  for t in /proc/$PID/task/*; do S0[$t]=$(cat $t/schedstat); done
  $BIN bench --server 127.0.0.1:$PORT "${COMMON[@]}" --threads 1 --duration 4 --quiet --json $J "$@" >/dev/null
  c1=$(awk '{print $14+$15}' /proc/$PID/stat); i1=$(awk '/^cpu /{print $5+$6}' /proc/stat)
  st=""
  for t in /proc/$PID/task/*; do read a b n <<<"$(cat $t/schedstat)"; read a0 b0 n0 <<<"${S0[$t]:-0 0 0}"; d=$(( (a-a0)/1000000 )); w=$(( (b-b0)/1000000 )); [ $d -gt 50 ] && st="$st $(cat $t/comm):run${d}ms/wait${w}ms/n$((n-n0))"; done
  ops=$(python3 -c "import json;t=json.load(open('$J'))['totals'];print(int(t['ops_per_sec']), t['requests'])")
  set -- "$@"
  read o req <<<"$ops"
  echo "$name run$r idle_cores=$(python3 -c "print(round(($i1-$i0)/100/4,2))") ops=$o cpu_us_req=$(python3 -c "print(round(($c1-$c0)/100/$req*1e6,3))") $st"
  python3 -c "
import socket;s=socket.create_connection(('127.0.0.1',$PORT));s.sendall(b'stats\\r\\n');d=b''
while not d.endswith(b'END\\r\\n'): d+=s.recv(65536)
print('   ',' '.join(l[5:] for l in d.decode().split('\\r\\n') if 'worker_thread' in l))"
  kill $PID; wait $PID 2>/dev/null
 done
done

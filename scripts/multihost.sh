#!/usr/bin/env bash
# A cluster across hosts, tested (docs/operations.md, "Deploying on several hosts").
#
# Makes four Linux network namespaces that stand for four hosts, joined by veth pairs to a
# bridge in a fifth namespace (the "switch"), with the addresses 10.77.0.1..4/24:
#
#   <p>-h1  10.77.0.1   mbal coordinator, mbal proxy, the clients (pymemcache, mbal bench)
#   <p>-h2  10.77.0.2   mbal server --id 0
#   <p>-h3  10.77.0.3   mbal server --id 1
#   <p>-h4  10.77.0.4   mbal server --id 2
#
# writes a cluster file naming the servers and the coordinator by those addresses, with the
# cluster secret and TLS (one CA, a member certificate with the four IP SANs, client
# certificates required), starts everything, runs a bounded workload through the proxy and a
# routed `mbal bench`, checks every answer, kills one server with SIGKILL and checks that the
# cluster serves on (its keys miss, nothing errs once the coordinator has given its cachelets
# to the others), then removes every process, namespace and interface it made, also on
# failure. Nothing is made in the root namespace; no traffic leaves the namespaces.
#
# Usage: scripts/multihost.sh [MBAL_BIN]   (needs root, ip(8), openssl, python3 + pymemcache)
#   MBAL_BIN defaults to target/release/mbal, else target/debug/mbal.
#   MBAL_NETNS_PREFIX names the namespaces (default mbal-<pid>, so runs do not collide).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${1:-}"
if [ -z "$BIN" ]; then
  if [ -x target/release/mbal ]; then BIN=target/release/mbal; else BIN=target/debug/mbal; fi
fi
[ -x "$BIN" ] || { echo "multihost: no mbal binary at $BIN (cargo build --bin mbal)" >&2; exit 1; }
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"

P="${MBAL_NETNS_PREFIX:-mbal-$$}"
SW="$P-sw"
HOSTS=(h1 h2 h3 h4)
NET=10.77.0
COORD="$NET.1:11300"
PROXY="$NET.1:11211"
WORK="$(mktemp -d /tmp/mbal-multihost.XXXXXX)"
PIDS=()
MADE_NS=()
START=$SECONDS

log() { printf 'multihost [%3ds]: %s\n' "$((SECONDS - START))" "$*"; }
fail() {
  printf 'multihost: FAILED: %s\n' "$*" >&2
  exit 1
}
in_ns() { local h="$1"; shift; ip netns exec "$P-$h" "$@"; }
# Start a long-running process in host H's namespace, output to LOG; its pid (ip netns exec
# execs the command: the pid is the program's own) goes to PIDS and LAST.
spawn() {
  local h="$1" log="$2"
  shift 2
  ip netns exec "$P-$h" "$@" </dev/null >"$log" 2>&1 &
  LAST=$!
  PIDS+=("$LAST")
}

# Running (a process that exited but is not yet waited for is not).
alive() {
  local st
  st="$(ps -o stat= -p "$1" 2>/dev/null)" && [ -n "$st" ] && [ "${st#Z}" = "$st" ]
}

teardown() {
  local rc=$?
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  # Bounded wait for them, then SIGKILL what is left (each by its pid).
  for _ in $(seq 40); do
    local alive=0
    for pid in "${PIDS[@]}"; do alive "$pid" && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.05
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    if alive "$pid"; then
      echo "multihost: process $pid still running" >&2
      rc=1
    fi
  done
  # Deleting a namespace removes its interfaces: the switch's bridge and veth ends, each
  # host's veth end (and with it its peer).
  for ns in "${MADE_NS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  local left
  left="$(ip netns list | awk '{print $1}' | grep -F -- "$P-" || true)"
  if [ -n "$left" ]; then
    echo "multihost: namespaces left behind: $left" >&2
    rc=1
  fi
  if [ $rc -ne 0 ]; then
    for f in "$WORK"/*.log; do
      [ -s "$f" ] && { echo "--- $f (last lines)" >&2; tail -n 15 "$f" >&2; }
    done
  fi
  rm -rf "$WORK"
  exit $rc
}
trap teardown EXIT
trap 'exit 1' INT TERM

# --- preconditions: fail loudly, never skip (CI runs as root) -------------------------
[ "$(id -u)" -eq 0 ] || fail "needs root to make network namespaces (ip netns add); run as root"
command -v ip >/dev/null || fail "ip(8) is missing (apt-get install iproute2)"
command -v openssl >/dev/null || fail "openssl is missing (apt-get install openssl)"
python3 -c 'import pymemcache' 2>/dev/null || fail "python3 with pymemcache is needed (pip install pymemcache)"

# Namespaces an earlier run left when it was killed outright (SIGKILL: no trap ran): their
# names carry that run's pid, which is gone.
for ns in $(ip netns list | awk '{print $1}' | grep -E '^mbal-[0-9]+-(sw|h[1-4])$' || true); do
  pid="${ns#mbal-}"
  pid="${pid%%-*}"
  if [ ! -d "/proc/$pid" ]; then
    log "removing $ns, left by an earlier run (pid $pid) that was killed"
    ip netns del "$ns" || true
  fi
done

# --- the network: a bridge in a namespace of its own, one veth pair per host ----------
log "namespaces $P-{sw,h1..h4}, bridge br0 in $SW, $NET.1..4/24"
ip netns add "$SW" || fail "ip netns add $SW refused (network namespaces not permitted here?)"
MADE_NS+=("$SW")
ip -n "$SW" link add br0 type bridge || fail "cannot make a bridge in $SW"
ip -n "$SW" link set br0 up
i=0
for h in "${HOSTS[@]}"; do
  i=$((i + 1))
  ip netns add "$P-$h" || fail "ip netns add $P-$h refused"
  MADE_NS+=("$P-$h")
  # The veth pair is made in the switch namespace with its other end put straight into the host's.
  ip -n "$SW" link add "$h" type veth peer name eth0 netns "$P-$h" || fail "cannot make a veth pair for $h"
  ip -n "$SW" link set "$h" master br0 up
  ip -n "$P-$h" addr add "$NET.$i/24" dev eth0
  ip -n "$P-$h" link set eth0 up
  ip -n "$P-$h" link set lo up
done

# --- TLS: a CA and one member certificate with every host's address as an IP SAN -------
log "certificates (CA, member certificate with IP SANs $NET.1..4)"
(
  cd "$WORK"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=mbal multihost test CA" -keyout ca.key -out ca.pem \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=mbal member" -keyout member.key -out member.csr
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
    "extendedKeyUsage=serverAuth,clientAuth" \
    "subjectAltName=IP:$NET.1,IP:$NET.2,IP:$NET.3,IP:$NET.4" >member.ext
  openssl x509 -req -in member.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
    -extfile member.ext -out member.pem
) >"$WORK/openssl.log" 2>&1 || fail "openssl could not make the certificates"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/cluster.secret"
chmod 600 "$WORK/cluster.secret" "$WORK"/*.key

cat >"$WORK/cluster.toml" <<EOF
# Written by scripts/multihost.sh: one server per host, named by its address.
workers = 2
cachelets_per_worker = 8
secret_file = "cluster.secret"
coordinators = ["$COORD"]

[[servers]]
addr = "$NET.2:11211"

[[servers]]
addr = "$NET.3:11211"

[[servers]]
addr = "$NET.4:11211"

[tls]
ca_cert = "ca.pem"
cert = "member.pem"
key = "member.key"
verify_mode = 2
client_cert = "member.pem"
client_key = "member.key"
EOF

# --- the coordinator (h1), then one server per host (h2..h4) --------------------------
log "mbal coordinator on $COORD (TLS, secret)"
spawn h1 "$WORK/coordinator.log" "$BIN" coordinator --cluster "$WORK/cluster.toml" --listen "$COORD" \
  --data-dir "$WORK/coordinator" --beat-ms 100 --lease-ms 400 --failure-timeout-ms 800

declare -A SERVER_PID
for id in 0 1 2; do
  h="h$((id + 2))"
  log "mbal server --id $id on $NET.$((id + 2)):11211 in $P-$h"
  spawn "$h" "$WORK/server$id.log" "$BIN" server --cluster "$WORK/cluster.toml" --id "$id" --coordinator "$COORD" -m 64
  SERVER_PID[$id]=$LAST
done

# A TLS handshake as a member would make it, from h1 (so across the bridge), with a deadline.
tls_ready() {
  in_ns h1 timeout 2 openssl s_client -connect "$1" -CAfile "$WORK/ca.pem" \
    -cert "$WORK/member.pem" -key "$WORK/member.key" -verify_return_error -brief </dev/null >/dev/null 2>&1
}
wait_for() { # DESCRIPTION SECONDS COMMAND...
  local what="$1" secs="$2"
  shift 2
  local deadline=$((SECONDS + secs))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || fail "$what: not within ${secs}s"
    for pid in "${PIDS[@]}"; do alive "$pid" || fail "$what: process $pid exited"; done
    sleep 0.1
  done
}
wait_for "the coordinator answering TLS from h1" 10 tls_ready "$COORD"
for id in 0 1 2; do
  wait_for "server $id answering TLS from h1" 15 tls_ready "$NET.$((id + 2)):11211"
done

members() {
  in_ns h1 "$BIN" cluster members --coordinator "$COORD" --cluster "$WORK/cluster.toml" 2>&1
}
all_up() { [ "$(members | awk '$3 == "up"' | wc -l)" -eq 3 ]; }
wait_for "every server registered and up at the coordinator" 10 all_up
log "members at the coordinator:"
members | sed 's/^/    /'

# --- the proxy (h1) and the clients ------------------------------------------------
log "mbal proxy on $PROXY (upstreams over TLS to $NET.2..4)"
spawn h1 "$WORK/proxy.log" "$BIN" proxy --cluster "$WORK/cluster.toml" -l "$NET.1" -p 11211 -t 1 --upstream-timeout-ms 500
proxy_ready() { in_ns h1 timeout 1 bash -c "exec 3<>/dev/tcp/${PROXY%:*}/${PROXY#*:}" 2>/dev/null; }
wait_for "the proxy listening" 10 proxy_ready

log "routed client: mbal bench --routed --load from h1 (500 keys, then at most 3000 ops or 3 s)"
# --allow-non-loopback: 10.77.0.x are the hosts made above, inside this script's namespaces.
in_ns h1 "$BIN" bench --routed --allow-non-loopback --server "$NET.2:11211" --tls-ca "$WORK/ca.pem" \
  --tls-cert "$WORK/member.pem" --tls-key "$WORK/member.key" \
  --load --workload c --max-ops 3000 --duration 3 --keys 500 --conns 2 >"$WORK/bench.log" 2>&1 ||
  fail "mbal bench --routed failed: $(tail -n 5 "$WORK/bench.log")"
# Every key loaded first, so every read hits; no errors.
grep -qE '^run: .*hit ratio 1\.0000, errors 0,' "$WORK/bench.log" ||
  fail "mbal bench --routed: misses or errors: $(grep '^run:' "$WORK/bench.log")"

log "pymemcache through the proxy: writes, reads, checks"
in_ns h1 python3 - "$PROXY" >"$WORK/client-before.log" 2>&1 <<'EOF' || fail "workload through the proxy: $(tail -n 5 "$WORK/client-before.log")"
import sys
from pymemcache.client.base import Client
host, port = sys.argv[1].rsplit(":", 1)
c = Client((host, int(port)), connect_timeout=2, timeout=2)
N = 300
for i in range(N):
    assert c.set(f"k{i}", f"v{i}".encode(), noreply=False), i
for i in range(N):
    got = c.get(f"k{i}")
    assert got == f"v{i}".encode(), (i, got)
many = c.get_many([f"k{i}" for i in range(N)])
assert len(many) == N and all(many[f"k{i}"] == f"v{i}".encode() for i in range(N))
assert c.set("n", b"10", noreply=False)
assert c.incr("n", 5, noreply=False) == 15
assert c.delete("k0", noreply=False) and c.get("k0") is None
assert c.set("k0", b"v0", noreply=False)
stats = c.stats()
assert stats[b"proxy_upstreams"] >= 3, stats
print(f"ok: {N} keys set and read back through the proxy")
EOF
cat "$WORK/client-before.log"

# --- a server dies --------------------------------------------------------------------
victim=1
log "kill -9 server $victim (pid ${SERVER_PID[$victim]}, $NET.3)"
[ "$(readlink "/proc/${SERVER_PID[$victim]}/exe")" = "$BIN" ] || fail "pid ${SERVER_PID[$victim]} is not the server"
kill -KILL "${SERVER_PID[$victim]}"
wait "${SERVER_PID[$victim]}" 2>/dev/null || true
mapfile -t PIDS < <(printf '%s\n' "${PIDS[@]}" | grep -vx "${SERVER_PID[$victim]}")
down() { members | awk -v id="$victim" '$1 == id && $3 == "down" { found = 1 } END { exit !found }'; }

log "the cluster serves on: reads miss, never err; writes succeed once the coordinator reassigns"
in_ns h1 python3 - "$PROXY" >"$WORK/client-after.log" 2>&1 <<'EOF' || fail "serving after the failure: $(tail -n 5 "$WORK/client-after.log")"
import sys, time
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheServerError
host, port = sys.argv[1].rsplit(":", 1)
c = Client((host, int(port)), connect_timeout=2, timeout=2)
N = 300
# Reads from the moment of the kill: hits with the right value or misses, never an error.
misses = set()
for i in range(N):
    got = c.get(f"k{i}")
    if got is None:
        misses.add(i)
    else:
        assert got == f"v{i}".encode(), (i, got)
# Writes: an error ("unreachable") is allowed only until the coordinator has given the dead
# server's cachelets to the others; then every write is stored. Bounded in time and requests.
deadline = time.monotonic() + 15
rounds = 0
while True:
    rounds += 1
    errors, last = 0, None
    for i in range(N):
        try:
            assert c.set(f"w{i}", f"x{i}".encode(), noreply=False), i
        except MemcacheServerError as e:
            assert "unreachable" in str(e), e
            errors, last = errors + 1, (f"w{i}", str(e))
    if errors == 0:
        break
    assert time.monotonic() < deadline and rounds < 1000, \
        f"writes still failing after {rounds} rounds: {errors}/{N}, e.g. {last}; proxy stats {c.stats()}"
    time.sleep(0.1)
for i in range(N):
    assert c.get(f"w{i}") == f"x{i}".encode(), i
# The dead server's old keys are gone (misses), the live servers' are all still there.
after = {i for i in range(N) if c.get(f"k{i}") is None}
stats = c.stats()
assert 0 < len(after) < N, (f"expected some (not all) of {N} keys lost with one of 3 servers: {len(after)} misses"
                            f" (at first {len(misses)}; writes stored after {rounds} round(s)); proxy stats {stats}")
for i in range(N):
    if i not in after:
        assert c.get(f"k{i}") == f"v{i}".encode(), i
stats = c.stats()
assert stats[b"proxy_maps_installed"] >= 1, stats
# the maps came from the coordinator (over TLS, named in the cluster file), not from a server
assert int(stats[b"proxy_map_coordinator_fetches"]) >= 1, stats
assert int(stats[b"proxy_map_coordinator_failures"]) == 0, stats
print(f"ok: {len(after)}/{N} keys lost with the dead server, the rest read back;"
      f" writes stored after {rounds} round(s); unreachable misses {stats[b'proxy_unreachable_misses']};"
      f" map fetches from the coordinator {stats[b'proxy_map_coordinator_fetches']}")
EOF
cat "$WORK/client-after.log"
wait_for "the coordinator listing server $victim as down" 5 down
log "members after the failure:"
members | sed 's/^/    /'
for id in 0 2; do
  alive "${SERVER_PID[$id]}" || fail "server $id exited"
done
log "multihost: all checks passed ($((SECONDS - START)) s); tearing down"

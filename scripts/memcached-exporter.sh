#!/usr/bin/env bash
# memcached_exporter (github.com/prometheus/memcached_exporter, the Go exporter operators run
# for memcached) scraping mbal: builds the exporter from the Go module proxy (pinned version),
# starts an mbal server and the exporter on loopback, puts a little load on mbal, scrapes the
# exporter and checks `memcached_up 1`, the counters it read, and that it logged no error.
#   MBAL_BIN=path            the mbal binary (default: cargo build, target/debug/mbal)
#   MEMCACHED_EXPORTER=path  an exporter binary (default: built into target/memcached-exporter)
#   EXPORTER_VERSION=v0.14.4 the version built
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "memcached-exporter: FAIL: $*" >&2; exit 1; }
version="${EXPORTER_VERSION:-v0.14.4}"
work="$PWD/target/memcached-exporter"
mkdir -p "$work"

exporter="${MEMCACHED_EXPORTER:-}"
if [ -z "$exporter" ]; then
  exporter="$work/memcached_exporter-$version"
  if [ ! -x "$exporter" ]; then
    command -v go >/dev/null || fail "go is not installed (https://go.dev/dl/)"
    # A throw-away module that requires the exporter at $version: `go build` of its command
    # (not `go install ...@version`, which also asks the proxy for the module's version list).
    mod=$(mktemp -d)
    trap 'rm -rf "$mod"' EXIT
    printf 'module mbal.local/exporter\n\ngo 1.22\n\nrequire github.com/prometheus/memcached_exporter %s\n' "$version" >"$mod/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/prometheus/memcached_exporter/cmd/memcached_exporter"\n' >"$mod/tools.go"
    (
      cd "$mod"
      # The checksum database is asked as usual; where it has no record of the exporter (some
      # mirrors), its go.sum line comes from the module proxy alone (said here).
      if ! go mod tidy 2>"$mod/tidy.log"; then
        echo "memcached-exporter: the checksum database did not verify the exporter; using the proxy's checksum ($(tail -n 1 "$mod/tidy.log"))"
        GONOSUMDB=github.com/prometheus/memcached_exporter go mod tidy
      fi
      go build -o "$exporter" github.com/prometheus/memcached_exporter/cmd/memcached_exporter
    )
  fi
fi
echo "memcached-exporter: $("$exporter" --version 2>&1 | head -n 1)"

mbal="${MBAL_BIN:-}"
if [ -z "$mbal" ]; then
  cargo build -q --bin mbal
  mbal="$PWD/target/debug/mbal"
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap 'cleanup; rm -rf "${mod:-/nonexistent}"' EXIT
"$mbal" server -l 127.0.0.1 -p 0 -t 2 -m 64 --print-ports >"$work/ports.json" 2>"$work/mbal.log" &
pids+=($!)
for _ in $(seq 200); do [ -s "$work/ports.json" ] && break; sleep 0.05; done
addr=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["main"])' "$work/ports.json")
eport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$exporter" --memcached.address="$addr" --web.listen-address="127.0.0.1:$eport" 2>"$work/exporter.log" &
pids+=($!)

python3 - "$addr" "$eport" <<'PY'
import socket, sys, time, urllib.request
addr, eport = sys.argv[1], sys.argv[2]
host, port = addr.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=5) as c:
    f = c.makefile("rb")
    for i in range(100):
        c.sendall(b"set k%d 0 0 1\r\nx\r\nget k%d\r\nget nokey%d\r\n" % (i, i, i))
        assert f.readline() == b"STORED\r\n"
        assert f.readline().startswith(b"VALUE")
        f.readline(); f.readline()
        assert f.readline() == b"END\r\n"
end = time.monotonic() + 10
while True:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{eport}/metrics", timeout=5).read().decode()
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.1)
metrics = {}
for line in text.splitlines():
    if line.startswith("memcached_") and " " in line:
        name, value = line.rsplit(" ", 1)
        metrics[name] = float(value)
def want(name, ok):
    assert name in metrics and ok(metrics[name]), f"{name} = {metrics.get(name)}"
    print(f"memcached-exporter: {name} {metrics[name]:g}")
want("memcached_up", lambda v: v == 1)
want('memcached_commands_total{command="set",status="hit"}', lambda v: v >= 100)
want('memcached_commands_total{command="get",status="hit"}', lambda v: v >= 100)
want('memcached_commands_total{command="get",status="miss"}', lambda v: v >= 100)
want("memcached_current_items", lambda v: v >= 100)
want("memcached_current_connections", lambda v: v >= 1)
want("memcached_limit_bytes", lambda v: v == 64 << 20)
print(f"memcached-exporter: {sum(1 for n in metrics)} memcached_* series from mbal")
PY
if grep -Ei 'level=(error|warn)|error' "$work/exporter.log"; then
  fail "the exporter logged errors (above; $work/exporter.log)"
fi
echo "memcached-exporter: memcached_up 1, no scrape errors: passed"

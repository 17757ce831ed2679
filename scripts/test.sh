#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs every
# check CI runs. Exits non-zero on the first failure.
#   FUZZ_SECONDS=N   seconds per fuzz target (default 20; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's line says how long the run has taken so far (CI's aim: under 15 minutes).
step() { printf '\n==> [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

# Built for a clean clone (CI's case): no incremental caches, and tests' debug info as line
# tables only (backtraces keep their lines). A cold build otherwise left 8.5 GB in target/
# (1.8 GB of it incremental caches) before the fuzz targets were linked, and CI's linker once
# died there (ld: signal 7, Bus error), most likely on a full disk (the free space is printed
# before the fuzz step). Set either variable to keep your own.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"

step "installing build and test dependencies (protobuf-compiler, memcached, libmemcached-tools, libsasl2-modules, etcd-server, iproute2, openssl, procps, pytest, pymemcache, pylibmc, cryptography)"
need_apt=()
# protoc: the etcd client crate (crates/coordinator) compiles etcd's .proto files at build time.
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
# etcd: the coordinator's etcd store and fail-over tests (tests/coordinator_etcd.rs) start one.
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v memcached >/dev/null || need_apt+=(memcached)
# scripts/multihost.sh: network namespaces, certificates, process states.
command -v ip >/dev/null || need_apt+=(iproute2)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v ps >/dev/null || need_apt+=(procps)
command -v memccapable >/dev/null || need_apt+=(libmemcached-tools)
# Cyrus SASL's PLAIN plugin: pylibmc's SASL test (tests/clients/test_auth.py) loads it.
compgen -G '/usr/lib/*/sasl2/libplain.so*' >/dev/null || need_apt+=(libsasl2-modules)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
python3 -c 'import pytest, pymemcache, pylibmc, cryptography' 2>/dev/null ||
  python3 -m pip install -q pytest pymemcache pylibmc cryptography

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "no import circle among the server's modules but the data path's dispatch <-> worker"
python3 scripts/module-cycles.py crates/server/src --allow dispatch,worker

step "cargo test (unit, property and loopback integration tests)"
# A stock memcached for the tests that compare reply bytes with it
# (crates/proto/tests/vs_memcached.rs).
MC_PORT=$((30000 + RANDOM % 20000))
mc_user=(); [ "$(id -u)" -eq 0 ] && mc_user=(-u nobody)
memcached "${mc_user[@]}" -l 127.0.0.1 -p "$MC_PORT" -U 0 -t 1 -m 64 &
MC_PID=$!
trap 'kill $MC_PID 2>/dev/null || true' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$MC_PORT) 2>/dev/null && break; sleep 0.05; done
MBAL_MEMCACHED_ADDR="127.0.0.1:$MC_PORT" MBAL_REQUIRE_MEMCACHED=1 MBAL_REQUIRE_ETCD=1 cargo test --workspace
kill $MC_PID 2>/dev/null || true

step "the YCSB driver's generators against YCSB's (scripts/lib/ycsb_driver.py selftest)"
python3 scripts/lib/ycsb_driver.py selftest

# The client-library and multi-host checks run the debug binary that `cargo test` built above
# (its integration tests need it): they check behaviour, not speed, and a release build
# (thin LTO, one codegen unit) cost CI a cold build of its own (6m22s on a 2-core machine).
# The build below is a no-op unless the binary is missing.
cargo build -q --bin mbal
step "real client libraries against a real server (pytest)"
MBAL_BIN="$PWD/target/debug/mbal" python3 -m pytest -q tests/clients

step "a cluster across hosts: network namespaces, coordinator, TLS, proxy, a server killed (scripts/multihost.sh)"
scripts/multihost.sh target/debug/mbal

FUZZ_SECONDS="${FUZZ_SECONDS:-20}"
if [ "$FUZZ_SECONDS" -gt 0 ]; then
  step "cargo fuzz: every parser for ${FUZZ_SECONDS}s"
  df -h . | tail -1 || true
  command -v cargo-fuzz >/dev/null || cargo install -q cargo-fuzz --locked
  crates/proto/fuzz/run-all.sh "$FUZZ_SECONDS"
fi
step "all checks passed"

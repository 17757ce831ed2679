#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs every
# check CI runs. Exits non-zero on the first failure.
#   FUZZ_SECONDS=N   seconds per fuzz target (default 20; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "installing test dependencies (memcached, libmemcached-tools, pytest, pymemcache, pylibmc)"
need_apt=()
command -v memcached >/dev/null || need_apt+=(memcached)
command -v memccapable >/dev/null || need_apt+=(libmemcached-tools)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
python3 -c 'import pytest, pymemcache, pylibmc' 2>/dev/null ||
  python3 -m pip install -q pytest pymemcache pylibmc

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (unit, property and loopback integration tests)"
cargo test --workspace

step "real client libraries against a real server (pytest)"
cargo build --release --bin mbal
MBAL_BIN="$PWD/target/release/mbal" python3 -m pytest -q tests/clients

FUZZ_SECONDS="${FUZZ_SECONDS:-20}"
if [ "$FUZZ_SECONDS" -gt 0 ]; then
  step "cargo fuzz: every parser for ${FUZZ_SECONDS}s"
  command -v cargo-fuzz >/dev/null || cargo install -q cargo-fuzz --locked
  crates/proto/fuzz/run-all.sh "$FUZZ_SECONDS"
fi
step "all checks passed"

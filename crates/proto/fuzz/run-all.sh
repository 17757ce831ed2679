#!/usr/bin/env bash
# Run every mbal-proto fuzz target for N seconds each (default 20).
# Fails (non-zero exit) if any target finds a crash.
# Needs: rustup nightly toolchain and `cargo install cargo-fuzz`.
set -euo pipefail
secs="${1:-20}"
cd "$(dirname "$0")/.."
for t in fuzz_text fuzz_meta fuzz_binary; do
    echo "== $t (${secs}s)"
    mkdir -p "fuzz/corpus/$t"
    cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048
done
echo "all fuzz targets ran ${secs}s without a crash"

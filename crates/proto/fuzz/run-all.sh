#!/usr/bin/env bash
# Run every mbal-proto fuzz target for N seconds each (default 20).
# Fails (non-zero exit) if any target finds a crash.
# Needs `cargo install cargo-fuzz`, and the rustup nightly toolchain (with
# AddressSanitizer); without nightly it falls back to stable with
# RUSTC_BOOTSTRAP=1 and no sanitizer (coverage-guided fuzzing still runs).
set -euo pipefail
secs="${1:-20}"
cd "$(dirname "$0")/.."
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz run)
else
    echo "(no nightly toolchain: fuzzing on stable without a sanitizer)"
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz run --sanitizer none)
fi
for t in fuzz_text fuzz_meta fuzz_binary fuzz_client fuzz_auth fuzz_migrate fuzz_map; do
    echo "== $t (${secs}s)"
    mkdir -p "fuzz/corpus/$t"
    "${fuzz[@]}" "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048
done
echo "all fuzz targets ran ${secs}s without a crash"

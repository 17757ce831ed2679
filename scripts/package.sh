#!/usr/bin/env bash
# Build the Debian package (target/debian/mbal_*.deb) with cargo-deb, from
# [package.metadata.deb] in Cargo.toml (docs/operations.md "Package and service").
#   MBAL_DEB_PROFILE=release|dev   cargo profile of the packaged binary (default release)
# Prints the path of the .deb on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${MBAL_DEB_PROFILE:-release}"
command -v cargo-deb >/dev/null || cargo install cargo-deb --locked
cargo build --profile "$profile" --bin mbal
dir=release; [ "$profile" = dev ] && dir=debug
# The package's files are staged in target/mbal-deb (the asset paths of Cargo.toml).
mkdir -p target/mbal-deb
cp "target/$dir/mbal" target/mbal-deb/mbal
# /etc/mbal/mbal.toml: every option commented out at its default, generated from the options.
"target/$dir/mbal" server --print-config > target/mbal-deb/mbal.toml
cargo deb --no-build --no-strip -p mbal 2>&1 | tail -n 1 | tee target/mbal-deb/deb-path
deb=$(tail -n 1 target/mbal-deb/deb-path)
[ -f "$deb" ] || { echo "package.sh: no .deb built" >&2; exit 1; }

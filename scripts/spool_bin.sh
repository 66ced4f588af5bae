#!/usr/bin/env bash
# Builds spool and prints the path of its binary as cargo reports it, so scripts work
# wherever cargo puts its output (CARGO_TARGET_DIR, a cargo config's build.target-dir, a
# build target triple) instead of assuming `target/debug`.
# Usage: scripts/spool_bin.sh [cargo build flags, e.g. --release]
set -euo pipefail
cd "$(dirname "$0")/.."
# Diagnostics go to stderr rendered as usual; stdout carries one JSON message per line, and
# the binary's `compiler-artifact` message names the executable.
BIN=$(cargo build --quiet --bin spool --message-format=json-render-diagnostics "$@" |
  sed -n 's/^{"reason":"compiler-artifact".*"executable":"\([^"]*\)".*$/\1/p' | tail -n 1)
[[ -n "$BIN" && -x "$BIN" ]] || { echo "spool_bin.sh: cargo reported no spool binary" >&2; exit 1; }
printf '%s\n' "$BIN"

#!/usr/bin/env bash
# `make demo`: the real job end to end against the bundled mock server, on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
# SPOOL_BIN / DEMO_OUT let the test suite run this very script against its own build.
# Otherwise build, and take the binary from where cargo put it (CARGO_TARGET_DIR included).
BIN=${SPOOL_BIN:-$(bash scripts/spool_bin.sh)}
OUT=${DEMO_OUT:-demo-out}
rm -rf "$OUT" && mkdir -p "$OUT"
cp -r examples/prompts "$OUT/prompts"

# A simulated 8-GPU server, 15× faster than real time: ~850 tok/s × 15, heavy-tailed lengths,
# answering in Qwen3's real tokens (the config's [tokenizer]), so the ids decode to its text.
"$BIN" mock-server --addr 127.0.0.1:0 --time-scale 15 --capacity-tps 850 --per-request-tps 60 \
  --mean-tokens 350 --sigma 1.0 --seed 7 --model qwen3-demo --think \
  --tokenizer tests/fixtures/tokenizers/qwen3/tokenizer.json >"$OUT/mock.addr" 2>"$OUT/mock.log" &
MOCK=$!
trap 'kill $MOCK 2>/dev/null; wait $MOCK 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do grep -q listening "$OUT/mock.addr" && break; sleep 0.1; done
URL=$(sed -n 's/^listening on //p' "$OUT/mock.addr")
echo "== mock server at $URL"

# The example config, pointed at the mock and at the copied prompts.
sed -e "s#http://127.0.0.1:30000#$URL#" \
    -e "s#\.\./tests/fixtures#$PWD/tests/fixtures#" examples/spool.toml >"$OUT/spool.toml"

echo "== spool run"
"$BIN" run -c "$OUT/spool.toml"
echo "== spool status"
"$BIN" status -c "$OUT/spool.toml"
echo "== spool verify"
"$BIN" verify -c "$OUT/spool.toml"
echo "== first rows of $OUT/spool-out/chat/part-000000.parquet"
"$BIN" show "$OUT/spool-out/chat/part-000000.parquet" -n 2 --width 100
echo "== a regenerated conversation: sample 0, turns 0-2 of the first conversation closed (thinking in the reasoning column)"
"$BIN" show "$OUT/spool-out/dialogues/part-000000.parquet" -n 3 --width 100
echo "== run it again: nothing left to do, nothing requested twice"
"$BIN" run -q -c "$OUT/spool.toml"
"$BIN" status -c "$OUT/spool.toml"

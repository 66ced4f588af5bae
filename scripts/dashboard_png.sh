#!/usr/bin/env bash
# `make dashboard-png`: a demo run scraped by a real Prometheus, drawn to docs/dashboard.png
# with the dashboard's own queries (scripts/dashboard_png.py). Loopback only.
# Needs: prometheus (Debian package), python3 with matplotlib (python3-matplotlib), curl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_PNG=${OUT_PNG:-docs/dashboard.png}
command -v prometheus >/dev/null || { echo "needs prometheus (apt-get install prometheus)" >&2; exit 2; }
PY=""
for p in python3 /usr/bin/python3; do
  if "$p" -c 'import matplotlib' 2>/dev/null; then PY=$p; break; fi
done
[[ -n "$PY" ]] || { echo "needs matplotlib (apt-get install python3-matplotlib)" >&2; exit 2; }

# Built, and found where cargo put it (CARGO_TARGET_DIR included).
BIN=$(bash scripts/spool_bin.sh)
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# A simulated server, 2× real time (the run lasts about a minute), with a few 500s and 429s
# so the error panels move.
"$BIN" mock-server --addr 127.0.0.1:0 --time-scale 2 --capacity-tps 850 --per-request-tps 60 \
  --mean-tokens 350 --sigma 1.0 --seed 7 --fail-500 0.02 --fail-429 0.01 --retry-after-s 1 \
  --model qwen3-demo >"$W/mock.addr" 2>"$W/mock.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q listening "$W/mock.addr" && break; sleep 0.1; done
URL=$(sed -n 's/^listening on //p' "$W/mock.addr")

MPORT=$(free_port)
cat >"$W/spool.toml" <<EOF
data_dir = "data"
output_dir = "out"
[server]
api = "sglang"
urls = ["$URL"]
model = "qwen3-demo"
[run]
concurrency = 48
metrics_addr = "127.0.0.1:$MPORT"
[tokenizer]
path = "$PWD/tests/fixtures/tokenizers/qwen3/tokenizer.json"
chat_template = "$PWD/tests/fixtures/tokenizers/qwen3/tokenizer_config.json"
[sampling]
max_tokens = 2048
[shards]
max_rows = 20
[[dataset]]
name = "chat"
path = "$PWD/examples/prompts/chat.jsonl"
token_budget = 40000
[[dataset]]
name = "code"
path = "$PWD/examples/prompts/code.jsonl"
[[dataset]]
name = "math"
path = "$PWD/examples/prompts/math.jsonl"
token_budget = 12000
[dataset.sampling]
max_tokens = 1024
EOF

PORT=$(free_port)
mkdir -p "$W/tsdb"
cat >"$W/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: spool
    static_configs:
      - targets: ['127.0.0.1:$MPORT']
EOF
# Prometheus first, so the whole run is scraped.
prometheus --config.file="$W/prometheus.yml" --storage.tsdb.path="$W/tsdb" \
  --web.listen-address="127.0.0.1:$PORT" --log.level=warn 2>"$W/prometheus.log" &
PIDS+=($!)
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$PORT/-/ready" >/dev/null && break; sleep 0.1; done

START=$(date +%s)
echo "== spool run (metrics at 127.0.0.1:$MPORT) scraped every second by Prometheus on 127.0.0.1:$PORT"
"$BIN" run -q -c "$W/spool.toml" || true
END=$(date +%s)
echo "== run took $((END - START)) s; drawing $OUT_PNG"
mkdir -p "$(dirname "$OUT_PNG")"
"$PY" scripts/dashboard_png.py --prometheus "http://127.0.0.1:$PORT" --start "$START" --end "$END" \
  --out "$OUT_PNG"

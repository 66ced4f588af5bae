# spool: the two commands that do everything are `make demo` and `make test`.
.PHONY: demo test lint build soak test-llama-server bench bench-all bench-eta bench-autoconc bench-prefix bench-tokenize bench-tokenize-kimi clean dashboard-png bench-overhead bench-stream bench-throughput bench-scale bench-shard bench-dedup bench-export bench-partitions bench-bombs bench-cluster-scale

# The benchmarks' Python (numpy, pyarrow, aiohttp…) is the project's .venv/, which `make
# test` and `make bench-all` set up (scripts/test_env.sh).
export PATH := $(CURDIR)/.venv/bin:$(PATH)

build:
	cargo build

## Runs the real job end to end against the bundled mock server (loopback only).
demo:
	bash scripts/demo.sh

## The whole test suite (unit + integration, real sled, real Parquet read back by pyarrow/DuckDB),
## set up first by scripts/test_env.sh: a project-local .venv/ from tests/requirements*.txt
## (reused while they are unchanged) and Debian's prometheus, strace and systemd (installed
## when root, else named). This is all CI runs.
test:
	@bash scripts/test_env.sh
	@export PATH="$(CURDIR)/.venv/bin:$$PATH" SPOOL_TEST_REQUIRE_DUCKDB=1; \
	if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --no-fail-fast --status-level fail --final-status-level slow; \
	else \
		cargo test --no-fail-fast; \
	fi

## The Python wheel (pyproject.toml): `spool` in a Python-independent wheel in dist/, so that
## `pip install dist/spool_llm-*.whl` puts it on PATH. Needs maturin (pinned in
## tests/requirements.txt, which `make test` installs into .venv/). WHEEL_PROFILE=dev builds
## it faster and unoptimised (the test does); WHEEL_OUT writes it elsewhere.
.PHONY: wheel
wheel:
	@export PATH="$(CURDIR)/.venv/bin:$$PATH"; \
	command -v maturin >/dev/null || { echo "make wheel: needs maturin: pip install maturin (or make test, which installs it into .venv/)" >&2; exit 1; }; \
	maturin build --locked --profile $(or $(WHEEL_PROFILE),release) --out $(or $(WHEEL_OUT),dist)

## The server's rendering against a real llama.cpp server (not in `make test`: building
## llama-server from the llama-cpp-python sdist took 25 min on 2 shared cores; kept in
## LLAMA_SERVER_DIR, default target/llama-server, and reused).
test-llama-server:
	bash scripts/llama-server.sh $${LLAMA_SERVER_DIR:-target/llama-server}
	SPOOL_TEST_LLAMA_SERVER=$$(realpath $${LLAMA_SERVER_DIR:-target/llama-server}) \
		cargo test --test it llama_server -- --ignored --nocapture

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings

## Longer chaos: rounds of the crash test (60 SIGKILLs each, faults on, fresh seed) until
## SPOOL_SOAK_S seconds (default 1800) have passed. SPOOL_CRASH_KILLS / SPOOL_CRASH_ITEMS
## size a round; each prints a `chaos:` line, the last a `soak:` total.
soak:
	SPOOL_SOAK_S=$${SPOOL_SOAK_S:-1800} cargo test --test it crash::soak -- --ignored --nocapture

## Lists the benchmarks: each `make bench-*` prints its table; figures and method in BENCHMARKS.md.
bench:
	@echo "Benchmarks (by hand, not in make test; results in BENCHMARKS.md):"
	@grep -E '^bench-[a-z-]+:' Makefile | cut -d: -f1 | sed 's/^/  make /'

## Every benchmark in turn against one release build, each one's output in
## bench/results/<target>.md with the commit, date and machine it was measured on (hours;
## an idle machine). BENCH_ONLY="bench-partitions bench-shard" for a subset.
bench-all:
	bash scripts/bench_all.sh

## Budget overshoot (finish / cancel / naive), ETA error over the run against the naive
## "remaining requests / req/s", and server utilisation across the dataset boundary, in a
## scaled-time simulation of the real job (150 in flight, lognormal 3500/σ1, 850 tok/s); and
## the capacity change: two servers, one killed mid-run (`loss`) against none (`steady2`),
## the ETA's median error in windows after the loss. About 30 minutes at the default time
## scale 50; BENCH_ETA_ARGS="--variants loss" for one.
bench-eta:
	BIN=$$(bash scripts/spool_bin.sh --release) && python3 bench/eta.py --bin "$$BIN" $(BENCH_ETA_ARGS)

## concurrency = "auto" against a sweep of fixed concurrencies on the mock's KV-cache model,
## three profiles (KV-bound with preemption, compute-bound, two unequal servers): tok/s after
## warm-up, preemptions, tokens thrown away under "cancel". About 20 minutes;
## BENCH_AUTOCONC_ARGS="--profiles kv-bound" for one.
bench-autoconc:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && python3 bench/autoconc.py --bin "$$BIN" $(BENCH_AUTOCONC_ARGS)

## Routing for the prefix cache on four mock servers (KV model, radix-style prefix cache):
## prompts sharing long blocks, 4 samples each, under prefix, least_requests and round_robin
## routing and on one server: hit rates, throughput, utilisation. About 5 minutes.
bench-prefix:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && python3 bench/prefix.py --bin "$$BIN" $(BENCH_PREFIX_ARGS)

## spool's enqueue path (render + tokenize + queue) vs transformers + tokenizers, on
## generated chat prompts (needs `pip install transformers`; no model download). By hand, not
## in `make test`; figures go in BENCHMARKS.md. BENCH_TOKENIZE_ARGS="--sizes 100000" for less.
bench-tokenize:
	BIN=$$(bash scripts/spool_bin.sh --release) && python3 bench/tokenize/bench.py --spool "$$BIN" $(BENCH_TOKENIZE_ARGS)

## The same with Kimi's tiktoken tokenizer (the model folder as [tokenizer] path): enqueue rate
## and peak RSS, then the raw encoder on one thread vs Python tiktoken built as Moonshot builds it.
bench-tokenize-kimi:
	BIN=$$(bash scripts/spool_bin.sh --release) && cargo build --release --quiet --example bench_kimi_encode \
	  && python3 bench/tokenize/bench.py --kimi --spool "$$BIN" $(BENCH_TOKENIZE_ARGS)

clean:
	cargo clean
	rm -rf demo-out

## docs/dashboard.png: a demo run scraped by a local Prometheus, drawn with the Grafana
## dashboard's own queries (needs Debian's `prometheus` and `python3-matplotlib`; not in `make test`).
dashboard-png:
	bash scripts/dashboard_png.sh

## Client overhead against an instant mock (~100-token completions): completions/s and
## client CPU s per 1000 completions at concurrency 64, 256, 1024, for spool and for
## bench/client/baseline.py (asyncio + aiohttp; needs `pip install aiohttp`).
## BENCH_OVERHEAD_ARGS="--prompts 10000 --concurrency 256" for less. SPOOL_BENCH_BIN
## measures another build instead of this one (the bench-client targets all honour it).
bench-overhead:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		SPOOL_BENCH_BIN="$$BIN" python3 bench/client/bench.py overhead $(BENCH_OVERHEAD_ARGS)

## Streaming at scale: 2 000 long streaming requests in flight at 10 000 tok/s aggregate:
## client CPU % of one core, RSS, CPU µs per token. BENCH_STREAM_ARGS="--seconds 30".
bench-stream:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		SPOOL_BENCH_BIN="$$BIN" python3 bench/client/bench.py stream $(BENCH_STREAM_ARGS)

## Server utilisation: achieved tok/s ÷ the mock's capacity over a 5-minute window
## (850 tok/s × time scale 10, 150 in flight). BENCH_THROUGHPUT_ARGS="--seconds 60" for less.
bench-throughput:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		SPOOL_BENCH_BIN="$$BIN" python3 bench/client/bench.py throughput $(BENCH_THROUGHPUT_ARGS)

## A 10 M-prompt dataset (prompt strings, no tokenizer): enqueue rate, sled bytes per item,
## restart time (SIGKILL -> first request dispatched) and RSS while enqueueing and draining,
## against a fast mock server. Generates target/bench-data/scale-prompts-N.jsonl once
## (4.5 GB for 10 M). BENCH_SCALE_ARGS="--prompts 1000000" for a smaller run.
bench-scale:
	BIN=$$(bash scripts/spool_bin.sh --release) && python3 bench/scale/bench.py --spool "$$BIN" $(BENCH_SCALE_ARGS)

## Shard writing: the crate's ShardWriter writing long completions with token-id lists to
## zstd Parquet at levels 1, 3 and 9: rows/s, MB/s and compression ratio.
## BENCH_SHARD_ARGS="ROWS LEVELS" (default "2000 1,3,9").
bench-shard:
	cargo run --release --example bench_shard -- $(BENCH_SHARD_ARGS)

## Intake with duplicates: enqueue rate of 1 M all-unique rows against 1 M rows of which half
## repeat an earlier one (`cat a a`, and the same rows shuffled), through `spool run`; then
## the duplicate-id set alone (examples/bench_dedup.rs) on the same three shapes.
## BENCH_DEDUP_ARGS="--rows 200000 --repeat 1" for less.
bench-dedup:
	BIN=$$(bash scripts/spool_bin.sh --release) && python3 bench/dedup/bench.py --spool "$$BIN" $(BENCH_DEDUP_ARGS)
	cargo run --release --example bench_dedup

## `spool export` at scale: peak RSS (/usr/bin/time -v) and rows/s for `tokens`, `sharegpt`
## and `hf` at 1 M and 10 M rows of shards written straight in spool's schema by pyarrow
## (target/bench-data/export-N/, ~330 MB per 1 M rows, made once). SPOOL_BENCH_BIN measures
## another build; BENCH_EXPORT_ARGS="--rows 1000000,3000000 --formats hf" for less.
bench-export:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		python3 bench/export/bench.py --spool "$$BIN" $(BENCH_EXPORT_ARGS)

## Input bombs (small files that decode to gigabytes, beside a plain dataset): peak RSS,
## wall time, exit code and data_dir size of `spool run` on each. SPOOL_BENCH_BIN measures
## another build. Needs the zstd command-line tool.
bench-bombs:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		python3 bench/bombs/bench.py --spool "$$BIN" $(BENCH_BOMBS_ARGS)

## One process against 4 partitions (four `spool run`s, one file:// prefix, `finalize`) on
## the same mock capacity: wall time, completions/s, tok/s, a budgeted dataset's overshoot
## and budget left unused, under "cancel" and "finish". About 5 minutes.
bench-partitions:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		SPOOL_BENCH_BIN="$$BIN" python3 bench/partitions/bench.py $(BENCH_PARTITIONS_ARGS)

## A cluster job of 256 partitions × 1000 commits on a local store: a worker's start-up,
## `spool status` and `spool finalize` (and a rerun), timed, with their store requests.
bench-cluster-scale:
	BIN=$${SPOOL_BENCH_BIN:-$$(bash scripts/spool_bin.sh --release)} && \
		SPOOL_BENCH_BIN="$$BIN" python3 bench/cluster_scale/bench.py $(BENCH_CLUSTER_SCALE_ARGS)

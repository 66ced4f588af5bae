# spool: the two commands that do everything are `make demo` and `make test`.
.PHONY: demo test lint build soak bench clean

build:
	cargo build

## Runs the real job end to end against the bundled mock server (loopback only).
demo:
	bash scripts/demo.sh

## The whole test suite (unit + integration, real sled, real Parquet read back by pyarrow/DuckDB).
test:
	@if cargo nextest --version >/dev/null 2>&1; then \
		cargo nextest run --no-fail-fast --status-level fail --final-status-level slow; \
	else \
		cargo test --no-fail-fast; \
	fi

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings

## Longer crash run: SPOOL_CRASH_KILLS=N (default 60) random SIGKILLs.
soak:
	SPOOL_CRASH_KILLS=$${SPOOL_CRASH_KILLS:-60} cargo test --test it crash -- --nocapture

bench:
	@echo "No benchmarks yet: the bench-* targets come with issues 4, 6 and 7 (see BENCHMARKS.md)."

clean:
	cargo clean
	rm -rf demo-out

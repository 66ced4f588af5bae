#!/usr/bin/env bash
# `make bench-all`: every benchmark in turn against one release build, each one's output
# written to bench/results/<target>.md under a header naming the commit, the date, the
# machine and the load around it, so a table copied into BENCHMARKS.md says when and where
# it was measured. BENCH_ONLY="bench-partitions bench-shard" runs a subset; the *_ARGS
# variables of each target pass through. Hours for all of them; run on an idle machine.
set -uo pipefail
cd "$(dirname "$0")/.."
# The benchmarks' Python packages live in the project's .venv/, as the tests' do.
bash scripts/test_env.sh || exit 1
export PATH="$PWD/.venv/bin:$PATH"
BIN=$(bash scripts/spool_bin.sh --release) || exit 1
export SPOOL_BENCH_BIN="$BIN"
targets=${BENCH_ONLY:-$(grep -E '^bench-[a-z-]+:' Makefile | cut -d: -f1 | grep -v '^bench-all$')}
commit=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- src Cargo.toml Cargo.lock bench scripts || commit="$commit (with local changes)"
machine="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
mkdir -p bench/results
summary=()
for t in $targets; do
  out="bench/results/$t.md"
  start=$(date -u +%s)
  {
    echo "# \`make $t\`"
    echo
    echo "- commit: $commit"
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "- machine: $machine"
    echo "- load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo '```'
  } > "$out"
  make --no-print-directory "$t" >> "$out" 2>&1
  rc=$?
  mins=$(( ($(date -u +%s) - start + 59) / 60 ))
  {
    echo '```'
    echo
    echo "- exit: $rc, $mins min; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  } >> "$out"
  summary+=("$t: exit $rc, $mins min -> $out")
done
printf '%s\n' "${summary[@]}"

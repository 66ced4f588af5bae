"""`make bench-export`: peak RSS and rows/s of `spool export` at 1 M and 10 M rows.

Writes shards in spool's schema (schemas/shard.schema.json) directly with pyarrow — no
server, no queue — under target/bench-data/export-<rows>/ (once per size, reused), with a
config naming the dataset, then runs `/usr/bin/time -v spool export` per format and prints
a Markdown table. Rows are short chat generations (prompt ~40 ids, completion ~80 ids, a
system+user `messages`), so the figures measure the export path, not the disk.

Usage: bench.py --spool BIN [--rows 1000000,10000000] [--formats tokens,sharegpt,hf]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD_ROWS = 100_000
CHUNK = 20_000


def ids_type():
    return pa.list_(pa.field("item", pa.uint32(), nullable=False))


def schema():
    f = pa.field
    return pa.schema(
        [
            f("id", pa.string(), False),
            f("dataset", pa.string(), False),
            f("row", pa.uint64(), False),
            f("prompt", pa.string(), False),
            f("messages", pa.string(), True),
            f("prompt_token_ids", ids_type(), True),
            f("completion", pa.string(), False),
            f("completion_token_ids", ids_type(), True),
            f("prompt_tokens", pa.uint32(), False),
            f("completion_tokens", pa.uint32(), False),
            f("finish_reason", pa.string(), False),
            f("model", pa.string(), False),
            f("attempts", pa.uint32(), False),
            f("latency_ms", pa.uint32(), False),
            f("ttft_ms", pa.uint32(), True),
            f("completed_at", pa.timestamp("ms", tz="UTC"), False),
            f("sample", pa.uint32(), False),
            f("turn", pa.uint32(), False),
            f("reasoning", pa.string(), True),
            f("tool_calls", pa.string(), True),
            f("tools", pa.string(), True),
            f("sampling", pa.string(), True),
            f("partial", pa.string(), True),
        ],
        metadata={
            "spool.version": "bench",
            "spool.config_sha256": "0" * 64,
            "spool.sampling": '{"max_tokens":128,"temperature":0.7,"top_p":1.0}',
            "spool.count_source": "server",
        },
    )


def id_lists(rng, n, lo, hi):
    lens = rng.integers(lo, hi, size=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = pa.array(rng.integers(0, 150_000, size=int(offsets[-1]), dtype=np.uint32))
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=ids_type()), lens


def chunk(rng, start, n):
    i = np.arange(start, start + n)
    words = [f"w{k}" for k in range(64)]
    text = lambda k, m: " ".join(words[(k + j) % 64] for j in range(m))
    prompt_ids, plens = id_lists(rng, n, 24, 56)
    comp_ids, clens = id_lists(rng, n, 48, 112)
    ids = [f"q{k}" for k in i]
    msgs = [
        '[{"role":"system","content":"You are terse."},{"role":"user","content":"Question %d: %s"}]'
        % (k, text(k, 8))
        for k in i
    ]
    cols = {
        "id": pa.array(ids),
        "dataset": pa.array(["bench"] * n),
        "row": pa.array(i.astype(np.uint64)),
        "prompt": pa.array(
            [f"<|im_start|>user\nQuestion {k}: {text(k, 8)}<|im_end|>\n<|im_start|>assistant\n" for k in i]
        ),
        "messages": pa.array(msgs),
        "prompt_token_ids": prompt_ids,
        "completion": pa.array([text(k, 40) for k in i]),
        "completion_token_ids": comp_ids,
        "prompt_tokens": pa.array(plens.astype(np.uint32)),
        "completion_tokens": pa.array(clens.astype(np.uint32)),
        "finish_reason": pa.array(["stop" if k % 10 else "length" for k in i]),
        "model": pa.array(["bench-model"] * n),
        "attempts": pa.array(np.ones(n, dtype=np.uint32)),
        "latency_ms": pa.array(np.full(n, 900, dtype=np.uint32)),
        "ttft_ms": pa.array(np.full(n, 40, dtype=np.uint32)),
        "completed_at": pa.array(np.full(n, 1_700_000_000_000, dtype=np.int64)).cast(
            pa.timestamp("ms", tz="UTC")
        ),
        "sample": pa.array(np.zeros(n, dtype=np.uint32)),
        "turn": pa.array(np.zeros(n, dtype=np.uint32)),
        "reasoning": pa.array([None] * n, pa.string()),
        "tool_calls": pa.array([None] * n, pa.string()),
        "tools": pa.array([None] * n, pa.string()),
        "sampling": pa.array(['{"temperature":0.7}'] * n),
        "partial": pa.array([None] * n, pa.string()),
    }
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=schema())


def generate(base, rows):
    """Shards of `rows` rows and a config, once; returns the config's path."""
    cfg = os.path.join(base, "spool.toml")
    done = os.path.join(base, ".complete")
    if os.path.exists(done):
        return cfg
    shutil.rmtree(base, ignore_errors=True)
    out = os.path.join(base, "out", "bench")
    os.makedirs(out)
    open(os.path.join(base, "empty.jsonl"), "w").close()
    with open(cfg, "w") as f:
        f.write(
            'data_dir = "data"\noutput_dir = "out"\n[server]\nmodel = "bench-model"\n'
            '[[dataset]]\nname = "bench"\npath = "empty.jsonl"\n'
        )
    rng = np.random.default_rng(7)
    t0 = time.time()
    for s, start in enumerate(range(0, rows, SHARD_ROWS)):
        n = min(SHARD_ROWS, rows - start)
        path = os.path.join(out, f"part-{s:06d}.parquet")
        # spool names list items `item` (the Arrow convention), not Parquet's `element`.
        with pq.ParquetWriter(
            path, schema(), compression="zstd", use_compliant_nested_type=False
        ) as w:
            for c in range(start, start + n, CHUNK):
                w.write_batch(chunk(rng, c, min(CHUNK, start + n - c)))
    open(done, "w").close()
    print(f"generated {rows} rows in {time.time() - t0:.0f} s under {base}", file=sys.stderr)
    return cfg


def measure(spool, cfg, fmt, out):
    shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else None
    # No [tokenizer]: the end-of-turn id appended to a completion that ended its turn is
    # named (Qwen's <|im_end|>), as a user without one must.
    cmd = ["/usr/bin/time", "-v", spool, "export", "-q", "-c", cfg, "--format", fmt, "--out", out,
           "--end-of-turn", "151645"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    m = re.search(r"export \S+: (\d+) row", p.stdout)
    rows = int(m.group(1)) if m else None
    size = (
        sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        if os.path.isdir(out)
        else os.path.getsize(out)
    )
    return rows, wall, rss, size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spool", required=True)
    ap.add_argument("--rows", default="1000000,10000000")
    ap.add_argument("--formats", default="tokens,sharegpt,hf")
    ap.add_argument("--keep", action="store_true", help="keep the exports")
    a = ap.parse_args()
    ext = {"tokens": ".parquet", "sharegpt": ".jsonl", "hf": ""}
    lines = [
        "| rows | format | wall s | rows/s | peak RSS MiB | output MB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for rows in [int(r) for r in a.rows.split(",")]:
        base = os.path.join(ROOT, "target", "bench-data", f"export-{rows}")
        cfg = generate(base, rows)
        for fmt in a.formats.split(","):
            out = os.path.join(base, "export", fmt + ext.get(fmt, ".out"))
            n, wall, rss, size = measure(a.spool, cfg, fmt, out)
            if n != rows:
                raise SystemExit(f"{fmt}: exported {n} rows of {rows}")
            line = f"| {rows:,} | {fmt} | {wall:.1f} | {rows / wall:,.0f} | {rss / 1024:.0f} | {size / 1e6:,.0f} |"
            print(line, file=sys.stderr)
            lines.append(line)
            if not a.keep:
                shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Input bombs: peak RSS, wall time, exit code and data_dir size of `spool run` on small
files that decode to gigabytes, each beside a plain 20-prompt dataset, against spool's
own mock server. The shapes are the tests' (tests/it/input_bombs.rs):

  zstd        60 lines of {"id": "z<i>", "prompt": "aaa…"} 30 MiB long, zstd -3 (~60 KB)
  parquet     one 1 MiB string in 3000 rows (own ids), dictionary-encoded, zstd (~7 KB)
  parquet-page  the same string in 300 rows of plain pages: one page of 300 MiB (~14 KB)
  wide        8 lines of `tools` holding 4 M empty objects (12 MB each, 100 MB)

Usage: python3 bench/bombs/bench.py --spool target/release/spool [--only zstd,wide]
Needs pyarrow and the zstd command-line tool. Prints one Markdown table row per bomb.
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq


def write_zstd(path):
    with open(path, "wb") as out:
        z = subprocess.Popen(["zstd", "-3", "-q", "-c"], stdin=subprocess.PIPE, stdout=out)
        chunk = b"a" * (1 << 20)
        for i in range(60):
            z.stdin.write(b'{"id": "z%d", "prompt": "' % i)
            for _ in range(30):
                z.stdin.write(chunk)
            z.stdin.write(b'"}\n')
        z.stdin.close()
        assert z.wait() == 0


def write_parquet(path, rows, dictionary):
    col = pa.DictionaryArray.from_arrays(
        pa.array([0] * rows, pa.int32()), pa.array(["x" * (1 << 20)])
    )
    ids = pa.array([f"b{i}" for i in range(rows)])
    pq.write_table(
        pa.table({"id": ids, "prompt": col}),
        path,
        compression="zstd",
        use_dictionary=dictionary,
    )


def write_wide(path):
    objects = "{}," * (4 << 20)
    with open(path, "w") as f:
        for i in range(8):
            f.write(
                f'{{"id": "w{i}", "messages": [{{"role": "user", "content": "hi"}}], '
                f'"tools": [{objects}{{}}]}}\n'
            )


BOMBS = {
    "zstd": ("bomb.jsonl.zst", write_zstd),
    "parquet": ("bomb.parquet", lambda p: write_parquet(p, 3000, True)),
    "parquet-page": ("bomb.parquet", lambda p: write_parquet(p, 300, False)),
    "wide": ("bomb.jsonl", write_wide),
}

CONFIG = """data_dir = "data"
output_dir = "out"
[server]
api = "chat"
urls = ["{url}"]
model = "mock-model"
self_check = false
[run]
concurrency = 16
metrics_addr = ""
[sampling]
max_tokens = 4
[[dataset]]
name = "plain"
path = "plain.jsonl"
[[dataset]]
name = "bomb"
path = "{bomb}"
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def run(spool, name):
    file, write = BOMBS[name]
    d = tempfile.mkdtemp(prefix=f"spool-bomb-{name}-")
    try:
        bomb = os.path.join(d, file)
        write(bomb)
        with open(os.path.join(d, "plain.jsonl"), "w") as f:
            for i in range(20):
                f.write(f'{{"id": "p{i}", "prompt": "hello {i}"}}\n')
        port = free_port()
        mock = subprocess.Popen(
            [spool, "mock-server", "--addr", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            cfg = os.path.join(d, "spool.toml")
            with open(cfg, "w") as f:
                f.write(CONFIG.format(url=f"http://127.0.0.1:{port}", bomb=file))
            t = time.monotonic()
            p = subprocess.run(
                ["/usr/bin/time", "-v", spool, "run", "-q", "-c", cfg],
                capture_output=True,
                text=True,
                errors="replace",
            )
            wall = time.monotonic() - t
        finally:
            mock.terminate()
            mock.wait()
        rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
        code = p.returncode
        signal = re.search(r"Command terminated by signal (\d+)", p.stderr)
        aborted = re.search(r"memory allocation of \d+ bytes failed", p.stderr)
        outcome = f"exit {code}"
        if signal:
            outcome = f"signal {signal.group(1)}"
        if aborted:
            outcome += f" ({aborted.group(0)})"
        print(
            f"| {name} | {os.path.getsize(bomb) // 1024} KB | {rss // 1024} MiB | {wall:.1f} s "
            f"| {outcome} | {du(os.path.join(d, 'data')) // (1 << 20)} MiB |",
            flush=True,
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spool", required=True)
    ap.add_argument("--only", default=",".join(BOMBS))
    a = ap.parse_args()
    print("| bomb | file | peak RSS | wall | outcome | data_dir |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.only.split(","):
        run(os.path.abspath(a.spool), name)


if __name__ == "__main__":
    sys.exit(main())

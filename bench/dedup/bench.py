#!/usr/bin/env python3
"""`make bench-dedup`: intake's rate when half the rows are duplicates, against all-unique rows.

Three files of N rows each (default 1,000,000; `--rows N`), made once under
target/bench-data/ from bench/scale/gen_prompts.py's rows (prompt strings, ids derived from
the content, no tokenizer):
  unique     N distinct rows;
  cat        the first N/2 of them, then the same N/2 again (`cat a.jsonl a.jsonl`);
  shuffled   the first N/2 of them twice, in a seeded random order (duplicates scattered).
Each is enqueued by `spool run` (release build) on a fresh data_dir with `token_budget = 0`,
so it enqueues everything and stops (no server: `self_check = false`, a closed port), the
same path as `make bench-scale`. Rate = rows of the file / the seconds of spool's own
`enqueued` line (the intake pass alone); CPU seconds (user + system) from wait4 (not its
peak RSS: on Linux that carries the forking Python's over the exec). Each file is
run `--repeat` times (default 3), alternating files; the median is printed, and the ratio
of each duplicate file's rate to the unique rate. Run by hand, never by `make test`.

usage: bench.py [--rows N] [--repeat R] [--spool PATH] [--files unique,cat,shuffled]
"""
import argparse
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))
from cargo_target import release_bin  # noqa: E402 (bench/cargo_target.py)
from spool_toml import write_config  # noqa: E402 (bench/spool_toml.py)
DATA = os.path.join(ROOT, "target", "bench-data")


def ensure(path, make):
    if not os.path.exists(path):
        print(f"generating {path}", flush=True)
        make(path + ".tmp")
        os.rename(path + ".tmp", path)
    return path


def files(n):
    os.makedirs(DATA, exist_ok=True)
    gen = os.path.join(ROOT, "bench", "scale", "gen_prompts.py")
    unique = ensure(os.path.join(DATA, f"scale-prompts-{n}.jsonl"),
                    lambda p: subprocess.run([sys.executable, gen, "--prompts", str(n), p], check=True))

    def half():
        with open(unique, "rb") as f:
            return [line for _, line in zip(range(n // 2), f)]

    def cat(p):
        rows = half()
        with open(p, "wb") as f:
            f.writelines(rows)
            f.writelines(rows)

    def shuffled(p):
        rows = half() * 2
        random.Random(11).shuffle(rows)
        with open(p, "wb") as f:
            f.writelines(rows)

    return {
        "unique": unique,
        "cat": ensure(os.path.join(DATA, f"dedup-cat-{n}.jsonl"), cat),
        "shuffled": ensure(os.path.join(DATA, f"dedup-shuffled-{n}.jsonl"), shuffled),
    }


def enqueue(spool, path):
    d = tempfile.mkdtemp(prefix="spool-bench-dedup-")
    try:
        cfg = write_config(d, "dedup", path, tail="[sampling]\nmax_tokens = 64")
        os.sync()
        err = open(os.path.join(d, "run.log"), "w+")
        p = subprocess.Popen([spool, "run", "-c", cfg], stdout=subprocess.DEVNULL, stderr=err, cwd=d)
        _, status, ru = os.wait4(p.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        err.seek(0)
        log = err.read()
        if rc != 0:
            sys.exit(f"spool run failed ({rc}):\n{log[-3000:]}")
        line = next((l for l in log.splitlines() if " enqueued" in l), None)
        if line is None:
            sys.exit("no `enqueued` line in spool's log:\n" + log[-3000:])
        f = dict((k, v.strip('"')) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line))
        return {"added": int(f["added"]), "rejected": int(f["rejected"]), "seconds": float(f["seconds"]),
                "cpu_s": ru.ru_utime + ru.ru_stime,
                "lookups": int(f.get("id_lookups", 0)), "lookup_bytes": int(f.get("id_lookup_bytes", -1))}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spool", help="spool binary (default: the release build, wherever cargo put it)")
    ap.add_argument("--files", default="unique,cat,shuffled")
    a = ap.parse_args()
    a.spool = a.spool or str(release_bin())
    paths = files(a.rows)
    names = a.files.split(",")
    lines = {}
    for name in names:
        with open(paths[name], "rb") as f:
            lines[name] = sum(1 for _ in f)
    runs = {name: [] for name in names}
    for i in range(a.repeat):
        for name in names:
            r = enqueue(a.spool, paths[name])
            r["rate"] = lines[name] / r["seconds"]
            runs[name].append(r)
            print(f"  run {i + 1} {name:9} {r['rate']:>10,.0f} rows/s  {r['seconds']:7.2f} s  cpu {r['cpu_s']:6.2f} s"
                  f"  added {r['added']:,} rejected {r['rejected']:,}  lookups {r['lookups']:,}"
                  f"  lookup bytes {r['lookup_bytes']:,}", flush=True)
    print(f"\n{a.spool}  rows={a.rows:,}  {platform.node()} {os.cpu_count()} CPUs  (median of {a.repeat})")
    print(f"{'file':10} {'rows/s':>10} {'seconds':>8} {'cpu s':>7} {'vs unique':>9}")
    base = statistics.median(r["rate"] for r in runs["unique"]) if "unique" in runs else None
    for name in names:
        rate = statistics.median(r["rate"] for r in runs[name])
        secs = statistics.median(r["seconds"] for r in runs[name])
        cpu = statistics.median(r["cpu_s"] for r in runs[name])
        ratio = f"{rate / base:.2f}" if base else "-"
        print(f"{name:10} {rate:>10,.0f} {secs:>8.2f} {cpu:>7.2f} {ratio:>9}")


if __name__ == "__main__":
    main()

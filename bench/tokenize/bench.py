#!/usr/bin/env python3
"""`make bench-tokenize`: spool's enqueue path vs a Python reference, same input, same
machine, same tokenizer (Qwen3, tests/fixtures/tokenizers/qwen3).

For each size N (default 100000 and 1000000):
  1. generate N chat prompts once (target/bench-data/prompts-N.jsonl, gen_prompts.py);
  2. spool: `spool run` (release build) on a config whose only dataset has
     `token_budget = 0`, so the run enqueues every prompt (parse, render, tokenize, write
     to the sled queue) and then stops at once (budget met); no server is needed
     (`self_check = false`, a closed port). Rates come from spool's own `enqueued` log
     line (the intake pass only); peak RSS is the whole process's (ru_maxrss, measured
     by a fresh parent so no other child counts);
  3. Python: reference.py (transformers apply_chat_template + tokenizers encode_batch);
     rates over its render+tokenize loop; peak RSS of the whole process.
The token totals of both must be equal: same template, same ids.

With --ablate, spool also runs without the fast byte-level BPE encoder
(SPOOL_BENCH_NO_FAST_BPE=1), then also without the NFC bypass (SPOOL_BENCH_NO_NFC_BYPASS=1)
and, given --spool-glibc (a `--no-default-features` build), with glibc malloc and neither:
what each optimisation bought, on the same input.

usage: bench.py [--sizes 100000,1000000] [--skip-python] [--spool PATH]
                [--ablate] [--spool-glibc PATH]
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))
from cargo_target import release_bin  # noqa: E402 (bench/cargo_target.py)
from spool_toml import write_config  # noqa: E402 (bench/spool_toml.py)
TOK = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen3")
DATA = os.path.join(ROOT, "target", "bench-data")




def peak_rss_mib(cmd):
    """Runs cmd under a fresh python parent so RUSAGE_CHILDREN is its alone."""
    code = (
        "import resource, subprocess, sys, json, time\n"
        "t=time.perf_counter()\n"
        "p=subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "w=time.perf_counter()-t\n"
        "u=resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': p.returncode, 'rss_kib': u.ru_maxrss, 'cpu': u.ru_utime + u.ru_stime, 'wall': w, 'out': p.stdout, 'err': p.stderr[-200000:]}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True)
    res = json.loads(p.stdout)
    if res["rc"] != 0:
        sys.exit(f"{cmd[0]} failed ({res['rc']}):\n{res['err'][-3000:]}")
    return res


def ensure_data(n):
    os.makedirs(DATA, exist_ok=True)
    path = os.path.join(DATA, f"prompts-{n}.jsonl")
    if not os.path.exists(path):
        print(f"generating {n} prompts -> {path}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "gen_prompts.py"), str(n), path + ".tmp"], check=True)
        os.rename(path + ".tmp", path)
    return path


def spool_config(d, prompts):
    return write_config(d, "bench", prompts, tail=f'''[tokenizer]
path = "{TOK}/tokenizer.json"
chat_template = "{TOK}/tokenizer_config.json"''')


def bench_spool(spool, prompts, env=None):
    d = tempfile.mkdtemp(prefix="spool-bench-", dir=DATA)
    try:
        cfg = spool_config(d, prompts)
        res = peak_rss_mib(["env", *(env or []), spool, "run", "-c", cfg])
        line = next((l for l in res["err"].splitlines() if " enqueued" in l), None)
        if line is None:
            sys.exit("no `enqueued` line in spool's log:\n" + res["err"][-3000:])
        f = dict((k, v.strip('"')) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line))
        du = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(os.path.join(d, "data")) for x in fs)
        return {
            "prompts": int(f["added"]),
            "tokens": int(f["prompt_tokens"]),
            "seconds": float(f["seconds"]),
            "wall": res["wall"],
            "rss_mib": res["rss_kib"] / 1024,
            "cpu_s": res["cpu"],
            "queue_mib": du / 2**20,
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_python(prompts):
    res = peak_rss_mib([sys.executable, os.path.join(HERE, "reference.py"), TOK, prompts])
    r = json.loads(res["out"].strip().splitlines()[-1])
    r.update(wall=res["wall"], rss_mib=res["rss_kib"] / 1024, cpu_s=res["cpu"])
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--skip-python", action="store_true")
    ap.add_argument("--spool", help="spool binary (default: the release build, wherever cargo put it)")
    ap.add_argument("--ablate", action="store_true")
    ap.add_argument("--spool-glibc")
    a = ap.parse_args()
    a.spool = a.spool or str(release_bin())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}")
    try:
        import tokenizers, transformers
        print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
    except ImportError:
        pass
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        prompts = ensure_data(n)
        mib = os.path.getsize(prompts) / 2**20
        s = bench_spool(a.spool, prompts)
        rows.append(("spool", n, mib, s))
        print(json.dumps({"impl": "spool", "n": n, **s}), flush=True)
        if a.ablate:
            no_fast = "SPOOL_BENCH_NO_FAST_BPE=1"
            no_bypass = "SPOOL_BENCH_NO_NFC_BYPASS=1"
            variants = [
                ("spool, no fast BPE", a.spool, [no_fast]),
                ("spool, no fast BPE, no NFC bypass", a.spool, [no_fast, no_bypass]),
            ]
            if a.spool_glibc:
                variants.append(("spool, glibc malloc, no fast BPE, no NFC bypass", a.spool_glibc,
                                 [no_fast, no_bypass]))
            for label, binary, env in variants:
                v = bench_spool(binary, prompts, env)
                rows.append((label, n, mib, v))
                print(json.dumps({"impl": label, "n": n, **v}), flush=True)
                if v["tokens"] != s["tokens"]:
                    print(f"MISMATCH: {label} {v['tokens']} tokens, spool {s['tokens']}", flush=True)
        if not a.skip_python:
            p = bench_python(prompts)
            rows.append(("python", n, mib, p))
            print(json.dumps({"impl": "python", "n": n, **p}), flush=True)
            if p["tokens"] != s["tokens"] or p["prompts"] != s["prompts"]:
                print(f"MISMATCH: spool {s['prompts']} prompts / {s['tokens']} tokens, "
                      f"python {p['prompts']} / {p['tokens']}", flush=True)
    print()
    # CPU seconds (user + system, whole process, startup included) per 1,000 prompts: unlike
    # the rates, barely moved by other load on a shared machine.
    print("| impl | prompts | input | prompts/s | tokens/s | loop s | process s | CPU s / 1k prompts | peak RSS |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for impl, n, mib, r in rows:
        print(f"| {impl} | {n:,} | {mib:,.0f} MiB | {r['prompts'] / r['seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds']:,.0f} | {r['seconds']:.1f} | {r['wall']:.1f} | "
              f"{1000 * r['cpu_s'] / r['prompts']:.3f} | {r['rss_mib']:,.0f} MiB |")


if __name__ == "__main__":
    main()

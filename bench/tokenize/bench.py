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

With --kimi (`make bench-tokenize-kimi`), the same input through Kimi's tokenizer instead
(tests/fixtures/tokenizers/kimi-k2, the model folder as `[tokenizer] path`, its own chat
template): spool's enqueue path at each size (rate, peak RSS), then the raw encoder on one
thread against Python tiktoken built as Moonshot builds it, on two corpora: the first
--corpus rows' message texts, and the repository's own code and docs (wider vocabulary)
(examples/bench_kimi_encode.rs vs kimi_reference.py; 3 passes each, first and best shown;
token totals and id checksums compared).

usage: bench.py [--sizes 100000,1000000] [--skip-python] [--spool PATH]
                [--ablate] [--spool-glibc PATH]
                [--kimi [--encoder PATH] [--corpus 100000]]
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
KIMI = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "kimi-k2")
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


def spool_config(d, prompts, kimi=False):
    if kimi:
        return write_config(d, "bench", prompts, tail=f'''[tokenizer]
path = "{KIMI}"''')
    return write_config(d, "bench", prompts, tail=f'''[tokenizer]
path = "{TOK}/tokenizer.json"
chat_template = "{TOK}/tokenizer_config.json"''')


def bench_spool(spool, prompts, env=None, kimi=False):
    d = tempfile.mkdtemp(prefix="spool-bench-", dir=DATA)
    try:
        cfg = spool_config(d, prompts, kimi)
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


def kimi_corpus(prompts, rows):
    """The message texts of the first `rows` rows, one {"text"} a line: what the raw
    encoder benchmark encodes on both sides."""
    path = os.path.join(DATA, f"kimi-corpus-{rows}.jsonl")
    if not os.path.exists(path):
        with open(prompts, encoding="utf-8") as f, open(path + ".tmp", "w", encoding="utf-8") as out:
            for i, line in enumerate(f):
                if i == rows:
                    break
                row = json.loads(line)
                turns = row.get("messages") or row.get("conversations")
                text = "\n".join(t.get("content") or t.get("value") for t in turns)
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        os.rename(path + ".tmp", path)
    return path


def repo_corpus():
    """The repository's own Rust, Python and Markdown (target/ and fixtures left out), in
    paragraphs of at most ~2,000 characters, one {"text"} a line: prose and code with a far
    wider vocabulary than the generated prompts."""
    path = os.path.join(DATA, "kimi-corpus-repo.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        for top in ("src", "tests/it", "tests/python", "bench", "docs", "examples", "."):
            base = os.path.join(ROOT, top)
            names = sorted(os.listdir(base)) if top == "." else None
            files = ([os.path.join(base, n) for n in names if n.endswith(".md")] if names is not None
                     else sorted(os.path.join(r, f) for r, _, fs in os.walk(base) for f in fs
                                 if f.endswith((".rs", ".py", ".md"))))
            for fp in files:
                with open(fp, encoding="utf-8") as f:
                    chunk = ""
                    for para in f.read().split("\n\n"):
                        if chunk and len(chunk) + len(para) > 2000:
                            out.write(json.dumps({"text": chunk}, ensure_ascii=False) + "\n")
                            chunk = ""
                        chunk += para + "\n\n"
                    if chunk:
                        out.write(json.dumps({"text": chunk}, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    return path


def json_lines(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]


def bench_kimi(a):
    """Kimi: the enqueue path at each size, then the raw encoder against Python tiktoken."""
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        prompts = ensure_data(n)
        s = bench_spool(a.spool, prompts, kimi=True)
        rows.append((n, os.path.getsize(prompts) / 2**20, s))
        print(json.dumps({"impl": "spool, kimi", "n": n, **s}), flush=True)
    print()
    print("| impl | prompts | input | prompts/s | tokens/s | loop s | process s | CPU s / 1k prompts | peak RSS |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, mib, r in rows:
        print(f"| spool, Kimi folder | {n:,} | {mib:,.0f} MiB | {r['prompts'] / r['seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds']:,.0f} | {r['seconds']:.1f} | {r['wall']:.1f} | "
              f"{1000 * r['cpu_s'] / r['prompts']:.3f} | {r['rss_mib']:,.0f} MiB |")
    print()
    enc = a.encoder or str(release_bin().parent / "examples" / "bench_kimi_encode")
    for corpus in (kimi_corpus(ensure_data(max(a.corpus, 1)), a.corpus), repo_corpus()):
        mine = json_lines([enc, KIMI, corpus, "3"])
        theirs = [] if a.skip_python else json_lines(
            [sys.executable, os.path.join(HERE, "kimi_reference.py"), KIMI, corpus, "3"])
        results = [("spool", [r for r in mine if "pass" in r])]
        for name in ("tiktoken", "vendor encode"):
            results.append((f"python {name}", [r for r in theirs if r.get("impl") == name]))
        loads = {"spool": round(mine[0]["load_seconds"], 3)}
        if theirs:
            loads["python"] = round(theirs[0]["load_seconds"], 3)
        print(f"raw encoder, one thread: corpus {os.path.basename(corpus)}, tokenizer load s {loads}")
        print("| impl | texts | MB | tokens | first pass s | best of 3 s | MB/s (best) | tokens/s (best) | ids |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        want = results[0][1][0]
        for name, passes in results:
            if not passes:
                continue
            best = min(passes, key=lambda r: r["seconds"])
            same = all(r["tokens"] == want["tokens"] and r["checksum"] == want["checksum"] for r in passes)
            print(f"| {name} | {best['texts']:,} | {best['bytes'] / 1e6:,.1f} | {best['tokens']:,} | "
                  f"{passes[0]['seconds']:.2f} | {best['seconds']:.2f} | "
                  f"{best['bytes'] / 1e6 / best['seconds']:,.2f} | "
                  f"{best['tokens'] / best['seconds']:,.0f} | {'same' if same else 'DIFFER'} |")
        print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--skip-python", action="store_true")
    ap.add_argument("--spool", help="spool binary (default: the release build, wherever cargo put it)")
    ap.add_argument("--ablate", action="store_true")
    ap.add_argument("--spool-glibc")
    ap.add_argument("--kimi", action="store_true")
    ap.add_argument("--encoder", help="examples/bench_kimi_encode (default: the release build)")
    ap.add_argument("--corpus", type=int, default=100_000)
    a = ap.parse_args()
    a.spool = a.spool or str(release_bin())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}")
    if a.kimi:
        import tiktoken
        print(f"tiktoken {tiktoken.__version__}")
        bench_kimi(a)
        return
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

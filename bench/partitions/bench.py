#!/usr/bin/env python3
"""`make bench-partitions`: one process against N partitions on the same mock capacity.

One mock server (its capacity model: a fixed aggregate tok/s shared by the requests in
flight) serves two datasets: `free` (no budget: throughput) and `bound` (a token budget
about half its demand: overshoot and budget left unused). Rows:

  one process      today's single `spool run` (concurrency C, local output);
  N partitions     N `spool run` processes with JOB_COMPLETION_INDEX=0..N-1 (C/N each)
                   committing to one file:// prefix and sharing `bound`'s budget (tickets
                   from one pool), then `spool finalize`;

each under `budget_policy = "cancel"` and `"finish"`, for each N of --partitions. Figures:
wall time (first start to last exit, finalize included), published completions/s and
tok/s, `bound`'s tokens against its budget (overshoot = above it; unused = below it while
items were left) and the budget tickets taken. Every server binds 127.0.0.1 port 0. By
hand, never in `make test`.
"""
import argparse, json, os, pathlib, subprocess, sys, tempfile, time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from cargo_target import release_bin  # noqa: E402

BIN = pathlib.Path(os.environ.get("SPOOL_BENCH_BIN") or release_bin()).resolve()


def start_mock(args, log):
    p = subprocess.Popen([str(BIN), "mock-server", "--addr", "127.0.0.1:0", *args],
                         stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        sys.exit(f"mock did not start: {line!r} (see {log})")
    return p, line.strip().replace("listening on ", "")


def write_prompts(path, prefix, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}{i}", "prompt": f"question {i} about {prefix}"}) + "\n")


def config(d, url, concurrency, policy, budget, partitions, output):
    part = f"partitions = {partitions}\n" if partitions else ""
    (d / "spool.toml").write_text(f"""
data_dir = "data-{{partition}}"
output_dir = "{output}"
[server]
api = "completions"
urls = ["{url}"]
model = "mock"
request_timeout_s = 3600
self_check = false
[run]
concurrency = {concurrency}
progress_every = 100000000
metrics_addr = ""
shutdown_grace_s = 5
budget_policy = "{policy}"
{part}[sampling]
max_tokens = 4096
[shards]
max_rows = 500
[[dataset]]
name = "free"
path = "free.jsonl"
[[dataset]]
name = "bound"
path = "bound.jsonl"
token_budget = {budget}
""")


def run_all(cmds, cwd):
    procs = [subprocess.Popen(c, cwd=cwd, env={**os.environ, **e}, stdout=subprocess.DEVNULL,
                              stderr=open(cwd / f"run-{i}.log", "w"))
             for i, (c, e) in enumerate(cmds)]
    for i, p in enumerate(procs):
        if p.wait() != 0:
            sys.exit(f"run {i} exited {p.returncode}: see {cwd}/run-{i}.log")


def one(a, partitions, policy):
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-part-{partitions}-{policy}-"))
    write_prompts(d / "free.jsonl", "f", a.prompts)
    write_prompts(d / "bound.jsonl", "b", a.prompts)
    mock, url = start_mock(["--capacity-tps", str(a.capacity), "--per-request-tps", str(a.per_request),
                            "--mean-tokens", str(a.mean), "--sigma", "1.0", "--time-scale", str(a.scale),
                            "--seed", "7"], d / "mock.log")
    try:
        cfg = str(d / "spool.toml")
        t0 = time.perf_counter()
        if partitions == 0:
            config(d, url, a.concurrency, policy, a.budget, None, "out")
            run_all([([str(BIN), "-q", "run", "-c", cfg], {})], d)
            wall = time.perf_counter() - t0
            st = json.loads(subprocess.check_output([str(BIN), "status", "-c", cfg, "--json", "-q"]))
            ds = {x["name"]: x for x in st["datasets"]}
            tokens = {n: ds[n]["completion_tokens"] for n in ds}
            rows = sum(ds[n]["done"] for n in ds)
            items_left = ds["bound"]["items"] - ds["bound"]["done"] - ds["bound"].get("failed", 0)
        else:
            config(d, url, a.concurrency // partitions, policy, a.budget, partitions, f"file://{d}/shared")
            run_all([([str(BIN), "-q", "run", "-c", cfg], {"JOB_COMPLETION_INDEX": str(i)})
                     for i in range(partitions)], d)
            m = json.loads(subprocess.check_output([str(BIN), "finalize", "-c", cfg, "--json", "-q"]))
            wall = time.perf_counter() - t0
            tokens = {n: m["datasets"][n]["completion_tokens"] for n in m["datasets"]}
            rows = sum(m["datasets"][n]["items"] for n in m["datasets"])
            items_left = a.prompts - m["datasets"]["bound"]["items"]
            tickets = len(list((d / "shared/_spool/budget/bound").glob("*.json")))
    finally:
        mock.terminate()
        mock.wait()
    b = tokens.get("bound", 0)
    total = sum(tokens.values())
    if partitions == 0:
        tickets = 0
    return {
        "tickets": tickets,
        "setup": "one process" if partitions == 0 else f"{partitions} partitions",
        "policy": policy, "wall": wall, "rows_s": rows / wall, "tok_s": total / wall,
        "bound": b, "overshoot": max(0, b - a.budget),
        "unused": max(0, a.budget - b) if items_left > 0 else 0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=300_000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--capacity", type=float, default=850)
    ap.add_argument("--per-request", type=float, default=60)
    ap.add_argument("--mean", type=float, default=300)
    ap.add_argument("--scale", type=float, default=40)
    ap.add_argument("--policies", default="cancel,finish")
    ap.add_argument("--partitions", default="4,16", help="partition counts, comma-separated")
    a = ap.parse_args()
    print(f"mock: {a.capacity * a.scale:.0f} tok/s aggregate, {a.per_request * a.scale:.0f} per request, "
          f"lognormal mean {a.mean} σ 1; {a.prompts} prompts per dataset; budget {a.budget}; "
          f"concurrency {a.concurrency} in all")
    print("| setup | policy | wall s | completions/s | tok/s | `bound` tokens | overshoot | unused | tickets |")
    print("|---|---|---|---|---|---|---|---|---|")
    counts = [int(n) for n in a.partitions.split(",")]
    for policy in a.policies.split(","):
        for parts in [0, *counts]:
            r = one(a, parts, policy)
            print(f"| {r['setup']} | {r['policy']} | {r['wall']:.1f} | {r['rows_s']:.0f} | {r['tok_s']:.0f} | "
                  f"{r['bound']} | {r['overshoot']} ({100 * r['overshoot'] / a.budget:.2f} %) | "
                  f"{r['unused']} ({100 * r['unused'] / a.budget:.2f} %) | {r['tickets']} |", flush=True)
            print(f"  load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()

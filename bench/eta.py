#!/usr/bin/env python3
"""`make bench-eta`: budget overshoot, ETA honesty and slot use at the dataset boundary.

A scaled-time simulation of the real job against `spool mock-server`: 150 requests in
flight, completion lengths log-normal (mean 3500, sigma 1, capped at 10240), an aggregate
capacity of 850 tok/s (times the time scale), a 10 M-token budget over 10 000 prompts and a
second dataset after it. Variants:

  finish  budget_policy = "finish"  (spool's default)
  cancel  budget_policy = "cancel"
  naive   dispatch until completed tokens >= budget (SPOOL_BENCH_NAIVE_BUDGET=1)
  serial  wait for each dataset's tail before the next (SPOOL_BENCH_SERIAL_DATASETS=1)

Every second it reads the running process's /status (spool's ETA per dataset, done
counts) and computes the naive ETA "remaining requests / completed requests per second".
At the end it prints the tables that BENCHMARKS.md records. Loopback only.
"""
import argparse, json, os, pathlib, signal, subprocess, sys, tempfile, time, urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
from cargo_target import release_bin  # noqa: E402 (bench/ is this script's folder)


def start_mock(bin_, scale, seed, log):
    p = subprocess.Popen(
        [bin_, "mock-server", "--addr", "127.0.0.1:0", "--time-scale", str(scale),
         "--capacity-tps", "850", "--per-request-tps", "60", "--mean-tokens", "3500",
         "--sigma", "1.0", "--seed", str(seed), "--context-len", "100000"],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = p.stdout.readline()
    return p, line.strip().replace("listening on ", "")


def write_inputs(d, n1, n2):
    with open(d / "a.jsonl", "w") as f:
        for i in range(n1):
            f.write(json.dumps({"id": i, "prompt": f"prompt {i} of the first set: write at length about topic {i}"}) + "\n")
    with open(d / "b.jsonl", "w") as f:
        for i in range(n2):
            f.write(json.dumps({"id": i, "prompt": f"prompt {i} of the second set about item {i}"}) + "\n")


def config(d, url, policy, budget1, budget2):
    (d / "spool.toml").write_text(f"""
data_dir = "data"
output_dir = "out"
[server]
api = "completions"
urls = ["{url}"]
model = "mock"
stream = true
request_timeout_s = 36000
[run]
concurrency = 150
progress_every = 1000000
metrics_addr = "127.0.0.1:0"
budget_policy = "{policy}"
shutdown_grace_s = 5
[sampling]
max_tokens = 10240
[shards]
max_rows = 5000
[[dataset]]
name = "first"
path = "a.jsonl"
token_budget = {budget1}
[[dataset]]
name = "second"
path = "b.jsonl"
token_budget = {budget2}
""")


def get_status(addr):
    try:
        with urllib.request.urlopen(f"http://{addr}/status", timeout=2) as r:
            return json.load(r)
    except Exception:
        return None


def shard_last_completed(dir_):
    """Latest `completed_at` (Unix seconds) over a dataset's shards, or None without pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    last = None
    for f in sorted(dir_.glob("part-*.parquet")):
        col = pq.read_table(f, columns=["completed_at"]).column("completed_at")
        for v in col.to_pylist():
            ts = v.timestamp() if v is not None else None
            if ts is not None and (last is None or ts > last):
                last = ts
    return last


def run_variant(bin_, variant, scale, seed, n1, n2, budget1, budget2):
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-eta-{variant}-"))
    write_inputs(d, n1, n2)
    mock, url = start_mock(bin_, scale, seed, d / "mock.log")
    policy = "cancel" if variant == "cancel" else "finish"
    config(d, url, policy, budget1, budget2)
    env = dict(os.environ)
    if variant == "naive":
        env["SPOOL_BENCH_NAIVE_BUDGET"] = "1"
    if variant == "serial":
        env["SPOOL_BENCH_SERIAL_DATASETS"] = "1"
    t0 = time.monotonic()
    t0_wall = time.time()
    run = subprocess.Popen([bin_, "run", "-q", "-c", str(d / "spool.toml")], env=env,
                           stdout=subprocess.DEVNULL, stderr=open(d / "run.log", "w"))
    addr = None
    samples = []  # (t, first: (done, items, eta_spool, tokens), finished flags)
    first_done_at = None
    cpu0 = None
    while run.poll() is None:
        time.sleep(0.5)
        if addr is None:
            try:
                addr = (d / "data" / "metrics.addr").read_text().strip()
            except FileNotFoundError:
                continue
        st = get_status(addr)
        if not st:
            continue
        t = time.monotonic() - t0
        f = st["datasets"][0]
        g = st["datasets"][1] if len(st["datasets"]) > 1 else {}
        samples.append((t, f["done"], f["items"], f.get("eta_s"), f["completion_tokens"], f["inflight"], f["state"],
                        g.get("inflight"), g.get("state"), f.get("tokens_per_s"), g.get("tokens_per_s")))
        if first_done_at is None and f["inflight"] == 0 and f["state"] in ("budget_met", "done") and f["done"] > 0:
            first_done_at = t
    wall = time.monotonic() - t0
    # The exact end of the first dataset: its last completion's timestamp in the shards
    # (the /status polls only bound it to within a poll interval).
    last_completed = shard_last_completed(d / "out" / "first")
    if last_completed is not None and first_done_at is not None:
        first_done_at = last_completed - t0_wall
    final = json.loads(subprocess.run([bin_, "status", "--json", "-c", str(d / "spool.toml")],
                                      capture_output=True, text=True).stdout)
    mock.send_signal(signal.SIGINT)
    mock.wait(timeout=30)
    # Tokens the simulated GPU produced: completed + wasted (cancelled) tokens.
    gen = sum(x["completion_tokens"] + x["wasted_tokens"] for x in final["datasets"])
    return {"variant": variant, "wall": wall, "samples": samples, "final": final,
            "first_done_at": first_done_at, "generated": gen, "dir": str(d)}


def run_capacity(bin_, variant, scale, seed, prompts, kill_at, concurrency):
    """Two mock servers, one dataset without a budget; `loss`: the second server is
    SIGKILLed at `kill_at` s (out of rotation at once: its connections are refused).
    Returns the /status samples, the kill time and the run's end (last completed_at)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-eta-{variant}-"))
    write_inputs(d, prompts, 0)
    a, url_a = start_mock(bin_, scale, seed, d / "mock-a.log")
    b, url_b = start_mock(bin_, scale, seed + 1, d / "mock-b.log")
    conc = '"auto"' if concurrency == "auto" else str(concurrency)
    (d / "spool.toml").write_text(f"""
data_dir = "data"
output_dir = "out"
[server]
api = "completions"
urls = ["{url_a}", "{url_b}"]
stream = true
request_timeout_s = 36000
self_check = false
max_attempts = 50
[run]
concurrency = {conc}
progress_every = 1000000
metrics_addr = "127.0.0.1:0"
shutdown_grace_s = 5
[sampling]
max_tokens = 10240
[shards]
max_rows = 5000
[[dataset]]
name = "first"
path = "a.jsonl"
""")
    t0, t0_wall = time.monotonic(), time.time()
    run = subprocess.Popen([bin_, "run", "-q", "-c", str(d / "spool.toml")],
                           stdout=subprocess.DEVNULL, stderr=open(d / "run.log", "w"))
    addr, samples, killed = None, [], None
    while run.poll() is None:
        time.sleep(0.5)
        t = time.monotonic() - t0
        if variant == "loss" and killed is None and t >= kill_at:
            b.kill()
            killed = t
        if addr is None:
            try:
                addr = (d / "data" / "metrics.addr").read_text().strip()
            except FileNotFoundError:
                continue
        st = get_status(addr)
        if st:
            f = st["datasets"][0]
            samples.append((t, f.get("eta_s"), f["done"]))
    last = shard_last_completed(d / "out" / "first")
    end = last - t0_wall if last is not None else time.monotonic() - t0
    for p in (a, b):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
    return {"variant": variant, "samples": samples, "killed": killed, "end": end, "dir": str(d)}


def median(xs):
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def capacity_errors(res):
    """Median |eta - actual| / actual: after a loss over [0,10), [10,60), [60,end) s;
    without one over 5-90 % of the run."""
    end, k = res["end"], res["killed"]
    errs = [(t, abs(eta - (end - t)) / (end - t)) for t, eta, _ in res["samples"]
            if eta is not None and end - t > 0]
    if k is None:
        return {"5-90 %": median([e for t, e in errs if 0.05 * end <= t <= 0.90 * end])}
    win = lambda lo, hi: median([e for t, e in errs if k + lo <= t < k + hi and t <= 0.98 * end])
    return {"before the loss (5 % of the run on)": median([e for t, e in errs if 0.05 * end <= t < k]),
            "0-10 s after": win(0, 10), "10-60 s after": win(10, 60), "60 s after to the end": win(60, 1e9)}


FRACTIONS = (0.01, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95)


def trace(res, from_frac=0.5):
    """Predicted vs actual remaining over the end of the first dataset (`--trace`)."""
    end = res["first_done_at"] or res["wall"]
    print("t(s) done inflight1 state1 inflight2 state2 tok/s(1+2) eta_spool actual err%", file=sys.stderr)
    for x in res["samples"]:
        t, done, items, eta, tokens, inflight, state, in2, st2, r1, r2 = x
        if t < from_frac * end or t > end + 1:
            continue
        actual = end - t
        err = "" if eta is None or actual <= 0 else f"{100 * (eta - actual) / actual:+.1f}"
        rate = (r1 or 0) + (r2 or 0)
        print(f"{t:6.1f} {done:6d} {inflight:4d} {state:10s} {in2} {st2} {rate:8.0f} "
              f"{'-' if eta is None else f'{eta:6.1f}'} {actual:6.1f} {err}", file=sys.stderr)


def eta_errors(res):
    """|predicted - actual| / actual at fractions of the first dataset's run."""
    s = res["samples"]
    end = res["first_done_at"] or res["wall"]
    out = {}
    for frac in FRACTIONS:
        target = frac * end
        cand = [x for x in s if x[0] >= target]
        if not cand:
            continue
        t, done, items, eta, tokens, inflight, state = cand[0][:7]
        actual = end - t
        if actual <= 0:
            continue
        # Naive: remaining requests / completed requests per second so far.
        naive = (items - done) / (done / t) if done > 0 else None
        err = lambda p: None if p is None else abs(p - actual) / actual
        out[frac] = (err(eta), err(naive), t, actual, eta, naive)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=10000)
    ap.add_argument("--budget", type=int, default=10_000_000)
    ap.add_argument("--second-prompts", type=int, default=1000)
    ap.add_argument("--second-budget", type=int, default=1_000_000)
    ap.add_argument("--variants", default="finish,cancel,naive,serial,steady2,loss")
    ap.add_argument("--capacity-prompts", type=int, default=4000,
                    help="prompts of the two-server runs (steady2, loss)")
    ap.add_argument("--kill-at", type=float, default=90.0,
                    help="seconds into the `loss` run when the second server is killed")
    ap.add_argument("--capacity-concurrency", default="150",
                    help="concurrency of the two-server runs (a number or auto)")
    ap.add_argument("--bin", help="spool binary (default: the release build, wherever cargo put it)")
    ap.add_argument("--trace", action="store_true",
                    help="print predicted vs actual remaining over the second half of the run")
    a = ap.parse_args()
    a.bin = a.bin or str(release_bin())
    results = {}
    for v in a.variants.split(","):
        print(f"== {v} (time scale {a.scale})", file=sys.stderr, flush=True)
        if v in ("steady2", "loss"):
            results[v] = run_capacity(a.bin, v, a.scale, a.seed, a.capacity_prompts, a.kill_at,
                                      a.capacity_concurrency)
            print(f"   ends at {results[v]['end']:.0f}s, killed at {results[v]['killed']}", file=sys.stderr)
            continue
        results[v] = run_variant(a.bin, v, a.scale, a.seed, a.prompts, a.second_prompts, a.budget, a.second_budget)
        r = results[v]
        print(f"   wall {r['wall']:.0f}s, first dataset done at {r['first_done_at']}", file=sys.stderr)
    cap = 850.0 * a.scale
    print(f"\nScaled-time simulation: time scale {a.scale:g}, 150 in flight, lognormal(mean 3500, sigma 1) capped at 10240,")
    print(f"{cap:.0f} tok/s capacity ({850} tok/s real), first dataset {a.prompts} prompts / budget {a.budget:,}, "
          f"second {a.second_prompts} prompts / budget {a.second_budget:,}.\n")
    if "finish" in results and a.trace:
        trace(results["finish"])
    if "finish" in results:
        e = eta_errors(results["finish"])
        print("ETA error |predicted - actual| / actual, first dataset (policy finish):\n")
        print("| point of the run | spool ETA error | naive ETA error (remaining req / req/s) | actual remaining (s, scaled) |")
        print("|---|---|---|---|")
        fmt = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"
        for frac, (es, en, t, actual, eta, naive) in sorted(e.items()):
            print(f"| {int(frac * 100)} % | {fmt(es)} | {fmt(en)} | {actual:.0f} |")
        print()
    print("Budget outcome, first dataset:\n")
    print("| policy | completed tokens | budget | final − budget | % of budget | wasted (cancelled) tokens |")
    print("|---|---|---|---|---|---|")
    for v in ("finish", "cancel", "naive"):
        if v in results:
            f = results[v]["final"]["datasets"][0]
            diff = f["completion_tokens"] - a.budget
            print(f"| {v} | {f['completion_tokens']:,} | {a.budget:,} | {diff:+,} | {100 * diff / a.budget:+.2f} % | {f['wasted_tokens']:,} |")
    print()
    print("Server utilisation over the whole two-dataset run (tokens generated / (capacity x wall time)):\n")
    print("| scheduling | wall (s, scaled) | tokens generated | utilisation |")
    print("|---|---|---|---|")
    for v in ("finish", "serial"):
        if v in results:
            r = results[v]
            print(f"| {'spool (next dataset fills free slots)' if v == 'finish' else 'wait for each tail'} | {r['wall']:.0f} | {r['generated']:,} | {100 * r['generated'] / (cap * r['wall']):.1f} % |")
    for v in ("steady2", "loss"):
        if v in results:
            print(f"\nETA median error, two servers (850 tok/s each x {a.scale:g}), concurrency "
                  f"{a.capacity_concurrency}, {a.capacity_prompts} prompts, "
                  f"{'second server killed at ' + str(a.kill_at) + ' s' if v == 'loss' else 'no loss'}:\n")
            print("| window | median error |")
            print("|---|---|")
            for k, e in capacity_errors(results[v]).items():
                print(f"| {k} | {'n/a' if e is None else f'{100 * e:.1f} %'} |")
    json.dump(results,
              open(pathlib.Path(tempfile.gettempdir()) / "spool-bench-eta.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()

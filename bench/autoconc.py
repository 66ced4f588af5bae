#!/usr/bin/env python3
"""`make bench-autoconc`: `concurrency = "auto"` against a sweep of fixed concurrencies on
`spool mock-server`'s KV-cache model, three profiles:

  kv-bound    one server whose KV cache holds ~70 requests of this workload: past that
              the newest are preempted and recomputed (the throughput falls)
  compute     one server with a KV cache that never fills: throughput flat past its knee,
              a queue past its max_running
  unequal     two servers, one with half the KV cache and half the compute of the other

Each setting is one `spool run` with `budget_policy = "cancel"` and a token budget: the
throughput is the tokens the mock(s) generated per second over a window after warm-up
(`--warmup`, default 20 s, to the moment the budget is met), preemptions are the mocks'
`vllm:num_preemptions_total` at the end, thrown away is the run's `wasted_tokens`.
Completions are log-normal (mean 1000, sigma 1, capped at 4096), time scale 100.
Loopback only.
"""
import argparse, json, os, pathlib, signal, subprocess, sys, tempfile, time, urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cargo_target import release_bin  # noqa: E402

COMMON = ["--mean-tokens", "1000", "--sigma", "1.0", "--context-len", "100000",
          "--per-request-tps", "60", "--prefill-tps", "8000", "--metrics-names", "vllm"]
PROFILES = {
    "kv-bound": {"servers": [["--kv-tokens", "100000", "--capacity-tps", "6000"]],
                 "sweep": [32, 48, 64, 96, 128, 192]},
    "compute": {"servers": [["--kv-tokens", "10000000", "--capacity-tps", "2000",
                             "--max-running", "256"]],
                "sweep": [16, 32, 64, 128, 256]},
    "unequal": {"servers": [["--kv-tokens", "100000", "--capacity-tps", "6000"],
                            ["--kv-tokens", "50000", "--capacity-tps", "3000"]],
                "sweep": [48, 64, 96, 128, 192]},
}


def start_mock(bin_, flags, scale, seed, log):
    p = subprocess.Popen([bin_, "mock-server", "--addr", "127.0.0.1:0", "--time-scale", str(scale),
                          "--seed", str(seed)] + COMMON + flags,
                         stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = p.stdout.readline()
    return p, line.strip().replace("listening on ", "")


def mock_counters(url):
    out = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = line.split("{")[0].split()[0]
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def config_head(urls):
    """The start of a bench run's spool.toml: local folders, the mocks' completions API."""
    return f"""
data_dir = "data"
output_dir = "out"
[server]
api = "completions"
urls = [{", ".join(f'"{u}"' for u in urls)}]
stream = true
"""


def tokens_and_preemptions(urls):
    t = p = 0.0
    for u in urls:
        c = mock_counters(u)
        t += c.get("vllm:generation_tokens_total", 0.0)
        p += c.get("vllm:num_preemptions_total", 0.0)
    return t, p


def run_one(bin_, profile, setting, args):
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-auto-{profile}-"))
    mocks = [start_mock(bin_, f, args.scale, args.seed, d / f"mock{i}.log")
             for i, f in enumerate(PROFILES[profile]["servers"])]
    urls = [u for _, u in mocks]
    with open(d / "p.jsonl", "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"id": i, "prompt": f"prompt {i}: write at length about topic {i}"}) + "\n")
    conc = '"auto"\nmax_concurrency = 512' if setting == "auto" else str(setting)
    (d / "spool.toml").write_text(config_head(urls) + f"""request_timeout_s = 36000
self_check = false
[run]
concurrency = {conc}
progress_every = 1000000
metrics_addr = "127.0.0.1:0"
budget_policy = "cancel"
shutdown_grace_s = 5
[sampling]
max_tokens = 4096
[[dataset]]
name = "d"
path = "p.jsonl"
token_budget = {args.budget}
""")
    t0 = time.monotonic()
    run = subprocess.Popen([bin_, "run", "-q", "-c", str(d / "spool.toml")],
                           stdout=subprocess.DEVNULL, stderr=open(d / "run.log", "w"))
    start = None
    limits = []
    while run.poll() is None:
        time.sleep(0.5)
        t = time.monotonic() - t0
        if start is None and t >= args.warmup:
            start = (t, *tokens_and_preemptions(urls))
        if t > args.timeout:
            run.send_signal(signal.SIGINT)
            break
        try:
            addr = (d / "data" / "metrics.addr").read_text().strip()
            with urllib.request.urlopen(f"http://{addr}/status", timeout=2) as r:
                st = json.load(r)
            limits.append([s.get("limit") for s in st.get("servers", [])])
        except Exception:
            pass
    end_t = time.monotonic() - t0
    run.wait()
    tok_end, pre_end = tokens_and_preemptions(urls)
    final = json.loads(subprocess.run([bin_, "status", "--json", "-c", str(d / "spool.toml")],
                                      capture_output=True, text=True).stdout)
    for p, _ in mocks:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
    ds = final["datasets"][0]
    tps = (tok_end - start[1]) / (end_t - start[0]) if start and end_t > start[0] else float("nan")
    return {"profile": profile, "setting": setting, "tok_s": tps, "preemptions": pre_end,
            "wasted": ds["wasted_tokens"], "completion_tokens": ds["completion_tokens"],
            "wall": end_t, "last_limits": limits[-1] if limits else None, "dir": str(d)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--profiles", default="kv-bound,compute,unequal")
    ap.add_argument("--scale", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=200000)
    ap.add_argument("--budget", type=int, default=30_000_000)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--sweep", help="comma-separated fixed settings (default: per profile)")
    args = ap.parse_args()
    bin_ = args.bin or str(release_bin())
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    for profile in args.profiles.split(","):
        sweep = [int(x) for x in args.sweep.split(",")] if args.sweep else PROFILES[profile]["sweep"]
        rows = []
        for setting in sweep + ["auto"]:
            r = run_one(bin_, profile, setting, args)
            print(json.dumps(r), file=sys.stderr)
            rows.append(r)
        fixed = [r for r in rows if r["setting"] != "auto"]
        best = max(fixed, key=lambda r: r["tok_s"])
        auto = rows[-1]
        print(f"\n### {profile}\n")
        print("| concurrency | tok/s (after warm-up) | vs best fixed | preemptions | tokens thrown away (cancel) | limits at the end |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            mark = " (best fixed)" if r is best else ""
            print(f"| {r['setting']}{mark} | {r['tok_s']:,.0f} | {100 * r['tok_s'] / best['tok_s']:.1f} % | "
                  f"{r['preemptions']:,.0f} | {r['wasted']:,} | {r['last_limits']} |")
        ok = (auto["tok_s"] >= 0.97 * best["tok_s"], auto["preemptions"] <= best["preemptions"],
              auto["wasted"] <= best["wasted"])
        print(f"\nauto ≥ 97 % of best fixed: {ok[0]}; preemptions ≤ best's: {ok[1]}; "
              f"thrown away ≤ best's: {ok[2]}")
        sys.stdout.flush()
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()

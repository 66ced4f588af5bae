#!/usr/bin/env python3
"""`make bench-prefix`: routing for the prefix cache, on four `spool mock-server`s with the
KV-cache model and its radix-style prefix cache.

Prompts in groups sharing a long block (a system prompt, a few-shot block), each with a
question of its own, in a shuffled order, `samples = 4`, a fixed concurrency. For each
routing (`prefix`, the default; `least_requests`; `round_robin`, SpecForge's) and for one
server alone: the prefix-cache hit rate (the mocks' `vllm:prefix_cache_hits_total` ÷
`vllm:prefix_cache_queries_total`), the throughput (tokens the mocks generated ÷ the run's
wall time, start-up and tail included) and the tokens each server generated. Utilisation is a
routing's throughput ÷ least-requests routing's (the routing that only balances load).
Loopback only.
"""
import argparse, json, os, pathlib, random, signal, subprocess, sys, tempfile, time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from autoconc import config_head, mock_counters  # noqa: E402
from cargo_target import release_bin  # noqa: E402

MOCK = ["--mean-tokens", "300", "--sigma", "0.5", "--context-len", "100000",
        "--per-request-tps", "60", "--prefill-tps", "8000", "--capacity-tps", "3000",
        "--kv-tokens", "200000", "--metrics-names", "vllm"]


def start_mock(bin_, scale, seed, log):
    p = subprocess.Popen([bin_, "mock-server", "--addr", "127.0.0.1:0", "--time-scale", str(scale),
                          "--seed", str(seed)] + MOCK,
                         stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    return p, p.stdout.readline().strip().replace("listening on ", "")


def write_prompts(path, groups, per_group, seed):
    rows = []
    for g in range(groups):
        block = " ".join(f"g{g}w{w}" for w in range(300))
        for k in range(per_group):
            own = " ".join(f"g{g}k{k}q{w}" for w in range(60))
            rows.append(json.dumps({"id": f"g{g}k{k}", "prompt": f"{block} {own}"}))
    random.Random(seed).shuffle(rows)
    path.write_text("\n".join(rows) + "\n")


def run_one(bin_, servers, routing, args):
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-prefix-{routing}-"))
    mocks = [start_mock(bin_, args.scale, args.seed + i, d / f"mock{i}.log") for i in range(servers)]
    urls = [u for _, u in mocks]
    write_prompts(d / "p.jsonl", args.groups, args.per_group, args.seed)
    (d / "spool.toml").write_text(config_head(urls) + f"""self_check = false
routing = "{routing}"
[run]
concurrency = {args.concurrency * servers // 4}
progress_every = 1000000
metrics_addr = "127.0.0.1:0"
[sampling]
max_tokens = 2048
[[dataset]]
name = "d"
path = "p.jsonl"
samples = 4
""")
    t0 = time.monotonic()
    subprocess.run([bin_, "run", "-q", "-c", str(d / "spool.toml")], check=True,
                   stdout=subprocess.DEVNULL, stderr=open(d / "run.log", "w"))
    wall = time.monotonic() - t0
    tokens = queries = hits = 0.0
    requests = []
    for u in urls:
        c = mock_counters(u)
        tokens += c.get("vllm:generation_tokens_total", 0.0)
        queries += c.get("vllm:prefix_cache_queries_total", 0.0)
        hits += c.get("vllm:prefix_cache_hits_total", 0.0)
        requests.append(int(c.get("vllm:generation_tokens_total", 0.0)))
    for p, _ in mocks:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
    return {"servers": servers, "routing": routing, "hit_rate": hits / queries if queries else 0.0,
            "tok_s": tokens / wall, "wall": wall, "tokens_per_server": requests, "dir": str(d)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin")
    ap.add_argument("--scale", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=128, help="with four servers")
    args = ap.parse_args()
    bin_ = args.bin or str(release_bin())
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    rows = []
    for servers, routing in [(1, "prefix"), (4, "prefix"), (4, "least_requests"), (4, "round_robin")]:
        r = run_one(bin_, servers, routing, args)
        print(json.dumps(r), file=sys.stderr)
        rows.append(r)
    one, lr = rows[0], rows[2]
    print("| servers | routing | hit rate | vs one server | tok/s | utilisation (vs least_requests) | tokens generated per server |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        util = f"{100 * r['tok_s'] / lr['tok_s']:.1f} %" if r["servers"] == 4 else "–"
        print(f"| {r['servers']} | {r['routing']} | {r['hit_rate']:.3f} | "
              f"{100 * r['hit_rate'] / one['hit_rate']:.1f} % | {r['tok_s']:,.0f} | {util} | "
              f"{', '.join(f'{n:,}' for n in r['tokens_per_server'])} |")
    p = rows[1]
    print(f"\nprefix hit rate ≥ 90 % of one server's: {p['hit_rate'] >= 0.9 * one['hit_rate']}; "
          f"utilisation ≥ 97 %: {p['tok_s'] >= 0.97 * lr['tok_s']}")
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()

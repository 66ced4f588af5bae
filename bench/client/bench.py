#!/usr/bin/env python3
"""Client benchmarks: `make bench-overhead`, `bench-stream`, `bench-throughput`.

  overhead    scenario 1: instant mock (`--instant`: every request answered at once, no
              5 ms scheduler tick; ~100-token completions); spool vs
              bench/client/baseline.py at several concurrencies: completions/s end to end
              and client CPU seconds per 1000 completions (the client process only:
              getrusage of the waited-for child, never the mock).
  stream      scenario 2: N long streaming requests in flight at a fixed aggregate
              tok/s; client CPU % of one core, RSS, CPU µs per streamed token, measured
              over a window after the ramp-up from /proc/PID/stat and /proc/PID/status.
  throughput  scenario 4: the mock's capacity model (fixed aggregate tok/s); spool's
              streamed tok/s over a window ÷ capacity.

Every server binds 127.0.0.1 port 0. Prints a Markdown table per scenario (the one
BENCHMARKS.md records) and the machine's load average. By hand, never in `make test`.
"""
import argparse, json, os, pathlib, re, shutil, signal, subprocess, sys, tempfile, time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from cargo_target import release_bin  # noqa: E402 (bench/cargo_target.py)
# SPOOL_BENCH_BIN: another build (e.g. the binary before a change, for before/after rows).
BIN = pathlib.Path(os.environ.get("SPOOL_BENCH_BIN") or release_bin()).resolve()
# SPOOL_BENCH_MOCK_BIN: the binary whose `mock-server` is used (default BIN), so that builds
# before and after a change are measured against the same mock.
MOCK_BIN = pathlib.Path(os.environ.get("SPOOL_BENCH_MOCK_BIN", BIN)).resolve()
TICK = os.sysconf("SC_CLK_TCK")


def start_mock(args, log):
    p = subprocess.Popen([str(MOCK_BIN), "mock-server", "--addr", "127.0.0.1:0", *args],
                         stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        sys.exit(f"mock did not start: {line!r} (see {log})")
    return p, line.strip().replace("listening on ", "")


def stop(p, sig=signal.SIGTERM):
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def write_prompts(path, n, words=8):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt": f"prompt {i}: " + " ".join(f"topic{i % 97}" for _ in range(words))}) + "\n")


def spool_config(d, url, concurrency, stream, max_tokens=10240, metrics="127.0.0.1:0"):
    (d / "spool.toml").write_text(f"""
data_dir = "data"
output_dir = "out"
[server]
api = "completions"
urls = ["{url}"]
model = "mock"
stream = {"true" if stream else "false"}
request_timeout_s = 36000
[run]
concurrency = {concurrency}
progress_every = 100000000
metrics_addr = "{metrics}"
shutdown_grace_s = 1
[sampling]
max_tokens = {max_tokens}
[[dataset]]
name = "bench"
path = "prompts.jsonl"
""")


def run_waited(cmd, cwd, log):
    """Runs `cmd` to the end; (wall s, user+sys CPU s of that process only, max RSS MiB)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} exited {p.returncode}: see {log}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


def count_lines(path):
    with open(path) as f:
        return sum(1 for _ in f)


def overhead(a):
    rows = []
    for c in a.concurrency:
        for client in a.clients:
            d = pathlib.Path(tempfile.mkdtemp(prefix=f"spool-bench-{client}-{c}-"))
            write_prompts(d / "prompts.jsonl", a.prompts)
            mock, url = start_mock(["--instant", "--capacity-tps", "1e12", "--per-request-tps", "1e12",
                                    "--mean-tokens", str(a.tokens), "--sigma", "0",
                                    "--context-len", "100000"], d / "mock.log")
            try:
                if client == "spool":
                    spool_config(d, url, c, stream=False)
                    wall, cpu, rss = run_waited([str(BIN), "-q", "run", "-c", "spool.toml"], d, d / "client.log")
                    st = json.loads(subprocess.check_output([str(BIN), "status", "-c", str(d / "spool.toml"), "--json"]))
                    n = sum(x["done"] for x in st["datasets"])
                else:
                    wall, cpu, rss = run_waited([sys.executable, str(ROOT / "bench/client/baseline.py"),
                                                 "--url", url, "--input", "prompts.jsonl",
                                                 "--output", "out.jsonl", "--concurrency", str(c)], d, d / "client.log")
                    n = count_lines(d / "out.jsonl")
            finally:
                stop(mock)
            if n != a.prompts:
                sys.exit(f"{client} c={c}: {n} of {a.prompts} completions (see {d})")
            rows.append(dict(client=client, c=c, n=n, wall=wall, cps=n / wall, cpu=cpu,
                             cpu_per_1k=cpu / n * 1000, rss=rss))
            print(f"  {client:8} c={c:5}: {n} in {wall:.2f} s, {n / wall:,.0f}/s, CPU {cpu:.2f} s "
                  f"({cpu / n * 1000:.3f} s/1k), max RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
            if not a.keep:
                shutil.rmtree(d, ignore_errors=True)
    print(f"\nScenario 1: client overhead, {a.prompts} prompts, {a.tokens}-token completions, "
          f"instant mock (load avg {os.getloadavg()[0]:.2f})\n")
    print("| concurrency | client | completions/s | CPU s / 1000 completions | max RSS MiB | spool ÷ baseline (rate) | baseline ÷ spool (CPU) |")
    print("|---|---|---|---|---|---|---|")
    by = {(r["client"], r["c"]): r for r in rows}
    for r in rows:
        ratio = ("", "")
        if r["client"] == "spool" and ("baseline", r["c"]) in by:
            b = by[("baseline", r["c"])]
            ratio = (f"**{r['cps'] / b['cps']:.1f}×**", f"**{b['cpu_per_1k'] / r['cpu_per_1k']:.1f}×**")
        print(f"| {r['c']} | {r['client']} | {r['cps']:,.0f} | {r['cpu_per_1k']:.3f} | {r['rss']:.0f} | {ratio[0]} | {ratio[1]} |")


def proc_sample(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    status = open(f"/proc/{pid}/status").read()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    return cpu, rss, hwm


def metric(addr, name):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def live_spool(d, url, c, prompts, max_tokens, mock):
    write_prompts(d / "prompts.jsonl", prompts)
    spool_config(d, url, c, stream=True, max_tokens=max_tokens)
    p = subprocess.Popen([str(BIN), "-q", "run", "-c", "spool.toml"], cwd=d,
                         stdout=subprocess.DEVNULL, stderr=open(d / "client.log", "w"))
    addr_file = d / "data" / "metrics.addr"
    for _ in range(600):
        if addr_file.exists() and addr_file.read_text().strip():
            break
        if p.poll() is not None:
            stop(mock)
            sys.exit(f"spool exited {p.returncode}: see {d / 'client.log'}")
        time.sleep(0.1)
    return p, addr_file.read_text().strip()


def window(p, addr, warmup, seconds):
    time.sleep(warmup)
    t0 = time.perf_counter()
    cpu0, _, _ = proc_sample(p.pid)
    tok0 = metric(addr, "spool_streamed_tokens_total")
    inflight, rss_max = [], 0.0
    while time.perf_counter() - t0 < seconds:
        time.sleep(1)
        _, rss, _ = proc_sample(p.pid)
        rss_max = max(rss_max, rss)
        inflight.append(metric(addr, "spool_inflight_requests"))
    wall = time.perf_counter() - t0
    cpu1, rss, hwm = proc_sample(p.pid)
    tok1 = metric(addr, "spool_streamed_tokens_total")
    return dict(wall=wall, cpu=cpu1 - cpu0, tokens=tok1 - tok0, rss=rss, rss_max=rss_max,
                hwm=hwm, inflight=sum(inflight) / max(1, len(inflight)))


def streaming(a):
    d = pathlib.Path(tempfile.mkdtemp(prefix="spool-bench-stream-"))
    per_req = a.tps / a.inflight
    mock, url = start_mock(["--capacity-tps", str(a.tps), "--per-request-tps", str(per_req),
                            "--mean-tokens", str(a.tokens), "--sigma", "0",
                            "--context-len", "1000000"], d / "mock.log")
    try:
        p, addr = live_spool(d, url, a.inflight, a.inflight * 2, a.tokens * 4, mock)
        w = window(p, addr, a.warmup, a.seconds)
        stop(p, signal.SIGINT)
    finally:
        stop(mock)
    tps = w["tokens"] / w["wall"]
    print(f"\nScenario 2: {a.inflight} streaming requests (`/v1/completions`, deltas), "
          f"mock capacity {a.tps:,.0f} tok/s, window {w['wall']:.0f} s after {a.warmup:.0f} s "
          f"(load avg {os.getloadavg()[0]:.2f})\n")
    print("| requests in flight (mean) | tok/s streamed | client CPU (% of one core) | CPU µs / token | RSS MiB (end / max sampled / peak) |")
    print("|---|---|---|---|---|")
    print(f"| {w['inflight']:,.0f} | {tps:,.0f} | **{w['cpu'] / w['wall'] * 100:.1f} %** | "
          f"{w['cpu'] / max(1, w['tokens']) * 1e6:.1f} | {w['rss']:.0f} / {w['rss_max']:.0f} / **{w['hwm']:.0f}** |")
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


def throughput(a):
    d = pathlib.Path(tempfile.mkdtemp(prefix="spool-bench-tput-"))
    cap = a.capacity * a.time_scale
    mock, url = start_mock(["--capacity-tps", str(a.capacity), "--per-request-tps", "60",
                            "--mean-tokens", "3500", "--sigma", "1", "--time-scale", str(a.time_scale),
                            "--context-len", "100000"], d / "mock.log")
    try:
        expected = cap * (a.seconds + a.warmup) / 3500
        p, addr = live_spool(d, url, a.concurrency, int(expected * 3) + 2 * a.concurrency, 10240, mock)
        w = window(p, addr, a.warmup, a.seconds)
        stop(p, signal.SIGINT)
    finally:
        stop(mock)
    tps = w["tokens"] / w["wall"]
    print(f"\nScenario 4: throughput tracking, mock capacity {a.capacity:g} tok/s × time scale "
          f"{a.time_scale:g} = {cap:,.0f} tok/s, per request 60 × {a.time_scale:g}, lognormal "
          f"mean 3500 σ 1, concurrency {a.concurrency}, window {w['wall']:.0f} s after "
          f"{a.warmup:.0f} s (load avg {os.getloadavg()[0]:.2f})\n")
    print("| window (s) | tokens streamed | achieved tok/s | capacity tok/s | achieved ÷ capacity | client CPU % |")
    print("|---|---|---|---|---|---|")
    print(f"| {w['wall']:.0f} | {w['tokens']:,.0f} | {tps:,.0f} | {cap:,.0f} | **{tps / cap * 100:.2f} %** | "
          f"{w['cpu'] / w['wall'] * 100:.1f} |")
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="keep the temporary run folders")
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    o.add_argument("--clients", nargs="+", default=["spool", "baseline"])
    o.add_argument("--prompts", type=int, default=30000)
    o.add_argument("--tokens", type=int, default=100)
    s = sub.add_parser("stream")
    s.add_argument("--inflight", type=int, default=2000)
    s.add_argument("--tps", type=float, default=10000)
    s.add_argument("--tokens", type=int, default=4000)
    s.add_argument("--warmup", type=float, default=15)
    s.add_argument("--seconds", type=float, default=60)
    t = sub.add_parser("throughput")
    t.add_argument("--capacity", type=float, default=850)
    t.add_argument("--time-scale", type=float, default=10)
    t.add_argument("--concurrency", type=int, default=150)
    t.add_argument("--warmup", type=float, default=20)
    t.add_argument("--seconds", type=float, default=300)
    a = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} missing: cargo build --release")
    {"overhead": overhead, "stream": streaming, "throughput": throughput}[a.cmd](a)


if __name__ == "__main__":
    main()

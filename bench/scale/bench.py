#!/usr/bin/env python3
"""`make bench-scale` spool at scale, prompt strings, no tokenizer.

For N prompts (default 10,000,000; `--prompts N`):
  1. generate them once (target/bench-data/scale-prompts-N.jsonl, gen_prompts.py);
  2. enqueue: `spool run` (release build) on a config whose dataset has `token_budget = 0`,
     so it enqueues everything and stops (no server: `self_check = false`, a closed port).
     Rate from spool's own `enqueued … prompts_per_s=` line; RSS sampled from /proc every
     0.2 s (peak, and at 25/50/75/100 % of the pass); queue size = bytes of data_dir (sled's
     data_dir/queue plus the item blocks in data_dir/items);
  3. restart: a fast `spool mock-server` (time × 1000, ~50-token completions) with a
     request log; `spool run` on the same data_dir drains for a few seconds (RSS sampled),
     is SIGKILLed, and started again at once. Restart time = kill → the first request the
     mock sees from the new process (dispatch time = the log line's ts_ms − latency_ms).
     The new process drains for `--drain-s` seconds more (RSS sampled), then gets SIGTERM.
Prints one table. Benchmarks are run by hand, never by `make test`.

With --single-run there is no separate enqueue pass: the first run enqueues and drains in
one process (the usual use) before the kill, so the restart replays that run's whole log.

usage: bench.py [--prompts N] [--spool PATH] [--drain-s 15] [--keep] [--single-run]
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))
from cargo_target import release_bin  # noqa: E402 (bench/cargo_target.py)
import spool_toml  # noqa: E402 (bench/spool_toml.py)
DATA = os.path.join(ROOT, "target", "bench-data")


def ensure_data(n):
    os.makedirs(DATA, exist_ok=True)
    path = os.path.join(DATA, f"scale-prompts-{n}.jsonl")
    if not os.path.exists(path):
        print(f"generating {n:,} prompts -> {path}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "gen_prompts.py"), "--prompts", str(n), path + ".tmp"], check=True)
        os.rename(path + ".tmp", path)
    return path


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Sampler(threading.Thread):
    """Samples a process's RSS every 0.2 s until it exits or stop() is called."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.done.is_set():
            r = rss_mib(self.pid)
            if r is None:
                break
            self.samples.append((time.monotonic() - t0, r))
            time.sleep(0.2)

    def stop(self):
        self.done.set()
        self.join()

    def peak(self):
        return max((r for _, r in self.samples), default=0.0)

    def at(self, frac):
        if not self.samples:
            return 0.0
        return self.samples[min(len(self.samples) - 1, int(frac * (len(self.samples) - 1)))][1]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def write_config(d, prompts, url, budget_zero):
    return spool_toml.write_config(d, "scale", prompts, url=url, budget_zero=budget_zero,
                                   run="concurrency = 64", tail="[sampling]\nmax_tokens = 64")


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(path) for x in fs)


def enqueue(spool, d, prompts):
    cfg = write_config(d, prompts, "http://127.0.0.1:9", True)
    err = open(os.path.join(d, "enqueue.log"), "w+")
    # The pass writes ~5 GB at 10 M: start it with no earlier run's dirty pages still being
    # written back (without this, back-to-back runs of one binary ranged 190-260 k/s).
    os.sync()
    p = subprocess.Popen([spool, "run", "-c", cfg], stdout=subprocess.DEVNULL, stderr=err)
    s = Sampler(p.pid)
    s.start()
    # wait4, not wait: the child's rusage gives its CPU seconds (user + sys), which a
    # shared machine's load distorts far less than the wall-clock rate.
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = rc = os.waitstatus_to_exitcode(status)
    s.stop()
    err.seek(0)
    log = err.read()
    if rc != 0:
        sys.exit(f"spool run (enqueue) failed ({rc}):\n{log[-3000:]}")
    line = next((l for l in log.splitlines() if " enqueued" in l), None)
    if line is None:
        sys.exit("no `enqueued` line in spool's log:\n" + log[-3000:])
    f = dict((k, v.strip('"')) for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line))
    return {"added": int(f["added"]), "seconds": float(f["seconds"]), "rss": s,
            "cpu_s": ru.ru_utime + ru.ru_stime,
            "queue_bytes": dir_bytes(os.path.join(d, "data"))}


def first_dispatch_ms(log_path, after_ms):
    """Earliest dispatch (ts_ms − latency_ms) in the mock's log at or after `after_ms`."""
    best = None
    try:
        with open(log_path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                t = r["ts_ms"] - r.get("latency_ms", 0)
                if t >= after_ms and (best is None or t < best):
                    best = t
    except OSError:
        pass
    return best


def restart(spool, d, prompts, drain_s):
    port = free_port()
    mlog = os.path.join(d, "mock.jsonl")
    mock = subprocess.Popen([spool, "mock-server", "--addr", f"127.0.0.1:{port}", "--time-scale", "1000",
                             "--mean-tokens", "50", "--sigma", "0.5", "--log", mlog],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        cfg = write_config(d, prompts, f"http://127.0.0.1:{port}", False)
        err1 = open(os.path.join(d, "run1.log"), "w")
        p = subprocess.Popen([spool, "run", "-c", cfg], stdout=subprocess.DEVNULL, stderr=err1)
        s1 = Sampler(p.pid)
        s1.start()
        t0 = time.monotonic()
        while first_dispatch_ms(mlog, 0) is None:
            if p.poll() is not None or time.monotonic() - t0 > 3600:
                sys.exit(f"first run never dispatched (see {d}/run1.log)")
            time.sleep(0.1)
        first_start = time.monotonic() - t0
        time.sleep(drain_s)
        s1.stop()
        p.kill()
        p.wait()
        # After the wait: the old process dispatched until it died, so only requests sent
        # after its death are the new process's.
        kill_ms = time.time() * 1000
        err2 = open(os.path.join(d, "run2.log"), "w")
        p2 = subprocess.Popen([spool, "run", "-c", cfg], stdout=subprocess.DEVNULL, stderr=err2)
        s2 = Sampler(p2.pid)
        s2.start()
        t0 = time.monotonic()
        while True:
            t = first_dispatch_ms(mlog, kill_ms)
            if t is not None:
                break
            if p2.poll() is not None or time.monotonic() - t0 > 600:
                sys.exit(f"restarted run never dispatched (see {d}/run2.log)")
            time.sleep(0.02)
        restart_s = (t - kill_ms) / 1000
        time.sleep(drain_s)
        s2.stop()
        p2.send_signal(signal.SIGTERM)
        p2.wait(timeout=120)
        with open(mlog) as f:
            served = sum(1 for _ in f)
        return {"first_start_s": first_start, "restart_s": restart_s, "rss1": s1, "rss2": s2, "served": served}
    finally:
        mock.terminate()
        mock.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10_000_000)
    ap.add_argument("--spool", help="spool binary (default: the release build, wherever cargo put it)")
    ap.add_argument("--drain-s", type=float, default=15.0)
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    ap.add_argument("--single-run", action="store_true",
                    help="no separate enqueue pass: the first run enqueues and drains in one process "
                         "(the usual use), is SIGKILLed, and the restart is timed")
    a = ap.parse_args()
    a.spool = a.spool or str(release_bin())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    prompts = ensure_data(a.prompts)
    in_bytes = os.path.getsize(prompts)
    d = tempfile.mkdtemp(prefix="spool-scale-", dir=DATA)
    try:
        if a.single_run:
            os.sync()  # as in `enqueue`: no earlier run's writeback under this one
            r = restart(a.spool, d, prompts, a.drain_s)
            print(json.dumps({k: v for k, v in r.items() if not k.startswith("rss")}), flush=True)
            print(f"\n| prompts | single run: restart (kill → first request) | start → first request (enqueue included) "
                  f"| RSS peak first run / after the kill | load (1 min) |\n| ---: | ---: | ---: | ---: | ---: |\n"
                  f"| {a.prompts:,} | {r['restart_s']:.2f} s | {r['first_start_s']:.2f} s | "
                  f"{r['rss1'].peak():,.0f} / {r['rss2'].peak():,.0f} MiB | {os.getloadavg()[0]:.1f} |")
            return
        e = enqueue(a.spool, d, prompts)
        print(json.dumps({"enqueued": e["added"], "seconds": e["seconds"], "cpu_s": round(e["cpu_s"], 2),
                          "queue_bytes": e["queue_bytes"],
                          "rss_peak": e["rss"].peak()}), flush=True)
        r = restart(a.spool, d, prompts, a.drain_s)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("rss")}), flush=True)
        load = os.getloadavg()
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"kept {d}")
    n = e["added"]
    rs = e["rss"]
    print()
    print(f"| prompts | input | enqueue prompts/s | enqueue CPU s / 1k prompts | enqueue s | queue bytes/item | input bytes/item | "
          f"restart (kill → first request) | first start → first request | RSS peak enqueue (25/50/75/100 %) | "
          f"RSS peak draining before / after the kill | load (1 min) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {n:,} | {in_bytes / 2**20:,.0f} MiB | {n / e['seconds']:,.0f} | {e['cpu_s'] / n * 1000:.4f} | {e['seconds']:.1f} | "
          f"{e['queue_bytes'] / n:,.0f} | {in_bytes / n:,.0f} | {r['restart_s']:.2f} s | {r['first_start_s']:.2f} s | "
          f"{rs.peak():,.0f} MiB ({rs.at(0.25):,.0f}/{rs.at(0.5):,.0f}/{rs.at(0.75):,.0f}/{rs.at(1.0):,.0f}) | "
          f"{r['rss1'].peak():,.0f} / {r['rss2'].peak():,.0f} MiB | {load[0]:.1f} |")


if __name__ == "__main__":
    main()

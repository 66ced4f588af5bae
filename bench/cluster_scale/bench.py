#!/usr/bin/env python3
"""`make bench-cluster-scale`: a cluster job of many partitions with long commit logs, on a
local store (file://): a worker's start-up, `spool status`, `spool finalize` and a rerun
of `finalize`, each timed, with the store requests each made.

The store is built as a job of P partitions × C commits would have left it: partition 0 by
a real worker (one item per shard, so C real commits with their checkpoints), the others
written here in the same layout — a shard record per commit naming a small upload object
with its size and sha256, a checkpoint per hundred records (zstd, as workers write them),
a done marker and a status — with items that the partition owns (XXH64, as spool assigns
them). Then, timed: a worker of partition 1 on an empty data_dir (start-up: from launch to
its "cluster worker starting" line, which counts the requests it made; it then reads the
whole input, finds everything committed and exits), `spool status --json`, `spool
finalize`, and `spool finalize` again. Needs Python's `xxhash` and the `zstd` command. By
hand, never in `make test`.
"""
import argparse, hashlib, json, os, pathlib, re, shutil, subprocess, sys, tempfile, time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from cargo_target import release_bin  # noqa: E402

BIN = pathlib.Path(os.environ.get("SPOOL_BENCH_BIN") or release_bin()).resolve()
import xxhash  # noqa: E402

DATASET = "d"
WRITER = "feedfacecafebeef"


def owner(dataset, item, count):
    return xxhash.xxh64_intdigest(dataset.encode() + b"\0" + item.encode()) % count


def ids_by_partition(partitions, per):
    """`per` item ids owned by each partition, and the input's rows in file order."""
    owned = [[] for _ in range(partitions)]
    rows, n = [], 0
    while min(len(o) for o in owned) < per:
        i = f"i{n}"
        n += 1
        p = owner(DATASET, i, partitions)
        if len(owned[p]) < per:
            owned[p].append(i)
            rows.append(i)
    return owned, rows


def config(d, url, partitions):
    (d / "spool.toml").write_text(f"""
data_dir = "data-{{partition}}"
output_dir = "file://{d}/store"
[server]
api = "completions"
urls = ["{url}"]
model = "mock"
self_check = false
[run]
partitions = {partitions}
concurrency = 64
progress_every = 100000000
metrics_addr = ""
shutdown_grace_s = 5
[shards]
max_rows = 1
[[dataset]]
name = "{DATASET}"
path = "input.jsonl"
""")


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def synthesize(store, p, partitions, ids, version):
    """Partition p's log: one shard record per item, uploads, checkpoints, done, status."""
    pre = store / f"_spool/p{p:04d}"
    records = []
    for seq, item in enumerate(ids):
        body = f"synthetic shard of {item} (partition {p}, commit {seq})\n".encode() * 8
        sha = hashlib.sha256(body).hexdigest()
        key = f"_spool/p{p:04d}/shards/{WRITER}/{DATASET}/part-{seq:06d}-{sha[:12]}.parquet"
        write(store / key, body)
        r = {"format": 2, "partition": p, "partitions": partitions, "seq": seq, "writer": WRITER,
             "dataset": DATASET, "local_index": seq, "key": key, "rows": 1,
             "completion_tokens": 50, "bytes": len(body), "sha256": sha, "dropped": 0,
             "over_share": 0, "ids": [item], "spool_version": version}
        write(pre / f"commits/{seq:010d}.json", json.dumps(r, indent=2).encode())
        records.append(r)
    for first in range(0, len(records) - len(records) % 100, 100):
        pack = {"format": 2, "partition": p, "partitions": partitions, "first": first,
                "last": first + 99, "records": records[first:first + 100]}
        z = subprocess.run(["zstd", "-q", "-3", "-c"], input=json.dumps(pack).encode(),
                           check=True, capture_output=True).stdout
        write(pre / f"checkpoints/{first:010d}.json.zst", z)
    done = {"partition": p, "partitions": partitions, "writer": WRITER, "commits": len(records),
            "failed": 0, "spool_version": version}
    write(pre / "done.json", json.dumps(done).encode())
    status = {"format": 2, "partition": p, "partitions": partitions, "writer": WRITER,
              "heartbeat_unix": int(time.time()), "running": False, "report": None}
    write(pre / "status.json", json.dumps(status).encode())


def timed(cmd, cwd, env=None):
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    took = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{cmd} exited {p.returncode}:\n{p.stderr[-4000:]}")
    return took, p.stderr


def requests(stderr):
    m = re.findall(r"(\d+) requests \(get (\d+), put (\d+), list (\d+), head (\d+), copy (\d+), delete (\d+)\)", stderr)
    return m[-1] if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--partitions", type=int, default=256)
    ap.add_argument("--commits", type=int, default=1000, help="commits per partition")
    a = ap.parse_args()
    d = pathlib.Path(tempfile.mkdtemp(prefix="spool-bench-cluster-scale-"))
    version = subprocess.run([str(BIN), "--version"], capture_output=True, text=True).stdout.split()[1]
    owned, rows = ids_by_partition(a.partitions, a.commits)
    with open(d / "input.jsonl", "w") as f:
        for i in rows:
            f.write(json.dumps({"id": i, "prompt": f"question {i}"}) + "\n")
    mock = subprocess.Popen([str(BIN), "mock-server", "--addr", "127.0.0.1:0", "--capacity-tps", "5000",
                             "--per-request-tps", "500", "--time-scale", "1000", "--mean-tokens", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = mock.stdout.readline().strip().replace("listening on ", "")
    try:
        config(d, url, a.partitions)
        cfg = str(d / "spool.toml")
        t0 = time.perf_counter()
        # Partition 0 for real: the job record, and C commits made by the protocol itself.
        took, _ = timed([str(BIN), "-q", "run", "-c", cfg, "--partition", "0"], d)
        print(f"partition 0 run for real: {a.commits} commits in {took:.1f} s", flush=True)
        store = d / "store"
        for p in range(1, a.partitions):
            synthesize(store, p, a.partitions, owned[p], version)
        print(f"store written in {time.perf_counter() - t0:.0f} s: {a.partitions} partitions × "
              f"{a.commits} commits", flush=True)
        # Partition 1 again, on an empty data_dir: its start-up reads its whole log.
        shutil.rmtree(d / "data-1", ignore_errors=True)
        start = time.perf_counter()
        proc = subprocess.Popen([str(BIN), "run", "-c", cfg, "--partition", "1"], cwd=d,
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        startup, startup_requests, lines = None, None, []
        for line in proc.stderr:
            lines.append(line)
            if startup is None and "cluster worker starting" in line:
                startup = time.perf_counter() - start
                m = re.search(r"startup_requests=(\d+)", line)
                startup_requests = m and m.group(1)
        proc.wait()
        whole = time.perf_counter() - start
        if proc.returncode != 0 or startup is None:
            sys.exit("worker failed:\n" + "".join(lines[-40:]))
        st, st_err = timed([str(BIN), "status", "-c", cfg, "--json"], d)
        fin, fin_err = timed([str(BIN), "finalize", "-c", cfg], d)
        again, again_err = timed([str(BIN), "finalize", "-c", cfg], d)
        print(f"| step | seconds | store requests |", flush=True)
        print(f"|---|---:|---|", flush=True)
        print(f"| worker start-up (partition 1, {a.commits} commits, empty data_dir) | {startup:.2f} | {startup_requests} |", flush=True)
        print(f"| the same worker to its exit (reads the {len(rows)}-row input) | {whole:.1f} | |", flush=True)
        print(f"| `spool status` ({a.partitions} partitions) | {st:.2f} | {requests(st_err)} |", flush=True)
        print(f"| `spool finalize` ({a.partitions * a.commits} shards) | {fin:.1f} | {requests(fin_err)} |", flush=True)
        print(f"| `spool finalize` again | {again:.1f} | {requests(again_err)} |", flush=True)
        print(f"load average: {os.getloadavg()}", flush=True)
    finally:
        mock.terminate()
        mock.wait()
        if not os.environ.get("SPOOL_BENCH_KEEP"):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Loads spool's shards and exports with the readers people use and reports what they saw.

Usage: read_exports.py FORMAT PATH EXPECTED [FORMAT PATH EXPECTED ...]

PATH is a file, a glob of files (shards), or the folder of an `hf` export. EXPECTED is the
row count, or for `hf` the splits as `split=rows,split=rows` (in order). Each reader must
see exactly that many rows (else exit 1). Prints one JSON object on stdout:
{"results": [{"format", "reader", "rows", "first": {"id", "text", "ids"}, ...}]}
where `first` is the reader's first row through the format's extractor in FORMATS, so the
caller can compare it with what spool wrote. Set HF_HUB_OFFLINE=1 and HF_HOME /
HF_DATASETS_CACHE to a temporary folder: nothing is fetched.
"""

import glob
import json
import os
import re
import sys

try:
    import datasets
    import duckdb
    import pandas as pd
    import pyarrow.json as pajson
    import pyarrow.parquet as pq
except ImportError as e:  # CI installs them; say which one is missing.
    sys.stderr.write(
        f"read_exports.py needs datasets, pandas, pyarrow and duckdb: {e} "
        "(pip install datasets pandas pyarrow duckdb)\n"
    )
    sys.exit(3)


def _batch_text(r):
    choice = r["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _ids(v):
    return None if v is None else [int(t) for t in v]


# format -> (file kind, extractor of (id, text, ids) from one row as a dict).
# `text` is the generated completion, `ids` the token ids of the row (None when the format
# has none). Adding a format is one line here.
FORMATS = {
    "shard": ("parquet", lambda r: (r["id"], r["completion"], _ids(list(r["prompt_token_ids"]) + list(r["completion_token_ids"])))),
    "sharegpt": ("json", lambda r: (r["id"], r["conversations"][-1]["content"], None)),
    "tokens": ("parquet", lambda r: (r["id"], None, _ids(r["input_ids"]))),
    "tokens-jsonl": ("json", lambda r: (r["id"], None, _ids(r["input_ids"]))),
    "hf": ("hf", lambda r: (r["id"], r["completion"], _ids(r["input_ids"]))),
    "specforge": ("json", lambda r: (r["id"], None, _ids(r["input_ids"]))),
    "specforge-chat": ("json", lambda r: (r["id"], r["conversations"][-1]["content"], None)),
    # `<item id>_s<sample>_gen<turn>`: the item id is what the caller looks up.
    "speculators": ("json", lambda r: (re.sub(r"_s\d+_gen\d+$", "", r["id"]), None, _ids(r["input_ids"]))),
    "openai-batch": ("json", lambda r: (r["custom_id"], _batch_text(r), None)),
}


def first(fmt, row):
    rid, text, ids = FORMATS[fmt][1](row)
    return {"id": rid, "text": text, "ids": ids}


def plain(v):
    """numpy arrays and scalars (pandas) as Python lists and numbers."""
    if hasattr(v, "tolist"):
        return plain(v.tolist())
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def files_of(path):
    files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
    if not files:
        raise SystemExit(f"no file matches {path}")
    return files


def duck(fmt, source, arg):
    """DuckDB's row count and first row of `source(?)` (read_parquet / read_json_auto)."""
    con = duckdb.connect()
    n = con.execute(f"SELECT count(*) FROM {source}(?)", [arg]).fetchone()[0]
    cur = con.execute(f"SELECT * FROM {source}(?) LIMIT 1", [arg])
    cols = [d[0] for d in cur.description]
    return "duckdb", n, first(fmt, dict(zip(cols, cur.fetchone())))


def read_parquet(fmt, path):
    files = files_of(path)
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    yield "datasets", len(ds), first(fmt, ds[0])
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    yield "pandas", len(df), first(fmt, plain(df.iloc[0].to_dict()))
    t = pq.ParquetDataset(files).read()
    yield "pyarrow", t.num_rows, first(fmt, t.slice(0, 1).to_pylist()[0])
    yield duck(fmt, "read_parquet", files)


def read_json(fmt, path):
    ds = datasets.load_dataset("json", data_files=path, split="train")
    yield "datasets", len(ds), first(fmt, ds[0])
    # dtype=False: ids that look like numbers stay strings.
    df = pd.read_json(path, lines=True, dtype=False)
    yield "pandas", len(df), first(fmt, plain(df.iloc[0].to_dict()))
    t = pajson.read_json(path)
    yield "pyarrow", t.num_rows, first(fmt, t.slice(0, 1).to_pylist()[0])
    yield duck(fmt, "read_json_auto", path)


def read_hf(fmt, path, splits):
    dd = datasets.load_dataset(path)
    got = {k: len(v) for k, v in dd.items()}
    if got != splits:
        raise SystemExit(f"hf: load_dataset({path}) gave splits {got}, expected {splits}")
    split0 = next(k for k, n in splits.items() if n > 0)
    ds = dd[split0]
    yield "datasets", sum(got.values()), first(fmt, ds[0]), {
        "splits": got,
        "input_ids": str(ds.features["input_ids"]),
        "messages": str(ds.features["messages"]),
    }
    files = {s: os.path.join(path, "data", f"{s}-*.parquet") for s in splits}
    dd = datasets.load_dataset("parquet", data_files=files)
    yield "datasets-parquet", sum(len(v) for v in dd.values()), first(fmt, dd[split0][0])
    data = sorted(glob.glob(os.path.join(path, "data", "*.parquet")))
    order = list(splits)
    data.sort(key=lambda f: order.index(os.path.basename(f).rsplit("-", 3)[0]))
    df = pd.concat([pd.read_parquet(f) for f in data], ignore_index=True)
    yield "pandas", len(df), first(fmt, plain(df.iloc[0].to_dict()))
    t = pq.ParquetDataset(data).read()
    yield "pyarrow", t.num_rows, first(fmt, t.slice(0, 1).to_pylist()[0])
    yield duck(fmt, "read_parquet", data)


def main(argv):
    if len(argv) % 3 != 0 or not argv:
        raise SystemExit(__doc__)
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        raise SystemExit("set HF_HUB_OFFLINE=1: this script reads local files only")
    datasets.disable_progress_bars()
    results = []
    for i in range(0, len(argv), 3):
        fmt, path, expected = argv[i : i + 3]
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt}: add it to FORMATS")
        kind = FORMATS[fmt][0]
        if kind == "hf":
            splits = {k: int(v) for k, v in (p.split("=") for p in expected.split(","))}
            want = sum(splits.values())
            readers = read_hf(fmt, path, splits)
        else:
            want = int(expected)
            readers = (read_parquet if kind == "parquet" else read_json)(fmt, path)
        for reader, rows, row, *extra in readers:
            if rows != want:
                raise SystemExit(f"{fmt} via {reader}: {rows} rows, expected {want}")
            r = {"format": fmt, "reader": reader, "rows": rows, "first": row}
            for e in extra:
                r.update(e)
            results.append(r)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])

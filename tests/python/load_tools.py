"""Loads spool's chat-shaped exports with HuggingFace `datasets` and reports their tools.

Usage: load_tools.py PATH...

A PATH that is a folder is an `hf` export (`load_dataset(PATH)`, its first split); any other
is JSONL (`load_dataset("json", data_files=PATH, split="train")`, which fixes the schema from
the file's first 10 MB). Prints a JSON list, per PATH: {"rows", "without_tools": the first
row's `tools`, "tools": {item id: tools} and "tool_calls": {item id: the last message's
tool_calls} for the rows whose tools are not "[]"}. Set HF_HUB_OFFLINE=1 and HF_HOME /
HF_DATASETS_CACHE to a temporary folder.
"""

import json
import os
import re
import sys

try:
    import datasets
except ImportError as e:
    sys.exit(f"load_tools.py needs datasets: {e}")


def load(path):
    if os.path.isdir(path):
        dd = datasets.load_dataset(path)
        return dd[next(iter(dd))]
    return datasets.load_dataset("json", data_files=path, split="train")


def main(paths):
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        sys.exit("set HF_HUB_OFFLINE=1: this script reads local files only")
    datasets.disable_progress_bars()
    out = []
    for path in paths:
        ds = load(path)
        res = {"rows": len(ds), "without_tools": ds[0]["tools"], "tools": {}, "tool_calls": {}}
        for r in ds:
            if r["tools"] == "[]":
                continue
            # `<id>#turn<k>` (per-turn) and `<id>` name the same item.
            rid = re.sub(r"#turn\d+$", "", r["id"])
            res["tools"][rid] = r["tools"]
            if "conversations" in r:
                res["tool_calls"][rid] = r["conversations"][-1]["tool_calls"]
        out.append(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])

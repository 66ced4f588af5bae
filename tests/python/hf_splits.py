"""Loads a spool `hf` export folder with HuggingFace `datasets` and lists each split's rows.

Usage: hf_splits.py DIR

Prints {split: [[dataset, id], ...]} (rows in order), as `load_dataset(DIR)` gives them.
Set HF_HUB_OFFLINE=1 and HF_HOME / HF_DATASETS_CACHE to a temporary folder.
"""

import json
import os
import sys

try:
    import datasets
except ImportError as e:
    sys.exit(f"hf_splits.py needs datasets: {e}")


def main(path):
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        sys.exit("set HF_HUB_OFFLINE=1: this script reads local files only")
    datasets.disable_progress_bars()
    dd = datasets.load_dataset(path)
    print(json.dumps({k: [[r["dataset"], r["id"]] for r in v] for k, v in dd.items()}))


if __name__ == "__main__":
    main(sys.argv[1])

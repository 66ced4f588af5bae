"""Compares spool's `draft-vocab` files with SpecForge's own vocabulary mapping.

Usage: vocab_specforge.py ROWS.jsonl WORKDIR DRAFT.safetensors...

SpecForge's `generate_vocab_mapping_file` runs on the rows' input_ids/loss_mask in file
order (a torch-formatted `datasets.Dataset`, as its data pipeline hands it over), with N
and the target size of each file. Prints a JSON list, per file: whether d2t and t2d are
equal, and, if not, whether the two choices differ only among ids whose count equals the
N-th largest count (SpecForge breaks such ties by first appearance, spool and speculators
by the smaller id), with the number of ids that differ; and whether the file, converted
to the `.pt` SpecForge takes (`torch.save(load_file(path), ...)`), loads through its draft
model's `load_vocab_mapping` and passes its `validate_vocab_mapping_consistency`.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import types
from collections import Counter


def main():
    rows_path, work, drafts = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(work, exist_ok=True)
    try:
        import torch
        from datasets import Dataset
        from safetensors.torch import load_file
        from specforge.core.compact_teacher import validate_vocab_mapping_consistency
        from specforge.data.preprocessing import generate_vocab_mapping_file
        from specforge.modeling.draft.base import Eagle3DraftModel
    except ImportError as e:
        sys.exit(f"vocab_specforge.py needs specforge 0.2 (and torch, datasets, safetensors): {e}")

    rows = [json.loads(l) for l in open(rows_path) if l.strip()]
    ds = Dataset.from_dict({
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
    }).with_format("torch")
    counts = Counter()
    for r in rows:
        counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m == 1)
    out = []
    for k, path in enumerate(drafts):
        t = load_file(path)
        n, target = t["d2t"].shape[0], t["t2d"].shape[0]
        # A fresh cache folder: SpecForge returns any file cached under the same key.
        cache = tempfile.mkdtemp(dir=work)
        with contextlib.redirect_stdout(io.StringIO()):
            mapping = generate_vocab_mapping_file(
                ds, target, n, cache_dir=cache, cache_key=f"spool{k}"
            )
        theirs = torch.load(mapping)
        equal = torch.equal(theirs["d2t"], t["d2t"]) and torch.equal(theirs["t2d"], t["t2d"])
        ours_ids = set((t["d2t"] + torch.arange(n)).tolist())
        their_ids = set((theirs["d2t"] + torch.arange(n)).tolist())
        diff = ours_ids ^ their_ids
        boundary = sorted((counts[i] for i in ours_ids), reverse=True)[-1]
        # The conversion in docs/export/token-freq.md to the .pt SpecForge's `vocab_mapping_path` takes, loaded
        # by its draft model's own loader into buffers of the model's shapes.
        pt = os.path.join(cache, "vocab_mapping.pt")
        torch.save(load_file(path), pt)
        buffers = types.SimpleNamespace(
            t2d=torch.zeros(target, dtype=torch.bool), d2t=torch.zeros(n, dtype=torch.long)
        )
        Eagle3DraftModel.load_vocab_mapping(buffers, pt)
        validate_vocab_mapping_consistency(buffers.t2d, buffers.d2t)
        out.append({
            "pt_loads": torch.equal(buffers.d2t, t["d2t"]) and torch.equal(buffers.t2d, t["t2d"]),
            "file": path,
            "n": n,
            "equal": equal,
            "ids_differing": len(diff),
            "differ_only_in_ties": all(counts[i] == boundary for i in diff),
            "t2d_sum_theirs": int(theirs["t2d"].sum()),
        })
    print(json.dumps(out))


if __name__ == "__main__":
    main()

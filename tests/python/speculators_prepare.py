"""Reads spool's `speculators`, `token-freq` and `draft-vocab` exports with speculators' own code.

Usage: speculators_prepare.py SPEC.json
SPEC: {"model": DIR, "work": DIR, "cases": [{"rows": JSONL, "token_freq": FILE|null,
       "draft": [FILE, ...]}]}

Per case: `speculators prepare-data` (the CLI's function, in process, CPU) turns the JSONL
into its training dataset; the rows are then read back through the training loader
(`speculators.train.data.ArrowDataset`). Prints one JSON object with, per case, whether
its (input_ids, loss_mask) pairs equal the exported ones (as multisets: prepare-data
shuffles and drops the ids), whether `text` is transformers' decode of the ids with
special tokens, whether prepare-data's `token_freq.pt` equals the `counts` tensor, and
whether speculators' `build_vocab_mappings_from_distribution` on that `token_freq.pt` (target
size from the model's config, as `speculators train` reads it) gives each file's d2t/t2d.
The comparisons go through the README's conversion of the counts (a `{id: count}` dict saved
with `torch.save`); each draft file's `d2t-N.npy` / `t2d-N.npy` beside it are read as they are
by `speculators train`'s own `_load_mappings` and `parse_vocab_mappings`.
"""

import argparse
import json
import os
import sys


def main():
    spec = json.load(open(sys.argv[1]))
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoTokenizer
        import numpy as np
        from speculators.cli.prepare_data import prepare_data
        from speculators.train.cli import _load_mappings, parse_vocab_mappings
        from speculators.train.data import ArrowDataset
        from speculators.train.vocab_mapping import (
            build_vocab_mappings_from_distribution,
            get_target_vocab_size,
        )
    except ImportError as e:
        sys.exit(f"speculators_prepare.py needs speculators 0.9 (and its httpx, torch, "
                 f"transformers, datasets, safetensors): {e}")

    model = spec["model"]
    tok = AutoTokenizer.from_pretrained(model)
    target_vocab = get_target_vocab_size(None, model)
    out = {"target_vocab": target_vocab, "cases": []}
    for k, case in enumerate(spec["cases"]):
        rows = [json.loads(l) for l in open(case["rows"]) if l.strip()]
        data_dir = os.path.join(spec["work"], f"prepared{k}")
        freq_path = os.path.join(data_dir, "token_freq.pt")
        prepare_data(
            model=model,
            data=[case["rows"]],
            output=data_dir,
            seq_length=1 << 20,
            token_freq_path=freq_path,
            num_preprocessing_workers=1,
            skip_token_freq=False,
        )
        ds = ArrowDataset(max_len=1 << 20, datapath=data_dir)
        theirs = sorted(
            (tuple(ds.data[i]["input_ids"].tolist()), tuple(ds.data[i]["loss_mask"].tolist()))
            for i in range(len(ds))
        )
        ours = sorted((tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in rows)
        mismatched = sum(a != b for a, b in zip(theirs, ours)) + abs(len(theirs) - len(ours))
        text_equal = sum(
            r["text"] == tok.decode(r["input_ids"], skip_special_tokens=False) for r in rows
        )
        res = {
            "rows": len(rows),
            "prepared": len(ds),
            "pairs_equal": theirs == ours,
            "pairs_mismatched": mismatched,
            "supervised_tokens": int(sum(sum(m) for _, m in theirs)),
            "text_equal": text_equal,
        }
        freq = torch.load(freq_path, weights_only=True)
        if case.get("token_freq"):
            counts = load_file(case["token_freq"])["counts"]
            nz = counts.nonzero().flatten().tolist()
            # The README's conversion to speculators' token_freq.pt, loaded as it loads it.
            converted = os.path.join(data_dir, "spool_token_freq.pt")
            torch.save({i: int(counts[i]) for i in nz}, converted)
            res["token_freq_equal"] = torch.load(converted, weights_only=True) == freq
            res["token_freq_dtype"] = str(counts.dtype)
            res["token_freq_len"] = counts.shape[0]
            res["distinct"] = len(freq)
        res["draft"] = []
        for path in case.get("draft", []):
            t = load_file(path)
            n = t["d2t"].shape[0]
            d2t, t2d = build_vocab_mappings_from_distribution(freq, n, target_vocab)
            # The .npy files spool writes beside the safetensors file, as `speculators
            # train` loads them: given as --d2t-path/--t2d-path (`_load_mappings`), and
            # found by name in --data-path with --draft-vocab-size N (`parse_vocab_mappings`).
            folder = os.path.dirname(path)
            d2t_npy = os.path.join(folder, f"d2t-{n}.npy")
            t2d_npy = os.path.join(folder, f"t2d-{n}.npy")
            if not (os.path.exists(d2t_npy) and os.path.exists(t2d_npy)):
                sys.exit(f"no d2t-{n}.npy / t2d-{n}.npy beside {path}")
            loaded_d2t, loaded_t2d, loaded_n = _load_mappings(d2t_npy, t2d_npy, n)
            args = argparse.Namespace(
                d2t_path=None, t2d_path=None, data_path=folder, draft_vocab_size=n,
                token_freq_path=None, verifier_name_or_path=model, trust_remote_code=False,
            )
            found_d2t, found_t2d, found_n = parse_vocab_mappings(args)
            npy_dtypes = [str(np.load(d2t_npy).dtype), str(np.load(t2d_npy).dtype)]
            res["draft"].append({
                "file": path,
                "n": n,
                "d2t_equal": torch.equal(d2t, t["d2t"]),
                "t2d_equal": torch.equal(t2d, t["t2d"]),
                "dtypes": [str(t["d2t"].dtype), str(t["t2d"].dtype)],
                "npy_loads": loaded_n == n
                and torch.equal(loaded_d2t, d2t)
                and torch.equal(loaded_t2d, t2d),
                "npy_found": found_n == n
                and torch.equal(found_d2t, d2t)
                and torch.equal(found_t2d, t2d),
                "npy_dtypes": npy_dtypes,
            })
        out["cases"].append(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes N synthetic `{"prompt": ...}` rows (JSONL) for `make bench-scale`.

Deterministic (seeded). Prompt strings only (no chat messages, no tokenizer needed): each is
`#<i> ` followed by a slice of a fixed pseudo-random word text, of lognormal length (median
~300 bytes, capped at 4 KiB), so every row is distinct (derived ids never collide) and
generation stays fast (~1 µs of Python per row plus the write). No `id` field: spool derives
ids from the content, the common case.

usage: gen_prompts.py [--prompts N] OUT.jsonl      (N defaults to 10,000,000)
"""
import argparse
import json
import math
import random

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which "
    "have not but what all were when we there can been has more if will one would so no "
    "explain write function code python rust error value list string number example data "
    "model train token memory server request response file system user question answer "
    "why how does should could please give step detail summary compare difference between "
    "algorithm complexity proof theorem integral derivative matrix vector probability "
    "café naïve résumé Zürich 東京 数据 模型 def return import class self None fn let impl "
    "0 1 2 3 42 100 256 1024 3.14 2024"
).split()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10_000_000)
    ap.add_argument("out")
    a = ap.parse_args()
    rng = random.Random(7)
    text = " ".join(rng.choices(WORDS, k=400_000))
    span = len(text) - 5000
    with open(a.out, "w", encoding="utf-8") as f:
        buf = []
        for i in range(a.prompts):
            n = max(16, min(4096, int(math.exp(rng.gauss(math.log(300), 0.8)))))
            off = rng.randrange(span)
            buf.append(json.dumps({"prompt": f"#{i} " + text[off:off + n]}, ensure_ascii=False))
            if len(buf) >= 10_000:
                f.write("\n".join(buf) + "\n")
                buf.clear()
        if buf:
            f.write("\n".join(buf) + "\n")


if __name__ == "__main__":
    main()

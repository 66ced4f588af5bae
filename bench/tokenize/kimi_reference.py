#!/usr/bin/env python3
"""`make bench-tokenize-kimi`, the Python half of the raw encoder comparison: Python
`tiktoken` built as Moonshot's `tokenization_kimi.py` builds it (the class of
tests/python/kimi_oracle.py), one thread, over the same corpus as
examples/bench_kimi_encode.rs.

Two ways, each timed over whole passes of the corpus (texts read before the clock, ids
kept in lists, checksum computed after the clock, as the Rust side does):
  - "tiktoken": `Encoding.encode(text, allowed_special="all")`, tiktoken's Rust core alone;
  - "vendor encode": the vendor's `encode(text)`: its 400,000-character chunks and its
    25,000-character run splitting in Python, then tiktoken (SGLang's raw-text path).
Prints one JSON line per pass.

usage: kimi_reference.py MODEL_DIR CORPUS.jsonl [PASSES]
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))
from kimi_oracle import KimiLike  # noqa: E402


def checksum(all_ids):
    total = 0
    for ids in all_ids:
        total += sum(i * (k + 1) for k, i in enumerate(ids))
    return total % 2**64


def main():
    model_dir, corpus = sys.argv[1], sys.argv[2]
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    t = time.perf_counter()
    tok = KimiLike.from_pretrained(model_dir)
    print(json.dumps({"load_seconds": time.perf_counter() - t}), flush=True)
    enc = tok.model
    ways = [
        ("tiktoken", lambda s: enc.encode(s, allowed_special="all")),
        ("vendor encode", tok.encode),
    ]
    for name, fn in ways:
        for p in range(passes):
            t = time.perf_counter()
            all_ids = [fn(s) for s in texts]
            seconds = time.perf_counter() - t
            print(json.dumps({
                "impl": name, "pass": p, "texts": len(texts), "bytes": nbytes,
                "tokens": sum(map(len, all_ids)), "seconds": seconds,
                "checksum": str(checksum(all_ids)),
            }), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes N synthetic chat prompts (JSONL) of realistic lengths for `make bench-tokenize`.

Deterministic (seeded). Per row: user content of lognormal length (median ~70 words, mean
~110 words, capped at 3000), drawn from a mixed vocabulary (English words, code tokens,
numbers, punctuation, a little CJK and accented text); 25% have a system message, 15% are
multi-turn (user, assistant, user); 20% are ShareGPT `conversations` (half with a trailing
`gpt` turn, which spool drops), the rest OpenAI `messages`. Ids are `b0`, `b1`, ...

usage: gen_prompts.py N OUT.jsonl
"""
import json
import math
import random
import sys

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which "
    "have not but what all were when we there can been has more if will one would so no "
    "explain write function code python rust error value list string number example data "
    "model train token memory server request response file system user question answer "
    "why how does should could please give step detail summary compare difference between "
    "algorithm complexity proof theorem integral derivative matrix vector probability "
    "história café naïve résumé Zürich 東京 数据 模型 训练 問題 ありがとう "
    "def return import class self None True False fn let mut impl struct enum match "
    "{ } ( ) [ ] ; : , . ? ! = == -> => + - * / % < > <= >= && || "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14 2024 1e-5"
).split()
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise expert programmer. Answer with code when useful.",
    "You are a patient math tutor. Explain each step.",
    "Answer in the language of the question.",
]


def words(rng, n):
    return " ".join(rng.choices(WORDS, k=n))


def length(rng):
    n = int(math.exp(rng.gauss(math.log(70), 0.95)))
    return max(3, min(n, 3000))


def main():
    n, out = int(sys.argv[1]), sys.argv[2]
    rng = random.Random(6)
    with open(out, "w", encoding="utf-8") as f:
        for i in range(n):
            turns = []
            if rng.random() < 0.25:
                turns.append(("system", rng.choice(SYSTEMS)))
            if rng.random() < 0.15:
                turns.append(("user", words(rng, length(rng))))
                turns.append(("assistant", words(rng, length(rng))))
            turns.append(("user", words(rng, length(rng))))
            if rng.random() < 0.2:
                frm = {"system": "system", "user": "human", "assistant": "gpt"}
                conv = [{"from": frm[r], "value": c} for r, c in turns]
                if rng.random() < 0.5:
                    conv.append({"from": "gpt", "value": words(rng, 20)})
                row = {"id": f"b{i}", "conversations": conv}
            else:
                row = {"id": f"b{i}", "messages": [{"role": r, "content": c} for r, c in turns]}
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")


if __name__ == "__main__":
    main()

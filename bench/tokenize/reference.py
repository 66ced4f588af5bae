#!/usr/bin/env python3
"""Python reference for `make bench-tokenize`: render + tokenize a prompt file the way a
Python data script does, with transformers' `apply_chat_template` (jinja2) and
`tokenizers`' batch encode (Rust, all cores).

Reads the JSONL as a stream, in batches of 1024 rows: ShareGPT `conversations` are
converted to messages (trailing assistant turn dropped, as spool does), the batch is
rendered with `apply_chat_template(batch, tokenize=False, add_generation_prompt=True)`,
then encoded with `backend_tokenizer.encode_batch(texts, add_special_tokens=False)` (what
`apply_chat_template(tokenize=True)` does). Nothing is written: the reference does less
than spool, which also writes every prompt and its ids to its queue.

usage: reference.py TOKENIZER_DIR PROMPTS.jsonl  -> one JSON line on stdout
"""
import json
import sys
import time

from transformers import AutoTokenizer

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}


def messages(row):
    if "messages" in row:
        return row["messages"]
    turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    if turns and turns[-1]["role"] == "assistant":
        turns.pop()
    return turns


def main():
    tok_dir, path = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    backend = tok.backend_tokenizer
    t_load = time.perf_counter() - t0
    prompts = tokens = 0
    t1 = time.perf_counter()
    batch = []

    def flush():
        nonlocal prompts, tokens
        texts = tok.apply_chat_template(batch, tokenize=False, add_generation_prompt=True)
        for enc in backend.encode_batch(texts, add_special_tokens=False):
            tokens += len(enc.ids)
        prompts += len(batch)
        batch.clear()

    with open(path, encoding="utf-8") as f:
        for line in f:
            batch.append(messages(json.loads(line)))
            if len(batch) == 1024:
                flush()
    if batch:
        flush()
    secs = time.perf_counter() - t1
    print(json.dumps({"prompts": prompts, "tokens": tokens, "seconds": secs, "load_seconds": t_load}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The Python client spool is measured against in `make bench-overhead`.

Written the way such throw-away generation jobs usually are: asyncio + aiohttp, one task
per prompt gated by a semaphore, one JSONL line appended per completion, and resume by
scanning the output file for the ids already done. It stores what spool stores (text,
token ids, token counts, finish reason) so both clients do the same work per item.

  python3 baseline.py --url http://127.0.0.1:PORT --input prompts.jsonl \
      --output out.jsonl --concurrency 256
"""
import argparse
import asyncio
import json
import os
import random

import aiohttp


def load_done(path):
    done = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (ValueError, KeyError):
                    pass  # a line cut by a crash: that prompt is requested again
    return done


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model", default="mock")
    ap.add_argument("--max-tokens", type=int, default=10240)
    ap.add_argument("--max-attempts", type=int, default=6)
    a = ap.parse_args()

    done = load_done(a.output)
    with open(a.input) as f:
        prompts = [json.loads(line) for line in f]
    todo = [p for p in prompts if p["id"] not in done]

    sem = asyncio.Semaphore(a.concurrency)
    out = open(a.output, "a")
    conn = aiohttp.TCPConnector(limit=a.concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(p):
            body = {
                "model": a.model,
                "prompt": p["prompt"],
                "max_tokens": a.max_tokens,
                "temperature": 0.7,
                "top_p": 0.95,
                "return_token_ids": True,
            }
            async with sem:
                for attempt in range(a.max_attempts):
                    try:
                        async with session.post(a.url + "/v1/completions", json=body) as r:
                            r.raise_for_status()
                            data = await r.json()
                        break
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        if attempt + 1 == a.max_attempts:
                            return
                        await asyncio.sleep(min(60, 0.5 * 2**attempt) * (0.5 + random.random() / 2))
            c = data["choices"][0]
            u = data.get("usage") or {}
            rec = {
                "id": p["id"],
                "prompt": p["prompt"],
                "completion": c["text"],
                "token_ids": c.get("token_ids"),
                "prompt_tokens": u.get("prompt_tokens"),
                "completion_tokens": u.get("completion_tokens"),
                "finish_reason": c.get("finish_reason"),
            }
            out.write(json.dumps(rec) + "\n")
            out.flush()

        await asyncio.gather(*(one(p) for p in todo))
    out.close()


if __name__ == "__main__":
    asyncio.run(main())

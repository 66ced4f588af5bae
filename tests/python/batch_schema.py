"""spool's OpenAI batch files against vLLM's batch schema (tests/fixtures/vllm_batch).

    batch_schema.py write INPUT.jsonl
        Writes a batch input file the way users write one (dicts dumped per line, chat and
        text-completion requests, sampling fields, a long prompt the server refuses,
        and rows spool must reject) and validates each line as a BatchRequestInput.
        Prints {"lines", "valid": [custom_id...], "invalid": [custom_id...],
                "multi": [custom_id...], "too_long": custom_id}.
    batch_schema.py check OUTPUT.jsonl SUMMARY.json INPUT.jsonl...
        Validates every line of spool's openai-batch export as a BatchRequestOutput and
        compares custom_ids in and out and the counts with the export's summary.
        Prints a JSON report (see `check`).

Needs pydantic 2 and the openai package (for the message types); fails loudly without.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures", "vllm_batch"))

try:
    import pydantic  # noqa: F401
    from protocol import BatchRequestInput, BatchRequestOutput
except ImportError as e:  # CI installs them; say what is missing instead of skipping.
    print(f"batch_schema.py needs pydantic 2 and openai: {e}", file=sys.stderr)
    sys.exit(3)

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def requests():
    """The lines of the test's batch file, as (line text, meant to be read by spool)."""
    out = []

    def req(cid, url, body, method="POST"):
        return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})

    for i in range(12):
        body = {
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"Question {i}: why is the sky blue?"},
            ],
            "max_tokens": 5 + i,
        }
        if i % 3 == 0:
            body["temperature"] = 0.2
            body["seed"] = 100 + i
        if i % 4 == 1:
            body["stop"] = ["w7"]
        out.append((req(f"chat-{i}", CHAT, body), True))
    for i in range(4):
        body = {"model": "m", "prompt": f"Once upon a time {i}", "max_tokens": 9, "top_p": 0.5}
        out.append((req(f"text-{i}", TEXT, body), True))
    # Read by spool, refused by the server: far past the mock's context.
    long = " ".join(["word"] * 1500)
    out.append((req("too-long", CHAT, {"messages": [{"role": "user", "content": long}]}), True))
    # Rejected by spool (and by vLLM's schema where noted).
    out.append((req("bad-url", "/v1/embeddings", {"input": "x"}), False))
    out.append((req("bad-type", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": "ten"}), False))
    out.append((req("bad-method", CHAT, {"messages": [{"role": "user", "content": "x"}]},
                    method="GET"), False))
    out.append((req("no-messages", CHAT, {"max_tokens": 3}), False))
    return out


def write(path):
    lines = requests()
    valid, invalid = [], []
    with open(path, "w", encoding="utf-8") as f:
        for text, _ in lines:
            f.write(text + "\n")
            cid = json.loads(text)["custom_id"]
            try:
                BatchRequestInput.model_validate_json(text)
                valid.append(cid)
            except pydantic.ValidationError:
                invalid.append(cid)
    read = [json.loads(t)["custom_id"] for t, ok in lines if ok]
    print(json.dumps({"lines": len(lines), "valid": valid, "invalid": invalid,
                      "read_by_spool": read, "too_long": "too-long"}))


def check(output_path, summary_path, input_paths):
    ids_in = []
    for input_path in input_paths:
        with open(input_path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    ids_in.append(json.loads(line)["custom_id"])
    ids_out, invalid, responses, failed, rejected = [], [], 0, 0, 0
    choices = 0
    codes = {}
    with open(output_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                o = BatchRequestOutput.model_validate_json(line)
            except pydantic.ValidationError as e:
                invalid.append({"line": n, "error": str(e)[:500]})
                continue
            ids_out.append(o.custom_id)
            if o.response is not None and o.response.status_code == 200 and o.error is None:
                if o.response.body is None:
                    invalid.append({"line": n, "error": "200 without a body"})
                    continue
                responses += 1
                choices += len(o.response.body.choices)
            else:
                code = (o.error or {}).get("code") if isinstance(o.error, dict) else None
                codes[code] = codes.get(code, 0) + 1
                if code == "request_failed":
                    failed += 1
                elif code == "rejected_row":
                    rejected += 1
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    kept = sum(d["kept"] for d in summary["datasets"])
    items_kept = sum(d["items_kept"] for d in summary["datasets"])
    queue = [d.get("queue") or {} for d in summary["datasets"]]
    print(json.dumps({
        "lines": len(ids_out) + len(invalid),
        "invalid": invalid,
        "responses": responses,
        "choices": choices,
        "failed": failed,
        "rejected": rejected,
        "codes": {str(k): v for k, v in codes.items()},
        "ids_in": sorted(ids_in),
        "ids_out": sorted(ids_out),
        "same_ids": sorted(ids_in) == sorted(ids_out),
        "summary_kept": kept,
        "summary_items_kept": items_kept,
        "summary_failed": sum(q.get("failed", 0) for q in queue),
        "summary_rejected": sum(q.get("rejected", 0) for q in queue),
        "summary_input_rows": sum(q.get("input_rows", 0) for q in queue),
    }))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)

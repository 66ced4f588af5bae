#!/usr/bin/env python3
"""Regenerates examples/prompts/*.jsonl (deterministic; committed outputs)."""
import json, random, pathlib

root = pathlib.Path(__file__).resolve().parent.parent / "examples" / "prompts"
root.mkdir(parents=True, exist_ok=True)
rng = random.Random(42)

topics = ["binary search", "a LRU cache", "Dijkstra's algorithm", "a trie", "rate limiting",
          "consistent hashing", "a ring buffer", "merge sort", "a bloom filter", "a thread pool",
          "JSON parsing", "backpressure", "exponential backoff", "a write-ahead log", "B-trees"]
langs = ["Rust", "Python", "Go", "C++", "TypeScript"]
subjects = ["photosynthesis", "the French revolution", "plate tectonics", "inflation", "vaccines",
            "black holes", "the printing press", "compound interest", "neural networks", "tides"]
styles = ["to a ten-year-old", "in three bullet points", "as a short story", "for an expert",
          "with one concrete example", "and list two common misconceptions"]

with open(root / "chat.jsonl", "w") as f:
    for i in range(120):
        s, st = rng.choice(subjects), rng.choice(styles)
        if i % 3 == 0:
            row = {"id": f"chat-{i}", "conversations": [
                {"from": "system", "value": "You are a patient teacher."},
                {"from": "human", "value": f"Explain {s} {st}."},
                {"from": "gpt", "value": "(an old answer, dropped: spool regenerates it)"}]}
        else:
            row = {"id": f"chat-{i}", "messages": [
                {"role": "user", "content": f"Explain {s} {st}."}]}
        f.write(json.dumps(row, ensure_ascii=False) + "\n")

with open(root / "code.jsonl", "w") as f:
    for i in range(100):
        t, l = rng.choice(topics), rng.choice(langs)
        f.write(json.dumps({"id": i, "messages": [
            {"role": "system", "content": "You are an expert programmer. Answer with code and a short explanation."},
            {"role": "user", "content": f"Implement {t} in {l}, with tests."}]}) + "\n")

with open(root / "math.jsonl", "w") as f:
    for i in range(80):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        # `prompt` rows are sent as they are, without a chat template.
        f.write(json.dumps({"prompt": f"Problem {i}: compute {a} * {b} and show each step.\nSolution:"}) + "\n")

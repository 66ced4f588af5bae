"""Runs Moonshot's own tool encoder on test cases, as the oracle for spool's `kimi_tools`.

Usage: kimi_tools.py CASES.jsonl

Each line of CASES.jsonl has `id` and `tools`. For each, `encode_tools_to_typescript_style`
of Moonshot's `tool_declaration_ts.py` (vendored in tests/fixtures/moonshot/, with its
licence and provenance) runs on the tools as they are, and one JSON line goes to stdout:
`id` and either `typescript` (the string it returns) or `error` (the exception's type and
message: what `tokenization_kimi.py` catches before falling back to JSON declarations).
"""

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "moonshot"))

from tool_declaration_ts import encode_tools_to_typescript_style  # noqa: E402


def main():
    out = sys.stdout
    for line in Path(sys.argv[1]).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        record = {"id": case["id"]}
        try:
            # The encoder logs through `logging`; nothing of it belongs in the answer.
            with contextlib.redirect_stdout(sys.stderr):
                record["typescript"] = encode_tools_to_typescript_style(case["tools"])
        except Exception as e:  # what tokenization_kimi.py catches
            record["error"] = f"{type(e).__name__}: {e}"
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""Renders every (template, conversation) pair with transformers, as the oracle for spool.

Usage: render_templates.py CONVERSATIONS.jsonl NAME=TEMPLATE_PATH[=TOKENIZER_PATH] ...

TEMPLATE_PATH is a template file (its special tokens come from the `tokenizer_config.json`
beside it) or a `tokenizer_config.json` with a `chat_template` string. TOKENIZER_PATH, when
given, is a `tokenizer.json` (the `tokenizers` library, as transformers' fast tokenizers
load it) and each rendered pair also gets `input_ids` (encoded without special tokens, as
`apply_chat_template(tokenize=True)` encodes). Each conversation row
has `id`, `messages`, `add_generation_prompt`, and optionally `tools` and `kwargs`.

Each pair is rendered exactly as `PreTrainedTokenizerBase.apply_chat_template(messages,
tools=tools, add_generation_prompt=..., tokenize=False, **kwargs)` does it: messages go
through `_normalize_chat_messages` (keys whose value is None are dropped), the special tokens
(`special_tokens_map`: the named attributes that are set) come first and kwargs override them,
then `render_jinja_template` renders. Where the config's `auto_map` names Moonshot's
`tokenization_kimi.TikTokenTokenizer`, tools first go through that tokenizer's own step: its
`apply_chat_template` override calls `deep_sort_dict(tools)` (every dict's keys sorted, at
every depth, lists kept in order) before transformers' — restated here as
`kimi_deep_sort`, since Moonshot's file cannot be shipped with the tests. Writes one JSON line per pair to stdout: `template`,
`id`, and either `rendered` (and `input_ids`) or `error` (the exception's message) with
`error_type`.
"""

import json
import sys
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

# `PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES`: what `special_tokens_map` can hold.
SPECIAL_TOKEN_KEYS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


def token_text(value):
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(config):
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = token_text(config.get(key))
        if text is not None:
            out[key] = text
    return out


def kimi_deep_sort(obj):
    """Moonshot's `deep_sort_dict` (tokenization_kimi.py), as it reads."""
    if isinstance(obj, dict):
        return {k: kimi_deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [kimi_deep_sort(item) for item in obj]
    return obj


def is_kimi_tokenizer(config):
    names = (config.get("auto_map") or {}).get("AutoTokenizer") or []
    names = [names] if isinstance(names, str) else names
    return any(isinstance(n, str) and n.startswith("tokenization_kimi.") for n in names)


def load_template(path):
    """The template source, the special tokens, and whether tools are deep-sorted first."""
    path = Path(path)
    if path.suffix == ".json":
        config = json.loads(path.read_text(encoding="utf-8"))
        return config["chat_template"], special_tokens(config), is_kimi_tokenizer(config)
    config_path = path.with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    return path.read_text(encoding="utf-8"), special_tokens(config), is_kimi_tokenizer(config)


def load_tokenizer(path):
    path = Path(path)
    if path.name != "tokenizer.json":
        raise SystemExit(f"{path}: only tokenizer.json files are supported as tokenizers")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def render(source, tokens, sort_tools, row):
    messages = _normalize_chat_messages(row["messages"])
    tools = row.get("tools")
    if sort_tools:
        tools = kimi_deep_sort(tools)
    template_kwargs = {**tokens, **row.get("kwargs", {})}
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=row["add_generation_prompt"],
        **template_kwargs,
    )
    return rendered[0]


def main():
    conversations = [json.loads(line) for line in Path(sys.argv[1]).read_text(encoding="utf-8").splitlines() if line.strip()]
    out = sys.stdout
    out.write(json.dumps({"transformers": transformers.__version__, "jinja2": __import__("jinja2").__version__}) + "\n")
    for spec in sys.argv[2:]:
        name, path, *tokenizer_path = spec.split("=")
        source, tokens, sort_tools = load_template(path)
        encode = load_tokenizer(tokenizer_path[0]) if tokenizer_path else None
        for row in conversations:
            record = {"template": name, "id": row["id"]}
            try:
                record["rendered"] = render(source, tokens, sort_tools, row)
                if encode is not None:
                    record["input_ids"] = encode(record["rendered"])
            except Exception as e:  # the oracle's verdict, whatever the kind
                record["error"] = str(e)
                record["error_type"] = type(e).__name__
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

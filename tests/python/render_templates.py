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
`tokenization_kimi.TikTokenTokenizer`, Moonshot's own code (vendored in
tests/fixtures/moonshot/) runs first, as transformers would run it: for a template that
reads `tools_ts_str` (K2.5 / K2.6), that tokenizer's `apply_chat_template` override itself
(tools deep-sorted, `tools_ts_str` from `tool_declaration_ts.py`, `thinking=True` and
`preserve_thinking=False` defaults) in front of the transformers steps above; for the K2
templates, the K2 override's one step, its `deep_sort_dict(tools)`. Writes one JSON line per
pair to stdout: `template`, `id`, and either `rendered` (and `input_ids`) or `error` (the
exception's message) with `error_type`.
"""

import contextlib
import json
import sys
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "moonshot"))

# Moonshot's code: its tokenizer's chat rendering and the tool encoder it imports.
from tokenization_kimi_chat import TikTokenTokenizer, deep_sort_dict  # noqa: E402

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


def is_kimi_tokenizer(config):
    names = (config.get("auto_map") or {}).get("AutoTokenizer") or []
    names = [names] if isinstance(names, str) else names
    return any(isinstance(n, str) and n.startswith("tokenization_kimi.") for n in names)


def model_code(config, source):
    """Which of Moonshot's `apply_chat_template` overrides runs: None, "k2" or "k2.5"."""
    if not is_kimi_tokenizer(config):
        return None
    return "k2.5" if "tools_ts_str" in source else "k2"


def load_template(path):
    """The template source, the special tokens, and the model code that runs before it."""
    path = Path(path)
    if path.suffix == ".json":
        config = json.loads(path.read_text(encoding="utf-8"))
        source = config["chat_template"]
    else:
        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        source = path.read_text(encoding="utf-8")
    return source, special_tokens(config), model_code(config, source)


def load_tokenizer(path):
    path = Path(path)
    if path.is_dir() and (path / "tiktoken.model").is_file():
        # Kimi's tiktoken folder: the ids of the server's path (transformers' trie around a
        # class shaped as Moonshot's TikTokenTokenizer), as kimi_oracle.py builds them.
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kimi_oracle import KimiLike

        kimi = KimiLike.from_pretrained(str(path))
        return lambda text: kimi(text, add_special_tokens=False)["input_ids"]
    if path.name != "tokenizer.json":
        raise SystemExit(f"{path}: only tokenizer.json files and tiktoken folders are tokenizers")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


class Transformers:
    """`PreTrainedTokenizerBase.apply_chat_template(tokenize=False)` for one conversation."""

    def __init__(self, source, tokens):
        self.source = source
        self.tokens = tokens

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=False, **kwargs):
        messages = _normalize_chat_messages(conversation)
        template_kwargs = {**self.tokens, **kwargs}
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.source,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        return rendered[0]


class KimiK25(TikTokenTokenizer, Transformers):
    """Moonshot's K2.5 / K2.6 override in front of transformers', as the model loads."""


def render(source, tokens, code, row):
    tools = row.get("tools")
    kwargs = row.get("kwargs", {})
    if code == "k2.5":
        # The override prints when its encoder fails; stdout is this script's answer.
        with contextlib.redirect_stdout(sys.stderr):
            return KimiK25(source, tokens).apply_chat_template(
                row["messages"], tools=tools, add_generation_prompt=row["add_generation_prompt"], **kwargs
            )
    if code == "k2":
        tools = deep_sort_dict(tools)
    return Transformers(source, tokens).apply_chat_template(
        row["messages"], tools=tools, add_generation_prompt=row["add_generation_prompt"], **kwargs
    )


def main():
    conversations = [json.loads(line) for line in Path(sys.argv[1]).read_text(encoding="utf-8").splitlines() if line.strip()]
    out = sys.stdout
    out.write(json.dumps({"transformers": transformers.__version__, "jinja2": __import__("jinja2").__version__}) + "\n")
    for spec in sys.argv[2:]:
        name, path, *tokenizer_path = spec.split("=")
        source, tokens, code = load_template(path)
        encode = load_tokenizer(tokenizer_path[0]) if tokenizer_path else None
        for row in conversations:
            record = {"template": name, "id": row["id"]}
            try:
                record["rendered"] = render(source, tokens, code, row)
                if encode is not None:
                    record["input_ids"] = encode(record["rendered"])
            except Exception as e:  # the oracle's verdict, whatever the kind
                record["error"] = str(e)
                record["error_type"] = type(e).__name__
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

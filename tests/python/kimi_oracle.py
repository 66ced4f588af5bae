"""Reference ids for Kimi's tiktoken tokenizer, built as Moonshot's `tokenization_kimi.py`
(`TikTokenTokenizer` of Kimi K2 / K2.5 / K2-Thinking) builds it.

Usage: kimi_oracle.py MODEL_DIR CASES.jsonl OUT.jsonl [--vendor tokenization_kimi.py]

CASES.jsonl: one object a line, {"text": str} or {"ids": [int]} (decode only).
OUT.jsonl, one object a line in the same order:
  - "call": ids of the server's path, transformers' `tokenizer(text)` (vLLM's prompt path and
    every chat rendering): transformers' own added-token trie and `convert_tokens_to_ids`
    around a tokenizer class written as the vendor's (`_tokenize` -> `encode`), with
    add_special_tokens=False; "call_special": the same with add_special_tokens=True;
  - "encode": the vendor's `encode(text)` (SGLang's path for a raw text prompt): 400,000-
    character chunks, runs cut at 25,000 characters, tiktoken with every special allowed;
  - "tiktoken": plain `Encoding.encode(text, allowed_special="all")`, no chunking;
  - "decoded": `Encoding.decode` of "call"; for an "ids" case, of those ids;
  - "vendor_call" / "vendor_encode": the same two paths through the vendor's own file, when
    --vendor names one.
The first line of OUT is {"isspace": [...]}: every code point Python's str.isspace accepts,
and {"vendor": path or null}.

Nothing here is the vendor's code: the class below follows what its file does, step by
step, so transformers' real machinery (trie, token conversion) runs around it.
"""

import importlib.util
import json
import os
import sys

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

# The vendor's pat_str: its eight alternatives joined with "|".
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
SPECIAL_SLOTS = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
DEFAULT_ADDITIONAL = [
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
    "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>",
]


def runs_cut(s, limit):
    """Parts of s with no run of whitespace / non-whitespace longer than limit."""
    if not s:
        return
    run, space, start = 0, s[0].isspace(), 0
    for i, c in enumerate(s):
        now = c.isspace()
        if now != space:
            run, space = 1, now
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


class KimiLike(PreTrainedTokenizer):
    """A tokenizer class shaped as the vendor's: the special block named from
    added_tokens_decoder (the rest <|reserved_token_ID|>), the byte-level token strings
    transformers converts back to ids, `encode` without kwargs doing the chunked tiktoken
    encode, `_tokenize` calling it. The vendor does not pass added_tokens_decoder on to
    transformers, so its trie holds only bos/eos/unk/pad and additional_special_tokens."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
                 pad_token=None, additional_special_tokens=None, added_tokens_decoder=None,
                 **kwargs):
        if additional_special_tokens is None:
            additional_special_tokens = list(DEFAULT_ADDITIONAL)
        names = {i: t.content for i, t in (added_tokens_decoder or {}).items()}
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + SPECIAL_SLOTS)}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.n_words = self.model.n_vocab
        self.unk_id = self.special_tokens[str(unk_token)]
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.n_words)}
        self.encoder = {}
        for i in range(self.n_words):
            self.encoder[self.decoder[i]] = i
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, additional_special_tokens=additional_special_tokens,
                         **kwargs)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        out = []
        for i in range(0, len(text), MAX_ENCODE_CHARS):
            for part in runs_cut(text[i:i + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                if allow_special_tokens:
                    out.extend(self.model.encode(part, allowed_special="all"))
                else:
                    out.extend(self.model.encode(part, disallowed_special=()))
        return out

    @property
    def vocab_size(self):
        return self.n_words

    def get_vocab(self):
        return self.encoder

    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")


def load_vendor(path, model_dir):
    """The vendor's own class from its file. Its K2 file imports `bytes_to_unicode` from
    where transformers 4 kept it; that one name is provided where transformers 5 lacks it."""
    import transformers.models.gpt2.tokenization_gpt2 as gpt2

    if not hasattr(gpt2, "bytes_to_unicode"):
        gpt2.bytes_to_unicode = bytes_to_unicode
    spec = importlib.util.spec_from_file_location("tokenization_kimi", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TikTokenTokenizer.from_pretrained(model_dir)


def main():
    args = sys.argv[1:]
    vendor_path = None
    if "--vendor" in args:
        k = args.index("--vendor")
        vendor_path = args[k + 1]
        del args[k:k + 2]
    model_dir, cases_path, out_path = args
    tok = KimiLike.from_pretrained(model_dir)
    vendor = load_vendor(vendor_path, model_dir) if vendor_path else None
    enc = tok.model
    with open(cases_path, encoding="utf-8") as f, open(out_path, "w", encoding="utf-8") as out:
        head = {
            "isspace": [c for c in range(0x110000) if chr(c).isspace()],
            "vendor": vendor_path,
            "trie": sorted(tok.added_tokens_encoder),
        }
        out.write(json.dumps(head) + "\n")
        for line in f:
            case = json.loads(line)
            if "ids" in case:
                out.write(json.dumps({"decoded": enc.decode(case["ids"])}) + "\n")
                continue
            text = case["text"]
            call = tok(text, add_special_tokens=False)["input_ids"]
            res = {
                "call": call,
                "call_special": tok(text, add_special_tokens=True)["input_ids"],
                "encode": tok.encode(text),
                "tiktoken": enc.encode(text, allowed_special="all"),
                "decoded": enc.decode(call),
            }
            if vendor is not None:
                res["vendor_call"] = vendor(text, add_special_tokens=False)["input_ids"]
                res["vendor_encode"] = vendor.encode(text)
            out.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()

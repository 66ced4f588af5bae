#!/usr/bin/env bash
# A real llama.cpp server for tests/it/llama_server.rs, from the registries alone:
# llama-server built from the llama.cpp source inside the llama-cpp-python sdist (PyPI),
# and a tiny Qwen3 model in GGUF (random weights, 1 layer; the tokenizer and chat template
# of tests/fixtures/tokenizers/qwen3) converted by that source's convert_hf_to_gguf.py.
# Nothing comes from the Hugging Face hub. Building took 25 min on 2 shared cores here.
#
# Usage: scripts/llama-server.sh DIR   (then DIR/llama-server, DIR/tiny-qwen3.gguf;
#        SPOOL_TEST_LLAMA_SERVER=DIR cargo nextest run --test it --run-ignored only -E 'test(/llama_server/)')
set -euo pipefail
dir=$(realpath -m "${1:?usage: scripts/llama-server.sh DIR}")
root=$(cd "$(dirname "$0")/.." && pwd)
version=0.3.36
mkdir -p "$dir"
if [ -x "$dir/llama-server" ] && [ -f "$dir/tiny-qwen3.gguf" ]; then
  echo "$dir: already built"
  exit 0
fi
PIP="python3 -m pip install --quiet --disable-pip-version-check"
# The sdist's build backend (to read its metadata), cmake, and what the converter imports.
$PIP scikit-build-core cmake sentencepiece transformers torch safetensors numpy
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"

cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j"$(nproc)" >/dev/null

python3 - "$root/tests/fixtures/tokenizers/qwen3" "$work/tiny" <<'EOF'
import os, shutil, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
src, out = sys.argv[1], sys.argv[2]
os.makedirs(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(src, f), out)
torch.manual_seed(0)
config = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                     bos_token_id=151643, eos_token_id=151645)
Qwen3ForCausalLM(config).to(torch.float16).save_pretrained(out, safe_serialization=True)
EOF
PYTHONPATH="$src/gguf-py" python3 "$src/convert_hf_to_gguf.py" "$work/tiny" \
  --outfile "$dir/tiny-qwen3.gguf" --outtype f16 >/dev/null 2>&1
cp "$work/build/bin/llama-server" "$dir/llama-server"
echo "$dir/llama-server, $dir/tiny-qwen3.gguf"

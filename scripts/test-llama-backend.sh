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
#   scripts/test-llama-backend.sh [--arm] LLAMA_CPP_DIR
#
# The libraries are found as build-llama-backend.sh finds them
# ($GGML_LIB_DIR, LLAMA_CPP_DIR/build/bin, or the llama-cpp-python of
# ${PYTHON:-python3}).  Builds into build/llama-backend/ (or
# $SA_LLAMA_BUILD); CC overrides gcc.  Exits non-zero if anything fails.
#
# --asan: the backend and the test built with AddressSanitizer + UBSan
# (into build/llama-backend-asan/), llama.cpp's libraries as they are.
#
# --arm: the same on aarch64, emulated: ggml itself cross-built from
# LLAMA_CPP_DIR (${CMAKE:-cmake}, aarch64-linux-gnu-gcc/g++, its CPU backend
# for armv8.2-a+dotprod+fp16, no OpenMP) into build/llama-backend-arm/ggml
# (or $SA_LLAMA_BUILD/ggml), the backend and the test cross-built against
# it, and the test run under qemu-aarch64 as a Cortex-A76, so the core's
# NEON kernels are compared with llama.cpp's own NEON ones.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
arm=0 asan=0
case "${1:-}" in
    --arm) arm=1; shift ;;
    --asan) asan=1; shift ;;
esac
if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,25p' "$0"
    [[ $# -eq 1 ]] && exit 0
    exit 2
fi
llama="$(cd "$1" && pwd)"
run=()
if (( arm )); then
    build="${SA_LLAMA_BUILD:-$repo/build/llama-backend-arm}"
    export CC="${CC:-aarch64-linux-gnu-gcc}"
    for tool in "$CC" aarch64-linux-gnu-g++ qemu-aarch64 "${CMAKE:-cmake}"; do
        command -v "$tool" >/dev/null || {
            echo "test-llama-backend.sh: $tool not found (CI installs gcc-aarch64-linux-gnu," \
                 "g++-aarch64-linux-gnu, qemu-user and cmake)" >&2
            exit 1
        }
    done
    ggml="$build/ggml"
    mkdir -p "$build"
    echo "== ggml cross-built for aarch64 from $llama into $ggml"
    t0=$SECONDS
    "${CMAKE:-cmake}" -S "$llama" -B "$ggml" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
        -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
        -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16 -DGGML_OPENMP=OFF \
        -DGGML_CCACHE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF >"$build/cmake.log" 2>&1 ||
        { cat "$build/cmake.log"; exit 1; }
    "${CMAKE:-cmake}" --build "$ggml" -j "$(nproc)" --target ggml >>"$build/cmake.log" 2>&1 ||
        { tail -n 40 "$build/cmake.log"; exit 1; }
    echo "   built in $((SECONDS - t0)) s"
    export GGML_LIB_DIR="$ggml/bin"
    run=(qemu-aarch64 -cpu cortex-a76 -L /usr/aarch64-linux-gnu)
elif (( asan )); then
    build="${SA_LLAMA_BUILD:-$repo/build/llama-backend-asan}"
    export SA_BACKEND_SANITIZE=address,undefined
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
else
    build="${SA_LLAMA_BUILD:-$repo/build/llama-backend}"
fi
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
sanitize=()
(( asan )) && sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=all)
"$cc" -O2 -g "${sanitize[@]}" -std=gnu11 -Wall -Wextra -I"$llama/ggml/include" \
    "$repo/tests/c/test_ggml_backend.c" "${libs[@]}" -Wl,-rpath,"$lib_dir" -lm -o "$exe"
echo "== the backend against llama.cpp's CPU backend${run[*]:+ (${run[*]})}"
"${run[@]}" "$exe" "$plugin"
if (( arm )); then
    echo "== again with SPARSE_ATTN_ISA=neon (the A55's path: NEON without dotprod)"
    SPARSE_ATTN_ISA=neon SA_EXPECT_ISA=neon "${run[@]}" "$exe" "$plugin"
elif (( ! asan )); then
    echo "== again with SPARSE_ATTN_ISA=portable (the kernels' portable twins)"
    SPARSE_ATTN_ISA=portable SA_EXPECT_ISA=portable "$exe" "$plugin"
fi

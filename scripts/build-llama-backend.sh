#!/usr/bin/env bash
# Build the ggml backend (csrc/ggml/backend.c with the whole C core) as a
# shared object llama.cpp loads at run time.
#
#   scripts/build-llama-backend.sh LLAMA_CPP_DIR [OUT]
#
# LLAMA_CPP_DIR is a llama.cpp source tree: the headers are read from its
# ggml/include and ggml/src (ggml-backend-impl.h); none is part of this
# repository.  It must be the llama.cpp the backend will be loaded into (the
# backend interface has no stable ABI; llama-cpp-python's sdist vendors its
# own under vendor/llama.cpp).  OUT defaults to build/llama-backend/
# libsparse_attn_ggml.so.
#
# The backend links against libggml-base, found in $GGML_LIB_DIR, else in
# LLAMA_CPP_DIR/build/bin (a CMake build of that tree), else in the
# llama_cpp package of ${PYTHON:-python3} (llama-cpp-python's lib/).  At run
# time it uses the libggml-base already loaded by whoever loads it.
#
# The core is compiled as the Python extension compiles it (the flags of
# csrc/build_ffi.py's compile_args, the kernel files of csrc/isa_list.h for
# this architecture, each selecting its instruction set itself), so the
# kernel path is still chosen at run time from the CPU; CC overrides gcc.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || $# -gt 2 || $1 == -h || $1 == --help ]]; then
    sed -n '2,23p' "$0"
    [[ $# -ge 1 && ($1 == -h || $1 == --help) ]] && exit 0
    exit 2
fi
llama="$(cd "$1" && pwd)"
out="${2:-$repo/build/llama-backend/libsparse_attn_ggml.so}"
cc="${CC:-gcc}"

for f in ggml/include/ggml.h ggml/include/ggml-backend.h ggml/src/ggml-backend-impl.h; do
    if [[ ! -f $llama/$f ]]; then
        echo "build-llama-backend.sh: $llama/$f not found: LLAMA_CPP_DIR must be a llama.cpp" \
             "source tree" >&2
        exit 1
    fi
done

# ggml_lib_dir, ggml_lib: where the ggml libraries are (the order above)
. "$repo/scripts/lib/ggml-libs.sh"
lib_dir="$(ggml_lib_dir "$llama")"
lib="$(ggml_lib "$lib_dir" ggml-base)"

# isa_sources ARCH: the kernel files of csrc/isa_list.h for that architecture
. "$repo/scripts/lib/isa-sources.sh"
arch="$("$cc" -dumpmachine)"
arch="${arch%%-*}"
mapfile -t isa < <(isa_sources "$arch")
# csrc/build_ffi.py's compile_args: fp-contract=off keeps the arithmetic the
# source's (no FMA fused in one inlined copy and not in another); aarch64
# renames registers after allocation (the A55's in-order schedule).
flags=(-O3 -std=gnu11 -fvisibility=hidden -ffp-contract=off)
[[ $arch == aarch64 ]] && flags+=(-frename-registers)
# A llama.cpp whose CPU backend runs its threads with OpenMP (the default
# where the compiler has it): the core's items run on that OpenMP team, not
# on the core's own pool, whose workers would compete with the team's
# spinning threads for the cores (csrc/threads.c, SA_PARALLEL_OPENMP).
parallel="the core's thread pool"
cpu_lib="$(ggml_lib "$lib_dir" ggml-cpu 2>/dev/null)" || cpu_lib=""
if [[ -n $cpu_lib ]] && readelf -d "$cpu_lib" | grep -q 'NEEDED.*libgomp'; then
    flags+=(-fopenmp -DSA_PARALLEL_OPENMP)
    parallel="llama.cpp's OpenMP threads"
fi
# SA_BACKEND_SANITIZE=address,undefined (scripts/test-llama-backend.sh
# --asan): the same sources under those sanitizers, for the tests only.
if [[ -n ${SA_BACKEND_SANITIZE:-} ]]; then
    flags=(-O1 -g -fno-omit-frame-pointer "${flags[@]:1}" -fsanitize="$SA_BACKEND_SANITIZE"
           -fno-sanitize-recover=all)
fi
flags+=("-DSA_BUILD_FLAGS=\"${flags[*]}\"")

mkdir -p "$(dirname "$out")"
echo "== building $out ($cc, $arch, linked against $lib; items on $parallel)"
"$cc" "${flags[@]}" -Wall -Wextra -fPIC -shared -pthread \
    -I"$repo/csrc" -I"$llama/ggml/include" -I"$llama/ggml/src" \
    "$repo"/csrc/*.c "${isa[@]}" "$repo/csrc/ggml/backend.c" \
    "$lib" -lm -Wl,-z,defs -o "$out"
# Only the backend's entry points are exported (the core's names stay inside,
# so the Python extension loaded beside it never clashes).
exported="$(nm -D --defined-only "$out" | awk '$2 == "T" {print $3}' | sort | tr '\n' ' ')"
if [[ $exported != "ggml_backend_init sa_ggml_calls sa_ggml_configure sa_ggml_settings_text sa_ggml_sparse_calls " ]]; then
    echo "build-llama-backend.sh: unexpected exports: $exported" >&2
    exit 1
fi
echo "== $out: exports $exported"

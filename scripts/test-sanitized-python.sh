#!/usr/bin/env bash
# The Python tests that feed the C core bad input, odd sizes and state
# changes, against a build of the extension with AddressSanitizer + UBSan,
# once per kernel path this CPU runs (SPARSE_ATTN_ISA), so a bad pointer or
# an overflow on any path fails the run.
#
#   scripts/test-sanitized-python.sh [pytest args...]
#
# Builds in a copy of the tree (never in place) into a venv under
# ${SA_SANITIZED_BUILD:-build/sanitized}, with the system's numpy, cffi and
# pytest (--system-site-packages) and the transformers stack installed into
# it (the CPU torch wheel runs with the sanitizers preloaded, so the
# transformers backend's hand-off of torch tensors to the core is checked
# too), and runs the tests with libasan and libubsan preloaded (the Python
# interpreter itself is not instrumented; leak checking is off: CPython
# keeps objects alive at exit).  Native
# AddressSanitizer does not see inside AVX-512 masked loads and gathers, so
# the portable and AVX2 paths are run too.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SA_SANITIZED_BUILD:-$repo/build/sanitized}"
py="${PYTHON:-python3}"
tests=(tests/test_bad_input.py tests/test_hardening.py tests/test_agreement.py
       tests/test_q8_and_cache.py tests/test_probe_rows.py tests/test_minmax.py
       tests/test_selection.py tests/test_determinism.py tests/test_channels.py
       tests/test_split_kv.py tests/test_transformers_hardening.py tests/test_ggml_attn.py
       tests/test_kv_state.py)

rm -rf "$build"
. "$repo/scripts/lib/copy-source.sh"
copy_source "$repo" "$build/src"
"$py" -m venv --system-site-packages "$build/venv"
san="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
echo "== building the extension with $san"
(cd "$build/src" && SPARSE_ATTN_CFLAGS="$san -O1 -g" SPARSE_ATTN_LDFLAGS="$san" \
    "$build/venv/bin/python" -m pip install -q --no-deps --no-build-isolation .)
PYTHON="$build/venv/bin/python" bash "$repo/scripts/install-transformers-extras.sh"
preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
isas="$(cd "$build" && LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
        "$build/venv/bin/python" -c 'import sparse_attn as s; print(*s.available_isas())')"
status=0
for isa in $isas; do
    echo "== pytest under ASan + UBSan, SPARSE_ATTN_ISA=$isa"
    (cd "$build" && \
     LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 SPARSE_ATTN_ISA="$isa" \
     "$build/venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]/#/src/}" "$@") || status=1
done
exit "$status"

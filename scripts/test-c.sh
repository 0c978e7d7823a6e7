#!/usr/bin/env bash
# Build and run the C harness (tests/c/test_kernels.c): every kernel table the
# CPU can run against the portable one, the public API end to end on every
# ISA, and argument rejection.
#
#   scripts/test-c.sh          native build with -O1 -g, AddressSanitizer and
#                              UBSan (the memory-safety run)
#   scripts/test-c.sh --arm    aarch64 cross build (static), run under
#                              qemu-aarch64 as a Cortex-A76 (must default to
#                              neon-dotprod; every ISA tested) and as a
#                              Cortex-A53 (must default to neon; neon tested
#                              against portable); then, if a static UBSan
#                              build links, the A76 run of the two Arm files
#                              under UBSan
#   scripts/test-c.sh --tsan   native build with ThreadSanitizer, the
#                              threaded parts only (--threads-only: the worker
#                              pool under 1-3 threads and four concurrent
#                              callers, each result checked bitwise)
#   scripts/test-c.sh --avx512-emulated
#                              x86-64 only: the native ASan + UBSan build, but
#                              with csrc/x86/avx512_vnni.h (the kernels of
#                              kernels_avx512_vnni.c and kernels_avx512_amx.c)
#                              compiled for AVX2 through SIMDe and a C model
#                              of the AMX tiles
#                              (tests/c/simde_avx512_shim.h), both tables
#                              reported runnable (-DSA_TEST_EMULATED_AVX512),
#                              so their kernels and the API on them are checked
#                              on a CPU without AVX-512 or AMX; must default to
#                              avx512-amx
#
# The native x86-64 and --arm runs also check that a kernel file, compiled
# as the extension compiles it, still contains a prefetch instruction.
#
# Installs nothing: the compilers, qemu-user and SIMDe (libsimde-dev) must
# already be there (.ci/run installs them).  Builds into build/test-c/ (or
# $SA_TEST_C_BUILD); CC and ARM_CC override the compilers, SIMDE_INCLUDE the
# directory holding simde/ (default /usr/include).  Exits non-zero if anything
# fails.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SA_TEST_C_BUILD:-$repo/build/test-c}"
mode=native
case "${1:-}" in
    "") ;;
    --arm) mode=arm ;;
    --avx512-emulated) mode=avx512-emulated ;;
    --tsan) mode=tsan ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "test-c.sh: unknown argument '$1' (use --arm, --avx512-emulated, --tsan or nothing)" >&2
       exit 2 ;;
esac
mkdir -p "$build"

# The whole core, plus the kernel files csrc/isa_list.h lists for the target
# architecture (cpu_features.c references every table of that architecture).
core=("$repo"/csrc/*.c)
# isa_sources ARCH: the kernel files of csrc/isa_list.h for that architecture
. "$repo/scripts/lib/isa-sources.sh"
common=(-std=gnu11 -Wall -Wextra -I"$repo/csrc" -pthread)
harness="$repo/tests/c/test_kernels.c"
cc="${CC:-gcc}"

build_harness() {  # compiler, arch, exe, label, flags...: core, the arch's kernel files, harness
    local compiler="$1" arch="$2" exe="$3" label="$4" list
    shift 4
    local isa=()
    list="$(isa_sources "$arch")"
    [[ -z $list ]] || mapfile -t isa <<<"$list"
    echo "== building $exe ($compiler, $label)"
    "$compiler" "${common[@]}" "$@" "${core[@]}" "${isa[@]}" "$harness" -o "$exe" -lm
}

# The kernels prefetch the rows rows.c names next (the next stretch of a run,
# the first rows of the next chosen run): a third faster sparse decode from
# DRAM on the development VM.  A compiler can drop __builtin_prefetch without
# a trace (one refactor compiled to no prefetch at all), and no result
# changes, so check the instruction is there in a kernel file, compiled as
# the extension compiles it (csrc/build_ffi.py).
check_prefetch() {  # compiler, kernel file under csrc/, instruction regex, label, arch flags...
    local asm
    asm="$("$1" -O3 -std=gnu11 -fvisibility=hidden -ffp-contract=off "${@:5}" -I"$repo/csrc" \
           -S -o - "$repo/csrc/$2")"
    if grep -Eq "^[[:space:]]+($3)[[:space:]]" <<<"$asm"; then
        echo "== $4: $2 keeps its prefetch ($3)"
    else
        echo "== $4: FAILED: $2 compiles to no $3 (the kernels' prefetch was optimised away)"
        return 1
    fi
}

run() {  # label, command... ; prints the result line and the time, returns the status
    local label="$1"; shift
    echo "== $label"
    local status=0 t0=$SECONDS
    "$@" || status=$?
    if (( status != 0 )); then
        echo "== $label: FAILED (exit $status)"
    fi
    echo "   ($((SECONDS - t0)) s)"
    return "$status"
}

if [[ $mode == native ]]; then
    exe="$build/test_kernels_native"
    build_harness "$cc" "$(uname -m)" "$exe" "ASan + UBSan" -O1 -g -fno-omit-frame-pointer \
        -fsanitize=address,undefined -fno-sanitize-recover=all
    status=0
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
        run "native $(uname -m)" "$exe" || status=$?
    if [[ $(uname -m) == x86_64 ]]; then
        check_prefetch "$cc" x86/kernels_avx2.c 'prefetcht[012]|prefetchnta' "native x86-64" ||
            status=1
        # every x86 decode kernel's prefetch walk issues its hint's lines,
        # each once (tests/c/test_walk_lines.c; skipped where the CPU lacks
        # the file's instructions)
        for pair in "kernels_avx2.c avx2" "kernels_avx512_vnni.c avx512vnni"; do
            read -r file feature <<<"$pair"
            walk="$build/test_walk_lines_${file%.c}"
            "$cc" "${common[@]}" -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all \
                -DSA_TEST_COUNT_PREFETCH -DSA_WALK_FILE="\"x86/$file\"" \
                -DSA_WALK_CPU="\"$feature\"" "$repo/tests/c/test_walk_lines.c" \
                "$repo/csrc/portable/kernels_portable.c" "$repo/csrc/common.c" -o "$walk" -lm ||
                status=1
            run "prefetch walks, x86/$file" "$walk" || status=1
        done
    fi
    exit "$status"
fi

if [[ $mode == tsan ]]; then
    exe="$build/test_kernels_tsan"
    build_harness "$cc" "$(uname -m)" "$exe" "ThreadSanitizer" -O1 -g -fsanitize=thread
    TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}" \
        run "native $(uname -m), ThreadSanitizer" "$exe" --threads-only
    exit $?
fi

if [[ $mode == avx512-emulated ]]; then
    if [[ $(uname -m) != x86_64 ]]; then
        echo "test-c.sh: --avx512-emulated needs an x86-64 host (this is $(uname -m))" >&2
        exit 1
    fi
    simde_include="${SIMDE_INCLUDE:-/usr/include}"
    if [[ ! -f $simde_include/simde/x86/avx512.h ]]; then
        echo "test-c.sh: SIMDe not found ($simde_include/simde/x86/avx512.h is missing;" \
             "CI installs libsimde-dev)" >&2
        exit 1
    fi
    # The AVX-512 vectors and kernels (avx512_vnni.h), rewritten for AVX2 +
    # SIMDe, and the two files that build a table from them, rewritten to
    # include that copy.  Each rewrite must hit exactly one line, so a change
    # to a file's preamble fails here loudly instead of silently testing
    # something else.
    hdr="$repo/csrc/x86/avx512_vnni.h"
    src="$repo/csrc/x86/kernels_avx512_vnni.c"
    amx="$repo/csrc/x86/kernels_avx512_amx.c"
    emu_hdr="$build/avx512_vnni_emulated.h"
    emu="$build/kernels_avx512_vnni_emulated.c"
    emu_amx="$build/kernels_avx512_amx_emulated.c"
    others=()   # every x86-64 kernel file but the two emulated
    while IFS= read -r f; do
        [[ $f == "$src" || $f == "$amx" ]] || others+=("$f")
    done < <(isa_sources x86_64)
    for pattern in '^#pragma GCC target(' '^#include <immintrin\.h>' '^#include "\.\./kernels\.h"'; do
        hits=$(grep -c -- "$pattern" "$hdr" || true)
        if [[ $hits != 1 ]]; then
            echo "test-c.sh: expected one line matching '$pattern' in $hdr, found $hits" >&2
            exit 1
        fi
    done
    for f in "$src" "$amx"; do
        if [[ $(grep -c '^#include "avx512_vnni\.h"$' "$f" || true) != 1 ]]; then
            echo "test-c.sh: expected one line '#include \"avx512_vnni.h\"' in $f" >&2
            exit 1
        fi
    done
    sed -e 's/^#pragma GCC target(.*/#pragma GCC target("avx2,fma")/' \
        -e 's/^#include <immintrin\.h>/#include "simde_avx512_shim.h"/' \
        -e 's|^#include "\.\./kernels\.h"|#include "kernels.h"|' \
        "$hdr" >"$emu_hdr"
    # The avx512-amx table's tile operations are modelled in C by the shim.
    sed -e 's|^#include "avx512_vnni\.h"$|#include "avx512_vnni_emulated.h"|' "$src" >"$emu"
    sed -e 's|^#include "avx512_vnni\.h"$|#include "avx512_vnni_emulated.h"|' "$amx" >"$emu_amx"
    exe="$build/test_kernels_avx512_emulated"
    log="$build/test_kernels_avx512_emulated.log"
    simde_flags=()
    [[ $simde_include == /usr/include ]] || simde_flags=(-isystem "$simde_include")
    echo "== building $exe ($cc, ASan + UBSan, avx512-vnni through SIMDe)"
    # -Wno-psabi: SIMDe passes 512-bit vectors by value without AVX-512.
    "$cc" "${common[@]}" -I"$repo/csrc/x86" -O1 -g -fno-omit-frame-pointer -Wno-psabi \
        -fsanitize=address,undefined -fno-sanitize-recover=all \
        -DSA_TEST_EMULATED_AVX512 -I"$repo/tests/c" "${simde_flags[@]}" \
        "${core[@]}" "${others[@]}" "$emu" "$emu_amx" "$harness" -o "$exe" -lm
    status=0
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
        run "x86-64, avx512-vnni and avx512-amx emulated (expect avx512-amx)" \
        "$exe" --expect-isa avx512-amx | tee "$log" || status=$?  # pipefail: the harness's status
    # The harness skips a table it thinks the CPU cannot run; make sure this
    # build really ran the emulated ones (kernel-level and end to end).
    for isa in avx512-vnni avx512-amx; do
        if ! grep -Eq "^ISA $isa +runs on this CPU" "$log"; then
            echo "== avx512-emulated: FAILED (the harness did not run $isa)"
            status=1
        fi
    done
    exit "$status"
fi

# --arm
arm_cc="${ARM_CC:-aarch64-linux-gnu-gcc}"
for tool in "$arm_cc" qemu-aarch64; do
    if ! command -v "$tool" >/dev/null; then
        echo "test-c.sh: $tool not found (CI installs gcc-aarch64-linux-gnu and qemu-user)" >&2
        exit 1
    fi
done
exe="$build/test_kernels_aarch64"
build_harness "$arm_cc" aarch64 "$exe" "-O2 -static" -O2 -static

failed=0
check_prefetch "$arm_cc" arm/kernels_neon_dotprod.c 'prfm' "aarch64" -frename-registers || failed=1

# The Cortex-A76 (dotprod) runs every ISA the build has.  The Cortex-A53
# (no dotprod) adds what only it shows: the default falls back to neon, and
# the neon file runs on a CPU without dotprod (a dotprod instruction there
# would be SIGILL); portable on it would repeat the A76's run.
# The qemu runs take two lanes (a qemu process keeps about one core busy):
# the A76 and A53 runs one after the other, the UBSan run beside them; each
# lane's output is printed whole when it ends.
lanes="$build/arm-lanes"
mkdir -p "$lanes"
(
    status=0
    run "aarch64 -cpu cortex-a76 (expect neon-dotprod)" \
        qemu-aarch64 -cpu cortex-a76 "$exe" --expect-isa neon-dotprod || status=1
    run "aarch64 -cpu cortex-a53 (expect neon; neon against portable only)" \
        qemu-aarch64 -cpu cortex-a53 "$exe" --expect-isa neon --only-isa neon || status=1
    exit "$status"
) >"$lanes/plain.log" 2>&1 &
plain_lane=$!

# UBSan, if this toolchain links it statically (ASan cannot be static).
ubsan="$build/test_kernels_aarch64_ubsan"
probe="$build/ubsan_probe"
ubsan_lane=
printf 'int main(int c, char **v) { (void)v; return c << 1 == 99; }\n' >"$probe.c"
if "$arm_cc" -O1 -static -fsanitize=undefined "$probe.c" -o "$probe" 2>/dev/null &&
   qemu-aarch64 -cpu cortex-a53 "$probe"; then
    # -O2, as the plain run (and the extension) are built: under qemu the
    # run's time is its instruction count: 269 s here against 352 s at -O1.
    build_harness "$arm_cc" aarch64 "$ubsan" "-O2 -static -fsanitize=undefined" -O2 -g -static \
        -fsanitize=undefined -fno-sanitize-recover=all
    # The Arm files on the A76 (portable is the C the native run checks
    # under UBSan, here the reference only); the code is the same on the A53.
    (
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
            run "aarch64 UBSan -cpu cortex-a76 (expect neon-dotprod; neon, neon-dotprod)" \
            qemu-aarch64 -cpu cortex-a76 "$ubsan" --expect-isa neon-dotprod \
            --only-isa neon,neon-dotprod
    ) >"$lanes/ubsan.log" 2>&1 &
    ubsan_lane=$!
else
    echo "== skipping the aarch64 UBSan build: $arm_cc cannot link -fsanitize=undefined statically"
fi
wait "$plain_lane" || failed=1
cat "$lanes/plain.log"
if [[ -n $ubsan_lane ]]; then
    wait "$ubsan_lane" || failed=1
    cat "$lanes/ubsan.log"
fi
exit "$failed"

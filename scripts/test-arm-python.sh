#!/usr/bin/env bash
# The Python test suite inside an emulated arm64 Debian (qemu-user via
# binfmt_misc), once as a Cortex-A76 (NEON + dotprod, the RK3588's big cores)
# and once as a Cortex-A53 (plain NEON), the package built there from this
# checkout.  Timings under emulation mean nothing; the tests are about
# correctness and about which kernels the CPU model gets.
#
#   scripts/test-arm-python.sh [ROOT]     ROOT defaults to /opt/arm64-root
#
# Needs (as root): debootstrap, qemu-user-static, binfmt-support.  Creates the
# root with debootstrap if it does not exist (about 3 minutes, 600 MB).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${1:-/opt/arm64-root}"

. "$repo/scripts/lib/arm64-root.sh"
setup_arm64_root "$root"

echo "== copying the checkout into $root/src/sparse_attn"
. "$repo/scripts/lib/copy-source.sh"
copy_source "$repo" "$root/src/sparse_attn"

echo "== building the extension inside the arm64 root (emulated gcc)"
chroot "$root" /bin/sh -c 'cd /src/sparse_attn && python3 setup.py -q build_ext --inplace' >/dev/null

for cpu in cortex-a76:neon-dotprod cortex-a53:neon; do
    model="${cpu%%:*}" expect="${cpu##*:}"
    echo "== pytest under QEMU_CPU=$model (expect ISA $expect)"
    QEMU_CPU="$model" chroot "$root" /bin/sh -c "cd /src/sparse_attn && \
        python3 -c 'import sparse_attn as sa, sys; print(\"isa:\", sa.isa(), \"available:\", sa.available_isas()); sys.exit(sa.isa() != \"$expect\")' && \
        python3 -m pytest -q -p no:cacheprovider tests"
done

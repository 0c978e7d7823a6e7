# Sourced by the scripts that run Python under arm64 emulation:
# setup_arm64_root ROOT registers qemu-aarch64 with binfmt_misc (so the
# root's binaries run under qemu-user) and debootstraps a minimal arm64
# Debian bookworm with Python, numpy, cffi, pytest and gcc into ROOT if it
# has no python3 yet (about 3 minutes, 600 MB).  Needs root, debootstrap,
# qemu-user-static and binfmt-support.
setup_arm64_root() {
    local root="$1"
    if ! [ -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    if ! [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64
    fi
    if ! [ -x "$root/usr/bin/python3" ]; then
        echo "== debootstrap arm64 bookworm into $root"
        debootstrap --arch=arm64 --variant=minbase \
            --include=python3,python3-numpy,python3-cffi,python3-pytest,python3-ply,python3-dev,python3-setuptools,python3-pip,gcc \
            bookworm "$root" >/dev/null
    fi
}

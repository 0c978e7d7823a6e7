"""cffi builder (out-of-line API mode) for sparse_attn._core.

The C API is the block between the cdef markers of sparse_attn.h; the
sources are every .c file of the core plus the ISA files of the target
architecture.  ISA files select their own instruction set with
``#pragma GCC target`` so that the whole extension builds with one set of
flags and the choice among them is made at run time, never from the
machine that built it.
"""
import os
import re
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = HERE / "sparse_attn.h"

CORE = ["common.c", "cpu_features.c", "q8.c", "threads.c", "attend.c", "decode.c",
        "prefill.c", "bounds.c", "probe_rows.c", "stream.c", "portable/kernels_portable.c"]
ISA_FILES = {
    "x86_64": ["x86/kernels_avx2.c", "x86/kernels_avx512_vnni.c"],
    "aarch64": ["arm/kernels_neon.c", "arm/kernels_neon_dotprod.c"],
}


def target_arch():
    """The architecture being built for (the host's, or a cross target's)."""
    plat = os.environ.get("_PYTHON_HOST_PLATFORM") or sysconfig.get_platform()
    for arch in ISA_FILES:
        if arch in plat or (arch == "aarch64" and "arm64" in plat):
            return arch
    return None


def cdef_text():
    text = HEADER.read_text()
    m = re.search(r"/\* cdef-begin \*/(.*?)/\* cdef-end \*/", text, re.S)
    if not m:
        raise RuntimeError(f"{HEADER}: cdef markers not found")
    return m.group(1)


def sources():
    files = CORE + ISA_FILES.get(target_arch(), [])
    return [str((HERE / f).relative_to(HERE.parent)) for f in files]


def compile_args():
    # fp-contract=off: the arithmetic is exactly what the source says, with no
    # FMA fused in by the compiler in one inlined copy and not in another, so
    # results are the same wherever a kernel is called from.
    args = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-ffp-contract=off"]
    extra = os.environ.get("SPARSE_ATTN_CFLAGS")  # e.g. sanitizers for the memory-safety run
    if extra:
        args += extra.split()
    return args


def link_args():
    args = ["-pthread"]
    extra = os.environ.get("SPARSE_ATTN_LDFLAGS")
    if extra:
        args += extra.split()
    return args


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "sparse_attn._core",
    '#include "sparse_attn.h"',
    sources=sources(),
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=compile_args(),
    extra_link_args=link_args(),
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

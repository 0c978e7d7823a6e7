"""cffi builder (out-of-line API mode) for sparse_attn._core.

The C API is the block between the cdef markers of sparse_attn.h; the
sources are every .c file directly in csrc/ (the ISA-free core) plus the
kernel files that csrc/isa_list.h lists for the target architecture.  ISA
files select their own instruction set with ``#pragma GCC target`` so that
the whole extension builds with one set of flags and the choice among them
is made at run time, never from the machine that built it.
"""
import os
import re
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = HERE / "sparse_attn.h"

ISA_LINE = re.compile(r'^SA_ISA\((\w+), "([^"]+)", (\w+), "([^"]+)"\)$', re.M)


def isa_list():
    """[(id, name, arch, source file)] of csrc/isa_list.h, lowest first."""
    return ISA_LINE.findall((HERE / "isa_list.h").read_text())


def target_arch():
    """The architecture being built for (the host's, or a cross target's)."""
    plat = os.environ.get("_PYTHON_HOST_PLATFORM") or sysconfig.get_platform()
    for arch, names in (("X86_64", ("x86_64",)), ("AARCH64", ("aarch64", "arm64"))):
        if any(n in plat for n in names):
            return arch
    return None


def cdef_text():
    text = HEADER.read_text()
    m = re.search(r"/\* cdef-begin \*/(.*?)/\* cdef-end \*/", text, re.S)
    if not m:
        raise RuntimeError(f"{HEADER}: cdef markers not found")
    return m.group(1)


def sources():
    arch = target_arch()
    core = sorted(p.name for p in HERE.glob("*.c"))
    kernels = [f for _, _, a, f in isa_list() if a in ("ANY", arch)]
    return [str((HERE / f).relative_to(HERE.parent)) for f in core + kernels]


def headers():
    """Every header of the core: a change to one rebuilds the extension
    (setuptools tracks only the .c files otherwise, and the kernel bodies
    live in headers)."""
    return sorted(str(p.relative_to(HERE.parent)) for p in HERE.rglob("*.h"))


def compile_args(arch=None):
    """The compiler flags for a build for arch (X86_64 or AARCH64; default
    target_arch())."""
    # fp-contract=off: the arithmetic is exactly what the source says, with no
    # FMA fused in by the compiler in one inlined copy and not in another, so
    # results are the same wherever a kernel is called from.
    args = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-ffp-contract=off"]
    if (arch or target_arch()) == "AARCH64":
        # Renaming after register allocation: GCC's allocator reuses one
        # register for values the in-order Cortex-A55 could have had in
        # flight together, and the vector moves it adds wait out the latency
        # of what they copy; renamed, the scheduler interleaves them.  By the
        # static model (bench/arm_model.py) the A55's plain NEON q8 decode
        # took 0.89-0.96x its cycles, neon-dotprod 0.91-1.02x, q8 prefill
        # 0.92-0.98x (docs/design.md).
        args.append("-frename-registers")
    extra = os.environ.get("SPARSE_ATTN_CFLAGS")  # e.g. sanitizers for the memory-safety run
    if extra:
        args += extra.split()
    # recorded in the core, for `sparse-attn info` (sa_build_info)
    return args + ['-DSA_BUILD_FLAGS="%s"' % " ".join(args).replace('"', "'")]


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
    depends=headers(),
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    extra_compile_args=compile_args(),
    extra_link_args=link_args(),
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

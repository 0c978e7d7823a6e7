"""Which kernel path runs (the C core picks the best one this CPU can run at
import; these name it and switch it, process-wide), and how many threads a
call uses by default (``default_threads()``: ``SPARSE_ATTN_NUM_THREADS`` or
the cores this process may run on)."""
from ._checks import default_threads
from .errors import ArgumentError, ArgumentTypeError
from ._ffi import ffi, lib


__all__ = ["isa", "built_isas", "available_isas", "set_isa", "default_threads"]


def isa():
    """The name of the kernel path in use: ``"portable"``, ``"avx2"``,
    ``"avx512-vnni"``, ``"avx512-amx"`` (avx512-vnni with prefill's q8 scores
    on AMX tiles), ``"neon"`` or ``"neon-dotprod"``."""
    return ffi.string(lib.sa_isa_name()).decode()


def built_isas():
    """Every kernel path built into this extension, lowest first."""
    return [ffi.string(lib.sa_isa_name_at(i)).decode() for i in range(lib.sa_isa_count())]


def available_isas():
    """The paths this CPU can run, lowest first."""
    return [name for name in built_isas() if lib.sa_isa_available(name.encode())]


def set_isa(name):
    """Use the kernel path `name` from now on (process-wide).  Raises
    ValueError for a path that is not built or that this CPU cannot run."""
    if not isinstance(name, str):
        raise ArgumentTypeError(f"ISA name must be a str, got {type(name).__name__}")
    if name not in built_isas():
        raise ArgumentError(f"unknown ISA {name!r}; this build has {built_isas()}")
    if lib.sa_set_isa(name.encode()) != lib.SA_OK:
        raise ArgumentError(f"this CPU cannot run ISA {name!r}; it can run {available_isas()}")

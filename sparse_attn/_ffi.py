"""The one module that imports the compiled core: pointers to arrays, and C
statuses turned into exceptions that name the argument."""
from .errors import ArgumentError, KernelError

try:
    from ._core import ffi, lib
except ImportError:   # pragma: no cover - exercised from a source tree
    import os as _os
    _here = _os.path.dirname(_os.path.abspath(__file__))
    # sparse_attn/ of a checkout: the repository root is one level up
    if _os.path.exists(_os.path.join(_os.path.dirname(_here), "csrc", "build_ffi.py")):
        raise ImportError(
            f"you are importing sparse_attn from its source folder ({_here}), which has no "
            "built C core: run `pip install -e .` there, or leave the folder to import the "
            "installed package"
        ) from None
    raise

# The magnitude the C core refuses in the values it scans (sparse_attn.h).
VALUE_LIMIT_LOG2 = lib.SA_VALUE_LIMIT_LOG2
_VALUES = f"holds NaN or Inf values, or magnitudes of 2**{VALUE_LIMIT_LOG2} or more"

# Statuses that come from a scan of one argument's values: the argument's
# default name and what was wrong with it.
_VALUE_STATUSES = {
    lib.SA_ERR_VALUES: ("x", _VALUES),
    lib.SA_ERR_Q_VALUES: ("q", _VALUES),
    lib.SA_ERR_K_VALUES: ("k", _VALUES),
    lib.SA_ERR_V_VALUES: ("v", _VALUES),
    lib.SA_ERR_IMPORTANCE_VALUES: ("importance", "holds NaN or Inf values"),
}


def ptr(a, ctype):
    """A read-only cffi pointer to a's data.  Whole contiguous arrays go
    through ffi.from_buffer; a view with a head stride (a KVCache's rows) is
    not one buffer, so it is passed by address, `a` being kept alive by the
    caller for the duration of the call."""
    if a.flags.c_contiguous:
        return ffi.from_buffer(ctype + "[]", a, require_writable=False)
    return ffi.cast(ctype + " *", a.ctypes.data)


def out_ptr(a, ctype):
    """A writable pointer to an output array (checked C-contiguous and
    writable by _checks.check_output, or made by this package)."""
    return ffi.from_buffer(ctype + "[]", a, require_writable=True)


def check(rc, what, names=None):
    """Raise for a failing status: ArgumentError naming the argument for the
    value scans (`names` maps a status to the caller's name for it), else
    KernelError with the core's text."""
    if rc == lib.SA_OK:
        return
    if rc in _VALUE_STATUSES:
        arg, text = _VALUE_STATUSES[rc]
        raise ArgumentError(f"{(names or {}).get(rc, arg)} {text}")
    msg = ffi.string(lib.sa_strerror(rc)).decode()
    raise KernelError(f"{what}: the C core refused the call: {msg} (status {rc})")

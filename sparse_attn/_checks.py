"""Argument validation: types, shapes, layouts and ranges, checked before any
C code runs; every message names the argument and shows what was expected
and what came.  The O(n) scans of values (NaN, Inf, magnitudes) are not
here: the C core makes them once per call, first thing, and _ffi turns its
status into the same kind of error."""
import functools
import math
import numbers
import os

import numpy as np

from . import cores
from .errors import ArgumentError, ArgumentTypeError

# The C core takes sizes and counts as C ints.
INT_MAX = 2**31 - 1


def check_int(name, value, *, minimum=None, maximum=INT_MAX):
    """An int (numpy integers too, never a bool) in [minimum, maximum]; the
    default maximum is what a C int holds."""
    if type(value) is not int and (isinstance(value, (bool, np.bool_)) or
                                   not isinstance(value, numbers.Integral)):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    return _in_range(name, int(value), minimum, maximum)


def _in_range(name, value, minimum, maximum):
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_float(name, value, *, minimum=None, maximum=None, positive=False):
    if type(value) not in (float, int) and (isinstance(value, (bool, np.bool_)) or
                                            not isinstance(value, numbers.Real)):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ArgumentError(f"{name} must be > 0, got {value}")
    return _in_range(name, value, minimum, maximum)


def check_float32(name, value):
    """A real number > 0 that stays finite and > 0 as the float32 the kernels
    compute with (1e300 would be Inf, 1e-300 zero)."""
    if type(value) is float and 1e-37 < value < 1e37:    # the common case, cheaply
        return value
    value = check_float(name, value, positive=True)
    with np.errstate(over="ignore"):
        as32 = np.float32(value) if value <= 3.5e38 else np.float32(np.inf)
    if not (np.isfinite(as32) and as32 > 0):
        raise ArgumentError(f"{name} must be a float32 number: finite and > 0 as float32 "
                            f"(between {np.finfo(np.float32).tiny:.3g} and "
                            f"{np.finfo(np.float32).max:.3g}), got {value!r}")
    return float(as32)


def check_choice(name, value, choices):
    """One of the strings in `choices` (anything else, unhashable values
    included, gets a message naming the argument)."""
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def _check_ndarray(name, a, dtype, ndim, allow_empty=False):
    dtype = np.dtype(dtype)
    if not isinstance(a, np.ndarray):
        raise ArgumentTypeError(
            f"{name} must be a numpy.ndarray of {dtype.name}, got {type(a).__name__}")
    if a.dtype != dtype:
        if a.dtype.kind == dtype.kind and a.dtype.itemsize == dtype.itemsize:
            raise ArgumentTypeError(
                f"{name} must be native-endian {dtype.name}, got {a.dtype.str}"
                f" (convert with {name}.astype(numpy.{dtype.name}))")
        raise ArgumentTypeError(
            f"{name} must have dtype {dtype.name}, got {a.dtype.name}"
            f" (convert with {name}.astype(numpy.{dtype.name}))")
    if ndim is not None and a.ndim != ndim:
        raise ArgumentError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if 0 in a.shape and not allow_empty:
        raise ArgumentError(f"{name} is empty: axis {a.shape.index(0)} of its shape "
                            f"{a.shape} has length 0")


def check_array(name, a, *, dtype, ndim=None, contiguous=True):
    """A numpy array of exactly `dtype` (native byte order, no silent
    casts), non-empty, aligned, and by default C-contiguous: for arrays the
    kernels read in place (K, V) or write (outputs)."""
    _check_ndarray(name, a, dtype, ndim)
    if contiguous and not a.flags.c_contiguous:
        raise ArgumentError(
            f"{name} must be C-contiguous (use numpy.ascontiguousarray({name}))")
    if not a.flags.aligned:           # data address a multiple of the dtype's alignment
        raise ArgumentError(
            f"{name} is misaligned: its data address is not a multiple of "
            f"{a.dtype.alignment} bytes (copy it with {name}.copy())")
    return a


def as_array(name, a, *, dtype, ndim=None, allow_empty=False):
    """Like check_array, for small inputs a call copies anyway or can afford
    to (q, importance, appended rows): any strides, any alignment; returns
    a C-contiguous aligned array (the same one when it already is)."""
    _check_ndarray(name, a, dtype, ndim, allow_empty)
    if a.flags.c_contiguous and a.flags.aligned:
        return a
    # a fresh array: ascontiguousarray would hand back a contiguous but
    # misaligned one unchanged
    return np.array(a, dtype=dtype, order="C", copy=True)


def check_output(name, a, *, dtype, shape):
    """An output array the kernels write: dtype, shape, C-contiguous and
    writable (a read-only memmap or a view of bytes is refused, not
    written through)."""
    check_array(name, a, dtype=dtype)
    if a.shape != tuple(shape):
        raise ArgumentError(f"{name} must have shape {tuple(shape)}, got {a.shape}")
    if not a.flags.writeable:
        raise ArgumentError(f"{name} is read-only (flags.writeable is False): pass a "
                            f"writable array")
    return a


def default_threads():
    cores.worker_placement()
    env = os.environ.get("SPARSE_ATTN_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ArgumentError(
                f"SPARSE_ATTN_NUM_THREADS must be a positive integer, got {env!r}") from None
        if not 1 <= n <= INT_MAX:
            raise ArgumentError(f"SPARSE_ATTN_NUM_THREADS must be in [1, {INT_MAX}], got {n}")
        return n
    return _usable_cores()


@functools.lru_cache(maxsize=None)
def _usable_cores():
    """The cores the default thread count covers, read once (it sits on every
    call's path): those this process may run on, only the fast ones of a
    big.LITTLE CPU (cores.py); at least one."""
    return max(1, len(cores.default_cores()))


def check_threads(threads):
    """A call's thread count.  Either way the workers are first kept on the
    fast cores of a big.LITTLE CPU (cores.worker_placement, once), however
    the count is chosen."""
    if threads is None:
        return default_threads()
    cores.worker_placement()
    return check_int("threads", threads, minimum=1)

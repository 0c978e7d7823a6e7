"""Argument validation: every check runs before any C code, and every message
names the argument and shows what was expected and what came."""
import functools
import math
import numbers
import os

import numpy as np


class SparseAttnError(Exception):
    """Base class of every error this package raises."""


class ArgumentError(SparseAttnError, ValueError):
    """An argument has the right type but a wrong value, shape or layout."""


class ArgumentTypeError(SparseAttnError, TypeError):
    """An argument has the wrong type or dtype."""


class KernelError(SparseAttnError, RuntimeError):
    """The C core reported a failure the Python checks did not foresee."""


def check_int(name, value, *, minimum=None, maximum=None):
    if type(value) is not int and (isinstance(value, bool) or
                                   not isinstance(value, numbers.Integral)):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
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
    if type(value) not in (float, int) and (isinstance(value, bool) or
                                            not isinstance(value, numbers.Real)):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ArgumentError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_array(name, a, *, dtype, ndim=None, contiguous=True, finite=False):
    """A numpy array of exactly `dtype` (no silent casts), aligned, and by
    default C-contiguous."""
    if not isinstance(a, np.ndarray):
        raise ArgumentTypeError(
            f"{name} must be a numpy.ndarray of {np.dtype(dtype).name}, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ArgumentTypeError(
            f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype.name}"
            f" (convert with {name}.astype(numpy.{np.dtype(dtype).name}))")
    if ndim is not None and a.ndim != ndim:
        raise ArgumentError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if contiguous and not a.flags.c_contiguous:
        raise ArgumentError(
            f"{name} must be C-contiguous (use numpy.ascontiguousarray({name}))")
    if not a.flags.aligned:           # data address a multiple of the dtype's alignment
        raise ArgumentError(
            f"{name} is misaligned: its data address is not a multiple of "
            f"{a.dtype.alignment} bytes (copy it with {name}.copy())")
    if finite and not np.isfinite(a).all():
        raise ArgumentError(f"{name} holds NaN or Inf values")
    return a


def default_threads():
    env = os.environ.get("SPARSE_ATTN_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ArgumentError(
                f"SPARSE_ATTN_NUM_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ArgumentError(f"SPARSE_ATTN_NUM_THREADS must be >= 1, got {n}")
        return n
    return _usable_cores()


@functools.lru_cache(maxsize=None)
def _usable_cores():
    """The cores this process may run on, read once (it sits on every call's path)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_threads(threads):
    if threads is None:
        return default_threads()
    return check_int("threads", threads, minimum=1)


def importance_blocks(importance_fraction, k_blocks):
    """The importance reserve of SPEC §6: ceil(importance_fraction * k_blocks),
    with the product rounded to 9 decimals first so that 0.3 * 10 reserves 3
    blocks, not 4."""
    return int(math.ceil(round(importance_fraction * k_blocks, 9)))


def check_n_probe(n_probe, block_size):
    """n_probe as the int the C core takes: an int >= 1, or "all" (every row
    of a block: block_size)."""
    if n_probe == "all":
        return block_size
    if isinstance(n_probe, str):
        raise ArgumentError(f"n_probe must be an int >= 1 or 'all', got {n_probe!r}")
    return check_int("n_probe", n_probe, minimum=1)

"""q8 tensors (docs/spec.md §4): int8 values with one float32 scale per group
of consecutive channels, and the quantiser that makes them."""
import numpy as np

from . import _checks as ck
from . import _ffi
from .errors import ArgumentError
from ._ffi import lib

# The largest dequantised magnitude a q8 tensor may hold (127 * scale), as
# the C core's value limit for the float arrays it scans.
_SCALE_LIMIT = 2.0 ** _ffi.VALUE_LIMIT_LOG2 / 127


def _read_only(a):
    """A read-only view of `a` (the caller's own array stays as it was)."""
    view = a.view()
    view.flags.writeable = False
    return view


class Q8:
    """A q8 tensor (spec §4): int8 values and one float32 scale per
    `group_size` consecutive elements of the last axis.

    Immutable: ``data``, ``scales`` and ``group_size`` are read-only
    properties over read-only views, checked once at construction (dtypes,
    shapes, values in [-127, 127], finite scales whose dequantised values
    stay below 2**48), so every later use can trust them.

    Attributes
    ----------
    data : numpy.ndarray, int8, shape ``(..., D)``
    scales : numpy.ndarray, float32, shape ``(..., D // group_size)``
    group_size : int
    """

    __slots__ = ("_data", "_scales", "_group_size", "_op")

    def __init__(self, data, scales, group_size):
        group_size = ck.check_int("group_size", group_size, minimum=1)
        ck.check_array("Q8.data", data, dtype=np.int8, contiguous=False)
        ck.check_array("Q8.scales", scales, dtype=np.float32, contiguous=False)
        if data.shape[-1] % group_size:
            raise ArgumentError(
                f"group_size ({group_size}) must divide the last axis of Q8.data "
                f"(shape {data.shape})")
        want = data.shape[:-1] + (data.shape[-1] // group_size,)
        if scales.shape != want:
            raise ArgumentError(
                f"Q8.scales must have shape {want} for data of shape {data.shape} and "
                f"group_size {group_size}, got {scales.shape}")
        # Spec §4 clamps to [-127, 127]; the x86 kernels' unsigned x signed
        # dot relies on it (-128 has no positive twin).
        if data.min() < -127:
            raise ArgumentError("Q8.data holds -128: q8 values are in [-127, 127] (spec §4); "
                                "quantise with sparse_attn.quantize_q8")
        if not np.isfinite(scales).all():
            raise ArgumentError("Q8.scales holds NaN or Inf values")
        if np.abs(scales).max() >= _SCALE_LIMIT:
            raise ArgumentError(
                f"Q8.scales holds scales of {_SCALE_LIMIT:.4g} or more: dequantised values "
                f"would reach 2**{_ffi.VALUE_LIMIT_LOG2}, where scores can overflow float32")
        self._set(_read_only(data), _read_only(scales), group_size)

    def _set(self, data, scales, group_size):
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_scales", scales)
        object.__setattr__(self, "_group_size", group_size)
        object.__setattr__(self, "_op", None)

    @classmethod
    def _wrap(cls, data, scales, group_size):
        """A Q8 over arrays this package made (quantize_q8, KVCache views):
        already known to hold valid values, so not scanned again."""
        self = cls.__new__(cls)
        self._set(_read_only(data), _read_only(scales), group_size)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Q8 is immutable: make a new Q8 instead of setting {name!r}")

    data = property(lambda self: self._data, doc="int8 values, shape ``(..., D)`` (read-only)")
    scales = property(lambda self: self._scales,
                      doc="float32 scales, shape ``(..., D // group_size)`` (read-only)")
    group_size = property(lambda self: self._group_size, doc="channels per scale")

    @property
    def shape(self):
        return self._data.shape

    @property
    def nbytes(self):
        return self._data.nbytes + self._scales.nbytes

    def dequantize(self):
        """float32 values ``scale * q``, shape ``data.shape``."""
        g = self._group_size
        d = self._data.astype(np.float32).reshape(self._data.shape[:-1] + (-1, g))
        return (d * self._scales[..., None]).reshape(self._data.shape)

    def __repr__(self):
        return f"Q8(shape={self.shape}, group_size={self.group_size})"


def quantize_q8(x, group_size=32):
    """Quantise float32 values to q8 (spec §4), the ggml ``q8_0`` recipe.

    Per group of ``group_size`` consecutive elements of the last axis:
    ``d = amax / 127``, ``q = round(x / d)`` (ties away from zero), clamped to
    [-127, 127]; an all-zero group gets ``d = 0`` and zeros, and a group
    too small for ``1 / d`` to be finite (amax below about 3.7e-37) gets its
    ``d`` and zeros.

    Parameters
    ----------
    x : numpy.ndarray, float32, shape ``(..., D)`` (any strides: copied when
        not C-contiguous); finite, magnitudes below 2**48
    group_size : int, default 32; must divide D

    Returns
    -------
    Q8 with ``data`` int8 ``(..., D)`` and ``scales`` float32 ``(..., D // group_size)``.

    Examples
    --------
    >>> import numpy as np, sparse_attn
    >>> x = np.array([[0.5, -1.0, 0.25, 0.0]], dtype=np.float32)
    >>> q = sparse_attn.quantize_q8(x, group_size=4)
    >>> q.data.tolist(), q.scales.tolist()
    ([[64, -127, 32, 0]], [[0.007874015718698502]])
    """
    group_size = ck.check_int("group_size", group_size, minimum=1)
    if isinstance(x, np.ndarray) and x.ndim == 0:
        raise ArgumentError("x must have at least one axis, got a 0-d array")
    x = ck.as_array("x", x, dtype=np.float32, allow_empty=True)
    dim = x.shape[-1]
    if dim == 0:
        raise ArgumentError(f"x must have a non-empty last axis, got shape {x.shape}")
    if dim % group_size:
        raise ArgumentError(f"group_size ({group_size}) must divide the last axis of x ({dim})")
    ck.check_int("the last axis of x", dim)
    data = np.empty(x.shape, np.int8)
    scales = np.empty(x.shape[:-1] + (dim // group_size,), np.float32)
    if x.size == 0:
        return Q8._wrap(data, scales, group_size)
    rc = lib.sa_quantize_q8(_ffi.ptr(x, "float"), x.size // dim, dim, group_size,
                            _ffi.out_ptr(data, "int8_t"), _ffi.out_ptr(scales, "float"))
    _ffi.check(rc, "quantize_q8")
    return Q8._wrap(data, scales, group_size)



"""The public functions: validate in Python, then one call into the C core.

Shape legend used in every docstring:

    H    query heads            Hkv  KV heads (H % Hkv == 0; head h reads KV head h // (H // Hkv))
    D    head_dim               S    rows of the KV (the valid ones are the first seq_len)
    T    query tokens (prefill) NB   blocks = ceil(seq_len / block_size)
    BS   block_size             K    chosen blocks per head = min(k_blocks, NB)
    G    q8 group_size
"""
import functools
import math

import numpy as np

from . import _checks as ck
from ._core import ffi, lib
from ._checks import ArgumentError, ArgumentTypeError, KernelError

SHARES = {"head": lib.SA_SHARE_HEAD, "group": lib.SA_SHARE_GROUP}


def _raise_for(rc, what):
    if rc != lib.SA_OK:
        msg = ffi.string(lib.sa_strerror(rc)).decode()
        raise KernelError(f"{what}: the C core refused the call: {msg} (status {rc})")


def _ptr(a, ctype):
    """A cffi pointer to a's data.  Whole contiguous arrays go through
    ffi.from_buffer; a KV view with a head stride (a KVCache's rows) is not
    one buffer, so it is passed by address, `a` being kept alive by the caller
    for the duration of the call."""
    if a.flags.c_contiguous:
        return ffi.from_buffer(ctype + "[]", a, require_writable=False)
    return ffi.cast(ctype + " *", a.ctypes.data)


# --------------------------------------------------------------------------- q8

class Q8:
    """A q8 tensor (SPEC §4): int8 values and one float32 scale per
    `group_size` consecutive elements of the last axis.

    Attributes
    ----------
    data : numpy.ndarray, int8, shape ``(..., D)``
    scales : numpy.ndarray, float32, shape ``(..., D // group_size)``
    group_size : int
    """

    __slots__ = ("data", "scales", "group_size", "_op")

    def __init__(self, data, scales, group_size):
        group_size = ck.check_int("group_size", group_size, minimum=1)
        ck.check_array("Q8.data", data, dtype=np.int8, contiguous=False)
        ck.check_array("Q8.scales", scales, dtype=np.float32, contiguous=False)
        if data.ndim < 1 or data.shape[-1] % group_size:
            raise ArgumentError(
                f"group_size ({group_size}) must divide the last axis of Q8.data "
                f"(shape {data.shape})")
        want = data.shape[:-1] + (data.shape[-1] // group_size,)
        if scales.shape != want:
            raise ArgumentError(
                f"Q8.scales must have shape {want} for data of shape {data.shape} and "
                f"group_size {group_size}, got {scales.shape}")
        # SPEC §4 clamps to [-127, 127]; the x86 kernels' unsigned x signed
        # dot relies on it (-128 has no positive twin).
        if data.size and data.min() < -127:
            raise ArgumentError("Q8.data holds -128: q8 values are in [-127, 127] (SPEC §4); "
                                "quantise with sparse_attn.quantize_q8")
        if not np.isfinite(scales).all():
            raise ArgumentError("Q8.scales holds NaN or Inf values")
        self.data, self.scales, self.group_size = data, scales, group_size
        self._op = None

    @classmethod
    def _wrap(cls, data, scales, group_size):
        """A Q8 over arrays this package made (quantize_q8, KVCache views):
        already known to hold valid values, so not scanned again."""
        self = cls.__new__(cls)
        self.data, self.scales, self.group_size = data, scales, group_size
        self._op = None
        return self

    @property
    def shape(self):
        return self.data.shape

    @property
    def nbytes(self):
        return self.data.nbytes + self.scales.nbytes

    def dequantize(self):
        """float32 values ``scale * q``, shape ``data.shape``."""
        g = self.group_size
        d = self.data.astype(np.float32).reshape(self.data.shape[:-1] + (-1, g))
        return (d * self.scales[..., None]).reshape(self.data.shape)

    def __repr__(self):
        return f"Q8(shape={self.shape}, group_size={self.group_size})"


def quantize_q8(x, group_size=32):
    """Quantise float32 values to q8 (SPEC §4), the ggml ``q8_0`` recipe.

    Per group of ``group_size`` consecutive elements of the last axis:
    ``d = amax / 127``, ``q = round(x / d)`` (ties away from zero), clamped to
    [-127, 127]; an all-zero group gets ``d = 0`` and zeros.

    Parameters
    ----------
    x : numpy.ndarray, float32, shape ``(..., D)``, C-contiguous, finite
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
    ck.check_array("x", x, dtype=np.float32, finite=True)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ArgumentError(f"x must have a non-empty last axis, got shape {x.shape}")
    dim = x.shape[-1]
    if dim % group_size:
        raise ArgumentError(f"group_size ({group_size}) must divide the last axis of x ({dim})")
    data = np.empty(x.shape, np.int8)
    scales = np.empty(x.shape[:-1] + (dim // group_size,), np.float32)
    rows = x.size // dim
    rc = lib.sa_quantize_q8(_ptr(x, "float"), rows, dim, group_size,
                            ffi.from_buffer("int8_t[]", data), ffi.from_buffer("float[]", scales))
    _raise_for(rc, "quantize_q8")
    return Q8._wrap(data, scales, group_size)


# --------------------------------------------------------------------------- KV views

class _KV:
    """A validated K or V operand and the sa_kv struct describing it."""

    __slots__ = ("struct", "keep", "n_kv_heads", "rows", "head_dim", "dtype", "group_size")


def _head_stride(name, a, rows, dim):
    """Rows between two KV heads of a [Hkv, S, D] array whose rows are
    contiguous (a whole array, or the valid rows of a larger one)."""
    item = a.dtype.itemsize
    if a.strides[2] != item or (rows > 1 and a.strides[1] != dim * item):
        raise ArgumentError(
            f"{name} must have contiguous rows of head_dim elements (C order within a head),"
            f" got strides {a.strides} for shape {a.shape}")
    if a.shape[0] == 1:
        return rows
    if a.strides[0] % (dim * item) or a.strides[0] < rows * dim * item:
        raise ArgumentError(
            f"{name}: the head axis stride ({a.strides[0]} bytes) must be a whole number of"
            f" rows and at least {rows} rows; pass a C-contiguous array")
    return a.strides[0] // (dim * item)


def kv_operand(name, kv):
    """Validate a K/V argument (float32 ndarray or Q8, shape [Hkv, S, D]).
    A Q8 keeps its validated operand for the next call, as long as its
    arrays and group size are the ones it was made from."""
    if isinstance(kv, Q8):
        cached = kv._op
        if cached is not None and cached.keep[0] is kv.data and cached.keep[1] is kv.scales \
                and cached.group_size == kv.group_size:
            return cached
        kv._op = op = _kv_operand(name, kv)
        return op
    return _kv_operand(name, kv)


def _kv_operand(name, kv):
    op = _KV()
    if isinstance(kv, Q8):
        data, scales = kv.data, kv.scales
        if data.ndim != 3:
            raise ArgumentError(f"{name} must have shape [n_kv_heads, seq, head_dim], "
                                f"got {name}.data of shape {data.shape}")
        hkv, rows, dim = data.shape
        stride = _head_stride(f"{name}.data", data, rows, dim)
        s_stride = _head_stride(f"{name}.scales", scales, rows, dim // kv.group_size)
        if hkv > 1 and s_stride != stride:
            raise ArgumentError(f"{name}.data and {name}.scales must share one row layout "
                                f"(head strides of {stride} and {s_stride} rows)")
        op.dtype, op.group_size = "q8", kv.group_size
        op.keep = (data, scales)
        op.struct = ffi.new("sa_kv *", {
            "dtype": lib.SA_DTYPE_Q8, "n_kv_heads": hkv, "head_stride": stride,
            "n_rows": rows, "head_dim": dim, "group_size": kv.group_size,
            "q8": _ptr(data, "int8_t"), "scales": _ptr(scales, "float")})
    elif isinstance(kv, np.ndarray):
        ck.check_array(name, kv, dtype=np.float32, ndim=3, contiguous=False)
        hkv, rows, dim = kv.shape
        stride = _head_stride(name, kv, rows, dim)
        op.dtype, op.group_size = "float32", None
        op.keep = (kv,)
        op.struct = ffi.new("sa_kv *", {
            "dtype": lib.SA_DTYPE_F32, "n_kv_heads": hkv, "head_stride": stride,
            "n_rows": rows, "head_dim": dim, "group_size": 0, "f32": _ptr(kv, "float")})
    else:
        raise ArgumentTypeError(
            f"{name} must be a float32 numpy.ndarray or a Q8, got {type(kv).__name__}")
    if min(hkv, rows, dim) < 1:
        raise ArgumentError(f"{name} must have non-empty dimensions, got shape {(hkv, rows, dim)}")
    op.n_kv_heads, op.rows, op.head_dim = hkv, rows, dim
    return op


def _check_pair(k, v):
    if k.dtype != v.dtype:
        raise ArgumentTypeError(f"k and v must have the same dtype, got {k.dtype} and {v.dtype}")
    if (k.n_kv_heads, k.head_dim) != (v.n_kv_heads, v.head_dim):
        raise ArgumentError(
            f"k and v must agree in n_kv_heads and head_dim, got k [{k.n_kv_heads}, "
            f"{k.rows}, {k.head_dim}] and v [{v.n_kv_heads}, {v.rows}, {v.head_dim}]")
    if k.group_size != v.group_size:
        raise ArgumentError(f"k and v must share one q8 group_size, got {k.group_size} "
                            f"and {v.group_size}")


def _check_query(q, k, ndim):
    shape = "[n_heads, head_dim]" if ndim == 2 else "[n_heads, T, head_dim]"
    ck.check_array("q", q, dtype=np.float32, ndim=ndim)
    if q.shape[-1] != k.head_dim:
        raise ArgumentError(f"q must have shape {shape} with head_dim {k.head_dim} "
                            f"(from k), got {q.shape}")
    if min(q.shape) < 1:
        raise ArgumentError(f"q must have non-empty dimensions, got shape {q.shape}")
    n_heads = q.shape[0]
    if n_heads % k.n_kv_heads:
        raise ArgumentError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads "
                            f"({k.n_kv_heads})")
    if not np.isfinite(q).all():
        raise ArgumentError("q holds NaN or Inf values")
    return n_heads


def _check_seq_len(seq_len, *kvs):
    rows = min(kv.rows for kv in kvs)
    if seq_len is None:
        return rows
    seq_len = ck.check_int("seq_len", seq_len, minimum=1)
    if seq_len > rows:
        raise ArgumentError(f"seq_len ({seq_len}) is beyond the KV, which holds {rows} rows")
    return seq_len


def _check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return ck.check_float("scale", scale, positive=True)


def _check_importance(importance, seq_len):
    if importance is None:
        return None
    ck.check_array("importance", importance, dtype=np.float32, ndim=1, finite=False)
    if importance.shape[0] < seq_len:
        raise ArgumentError(f"importance has {importance.shape[0]} entries, shorter than "
                            f"seq_len ({seq_len})")
    if not np.isfinite(importance[:seq_len]).all():
        raise ArgumentError("importance holds NaN or Inf values")
    return importance


class BlockBounds:
    """Per-block, per-channel key bounds for ``scoring="minmax"`` (SPEC §6).

    For block ``b`` of KV head ``kh`` and channel ``i``,
    ``scales[kh, b, i // group_size] * mn[kh, b, i] <= K[kh, t, i] <=
    scales[kh, b, i // group_size] * mx[kh, b, i]`` over the block's valid
    rows ``t`` (the dequantised keys for q8 K): int8 values with one float32
    scale per channel group, rounded outwards so the bound is a true bound.

    Attributes
    ----------
    mn, mx : int8 ``[Hkv, NB, D]``
    scales : float32 ``[Hkv, NB, D // group_size]``
    block_size, group_size : int
    n_rows : int, the rows of K the bounds cover (the ``seq_len`` they serve)
    """

    __slots__ = ("mn", "mx", "scales", "block_size", "group_size", "n_rows", "_st", "_key")

    def __init__(self, mn, mx, scales, block_size, group_size, n_rows):
        self.mn, self.mx, self.scales = mn, mx, scales
        self.block_size, self.group_size, self.n_rows = block_size, group_size, n_rows
        self._st = self._key = None

    @property
    def nbytes(self):
        return self.mn.nbytes + self.mx.nbytes + self.scales.nbytes

    def struct(self):
        """The sa_bounds the C core reads (the arrays must stay alive); kept
        for the next call while the arrays and sizes stay the same."""
        key = (self.mn, self.mx, self.scales, self.block_size, self.group_size)
        if self._key is not None and all(a is b for a, b in zip(key[:3], self._key[:3])) \
                and key[3:] == self._key[3:]:
            self._st.n_rows = self.n_rows
            return self._st
        self._st, self._key = self._make_struct(), key
        return self._st

    def _make_struct(self):
        for name, dtype in (("mn", np.int8), ("mx", np.int8), ("scales", np.float32)):
            a = ck.check_array(f"bounds.{name}", getattr(self, name), dtype=dtype, ndim=3,
                               contiguous=False)
            if a.strides[-1] != a.itemsize or a.strides[-2] != a.shape[-1] * a.itemsize:
                raise ArgumentError(f"bounds.{name} must have contiguous block rows")
        hkv, nb, dim = self.mn.shape
        if (self.mx.shape != self.mn.shape or dim % self.group_size or
                self.scales.shape != (hkv, nb, dim // self.group_size) or
                self.mx.strides != self.mn.strides or
                self.scales.strides[0] * self.group_size != self.mn.strides[0] * 4):
            raise ArgumentError("bounds.mn, .mx and .scales do not describe one layout")
        stride = self.mn.strides[0] // dim if hkv > 1 else max(self.mn.shape[1], 1)
        return ffi.new("sa_bounds *", {
            "n_kv_heads": hkv, "head_dim": dim, "block_size": self.block_size,
            "group_size": self.group_size, "head_stride": stride, "n_rows": self.n_rows,
            "mn": ffi.cast("int8_t *", self.mn.ctypes.data),
            "mx": ffi.cast("int8_t *", self.mx.ctypes.data),
            "scales": ffi.cast("float *", self.scales.ctypes.data)})

    def __repr__(self):
        return (f"BlockBounds(n_kv_heads={self.mn.shape[0]}, blocks={self.mn.shape[1]}, "
                f"head_dim={self.mn.shape[2]}, block_size={self.block_size}, "
                f"n_rows={self.n_rows})")


def default_bounds_group(kv_group_size, head_dim):
    """The q8 group for q8 K; for float32 K, 32 channels if that divides
    head_dim, else one group per row."""
    if kv_group_size:
        return kv_group_size
    return 32 if head_dim % 32 == 0 else head_dim


def empty_bounds(n_kv_heads, n_blocks, head_dim, block_size, group_size):
    return BlockBounds(np.zeros((n_kv_heads, n_blocks, head_dim), np.int8),
                       np.zeros((n_kv_heads, n_blocks, head_dim), np.int8),
                       np.zeros((n_kv_heads, n_blocks, head_dim // group_size), np.float32),
                       block_size, group_size, 0)


def block_bounds(k, *, block_size=32, seq_len=None, group_size=None):
    """Compute the :class:`BlockBounds` of K's first ``seq_len`` rows.

    This reads all of K once; a :class:`KVCache` keeps its bounds up to date
    as tokens are appended instead (``cache.bounds``).

    Parameters
    ----------
    k : float32 ``[Hkv, S, D]`` or Q8
    block_size : int, default 32
    seq_len : int, default ``S``
    group_size : int, default: K's q8 group, or 32 for float32 K (head_dim if
        32 does not divide it); channels sharing one bound scale

    Returns
    -------
    BlockBounds with ``NB = ceil(seq_len / block_size)`` blocks.
    """
    kop = kv_operand("k", k)
    seq_len = _check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    if group_size is None:
        group_size = default_bounds_group(kop.group_size, kop.head_dim)
    group_size = ck.check_int("group_size", group_size, minimum=1)
    if kop.head_dim % group_size:
        raise ArgumentError(f"group_size ({group_size}) must divide head_dim ({kop.head_dim})")
    b = empty_bounds(kop.n_kv_heads, -(-seq_len // block_size), kop.head_dim, block_size,
                     group_size)
    st = b.struct()
    _raise_for(lib.sa_bounds_update(kop.struct, 0, seq_len, st), "block_bounds")
    b.n_rows = seq_len
    return b


def probe_geometry(block_size, n_probe):
    """(rows kept per full block, step between them) of the probe (SPEC §2.2)."""
    step = max(1, block_size // n_probe)
    return -(-block_size // step), step


class ProbeRows:
    """Copies of the rows the probe samples (SPEC §2.2), for ``scoring="probe"``.

    With ``step = max(1, block_size // n_probe)``, each full block ``b`` of K
    keeps ``cnt = ceil(block_size / step)`` rows, K rows ``b*block_size +
    j*step`` at copy rows ``b*cnt + j``.  The probe then reads these copies
    front to back instead of every ``step``-th row of K, which on real
    hardware costs about a full read of K (the prefetchers fetch the rows in
    between).  The copies are byte copies, so scores, selections and outputs
    are bitwise those computed from K.  They cost ``cnt / block_size`` of
    K's memory (a quarter with the defaults).  The last, partial block of a
    context is probed from K.

    Attributes
    ----------
    rows : float32 ``[Hkv, R, D]`` or Q8, in K's dtype (and q8 group)
    block_size, n_probe : int
    n_rows : int, the rows of K the copies are current for
    """

    __slots__ = ("rows", "block_size", "n_probe", "n_rows", "_st", "_key")

    def __init__(self, rows, block_size, n_probe, n_rows):
        self.rows, self.block_size, self.n_probe, self.n_rows = rows, block_size, n_probe, n_rows
        self._st = self._key = None

    @property
    def nbytes(self):
        return self.rows.nbytes

    def struct(self):
        """The sa_probe_rows the C core reads and writes (rows must stay
        alive); kept for the next call while rows and sizes stay the same."""
        key = (self.rows, self.block_size, self.n_probe)
        if self._key is not None and key[0] is self._key[0] and key[1:] == self._key[1:]:
            self._st.n_rows = self.n_rows
            return self._st
        op = kv_operand("probe_rows.rows", self.rows)
        st = op.struct
        self._key = key
        self._st = ffi.new("sa_probe_rows *", {
            "dtype": st.dtype, "n_kv_heads": st.n_kv_heads, "head_dim": st.head_dim,
            "group_size": st.group_size, "block_size": self.block_size,
            "n_probe": self.n_probe, "head_stride": st.head_stride, "n_rows": self.n_rows,
            "f32": ffi.cast("float *", st.f32), "q8": ffi.cast("int8_t *", st.q8),
            "scales": ffi.cast("float *", st.scales)})
        return self._st

    def __repr__(self):
        return (f"ProbeRows(rows={tuple(self.rows.shape)}, block_size={self.block_size}, "
                f"n_probe={self.n_probe}, n_rows={self.n_rows})")


def empty_probe_rows(n_kv_heads, capacity, head_dim, dtype, group_size, block_size, n_probe):
    """Room for the copies of every block of `capacity` K rows, the last
    partial one included (a cache that grows completes it later)."""
    cnt, _ = probe_geometry(block_size, n_probe)
    r = -(-capacity // block_size) * cnt
    if dtype == "float32":
        rows = np.zeros((n_kv_heads, r, head_dim), np.float32)
    else:
        rows = Q8._wrap(np.zeros((n_kv_heads, r, head_dim), np.int8),
                        np.zeros((n_kv_heads, r, head_dim // group_size), np.float32),
                        group_size)
    return ProbeRows(rows, block_size, n_probe, 0)


def probe_rows(k, *, block_size=32, n_probe=8, seq_len=None):
    """Copy the probe's sampled rows of K's first ``seq_len`` rows into a
    :class:`ProbeRows` (one strided read of K).  A :class:`KVCache` keeps its
    copies up to date as tokens are appended instead (``cache.probe_rows``).

    Parameters
    ----------
    k : float32 ``[Hkv, S, D]`` or Q8
    block_size, n_probe : int, defaults 32 and 8 (those of the decode calls
        the copies serve)
    seq_len : int, default ``S``
    """
    kop = kv_operand("k", k)
    seq_len = _check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    n_probe = ck.check_int("n_probe", n_probe, minimum=1)
    p = empty_probe_rows(kop.n_kv_heads, seq_len, kop.head_dim, kop.dtype, kop.group_size,
                         block_size, n_probe)
    _raise_for(lib.sa_probe_rows_update(kop.struct, 0, seq_len, p.struct()), "probe_rows")
    p.n_rows = seq_len
    return p


def _probe_rows_for(scoring, rows, kop, seq_len, block_size, n_probe):
    """The caller's probe-row copies, checked against this call, or None."""
    if rows is None:
        return None
    if scoring != "probe":
        raise ArgumentError("probe_rows= is only read with scoring='probe'")
    if not isinstance(rows, ProbeRows):
        raise ArgumentTypeError(f"probe_rows must be a ProbeRows (see probe_rows), got "
                                f"{type(rows).__name__}")
    r = rows.rows
    dtype, group = ("q8", r.group_size) if isinstance(r, Q8) else ("float32", None)
    shape = r.shape
    if (dtype, group) != (kop.dtype, kop.group_size) or shape[0] != kop.n_kv_heads or \
            shape[2] != kop.head_dim:
        raise ArgumentError(f"probe_rows hold {dtype} rows of [{shape[0]} KV heads, head_dim "
                            f"{shape[2]}], k is {kop.dtype} [{kop.n_kv_heads}, {kop.head_dim}]"
                            " (and the q8 group sizes must match)")
    if (rows.block_size, rows.n_probe) != (block_size, n_probe):
        raise ArgumentError(f"probe_rows were copied for block_size {rows.block_size}, n_probe "
                            f"{rows.n_probe}, not {block_size}, {n_probe}")
    if rows.n_rows < seq_len:
        raise ArgumentError(f"probe_rows cover {rows.n_rows} rows of K but seq_len is "
                            f"{seq_len}; copy them again with probe_rows(k)")
    cnt, _ = probe_geometry(block_size, n_probe)
    if seq_len // block_size * cnt > shape[1]:
        raise ArgumentError(f"probe_rows hold {shape[1]} rows, fewer than the "
                            f"{seq_len // block_size * cnt} of seq_len {seq_len}")
    return rows


SCORINGS = {"probe": lib.SA_SCORING_PROBE, "minmax": lib.SA_SCORING_MINMAX}

# Named selection policies: SPEC §6's four knobs and the probe's n_probe.
# "seed" is the article's rule and the default everywhere.  "recall" is the
# best combination python -m sparse_attn.eval found on SmolLM2-135M-Instruct
# at 2K tokens (README): no importance reserve and a probe that reads every
# row of a block (n_probe="all", the block's true max of q.k), which kept all
# 9 answers exact attention gives at k = 4, 8, 16 and 32 (seed: 2, 4, 7, 9)
# and gave exact's text more often than seed at every k.  It reads all of K
# to choose, so it saves V reads and attention work, not K reads.  "fast"
# reads the least: Quest's min/max key bounds instead of the probe, one
# selection per GQA group, the first block kept; it recalled less than the
# probe on SmolLM2, so measure your model first.
POLICIES = {
    "seed": dict(importance_fraction=0.5, sink_blocks=0, scoring="probe", share="head",
                 n_probe=8),
    "recall": dict(importance_fraction=0.0, sink_blocks=0, scoring="probe", share="head",
                   n_probe="all"),
    "fast": dict(importance_fraction=0.0, sink_blocks=1, scoring="minmax", share="group",
                 n_probe=8),
}


def resolve_policy(policy, importance_fraction=None, sink_blocks=None, scoring=None,
                   share=None, n_probe=None):
    """The knob values of `policy`, with every knob given (not None) taking
    precedence.  Returns a dict of the four SPEC §6 knobs and n_probe (an int
    or "all")."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ArgumentError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    knobs = dict(POLICIES[policy])
    for name, value in (("importance_fraction", importance_fraction),
                        ("sink_blocks", sink_blocks), ("scoring", scoring), ("share", share),
                        ("n_probe", n_probe)):
        if value is not None:
            knobs[name] = value
    return knobs


def _bounds_for(scoring, bounds, k, kop, seq_len, block_size):
    """The bounds a minmax selection reads: the caller's, checked, or computed now."""
    if scoring != "minmax":
        if bounds is not None:
            raise ArgumentError("bounds= is only read with scoring='minmax'")
        return None
    if bounds is None:
        return block_bounds(k, block_size=block_size, seq_len=seq_len)
    if not isinstance(bounds, BlockBounds):
        raise ArgumentTypeError(f"bounds must be a BlockBounds (see block_bounds), got "
                                f"{type(bounds).__name__}")
    if bounds.mn.shape[0] != kop.n_kv_heads or bounds.mn.shape[2] != kop.head_dim:
        raise ArgumentError(f"bounds are for [{bounds.mn.shape[0]} KV heads, head_dim "
                            f"{bounds.mn.shape[2]}], k is [{kop.n_kv_heads}, {kop.head_dim}]")
    if bounds.block_size != block_size:
        raise ArgumentError(f"bounds were computed for block_size {bounds.block_size}, not "
                            f"{block_size}")
    if bounds.n_rows != seq_len:
        raise ArgumentError(f"bounds cover {bounds.n_rows} rows but seq_len is {seq_len}; "
                            f"recompute them with block_bounds(k, seq_len={seq_len})")
    return bounds


def select_params(k_blocks=32, block_size=32, n_probe=8, recency=True,
                  importance_fraction=0.5, sink_blocks=0, share="head", scoring="probe"):
    """Validated selection settings as the C struct (SPEC §2 and §6); the
    caller attaches bounds for scoring="minmax"."""
    try:
        fields = _select_fields(k_blocks, block_size, n_probe, recency, importance_fraction,
                                sink_blocks, share, scoring)
    except TypeError:   # an unhashable argument: validate it uncached, for the message
        fields = _select_fields.__wrapped__(k_blocks, block_size, n_probe, recency,
                                            importance_fraction, sink_blocks, share, scoring)
    return ffi.new("sa_select_params *", dict(fields))


@functools.lru_cache(maxsize=256, typed=True)
def _select_fields(k_blocks, block_size, n_probe, recency, importance_fraction, sink_blocks,
                   share, scoring):
    """The checked field values of sa_select_params (cached: decode calls
    repeat the same settings every layer and step)."""
    k_blocks = ck.check_int("k_blocks", k_blocks, minimum=1)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    n_probe = ck.check_n_probe(n_probe, block_size)
    recency = ck.check_bool("recency", recency)
    frac = ck.check_float("importance_fraction", importance_fraction, minimum=0.0, maximum=1.0)
    sink_blocks = ck.check_int("sink_blocks", sink_blocks, minimum=0)
    if share not in SHARES:
        raise ArgumentError(f"share must be one of {sorted(SHARES)}, got {share!r}")
    if scoring not in SCORINGS:
        raise ArgumentError(f"scoring must be one of {sorted(SCORINGS)}, got {scoring!r}")
    return (("block_size", block_size), ("k_blocks", k_blocks), ("n_probe", n_probe),
            ("recency", int(recency)), ("importance_blocks", ck.importance_blocks(frac, k_blocks)),
            ("sink_blocks", sink_blocks), ("share", SHARES[share]), ("scoring", SCORINGS[scoring]))


# --------------------------------------------------------------------------- entry points

def probe_scores(q, k, *, seq_len=None, block_size=32, n_probe=8, threads=None):
    """The probe of SPEC §2.2: per head and block, the largest raw dot
    ``q_h . K[kh, pos]`` over the block's sampled positions.

    Block ``b`` covers ``[b*BS, min((b+1)*BS, seq_len))``; with
    ``step = max(1, len // n_probe)`` the sampled positions are
    ``p0, p0+step, ...`` inside the block.  No scale is applied; for q8 K the
    query is quantised and the int8 x int8 dot of SPEC §4 is used.

    Parameters
    ----------
    q : float32 ``[H, D]``
    k : float32 ``[Hkv, S, D]`` or Q8
    seq_len : int, default ``S``
    block_size : int, default 32
    n_probe : int or ``"all"`` (every row), default 8

    Returns
    -------
    float32 ``[H, NB]``
    """
    kop = kv_operand("k", k)
    n_heads = _check_query(q, kop, 2)
    seq_len = _check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    n_probe = ck.check_n_probe(n_probe, block_size)
    threads = ck.check_threads(threads)
    nb = -(-seq_len // block_size)
    out = np.empty((n_heads, nb), np.float32)
    rc = lib.sa_probe_scores(_ptr(q, "float"), n_heads, kop.struct, seq_len, block_size,
                             n_probe, ffi.from_buffer("float[]", out), threads)
    _raise_for(rc, "probe_scores")
    return out


def select_blocks(q, k, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, policy="seed", importance_fraction=None,
                  sink_blocks=None, share=None, scoring=None, bounds=None, probe_rows=None,
                  threads=None):
    """Choose the blocks each query head attends to (SPEC §2 steps 1-5, §6).

    In order, with ``total = min(k_blocks, NB)``:

    1. sinks: blocks ``0 .. min(sink_blocks, total)-1``;
    2. importance reserve (only if ``importance`` is given):
       ``ceil(importance_fraction * k_blocks)`` blocks (the seed's
       ``(k_blocks+1)//2`` at 0.5) with the largest per-block sum of
       ``importance``, at most what the sinks left;
    3. probe fill: the unused blocks with the largest probe score
       (:func:`probe_scores`) until ``total`` are chosen;
    4. recency insurance (``recency=True``): if block ``NB-1`` is not chosen
       and the fill picked at least one block, the last fill pick (lowest
       score; among equal scores the higher index) is replaced by ``NB-1``.
       Sink and importance picks are never evicted.

    Every tie goes to the lower block index; there are no random numbers, so
    the same inputs always give the same blocks.  With ``share="group"`` the
    scores of a KV head's query heads are summed and the group shares one
    selection.  With ``scoring="minmax"`` a block's score is Quest's bound
    ``sum_i max(q_i * mn_i, q_i * mx_i)`` over the per-channel key bounds of
    the block (:class:`BlockBounds`) instead of the probe.

    Parameters
    ----------
    q : float32 ``[H, D]``
    k : float32 ``[Hkv, S, D]`` or Q8
    seq_len : int, default ``S``
    k_blocks : int, default 32
    block_size : int, default 32
    n_probe : int or ``"all"``, default the policy's (seed: 8; ``"all"``
        samples every row, ``n_probe = block_size``)
    importance : float32 ``[>= seq_len]`` or None
    recency : bool, default True
    policy : str, default ``"seed"``; a preset of ``n_probe`` and the four
        knobs below (``sparse_attn.POLICIES``); a knob given explicitly
        overrides it
    importance_fraction : float in [0, 1] (seed: 0.5)
    sink_blocks : int (seed: 0)
    share : ``"head"`` (seed) or ``"group"``
    scoring : ``"probe"`` (seed) or ``"minmax"``
    bounds : BlockBounds or None; for ``"minmax"``, the bounds of K over
        exactly ``seq_len`` rows (``KVCache.bounds``); None computes them now,
        reading all of K
    probe_rows : ProbeRows or None; for ``"probe"``, copies of the probed
        rows (``KVCache.probe_rows``, :func:`probe_rows`) covering at least
        ``seq_len`` rows, made for this ``block_size`` and ``n_probe``; the
        probe then reads a quarter of K's bytes instead of about all of them,
        with bitwise the same result.  None probes K itself
    threads : int, default ``SPARSE_ATTN_NUM_THREADS`` or the usable cores

    Returns
    -------
    int32 ``[H, K]``, each row ascending.

    Examples
    --------
    >>> import numpy as np, sparse_attn
    >>> k = np.zeros((1, 96, 4), np.float32); k[0, 40, 0] = 1.0   # a needle in block 1
    >>> q = np.array([[1, 0, 0, 0]], np.float32)
    >>> sparse_attn.select_blocks(q, k, k_blocks=2, n_probe=32).tolist()
    [[1, 2]]
    """
    kop = kv_operand("k", k)
    n_heads = _check_query(q, kop, 2)
    seq_len = _check_seq_len(seq_len, kop)
    knobs = resolve_policy(policy, importance_fraction, sink_blocks, scoring, share, n_probe)
    n_probe = knobs.pop("n_probe")
    params = select_params(k_blocks, block_size, n_probe, recency, **knobs)
    bounds = _bounds_for(knobs["scoring"], bounds, k, kop, seq_len, params.block_size)
    if bounds is not None:
        bstruct = bounds.struct()
        params.bounds = bstruct
    probe_rows = _probe_rows_for(knobs["scoring"], probe_rows, kop, seq_len, params.block_size,
                                 params.n_probe)
    if probe_rows is not None:
        pstruct = probe_rows.struct()
        params.probe_rows = pstruct
    importance = _check_importance(importance, seq_len)
    threads = ck.check_threads(threads)
    nb = -(-seq_len // params.block_size)
    blocks = np.empty((n_heads, min(params.k_blocks, nb)), np.int32)
    imp = ffi.NULL if importance is None else _ptr(importance, "float")
    n_imp = 0 if importance is None else importance.shape[0]
    rc = lib.sa_select_blocks(_ptr(q, "float"), n_heads, kop.struct, seq_len, params, imp,
                              n_imp, ffi.from_buffer("int32_t[]", blocks), threads)
    _raise_for(rc, "select_blocks")
    return blocks


def sparse_decode(q, k, v, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, scale=None, policy="seed",
                  importance_fraction=None, sink_blocks=None, share=None, scoring=None,
                  bounds=None, probe_rows=None, threads=None, return_blocks=False):
    """One decode step of one layer over the blocks :func:`select_blocks` picks.

    Equivalent to (the numpy reference, ``sparse_attn.reference``)::

        blocks = select_blocks(q, k, ...)            # [H, K]
        for h in range(H):
            kh = h // (H // Hkv)
            t = tokens of blocks[h], ascending, < seq_len
            s = scale * K[kh, t] @ q[h]               # q8: quantised q, int8 dot
            p = exp(s - s.max())
            out[h] = p @ V[kh, t] / p.sum()

    With ``k_blocks >= NB`` the result is bitwise equal to :func:`dense_decode`.

    Parameters
    ----------
    q : float32 ``[H, D]``
    k, v : float32 ``[Hkv, S, D]`` or Q8 (both the same kind)
    scale : float, default ``1/sqrt(D)``
    return_blocks : bool, default False; also return the ``[H, K]`` blocks
    others : as :func:`select_blocks`

    Returns
    -------
    out : float32 ``[H, D]``, and ``blocks`` int32 ``[H, K]`` if ``return_blocks``.
    """
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    _check_pair(kop, vop)
    n_heads = _check_query(q, kop, 2)
    seq_len = _check_seq_len(seq_len, kop, vop)
    knobs = resolve_policy(policy, importance_fraction, sink_blocks, scoring, share, n_probe)
    n_probe = knobs.pop("n_probe")
    params = select_params(k_blocks, block_size, n_probe, recency, **knobs)
    bounds = _bounds_for(knobs["scoring"], bounds, k, kop, seq_len, params.block_size)
    if bounds is not None:
        bstruct = bounds.struct()
        params.bounds = bstruct
    probe_rows = _probe_rows_for(knobs["scoring"], probe_rows, kop, seq_len, params.block_size,
                                 params.n_probe)
    if probe_rows is not None:
        pstruct = probe_rows.struct()
        params.probe_rows = pstruct
    importance = _check_importance(importance, seq_len)
    scale = _check_scale(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    return_blocks = ck.check_bool("return_blocks", return_blocks)
    nb = -(-seq_len // params.block_size)
    out = np.empty((n_heads, kop.head_dim), np.float32)
    blocks = np.empty((n_heads, min(params.k_blocks, nb)), np.int32) if return_blocks else None
    imp = ffi.NULL if importance is None else _ptr(importance, "float")
    n_imp = 0 if importance is None else importance.shape[0]
    rc = lib.sa_sparse_decode(
        _ptr(q, "float"), n_heads, kop.struct, vop.struct, seq_len, params, imp, n_imp, scale,
        ffi.from_buffer("float[]", out),
        ffi.from_buffer("int32_t[]", blocks) if return_blocks else ffi.NULL, threads)
    _raise_for(rc, "sparse_decode")
    return (out, blocks) if return_blocks else out


def dense_decode(q, k, v, *, seq_len=None, scale=None, threads=None):
    """Exact attention of one query token over all ``seq_len`` keys.

    ``out[h] = softmax(scale * K[kh, :seq_len] @ q[h]) @ V[kh, :seq_len]``.

    Parameters
    ----------
    q : float32 ``[H, D]``
    k, v : float32 ``[Hkv, S, D]`` or Q8
    seq_len : int, default ``S``
    scale : float, default ``1/sqrt(D)``

    Returns
    -------
    float32 ``[H, D]``
    """
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    _check_pair(kop, vop)
    n_heads = _check_query(q, kop, 2)
    seq_len = _check_seq_len(seq_len, kop, vop)
    scale = _check_scale(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    out = np.empty((n_heads, kop.head_dim), np.float32)
    rc = lib.sa_dense_decode(_ptr(q, "float"), n_heads, kop.struct, vop.struct, seq_len, scale,
                             ffi.from_buffer("float[]", out), threads)
    _raise_for(rc, "dense_decode")
    return out


def prefill(q, k, v, *, start=0, scale=None, threads=None):
    """Exact causal attention for T query tokens, and the importance of SPEC §3.

    The queries sit at positions ``[start, start+T)``; the query at position
    ``p`` attends to keys ``0..p``.  ``k`` and ``v`` must hold at least
    ``start+T`` rows (the keys of this chunk included).

    Parameters
    ----------
    q : float32 ``[H, T, D]``
    k, v : float32 ``[Hkv, S, D]`` or Q8, ``S >= start + T``
    start : int, default 0
    scale : float, default ``1/sqrt(D)``

    Returns
    -------
    out : float32 ``[H, T, D]``
    importance : float32 ``[start+T]``; ``importance[s] = sum over heads h and
        rows t of P_h[t, s]``, the attention mass key s received.  A caller
        that prefills in chunks adds the chunks' importance up.
    """
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    _check_pair(kop, vop)
    n_heads = _check_query(q, kop, 3)
    start = ck.check_int("start", start, minimum=0)
    T = q.shape[1]
    if start + T > min(kop.rows, vop.rows):
        raise ArgumentError(f"start + T ({start} + {T}) is beyond the KV, which holds "
                            f"{min(kop.rows, vop.rows)} rows")
    scale = _check_scale(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    out = np.empty(q.shape, np.float32)
    importance = np.empty(start + T, np.float32)
    rc = lib.sa_prefill(_ptr(q, "float"), n_heads, T, kop.struct, vop.struct, start, scale,
                        ffi.from_buffer("float[]", out), ffi.from_buffer("float[]", importance),
                        threads)
    _raise_for(rc, "prefill")
    return out, importance


# --------------------------------------------------------------------------- kernels alone

def q8_dot(q, rows):
    """The int8 x int8 dot of SPEC §4 of one quantised query against rows.

    Parameters
    ----------
    q : Q8 of shape ``[D]``
    rows : Q8 of shape ``[N, D]``, same group_size, C-contiguous

    Returns
    -------
    float32 ``[N]``: ``sum_g d_q,g * d_k,g * sum_{i in g} q_i k_i``.
    """
    if not isinstance(q, Q8) or not isinstance(rows, Q8):
        raise ArgumentTypeError("q and rows must be Q8 (see quantize_q8)")
    if q.data.ndim != 1 or rows.data.ndim != 2 or rows.shape[1] != q.shape[0]:
        raise ArgumentError(f"q must be [D] and rows [N, D], got {q.shape} and {rows.shape}")
    if q.group_size != rows.group_size:
        raise ArgumentError(f"q and rows must share group_size, got {q.group_size} "
                            f"and {rows.group_size}")
    for name, a in (("q.data", q.data), ("q.scales", q.scales), ("rows.data", rows.data),
                    ("rows.scales", rows.scales)):
        ck.check_array(name, a, dtype=a.dtype)
    out = np.empty(rows.shape[0], np.float32)
    rc = lib.sa_kernel_q8_dot(_ptr(q.data, "int8_t"), _ptr(q.scales, "float"), q.shape[0],
                              q.group_size, _ptr(rows.data, "int8_t"), _ptr(rows.scales, "float"),
                              rows.shape[0], ffi.from_buffer("float[]", out))
    _raise_for(rc, "q8_dot")
    return out


def accumulate_v(p, v, out=None):
    """V accumulation: ``out += sum_t p[t] * v[t]`` in token order.

    Parameters
    ----------
    p : float32 ``[N]``
    v : float32 ``[N, D]`` or Q8 ``[N, D]`` (dequantised on the fly)
    out : float32 ``[D]`` to add into, or None for zeros

    Returns
    -------
    float32 ``[D]`` (``out`` itself when given)
    """
    ck.check_array("p", p, dtype=np.float32, ndim=1, finite=True)
    if isinstance(v, Q8):
        if v.data.ndim != 2:
            raise ArgumentError(f"v must be [N, D], got {v.shape}")
        vop = kv_operand("v", Q8._wrap(v.data[None], v.scales[None], v.group_size))
    else:
        ck.check_array("v", v, dtype=np.float32, ndim=2)
        vop = kv_operand("v", v[None])
    if p.shape[0] != vop.rows:
        raise ArgumentError(f"p has {p.shape[0]} weights for {vop.rows} rows of v")
    if out is None:
        out = np.zeros(vop.head_dim, np.float32)
    else:
        ck.check_array("out", out, dtype=np.float32, ndim=1)
        if out.shape[0] != vop.head_dim:
            raise ArgumentError(f"out must have shape ({vop.head_dim},), got {out.shape}")
    rc = lib.sa_kernel_accumulate_v(_ptr(p, "float"), vop.struct, p.shape[0],
                                    ffi.from_buffer("float[]", out))
    _raise_for(rc, "accumulate_v")
    return out


# --------------------------------------------------------------------------- ISA

def isa():
    """The name of the kernel path in use: ``"portable"``, ``"avx2"``,
    ``"avx512-vnni"``, ``"neon"`` or ``"neon-dotprod"``."""
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

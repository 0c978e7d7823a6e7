"""What a selection reads beside K: the per-block key bounds of
``scoring="minmax"``, the copies of the rows the probe samples and the
channel-major copy of ``scoring="channels"``.

Each is immutable and owns its arrays: the functions here make them, and a
hand-built one copies the caller's arrays and checks the copies when made
(so one that does not fit never reaches C, and nothing the caller writes
afterwards does).  Each is checked against every call it serves.  A
:class:`~sparse_attn.KVCache` keeps its own up to date as tokens are
appended, and hands out copies.
"""
import numpy as np

from . import _checks as ck
from . import _ffi
from .errors import ArgumentError, ArgumentTypeError
from ._ffi import ffi, lib
from ._operands import check_seq_len, kv_operand
from .q8 import _SCALE_LIMIT, Q8, _read_only


def probe_geometry(block_size, n_probe):
    """(rows kept per full block, step between them) of the probe (spec §2.2),
    as the C core computes it (probe_rows.c)."""
    step = max(1, block_size // n_probe)
    return -(-block_size // step), step


def default_scale_group(kv_group_size, head_dim):
    """The channels sharing one bound scale: K's q8 group, or 32 for float32
    K (head_dim when 32 does not divide it)."""
    if kv_group_size is not None:
        return kv_group_size
    return 32 if head_dim % 32 == 0 else head_dim


def frozen_copy(a):
    """A C-contiguous copy of `a` that nothing can write: its memory is a
    bytes object, so its read-only flag cannot be lifted (it can on a
    read-only view of a writable array, and that array's owner writes it
    anyway)."""
    return np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)


def _check_scales(name, scales):
    """The scales of bounds or of a channel copy, as this package makes
    them: finite, not negative, and (as Q8 requires) times 127 below the
    value limit, where scores could overflow float32."""
    if not np.isfinite(scales).all():
        raise ArgumentError(f"{name} holds NaN or Inf values")
    if scales.size and scales.min() < 0:
        raise ArgumentError(f"{name} holds negative scales ({scales.min():.4g}); a scale is "
                            f"a largest magnitude / 127")
    if scales.size and scales.max() >= _SCALE_LIMIT:
        raise ArgumentError(
            f"{name} holds scales of {_SCALE_LIMIT:.4g} or more: values would reach "
            f"2**{_ffi.VALUE_LIMIT_LOG2}, where scores can overflow float32")


def _rows_layout(name, a, dtype):
    """Checks a [Hkv, N, W] array with contiguous rows; returns its head
    stride in rows."""
    ck.check_array(name, a, dtype=dtype, ndim=3, contiguous=False)
    hkv, n, w = a.shape
    item = a.dtype.itemsize
    if a.strides[2] != item or (n > 1 and a.strides[1] != w * item) or \
            (hkv > 1 and (a.strides[0] % (w * item) or a.strides[0] < n * w * item)):
        raise ArgumentError(f"{name} must have contiguous rows (C order within a head), got "
                            f"strides {a.strides} for shape {a.shape}")
    return n if hkv == 1 else a.strides[0] // (w * item)


# --------------------------------------------------------------------------- key bounds

class _Immutable:
    """What the metadata classes share: they are immutable once made, and
    ``_wrap`` makes one over arrays this package computed and no one else
    holds (the builders, a KVCache's snapshots) without copying or checking
    them again; the public constructor copies and checks the caller's."""

    __slots__ = ()

    @classmethod
    def _wrap(cls, *args, **kwargs):
        self = cls.__new__(cls)
        self._init(*args, **kwargs)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable (cannot set {name!r})")


class BlockBounds(_Immutable):
    """Per-block, per-channel key bounds for ``scoring="minmax"`` (spec §6).

    Made from the caller's arrays, it keeps copies of them (checked once:
    finite scales, not negative, below ``2**48 / 127``).

    For block ``b`` of KV head ``kh`` and channel ``i``:
    ``scales[kh, b, i // scale_group] * mn[kh, b, i] <= K[kh, t, i] <=
    scales[kh, b, i // scale_group] * mx[kh, b, i]`` for every valid row
    ``t`` of the block (int8 multiples of the scale, rounded outwards).

    Attributes (read-only)
    ----------------------
    mn, mx : int8 ``[Hkv, NB, D]``
    scales : float32 ``[Hkv, NB, D // scale_group]``
    block_size : int
    scale_group : int, channels sharing one scale
    k_rows : int, the rows of K the bounds were computed over
    """

    __slots__ = ("_mn", "_mx", "_scales", "_block_size", "_scale_group", "_k_rows",
                 "_stride", "_struct")

    def __init__(self, mn, mx, scales, block_size, scale_group, k_rows):
        block_size = ck.check_int("block_size", block_size, minimum=1)
        scale_group = ck.check_int("scale_group", scale_group, minimum=1)
        k_rows = ck.check_int("k_rows", k_rows, minimum=0)
        stride = _rows_layout("bounds.mn", mn, np.int8)
        if _rows_layout("bounds.mx", mx, np.int8) != stride or mx.shape != mn.shape:
            raise ArgumentError(f"bounds.mx must have the shape and layout of bounds.mn "
                                f"{mn.shape}, got {mx.shape}")
        hkv, nb, dim = mn.shape
        if dim % scale_group:
            raise ArgumentError(f"scale_group ({scale_group}) must divide head_dim ({dim})")
        scale_stride = _rows_layout("bounds.scales", scales, np.float32)
        if scales.shape != (hkv, nb, dim // scale_group):
            raise ArgumentError(f"bounds.scales must have shape {(hkv, nb, dim // scale_group)}"
                                f", got {scales.shape}")
        if hkv > 1 and scale_stride != stride:
            raise ArgumentError("bounds.scales must have the head stride of bounds.mn")
        if -(-k_rows // block_size) > nb:
            raise ArgumentError(f"bounds hold {nb} blocks, fewer than the "
                                f"{-(-k_rows // block_size)} of k_rows {k_rows}")
        # the copies are checked, so what the caller writes into its arrays
        # later (or meanwhile, from another thread) never reaches C
        mn, mx, scales = frozen_copy(mn), frozen_copy(mx), frozen_copy(scales)
        _check_scales("bounds.scales", scales)
        self._init(mn, mx, scales, block_size, scale_group, k_rows, nb)

    def _init(self, mn, mx, scales, block_size, scale_group, k_rows, stride):
        for name, value in (("_mn", _read_only(mn)), ("_mx", _read_only(mx)),
                            ("_scales", _read_only(scales)), ("_block_size", block_size),
                            ("_scale_group", scale_group), ("_k_rows", k_rows),
                            ("_stride", stride), ("_struct", None)):
            object.__setattr__(self, name, value)

    mn = property(lambda self: self._mn)
    mx = property(lambda self: self._mx)
    scales = property(lambda self: self._scales)
    block_size = property(lambda self: self._block_size)
    scale_group = property(lambda self: self._scale_group)
    k_rows = property(lambda self: self._k_rows)

    @property
    def nbytes(self):
        return self._mn.nbytes + self._mx.nbytes + self._scales.nbytes

    def struct(self):
        """The sa_bounds the C core reads (made once; the arrays stay alive
        with this object)."""
        if self._struct is None:
            hkv, _, dim = self._mn.shape
            st = ffi.new("sa_bounds *", {
                "n_kv_heads": hkv, "head_dim": dim, "block_size": self._block_size,
                "scale_group": self._scale_group, "head_stride": self._stride,
                "k_rows": self._k_rows,
                "mn": ffi.cast("int8_t *", _ffi.ptr(self._mn, "int8_t")),
                "mx": ffi.cast("int8_t *", _ffi.ptr(self._mx, "int8_t")),
                "scales": ffi.cast("float *", _ffi.ptr(self._scales, "float"))})
            object.__setattr__(self, "_struct", st)
        return self._struct

    def check_for(self, kop, seq_len, block_size):
        """Refuse bounds that were not made for this K, seq_len and block_size."""
        if self._mn.shape[0] != kop.n_kv_heads or self._mn.shape[2] != kop.head_dim:
            raise ArgumentError(f"bounds are for [{self._mn.shape[0]} KV heads, head_dim "
                                f"{self._mn.shape[2]}], k is [{kop.n_kv_heads}, "
                                f"{kop.head_dim}]")
        if self._block_size != block_size:
            raise ArgumentError(f"bounds were computed for block_size {self._block_size}, "
                                f"not {block_size}")
        if self._k_rows != seq_len:
            raise ArgumentError(f"bounds cover {self._k_rows} rows but seq_len is {seq_len}; "
                                f"recompute them with block_bounds(k, seq_len={seq_len})")

    def __repr__(self):
        return (f"BlockBounds(blocks={self._mn.shape[1]}, block_size={self._block_size}, "
                f"scale_group={self._scale_group}, k_rows={self._k_rows})")


def empty_bounds(n_kv_heads, n_blocks, head_dim, block_size, scale_group, zeros=np.zeros):
    """Zeroed bound arrays (mn, mx, scales) for a cache to fill."""
    return (zeros((n_kv_heads, n_blocks, head_dim), np.int8),
            zeros((n_kv_heads, n_blocks, head_dim), np.int8),
            zeros((n_kv_heads, n_blocks, head_dim // scale_group), np.float32))


def bounds_struct(arrays, block_size, scale_group, k_rows):
    """A writable sa_bounds over a cache's own arrays (mn, mx, scales)."""
    mn, mx, sc = arrays
    return ffi.new("sa_bounds *", {
        "n_kv_heads": mn.shape[0], "head_dim": mn.shape[2], "block_size": block_size,
        "scale_group": scale_group, "head_stride": mn.shape[1], "k_rows": k_rows,
        "mn": _ffi.out_ptr(mn, "int8_t"), "mx": _ffi.out_ptr(mx, "int8_t"),
        "scales": _ffi.out_ptr(sc, "float")})


def block_bounds(k, *, block_size=32, seq_len=None, scale_group=None):
    """Per-block min/max key bounds of K's first ``seq_len`` rows (one read of
    K), for ``scoring="minmax"``.  A :class:`~sparse_attn.KVCache` keeps its
    own up to date instead (``cache.bounds``).

    Parameters
    ----------
    k : float32 ``[Hkv, S, D]`` or Q8
    block_size : int, default 32
    seq_len : int, default ``S``
    scale_group : int, default: K's q8 group, or 32 for float32 K (head_dim if
        32 does not divide it); channels sharing one bound scale

    Returns
    -------
    BlockBounds with ``NB = ceil(seq_len / block_size)`` blocks.
    """
    kop = kv_operand("k", k)
    seq_len = check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    if scale_group is None:
        scale_group = default_scale_group(kop.group_size, kop.head_dim)
    scale_group = ck.check_int("scale_group", scale_group, minimum=1)
    if kop.head_dim % scale_group:
        raise ArgumentError(f"scale_group ({scale_group}) must divide head_dim "
                            f"({kop.head_dim})")
    nb = -(-seq_len // block_size)
    arrays = empty_bounds(kop.n_kv_heads, nb, kop.head_dim, block_size, scale_group)
    st = bounds_struct(arrays, block_size, scale_group, 0)
    _ffi.check(lib.sa_bounds_update(kop.struct, 0, seq_len, st), "block_bounds")
    return BlockBounds._wrap(*arrays, block_size, scale_group, seq_len, nb)


# --------------------------------------------------------------------------- probe rows

class ProbeRows(_Immutable):
    """Copies of the rows the probe samples (spec §2.2), for ``scoring="probe"``.

    With ``step = max(1, block_size // n_probe)``, each full block ``b`` of K
    keeps ``cnt = ceil(block_size / step)`` rows, K rows ``b*block_size +
    j*step`` at copy rows ``b*cnt + j``.  The probe then reads these copies
    front to back instead of every ``step``-th row of K, which on real
    hardware costs about a full read of K (the prefetchers fetch the rows in
    between).  The copies are byte copies, so scores, selections and outputs
    are bitwise those computed from K.  They cost ``cnt / block_size`` of
    K's memory (a quarter with the defaults).  The last, partial block of a
    context is probed from K.  Made from the caller's rows, it keeps a copy
    of them (checked once: finite float32 values below ``2**48``, or a
    valid Q8).

    Attributes (read-only)
    ----------------------
    rows : float32 ``[Hkv, R, D]`` or Q8, in K's dtype (and q8 group)
    block_size, n_probe : int
    k_rows : int, the rows of K the copies are current for
    """

    __slots__ = ("_rows", "_op", "_block_size", "_n_probe", "_k_rows", "_struct")

    def __init__(self, rows, block_size, n_probe, k_rows):
        from .selection import n_probe_value
        block_size = ck.check_int("block_size", block_size, minimum=1)
        n_probe = n_probe_value(n_probe, block_size)
        k_rows = ck.check_int("k_rows", k_rows, minimum=0)
        if not isinstance(rows, (np.ndarray, Q8)):
            raise ArgumentTypeError(f"probe_rows.rows must be a float32 numpy.ndarray or a "
                                    f"Q8, got {type(rows).__name__}")
        op = kv_operand("probe_rows.rows", rows)
        cnt, _ = probe_geometry(block_size, n_probe)
        if k_rows // block_size * cnt > op.rows:
            raise ArgumentError(f"probe_rows hold {op.rows} rows, fewer than the "
                                f"{k_rows // block_size * cnt} copies of k_rows {k_rows}")
        self._init(_owned_rows(rows), block_size, n_probe, k_rows)

    def _init(self, rows, block_size, n_probe, k_rows):
        if isinstance(rows, np.ndarray):
            rows = _read_only(rows)
        op = kv_operand("probe_rows.rows", rows)
        for name, value in (("_rows", rows), ("_op", op), ("_block_size", block_size),
                            ("_n_probe", n_probe), ("_k_rows", k_rows), ("_struct", None)):
            object.__setattr__(self, name, value)

    rows = property(lambda self: self._rows)
    block_size = property(lambda self: self._block_size)
    n_probe = property(lambda self: self._n_probe)
    k_rows = property(lambda self: self._k_rows)

    @property
    def nbytes(self):
        return self._rows.nbytes

    def struct(self):
        """The sa_probe_rows the C core reads (made once)."""
        if self._struct is None:
            st = ffi.new("sa_probe_rows *")
            st.rows = self._op.struct[0]
            st.block_size, st.n_probe, st.k_rows = self._block_size, self._n_probe, self._k_rows
            object.__setattr__(self, "_struct", st)
        return self._struct

    def check_for(self, kop, seq_len, sel):
        """Refuse copies that were not made for this K, seq_len, block_size
        and n_probe."""
        op = self._op
        if (op.dtype, op.group_size, op.n_kv_heads, op.head_dim) != \
                (kop.dtype, kop.group_size, kop.n_kv_heads, kop.head_dim):
            raise ArgumentError(f"probe_rows hold {op.dtype} rows of [{op.n_kv_heads} KV heads, "
                                f"head_dim {op.head_dim}], k is {kop.dtype} "
                                f"[{kop.n_kv_heads}, {kop.head_dim}] (and the q8 group sizes "
                                f"must match)")
        if (self._block_size, self._n_probe) != (sel.block_size, sel.n_probe):
            raise ArgumentError(f"probe_rows were copied for block_size {self._block_size}, "
                                f"n_probe {self._n_probe}, not {sel.block_size}, {sel.n_probe}")
        if self._k_rows < seq_len:
            raise ArgumentError(f"probe_rows cover {self._k_rows} rows of K but seq_len is "
                                f"{seq_len}; copy them again with probe_rows(k)")

    def __repr__(self):
        return (f"ProbeRows(rows={tuple(self._rows.shape)}, block_size={self._block_size}, "
                f"n_probe={self._n_probe}, k_rows={self._k_rows})")


def _owned_rows(rows):
    """A checked copy of the caller's probe rows (float32 [Hkv, R, D] or Q8)."""
    if isinstance(rows, Q8):
        try:
            return Q8(frozen_copy(rows.data), frozen_copy(rows.scales), rows.group_size)
        except ArgumentError as e:
            raise ArgumentError(f"probe_rows.rows: {e}") from None
    rows = frozen_copy(rows)
    if not (np.isfinite(rows).all() and np.abs(rows).max() < 2.0 ** _ffi.VALUE_LIMIT_LOG2):
        raise ArgumentError(f"probe_rows.rows holds NaN or Inf values, or magnitudes of "
                            f"2**{_ffi.VALUE_LIMIT_LOG2} or more")
    return rows


def empty_probe_rows(n_kv_heads, capacity, head_dim, dtype, group_size, block_size, n_probe,
                     zeros=np.zeros):
    """Zeroed room for the copies of every block of `capacity` K rows, the
    last partial one included (a cache that grows completes it later):
    an ndarray, or (data, scales) for q8."""
    cnt, _ = probe_geometry(block_size, n_probe)
    r = -(-capacity // block_size) * cnt
    if dtype == "float32":
        return zeros((n_kv_heads, r, head_dim), np.float32)
    return (zeros((n_kv_heads, r, head_dim), np.int8),
            zeros((n_kv_heads, r, head_dim // group_size), np.float32))


def probe_rows_struct(arrays, group_size, block_size, n_probe, k_rows):
    """A writable sa_probe_rows over a cache's own copy arrays."""
    st = ffi.new("sa_probe_rows *")
    r = st.rows
    if isinstance(arrays, tuple):
        data, scales = arrays
        r.dtype, r.group_size = lib.SA_DTYPE_Q8, group_size
        r.q8, r.scales = _ffi.out_ptr(data, "int8_t"), _ffi.out_ptr(scales, "float")
    else:
        data = arrays
        r.dtype = lib.SA_DTYPE_F32
        r.f32 = _ffi.out_ptr(data, "float")
    r.n_kv_heads, r.head_stride, r.n_rows, r.head_dim = (data.shape[0], data.shape[1],
                                                        data.shape[1], data.shape[2])
    st.block_size, st.n_probe, st.k_rows = block_size, n_probe, k_rows
    return st


def probe_rows(k, *, block_size=32, n_probe=8, seq_len=None):
    """Copy the probe's sampled rows of K's first ``seq_len`` rows into a
    :class:`ProbeRows` (one strided read of K).  A
    :class:`~sparse_attn.KVCache` keeps its copies up to date as tokens are
    appended instead (``cache.probe_rows``).

    Parameters
    ----------
    k : float32 ``[Hkv, S, D]`` or Q8
    block_size : int, default 32
    n_probe : int or ``"all"``, default 8 (those of the decode calls the
        copies serve)
    seq_len : int, default ``S``
    """
    from .selection import n_probe_value
    kop = kv_operand("k", k)
    seq_len = check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    n_probe = n_probe_value(n_probe, block_size)
    arrays = empty_probe_rows(kop.n_kv_heads, seq_len, kop.head_dim, kop.dtype,
                              kop.group_size, block_size, n_probe)
    st = probe_rows_struct(arrays, kop.group_size, block_size, n_probe, 0)
    _ffi.check(lib.sa_probe_rows_update(kop.struct, 0, seq_len, st), "probe_rows")
    rows = Q8._wrap(*arrays, kop.group_size) if isinstance(arrays, tuple) else arrays
    return ProbeRows._wrap(rows, block_size, n_probe, seq_len)


# --------------------------------------------------------------------------- channel copy

# A channel copy stores every block at full block_size; refuse sizes no
# machine holds before asking numpy for them.
MAX_CHANNEL_COPY_BYTES = 1 << 40


def empty_channels(n_kv_heads, n_blocks, head_dim, block_rows, zeros=np.zeros):
    """Zeroed channel-copy arrays (q8 ``[Hkv, D, NB, block_rows]`` int8,
    scales ``[Hkv, D, NB]`` float32) for a cache or a call to fill."""
    if n_kv_heads * n_blocks * head_dim * (block_rows + 4) > MAX_CHANNEL_COPY_BYTES:
        raise ArgumentError(f"a channel copy of {n_blocks} blocks of {block_rows} rows "
                            f"({n_kv_heads} KV heads, head_dim {head_dim}) would take more "
                            f"than {MAX_CHANNEL_COPY_BYTES} bytes; use a smaller block_size")
    return (zeros((n_kv_heads, head_dim, n_blocks, block_rows), np.int8),
            zeros((n_kv_heads, head_dim, n_blocks), np.float32))


def channels_struct(arrays, block_size, k_rows):
    """A writable sa_channels over channel-copy arrays (q8, scales)."""
    q, sc = arrays
    return ffi.new("sa_channels *", {
        "n_kv_heads": q.shape[0], "head_dim": q.shape[1], "block_size": block_size,
        "block_rows": q.shape[3], "head_stride": q.shape[2], "k_rows": k_rows,
        "q8": _ffi.out_ptr(q, "int8_t"), "scales": _ffi.out_ptr(sc, "float")})


class ChannelCopy(_Immutable):
    """The channel-major copy of K that ``scoring="channels"`` (the
    ``balanced`` policy, spec §6) reads.

    For KV head ``kh``, channel ``i`` and block ``b``, ``data[kh, i, b, t]``
    times ``scales[kh, i, b]`` is K[kh, b*block_size + t, i] (dequantised
    for q8) as one q8 group of the block's rows of that channel, for the
    block's valid rows ``t``.  A channel's blocks are adjacent, so a score
    over r of D channels reads r rows of the copy front to back, r/D of
    it.  ``block_rows`` is ``block_size``, or the rows there are for a copy
    of fewer rows than one block.  Made from the caller's arrays, it keeps
    copies of them (checked once: finite scales, not negative, below
    ``2**48 / 127``).

    Attributes (read-only)
    ----------------------
    data : int8 ``[Hkv, D, NB, block_rows]``
    scales : float32 ``[Hkv, D, NB]``
    block_size : int
    k_rows : int, the rows of K the copy was made from
    """

    __slots__ = ("_data", "_scales", "_block_size", "_k_rows", "_struct")

    def __init__(self, data, scales, block_size, k_rows):
        block_size = ck.check_int("block_size", block_size, minimum=1)
        k_rows = ck.check_int("k_rows", k_rows, minimum=0)
        ck.check_array("channels.data", data, dtype=np.int8, ndim=4)
        ck.check_array("channels.scales", scales, dtype=np.float32, ndim=3)
        hkv, dim, nb, rows = data.shape
        if scales.shape != (hkv, dim, nb):
            raise ArgumentError(f"channels.scales must have shape {(hkv, dim, nb)}, got "
                                f"{scales.shape}")
        if -(-k_rows // block_size) > nb:
            raise ArgumentError(f"the channel copy holds {nb} blocks, fewer than the "
                                f"{-(-k_rows // block_size)} of k_rows {k_rows}")
        if rows < min(block_size, k_rows) or (nb > 1 and rows < block_size):
            raise ArgumentError(f"the channel copy keeps {rows} rows per block, fewer than "
                                f"its block_size {block_size}")
        data, scales = frozen_copy(data), frozen_copy(scales)
        _check_scales("channels.scales", scales)
        self._init(data, scales, block_size, k_rows)

    def _init(self, data, scales, block_size, k_rows):
        for name, value in (("_data", _read_only(data)), ("_scales", _read_only(scales)),
                            ("_block_size", block_size), ("_k_rows", k_rows), ("_struct", None)):
            object.__setattr__(self, name, value)

    data = property(lambda self: self._data)
    scales = property(lambda self: self._scales)
    block_size = property(lambda self: self._block_size)
    k_rows = property(lambda self: self._k_rows)

    @property
    def nbytes(self):
        return self._data.nbytes + self._scales.nbytes

    def struct(self):
        """The sa_channels the C core reads (made once; the arrays stay
        alive with this object)."""
        if self._struct is None:
            d, sc = self._data, self._scales
            hkv, dim, nb, rows = d.shape
            st = ffi.new("sa_channels *", {
                "n_kv_heads": hkv, "head_dim": dim, "block_size": self._block_size,
                "block_rows": rows, "head_stride": self._row_blocks(), "k_rows": self._k_rows,
                "q8": ffi.cast("int8_t *", _ffi.ptr(d, "int8_t")),
                "scales": ffi.cast("float *", _ffi.ptr(sc, "float"))})
            object.__setattr__(self, "_struct", st)
        return self._struct

    def _row_blocks(self):
        """The blocks between the starts of two channels' rows (a cache's
        view has room for more blocks than the context holds)."""
        d = self._data
        hkv, dim, nb, rows = d.shape
        if dim > 1:
            return d.strides[1] // rows
        return d.strides[0] // rows if hkv > 1 else nb

    def check_for(self, kop, seq_len, block_size):
        """Refuse a copy that was not made for this K, seq_len and block_size."""
        d = self._data
        if d.shape[0] != kop.n_kv_heads or d.shape[1] != kop.head_dim:
            raise ArgumentError(f"the channel copy is for [{d.shape[0]} KV heads, head_dim "
                                f"{d.shape[1]}], k is [{kop.n_kv_heads}, {kop.head_dim}]")
        if self._block_size != block_size:
            raise ArgumentError(f"the channel copy was made for block_size "
                                f"{self._block_size}, not {block_size}")
        if self._k_rows != seq_len:
            raise ArgumentError(f"the channel copy covers {self._k_rows} rows but seq_len is "
                                f"{seq_len}; make it again with channel_copy(k, "
                                f"seq_len={seq_len})")

    def __repr__(self):
        return (f"ChannelCopy(blocks={self._data.shape[2]}, block_size={self._block_size}, "
                f"k_rows={self._k_rows})")


def channel_copy(k, *, block_size=32, seq_len=None):
    """The channel-major copy of K's first ``seq_len`` rows (one read of
    them) for ``scoring="channels"`` (``policy="balanced"``).  A
    :class:`~sparse_attn.KVCache` made with ``copy_channels=True`` keeps its
    own up to date instead (``cache.channels``).

    Parameters
    ----------
    k : float32 ``[Hkv, S, D]`` or Q8
    block_size : int, default 32
    seq_len : int, default ``S``

    Returns
    -------
    ChannelCopy with ``NB = ceil(seq_len / block_size)`` blocks:
    ``D * (block_size + 4)`` bytes per block and KV head (about K's size
    for q8 K, a quarter of it for float32), fewer for a single block
    shorter than ``block_size``.
    """
    kop = kv_operand("k", k)
    seq_len = check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    nb = -(-seq_len // block_size)
    # one block of fewer rows than block_size keeps only its rows
    arrays = empty_channels(kop.n_kv_heads, nb, kop.head_dim, min(block_size, seq_len))
    st = channels_struct(arrays, block_size, 0)
    _ffi.check(lib.sa_channels_update(kop.struct, 0, seq_len, st), "channel_copy")
    return ChannelCopy._wrap(*arrays, block_size, seq_len)


def owned_channel_copy(data, scales, block_size, k_rows):
    """A ChannelCopy over arrays the caller made for it and no one else
    writes (package-internal: the transformers backend's kept copy); not
    copied or checked again."""
    return ChannelCopy._wrap(data, scales, block_size, k_rows)

"""Arguments of the attention calls turned into what the C core reads: the
sa_kv of a K or V, and checked q, importance and scale.  Types, shapes and
layouts are checked here; the values of q and importance are scanned by the
core (see _ffi.check)."""
import math

import numpy as np

from . import _checks as ck
from . import _ffi
from .errors import ArgumentError, ArgumentTypeError
from ._ffi import ffi, lib
from .q8 import Q8


class KVOperand:
    """A validated K or V and the sa_kv struct describing it (`keep` holds
    the arrays the struct points into)."""

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
    stride = a.strides[0] // (dim * item)
    ck.check_int(f"{name}'s head stride in rows", stride)
    return stride


def _sizes(name, shape):
    hkv, rows, dim = shape
    ck.check_int(f"{name}'s number of KV heads (axis 0)", hkv)
    ck.check_int(f"{name}'s number of rows (axis 1)", rows)
    ck.check_int(f"{name}'s head_dim (axis 2)", dim)
    return hkv, rows, dim


def kv_operand(name, kv):
    """Validate a K/V argument (float32 ndarray or Q8, shape [Hkv, S, D]).
    A Q8 is immutable, so its operand is made once and kept on it."""
    if isinstance(kv, Q8):
        op = kv._op
        if op is None:
            op = _q8_operand(name, kv)
            object.__setattr__(kv, "_op", op)
        return op
    if isinstance(kv, np.ndarray):
        return _f32_operand(name, kv)
    raise ArgumentTypeError(f"{name} must be a float32 numpy.ndarray or a Q8 "
                            f"(see quantize_q8), got {type(kv).__name__}")


def _q8_operand(name, kv):
    data, scales = kv.data, kv.scales
    if data.ndim != 3:
        raise ArgumentError(f"{name} must have shape [n_kv_heads, seq, head_dim], "
                            f"got {name}.data of shape {data.shape}")
    hkv, rows, dim = _sizes(name, data.shape)
    stride = _head_stride(f"{name}.data", data, rows, dim)
    s_stride = _head_stride(f"{name}.scales", scales, rows, dim // kv.group_size)
    if hkv > 1 and s_stride != stride:
        raise ArgumentError(f"{name}.data and {name}.scales must share one row layout "
                            f"(head strides of {stride} and {s_stride} rows)")
    op = KVOperand()
    op.dtype, op.group_size = "q8", kv.group_size
    op.keep = (data, scales)
    op.n_kv_heads, op.rows, op.head_dim = hkv, rows, dim
    op.struct = ffi.new("sa_kv *", {
        "dtype": lib.SA_DTYPE_Q8, "n_kv_heads": hkv, "head_stride": stride,
        "n_rows": rows, "head_dim": dim, "group_size": kv.group_size,
        "q8": _ffi.ptr(data, "int8_t"), "scales": _ffi.ptr(scales, "float")})
    return op


def _f32_operand(name, kv):
    ck.check_array(name, kv, dtype=np.float32, ndim=3, contiguous=False)
    hkv, rows, dim = _sizes(name, kv.shape)
    stride = _head_stride(name, kv, rows, dim)
    op = KVOperand()
    op.dtype, op.group_size = "float32", None
    op.keep = (kv,)
    op.n_kv_heads, op.rows, op.head_dim = hkv, rows, dim
    op.struct = ffi.new("sa_kv *", {
        "dtype": lib.SA_DTYPE_F32, "n_kv_heads": hkv, "head_stride": stride,
        "n_rows": rows, "head_dim": dim, "group_size": 0, "f32": _ffi.ptr(kv, "float")})
    return op


def kv_pair(k, v, seq_len):
    """The operands of K and V and the checked seq_len.  Without seq_len, K
    and V must hold the same number of rows (spec §1); with it, both must
    hold at least seq_len."""
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    check_pair(kop, vop)
    if seq_len is None and kop.rows != vop.rows:
        raise ArgumentError(f"k and v hold different numbers of rows ({kop.rows} and "
                            f"{vop.rows}): pass seq_len to attend to the first seq_len of "
                            f"both")
    return kop, vop, check_seq_len(seq_len, kop, vop)


def check_pair(kop, vop):
    """K and V of one kind, heads, head_dim and q8 group."""
    if kop.dtype != vop.dtype:
        raise ArgumentTypeError(f"k and v must have the same dtype (both float32 or both Q8), "
                                f"got {kop.dtype} and {vop.dtype}")
    if (kop.n_kv_heads, kop.head_dim) != (vop.n_kv_heads, vop.head_dim):
        raise ArgumentError(f"k and v must agree on [n_kv_heads, head_dim], got "
                            f"[{kop.n_kv_heads}, {kop.head_dim}] and "
                            f"[{vop.n_kv_heads}, {vop.head_dim}]")
    if kop.group_size != vop.group_size:
        raise ArgumentError(f"k and v must share one q8 group_size, got {kop.group_size} "
                            f"and {vop.group_size}")


def check_seq_len(seq_len, *ops):
    rows = min(op.rows for op in ops)
    if seq_len is None:
        return rows
    seq_len = ck.check_int("seq_len", seq_len, minimum=1)
    if seq_len > rows:
        raise ArgumentError(f"seq_len ({seq_len}) is beyond the KV, which holds {rows} rows")
    return seq_len


def query(q, kop, ndim):
    """q as the contiguous float32 array the core reads ([H, D] for decode,
    [H, T, D] for prefill; any strides, copied when needed), and H."""
    q = ck.as_array("q", q, dtype=np.float32, ndim=ndim)
    n_heads = ck.check_int("n_heads (q's axis 0)", q.shape[0])
    if ndim == 3:
        ck.check_int("T (q's axis 1)", q.shape[1])
    if q.shape[-1] != kop.head_dim:
        raise ArgumentError(f"q has head_dim {q.shape[-1]}, the KV has head_dim {kop.head_dim}")
    if n_heads % kop.n_kv_heads:
        raise ArgumentError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads "
                            f"({kop.n_kv_heads})")
    return q, n_heads


def importance_array(importance, seq_len, what="seq_len"):
    """None, or importance as a contiguous float32 array of at least seq_len
    entries (any strides; NaN and Inf are refused by the core's scan).
    `what` names the length in the error (prefill reads `start` entries)."""
    if importance is None:
        return None
    importance = ck.as_array("importance", importance, dtype=np.float32, ndim=1,
                             allow_empty=seq_len == 0)
    if importance.shape[0] < seq_len:
        raise ArgumentError(f"importance has {importance.shape[0]} entries, shorter than "
                            f"{what} ({seq_len})")
    return importance


def scale_value(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return ck.check_float32("scale", scale)

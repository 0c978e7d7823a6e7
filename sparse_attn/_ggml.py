"""llama.cpp's attention op (ggml's ``GGML_OP_FLASH_ATTN_EXT``) over numpy
arrays in llama.cpp's own layouts: the thin Python face of the C core's
``sa_ggml_flash_attn``, which the ggml backend (csrc/ggml/backend.c) runs
inside llama.cpp.  Private: it exists so the tests can drive that entry
without llama.cpp; the public route is
:mod:`sparse_attn.integrations.llama_cpp`.

A ggml tensor's dimensions run innermost first (``ne[0]`` is a row); a
numpy array here has them in the opposite order, so its shape is ggml's
``ne`` reversed and its strides ggml's ``nb`` reversed (any non-negative
strides, rows contiguous: llama.cpp's K and V are views of its cache with
a row per cell holding every KV head).  Shape legend:

    ns   streams        H    query heads     Hkv  KV heads (H % Hkv == 0)
    n_q  query rows     n_kv KV cells        D    head size

Q8_0 (ggml's ``block_q8_0``) is blocks of 32 values: an fp16 scale ``d``
then 32 int8 ``q``, value ``d * q``; here an array of :data:`BLOCK_Q8_0`
records, ``D // 32`` of them per row.
"""
import numpy as np

from . import _checks as ck
from . import _ffi
from .errors import ArgumentError, ArgumentTypeError, UnsupportedError
from .selection import stateless_selection
from ._ffi import ffi, lib

#: ggml's block_q8_0 (34 bytes, unaligned).
BLOCK_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q8_0_GROUP = 32

_TYPES = {np.dtype(np.float32): lib.SA_GGML_F32, np.dtype(np.float16): lib.SA_GGML_F16,
          BLOCK_Q8_0: lib.SA_GGML_Q8_0}


def quantize_q8_0(x):
    """llama.cpp's ``quantize_row_q8_0_ref`` over the last axis of x
    (float32, a multiple of 32): per block ``d = amax / 127``, ``q =
    roundf(x / d)`` with ``1 / d`` in float32, ``d`` stored as fp16.

    shape: ``(..., D)`` -> ``(..., D // 32)`` of :data:`BLOCK_Q8_0`."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % Q8_0_GROUP:
        raise ArgumentError(f"x's last axis ({x.shape[-1]}) must be a multiple of 32")
    g = x.reshape(x.shape[:-1] + (-1, Q8_0_GROUP))
    d = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    scaled = (g * inv[..., None]).astype(np.float32)
    whole = np.trunc(scaled)                          # roundf: halves away from zero
    q = whole + np.where(np.abs(scaled - whole) >= 0.5, np.sign(scaled), 0)
    out = np.empty(g.shape[:-1], BLOCK_Q8_0)
    out["d"] = d.astype(np.float16)
    out["qs"] = q.astype(np.int8)
    return out


def q8_0_parts(blocks):
    """The int8 values ``(..., D)`` and float32 scales ``(..., D // 32)`` of
    Q8_0 blocks (every fp16 scale is a float32 exactly)."""
    return (np.ascontiguousarray(blocks["qs"]).reshape(blocks.shape[:-1] + (-1,)),
            blocks["d"].astype(np.float32))


def dequantize_q8_0(blocks):
    """float32 ``(..., D)``: each value ``d * q``."""
    q, d = q8_0_parts(blocks)
    return (q.reshape(d.shape + (Q8_0_GROUP,)) * d[..., None]).reshape(q.shape)


def _check_tensor(name, a, dtypes):
    if not isinstance(a, np.ndarray):
        raise ArgumentTypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in dtypes:
        names = " or ".join("BLOCK_Q8_0" if d == BLOCK_Q8_0 else d.name for d in dtypes)
        raise ArgumentTypeError(f"{name} must have dtype {names}, got {a.dtype}")
    if a.ndim != 4:
        raise ArgumentError(f"{name} must have 4 dimensions (ggml's ne reversed), "
                            f"got shape {a.shape}")
    if 0 in a.shape:
        raise ArgumentError(f"{name} is empty: shape {a.shape}")
    if any(s < 0 for s in a.strides):
        raise ArgumentError(f"{name} has a negative stride {a.strides}: ggml strides are "
                            "not negative")
    if a.strides[3] != a.itemsize and a.shape[3] > 1:
        raise ArgumentError(f"{name}'s rows must be contiguous (last stride {a.itemsize}), "
                            f"got strides {a.strides}")
    if any(s % a.dtype.alignment for s in a.strides) or not a.flags.aligned:
        raise ArgumentError(f"{name} is misaligned (strides {a.strides}): copy it with "
                            f"{name}.copy()")
    if any(s > ck.INT_MAX for s in a.shape):
        raise ArgumentError(f"{name} has a dimension beyond a C int: shape {a.shape}")


def _values_per_row(a):
    return a.shape[3] * (Q8_0_GROUP if a.dtype == BLOCK_Q8_0 else 1)


def _fill(t, a):
    """The sa_ggml_tensor t describing array a (kept alive by the caller)."""
    t.type = _TYPES[a.dtype]
    t.data = ffi.cast("void *", a.ctypes.data)
    t.ne = [_values_per_row(a), a.shape[2], a.shape[1], a.shape[0]]
    t.nb = [a.itemsize, a.strides[2], a.strides[1], a.strides[0]]


def op_struct(q, k, v, mask, out, *, scale, max_bias=0.0, logit_softcap=0.0, n_kv_max=0,
              has_sinks=False, select=None, blocks=None):
    """An ``sa_ggml_attn`` over the arrays, unchecked (the tests hand it to
    the C checks directly); select a :class:`~sparse_attn.selection.Selection`
    or None, blocks an int32 array for the chosen blocks or None; returns
    (the struct, what keeps it alive)."""
    a = ffi.new("sa_ggml_attn *")
    _fill(a.q, q)
    _fill(a.k, k)
    _fill(a.v, v)
    _fill(a.out, out)
    keep = [a, q, k, v, out]
    if mask is not None:
        m = ffi.new("sa_ggml_tensor *")
        _fill(m, mask)
        a.mask = m
        keep += [m, mask]
    a.scale, a.max_bias, a.logit_softcap = scale, max_bias, logit_softcap
    a.n_kv_max, a.has_sinks = n_kv_max, int(has_sinks)
    if select is not None:
        params = select.params()
        a.select = params
        keep.append(params)
    if blocks is not None:
        a.blocks = ffi.from_buffer("int32_t[]", blocks, require_writable=True)
        keep.append(blocks)
    return a, keep


def _refuse_features(max_bias, logit_softcap, n_kv_max, sinks):
    # What the C entry does not compute (SA_ERR_UNSUPPORTED); the ggml
    # backend declines such nodes, and llama.cpp's CPU backend runs them.
    for name, value, what in (("max_bias", max_bias, "ALiBi"),
                              ("logit_softcap", logit_softcap, "a logit softcap")):
        if ck.check_float(name, value) != 0.0:
            raise UnsupportedError(f"{name} ({value}) asks for {what}, which "
                                   "sa_ggml_flash_attn does not compute")
    if ck.check_int("n_kv_max", n_kv_max, minimum=0) != 0:
        raise UnsupportedError(f"n_kv_max ({n_kv_max}) asks for a sparse K/V set, which "
                               "sa_ggml_flash_attn does not compute")
    if sinks is not None:
        raise UnsupportedError("sinks are not computed by sa_ggml_flash_attn")


def flash_attn_ext(q, k, v, mask=None, *, scale, max_bias=0.0, logit_softcap=0.0,
                   n_kv_max=0, sinks=None, threads=None, k_blocks=None, policy=None,
                   block_size=32, n_probe=None, recency=True, importance_fraction=None,
                   sink_blocks=None, share=None, scoring=None, return_blocks=False):
    """``ggml_flash_attn_ext(q, k, v, mask, scale, max_bias, logit_softcap)``
    computed by the C core, in float32 with the active kernels; with
    ``k_blocks``, its decode rows sparse (docs/spec.md §8).

    Parameters
    ----------
    q : float32, shape ``(ns, H, n_q, D)``
    k, v : float16 or :data:`BLOCK_Q8_0` (both the same), shape
        ``(ns, Hkv, n_kv, D)`` (Q8_0: ``(ns, Hkv, n_kv, D // 32)``); query head
        ``h`` reads KV head ``h // (H // Hkv)``
    mask : float16, shape ``(m3, m2, >= n_q, >= n_kv)`` with ``ns % m3 == 0``
        and ``H % m2 == 0``, or None.  ``-inf`` excludes a cell (it is never
        read); any other value is added to the scaled score.
    scale : float, finite and > 0
    max_bias, logit_softcap, n_kv_max, sinks
        Must be 0 / None: ALiBi, softcapping, a sparse K/V set and sinks are
        refused with :class:`~sparse_attn.UnsupportedError`.
    threads : int, default ``SPARSE_ATTN_NUM_THREADS`` or the usable cores
    k_blocks : int or None (default: exact)
        Spec §8's sparse decode: a call of at most 4 query rows whose mask
        has one plane for all heads attends, per row, the ``k_blocks``
        blocks of ``block_size`` consecutive valid cells its probe chooses.
    policy, n_probe, recency, importance_fraction, sink_blocks, share, scoring
        The selection (:func:`~sparse_attn.selection.stateless_selection`:
        default :data:`~sparse_attn.selection.LLAMA_CPP_POLICY`; an
        importance reserve or scoring from metadata is refused with
        :class:`~sparse_attn.UnsupportedError`).
    return_blocks : bool
        Also return the blocks chosen: int32 ``(ns, n_q, H, k_blocks)``,
        ascending, -1 after the last (all -1 for a row with no valid cell
        and for a call computed exactly).

    Returns
    -------
    float32, shape ``(ns, n_q, H, D)`` (ggml's ``[D, H, n_q, ns]``): per row
    and head the softmax of ``scale * q.k + mask`` over the cells read,
    times V; zeros for a row that may read no cell.  With ``return_blocks``,
    (that, the blocks).
    """
    _check_tensor("q", q, (np.dtype(np.float32),))
    _check_tensor("k", k, (np.dtype(np.float16), BLOCK_Q8_0))
    _check_tensor("v", v, (k.dtype,))
    if mask is not None:
        _check_tensor("mask", mask, (np.dtype(np.float16),))
    _refuse_features(max_bias, logit_softcap, n_kv_max, sinks)
    scale = ck.check_float32("scale", scale)
    threads = ck.check_threads(threads)
    ns, H, n_q, D = q.shape
    _, Hkv, n_kv, _ = k.shape
    if _values_per_row(k) != D:
        raise ArgumentError(f"k's rows hold {_values_per_row(k)} values, q's {D}")
    if _values_per_row(v) != D:
        raise UnsupportedError(f"v's rows hold {_values_per_row(v)} values, q's {D}: "
                               "sa_ggml_flash_attn computes K and V of one head size")
    if k.shape[0] != ns or v.shape[:3] != k.shape[:3]:
        raise ArgumentError(f"k {k.shape} and v {v.shape} must be (ns={ns}, Hkv, n_kv, ...) "
                            "with the same Hkv and n_kv")
    if H % Hkv:
        raise ArgumentError(f"q's heads ({H}) must be a multiple of k's ({Hkv})")
    if mask is not None:
        m3, m2, mq, mkv = mask.shape
        if mq < n_q or mkv < n_kv or H % m2 or ns % m3:
            raise ArgumentError(
                f"mask must be (m3, m2, >= n_q={n_q}, >= n_kv={n_kv}) with H={H} a multiple "
                f"of m2 and ns={ns} a multiple of m3, got {mask.shape}")
    sel = None
    if k_blocks is not None:
        sel = stateless_selection(policy, k_blocks=k_blocks, block_size=block_size,
                                  n_probe=n_probe, recency=recency,
                                  importance_fraction=importance_fraction,
                                  sink_blocks=sink_blocks, share=share, scoring=scoring)
    elif return_blocks:
        raise ArgumentError("return_blocks needs k_blocks (an exact call chooses no blocks)")
    out = np.empty((ns, n_q, H, D), np.float32)
    blocks = np.empty((ns, n_q, H, sel.k_blocks), np.int32) if return_blocks else None
    a, keep = op_struct(q, k, v, mask, out, scale=scale, select=sel, blocks=blocks)
    _ffi.check(lib.sa_ggml_flash_attn(a, threads), "flash_attn_ext",
               {lib.SA_ERR_Q_VALUES: "q"})
    del keep
    return (out, blocks) if return_blocks else out

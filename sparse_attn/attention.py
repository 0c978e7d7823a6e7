"""The attention entry points: each checks its operands, resolves its
:class:`~sparse_attn.selection.Selection`, and makes one call into the C core.

Shape legend used in every docstring:

    H    query heads            Hkv  KV heads (H % Hkv == 0; head h reads KV head h // (H // Hkv))
    D    head_dim               S    rows of the KV (the valid ones are the first seq_len)
    T    query tokens (prefill) NB   blocks = ceil(seq_len / block_size)
    BS   block_size             K    chosen blocks per head = min(k_blocks, NB)
    GS   q8 group_size
"""
import numpy as np

from . import _checks as ck
from . import _ffi
from .errors import ArgumentError, ArgumentTypeError
from ._ffi import ffi, lib
from ._operands import (check_pair, check_seq_len, importance_array, kv_operand, kv_pair,
                        query, scale_value)
from .metadata import BlockBounds, ChannelCopy, ProbeRows, block_bounds, channel_copy
from .q8 import Q8
from .selection import n_probe_value, selection


_READS = {"bounds": "minmax", "probe_rows": "probe", "channels": "channels"}
# The metadata a scoring cannot run without, made for the call when the
# caller gives none: (argument, class, the function that makes it).
_MADE_FOR_THE_CALL = {"minmax": ("bounds", BlockBounds, block_bounds),
                      "channels": ("channels", ChannelCopy, channel_copy)}


def metadata_structs(sel, k, kop, seq_len, bounds, probe_rows, channels=None):
    """The metadata struct (sa_bounds for minmax, sa_channels for channels)
    and the sa_probe_rows (or None) a selection reads in this call, from
    the caller's objects, checked against the call; minmax without bounds
    computes them now, and channel scoring without a channel copy makes it
    (each a read of K's seq_len rows).  Returns (metadata struct,
    probe-rows struct, what keeps them alive)."""
    given = dict(bounds=bounds, probe_rows=probe_rows, channels=channels)
    for name, value in given.items():
        if value is not None and sel.scoring != _READS[name]:
            raise ArgumentError(f"{name}= is only read with scoring={_READS[name]!r}")
    made = _MADE_FOR_THE_CALL.get(sel.scoring)
    if made is not None:
        name, kind, make = made
        meta = given[name]
        if meta is None:
            meta = make(k, block_size=sel.block_size, seq_len=seq_len)
        elif not isinstance(meta, kind):
            raise ArgumentTypeError(f"{name} must be a {kind.__name__} (see {make.__name__}), "
                                    f"got {type(meta).__name__}")
        else:
            meta.check_for(kop, seq_len, sel.block_size)
        return meta.struct(), None, meta
    if probe_rows is None:
        return None, None, None
    if not isinstance(probe_rows, ProbeRows):
        raise ArgumentTypeError(f"probe_rows must be a ProbeRows (see probe_rows), got "
                                f"{type(probe_rows).__name__}")
    probe_rows.check_for(kop, seq_len, sel)
    return None, probe_rows.struct(), probe_rows


def _importance_args(importance):
    if importance is None:
        return ffi.NULL, 0
    return _ffi.ptr(importance, "float"), importance.shape[0]


def sparse_call(q, n_heads, kop, vop, seq_len, sel, importance, bounds_st, probe_st, scale,
                threads, return_blocks):
    """One sa_sparse_decode over checked operands (the cache's path too)."""
    out = np.empty((n_heads, kop.head_dim), np.float32)
    blocks = np.empty((n_heads, sel.n_selected(seq_len)), np.int32) if return_blocks else None
    imp, n_imp = _importance_args(importance)
    rc = lib.sa_sparse_decode(
        _ffi.ptr(q, "float"), n_heads, kop.struct, vop.struct, seq_len,
        sel.params(bounds_st, probe_st), imp, n_imp, scale, _ffi.out_ptr(out, "float"),
        _ffi.out_ptr(blocks, "int32_t") if return_blocks else ffi.NULL, threads)
    _ffi.check(rc, "sparse_decode")
    return (out, blocks) if return_blocks else out


def batch_call(calls, threads):
    """One sa_decode_batch over checked operands (package-internal: the
    transformers backend's decode step of a batch).  ``calls``: per
    sequence ``(q, n_heads, kop, vop, seq_len, params, importance, scale,
    out)``, ``q`` and ``out`` cffi float pointers the caller keeps alive,
    ``params`` a selection struct (None: dense decode) and ``importance``
    a float32 array or None.  Raises naming the sequence that failed."""
    arr = ffi.new("sa_decode_call[]", len(calls))
    for c, (q, n_heads, kop, vop, seq_len, params, importance, scale, out) in zip(arr, calls):
        c.q, c.n_heads, c.k, c.v, c.seq_len = q, n_heads, kop.struct, vop.struct, seq_len
        c.scale, c.out = scale, out
        if params is not None:
            c.params = params
            c.importance, c.n_importance = _importance_args(importance)
    failed = ffi.new("int *")
    rc = lib.sa_decode_batch(arr, len(calls), threads, failed)
    _ffi.check(rc, f"decode of sequence {failed[0]} of the batch")


def probe_scores(q, k, *, seq_len=None, block_size=32, n_probe=8, threads=None):
    """The probe of spec §2.2: per head and block, the largest raw dot
    ``q_h . K[kh, pos]`` over the block's sampled positions.

    Block ``b`` covers ``[b*BS, min((b+1)*BS, seq_len))``; with
    ``step = max(1, len // n_probe)`` the sampled positions are
    ``p0, p0+step, ...`` inside the block.  No scale is applied; for q8 K the
    query is quantised and the int8 x int8 dot of spec §4 is used.

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
    q, n_heads = query(q, kop, 2)
    seq_len = check_seq_len(seq_len, kop)
    block_size = ck.check_int("block_size", block_size, minimum=1)
    n_probe = n_probe_value(n_probe, block_size)
    threads = ck.check_threads(threads)
    out = np.empty((n_heads, -(-seq_len // block_size)), np.float32)
    rc = lib.sa_probe_scores(_ffi.ptr(q, "float"), n_heads, kop.struct, seq_len, block_size,
                             n_probe, _ffi.out_ptr(out, "float"), threads)
    _ffi.check(rc, "probe_scores")
    return out


def select_blocks(q, k, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, policy="seed", importance_fraction=None,
                  sink_blocks=None, share=None, scoring=None, n_channels=None, bounds=None,
                  probe_rows=None, channels=None, threads=None):
    """Choose the blocks each query head attends to (spec §2 steps 1-5, §6).

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
    q : float32 ``[H, D]`` (any strides)
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
    q, n_heads = query(q, kop, 2)
    seq_len = check_seq_len(seq_len, kop)
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, n_probe=n_probe,
                    recency=recency, importance_fraction=importance_fraction,
                    sink_blocks=sink_blocks, share=share, scoring=scoring, n_channels=n_channels)
    bst, pst, keep = metadata_structs(sel, k, kop, seq_len, bounds, probe_rows, channels)
    importance = importance_array(importance, seq_len)
    threads = ck.check_threads(threads)
    blocks = np.empty((n_heads, sel.n_selected(seq_len)), np.int32)
    imp, n_imp = _importance_args(importance)
    rc = lib.sa_select_blocks(_ffi.ptr(q, "float"), n_heads, kop.struct, seq_len,
                              sel.params(bst, pst), imp, n_imp,
                              _ffi.out_ptr(blocks, "int32_t"), threads)
    _ffi.check(rc, "select_blocks")
    del keep
    return blocks


def sparse_decode(q, k, v, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, scale=None, policy="seed",
                  importance_fraction=None, sink_blocks=None, share=None, scoring=None,
                  n_channels=None, bounds=None, probe_rows=None, channels=None, threads=None,
                  return_blocks=False):
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
    q : float32 ``[H, D]`` (any strides)
    k, v : float32 ``[Hkv, S, D]`` or Q8 (both the same kind); without
        ``seq_len`` both must hold the same number of rows
    scale : float, default ``1/sqrt(D)``
    return_blocks : bool, default False; also return the ``[H, K]`` blocks
    others : as :func:`select_blocks`

    Returns
    -------
    out : float32 ``[H, D]``, and ``blocks`` int32 ``[H, K]`` if ``return_blocks``.
    """
    kop, vop, seq_len = kv_pair(k, v, seq_len)
    q, n_heads = query(q, kop, 2)
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, n_probe=n_probe,
                    recency=recency, importance_fraction=importance_fraction,
                    sink_blocks=sink_blocks, share=share, scoring=scoring, n_channels=n_channels)
    bst, pst, keep = metadata_structs(sel, k, kop, seq_len, bounds, probe_rows, channels)
    importance = importance_array(importance, seq_len)
    scale = scale_value(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    return_blocks = ck.check_bool("return_blocks", return_blocks)
    result = sparse_call(q, n_heads, kop, vop, seq_len, sel, importance, bst, pst, scale,
                         threads, return_blocks)
    del keep
    return result


def dense_call(q, n_heads, kop, vop, seq_len, scale, threads):
    out = np.empty((n_heads, kop.head_dim), np.float32)
    rc = lib.sa_dense_decode(_ffi.ptr(q, "float"), n_heads, kop.struct, vop.struct, seq_len,
                             scale, _ffi.out_ptr(out, "float"), threads)
    _ffi.check(rc, "dense_decode")
    return out


def dense_decode(q, k, v, *, seq_len=None, scale=None, threads=None):
    """Exact attention of one query token over all ``seq_len`` keys.

    ``out[h] = softmax(scale * K[kh, :seq_len] @ q[h]) @ V[kh, :seq_len]``.

    Parameters
    ----------
    q : float32 ``[H, D]`` (any strides)
    k, v : float32 ``[Hkv, S, D]`` or Q8
    seq_len : int, default ``S``
    scale : float, default ``1/sqrt(D)``

    Returns
    -------
    float32 ``[H, D]``
    """
    kop, vop, seq_len = kv_pair(k, v, seq_len)
    q, n_heads = query(q, kop, 2)
    scale = scale_value(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    return dense_call(q, n_heads, kop, vop, seq_len, scale, threads)


def prefill(q, k, v, *, start=0, scale=None, k_blocks=None, block_size=32, n_probe=None,
            importance=None, recency=True, policy="seed", importance_fraction=None,
            sink_blocks=None, share=None, scoring=None, n_channels=None, bounds=None,
            probe_rows=None, channels=None, exact_tail=0, threads=None):
    """Causal attention for T query tokens, exact (spec §3) or sparse (§7),
    and the importance of what ran.

    The queries sit at positions ``[start, start+T)``; the query at position
    ``p`` attends to keys ``0..p``.  ``k`` and ``v`` must hold at least
    ``start+T`` rows (the keys of this chunk included).

    With ``k_blocks`` set, prefill is sparse, the seed's way: the rows of KV
    block ``b`` (positions ``[b*BS, (b+1)*BS)``) attend to their own block
    causally plus, when ``b >= k_blocks``, the ``k_blocks - 1`` blocks before
    ``b`` that the decode rules choose (:func:`select_blocks`: sinks,
    importance reserve, score fill, recency insurance, with this call's
    policy and knobs), scored with each head's mean query row over block
    ``b``'s rows in this call; when ``b < k_blocks`` they attend to every
    earlier block, so they are exact.  ``exact_tail=n`` makes the blocks
    holding the call's last ``n`` rows exact too: a prompt that ends with its
    question lets those rows, which the next token is made from, read every
    key (``n=64`` kept every needle answer on SmolLM2 where the plain rule
    lost 4 of 18; sparse-attn eval, CHANGELOG.md).  With ``k_blocks >= NB`` the output is
    bitwise exact prefill's.  ``importance`` is what was recorded before
    this call (a cache's, from earlier chunks): the reserve ranks the block
    sums of ``importance[:start]``.

    Parameters
    ----------
    q : float32 ``[H, T, D]`` (any strides)
    k, v : float32 ``[Hkv, S, D]`` or Q8, ``S >= start + T``
    start : int, default 0
    scale : float, default ``1/sqrt(D)``
    k_blocks : int or None (exact), default None
    importance : float32 ``[>= start]`` or None; read only when sparse
    bounds : BlockBounds over exactly ``start + T`` rows, for ``"minmax"``
        (None computes them, reading all of K)
    probe_rows : ProbeRows covering ``start + T`` rows, for ``"probe"``
    exact_tail : int >= 0, default 0; read only when sparse.  The blocks
        from the one holding position ``start + T - exact_tail`` on are
        exact; those rows are exact prefill's bit for bit
    others : as :func:`select_blocks`; read only when sparse

    Returns
    -------
    out : float32 ``[H, T, D]``
    importance : float32 ``[start+T]``; ``importance[s] = sum over heads h and
        rows t of P_h[t, s]``, the attention mass key s received from the
        probabilities that ran.  A caller that prefills in chunks adds the
        chunks' importance up.
    """
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    check_pair(kop, vop)
    q, n_heads = query(q, kop, 3)
    start = ck.check_int("start", start, minimum=0)
    T = q.shape[1]
    if start + T > min(kop.rows, vop.rows):
        raise ArgumentError(f"start + T ({start} + {T}) is beyond the KV, which holds "
                            f"{min(kop.rows, vop.rows)} rows")
    scale = scale_value(scale, kop.head_dim)
    threads = ck.check_threads(threads)
    exact_tail = ck.check_int("exact_tail", exact_tail, minimum=0)
    if k_blocks is None:
        for name, value in (("importance", importance), ("bounds", bounds),
                            ("probe_rows", probe_rows), ("channels", channels)):
            if value is not None:
                raise ArgumentError(f"{name}= is only read by sparse prefill (k_blocks=...)")
        return prefill_call(q, n_heads, kop, vop, start, None, None, scale, threads)
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, n_probe=n_probe,
                    recency=recency, importance_fraction=importance_fraction,
                    sink_blocks=sink_blocks, share=share, scoring=scoring, n_channels=n_channels)
    bst, pst, keep = metadata_structs(sel, k, kop, start + T, bounds, probe_rows, channels)
    importance = importance_array(importance, start, "start")
    result = prefill_call(q, n_heads, kop, vop, start, sel.params(bst, pst, exact_tail),
                          importance, scale, threads)
    del keep
    return result


def prefill_call(q, n_heads, kop, vop, start, params, prior, scale, threads):
    """One sa_prefill over checked operands (the cache's path too); params
    None is exact prefill."""
    T = q.shape[1]
    out = np.empty(q.shape, np.float32)
    importance = np.empty(start + T, np.float32)
    imp, n_imp = _importance_args(prior)
    rc = lib.sa_prefill(_ffi.ptr(q, "float"), n_heads, T, kop.struct, vop.struct, start,
                        ffi.NULL if params is None else params, imp, n_imp, scale,
                        _ffi.out_ptr(out, "float"), _ffi.out_ptr(importance, "float"), threads)
    _ffi.check(rc, "prefill")
    return out, importance


# --------------------------------------------------------------------------- kernels alone

def _contiguous_q8(name, x, ndim):
    if not isinstance(x, Q8):
        raise ArgumentTypeError(f"{name} must be a Q8 (see quantize_q8), got "
                                f"{type(x).__name__}")
    if x.data.ndim != ndim:
        raise ArgumentError(f"{name} must have {ndim} dimension(s), got shape {x.shape}")
    if 0 in x.shape:
        raise ArgumentError(f"{name} is empty (shape {x.shape})")
    return np.ascontiguousarray(x.data), np.ascontiguousarray(x.scales)


def q8_dot(q, rows):
    """The int8 x int8 dot of spec §4 of one quantised query against rows.

    Parameters
    ----------
    q : Q8 of shape ``[D]``
    rows : Q8 of shape ``[N, D]``, same group_size (any strides)

    Returns
    -------
    float32 ``[N]``: ``sum_g d_q,g * d_k,g * sum_{i in g} q_i k_i``.
    """
    qd, qs = _contiguous_q8("q", q, 1)
    rd, rs = _contiguous_q8("rows", rows, 2)
    if rows.shape[1] != q.shape[0]:
        raise ArgumentError(f"q must be [D] and rows [N, D], got {q.shape} and {rows.shape}")
    if q.group_size != rows.group_size:
        raise ArgumentError(f"q and rows must share group_size, got {q.group_size} "
                            f"and {rows.group_size}")
    ck.check_int("rows' length N", rows.shape[0])
    ck.check_int("D", q.shape[0])
    out = np.empty(rows.shape[0], np.float32)
    rc = lib.sa_kernel_q8_dot(_ffi.ptr(qd, "int8_t"), _ffi.ptr(qs, "float"), q.shape[0],
                              q.group_size, _ffi.ptr(rd, "int8_t"), _ffi.ptr(rs, "float"),
                              rows.shape[0], _ffi.out_ptr(out, "float"))
    _ffi.check(rc, "q8_dot")
    return out


def accumulate_v(p, v, out=None):
    """V accumulation: ``out += sum_t p[t] * v[t]`` in token order.

    Parameters
    ----------
    p : float32 ``[N]`` (any strides; N may be 0: nothing is added)
    v : float32 ``[N, D]`` or Q8 ``[N, D]`` (in decode's q8 V order for the
        kernels in use, spec §4)
    out : float32 ``[D]``, C-contiguous and writable, to add into; or None
        for zeros

    Returns
    -------
    float32 ``[D]`` (``out`` itself when given)
    """
    p = ck.as_array("p", p, dtype=np.float32, ndim=1, allow_empty=True)
    if isinstance(v, Q8):
        if v.data.ndim != 2:
            raise ArgumentError(f"v must be [N, D], got {v.shape}")
        n, dim = v.shape
    else:
        ck.as_array("v", v, dtype=np.float32, ndim=2, allow_empty=True)
        n, dim = v.shape
    if dim == 0:
        raise ArgumentError(f"v must have a non-empty last axis, got shape {v.shape}")
    if p.shape[0] != n:
        raise ArgumentError(f"p has {p.shape[0]} weights for {n} rows of v")
    if out is None:
        out = np.zeros(dim, np.float32)
    else:
        ck.check_output("out", out, dtype=np.float32, shape=(dim,))
    if n == 0:
        return out
    if isinstance(v, Q8):
        vd, vs = np.ascontiguousarray(v.data), np.ascontiguousarray(v.scales)
        vop = kv_operand("v", Q8._wrap(vd[None], vs[None], v.group_size))
    else:
        vop = kv_operand("v", np.ascontiguousarray(v)[None])
    if not np.isfinite(p).all():
        raise ArgumentError("p holds NaN or Inf values")
    rc = lib.sa_kernel_accumulate_v(_ffi.ptr(p, "float"), vop.struct, n,
                                    _ffi.out_ptr(out, "float"))
    _ffi.check(rc, "accumulate_v")
    return out

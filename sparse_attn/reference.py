"""The numpy reference: docs/spec.md written as plain numpy, float64 inside.

This is what the tests trust.  It is written to be read next to the spec,
not to be fast; every function takes the same arguments as its C-backed
twin in ``sparse_attn`` (without ``threads``).  q8 quantisation is done in
float32 exactly as the C core does it, so that q8 results can be compared
against "a reference that quantizes the same way" (spec §5).
"""
import math

import numpy as np

from .metadata import BlockBounds
from .q8 import Q8
from .selection import selection


# --------------------------------------------------------------------------- §4 q8

def round_half_away(x):
    """C's roundf: round to nearest, ties away from zero (exact in float32)."""
    whole = np.trunc(x)
    frac = x - whole                       # exact for float32
    return whole + np.where(np.abs(frac) >= 0.5, np.sign(x), 0).astype(x.dtype)


def quantize_q8(x, group_size=32):
    x = np.asarray(x, np.float32)
    groups = x.reshape(x.shape[:-1] + (-1, group_size))
    amax = np.abs(groups).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    # id = 1 / d, or 0 where that is not finite: d = 0, or d below
    # 1 / FLT_MAX, where 0 * Inf would be NaN
    with np.errstate(divide="ignore", over="ignore"):
        inv = (np.float32(1) / d).astype(np.float32)
    inv = np.where(np.isfinite(inv), inv, np.float32(0)).astype(np.float32)
    q = round_half_away((groups * inv[..., None]).astype(np.float32))
    q = np.clip(q, -127, 127).astype(np.int8).reshape(x.shape)
    return Q8(q, d, group_size)


def q8_dot(q, rows):
    """spec §4 dot of a Q8 [D] with Q8 rows [N, D], float64."""
    g = q.group_size
    qi = q.data.astype(np.int64).reshape(-1, g)
    ri = rows.data.astype(np.int64).reshape(rows.shape[0], -1, g)
    isum = (ri * qi[None]).sum(axis=-1)                     # exact integer per group
    return (isum * (q.scales.astype(np.float64)[None] * rows.scales.astype(np.float64))).sum(-1)


def accumulate_v(p, v, out=None):
    vals = v.dequantize() if isinstance(v, Q8) else v
    res = np.asarray(p, np.float64) @ np.asarray(vals, np.float64)
    if out is not None:
        res = res + out
    return res


# --------------------------------------------------------------------------- helpers

def _kv_head_dot(q_h, kv, kh, rows):
    """Raw dot of one query head with K[kh, rows] (q8: the quantised dot)."""
    if isinstance(kv, Q8):
        qq = quantize_q8(q_h.astype(np.float32), kv.group_size)
        return q8_dot(qq, Q8(kv.data[kh, rows], kv.scales[kh, rows], kv.group_size))
    return kv[kh, rows].astype(np.float64) @ q_h.astype(np.float64)


def _values(v, kh, rows):
    if isinstance(v, Q8):
        return Q8(v.data[kh, rows], v.scales[kh, rows], v.group_size).dequantize().astype(np.float64)
    return v[kh, rows].astype(np.float64)


def _n_kv(kv):
    return kv.shape[0]


def _rows(kv):
    return kv.shape[1]


def _block_bounds(b, block_size, seq_len):
    return b * block_size, min((b + 1) * block_size, seq_len)


# --------------------------------------------------------------------------- §2

def probe_scores(q, k, *, seq_len=None, block_size=32, n_probe=8):
    n_probe = block_size if n_probe == "all" else n_probe
    seq_len = _rows(k) if seq_len is None else seq_len
    n_heads, group = q.shape[0], q.shape[0] // _n_kv(k)
    nb = math.ceil(seq_len / block_size)
    probe = np.empty((n_heads, nb))
    for h in range(n_heads):
        for b in range(nb):
            p0, p_end = _block_bounds(b, block_size, seq_len)
            step = max(1, (p_end - p0) // n_probe)
            positions = np.arange(p0, p_end, step)
            probe[h, b] = _kv_head_dot(q[h], k, h // group, positions).max()
    return probe


def _greedy(values, used, count):
    """Pick `count` unused indices by largest value, ties to the lower index."""
    picks = []
    for _ in range(count):
        best = None
        for j in range(len(values)):
            if used[j]:
                continue
            if best is None or values[j] > values[best]:
                best = j
        if best is None:
            break
        used[best] = True
        picks.append(best)
    return picks


def _choose(score, nb, k_blocks, imp_sum, recency, reserve, sink_blocks):
    """spec §2 steps 3-5 with §6's sinks and reserve size, for one score row."""
    total = min(k_blocks, nb)
    used = [False] * nb
    chosen = []
    for b in range(min(sink_blocks, total)):
        used[b] = True
        chosen.append(b)
    if imp_sum is not None:
        chosen += _greedy(imp_sum, used, min(reserve, total - len(chosen)))
    fill = _greedy(score, used, total - len(chosen))
    if recency and fill and not used[nb - 1]:
        fill[-1] = nb - 1          # the last fill pick: lowest score, higher index on ties
    return sorted(chosen + fill)


# --------------------------------------------------------------------------- §6 minmax

def block_bounds(k, *, block_size=32, seq_len=None, scale_group=None):
    """Per-block key bounds, int8 with a float32 scale per channel group,
    rounded outwards (float32 arithmetic, as the C core)."""
    seq_len = _rows(k) if seq_len is None else seq_len
    if isinstance(k, Q8):
        group_size = scale_group or k.group_size
        keys = Q8(k.data[:, :seq_len], k.scales[:, :seq_len], k.group_size).dequantize()
    else:
        group_size = scale_group or (32 if k.shape[2] % 32 == 0 else k.shape[2])
        keys = k[:, :seq_len]
    hkv, _, dim = keys.shape
    nb = math.ceil(seq_len / block_size)
    f32 = np.float32
    mn = np.zeros((hkv, nb, dim), np.int8)
    mx = np.zeros((hkv, nb, dim), np.int8)
    scales = np.zeros((hkv, nb, dim // group_size), f32)
    for b in range(nb):
        rows = keys[:, b * block_size:(b + 1) * block_size]
        lo, hi = rows.min(axis=1), rows.max(axis=1)                     # [hkv, dim]
        amax = np.maximum(np.abs(lo), np.abs(hi)).reshape(hkv, -1, group_size).max(-1)
        s = (amax / f32(127)).astype(f32)
        s = np.where(f32(127) * s < amax, np.nextafter(s, f32(np.inf)), s).astype(f32)
        scales[:, b] = s
        sv = np.repeat(s, group_size, axis=1)
        safe = np.where(sv == 0, f32(1), sv)
        up, down = np.ceil(hi / safe), np.floor(lo / safe)
        up = np.where(up * safe < hi, up + 1, up)                        # outward rounding
        down = np.where(down * safe > lo, down - 1, down)
        mx[:, b] = np.where(sv == 0, 0, np.clip(up, -127, 127))
        mn[:, b] = np.where(sv == 0, 0, np.clip(down, -127, 127))
    return BlockBounds(mn, mx, scales, block_size, group_size, seq_len)


def minmax_scores(q, bounds):
    """Quest's bound per head and block: sum_i max(q_i * mn_i, q_i * mx_i)."""
    g = bounds.scale_group
    scale = np.repeat(bounds.scales.astype(np.float64), g, axis=2)     # [hkv, nb, dim]
    lo, hi = bounds.mn * scale, bounds.mx * scale
    group = q.shape[0] // bounds.mn.shape[0]
    out = []
    for h in range(q.shape[0]):
        qh = q[h].astype(np.float64)
        kh = h // group
        out.append(np.maximum(qh * lo[kh], qh * hi[kh]).sum(axis=1))
    return np.array(out)


# --------------------------------------------------------------------------- §6 channels

def channel_copy(k, *, block_size=32, seq_len=None):
    """The channel-major copy: per KV head, block and channel the block's
    values of the channel (dequantised for q8) as one q8 group of
    block_size values, missing rows of a partial block as zeros.  Returns
    (int8 [Hkv, D, NB, BS], float32 scales [Hkv, D, NB])."""
    seq_len = _rows(k) if seq_len is None else seq_len
    keys = (Q8(k.data[:, :seq_len], k.scales[:, :seq_len], k.group_size).dequantize()
            if isinstance(k, Q8) else np.asarray(k[:, :seq_len], np.float32))
    hkv, _, dim = keys.shape
    nb = math.ceil(seq_len / block_size)
    padded = np.zeros((hkv, nb * block_size, dim), np.float32)
    padded[:, :seq_len] = keys
    blocks = padded.reshape(hkv, nb, block_size, dim).transpose(0, 3, 1, 2)
    q8 = quantize_q8(np.ascontiguousarray(blocks), group_size=block_size)
    return q8.data, q8.scales[..., 0]


def top_channels(q_group, n_channels):
    """The n_channels channels of largest summed |q| over a group's heads
    (summed in float32 in head order), ties to the lower channel, ascending."""
    a = np.zeros(q_group.shape[1], np.float32)
    for row in q_group:
        a = (a + np.abs(row.astype(np.float32))).astype(np.float32)
    order = np.argsort(-a, kind="stable")           # stable: ties to the lower channel
    return np.sort(order[:min(n_channels, len(a))])


def channel_scores(q, copy, n_channels, *, block_size=32, seq_len):
    """Per head and block the max over the block's valid rows of
    sum_j (q_c * s_c) * d_c[t] over the group's channels c (float64)."""
    data, scales = copy
    n_heads, group = q.shape[0], q.shape[0] // data.shape[0]
    nb = math.ceil(seq_len / block_size)
    out = np.empty((n_heads, nb))
    for kh in range(data.shape[0]):
        idx = top_channels(q[kh * group:(kh + 1) * group], n_channels)
        for h in range(kh * group, (kh + 1) * group):
            w = (q[h, idx, None].astype(np.float32) * scales[kh, idx, :nb]).astype(np.float64)
            acc = np.einsum("cb,cbt->bt", w, data[kh, idx, :nb].astype(np.float64))
            for b in range(nb):
                rows = min(block_size, seq_len - b * block_size)
                out[h, b] = acc[b, :rows].max()
    return out


def select_blocks(q, k, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, policy="seed", importance_fraction=None,
                  sink_blocks=None, share=None, scoring=None, n_channels=None, bounds=None):
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, n_probe=n_probe,
                    recency=recency, importance_fraction=importance_fraction,
                    sink_blocks=sink_blocks, share=share, scoring=scoring,
                    n_channels=n_channels)
    n_probe, sink_blocks, share, scoring = sel.n_probe, sel.sink_blocks, sel.share, sel.scoring
    seq_len = _rows(k) if seq_len is None else seq_len
    n_heads, group = q.shape[0], q.shape[0] // _n_kv(k)
    nb = math.ceil(seq_len / block_size)
    if scoring == "channels":
        probe = channel_scores(q, channel_copy(k, block_size=block_size, seq_len=seq_len),
                               sel.n_channels, block_size=block_size, seq_len=seq_len)
    elif scoring == "minmax":
        if bounds is None:
            bounds = block_bounds(k, block_size=block_size, seq_len=seq_len)
        probe = minmax_scores(q, bounds)
    else:
        probe = probe_scores(q, k, seq_len=seq_len, block_size=block_size, n_probe=n_probe)
    imp_sum = None
    if importance is not None:
        imp = np.asarray(importance[:seq_len], np.float64)
        imp_sum = [imp[slice(*_block_bounds(b, block_size, seq_len))].sum() for b in range(nb)]
    reserve = sel.importance_blocks
    out = []
    for h in range(n_heads):
        if share == "group":
            kh = h // group
            score = probe[kh * group:(kh + 1) * group].sum(axis=0)
        else:
            score = probe[h]
        out.append(_choose(list(score), nb, k_blocks, imp_sum, recency, reserve, sink_blocks))
    return np.array(out, np.int32)


def _attend(q_h, k, v, kh, tokens, scale):
    s = scale * _kv_head_dot(q_h, k, kh, tokens)
    p = np.exp(s - s.max())
    return (p @ _values(v, kh, tokens)) / p.sum(), p / p.sum()


def sparse_decode(q, k, v, *, seq_len=None, k_blocks=32, block_size=32, n_probe=None,
                  importance=None, recency=True, scale=None, policy="seed",
                  importance_fraction=None, sink_blocks=None, share=None, scoring=None,
                  n_channels=None, bounds=None, return_blocks=False):
    seq_len = _rows(k) if seq_len is None else seq_len
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[0] // _n_kv(k)
    blocks = select_blocks(q, k, seq_len=seq_len, k_blocks=k_blocks, block_size=block_size,
                           n_probe=n_probe, importance=importance, recency=recency,
                           policy=policy, importance_fraction=importance_fraction,
                           sink_blocks=sink_blocks, share=share, scoring=scoring,
                           n_channels=n_channels, bounds=bounds)
    out = np.empty(q.shape)
    for h in range(q.shape[0]):
        tokens = np.concatenate([np.arange(*_block_bounds(b, block_size, seq_len))
                                 for b in blocks[h]])
        out[h] = _attend(q[h], k, v, h // group, tokens, scale)[0]
    return (out, blocks) if return_blocks else out


def dense_decode(q, k, v, *, seq_len=None, scale=None):
    seq_len = _rows(k) if seq_len is None else seq_len
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[0] // _n_kv(k)
    return np.stack([_attend(q[h], k, v, h // group, np.arange(seq_len), scale)[0]
                     for h in range(q.shape[0])])


# --------------------------------------------------------------------------- §3, §7

def _mean_rows(x):
    """The mean of x's rows as the C core takes it: summed in float32 in row
    order, then times float32(1 / rows)."""
    acc = x[0].astype(np.float32).copy()
    for r in range(1, x.shape[0]):
        acc = (acc + x[r]).astype(np.float32)
    return (acc * np.float32(np.float32(1) / np.float32(x.shape[0]))).astype(np.float32)


def _tile_choice(q, k, start, T, b, sel, imp_sum, bounds, copy=None):
    """docs/spec.md §7: the blocks before block b that the rows of block b
    attend to, per head (ascending lists)."""
    bs = sel.block_size
    n_heads, group = q.shape[0], q.shape[0] // _n_kv(k)
    if b < sel.k_blocks:
        return [list(range(b))] * n_heads
    r0, r1 = max(start, b * bs), min(start + T, (b + 1) * bs)
    rep = np.stack([_mean_rows(q[h, r0 - start:r1 - start]) for h in range(n_heads)])
    if sel.scoring == "minmax":
        sub = BlockBounds(bounds.mn[:, :b], bounds.mx[:, :b], bounds.scales[:, :b], bs,
                          bounds.scale_group, b * bs)
        score = minmax_scores(rep, sub)
    elif sel.scoring == "channels":
        score = channel_scores(rep, copy, sel.n_channels, block_size=bs, seq_len=b * bs)
    else:
        score = probe_scores(rep, k, seq_len=b * bs, block_size=bs, n_probe=sel.n_probe)
    sums = None if imp_sum is None else imp_sum[:b]
    out = []
    for h in range(n_heads):
        if sel.share == "group":
            kh = h // group
            row = score[kh * group:(kh + 1) * group].sum(axis=0)
        else:
            row = score[h]
        out.append(_choose(list(row), b, sel.k_blocks - 1, sums, sel.recency,
                           sel.importance_blocks, sel.sink_blocks))
    return out


def prefill(q, k, v, *, start=0, scale=None, k_blocks=None, block_size=32, n_probe=None,
            importance=None, recency=True, policy="seed", importance_fraction=None,
            sink_blocks=None, share=None, scoring=None, n_channels=None, bounds=None,
            exact_tail=0):
    """§3 exact prefill (k_blocks None) or §7 sparse prefill; returns
    (out, importance of this call)."""
    n_heads, T, D = q.shape
    S = start + T
    scale = 1 / math.sqrt(D) if scale is None else scale
    group = n_heads // _n_kv(k)
    out = np.empty(q.shape)
    imp_out = np.zeros(S)
    if k_blocks is None:
        for h in range(n_heads):
            for t in range(T):
                keys = np.arange(start + t + 1)
                out[h, t], p = _attend(q[h, t], k, v, h // group, keys, scale)
                imp_out[keys] += p
        return out, imp_out
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, n_probe=n_probe,
                    recency=recency, importance_fraction=importance_fraction,
                    sink_blocks=sink_blocks, share=share, scoring=scoring,
                    n_channels=n_channels)
    bs = sel.block_size
    if sel.scoring == "minmax" and bounds is None:
        bounds = block_bounds(k, block_size=bs, seq_len=S)
    copy = channel_copy(k, block_size=bs, seq_len=S) if sel.scoring == "channels" else None
    imp_sum = None
    if importance is not None:
        prior = np.asarray(importance[:start], np.float64)
        imp_sum = [prior[b * bs:(b + 1) * bs].sum() for b in range(-(-S // bs))]
    tail_block = (S - exact_tail) // bs if exact_tail > 0 else None
    for b in range(start // bs, -(-S // bs)):
        if tail_block is not None and b >= tail_block:
            chosen = [list(range(b))] * n_heads       # §7: the exact tail
        else:
            chosen = _tile_choice(q, k, start, T, b, sel, imp_sum, bounds, copy)
        for h in range(n_heads):
            before = [np.arange(c * bs, (c + 1) * bs) for c in chosen[h]]
            for pos in range(max(start, b * bs), min(S, (b + 1) * bs)):
                keys = np.concatenate(before + [np.arange(b * bs, pos + 1)])
                out[h, pos - start], p = _attend(q[h, pos - start], k, v, h // group, keys,
                                                 scale)
                imp_out[keys] += p
    return out, imp_out


# --------------------------------------------------------------------------- llama.cpp's op

def ggml_flash_attn(q, k, v, mask, scale, *, k_blocks=None, policy=None, block_size=32,
                    n_probe=None, recency=True, importance_fraction=None, sink_blocks=None,
                    share=None, scoring=None, return_blocks=False):
    """llama.cpp's attention op (``GGML_OP_FLASH_ATTN_EXT``, without ALiBi,
    softcap or sinks) over arrays in its layouts, as
    ``sparse_attn._ggml.flash_attn_ext`` takes them: q float32
    ``(ns, H, n_q, D)``, k and v float16 or ``BLOCK_Q8_0``
    ``(ns, Hkv, n_kv, ...)``, mask float16 ``(m3, m2, >= n_q, >= n_kv)`` or
    None.  Per stream s, head h (KV head ``h // (H // Hkv)``) and query row
    i: the cells whose mask value is not -inf, scores
    ``scale * q.k + mask``, softmax, times V; zeros when no cell is left.
    Q8_0 K is dotted as spec §4 dots q8: the query row quantised as q8 with
    groups of 32, the integer sums times both scales.

    With ``k_blocks`` (spec §8), a call of at most 4 rows whose mask has one
    plane for all heads reads, per row, only the blocks :func:`select_blocks`
    chooses over the row's valid cells (its sequence) with the stateless
    selection; ``return_blocks`` also returns them as
    ``_ggml.flash_attn_ext`` does."""
    from ._ggml import BLOCK_Q8_0, Q8_0_GROUP, dequantize_q8_0, q8_0_parts
    from .selection import stateless_selection

    ns, H, n_q, D = q.shape
    Hkv, n_kv = k.shape[1], k.shape[2]
    group = H // Hkv
    q8 = k.dtype == BLOCK_Q8_0
    vals = (dequantize_q8_0(v) if q8 else v).astype(np.float64)
    sel = None
    if k_blocks is not None:
        sel = stateless_selection(policy, k_blocks=k_blocks, block_size=block_size,
                                  n_probe=n_probe, recency=recency,
                                  importance_fraction=importance_fraction,
                                  sink_blocks=sink_blocks, share=share, scoring=scoring)
    sparse = sel is not None and n_q <= 4 and (mask is None or mask.shape[1] == 1)
    out = np.zeros((ns, n_q, H, D))
    blocks = np.full((ns, n_q, H, sel.k_blocks if sel else 0), -1, np.int32)

    def kv_rows(s, kh, cells):
        """K[s, kh, cells] as reference.py's K of one KV head: float32 or Q8."""
        if not q8:
            return k[s, kh, cells].astype(np.float32)[None]
        data, scales = q8_0_parts(k[s, kh, cells])
        return Q8(data[None], scales[None], Q8_0_GROUP)

    for s in range(ns):
        for i in range(n_q):
            if mask is None:
                bias = np.zeros((H, n_kv))
            else:
                bias = np.stack([mask[s % mask.shape[0], h % mask.shape[1], i, :n_kv]
                                 for h in range(H)]).astype(np.float64)
            choice = {}                                          # per KV head: its heads' picks
            for h in range(H):
                kh = h // group
                cells = np.flatnonzero(bias[h] != -np.inf)       # the row's sequence
                if len(cells) == 0:
                    continue
                chosen = np.arange(len(cells))
                if sparse:
                    nb = -(-len(cells) // sel.block_size)
                    if nb <= sel.k_blocks:
                        blocks[s, i, h, :nb] = np.arange(nb)
                    else:
                        g0 = kh * group
                        if kh not in choice:
                            choice[kh] = select_blocks(
                                q[s, g0:g0 + group, i], kv_rows(s, kh, cells),
                                seq_len=len(cells), k_blocks=sel.k_blocks,
                                block_size=sel.block_size, n_probe=sel.n_probe,
                                recency=sel.recency, policy="recall", importance_fraction=0.0,
                                sink_blocks=sel.sink_blocks, share=sel.share, scoring="probe")
                        picks = choice[kh][h - g0]
                        blocks[s, i, h, :len(picks)] = picks
                        chosen = np.concatenate([np.arange(b * sel.block_size,
                                                           min((b + 1) * sel.block_size,
                                                               len(cells)))
                                                 for b in picks])
                rows = cells[chosen]
                dots = _kv_head_dot(q[s, h, i], kv_rows(s, kh, rows), 0, slice(None))
                row = dots * np.float64(np.float32(scale)) + bias[h, rows]
                p = np.exp(row - row.max())
                out[s, i, h] = (p @ vals[s, kh][rows]) / p.sum()
    return (out, blocks) if return_blocks else out

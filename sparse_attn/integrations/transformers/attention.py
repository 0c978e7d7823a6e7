"""The attention function and mask transformers calls for attn_implementation="sparse_topk"."""
import math
import time

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from sparse_attn import _checks as ck, _ffi, decode_batch
from sparse_attn._ffi import ffi
from sparse_attn._operands import kv_pair, scale_value
from sparse_attn.attention import batch_call
from sparse_attn.decoder import Decoder, decode_rows
from sparse_attn.errors import ArgumentError, UnsupportedError

from .refusals import (CHECKED_KWARGS, QUERY_DTYPES, SLIDING_CHECKED_KWARGS, layer_kind,
                       refuse_kwargs, refuse_sliding, refuse_unsupported)
from .settings import settings_of
from .state import CacheState, _float32_kv, layer_state
from .tensors import KVPlaceholder, RowSpans


def sparse_topk_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                     mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """The ``AttentionMaskInterface`` entry of ``sparse_topk``.

    The kernels apply the causal mask themselves (queries at ``[S - T, S)``),
    so the mask of the full-attention layers is None for one unpadded
    sequence, and for a batch or padding a :class:`RowSpans`: each
    sequence's real keys (one range, or the positions of a mask with holes:
    right padding followed by generated tokens, padding between tokens),
    which the attention attends as that sequence alone.  The sliding-window
    layers get the same while every query's window holds every key (a
    sequence no longer than the window, ``local_size``): they are then full
    attention layers; beyond it, sdpa's window mask, which their attention
    (torch's sdpa) applies exactly.  Anything else (chunked or bidirectional
    patterns, packed sequences, mask overlays, a pre-allocated cache)
    raises :class:`UnsupportedError`.
    """
    config = kwargs.get("config")
    q_offset = int(q_offset)
    if int(kv_offset) + kv_length != q_offset + q_length:
        # transformers' own caches hold what they report up to the last
        # query (a window's offset included); a pre-allocated layer reports
        # its whole length
        raise UnsupportedError(
            f"the cache reports kv_length {kv_length} at offset {int(kv_offset)} for "
            f"{q_length} queries after {q_offset} cached tokens: a pre-allocated (static) "
            "cache, which sparse_topk does not read. Use the default DynamicCache "
            "or sparse_attn.integrations.transformers.SparseKVCache")
    if mask_function is not causal_mask_function:
        window = kwargs.get("local_size")
        sliding = _sliding_window_of(mask_function)
        if sliding is not None and sliding == window and int(kv_offset) == 0 and \
                kv_length <= window:
            pass        # every query sees every key: plain causal attention
        elif window is not None and window == getattr(config, "sliding_window", None) and \
                getattr(config, "attention_chunk_size", None) != window:
            # beyond the window (or another pattern built on it): sdpa's
            # mask, which the sliding-window layers attend with sdpa
            kwargs["allow_is_causal_skip"] = False
            return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset,
                             kv_offset=kv_offset, mask_function=mask_function,
                             attention_mask=attention_mask, **kwargs)
        else:
            name = getattr(mask_function, "__qualname__", repr(mask_function))
            raise UnsupportedError(
                f"sparse_topk computes causal attention (and sliding windows); this model asked "
                f"for another mask pattern ({name}: chunked, bidirectional, packed sequences or "
                "an overlay): use attn_implementation='sdpa' for it")
    if int(kv_offset) != 0:
        raise UnsupportedError(
            f"the cache reports {kv_length} keys from offset {int(kv_offset)} for a layer "
            "sparse_topk attends in full: a windowed cache layer for a full-attention layer; "
            "use attn_implementation='sdpa' for this cache")
    if attention_mask is None:
        return None if batch_size == 1 else \
            RowSpans((0,) * batch_size, (kv_length,) * batch_size, kv_length)
    m = attention_mask
    if m.ndim != 2 or m.shape[0] != batch_size or m.shape[1] < kv_length:
        raise UnsupportedError(
            f"sparse_topk takes a 2D padding mask of [batch {batch_size}, {kv_length} tokens], "
            f"got shape {list(m.shape)}: use attn_implementation='sdpa' for other masks")
    if bool(m[:, :kv_length].all()):
        return None if batch_size == 1 else \
            RowSpans((0,) * batch_size, (kv_length,) * batch_size, kv_length)
    return RowSpans.from_mask(m, kv_length)


def _sliding_window_of(mask_function):
    """The window of transformers' sliding-window causal mask function
    (``sliding_window_causal_mask_function(w)``: the intersection of
    ``sliding_window_overlay(w)`` and ``causal_mask_function``), or None for
    any other function (an overlay or packed sequences built on it, too)."""
    try:
        if mask_function.__qualname__ != "and_masks.<locals>.and_mask":
            return None
        (parts,) = [c.cell_contents for c in mask_function.__closure__]
        overlay, causal = parts
        if causal is not causal_mask_function or \
                overlay.__qualname__ != "sliding_window_overlay.<locals>.inner_mask":
            return None
        (window,) = [c.cell_contents for c in overlay.__closure__]
    except (AttributeError, TypeError, ValueError):
        return None
    return window if type(window) is int and window > 0 else None


def _sliding_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A sliding-window layer: exact attention over its window, by torch's
    sdpa with the mask sparse_topk_mask made (what attn_implementation="sdpa"
    computes for it); its cache layer keeps the window as float tensors."""
    if kwargs and not SLIDING_CHECKED_KWARGS.isdisjoint(kwargs):
        refuse_kwargs(module, {k: v for k, v in kwargs.items() if k != "sliding_window"})
    refuse_sliding(module, query, key, dropout)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                                  scaling=scaling, **kwargs)


def sparse_topk_attention(module, query, key, value, attention_mask, scaling=None,
                          dropout=0.0, **kwargs):
    """The ``AttentionInterface`` function of ``attn_implementation="sparse_topk"``.

    Parameters
    ----------
    module : the attention module (``layer_idx``, ``config``, ``is_causal``, ``training``)
    query : ``[B, H, T, D]`` float32/bfloat16/float16 CPU tensor
    key, value : ``[B, Hkv, S, D]`` (after the cache update; ``S >= T``), or
        the K/V a :class:`SparseKVCache` returned
    attention_mask : what :func:`sparse_topk_mask` returns: None (one
        unpadded sequence; for ``B > 1``, none padded) or a
        :class:`RowSpans` (each sequence's unpadded keys)
    scaling : float, default ``module.scaling`` or ``1/sqrt(D)``
    dropout : must be 0

    Returns
    -------
    attn_output : ``[B, T, H, D]`` in the query's dtype (zeros at padded
        queries)
    attn_weights : None

    With ``profile=True`` in the settings, each call adds to
    ``module.sparse_attn_stats``: ``calls``, ``seconds`` (the whole call),
    ``kernel_seconds`` (inside the C calls) and, for decode, the same as
    ``decode_*``.
    """
    t0 = time.perf_counter()
    md = module.__dict__
    sliding = md.get("_sparse_attn_sliding")
    if sliding is None:
        sliding = md["_sparse_attn_sliding"] = layer_kind(module) == "sliding_attention"
    if sliding and not (attention_mask is None or type(attention_mask) is RowSpans):
        # beyond the window: sdpa's mask, which sdpa applies
        md.pop("_sparse_attn_cache", None)
        return _sliding_attention(module, query, key, value, attention_mask, scaling, dropout,
                                  kwargs)
    ph = value is key and isinstance(key, KVPlaceholder)
    if torch.is_grad_enabled() and (query.requires_grad or not ph and (
            key.requires_grad or value.requires_grad)):
        # a forward with grad mode on (the weights require grad): computed
        # without a graph; its output in the graph refuses a backward
        with torch.no_grad():
            out, _ = sparse_topk_attention(module, query, key, value, attention_mask,
                                           scaling=scaling, dropout=dropout, **kwargs)
        inputs = [t for t in ((query,) if ph else (query, key, value)) if t.requires_grad]
        return _NoBackward.apply(out, *inputs), None
    # the cache this module's forward was given, if its pre-hook noted it:
    # taken here, whatever the cache, so no later call finds it
    named = md.pop("_sparse_attn_cache", None)
    settings = md.get("sparse_attn") or settings_of(module)
    # One cheap test of everything refuse_unsupported checks; it runs (and
    # raises with the reason) only when the test fails.
    # (a SparseKVCache's q8 placeholder stands for K and V, on the CPU)
    qs, qdt = query.shape, query.dtype
    if not (md.get("_sparse_attn_checked") and attention_mask is None and not dropout
            and query.is_cpu and qdt in QUERY_DTYPES and qs[0] == 1
            and (ph or key.is_cpu)
            and key.shape[-1] == qs[-1] and (ph or value.shape[-1] == qs[-1])
            and not (ph and key._sparse_attn_layer._rows is not None)):
        refuse_unsupported(module, query, key, value, attention_mask, dropout)
        if attention_mask is not None or qs[0] != 1 or ph and \
                key._sparse_attn_layer._rows is not None:
            if kwargs and not CHECKED_KWARGS.isdisjoint(kwargs):
                refuse_kwargs(module, kwargs)
            return _attend_rows(module, query, key, value, attention_mask, scaling, named,
                                settings, ph, kwargs)
    if kwargs and not CHECKED_KWARGS.isdisjoint(kwargs):
        refuse_kwargs(module, kwargs)
    return _attend(module, md, query, key, value, scaling, named, settings, ph, t0, 0)


class _NoBackward(torch.autograd.Function):
    """sparse_topk's output in an autograd graph (a forward with grad mode
    on): the forward is the output computed without a graph, so the output
    requires grad as sdpa's would; a backward through it refuses."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise UnsupportedError(
            "sparse_topk has no backward pass: its forward runs with grad mode on, but "
            "training (or any gradient through attention) needs attn_implementation='sdpa'")


def _attend_rows(module, query, key, value, spans, scaling, named, settings, ph, kwargs):
    """A batch (or a padded sequence): each sequence attended as a batch of
    one over its real tokens (``spans``, a :class:`RowSpans`, or None:
    every token; a sequence with padding between its tokens is attended
    over its real tokens gathered in order), its output rows written in
    place of the batch's; a padded query's output is zeros (nothing reads
    it: no real token attends a padded one).  A sequence's output is
    bitwise what its real tokens get alone."""
    B, n_heads, T, D = query.shape
    S = key.shape[2]
    if spans is None:
        spans = RowSpans((0,) * B, (S,) * B, S)
    if len(spans) != B or spans.kv_length != S:
        raise UnsupportedError(
            f"the mask's spans are for {len(spans)} sequences of {spans.kv_length} tokens, the "
            f"call has {B} of {S}: make the mask with sparse_topk_mask for this call")
    layer = key._sparse_attn_layer if ph else None
    if key.shape[0] != B or value.shape[0] != B:
        raise UnsupportedError(f"query has a batch of {B}, key and value of {key.shape[0]} and "
                               f"{value.shape[0]}: one batch for all three")
    if layer is not None and layer._rows is None and B == 1:
        layer.prompt_as_row(S)      # one padded sequence: keep its real tokens only
    if layer is not None and (layer._rows is None or len(layer._rows) != B):
        raise UnsupportedError(f"a SparseKVCache layer of one sequence read by a batch of {B}")
    md = module.__dict__
    if layer is not None:
        _check_new_rows(layer, spans, S - T)
    if T == 1 and not (settings.record_blocks or settings.compare_exact):
        out = _decode_rows(module, query, layer, spans, scaling, settings) if layer else \
            _decode_views(module, query, key, value, spans, scaling, named, settings)
        if out is not None:
            return out, None
    out = torch.zeros((B, T, n_heads, D), dtype=query.dtype)
    blocks = [] if settings.record_blocks else None
    first = S - T           # the position of the call's first query
    try:
        for b in range(B):
            new = spans.new(b, first)       # the real new tokens, from first
            if new is None:                 # none: nothing to keep, nothing to attend
                if blocks is not None:
                    blocks.append(None)
                continue
            qb = query[b:b + 1, :, new]
            if layer is not None:
                kb, vb = layer.take_row(b, new)
                if kb.shape[2] != spans.count[b]:
                    raise UnsupportedError(
                        f"sequence {b} of the batch: its SparseKVCache row holds {kb.shape[2]} "
                        f"tokens but the mask gives it {spans.count[b]}: its padding changed "
                        "between calls")
                rph = vb is kb and isinstance(kb, KVPlaceholder)
            else:
                keys = spans.keys(b)
                kb, vb, rph = key[b:b + 1, :, keys], value[b:b + 1, :, keys], False
            if blocks is not None:
                md.pop("sparse_attn_blocks", None)
            o, _ = _attend(module, md, qb, kb, vb, scaling, named, settings, rph,
                           time.perf_counter(), b)
            out[b, new] = o[0]
            if blocks is not None:
                blocks.append(md.get("sparse_attn_blocks"))
        for b in range(B):
            pads = _padded_queries(spans, b, first, S)
            if pads:
                source = layer._rows[b].kv if layer is not None else \
                    (key[b:b + 1, :, spans.keys(b)], value[b:b + 1, :, spans.keys(b)])
                for c, rows in pads:
                    out[b, rows] = _attend_prefix(query[b, :, rows], source, c, module,
                                                  scaling, settings).to(out.dtype)
    finally:
        if layer is not None:
            layer.release_held()
    if blocks is not None and T == 1:
        md["sparse_attn_blocks"] = blocks
    return out, None


def _check_new_rows(layer, spans, first):
    """Check every sequence's real new tokens of a batched SparseKVCache
    update (held by the layer) as its KVCache's append would, before any
    row takes its own: a refusal names the sequence, and no row nor the
    layer's length has changed (the update is dropped, as a refused
    append's rows are).  One
    pass over the whole update; its sequences one by one only when that
    finds a value out of range (maybe at a padded position, not stored)."""
    k, v = layer._held
    limit = 2.0 ** _ffi.VALUE_LIMIT_LOG2
    if bool((k.detach().abs() < limit).all()) and bool((v.detach().abs() < limit).all()):
        return      # (NaN compares False)
    for b in range(len(spans)):
        new = spans.new(b, first)
        if new is None:
            continue
        for name, t in (("key", k), ("value", v)):
            if not bool((t[b, :, new].detach().abs() < limit).all()):
                layer.drop_held()
                raise ArgumentError(
                    f"sequence {b} of the batch: its new {name} states {_ffi._VALUES}; no "
                    "sequence's cache has changed")


def _padded_queries(spans, b, first, S):
    """Sequence b's padded queries in this call (positions ``[first, S)``)
    that have real keys before them, grouped by how many: ``[(c, rows)]``,
    ``rows`` an int64 tensor of positions counted from ``first`` whose
    preceding real keys are the sequence's first ``c``.  sdpa attends such
    a query (right padding; padding between tokens) over those keys, its
    own key being padding, and transformers reads it (``generate`` takes
    the next token of a right-padded prompt from its last position); a
    padded query with no real key before it gets zeros, as sdpa gives."""
    n = spans.count[b]
    if n == 0:
        return []
    idx = spans.index[b]
    if idx is None:         # right padding: every later query sees all n keys
        lo = max(spans.end[b], first)
        return [(n, torch.arange(lo - first, S - first))] if S > lo else []
    pos = torch.arange(first, S)
    real = torch.zeros(S - first, dtype=torch.bool)
    real[idx[idx >= first] - first] = True
    pad = pos[~real]
    c = torch.searchsorted(idx, pad)        # real keys before each padded query
    pad, c = pad[c > 0], c[c > 0]
    if not pad.numel():
        return []
    counts, sizes = torch.unique_consecutive(c, return_counts=True)
    return [(int(k), rows - first)
            for k, rows in zip(counts.tolist(), torch.split(pad, sizes.tolist()))]


def _attend_prefix(query, source, c, module, scaling, settings):
    """Exact attention of padded queries (``[H, m, D]``) over the first
    ``c`` real keys of their sequence, ``source``: its compacted K and V
    (``[1, Hkv, n, D]`` tensors) or its SparseKVCache row's KVCache.  One
    C call (every query a dense decode call of sa_decode_batch); no
    importance is recorded (nothing real attends).  ``[m, H, D]`` float32."""
    if isinstance(source, tuple):
        kop, vop, _ = kv_pair(_float32_kv("key", source[0]), _float32_kv("value", source[1]),
                              None)
    else:
        kop, vop, _ = kv_pair(source.k, source.v, None)
    H, m, D = query.shape
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(D)
    scale = scale_value(scaling, D)
    q = query.detach().transpose(0, 1).to(torch.float32).contiguous()
    out = torch.empty((m, H, D), dtype=torch.float32)
    qp, outp = ffi.cast("float *", q.data_ptr()), ffi.cast("float *", out.data_ptr())
    batch_call([(qp + i * H * D, H, kop, vop, c, None, None, scale, outp + i * H * D)
                for i in range(m)], ck.check_threads(settings.threads))
    return out


def _decode_rows(module, query, layer, spans, scaling, settings):
    """A decode step of a batch on a SparseKVCache layer: every sequence's
    new token appended and attended in one C call (decoder.decode_rows), when
    every sequence is a plain decode step on a prepared decoder (else None,
    and the caller attends them one at a time).  ``[B, 1, H, D]``."""
    t0 = time.perf_counter()
    B, n_heads, _, D = query.shape
    S = spans.kv_length
    rows = layer._rows
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(D)
    threads = settings.threads
    dense = module.layer_idx in settings.dense_layers
    decoders = []
    for b, row in enumerate(rows):
        state = row.state
        if (spans.end[b] != S or type(state) is not CacheState or row._pending[0] is not None
                or row._kv.seq_len != spans.count[b] - 1 or n_heads % row._kv.n_kv_heads):
            return None
        decoder = state.decoder(settings, scaling, threads, dense)
        if type(decoder) is not Decoder or decoder.slow:
            return None
        decoders.append(decoder)
    slots = []
    for b, row in enumerate(rows):
        layer.take_row(b, slice(0, 1))  # the token, handed over to the row (q8) or appended
        slots.append(row._pending)
    layer.release_held()
    q, out, qp, outp = _step_buffers(query)
    t1 = time.perf_counter()
    decode_rows(decoders, slots, qp, outp, n_heads)
    return _step_done(module, settings, query, out, t0, time.perf_counter() - t1)


def _step_buffers(query):
    """A batch's decode step's query as float32 ``[B, H, 1, D]`` (the
    tensor itself when it is that), a new output ``[B, 1, H, D]`` and their
    data pointers: sequence b's rows are ``b * H * D`` floats on."""
    B, n_heads, _, D = query.shape
    q = query.detach()
    if q.dtype is not torch.float32 or not q.is_contiguous():
        q = q.to(torch.float32).contiguous()
    out = torch.empty((B, 1, n_heads, D), dtype=torch.float32)
    return q, out, ffi.cast("float *", q.data_ptr()), ffi.cast("float *", out.data_ptr())


def _step_done(module, settings, query, out, t0, kernel):
    if out.dtype is not query.dtype:
        out = out.to(query.dtype)
    if settings.profile:
        _record(module, True, time.perf_counter() - t0, kernel)
    return out


def _decode_views(module, query, key, value, spans, scaling, named, settings):
    """A decode step of a batch on transformers' cache: every sequence's
    view state bound to its rows (their own importance record and channel
    copy) and all attended in one C call (sparse_attn.decode_batch), when each
    sequence is a decode step of a cache holding its earlier tokens (else
    None, and the caller attends them one at a time).  ``[B, 1, H, D]``."""
    t0 = time.perf_counter()
    B, n_heads, _, D = query.shape
    S = spans.kv_length
    if any(e != S or n < 2 for e, n in zip(spans.end, spans.count)):
        return None
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(D)
    dense = module.layer_idx in settings.dense_layers
    q, out, _, _ = _step_buffers(query)
    qn, outn = q.view(B, n_heads, D).numpy(), out.view(B, n_heads, D).numpy()
    steps = []
    for b in range(B):
        keys = spans.keys(b)
        kb, vb = key[b:b + 1, :, keys], value[b:b + 1, :, keys]
        state = layer_state(module, settings, kb, vb, 1, named, b)
        state.bind(module.layer_idx, kb, vb, 1)
        steps.append((state.decoder(settings, scaling, settings.threads, dense), qn[b],
                      outn[b]))
    t1 = time.perf_counter()
    decode_batch(steps, threads=settings.threads)
    return _step_done(module, settings, query, out, t0, time.perf_counter() - t1)


def _attend(module, md, query, key, value, scaling, named, settings, ph, t0, row):
    """One sequence's attention (batch 1, unpadded), checked."""
    qs, qdt = query.shape, query.dtype
    _, n_heads, T, D = qs
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(D)
    state = key._sparse_attn_layer.state if ph else \
        layer_state(module, settings, key, value, T, named, row)
    threads = settings.threads
    dense = module.layer_idx in settings.dense_layers
    done = state.step(settings, scaling, threads, dense, query, qdt, n_heads) \
        if T == 1 and type(state) is CacheState else None
    if done is not None:            # a SparseKVCache layer's decode step
        out, blocks, kernel = done
        decode = True
    else:
        S = state.bind(module.layer_idx, key, value, T)
        decode = T == 1 and S > 1
        if decode:
            decoder = state.decoder(settings, scaling, threads, dense)
            qd = _decode_query(query, n_heads, D)
            t1 = time.perf_counter()
            res = decoder(qd)
            kernel = time.perf_counter() - t1
            out, blocks = res if type(res) is tuple else (res, None)
            out = torch.from_numpy(out).view(1, 1, n_heads, D)
        else:
            # taken whatever the mode, so a prompt's K/V never outlives its
            # layer's call (30 layers of a 7K prompt would hold ~300 MB)
            prompt = state.prompt_kv(T)
            if prompt is not None and settings.prefill == "sdpa":
                t1 = time.perf_counter()
                out = _sdpa_prefill(query.detach(), prompt[0].detach(), prompt[1].detach(),
                                    scaling)
                kernel = time.perf_counter() - t1
            else:
                q = query.detach()[0]
                if q.dtype != torch.float32:
                    q = q.to(torch.float32)
                sparse = {}
                if settings.prefill == "sparse" and not dense:
                    sparse = dict(settings.decode_kwargs(), exact_tail=settings.exact_tail)
                t1 = time.perf_counter()
                out = state.prefill(q.contiguous().numpy(), scaling, threads, sparse)
                kernel = time.perf_counter() - t1
                out = torch.from_numpy(out).transpose(0, 1).unsqueeze(0)
    if decode and not dense:
        if settings.record_blocks:
            md["sparse_attn_blocks"] = blocks
        if settings.compare_exact:
            exact = state.exact(_decode_query(query, n_heads, D), scaling, threads)
            got = out.view(n_heads, D).numpy()
            err = float(np.abs(got - exact).max() / max(np.abs(exact).max(), 1e-30))
            md.setdefault("sparse_attn_errors", []).append(err)
    if out.dtype is not qdt:
        out = out.to(qdt)
    if settings.profile:
        _record(module, decode, time.perf_counter() - t0, kernel)
    return out, None


def _sdpa_prefill(query, key, value, scaling):
    """prefill="sdpa": torch's causal attention of a whole prompt, ``[1, H,
    T, D]`` against its own ``[1, Hkv, T, D]`` K/V, in the query's dtype;
    ``[1, T, H, D]``."""
    key, value = key.to(query.dtype), value.to(query.dtype)
    g = query.shape[1] // key.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        out = sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=g > 1)
    except TypeError:       # torch < 2.5: no enable_gqa
        out = sdpa(query, key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1),
                   is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def _decode_query(query, n_heads, D):
    """``[H, D]`` float32 C-contiguous numpy of a one-token ``[1, H, 1, D]``
    query: a view when it is float32 with rows D apart (what a model's
    ``transpose(1, 2)`` of its projection gives), else a copy."""
    q = query.detach()
    if q.dtype != torch.float32:
        q = q.to(torch.float32)
    try:
        return q.view(n_heads, D).numpy()
    except RuntimeError:
        return q.reshape(n_heads, D).contiguous().numpy()


def _record(module, decode, seconds, kernel_seconds):
    st = module.__dict__.get("sparse_attn_stats")
    if st is None:
        st = module.__dict__["sparse_attn_stats"] = dict.fromkeys(
            ("calls", "seconds", "kernel_seconds", "decode_calls", "decode_seconds",
             "decode_kernel_seconds"), 0)
    st["calls"] += 1
    st["seconds"] += seconds
    st["kernel_seconds"] += kernel_seconds
    if decode:
        st["decode_calls"] += 1
        st["decode_seconds"] += seconds
        st["decode_kernel_seconds"] += kernel_seconds

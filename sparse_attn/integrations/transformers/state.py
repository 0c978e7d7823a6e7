"""What the backend keeps of a sequence between calls, per layer: on a SparseKVCache's layer, or on transformers' own cache object."""
import copy
import time
import warnings
import weakref

import torch

from sparse_attn import ArgumentError, KVState, UnsupportedError
from sparse_attn._ffi import ffi
from sparse_attn.decoder import Decoder, append_pending

from .tensors import OUTPUT_BATCH, KVPlaceholder


def _float32_kv(name, t):
    """``[Hkv, S, D]`` float32 numpy of a ``[1, Hkv, S, D]`` K/V tensor:
    a zero-copy view when it is float32 with contiguous rows (the head
    stride may be larger than S rows), else a float32 copy."""
    t = t.detach()[0]
    if isinstance(t, KVPlaceholder):
        raise UnsupportedError(f"{name} is a q8 placeholder separated from its SparseKVCache")
    if t.dtype != torch.float32 or t.stride(2) != 1 or (t.shape[1] > 1
                                                        and t.stride(1) != t.shape[2]):
        t = t.to(torch.float32).contiguous()
    return t.numpy()


class CacheState:
    """What the backend reads and records for one layer of a
    :class:`SparseKVCache`: its :class:`sparse_attn.KVCache` (which keeps the
    importance, the key bounds and the probe-row copies), and the decode
    calls prepared on it for each settings the model ran with."""

    def __init__(self, layer):
        self.layer, self.kv = layer, layer._kv
        # the decode call made last: (settings, scale, threads, dense, decoder)
        self._last = (None, None, None, None, None)
        # decode outputs made OUTPUT_BATCH at a time (see _new_outputs), each
        # handed out once
        self._outs, self._outs_heads = [], 0

    def bind(self, layer_idx, key, value, T):
        slot = self.layer._pending
        if slot[0] is not None:
            append_pending(self.kv, slot)
        return self.kv.seq_len

    def step(self, settings, scale, threads, dense, query, qdt, n_heads):
        """A decode step on a prepared decoder, reading the query tensor's
        data and writing a new output tensor's (no numpy views), the token
        the layer's update left pending appended in the same hold of the
        lock.  Returns (out ``[1, 1, H, D]`` float32, the blocks or None,
        seconds inside the C calls), or None where the general path runs:
        a decoder that makes its metadata per call (or not this module's:
        the scoring bench swaps in its own), query heads not a multiple of
        the KV heads, or a cache of one token (that step is a prefill)."""
        decoder = self.decoder(settings, scale, threads, dense)
        kv, slot = self.kv, self.layer._pending
        if (type(decoder) is not Decoder or decoder.slow or n_heads % kv.n_kv_heads
                or kv.seq_len + (slot[0] is not None) < 2):
            return None
        q = query if qdt is torch.float32 and query.is_contiguous() else \
            query.to(torch.float32).contiguous()
        outs = self._outs
        if not outs or self._outs_heads != n_heads:
            outs = self._new_outputs(n_heads)
        out = outs.pop()
        qp, outp = ffi.cast("float *", q.data_ptr()), ffi.cast("float *", out.data_ptr())
        t1 = time.perf_counter()
        if slot[0] is None:
            blocks = decoder.call_at(qp, n_heads, outp)
        else:       # takes the token under the lock (another thread may have appended it)
            blocks = decoder.append_call_at(slot, qp, n_heads, outp)
        return out, blocks, time.perf_counter() - t1

    def _new_outputs(self, n_heads):
        """OUTPUT_BATCH new ``[1, 1, n_heads, head_dim]`` float32 tensors,
        made back to back: one made per step between torch's matmuls cost
        ~4 us (see SparseKVLayer._step_placeholder)."""
        D = self.kv.head_dim
        self._outs = [torch.empty((1, 1, n_heads, D), dtype=torch.float32)
                      for _ in range(OUTPUT_BATCH)]
        self._outs_heads = n_heads
        return self._outs

    def prefill(self, q, scale, threads, sparse):
        return self.kv.prefill(q, scale=scale, threads=threads, **sparse)

    def prompt_kv(self, T):
        """The K/V tensors of this call's T tokens when they are the whole
        layer (a prompt that filled it in one update) and unchanged since
        (torch's version counters: an in-place op or ``set_`` on them after
        the update leaves the cache holding other values), else None."""
        held, self.layer._prompt = self.layer._prompt, None
        if held is None:
            return None
        k, v, k_version, v_version = held
        if k.shape[2] == T == self.kv.seq_len and (k._version, v._version) == (k_version,
                                                                               v_version):
            return k, v
        return None

    def decoder(self, settings, scale, threads, dense):
        """The layer's prepared decode call for these settings: the one made
        last when they are the same (settings objects are immutable; a layer
        runs one model's settings, scale, threads and dense flag), else a
        new one."""
        last = self._last
        if not (last[0] is settings and last[1] == scale and last[2] == threads
                and last[3] == dense):
            last = self._last = (settings, scale, threads, dense, self.kv.decoder(
                scale=scale, threads=threads, dense=dense,
                return_blocks=not dense and settings.record_blocks, **settings.decode_kwargs()))
        return last[4]

    def exact(self, q, scale, threads):
        return self.kv.dense_decode(q, scale=scale, threads=threads)


class _ViewState:
    """What the backend reads and records for one layer of one of
    transformers' own caches (a DynamicCache): the K and V tensors it hands
    over at each call, and the sequence's :class:`sparse_attn.KVState` (the
    importance record and the channel copy) between calls
    (:func:`_view_state` keeps one per cache and layer)."""

    def __init__(self, kv=None):
        self.kv = KVState() if kv is None else kv
        self.key = self.value = None

    def __getstate__(self):
        """What a copy keeps (a ``deepcopy`` of the cache that holds this
        state): the KVState; the next call binds its own tensors."""
        return {"kv": self.kv}

    def __setstate__(self, state):
        self.__init__(state["kv"])

    def bind(self, layer_idx, key, value, T):
        """Take this call's K and V (``[1, Hkv, S, D]``, the ``T`` queries'
        rows last), which hold the sequence this state recorded (the caller
        has made sure): ``S - T`` rows, or fewer after a crop, or none for a
        new sequence.  Returns S."""
        k, v = _float32_kv("key", key), _float32_kv("value", value)
        try:
            S = self.kv.bind(k, v, T)
        except UnsupportedError as exc:
            raise UnsupportedError(
                f"layer {layer_idx}: the cache holds {k.shape[1] - T} tokens before this call, "
                f"of which sparse_topk attended {self.kv.length}: it holds another sequence, "
                "filled by another attention implementation, or copied from a cache before "
                "the backend could tell caches apart (a model not passed to sat.enable() "
                "learns that at its first forward). Fill each cache with "
                "attn_implementation='sparse_topk' from its first token, or use "
                "sparse_attn.integrations.transformers.SparseKVCache") from exc
        except ArgumentError as exc:
            raise UnsupportedError(f"layer {layer_idx}: {exc}") from None
        self.key, self.value = key, value
        return S

    def continues(self, key, value, past):
        """Whether this call's K and V (``[1, Hkv, S, D]``) start with the
        first ``past`` rows of those this state was last bound to: their
        values compared (O(past), for the calls that cannot tell which cache
        they read)."""
        k, v = self.key, self.value
        if k is None or not 0 < past <= min(self.kv.length, k.shape[2]):
            return False
        if (k.dtype, v.dtype) != (key.dtype, value.dtype) or \
                (k.shape[:2], k.shape[3]) != (key.shape[:2], key.shape[3]) or \
                (v.shape[:2], v.shape[3]) != (value.shape[:2], value.shape[3]):
            return False
        return bool(torch.equal(k[:, :, :past], key[:, :, :past])
                    and torch.equal(v[:, :, :past], value[:, :, :past]))

    def channels(self, block_size):
        return self.kv.channels(block_size)

    def prefill(self, q, scale, threads, sparse):
        return self.kv.prefill(q, scale=scale, threads=threads, **sparse)

    def prompt_kv(self, T):
        return (self.key, self.value) if self.kv.start == 0 else None

    def decoder(self, settings, scale, threads, dense):
        """This step's decode call (a :class:`sparse_attn.kv_state.StateDecoder`)."""
        if dense:
            return self.kv.decoder(scale=scale, threads=threads, dense=True)
        return self.kv.decoder(scale=scale, threads=threads, return_blocks=True,
                               **settings.decode_kwargs())

    def exact(self, q, scale, threads):
        return self.kv.dense_decode(q, scale=scale, threads=threads)


def layer_state(module, settings, key, value, T, named, row=0):
    """The layer state of this call (of sequence ``row`` of a batch): the
    SparseKVCache layer's, or the view of the sequence in transformers'
    cache."""
    layer = getattr(key, "_sparse_attn_layer", None)
    if layer is not None and getattr(value, "_sparse_attn_layer", None) is layer:
        return layer.state
    return _view_state(module, settings, key, value, T, named, row)


def _view_state(module, settings, key, value, T, named, row):
    """The :class:`_ViewState` of the sequence in the transformers cache
    this call reads (K and V ``[1, Hkv, S, D]``, ``T`` new rows; sequence
    ``row`` of the batch): the one kept on the cache object for this layer
    and sequence, which the module's pre-hook names (``named``: a weak
    reference, or None; :func:`_note_cache`).  A call it does not name
    (before the hook, or without a cache) gets the module's own state
    ("loose"), continued only when K and V start with the rows it recorded;
    the first cache named in a call that continues it takes it over.
    ``module._sparse_attn_view`` is the state of the module's last call of
    the first sequence."""
    md = module.__dict__
    cache = named() if named is not None else None
    if "_sparse_attn_watched" not in md:
        # (a sliding-window layer's cache layer holds float tensors in a
        # SparseKVCache too)
        if settings.kv_dtype is not None and not md.get("_sparse_attn_sliding"):
            warnings.warn(f"sparse_topk: kv_dtype={settings.kv_dtype!r} is set but this forward "
                          "got a transformers cache; it runs on that cache's float K/V. Pass "
                          "cache=SparseKVCache(model) to use the setting", stacklevel=6)
        watch_caches(module)
    past = key.shape[2] - T
    lkey = "_sparse_attn_loose" if row == 0 else f"_sparse_attn_loose{row}"
    loose = md.get(lkey)
    states = _states_on(cache)
    if states is not None:
        skey = module.layer_idx if row == 0 else (module.layer_idx, row)
        state = states.get(skey)
        if state is None:
            if loose is not None and loose.continues(key, value, past):
                state = md.pop(lkey)
            else:
                state = _ViewState()
            states[skey] = state
    elif loose is not None and (past == 0 or loose.continues(key, value, past)):
        state = loose
    else:
        state = md[lkey] = _ViewState()
    if row == 0:
        md["_sparse_attn_view"] = state
    return state


def _states_on(cache):
    """The view states kept on a transformers cache (a dict by layer index
    for a batch's first sequence, by (layer index, sequence) for the others;
    made empty when there is none), or None for no cache, or one that takes
    no attributes.  A cache given states has its batch reordering methods
    wrapped so they reorder the states too (:func:`_follow_batch`)."""
    if cache is None:
        return None
    states = getattr(cache, "_sparse_attn_views", None)
    if states is None:
        states = {}
        try:
            cache._sparse_attn_views = states
        except AttributeError:
            return None
        _follow_batch(cache)
    return states


def _follow_batch(cache):
    """Make the cache object's ``reorder_cache`` (beam search),
    ``batch_select_indices`` and ``batch_repeat_interleave`` move the view
    states of its sequences (importance record, channel copy) where their
    K and V go: transformers reorders the tensors, which the attention call
    cannot see.  Each is a :class:`_FollowBatch` set on the object, which
    holds the cache as an attribute (not a closure), so a ``deepcopy`` or a
    pickle of the cache carries methods bound to the copy."""
    for name in _PICKS:
        if callable(getattr(type(cache), name, None)):
            setattr(cache, name, _FollowBatch(cache, name))


class _FollowBatch:
    """One of a transformers cache's batch-reordering methods, called on the
    cache's class, then the same reordering of the backend's per-sequence
    states kept on the cache (a sequence picked twice gets a copy)."""

    def __init__(self, cache, name):
        self.cache, self.name = cache, name

    def __call__(self, arg, *args, **kwargs):
        cache = self.cache
        result = getattr(type(cache), self.name)(cache, arg, *args, **kwargs)
        _reorder_states(cache, _PICKS[self.name](cache, arg))
        return result

    def __repr__(self):
        return f"<{self.name} of {type(self.cache).__name__}, moving sparse_topk's states>"


def _reorder_states(cache, picks):
    """Sequence i of the cache's view states becomes the one of sequence
    ``picks[i]`` (a copy where a sequence is picked again)."""
    states = cache.__dict__.get("_sparse_attn_views")
    if states is None:
        return
    by_layer = {}
    for skey, state in states.items():
        layer, row = (skey, 0) if isinstance(skey, int) else skey
        by_layer.setdefault(layer, {})[row] = state
    states.clear()
    for layer, rows in by_layer.items():
        taken = set()
        for i, src in enumerate(picks):
            state = rows.get(src)
            if state is None:
                continue
            if src in taken:
                state = copy.deepcopy(state)
            taken.add(src)
            states[layer if i == 0 else (layer, i)] = state


def _rows_now(cache):
    return 1 + max((k[1] for k in cache.__dict__.get("_sparse_attn_views", ())
                    if not isinstance(k, int)), default=0)


def _selected(indices):
    idx = torch.as_tensor(indices)
    if idx.dtype is torch.bool:
        idx = idx.nonzero().flatten()
    return [int(i) for i in idx.tolist()]


# each method's argument as the sequences it keeps, in order
_PICKS = {
    "reorder_cache": lambda cache, beam_idx: [int(i) for i in
                                              torch.as_tensor(beam_idx).tolist()],
    "batch_select_indices": lambda cache, indices: _selected(indices),
    "batch_repeat_interleave": lambda cache, repeats: [
        i for i in range(_rows_now(cache)) for _ in range(int(repeats))],
}


def watch_caches(module):
    """Give an attention module the pre-hook that names the cache of each
    call (once; a copy of the module has it too).  Never taken away: a call
    on a transformers cache without it cannot find the cache's state.  Not
    given before it is needed: it costs every call of the module ~1.5 us,
    which a model on a SparseKVCache (whose layers name themselves) saves."""
    md = module.__dict__
    if "_sparse_attn_watched" not in md and hasattr(module, "register_forward_pre_hook"):
        module.register_forward_pre_hook(_note_cache, with_kwargs=True)
        md["_sparse_attn_watched"] = True


def _note_cache(module, args, kwargs):
    """The forward pre-hook of an attention module served on transformers'
    caches: transformers hands the attention function the cache's tensors
    but not the cache, so this notes (weakly: the attention call takes it)
    the cache the module's forward was given."""
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    module.__dict__["_sparse_attn_cache"] = None if cache is None else _NamedCache(cache)


class _NamedCache:
    """A weak reference to the cache a module's forward was given (called,
    the cache or None).  Kept in the module's ``__dict__`` from its
    pre-hook to its attention call; should a forward fail between them, a
    pickle of the module keeps it as a dead reference (a weakref itself
    cannot be pickled)."""

    __slots__ = ("ref",)

    def __init__(self, cache=None):
        try:
            self.ref = None if cache is None else weakref.ref(cache)
        except TypeError:       # not weakly referenceable: treated as unnamed
            self.ref = None

    def __call__(self):
        return None if self.ref is None else self.ref()

    def __reduce__(self):
        return (_NamedCache, ())

"""SparseKVCache: a transformers Cache whose layers are sparse_attn KVCaches."""
import time
import warnings
from ctypes import memmove as _memmove

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

import sparse_attn as sa
from sparse_attn import _checks as ck
from sparse_attn._ffi import ffi
from sparse_attn.cache import DTYPES as CACHE_DTYPES
from sparse_attn.decoder import append_at, append_pending
from sparse_attn.errors import ArgumentError
from sparse_attn.errors import UnsupportedError

from .refusals import check_cpu
from .rows import BatchRows
from .settings import DEFAULT_SELECTION, kv_shape, text_config
from .state import CacheState
from .tensors import PLACEHOLDER_BATCH, KVPlaceholder, make_wrapper


class SparseKVLayer(BatchRows, CacheLayerMixin):
    """One layer of a :class:`SparseKVCache`: a :class:`sparse_attn.KVCache`
    (``kv``) that quantises (q8) or converts (float32) each update's new
    tokens only.  A layer given a batch keeps one such layer per sequence
    (:attr:`rows`), holding that sequence's unpadded tokens only.

    Parameters
    ----------
    dtype : ``"q8"`` (default) or ``"float32"``
    group_size : int, default 32
    capacity : int, default 1024; rows allocated at the first update (doubles as needed)
    block_size : int, default 32; the block size of the key bounds kept for
        ``scoring="minmax"`` and of the probe-row copies kept for
        ``scoring="probe"`` (the model's ``block_size`` when the cache is made from it)
    n_probe : int, default 8; the probe the copies serve (the model's ``n_probe``)
    copy_probe_rows : bool, default False; keep the probe-row copies (a quarter of K's
        memory); a cache made from a model whose policy probes some of each
        block's rows (``seed``) keeps them, any other keeps none
    copy_channels : bool, default True; keep the channel copy of K that
        ``scoring="channels"`` (``balanced``, the default policy) reads (about
        K's size for q8); a cache made from a model keeps it when the model's
        policy scores channels, else not
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, dtype="q8", group_size=32, capacity=1024, block_size=32, n_probe=8,
                 copy_probe_rows=False, copy_channels=True, **kwargs):
        super().__init__()
        self.block_size = ck.check_int("block_size", block_size, minimum=1)
        self.n_probe = ck.check_int("n_probe", n_probe, minimum=1)
        self.copy_probe_rows = ck.check_bool("copy_probe_rows", copy_probe_rows)
        self.copy_channels = ck.check_bool("copy_channels", copy_channels)
        if dtype not in CACHE_DTYPES:
            raise ArgumentError(f"dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self.group_size = ck.check_int("group_size", group_size, minimum=1)
        self.capacity = ck.check_int("capacity", capacity, minimum=1)
        self._kv = None
        # a decode step's new token, handed over to the attention (update):
        # a one-slot list holding the token and the cache's length it goes
        # at (_hold_token), appended under the cache's write lock by whoever
        # flushes it (KVCache._append_pending, Decoder.append_call_at),
        # idempotently: an interrupt cannot drop it or append it twice
        self._pending = [None]
        # the two handoffs (rows) a decode step's token is copied to, in
        # turn (_hold_token), their rows' addresses, and which one is next
        self._token_rows = self._token_to = None
        self._token_next = 0
        self._prompt = None     # prefill="sdpa": the K/V of a prompt that filled the layer
        self._placeholder = KVPlaceholder.for_layer(self)
        # the decode steps' placeholders, made PLACEHOLDER_BATCH at a time
        # (_step_placeholder): those of lengths _phs_first, _phs_first + 1, ...
        self._phs, self._phs_first = [], 0
        self._token_shape = None
        self.stats = [0, 0.0, 0.0]
        # A layer given batches holds one batch-1 layer per sequence
        # (``rows``); see _batched_update.
        self._rows, self._held, self._batch_len = None, None, 0
        # a batch row's tokens as runs of the batch's positions (take_row)
        self._runs = []
        self._args = (dtype, group_size, capacity, block_size, n_probe, copy_probe_rows,
                      copy_channels)

    @property
    def kv(self):
        """The layer's :class:`sparse_attn.KVCache` (None before the first
        update or :meth:`allocate`), holding every token the layer was
        given: a new token a decode step's update left for the attention
        call is appended first.  A layer holding a batch has one per
        sequence: see :attr:`rows`."""
        if self._rows is not None:
            raise UnsupportedError(f"this SparseKVLayer holds a batch of {len(self._rows)} "
                                   "sequences: each has its own KVCache, layer.rows[i].kv")
        if self._pending[0] is not None:
            append_pending(self._kv, self._pending)
        return self._kv

    def allocate(self, n_kv_heads, head_dim):
        """Make the layer's :class:`sparse_attn.KVCache` now, for K/V of
        ``[1, n_kv_heads, T, head_dim]`` (what :class:`SparseKVCache` does
        when the model's config gives those): made inside a model's forward
        pass instead, at the first update, its allocations cost torch's own
        ops about 2 s of page faults on a 2K-token SmolLM2 prompt
        (docs/design.md).  The first update still
        checks its shape, and remakes the cache if the config was wrong."""
        self._pending[0] = None
        # update's decode-step handoff takes K/V of this cache's token shape
        # only (q8), copied to rows of that size
        self._token_shape = torch.Size((1, n_kv_heads, 1, head_dim)) if self.dtype == "q8" \
            else None
        self._token_rows = None
        self._kv = sa.KVCache(n_kv_heads, head_dim, capacity=self.capacity, dtype=self.dtype,
                              group_size=self.group_size, block_size=self.block_size,
                              n_probe=self.n_probe, copy_probe_rows=self.copy_probe_rows,
                              copy_channels=self.copy_channels)
        self.state = CacheState(self)

    @property
    def rows(self):
        """The batch-1 layers of a layer given a batch (one per sequence, in
        batch order), or None for a layer of one sequence."""
        return self._rows

    def lazy_initialization(self, key_states, value_states):
        check_cpu("key_states", key_states)
        b, hkv, _, d = key_states.shape
        if value_states.shape[3] != d:
            raise UnsupportedError(f"SparseKVCache needs K and V of one head_dim, got {d} and "
                                   f"{value_states.shape[3]}")
        kv = self.kv
        if kv is None or kv.seq_len or (kv.n_kv_heads, kv.head_dim) != (hkv, d):
            self.allocate(hkv, d)
        self.model_dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True
        self._phs = []

    def update(self, key_states, value_states, *args, **kwargs):
        """Append the new tokens (``[1, Hkv, T, D]``, any float dtype) and
        return the whole layer's K and V (``[1, Hkv, S, D]``: views of the
        float32 buffers, or q8 placeholders).  ``stats`` keeps the calls, their
        seconds and the seconds inside the C append.

        A q8 layer's decode step (one new token) copies the token now and
        hands the copy over to the ``sparse_topk`` attention call that reads
        the placeholder, which appends it and attends under one hold of the
        cache's lock; anything else that reads the layer (``kv``,
        ``get_seq_length``, ``crop``, the next update) appends it first.  No
        caller's tensor is read after ``update`` returns."""
        t0 = time.perf_counter()
        shape = key_states.shape
        if shape == self._token_shape and value_states.shape == shape and \
                self._pending[0] is None and self._kv.seq_len:
            # a q8 decode step: the token is handed over to the attention
            # call (see below), and the placeholder made with no other work
            # (the general path below does the same, after its checks)
            self._pending[0] = self._hold_token(key_states, value_states, self._kv.seq_len)
            self._prompt = None
            i = self._kv.seq_len + 1 - self._phs_first
            self.keys = self.values = self._phs[i] if 0 <= i < len(self._phs) else \
                self._step_placeholder(self._kv.seq_len + 1)
            st = self.stats
            st[0] += 1
            st[1] += time.perf_counter() - t0
            return self.keys, self.values
        if self._rows is not None or shape[0] != 1:
            return self._batched_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self._pending[0] is not None:
            append_pending(self._kv, self._pending)
        kv = self._kv
        if not (len(shape) == 4 and shape[0] == 1 and shape[1] == kv.n_kv_heads
                and shape[3] == kv.head_dim and value_states.shape == shape):
            want = [1, kv.n_kv_heads, "T", kv.head_dim]
            raise UnsupportedError(f"SparseKVCache layer expects K/V of shape {want} (one "
                                   f"shape for both), got {list(key_states.shape)} and "
                                   f"{list(value_states.shape)}")
        st = self.stats
        # A prompt filling the empty layer: prefill="sdpa" attends it on
        # these tensors (the attention call of this update takes them,
        # whatever the mode, unless they were changed in place since).
        self._prompt = (key_states, value_states, key_states._version,
                        value_states._version) if kv.seq_len == 0 else None
        if shape[2] == 1 and self.dtype == "q8":
            self._pending[0] = self._hold_token(key_states, value_states, kv.seq_len)
            self.keys = self.values = self._placeholder.make(
                (1, shape[1], kv.seq_len + 1, shape[3]), self.model_dtype)
            st[0] += 1
            st[1] += time.perf_counter() - t0
            return self.keys, self.values
        (kp, k), (vp, v) = _rows_at(key_states), _rows_at(value_states)
        t1 = time.perf_counter()
        append_at(kv, kp, vp, shape[2])     # k and v keep the rows alive
        t2 = time.perf_counter()
        self._handles()
        st[0] += 1
        st[1] += time.perf_counter() - t0
        st[2] += t2 - t1
        return self.keys, self.values

    def _hold_token(self, key_states, value_states, at):
        """The handoff of a one-token update (``[1, Hkv, 1, D]`` K and V) that
        goes at row ``at`` (the cache's length now), as
        KVCache._append_pending takes it: pointers to float32 copies of the
        token's rows, made now, what owns them, and ``at``.  The append
        comes later (in the attention call), when the caller may have
        reused, resized or freed its tensors.  Float32 rows are copied to
        one of the layer's two handoffs, in turn: one is taken (under the
        cache's lock) before the next is made, so the one written is never
        one still being read; memory the layer keeps stays in the CPU's
        caches.  Other layouts and dtypes get torch's float32 copy."""
        k, v = key_states, value_states
        if (k.dtype is torch.float32 and v.dtype is torch.float32 and k.is_contiguous()
                and v.is_contiguous() and k.is_cpu and v.is_cpu):
            if self._token_rows is None:
                self._new_token_rows(k.shape[1] * k.shape[3])
            i = self._token_next
            self._token_next = i ^ 1
            k_to, v_to, nbytes = self._token_to[i]
            # ctypes takes the addresses as ints: no cffi pointer is made per step
            _memmove(k_to, k.data_ptr(), nbytes)
            _memmove(v_to, v.data_ptr(), nbytes)
            return self._token_rows[i] + (at,)
        return _rows_at(k, copy=True) + _rows_at(v, copy=True) + (at,)

    def _new_token_rows(self, row):
        """The layer's two handoffs of ``row`` floats of K and of V each, in
        one allocation that each keeps alive, and their rows' addresses."""
        block = _uninitialised("float[]", 4 * row)
        at = int(ffi.cast("uintptr_t", block))
        self._token_rows = [(block, block, block + row, block),
                            (block + 2 * row, block, block + 3 * row, block)]
        self._token_to = [(at, at + 4 * row, 4 * row), (at + 8 * row, at + 12 * row, 4 * row)]

    def _step_placeholder(self, S):
        """The decode step's placeholder for a layer of S tokens, making
        those of S to S + PLACEHOLDER_BATCH - 1 in one go: between two
        layers, torch's matmuls leave the code that makes a tensor out of the
        CPU's caches, so one made per step cost ~10 us (docs/design.md,
        "The Python layer"; sparse-attn bench model's glue column), where a batch
        made back to back costs ~1 us each."""
        shape, dtype = self._token_shape, self.model_dtype
        self._phs = [make_wrapper(self._placeholder, (1, shape[1], S + i, shape[3]),
                                   dtype=dtype, device="cpu")
                     for i in range(PLACEHOLDER_BATCH)]
        self._phs_first = S
        return self._phs[0]

    def _handles(self):
        shape = (1, self.kv.n_kv_heads, self.kv.seq_len, self.kv.head_dim)
        if self.dtype == "float32":
            self.keys = torch.from_numpy(self.kv.k).unsqueeze(0)
            self.values = torch.from_numpy(self.kv.v).unsqueeze(0)
            self.keys._sparse_attn_layer = self.values._sparse_attn_layer = self
        else:
            # one placeholder stands for both (one fewer tensor per step)
            self.keys = self.values = self._placeholder.make(shape, self.model_dtype)

    def get_seq_length(self):
        if self._rows is not None:
            return self._batch_len
        return 0 if self.kv is None else self.kv.seq_len

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1

    @property
    def nbytes(self):
        """Bytes held by this layer's K and V (at its current capacity;
        every sequence's for a batch)."""
        return sum(kv.nbytes for kv in self.kvs)

    @property
    def kvs(self):
        """The layer's KVCaches: one per sequence ([] before the first update)."""
        if self._rows is not None:
            return [kv for row in self._rows for kv in row.kvs]
        return [] if self.kv is None else [self.kv]

    def reset(self):
        if self._rows is not None:      # back to a layer of no sequence
            self._rows, self._held, self._batch_len = None, None, 0
            self.keys = self.values = None
            self.is_initialized = False
            return
        self._pending[0] = None
        self._prompt = None
        self._runs = []
        if self._kv is not None:
            self._kv.reset()
        self.keys = self.values = None
        if self.is_initialized:
            self._handles()

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove):
        """Remove the last ``-tokens_to_remove`` tokens (a negative count, as
        transformers' ``DynamicLayer.crop`` takes): rolls back decode steps
        (assisted decoding, or re-running decode from one prefill).  The
        importance the kept tokens received stays as recorded."""
        if tokens_to_remove > 0:
            raise ArgumentError(f"crop takes a negative number of tokens to remove, got "
                                f"{tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if self._rows is not None:
            # each sequence loses its tokens at the cropped positions
            if self._held is not None:
                raise UnsupportedError("crop between a batched update and its attention call")
            self._batch_len = max(self._batch_len + tokens_to_remove, 0)
            self._crop_rows(self._batch_len)
            self.keys = self.values = None
            return
        self._prompt = None
        self.kv.truncate(max(self.kv.seq_len + tokens_to_remove, 0))
        self._handles()

    def __repr__(self):
        if self._rows is not None:
            return f"SparseKVLayer(batch of {len(self._rows)}: {self._rows!r})"
        return f"SparseKVLayer({self.kv!r})" if self.kv is not None else \
            f"SparseKVLayer(dtype={self.dtype!r}, empty)"


_uninitialised = ffi.new_allocator(should_clear_after_alloc=False)


def _rows_at(states, copy=False):
    """A cffi pointer to one update's tokens as float32 C-contiguous
    ``[Hkv, T, D]``, and what owns that memory: the tensor itself when it
    has that layout (one token's K/V from a model's ``transpose(1, 2)``) and
    ``copy`` is false, to read during the call only (the caller may change
    the tensor once update returns), else a float32 C-contiguous copy made
    by torch (a bfloat16 model's one-token K/V: 2.8 against 7.3 us through
    numpy), which nothing else holds."""
    if states.is_cpu and states.dtype is torch.float32 and states.is_contiguous():
        if copy:
            states = states.clone()
        return ffi.cast("float *", states.data_ptr()), states
    check_cpu("key/value states", states)
    # (.to() returns a float32 tensor itself, whatever its layout)
    t = states.to(torch.float32).contiguous()
    return ffi.cast("float *", t.data_ptr()), t


def layer_kinds(text):
    """[(kind, sliding_window)] per layer of a text config: "full_attention"
    or "sliding_attention" (with its window); other kinds as they are."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
        kinds, kwargs = get_layer_types_and_kwargs(text)
        return [(k, kw.get("sliding_window")) for k, kw in zip(kinds, kwargs)]
    except (ImportError, AttributeError):   # older transformers
        n = text.num_hidden_layers
        kinds = getattr(text, "layer_types", None) or ["full_attention"] * n
        return [(k, getattr(text, "sliding_window", None)) for k in kinds]


class SparseKVCache(Cache):
    """A transformers ``Cache`` of :class:`SparseKVLayer` s: the KV in the
    layout the sparse_attn kernels read, q8 (default) or float32; a
    sliding-window layer keeps its window as transformers does (a
    ``DynamicSlidingWindowLayer`` of float tensors, which sdpa reads).

    q8 stores int8 values and one float32 scale per ``group_size`` values:
    ``(group_size + 4) / (4 * group_size)`` of float32 (0.28, i.e. 3.6x less,
    at the default 32); what a layer keeps beside them to select (with the
    default ``balanced`` policy, a channel copy about q8 K's size) is
    :attr:`metadata_nbytes`.  The importance record of each layer lives in its
    :class:`sparse_attn.KVCache`.  Read by ``attn_implementation="sparse_topk"``
    only (q8 K/V have no float tensors to give anyone else).

    Parameters
    ----------
    model_or_config : a transformers model or its config
        Gives the number of layers (full attention, or sliding-window) and,
        from a model enabled with ``kv_dtype``/``group_size``, the defaults
        below.
    dtype : ``"q8"`` or ``"float32"``, default: the model's ``kv_dtype`` or ``"q8"``
    group_size : int, default: the model's ``group_size`` (32)
    capacity : int, default 1024; rows allocated per layer up front (grows
        by doubling as needed).  The cache ``generate`` makes for a model
        enabled with ``kv_dtype`` takes the rows generate says it will hold
        (the prompt and the new tokens): it never grows, and a prompt that
        fills three quarters of it gets transparent huge pages
        (docs/design.md, "One allocation per cache").  Size a cache you pass
        yourself the same way
    copy_channels : bool or None, default None: whether each layer keeps the
        channel copy of K that ``scoring="channels"`` (``policy="balanced"``)
        reads (about K's size for q8); None keeps it when the model's policy
        scores channels (``balanced``, the default, does).  Without it such
        a decode makes the copy at every step (correct, but a read of all
        of K)

    Examples
    --------
    ``model.generate(**inputs, cache=SparseKVCache(model))``.
    """

    def __init__(self, model_or_config, *, dtype=None, group_size=None, capacity=1024,
                 copy_channels=None):
        config = getattr(model_or_config, "config", model_or_config)
        settings = getattr(model_or_config, "sparse_attn", None)
        if dtype is None:
            dtype = getattr(settings, "kv_dtype", None) or "q8"
        if group_size is None:
            group_size = getattr(settings, "group_size", 32)
        text = text_config(config)
        n_layers = ck.check_int("num_hidden_layers", text.num_hidden_layers, minimum=1)
        kinds = layer_kinds(text)
        other = sorted({k for k, _ in kinds} - {"full_attention", "sliding_attention"})
        if other:
            raise UnsupportedError(f"SparseKVCache serves full-attention and sliding-window "
                                   f"layers; this model also has {other}: use a DynamicCache")
        block_size = getattr(settings, "block_size", 32)
        # A model never passed to enable() runs with the default settings.
        sel = getattr(settings, "_selection", None) or DEFAULT_SELECTION
        # Copies serve a probe of some rows; a probe of every row reads K
        # itself, and minmax scoring reads the key bounds instead.
        copies = sel.reads == "probe_rows"
        n_probe = sel.n_probe if copies else 8
        channels = sel.reads == "channels" if copy_channels is None \
            else ck.check_bool("copy_channels", copy_channels)
        # a layer that decodes densely (dense_layers) reads no metadata
        dense = set(getattr(settings, "dense_layers", ()))
        super().__init__(layers=[
            SparseKVLayer(dtype, group_size, capacity, block_size, n_probe,
                          copies and i not in dense,
                          channels and (i not in dense or copy_channels is not None))
            if kinds[i][0] == "full_attention" else DynamicSlidingWindowLayer(kinds[i][1])
            for i in range(n_layers)])
        self.dtype = dtype
        if dtype == "q8" and not self.sparse_layers:
            warnings.warn(
                f"SparseKVCache: every layer of this model is a sliding-window layer (window "
                f"{kinds[0][1]}), which the cache keeps as transformers does, a float window: "
                "nothing is held in q8. sparse_topk attends each layer sparsely while the "
                "sequence fits its window, exactly (sdpa) beyond it", stacklevel=2)
        shape = kv_shape(text)
        if shape is not None:
            for layer in self.sparse_layers:
                layer.allocate(*shape)

    @property
    def sparse_layers(self):
        """The :class:`SparseKVLayer` s (every full-attention layer)."""
        return [layer for layer in self.layers if isinstance(layer, SparseKVLayer)]

    @property
    def nbytes(self):
        """Bytes held by every full-attention layer's K and V (at their
        current capacity; a sliding window's float tensors are not counted)."""
        return sum(layer.nbytes for layer in self.sparse_layers)

    @property
    def metadata_nbytes(self):
        """Bytes of what every layer keeps beside K and V for selection (key
        bounds, channel copy, probe-row copies; :attr:`sparse_attn.KVCache.metadata_nbytes`)."""
        return sum(kv.metadata_nbytes for layer in self.sparse_layers for kv in layer.kvs)

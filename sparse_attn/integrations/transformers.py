"""Hugging Face transformers attention backend: ``attn_implementation="sparse_topk"``.

One line switches a model that runs with transformers on a CPU to the
package's block-sparse top-k decode::

    import sparse_attn.integrations.transformers as sat
    sat.register()                  # or: sat.enable(model, k_blocks=32, ...)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="sparse_topk")

What runs (per attention layer, shape legend of :mod:`sparse_attn`):

* **prefill** (``T > 1`` query tokens, or the first token of a sequence):
  :func:`sparse_attn.prefill` of the queries at ``[S - T, S)``: exact causal
  attention (``prefill="exact"``, the default), or the seed's sparse prefill
  (``prefill="sparse"``: each block of query rows attends to its own block
  and the ``k_blocks - 1`` earlier blocks the decode knobs choose, docs/spec.md
  §7, except the blocks of the call's last ``exact_tail`` rows, which run
  exact); the importance of what ran is added to the layer's record, so a
  prompt fed in chunks accumulates it (and a sparse chunk's reserve reads
  the earlier chunks'); or torch's ``scaled_dot_product_attention`` in the
  model's dtype (``prefill="sdpa"``: a prompt that fills an empty cache in
  one call, as ``generate`` feeds it; a later chunk runs the exact prefill),
  which records no importance and so takes only policies without an
  importance reserve;
* **decode** (one query token after a prefill): :func:`sparse_attn.sparse_decode`
  with the layer's importance, the model's GQA layout and the model's own
  ``scaling``; layers listed in ``dense_layers`` run :func:`sparse_attn.dense_decode`.

Settings are per model (:func:`enable`; ``model.sparse_attn``, mirrored as a
plain dict in ``model.config.sparse_attn``); a model loaded with
``attn_implementation="sparse_topk"`` and never passed to :func:`enable`
runs with the spec's defaults (or with the dict saved in its config).

KV caches
---------
* transformers' own ``DynamicCache`` (the default): a float32 cache is read
  through zero-copy numpy views of its contiguous CPU tensors; a
  bfloat16/float16 cache is converted to float32 at every step (a copy of the
  whole cache per layer and step: use ``kv_dtype="float32"`` to avoid it).
  What the backend keeps of a sequence between calls (each layer's
  importance record and channel copy) is kept on the cache object that
  holds it, so several caches may be used on one model in turn, and a
  ``deepcopy`` of a prefilled cache (transformers' way to reuse a prompt)
  carries it.  transformers hands the attention function the cache's
  tensors, not the cache, so each attention module gets a forward pre-hook
  that notes the cache of its call: from :func:`enable` (unless
  ``kv_dtype`` is set: the hook costs ~1.5 us a call), else from the
  module's first call on such a cache.  A call the hook did not name (that
  first one) gets the module's own state, continued only where K and V
  start with the rows it recorded (compared), and handed to the first cache
  that continues it.  A cache cropped by ``crop`` keeps the importance its
  kept tokens received; one holding tokens sparse_topk did not attend
  (filled by another attention implementation) is refused.
* :class:`SparseKVCache`: a transformers ``Cache`` whose layers each hold a
  :class:`sparse_attn.KVCache` (``dtype="q8"`` quantises in C on append and
  holds K and V in ~3.6x less memory than float32, ~2.3x with the channel
  copy the default policy reads; ``"float32"`` converts only the new
  tokens).  The importance record lives in that ``KVCache``, i.e. per cache.
  Its ``update`` returns K/V tensors that carry a reference to the layer
  (attribute ``_sparse_attn_layer``); the attention function reads the
  ``KVCache`` through it and hands its buffers (``Q8`` for q8) to the kernels
  directly.  A q8 layer's one-token ``update`` (a decode step) copies the
  token at once and leaves the append to the attention call, so the caller
  may reuse or free its tensors as soon as ``update`` returns.  For q8 K and
  V are one *placeholder* tensor of the right shape
  and dtype with no data: any other attention implementation that touches
  it raises :class:`UnsupportedError` instead of reading garbage, and
  nothing ever dequantises the cache.  Mask creation only asks the cache
  for lengths.  Each layer's ``KVCache`` is made with the cache, from the
  config's KV heads and head_dim (made inside the first forward pass, its
  allocations cost torch's own ops page faults).  ``enable(model,
  kv_dtype=...)`` makes ``model.generate`` create one; for your own forward
  calls pass ``cache=SparseKVCache(model)``.

Refused, with an :class:`UnsupportedError` naming the alternative: batch > 1
(and any padding), sliding-window / chunked / bidirectional layers, custom or
packed-sequence masks, pre-allocated (static) caches, tensors not on the CPU,
autograd (``sparse_topk`` has no backward: run under ``torch.no_grad()``),
attention dropout, ``output_attentions``, softcapping and attention sinks.
"""
import inspect
import math
import time
import types
import warnings
import weakref
from ctypes import memmove as _memmove
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

import sparse_attn as sa
from sparse_attn import _checks as ck, metadata as _metadata
from sparse_attn import _ffi
from sparse_attn._ffi import ffi
from sparse_attn._operands import kv_operand, kv_pair, query, scale_value
from sparse_attn.attention import dense_call, metadata_structs, sparse_call
from sparse_attn.cache import DTYPES as CACHE_DTYPES, _Decoder
from sparse_attn.selection import CACHE_POLICY, POLICIES, selection
from sparse_attn._checks import ArgumentError, ArgumentTypeError, SparseAttnError

NAME = "sparse_topk"
KV_DTYPES = (None, "float32", "q8")
PREFILL_MODES = ("exact", "sparse", "sdpa")

__all__ = ["NAME", "register", "enable", "get_settings", "attention_modules",
           "SparseAttnSettings", "SparseKVCache", "SparseKVLayer", "UnsupportedError",
           "sparse_topk_attention", "sparse_topk_mask"]


class UnsupportedError(SparseAttnError, NotImplementedError):
    """A model, input or setting ``sparse_topk`` does not handle; the message
    names the alternative.  Raised instead of computing something wrong."""


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class SparseAttnSettings:
    """The per-model settings of the ``sparse_topk`` backend.

    Parameters
    ----------
    k_blocks, block_size, n_probe, recency, policy, importance_fraction, sink_blocks, share,
    scoring, n_channels
        As :func:`sparse_attn.sparse_decode` (defaults 32, 32, None, True,
        ``"balanced"``; n_probe and the knobs left None come from the policy:
        the ``balanced`` preset's channel scores, spec §6, unless another
        preset is named; ``policy="seed"`` is the article's rule).  With
        ``scoring="minmax"`` a :class:`SparseKVCache` supplies the key bounds
        it keeps up to date, and with ``scoring="channels"`` (``policy=
        "balanced"``) its channel copy of K; with transformers' own cache
        the backend keeps each layer's channel copy itself (making again
        only the blocks with new rows), while the key bounds are made at
        every step from all of K (correct, but reads the whole K).
    prefill : ``"exact"``, ``"sparse"`` or ``"sdpa"``, default ``"exact"``
        How prompts are attended: exact causal attention, or sparse prefill
        with the same ``k_blocks`` and knobs as decode (docs/spec.md §7)
        (layers in ``dense_layers`` prefill exactly either way), or torch's
        ``scaled_dot_product_attention`` on the prompt's own K/V in the
        model's dtype, exact too (for a bfloat16 model on a CPU with AMX it
        is several times faster than the float32 prefill; measured in
        docs/results.md).  ``"sdpa"`` records no importance, so it refuses a
        policy with an importance reserve (``seed``: use ``balanced``,
        ``recall`` or ``fast``, or ``importance_fraction=0``), and serves only a
        prompt that fills an empty cache in one call; a later chunk of a
        prompt runs the exact prefill.
    exact_tail : int, default 64
        With ``prefill="sparse"``: the blocks holding each prefill call's last
        ``exact_tail`` query rows run exact (docs/spec.md §7.6), so the rows the
        next token is made from (a prompt's question) read every key.  On
        SmolLM2 the sparse prefill kept 14 of 18 needle answers without it
        and 18 of 18 with 64 (docs/results.md); 0 is the plain rule.  The
        backend cannot tell which call ends a prompt, so a prompt fed in
        chunks gets a tail at the end of each chunk (each costs up to
        ``exact_tail + block_size - 1`` exact rows).
    dense_layers : tuple of int, default ()
        Layer indices whose decode step stays exact (:func:`sparse_attn.dense_decode`).
    kv_dtype : None, ``"float32"`` or ``"q8"``, default None
        None uses the cache transformers makes (``DynamicCache``); otherwise
        ``model.generate`` uses a :class:`SparseKVCache` of that dtype.
    group_size : int, default 32
        q8 group size (must divide head_dim: :func:`enable` with
        ``kv_dtype="q8"`` checks it against the model's).
    threads : int or None, default None
        Kernel threads (None: ``SPARSE_ATTN_NUM_THREADS`` or the usable cores).
    compare_exact : bool, default False
        Diagnostics: every sparse decode step also runs exact attention and
        appends the relative error ``max|sparse - exact| / max|exact|`` to the
        module's ``sparse_attn_errors`` list (what ``sparse-attn eval``
        reports).  Costs a dense decode per layer and step.
    profile : bool, default False
        Diagnostics: each attention call adds its time, and the time inside
        the C core, to the module's ``sparse_attn_stats`` (what
        ``sparse-attn bench model`` reports as attention time and glue).
    record_blocks : bool, default False
        Diagnostics: each sparse decode step stores the blocks it chose
        (int32 ``[H, k]``, ascending) as the module's ``sparse_attn_blocks``.
        Costs an array per layer and step.
    """

    k_blocks: int = 32
    block_size: int = 32
    n_probe: int = None
    recency: bool = True
    policy: str = CACHE_POLICY
    importance_fraction: float = None
    sink_blocks: int = None
    share: str = None
    scoring: str = None
    n_channels: int = None
    prefill: str = "exact"
    exact_tail: int = 64
    dense_layers: tuple = field(default=())
    kv_dtype: str = None
    group_size: int = 32
    threads: int = None
    compare_exact: bool = False
    profile: bool = False
    record_blocks: bool = False

    def __post_init__(self):
        # The policy fills the knobs left None; selection() checks every knob
        # and names the bad one.
        sel = selection(self.policy, k_blocks=self.k_blocks, block_size=self.block_size,
                        n_probe=self.n_probe, recency=self.recency,
                        importance_fraction=self.importance_fraction,
                        sink_blocks=self.sink_blocks, share=self.share, scoring=self.scoring,
                        n_channels=self.n_channels)
        # every knob as checked (a numpy integer becomes an int: to_dict is JSON)
        for name in ("k_blocks", "block_size", "recency", "importance_fraction", "sink_blocks",
                     "share", "scoring", "n_channels"):
            object.__setattr__(self, name, getattr(sel, name))
        # n_probe keeps the policy's spelling ("all" stays "all")
        if self.n_probe is None:
            object.__setattr__(self, "n_probe", POLICIES[self.policy]["n_probe"])
        elif self.n_probe != "all":
            object.__setattr__(self, "n_probe", sel.n_probe)
        object.__setattr__(self, "_selection", sel)
        for name in ("compare_exact", "profile", "record_blocks"):
            object.__setattr__(self, name, ck.check_bool(name, getattr(self, name)))
        try:
            layers = list(self.dense_layers)
        except TypeError:
            raise ArgumentTypeError(f"dense_layers must be an iterable of layer indices, "
                                    f"got {self.dense_layers!r}") from None
        dense = tuple(sorted({ck.check_int(f"dense_layers[{n}]", i, minimum=0)
                              for n, i in enumerate(layers)}))
        object.__setattr__(self, "dense_layers", dense)
        object.__setattr__(self, "exact_tail",
                           ck.check_int("exact_tail", self.exact_tail, minimum=0))
        if self.prefill not in PREFILL_MODES:
            raise ArgumentError(f"prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.prefill == "sdpa" and self.importance_fraction > 0:
            raise ArgumentError(
                f"prefill='sdpa' records no importance, and policy={self.policy!r} reserves "
                f"importance_fraction={self.importance_fraction} of the blocks by it: use "
                "policy='balanced', 'recall' or 'fast', or importance_fraction=0")
        if self.kv_dtype not in KV_DTYPES:
            raise ArgumentError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        object.__setattr__(self, "group_size",
                           ck.check_int("group_size", self.group_size, minimum=1))
        if self.threads is not None:
            object.__setattr__(self, "threads", ck.check_int("threads", self.threads, minimum=1))

    def to_dict(self):
        """The settings as a JSON-friendly dict (what ``config.sparse_attn`` holds)."""
        d = asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d

    def decode_kwargs(self):
        return dict(k_blocks=self.k_blocks, block_size=self.block_size, n_probe=self.n_probe,
                    recency=self.recency, importance_fraction=self.importance_fraction,
                    sink_blocks=self.sink_blocks, share=self.share, scoring=self.scoring,
                    n_channels=self.n_channels)


_DEFAULT_SELECTION = SparseAttnSettings()._selection


def attention_modules(model):
    """The attention modules of a transformers model: the ones the
    AttentionInterface is called with (they know their layer and scaling)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")
            and hasattr(m, "is_causal") and hasattr(m, "config")]


def _settings_of(module):
    settings = module.__dict__.get("sparse_attn")
    if settings is None:
        # register() + from_pretrained(attn_implementation=...) without enable():
        # the dict a saved config carries, else the defaults.
        settings = SparseAttnSettings(**(getattr(module.config, "sparse_attn", None) or {}))
        module.sparse_attn = settings
    return settings


def get_settings(model):
    """The :class:`SparseAttnSettings` a model runs with."""
    settings = getattr(model, "sparse_attn", None)
    if isinstance(settings, SparseAttnSettings):
        return settings
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedError(f"{type(model).__name__} has no attention module with a layer_idx")
    return _settings_of(modules[0])


# --------------------------------------------------------------------------- registration

def register():
    """Register ``"sparse_topk"`` with transformers: the attention function
    (``AttentionInterface``) and its mask function (``AttentionMaskInterface``,
    without which transformers would silently drop the causal mask and every
    check on it).  Idempotent."""
    AttentionInterface.register(NAME, sparse_topk_attention)
    AttentionMaskInterface.register(NAME, sparse_topk_mask)


def enable(model, *, k_blocks=32, block_size=32, n_probe=None, recency=True, policy=CACHE_POLICY,
           importance_fraction=None, sink_blocks=None, share=None, scoring=None,
           n_channels=None, prefill="exact", exact_tail=64, dense_layers=(), kv_dtype=None,
           group_size=32, threads=None, compare_exact=False, profile=False,
           record_blocks=False):
    """Switch ``model`` to ``sparse_topk`` with these settings (this model only).

    Registers the backend, checks the model (CPU, full causal attention in
    every layer), stores the settings on the model (``model.sparse_attn``, a
    :class:`SparseAttnSettings`, and ``model.config.sparse_attn``, a dict) and
    on each attention module, and sets ``attn_implementation="sparse_topk"``.
    Calling it again replaces the settings.  Parameters: see
    :class:`SparseAttnSettings`.

    Returns
    -------
    The model.

    Examples
    --------
    >>> import sparse_attn.integrations.transformers as sat
    >>> from transformers import Qwen3Config, Qwen3ForCausalLM
    >>> cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64,
    ...                   num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, head_dim=32)
    >>> model = sat.enable(Qwen3ForCausalLM(cfg).eval(), k_blocks=8, dense_layers=[0])
    >>> model.config._attn_implementation, model.sparse_attn.k_blocks
    ('sparse_topk', 8)
    >>> model.sparse_attn.dense_layers, model.config.sparse_attn["dense_layers"]
    ((0,), [0])
    """
    settings = SparseAttnSettings(
        k_blocks=k_blocks, block_size=block_size, n_probe=n_probe, recency=recency,
        policy=policy, importance_fraction=importance_fraction, sink_blocks=sink_blocks, share=share,
        scoring=scoring, n_channels=n_channels, prefill=prefill, exact_tail=exact_tail,
        dense_layers=dense_layers, kv_dtype=kv_dtype, group_size=group_size, threads=threads,
        compare_exact=compare_exact, profile=profile, record_blocks=record_blocks)
    modules = attention_modules(model)
    if not modules:
        raise UnsupportedError(
            f"{type(model).__name__} has no attention module with a layer_idx and scaling: it does "
            "not use transformers' AttentionInterface, so sparse_topk cannot serve it")
    n_layers = max(m.layer_idx for m in modules) + 1
    bad = [i for i in settings.dense_layers if i >= n_layers]
    if bad:
        raise ArgumentError(f"dense_layers {bad} are beyond the model's {n_layers} layers "
                            f"(0..{n_layers - 1})")
    if settings.kv_dtype == "q8":
        _check_group_size(settings.group_size, model, modules[0])
    for m in modules:
        _check_layer_type(m)
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise UnsupportedError(f"sparse_topk runs on the CPU; the model has parameters on "
                               f"{sorted(devices)}: move it with model.to('cpu'), or keep "
                               "attn_implementation='sdpa' on an accelerator")
    register()
    model.sparse_attn = settings
    for m in modules:
        m.sparse_attn = settings
        m.config.sparse_attn = settings.to_dict()
        if settings.kv_dtype is None:       # generate will use transformers' cache
            _watch_caches(m)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    _install_generate_cache(model)
    return model


def _check_group_size(group_size, model, module):
    """Refuse a q8 group size that does not divide the model's head_dim
    (the one its SparseKVCache is made with; else the attention module's),
    which the cache generate makes would refuse only inside generate()."""
    shape = _kv_shape(_text_config(model.config))
    head_dim = shape[1] if shape is not None else getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and head_dim % group_size:
        raise ArgumentError(
            f"group_size ({group_size}) must divide the model's head_dim ({head_dim}) for "
            f"kv_dtype='q8': use a divisor of {head_dim}, such as "
            f"{math.gcd(head_dim, 32)}")


def _check_layer_type(module):
    layer_types = getattr(module.config, "layer_types", None)
    kind = layer_types[module.layer_idx] if layer_types else "full_attention"
    if kind != "full_attention" or getattr(module, "sliding_window", None) is not None:
        raise UnsupportedError(
            f"layer {module.layer_idx} is a {kind!r} layer (sliding_window="
            f"{getattr(module, 'sliding_window', None)}); sparse_topk serves full causal "
            "attention layers only: use attn_implementation='sdpa' for this model")


def _install_generate_cache(model):
    """Make ``model.generate`` build a :class:`SparseKVCache` when the model's
    settings ask for a kv_dtype, by overriding this instance's
    ``_prepare_cache_for_generation`` (where transformers creates the cache
    generate uses; a cache the caller passes is left alone).  Bound with
    MethodType so that a deepcopy of the model rebinds it to the copy."""
    if "_prepare_cache_for_generation" in model.__dict__ or \
            not hasattr(type(model), "_prepare_cache_for_generation"):
        return
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    base = type(self)._prepare_cache_for_generation
    result = base(self, generation_config, model_kwargs, *args, **kwargs)
    settings = getattr(self, "sparse_attn", None)
    if (isinstance(settings, SparseAttnSettings) and settings.kv_dtype is not None
            and self.config._attn_implementation == NAME):
        for key in ("cache", "past_key_values"):
            made = model_kwargs.get(key)
            if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False):
                rows = _generate_capacity(base, self, generation_config, model_kwargs, args,
                                          kwargs)
                model_kwargs[key] = SparseKVCache(self) if rows is None else \
                    SparseKVCache(self, capacity=rows)
    return result


def _generate_capacity(base, model, generation_config, model_kwargs, args, kwargs):
    """The rows generate's cache will hold (the prompt and every new token
    but the last: transformers' ``max_cache_length``), so the cache is made
    at its final size: no growth copies at the first new token, and a
    prompt that fills three quarters of it gets transparent huge pages
    (sparse_attn.KVCache).  None (SparseKVCache's default capacity, growing
    as needed) when this transformers does not say."""
    try:
        bound = inspect.signature(base).bind(model, generation_config, model_kwargs, *args,
                                             **kwargs)
        rows = bound.arguments.get("max_cache_length")
    except (TypeError, ValueError):
        rows = None
    return rows if isinstance(rows, int) and 1 <= rows <= ck.INT_MAX else None


# --------------------------------------------------------------------------- the q8 / float32 cache

class _KVPlaceholder(torch.Tensor):
    """What a q8 :class:`SparseKVLayer` returns as K and V: the shape and
    dtype transformers expects, no data, and a reference to the layer.  Only
    the sparse_topk attention function knows to read the layer's q8 buffers;
    any torch operation on it raises instead of computing on garbage.

    Each layer makes its own subclass (:meth:`for_layer`) holding the layer
    as a class attribute, so a decode step's placeholder is one
    ``_make_wrapper_subclass`` call with no attributes to set."""

    _sparse_attn_layer = None

    @classmethod
    def for_layer(cls, layer):
        return type(cls.__name__, (cls,), {"_sparse_attn_layer": layer})

    @classmethod
    def make(cls, shape, dtype):
        return _make_wrapper(cls, shape, dtype=dtype, device="cpu")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UnsupportedError(
            f"{func} on the q8 K/V of a SparseKVCache: its K/V are q8 buffers only the "
            "'sparse_topk' attention can read. Use attn_implementation='sparse_topk' with this "
            "cache, or a DynamicCache with other implementations")

    def __repr__(self):
        return f"<q8 K/V placeholder {tuple(self.shape)} of {self._sparse_attn_layer!r}>"


_make_wrapper = torch.Tensor._make_wrapper_subclass

# How many decode steps' placeholders (SparseKVLayer) and output tensors
# (_CacheState) are made at a time: objects of no data, and outputs of
# n_heads * head_dim floats each (16 KB at 32 heads of 128).
PLACEHOLDER_BATCH = 32
OUTPUT_BATCH = 16


class SparseKVLayer(CacheLayerMixin):
    """One layer of a :class:`SparseKVCache`: a :class:`sparse_attn.KVCache`
    (``kv``) that quantises (q8) or converts (float32) each update's new
    tokens only.  Batch 1.

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
        # a one-slot list, emptied under the cache's write lock by whoever
        # appends it (KVCache._append_pending, _Decoder.append_call_at)
        self._pending = [None]
        # the two handoffs (rows) a decode step's token is copied to, in
        # turn (_hold_token), their rows' addresses, and which one is next
        self._token_rows = self._token_to = None
        self._token_next = 0
        self._prompt = None     # prefill="sdpa": the K/V of a prompt that filled the layer
        self._placeholder = _KVPlaceholder.for_layer(self)
        # the decode steps' placeholders, made PLACEHOLDER_BATCH at a time
        # (_step_placeholder): those of lengths _phs_first, _phs_first + 1, ...
        self._phs, self._phs_first = [], 0
        self._token_shape = None
        self.stats = [0, 0.0, 0.0]

    @property
    def kv(self):
        """The layer's :class:`sparse_attn.KVCache` (None before the first
        update or :meth:`allocate`), holding every token the layer was
        given: a new token a decode step's update left for the attention
        call is appended first."""
        if self._pending[0] is not None:
            self._kv._append_pending(self._pending)
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
        self.state = _CacheState(self)

    def lazy_initialization(self, key_states, value_states):
        _check_cpu("key_states", key_states)
        b, hkv, _, d = key_states.shape
        if b != 1:
            raise UnsupportedError(f"SparseKVCache holds one sequence (batch 1), got batch {b}: "
                                   "run the sequences one at a time, or use a DynamicCache")
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
                self._pending[0] is None and self._kv._n:
            # a q8 decode step: the token is handed over to the attention
            # call (see below), and the placeholder made with no other work
            # (the general path below does the same, after its checks)
            self._pending[0] = self._hold_token(key_states, value_states)
            self._prompt = None
            i = self._kv._n + 1 - self._phs_first
            self.keys = self.values = self._phs[i] if 0 <= i < len(self._phs) else \
                self._step_placeholder(self._kv._n + 1)
            st = self.stats
            st[0] += 1
            st[1] += time.perf_counter() - t0
            return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self._pending[0] is not None:
            self._kv._append_pending(self._pending)
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
                        value_states._version) if kv._n == 0 else None
        if shape[2] == 1 and self.dtype == "q8":
            self._pending[0] = self._hold_token(key_states, value_states)
            self.keys = self.values = self._placeholder.make(
                (1, shape[1], kv._n + 1, shape[3]), self.model_dtype)
            st[0] += 1
            st[1] += time.perf_counter() - t0
            return self.keys, self.values
        (kp, k), (vp, v) = _rows_at(key_states), _rows_at(value_states)
        t1 = time.perf_counter()
        kv._append_at(kp, vp, shape[2])     # k and v keep the rows alive
        t2 = time.perf_counter()
        self._handles()
        st[0] += 1
        st[1] += time.perf_counter() - t0
        st[2] += t2 - t1
        return self.keys, self.values

    def _hold_token(self, key_states, value_states):
        """The handoff of a one-token update (``[1, Hkv, 1, D]`` K and V), as
        KVCache._append_pending takes it: pointers to float32 copies of the
        token's rows, made now, and what owns them.  The append comes later
        (in the attention call), when the caller may have reused, resized
        or freed its tensors.  Float32 rows are copied to one of the
        layer's two handoffs, in turn: one is taken (under the cache's
        lock) before the next is made, so the one written is never one
        still being read; memory the layer keeps stays in the CPU's caches.
        Other layouts and dtypes get torch's float32 copy."""
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
            return self._token_rows[i]
        return _rows_at(k, copy=True) + _rows_at(v, copy=True)

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
        "The Python layer"; docs/results.md, "The glue"), where a batch
        made back to back costs ~1 us each."""
        shape, dtype = self._token_shape, self.model_dtype
        self._phs = [_make_wrapper(self._placeholder, (1, shape[1], S + i, shape[3]),
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
        return 0 if self.kv is None else self.kv.seq_len

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1

    @property
    def nbytes(self):
        """Bytes held by this layer's K and V (at its current capacity)."""
        return 0 if self.kv is None else self.kv.nbytes

    def reset(self):
        self._pending[0] = None
        self._prompt = None
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
        self._prompt = None
        self.kv.truncate(max(self.kv.seq_len + tokens_to_remove, 0))
        self._handles()

    def reorder_cache(self, beam_idx):
        if self.get_seq_length() and beam_idx.tolist() != [0]:
            raise UnsupportedError("SparseKVCache holds one sequence: beam search needs "
                                   "num_beams=1, or a DynamicCache with attn_implementation='sdpa'")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1:
            raise UnsupportedError("SparseKVCache holds one sequence: use num_beams=1 and "
                                   "num_return_sequences=1")

    def batch_select_indices(self, indices):
        if torch.as_tensor(indices).tolist() not in ([0], [True]):
            raise UnsupportedError("SparseKVCache holds one sequence; it cannot select batch rows")

    def __repr__(self):
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
    _check_cpu("key/value states", states)
    # (.to() returns a float32 tensor itself, whatever its layout)
    t = states.to(torch.float32).contiguous()
    return ffi.cast("float *", t.data_ptr()), t


class SparseKVCache(Cache):
    """A transformers ``Cache`` of :class:`SparseKVLayer` s: the KV in the
    layout the sparse_attn kernels read, q8 (default) or float32.

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
        Gives the number of layers (all must be full attention) and, from a
        model enabled with ``kv_dtype``/``group_size``, the defaults below.
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
        text = _text_config(config)
        n_layers = ck.check_int("num_hidden_layers", text.num_hidden_layers, minimum=1)
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"} or getattr(text, "use_sliding_window", False):
            raise UnsupportedError(f"SparseKVCache serves full-attention layers only; this model "
                                   f"has layer types {sorted(kinds)}: use a DynamicCache")
        block_size = getattr(settings, "block_size", 32)
        # A model never passed to enable() runs with the default settings.
        sel = getattr(settings, "_selection", None) or _DEFAULT_SELECTION
        # Copies serve a probe of some rows; a probe of every row reads K
        # itself, and minmax scoring reads the key bounds instead.
        copies = sel.reads == "probe_rows"
        n_probe = sel.n_probe if copies else 8
        channels = sel.reads == "channels" if copy_channels is None \
            else ck.check_bool("copy_channels", copy_channels)
        # a layer that decodes densely (dense_layers) reads no metadata
        dense = set(getattr(settings, "dense_layers", ()))
        super().__init__(layers=[SparseKVLayer(dtype, group_size, capacity, block_size, n_probe,
                                               copies and i not in dense,
                                               channels and (i not in dense
                                                             or copy_channels is not None))
                                 for i in range(n_layers)])
        self.dtype = dtype
        shape = _kv_shape(text)
        if shape is not None:
            for layer in self.layers:
                layer.allocate(*shape)

    @property
    def nbytes(self):
        """Bytes held by every layer's K and V (at their current capacity)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def metadata_nbytes(self):
        """Bytes of what every layer keeps beside K and V for selection (key
        bounds, channel copy, probe-row copies; :attr:`sparse_attn.KVCache.metadata_nbytes`)."""
        return sum(layer.kv.metadata_nbytes for layer in self.layers if layer.kv is not None)


def _text_config(config):
    """The decoder's text config of a model config (itself for a text model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config


def _kv_shape(text):
    """(n_kv_heads, head_dim) a text config declares, or None."""
    heads = getattr(text, "num_attention_heads", None)
    hkv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None)
    if d is None and heads and getattr(text, "hidden_size", None):
        d = text.hidden_size // heads
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hkv, d))
    return (hkv, d) if ok else None


# --------------------------------------------------------------------------- mask

def sparse_topk_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                     mask_function=causal_mask_function, attention_mask=None, **kwargs):
    """The ``AttentionMaskInterface`` entry of ``sparse_topk``.

    The kernels apply the causal mask themselves (queries at ``[S - T, S)``),
    so the only mask this returns is None, and only for what they compute:
    one unpadded sequence, plain causal attention, keys ``[0, S)``.  Anything
    else (padding, sliding/chunked/bidirectional patterns, packed sequences,
    extra mask overlays, a pre-allocated cache) raises
    :class:`UnsupportedError`.
    """
    if batch_size != 1:
        raise UnsupportedError(
            f"sparse_topk runs one sequence at a time (batch 1), got batch {batch_size}: loop "
            "over the prompts, or use attn_implementation='sdpa' for batched/padded inputs")
    if mask_function is not causal_mask_function:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise UnsupportedError(
            f"sparse_topk computes plain causal attention; this model asked for another mask "
            f"pattern ({name}: sliding-window, chunked, bidirectional, packed sequences or an "
            "overlay): use attn_implementation='sdpa' for it")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UnsupportedError(
            "sparse_topk does not support padding (the attention_mask has zeros): pass the "
            "sequence without padding, or use attn_implementation='sdpa' for padded inputs")
    q_offset = int(q_offset)
    if int(kv_offset) != 0 or q_offset + q_length != kv_length:
        raise UnsupportedError(
            f"the cache reports kv_length {kv_length} at offset {int(kv_offset)} for "
            f"{q_length} queries after {q_offset} cached tokens: a pre-allocated (static) or "
            "windowed cache, which sparse_topk does not read. Use the default DynamicCache "
            "or sparse_attn.integrations.transformers.SparseKVCache")
    return None


# --------------------------------------------------------------------------- attention

class _ImportanceRecord:
    """Per-layer importance of the sequence in a transformers-owned cache:
    float32 ``[length]``, growing by doubling."""

    def __init__(self):
        self._buf = np.zeros(1024, np.float32)
        self.length = 0

    def _reserve(self, n):
        if n > self._buf.shape[0]:
            buf = np.zeros(max(n, 2 * self._buf.shape[0]), np.float32)
            buf[:self.length] = self._buf[:self.length]
            self._buf = buf

    def prepare(self, layer_idx, past, seq):
        """Check the record covers the ``past`` tokens the cache holds
        before this call (``past == 0``: a new sequence; fewer than it
        covers: a cropped cache, whose kept tokens keep the importance they
        received), then make it ``seq`` tokens, the new ones at zero."""
        if past > self.length:
            raise UnsupportedError(
                f"layer {layer_idx}: the cache holds {past} tokens before this call, of which "
                f"sparse_topk attended {self.length}: it holds another sequence, filled by "
                "another attention implementation, or copied from a cache before the backend "
                "could tell caches apart (a model not passed to sat.enable() learns that at "
                "its first forward). Fill each cache with attn_implementation='sparse_topk' "
                "from its first token, or use "
                "sparse_attn.integrations.transformers.SparseKVCache")
        self._reserve(seq)
        self._buf[past:seq] = 0
        self.length = seq

    def add(self, importance):
        self._buf[:importance.shape[0]] += importance

    @property
    def importance(self):
        return self._buf[:self.length]


def _check_cpu(name, t):
    if t.device.type != "cpu":
        raise UnsupportedError(
            f"sparse_topk runs on CPU tensors; {name} is on {t.device}: keep "
            "attn_implementation='sdpa' (or a flash kernel) on an accelerator, or move the "
            "model to the CPU")


def _float32_kv(name, t):
    """``[Hkv, S, D]`` float32 numpy of a ``[1, Hkv, S, D]`` K/V tensor:
    a zero-copy view when it is float32 with contiguous rows (the head
    stride may be larger than S rows), else a float32 copy."""
    t = t.detach()[0]
    if isinstance(t, _KVPlaceholder):
        raise UnsupportedError(f"{name} is a q8 placeholder separated from its SparseKVCache")
    if t.dtype != torch.float32 or t.stride(2) != 1 or (t.shape[1] > 1
                                                        and t.stride(1) != t.shape[2]):
        t = t.to(torch.float32).contiguous()
    return t.numpy()


class _CacheState:
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
            self.kv._append_pending(slot)
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
        if (type(decoder) is not _Decoder or decoder.slow or n_heads % kv.n_kv_heads
                or kv._n + (slot[0] is not None) < 2):
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
    transformers' own caches (a DynamicCache): float32 views of the K and V
    it hands over at each call, and what it keeps of the sequence in it
    between calls, the importance record and the channel copy
    (:func:`_view_state` keeps one per cache and layer)."""

    def __init__(self):
        self.record = _ImportanceRecord()
        self.key = self.value = self.k = self.v = None
        self.start = 0
        # The channel copy of K that scoring="channels" reads: (arrays,
        # struct) for up to arrays[0].shape[2] blocks, covering the rows
        # the struct's k_rows says; None until a decode needs it.
        self._copy = None

    def __getstate__(self):
        """What a copy keeps (a ``deepcopy`` of the cache that holds this
        state): the record and the channel copy; the next call binds its own
        tensors."""
        copy = None
        if self._copy is not None:
            arrays, st = self._copy
            copy = (arrays, st.block_size, st.k_rows)
        return {"record": self.record, "copy": copy}

    def __setstate__(self, state):
        self.__init__()
        self.record = state["record"]
        if state["copy"] is not None:
            arrays, block_size, k_rows = state["copy"]
            self._copy = (arrays, _metadata.channels_struct(arrays, block_size, k_rows))

    def bind(self, layer_idx, key, value, T):
        """Take this call's K and V (``[1, Hkv, S, D]``, the ``T`` queries'
        rows last), which hold the sequence this state recorded (the caller
        has made sure): ``S - T`` rows, or fewer after a crop, or none for a
        new sequence.  Returns S."""
        self.key, self.value = key, value
        self.k, self.v = _float32_kv("key", key), _float32_kv("value", value)
        S = self.k.shape[1]
        if self.v.shape[1] != S or S < T:
            raise UnsupportedError(f"layer {layer_idx}: key/value hold {S}/{self.v.shape[1]} "
                                   f"tokens for {T} queries; expected equal lengths >= {T}")
        past = S - T
        if past == 0 or past < self.record.length:
            self._copy = None       # made from rows this sequence no longer holds
        self.record.prepare(layer_idx, past, S)
        self.start = past
        return S

    def continues(self, key, value, past):
        """Whether this call's K and V (``[1, Hkv, S, D]``) start with the
        first ``past`` rows of those this state was last bound to: their
        values compared (O(past), for the calls that cannot tell which cache
        they read)."""
        k, v = self.key, self.value
        if k is None or not 0 < past <= min(self.record.length, k.shape[2]):
            return False
        if (k.dtype, v.dtype) != (key.dtype, value.dtype) or \
                (k.shape[:2], k.shape[3]) != (key.shape[:2], key.shape[3]) or \
                (v.shape[:2], v.shape[3]) != (value.shape[:2], value.shape[3]):
            return False
        return bool(torch.equal(k[:, :, :past], key[:, :, :past])
                    and torch.equal(v[:, :, :past], value[:, :, :past]))

    def _channels_struct(self, kop, block_size):
        """The sa_channels of the channel copy (spec §6) of this call's K
        for ``scoring="channels"``, kept between calls: the rows before this
        call's are the ones the copy was made from (:meth:`bind` drops it
        when they are not), so only the blocks holding new rows are made
        again, as a :class:`sparse_attn.KVCache` does on append.  Another
        head layout or block size starts the copy again; the room for blocks
        grows by a quarter as it fills."""
        hkv, S, D = self.k.shape
        copy = self._copy
        if copy is not None:
            arrays, st = copy
            if arrays[0].shape[:2] != (hkv, D) or st.block_size != block_size:
                copy = None
        nb = -(-S // block_size)
        if copy is None or nb > arrays[0].shape[2]:
            room = max(64, nb + nb // 4)     # a quarter more: O(1) copying per row
            fresh = _metadata.empty_channels(hkv, room, D, block_size)
            done = 0
            if copy is not None:
                done = st.k_rows
                have = -(-done // block_size)
                for src, dst in zip(arrays, fresh):
                    dst[:, :, :have] = src[:, :, :have]
            arrays, st = fresh, _metadata.channels_struct(fresh, block_size, done)
            self._copy = (arrays, st)
        _ffi.check(_ffi.lib.sa_channels_update(kop.struct, st.k_rows, S, st),
                   "sparse_topk channel copy")
        return st

    def channels(self, block_size):
        """The kept channel copy of this call's K, brought up to date
        (:class:`sparse_attn.ChannelCopy`, views)."""
        S = self.k.shape[1]
        self._channels_struct(kv_operand("k", self.k), block_size)
        arrays, nb = self._copy[0], -(-S // block_size)
        return sa.ChannelCopy._wrap(arrays[0][:, :, :nb], arrays[1][:, :, :nb], block_size, S)

    def prefill(self, q, scale, threads, sparse):
        if sparse:
            prior = self.record.importance
            sparse = dict(sparse, importance=prior if prior[:self.start].any() else None)
        out, importance = sa.prefill(q, self.k, self.v, start=self.start, scale=scale,
                                     threads=threads, **sparse)
        self.record.add(importance)
        return out

    def prompt_kv(self, T):
        return (self.key, self.value) if self.start == 0 else None

    def decoder(self, settings, scale, threads, dense):
        """This step's decode call: sparse_decode's (or dense_decode's)
        C call on operands made once for the step, with no argument
        checks beyond the query's: K and V are the float32 views bind
        made, the importance is the layer's record and the channel copy
        the one kept here."""
        kop, vop, S = kv_pair(self.k, self.v, None)
        scale, threads = scale_value(scale, kop.head_dim), ck.check_threads(threads)
        if dense:
            def call(q):
                q, n_heads = query(q, kop, 2)
                return dense_call(q, n_heads, kop, vop, S, scale, threads)
            return call
        sel = settings._selection
        if sel.scoring == "channels":
            bst, pst, keep = self._channels_struct(kop, sel.block_size), None, self._copy
        else:       # the bounds made for the call (minmax), or K probed
            bst, pst, keep = metadata_structs(sel, self.k, kop, S, None, None)
        importance = self.record.importance

        def call(q, _keep=keep):
            q, n_heads = query(q, kop, 2)
            return sparse_call(q, n_heads, kop, vop, S, sel, importance, bst, pst, scale,
                               threads, True)
        return call

    def exact(self, q, scale, threads):
        return sa.dense_decode(q, self.k, self.v, scale=scale, threads=threads)


def _state(module, settings, key, value, T, named):
    """The layer state of this call: the SparseKVCache layer's, or the
    view of the sequence in transformers' cache."""
    layer = getattr(key, "_sparse_attn_layer", None)
    if layer is not None and getattr(value, "_sparse_attn_layer", None) is layer:
        return layer.state
    return _view_state(module, settings, key, value, T, named)


def _view_state(module, settings, key, value, T, named):
    """The :class:`_ViewState` of the sequence in the transformers cache
    this call reads (K and V ``[1, Hkv, S, D]``, ``T`` new rows): the one
    kept on the cache object for this layer, which the module's pre-hook
    names (``named``: a weak reference, or None; :func:`_note_cache`).  A
    call it does not name (before the hook, or without a cache) gets the
    module's own state ("loose"), continued only when K and V start with
    the rows it recorded; the first cache named in a call that continues
    it takes it over.  ``module._sparse_attn_view`` is the state of the
    module's last call."""
    md = module.__dict__
    cache = named() if named is not None else None
    if "_sparse_attn_watched" not in md:
        if settings.kv_dtype is not None:
            warnings.warn(f"sparse_topk: kv_dtype={settings.kv_dtype!r} is set but this forward "
                          "got a transformers cache; it runs on that cache's float K/V. Pass "
                          "cache=SparseKVCache(model) to use the setting", stacklevel=5)
        _watch_caches(module)
    past = key.shape[2] - T
    loose = md.get("_sparse_attn_loose")
    states = _states_on(cache)
    if states is not None:
        state = states.get(module.layer_idx)
        if state is None:
            if loose is not None and loose.continues(key, value, past):
                state = md.pop("_sparse_attn_loose")
            else:
                state = _ViewState()
            states[module.layer_idx] = state
    elif loose is not None and (past == 0 or loose.continues(key, value, past)):
        state = loose
    else:
        state = md["_sparse_attn_loose"] = _ViewState()
    md["_sparse_attn_view"] = state
    return state


def _states_on(cache):
    """The view states kept on a transformers cache (a dict by layer index,
    made empty when there is none), or None for no cache, or one that takes
    no attributes."""
    if cache is None:
        return None
    states = getattr(cache, "_sparse_attn_views", None)
    if states is None:
        states = {}
        try:
            cache._sparse_attn_views = states
        except AttributeError:
            return None
    return states


def _watch_caches(module):
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
    try:
        module.__dict__["_sparse_attn_cache"] = None if cache is None else weakref.ref(cache)
    except TypeError:       # not weakly referenceable: treated as unnamed
        module.__dict__["_sparse_attn_cache"] = None


def sparse_topk_attention(module, query, key, value, attention_mask, scaling=None,
                          dropout=0.0, **kwargs):
    """The ``AttentionInterface`` function of ``attn_implementation="sparse_topk"``.

    Parameters
    ----------
    module : the attention module (``layer_idx``, ``config``, ``is_causal``, ``training``)
    query : ``[1, H, T, D]`` float32/bfloat16/float16 CPU tensor
    key, value : ``[1, Hkv, S, D]`` (after the cache update; ``S >= T``), or
        the K/V a :class:`SparseKVCache` returned
    attention_mask : None (what :func:`sparse_topk_mask` returns)
    scaling : float, default ``module.scaling`` or ``1/sqrt(D)``
    dropout : must be 0

    Returns
    -------
    attn_output : ``[1, T, H, D]`` in the query's dtype
    attn_weights : None

    With ``profile=True`` in the settings, each call adds to
    ``module.sparse_attn_stats``: ``calls``, ``seconds`` (the whole call),
    ``kernel_seconds`` (inside the C calls) and, for decode, the same as
    ``decode_*``.
    """
    t0 = time.perf_counter()
    md = module.__dict__
    # the cache this module's forward was given, if its pre-hook noted it:
    # taken here, whatever the cache, so no later call finds it
    named = md.pop("_sparse_attn_cache", None)
    settings = md.get("sparse_attn") or _settings_of(module)
    # One cheap test of everything _refuse_unsupported checks; it runs (and
    # raises with the reason) only when the test fails.
    # (a SparseKVCache's q8 placeholder stands for K and V, on the CPU,
    # without grad: its own checks are the shape's)
    qs, qdt = query.shape, query.dtype
    ph = value is key and isinstance(key, _KVPlaceholder)
    if not (md.get("_sparse_attn_checked") and attention_mask is None and not dropout
            and query.is_cpu and qdt in _QUERY_DTYPES and qs[0] == 1
            and (ph or key.is_cpu)
            and not ((query.requires_grad or not ph and key.requires_grad)
                     and torch.is_grad_enabled())
            and key.shape[-1] == qs[-1] and (ph or value.shape[-1] == qs[-1])):
        _refuse_unsupported(module, query, key, value, attention_mask, dropout)
    if kwargs and not _CHECKED_KWARGS.isdisjoint(kwargs):
        _refuse_kwargs(module, kwargs)
    _, n_heads, T, D = qs
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(D)
    state = key._sparse_attn_layer.state if ph else \
        _state(module, settings, key, value, T, named)
    threads = settings.threads
    dense = module.layer_idx in settings.dense_layers
    done = state.step(settings, scaling, threads, dense, query, qdt, n_heads) \
        if T == 1 and type(state) is _CacheState else None
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


def _refuse_unsupported(module, query, key, value, attention_mask, dropout):
    """Raise UnsupportedError for what sparse_topk does not compute.  What
    depends only on the module is checked once per module."""
    if "_sparse_attn_checked" not in module.__dict__:
        _refuse_module(module)
        module.__dict__["_sparse_attn_checked"] = True
    if query.device.type != "cpu":
        _check_cpu("query", query)
    if not isinstance(key, _KVPlaceholder) and key.device.type != "cpu":
        _check_cpu("key", key)
    if query.dtype not in _QUERY_DTYPES:
        raise UnsupportedError(f"sparse_topk takes float32/bfloat16/float16 queries, got "
                               f"{query.dtype}")
    if dropout:
        raise UnsupportedError(
            f"attention dropout ({dropout}) in training: sparse_topk is for inference; call "
            "model.eval(), or train with attn_implementation='sdpa'")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        raise UnsupportedError(
            "sparse_topk has no backward pass: run inference under torch.no_grad() (generate "
            "does), or use attn_implementation='sdpa' for training")
    if query.shape[0] != 1:
        raise UnsupportedError(
            f"sparse_topk runs one sequence at a time (batch 1), got batch {query.shape[0]}: loop "
            "over the prompts, or use attn_implementation='sdpa' for batches")
    if attention_mask is not None:
        raise UnsupportedError(
            "sparse_topk got a materialised attention mask (a custom 4D mask, padding or "
            "another mask implementation): it computes plain causal attention only; use "
            "attn_implementation='sdpa' for custom masks")
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        raise UnsupportedError(
            f"sparse_topk needs one head_dim for Q, K and V, got {query.shape[-1]}, "
            f"{key.shape[-1]}, {value.shape[-1]}: use attn_implementation='sdpa'")


_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the keyword arguments _refuse_kwargs looks at (others are ignored)
_CHECKED_KWARGS = frozenset(("sliding_window", "is_causal", "softcap", "s_aux", "sinks",
                             "position_bias", "output_attentions"))


def _refuse_module(module):
    layer_idx = module.layer_idx
    if getattr(module, "sliding_window", None):
        raise UnsupportedError(
            f"layer {layer_idx} is a sliding-window layer: sparse_topk serves full causal "
            "attention only; use attn_implementation='sdpa' for this model")
    if not getattr(module, "is_causal", True):
        raise UnsupportedError(
            f"layer {layer_idx} is not causal (an encoder or bidirectional layer): sparse_topk "
            "is a causal decoder backend; use attn_implementation='sdpa'")


def _refuse_kwargs(module, kwargs):
    layer_idx = module.layer_idx
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedError(
            f"layer {layer_idx} is a sliding-window layer: sparse_topk serves full causal "
            "attention only; use attn_implementation='sdpa' for this model")
    if kwargs.get("is_causal") is False:
        raise UnsupportedError(
            f"layer {layer_idx} is not causal (an encoder or bidirectional layer): sparse_topk "
            "is a causal decoder backend; use attn_implementation='sdpa'")
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise UnsupportedError(f"sparse_topk does not implement {name} (layer {layer_idx}): "
                                   "use attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("output_attentions"):
        raise UnsupportedError("sparse_topk does not return attention weights: use "
                               "attn_implementation='eager' with output_attentions=True")

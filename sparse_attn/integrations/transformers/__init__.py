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

Sliding-window layers (``layer_types`` "sliding_attention", or every
layer of a config with a model-wide ``sliding_window`` and no
``layer_types``, as Mistral's): while a sequence fits the window (every
query sees every key) they are full attention layers and sparse like the
others; beyond it they are attended exactly over their window by torch's
sdpa.  Their cache layer keeps the window as transformers'
``DynamicSlidingWindowLayer`` does, also inside a ``SparseKVCache`` (so a
model whose every layer is windowed holds nothing in q8; the cache warns).

Batches and padding: each sequence of a batch is attended as a batch of
one over its real tokens (the mask function hands the layers a
:class:`RowSpans`: per sequence, one range of real tokens, or their
positions when padding sits between them, as in right padding followed
by generated tokens), with its own importance record and channel copy
(on transformers' cache, kept per sequence on the cache object) or its
own ``KVCache`` (a ``SparseKVCache`` layer given a batch holds one
batch-1 layer per sequence, ``layer.rows``, holding its real tokens
only): a sequence's attention output in a batch is bitwise its real
tokens' output alone.  A padded query attends the real keys before it
exactly, as sdpa does (``generate`` reads a right-padded prompt's next
token there), or gets zeros when there are none.  Beam search:
``reorder_cache``, ``batch_select_indices`` and
``batch_repeat_interleave`` move each sequence's state with it (a
``SparseKVCache`` row kept twice is copied, q8 data as stored; on
transformers' cache the backend sets those methods on the cache object as
callables holding it, so its per-sequence states follow the tensors, and
a ``deepcopy`` or pickle of the cache carries them bound to the copy).  A
decode step of the batch is one C call per layer for all its sequences
(``sa_decode_batch``); a prefill attends them one after another.

A forward with grad mode on (weights that require grad, outside
``torch.no_grad()``) runs, its output requiring grad as sdpa's; a backward
through a layer ``sparse_topk`` attended raises :class:`UnsupportedError`.

Refused, with an :class:`UnsupportedError` naming the alternative (see
docs/design.md, "What the transformers backend refuses"): chunked and
bidirectional layers, custom 4D masks, mask overlays and packed sequences
(``position_ids`` restarting within a row), pre-allocated (static) caches,
tensors not on the CPU, attention dropout (training), a backward pass,
``output_attentions``, attention-logit softcapping and attention sinks.
"""
from sparse_attn.errors import ArgumentError, UnsupportedError

from .attention import sparse_topk_attention, sparse_topk_mask
from .cache import SparseKVCache, SparseKVLayer
from .patching import register, enable
from .settings import NAME, get_settings, attention_modules, SparseAttnSettings
from .tensors import RowSpans

__all__ = ["NAME", "register", "enable", "get_settings", "attention_modules",
           "SparseAttnSettings", "SparseKVCache", "SparseKVLayer", "RowSpans",
           "ArgumentError", "UnsupportedError", "sparse_topk_attention", "sparse_topk_mask"]

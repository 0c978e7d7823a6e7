"""What sparse_topk does not handle, refused with an UnsupportedError that names the alternative."""
import math

import torch

from sparse_attn.errors import ArgumentError
from sparse_attn.errors import UnsupportedError

from .settings import kv_shape, text_config
from .tensors import KVPlaceholder, RowSpans


def check_group_size(group_size, model, module):
    """Refuse a q8 group size that does not divide the model's head_dim
    (the one its SparseKVCache is made with; else the attention module's),
    which the cache generate makes would refuse only inside generate()."""
    shape = kv_shape(text_config(model.config))
    head_dim = shape[1] if shape is not None else getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0 and head_dim % group_size:
        raise ArgumentError(
            f"group_size ({group_size}) must divide the model's head_dim ({head_dim}) for "
            f"kv_dtype='q8': use a divisor of {head_dim}, such as "
            f"{math.gcd(head_dim, 32)}")


# Layer kinds sparse_topk serves: full attention sparsely, sliding-window
# layers exactly through torch's sdpa over their window.
LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_kind(module):
    """The module's layer type as transformers' caches and masks see it:
    ``config.layer_types[layer_idx]``, else (no ``layer_types``) every layer
    is "sliding_attention" when the config sets a model-wide
    ``sliding_window`` (Mistral), "chunked_attention" when it sets an
    ``attention_chunk_size``, and "full_attention" otherwise; a module
    with a ``sliding_window`` of its own is "sliding_attention"."""
    config = module.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kind = layer_types[module.layer_idx]
    elif getattr(config, "sliding_window", None) is not None:
        kind = "sliding_attention"
    elif getattr(config, "attention_chunk_size", None) is not None:
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    if kind == "full_attention" and getattr(module, "sliding_window", None):
        kind = "sliding_attention"
    return kind


def check_layer_type(module):
    kind = layer_kind(module)
    if kind not in LAYER_KINDS:
        raise UnsupportedError(
            f"layer {module.layer_idx} is a {kind!r} layer; sparse_topk serves full causal "
            "attention layers (and sliding-window layers, through sdpa) only: use "
            "attn_implementation='sdpa' for this model")


def check_cpu(name, t):
    if t.device.type != "cpu":
        raise UnsupportedError(
            f"sparse_topk runs on CPU tensors; {name} is on {t.device}: keep "
            "attn_implementation='sdpa' (or a flash kernel) on an accelerator, or move the "
            "model to the CPU")


def refuse_sliding(module, query, key, dropout):
    """What a sliding-window layer beyond its window (attended by sdpa)
    refuses: what the backend refuses everywhere (accelerator tensors,
    dropout) and a
    q8 placeholder, which only a SparseKVCache's full-attention layers hand out."""
    check_layer_type(module)
    if isinstance(key, KVPlaceholder):
        raise UnsupportedError(
            f"layer {module.layer_idx} is a sliding-window layer but its cache layer holds q8 "
            "K/V: a SparseKVCache keeps sliding layers as float windows; make the cache with "
            "SparseKVCache(model) from this model's config")
    _refuse_everywhere(query, key, dropout)


def _refuse_everywhere(query, key, dropout):
    """What no layer serves: tensors off the CPU, dropout."""
    if query.device.type != "cpu":
        check_cpu("query", query)
    if not isinstance(key, KVPlaceholder) and key.device.type != "cpu":
        check_cpu("key", key)
    if dropout:
        raise UnsupportedError(
            f"attention dropout ({dropout}) in training: sparse_topk is for inference; call "
            "model.eval(), or train with attn_implementation='sdpa'")


def refuse_unsupported(module, query, key, value, attention_mask, dropout):
    """Raise UnsupportedError for what sparse_topk does not compute.  What
    depends only on the module is checked once per module."""
    if "_sparse_attn_checked" not in module.__dict__:
        _refuse_module(module)
        module.__dict__["_sparse_attn_checked"] = True
    if query.device.type != "cpu" or (not isinstance(key, KVPlaceholder)
                                      and key.device.type != "cpu"):
        _refuse_everywhere(query, key, dropout)
    if query.dtype not in QUERY_DTYPES:
        raise UnsupportedError(f"sparse_topk takes float32/bfloat16/float16 queries, got "
                               f"{query.dtype}")
    _refuse_everywhere(query, key, dropout)
    if attention_mask is not None and type(attention_mask) is not RowSpans:
        raise UnsupportedError(
            "sparse_topk got a materialised attention mask (a custom 4D mask, or one another "
            "mask implementation made): it computes causal attention over each sequence's "
            "unpadded tokens only; use attn_implementation='sdpa' for custom masks")
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        raise UnsupportedError(
            f"sparse_topk needs one head_dim for Q, K and V, got {query.shape[-1]}, "
            f"{key.shape[-1]}, {value.shape[-1]}: use attn_implementation='sdpa'")


QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# the keyword arguments refuse_kwargs looks at (others are ignored)
CHECKED_KWARGS = frozenset(("sliding_window", "is_causal", "softcap", "s_aux", "sinks",
                             "position_bias", "output_attentions"))
# what a sliding-window layer's sdpa call refuses besides (sdpa itself takes
# masks, dropout and any batch)
SLIDING_CHECKED_KWARGS = frozenset(("softcap", "s_aux", "sinks", "position_bias",
                                    "output_attentions"))


def _refuse_module(module):
    layer_idx = module.layer_idx
    check_layer_type(module)
    if not getattr(module, "is_causal", True):
        raise UnsupportedError(
            f"layer {layer_idx} is not causal (an encoder or bidirectional layer): sparse_topk "
            "is a causal decoder backend; use attn_implementation='sdpa'")


def refuse_kwargs(module, kwargs):
    layer_idx = module.layer_idx
    if kwargs.get("sliding_window") is not None and \
            not module.__dict__.get("_sparse_attn_sliding"):
        raise UnsupportedError(
            f"layer {layer_idx} was called with sliding_window={kwargs['sliding_window']} but "
            "is not a sliding-window layer of its config (layer_types, or a model-wide "
            "sliding_window): sparse_topk serves the windows the config declares; use "
            "attn_implementation='sdpa'")
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

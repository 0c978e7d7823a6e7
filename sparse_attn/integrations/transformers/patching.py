"""Registering the backend with transformers and switching a model to it (enable), with generate's cache."""
import inspect

from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from sparse_attn import _checks as ck
from sparse_attn.selection import CACHE_POLICY
from sparse_attn.errors import ArgumentError
from sparse_attn.errors import UnsupportedError

from .attention import sparse_topk_attention, sparse_topk_mask
from .cache import SparseKVCache
from .refusals import check_group_size, check_layer_type, layer_kind
from .settings import NAME, SparseAttnSettings, attention_modules
from .state import watch_caches


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
        check_group_size(settings.group_size, model, modules[0])
    for m in modules:
        check_layer_type(m)
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
        # generate will use transformers' cache, or (kv_dtype set) a
        # SparseKVCache whose sliding-window layers are transformers' too
        if settings.kv_dtype is None or layer_kind(m) == "sliding_attention":
            watch_caches(m)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    _install_generate_cache(model)
    return model


def _install_generate_cache(model):
    """Make ``model.generate`` build a :class:`SparseKVCache` when the model's
    settings ask for a kv_dtype, by overriding this instance's
    ``_prepare_cache_for_generation`` (where transformers creates the cache
    generate uses; a cache the caller passes is left alone) with a
    :class:`_GenerateCache`, which holds the model as an attribute: a
    deepcopy or a pickle of the model carries one bound to the copy."""
    if "_prepare_cache_for_generation" in model.__dict__ or \
            not hasattr(type(model), "_prepare_cache_for_generation"):
        return
    model._prepare_cache_for_generation = _GenerateCache(model)


class _GenerateCache:
    """The model's ``_prepare_cache_for_generation``, then a
    :class:`SparseKVCache` in place of the DynamicCache it made."""

    def __init__(self, model):
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        return _prepare_cache_for_generation(self.model, generation_config, model_kwargs,
                                             *args, **kwargs)


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

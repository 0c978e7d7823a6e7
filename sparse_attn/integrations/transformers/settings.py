"""The backend's settings: what enable() stores on a model and each attention module."""
from dataclasses import asdict, dataclass, field
from sparse_attn import _checks as ck
from sparse_attn.selection import CACHE_POLICY, POLICIES, selection
from sparse_attn.errors import ArgumentError, ArgumentTypeError
from sparse_attn.errors import UnsupportedError


NAME = "sparse_topk"


KV_DTYPES = (None, "float32", "q8")


PREFILL_MODES = ("exact", "sparse", "sdpa")


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
        is several times faster than the float32 prefill; CHANGELOG.md,
        0.2.0).  ``"sdpa"`` records no importance, so it refuses a
        policy with an importance reserve (``seed``: use ``balanced``,
        ``recall`` or ``fast``, or ``importance_fraction=0``), and serves only a
        prompt that fills an empty cache in one call; a later chunk of a
        prompt runs the exact prefill.
    exact_tail : int, default 64
        With ``prefill="sparse"``: the blocks holding each prefill call's last
        ``exact_tail`` query rows run exact (docs/spec.md §7.6), so the rows the
        next token is made from (a prompt's question) read every key.  On
        SmolLM2 the sparse prefill kept 14 of 18 needle answers without it
        and 18 of 18 with 64 (sparse-attn eval; CHANGELOG.md); 0 is the plain rule.  The
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


DEFAULT_SELECTION = SparseAttnSettings()._selection


def attention_modules(model):
    """The attention modules of a transformers model: the ones the
    AttentionInterface is called with (they know their layer and scaling)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")
            and hasattr(m, "is_causal") and hasattr(m, "config")]


def settings_of(module):
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
    return settings_of(modules[0])


def text_config(config):
    """The decoder's text config of a model config (itself for a text model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config


def kv_shape(text):
    """(n_kv_heads, head_dim) a text config declares, or None."""
    heads = getattr(text, "num_attention_heads", None)
    hkv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None)
    if d is None and heads and getattr(text, "hidden_size", None):
        d = text.hidden_size // heads
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hkv, d))
    return (hkv, d) if ok else None

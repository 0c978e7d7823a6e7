"""Block selection settings (docs/spec.md §2 and §6) in one place.

A :class:`Selection` is a policy preset resolved with the caller's overrides
into checked knobs.  It knows which metadata beside K the selection reads
(the probe-row copies or the key bounds), whether a cache should keep
probe-row copies for it, and the C struct the core takes.  Every entry point,
the KV cache, the benchmarks, the evaluation and the transformers backend
build their selection through :func:`selection`.
"""
import functools
import math
from dataclasses import dataclass

from . import _checks as ck
from .errors import ArgumentError, UnsupportedError
from ._ffi import ffi, lib

SHARES = {"head": lib.SA_SHARE_HEAD, "group": lib.SA_SHARE_GROUP}
SCORINGS = {"probe": lib.SA_SCORING_PROBE, "minmax": lib.SA_SCORING_MINMAX,
            "channels": lib.SA_SCORING_CHANNELS}

# Named selection policies: the four knobs of spec §6 and the probe's
# n_probe.  "seed" is the article's rule and the default of the functions
# over plain arrays (sparse_decode, select_blocks, prefill), which have no
# metadata to read; CACHE_POLICY, below, is the default where a cache keeps
# the metadata its scoring reads (KVCache, the transformers backend).
# "recall" is the best combination `sparse-attn eval` found on
# SmolLM2-135M-Instruct at 2K tokens (docs/results.md): no importance
# reserve and a probe that reads every row of a block (n_probe="all", the
# block's true max of q.k); it reads all of K to choose, so it saves V reads
# and attention work, not K reads.  "fast" reads the least: Quest's min/max
# key bounds instead of the probe, one selection per GQA group, the first
# block kept; it recalled less than the probe on SmolLM2, so measure your
# model first.  "balanced" scores a block by the max of q.k over the 16
# channels where the KV head's queries are largest (SparQ's idea), read
# from a channel-major copy of K that the cache keeps: a quarter of K's
# bytes at head_dim 64, kept all of recall's answers on SmolLM2 and
# Qwen2.5-0.5B (sparse-attn eval; CHANGELOG.md), with one choice per GQA
# group (share="group": every query head of a KV head reads the same k
# blocks, not the union of up to G sets), which kept every answer of the
# per-head choice on both models at 2K-8K.  The knobs a policy does not read (n_probe
# without the probe, n_channels without channel scoring) keep their
# defaults.
POLICIES = {
    "seed": dict(importance_fraction=0.5, sink_blocks=0, scoring="probe", share="head",
                 n_probe=8, n_channels=16),
    "recall": dict(importance_fraction=0.0, sink_blocks=0, scoring="probe", share="head",
                   n_probe="all", n_channels=16),
    "fast": dict(importance_fraction=0.0, sink_blocks=1, scoring="minmax", share="group",
                 n_probe=8, n_channels=16),
    "balanced": dict(importance_fraction=0.0, sink_blocks=0, scoring="channels", share="group",
                     n_probe=8, n_channels=16),
}


# The default policy of KVCache and the transformers backend: it kept every
# answer "recall" kept on both models measured, reading a quarter of K or
# less, from the channel copy the cache keeps (docs/results.md).  Over
# plain arrays the copy would be made at every call, a read of all of K
# (about 75x a dense decode's time), so the functions there keep the seed.
CACHE_POLICY = "balanced"


# The default policy of llama.cpp's attention op (the ggml backend, spec
# §8), where nothing is kept beside llama.cpp's cache: no importance is
# recorded and no key bounds or channel copy are kept, so of the presets
# only "recall" is stateless.  Its probe of every row reads all of K to
# choose; this default probes 8 rows a block (a quarter of K at block_size
# 32) and makes one choice per KV head group, so each chosen cell is read
# once per group.
LLAMA_CPP_POLICY = dict(POLICIES["recall"], n_probe=8, share="group")


def importance_blocks(importance_fraction, k_blocks):
    """The importance reserve of spec §6: ceil(importance_fraction * k_blocks),
    with the product rounded to 9 decimals first so that 0.3 * 10 reserves 3
    blocks, not 4."""
    return int(math.ceil(round(importance_fraction * k_blocks, 9)))


def n_probe_value(n_probe, block_size):
    """n_probe as the int the C core takes: an int >= 1, or the string "all"
    (every row of a block: block_size)."""
    if isinstance(n_probe, str):
        if n_probe == "all":
            return block_size
        raise ArgumentError(f"n_probe must be an int >= 1 or 'all', got {n_probe!r}")
    return ck.check_int("n_probe", n_probe, minimum=1)


@dataclass(frozen=True)
class Selection:
    """Checked selection knobs (spec §2, §6); make one with :func:`selection`.

    Attributes
    ----------
    k_blocks, block_size : int
    n_probe : int, rows probed per block (``block_size`` for ``"all"``)
    recency : bool
    importance_fraction : float in [0, 1]
    sink_blocks : int
    share : ``"head"`` or ``"group"``
    scoring : ``"probe"``, ``"minmax"`` or ``"channels"``
    n_channels : int, channels scored per KV head (``"channels"``)
    """

    k_blocks: int
    block_size: int
    n_probe: int
    recency: bool
    importance_fraction: float
    sink_blocks: int
    share: str
    scoring: str
    n_channels: int

    @property
    def importance_blocks(self):
        return importance_blocks(self.importance_fraction, self.k_blocks)

    @property
    def probes_every_row(self):
        return self.scoring == "probe" and self.n_probe >= self.block_size

    @property
    def reads(self):
        """The metadata the selection reads beside K: ``"bounds"`` (minmax),
        ``"channels"`` (the channel copy), ``"probe_rows"`` (a probe of some
        rows, served by copies), or None (a probe of every row reads K
        itself)."""
        if self.scoring in ("minmax", "channels"):
            return "bounds" if self.scoring == "minmax" else "channels"
        return None if self.probes_every_row else "probe_rows"

    def params(self, meta=None, probe_rows=None, exact_tail=0):
        """A fresh sa_select_params for one call, pointing at the call's
        metadata (or NULL): `meta` the sa_bounds (minmax) or sa_channels
        (channels), `probe_rows` the sa_probe_rows (probe); `exact_tail`
        (checked by the caller) is read by prefill only."""
        p = ffi.new("sa_select_params *", _fields(self))
        p.exact_tail = exact_tail
        if meta is not None:
            if self.scoring == "channels":
                p.channels = meta
            else:
                p.bounds = meta
        if probe_rows is not None:
            p.probe_rows = probe_rows
        return p

    def n_blocks(self, seq_len):
        return -(-seq_len // self.block_size)

    def n_selected(self, seq_len):
        return min(self.k_blocks, self.n_blocks(seq_len))


@functools.lru_cache(maxsize=256)
def _fields(sel):
    return dict(block_size=sel.block_size, k_blocks=sel.k_blocks, n_probe=sel.n_probe,
                recency=int(sel.recency), importance_blocks=sel.importance_blocks,
                sink_blocks=sel.sink_blocks, share=SHARES[sel.share],
                scoring=SCORINGS[sel.scoring], n_channels=sel.n_channels)


def selection(policy="seed", *, k_blocks=32, block_size=32, n_probe=None, recency=True,
              importance_fraction=None, sink_blocks=None, share=None, scoring=None,
              n_channels=None):
    """The :class:`Selection` of a policy preset with every knob given (not
    None) taking precedence; each value is checked and a bad one named."""
    args = (policy, k_blocks, block_size, n_probe, recency, importance_fraction, sink_blocks,
            share, scoring, n_channels)
    try:
        return _selection(*args)
    except TypeError as exc:
        if "unhashable" not in str(exc):
            raise
        return _selection.__wrapped__(*args)   # validate uncached, for the message


@functools.lru_cache(maxsize=512, typed=True)
def _selection(policy, k_blocks, block_size, n_probe, recency, importance_fraction, sink_blocks,
               share, scoring, n_channels):
    ck.check_choice("policy", policy, POLICIES)
    knobs = dict(POLICIES[policy])
    for name, value in (("importance_fraction", importance_fraction),
                        ("sink_blocks", sink_blocks), ("scoring", scoring), ("share", share),
                        ("n_probe", n_probe), ("n_channels", n_channels)):
        if value is not None:
            knobs[name] = value
    block_size = ck.check_int("block_size", block_size, minimum=1)
    return Selection(
        k_blocks=ck.check_int("k_blocks", k_blocks, minimum=1),
        block_size=block_size,
        n_probe=n_probe_value(knobs["n_probe"], block_size),
        recency=ck.check_bool("recency", recency),
        importance_fraction=ck.check_float("importance_fraction", knobs["importance_fraction"],
                                           minimum=0.0, maximum=1.0),
        sink_blocks=ck.check_int("sink_blocks", knobs["sink_blocks"], minimum=0),
        share=ck.check_choice("share", knobs["share"], SHARES),
        scoring=ck.check_choice("scoring", knobs["scoring"], SCORINGS),
        n_channels=ck.check_int("n_channels", knobs["n_channels"], minimum=1))


def _spec_bool(text):
    """A yes/no knob; any other word is refused, not read as no."""
    word = text.lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("0", "false", "no"):
        return False
    raise ValueError(text)


def _spec_layers(text):
    """Layer indices joined by '+', each >= 0 (the model's layer count is
    checked where the model is known)."""
    layers = tuple(int(i) for i in text.split("+") if i)
    if any(i < 0 for i in layers):
        raise ValueError(text)
    return layers


# Knobs a policy spec of the command line may set, and how to read them.
_SPEC_KNOBS = {
    "importance_fraction": float,
    "sink_blocks": int,
    "scoring": str,
    "share": str,
    "n_probe": lambda v: v if v == "all" else int(v),
    "n_channels": int,
    "recency": _spec_bool,
    "dense_layers": _spec_layers,
}


def parse_policy(spec):
    """A policy of the command line: ``name`` of a preset, or
    ``name:key=value,key=value`` over selection knobs (``dense_layers=0+1``
    for the transformers backend), over the preset ``name`` if it is one,
    else over ``seed``.  Returns (label, knobs): the knobs in full (the
    preset's, then the ones given), checked by resolving them once; the
    label is ``name``, or the whole spec for a preset changed by knobs.
    Raises ArgumentError naming what is wrong."""
    name, _, rest = spec.strip().partition(":")
    if not rest:
        ck.check_choice("policy", name, POLICIES)
        return name, dict(POLICIES[name])
    knobs = {}
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key not in _SPEC_KNOBS:
            raise ArgumentError(f"policy {name}: unknown knob {key!r} (knobs: "
                                f"{', '.join(_SPEC_KNOBS)})")
        try:
            knobs[key] = _SPEC_KNOBS[key](value)
        except ValueError:
            raise ArgumentError(f"policy {name}: {key}={value!r} is not a valid "
                                f"{key}") from None
    base = name if name in POLICIES else "seed"
    selection(base, **{k: v for k, v in knobs.items() if k != "dense_layers"})
    # the knobs over the base preset, in full: callers pass them on without
    # the name, and a preset changed by knobs is labelled by the whole spec
    return (spec.strip() if name in POLICIES else name), dict(POLICIES[base], **knobs)


def stateless_selection(policy=None, *, k_blocks, block_size=32, n_probe=None, recency=True,
                        importance_fraction=None, sink_blocks=None, share=None, scoring=None):
    """The :class:`Selection` of llama.cpp's attention op (spec §8): a
    preset (default :data:`LLAMA_CPP_POLICY`) and the knobs given, which
    must not need state kept beside llama.cpp's cache.

    Raises
    ------
    UnsupportedError
        An importance reserve (``importance_fraction`` above 0: ``seed``'s)
        or scoring from metadata (``minmax``: ``fast``; ``channels``:
        ``balanced``), with what to give instead.
    """
    knobs = dict(n_probe=n_probe, importance_fraction=importance_fraction,
                 sink_blocks=sink_blocks, share=share, scoring=scoring)
    if policy is None:
        base = {k: v for k, v in LLAMA_CPP_POLICY.items() if k in knobs}
        knobs = {k: base[k] if v is None else v for k, v in knobs.items()}
        policy = "recall"
    sel = selection(policy, k_blocks=k_blocks, block_size=block_size, recency=recency, **knobs)
    if sel.importance_fraction > 0:
        raise UnsupportedError(
            f"policy {policy}: importance_fraction {sel.importance_fraction:g} needs the "
            "importance prefill recorded, which the ggml backend does not keep yet: give "
            "importance_fraction=0 (or use recall)")
    if sel.scoring != "probe":
        what = "key bounds" if sel.scoring == "minmax" else "a channel copy"
        raise UnsupportedError(
            f"policy {policy}: scoring={sel.scoring} reads {what} kept beside K as it is "
            "appended, which the ggml backend does not keep yet: give scoring=probe (or use "
            "recall)")
    return sel


def stateless_spec(sel):
    """The policy text the C core's sa_ggml_settings_parse reads back as
    `sel` (every knob given)."""
    return (f"recall:n_probe={sel.n_probe},importance_fraction=0,sink_blocks={sel.sink_blocks},"
            f"share={sel.share},scoring=probe,recency={int(sel.recency)},"
            f"block_size={sel.block_size}")

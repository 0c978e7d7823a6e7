"""Synthetic long-context retrieval data shaped like a real model's attention.

The article's experiment hides one fact ("Zara's favourite food is ramen") in
the middle of a 2061-token context and asks for it at the end.  This module
builds the attention-level equivalent for one layer, deterministic from a
seed, with the structure that makes block selection hard or easy:

* **background**: every key and value is Gaussian noise (diffuse attention);
* **attention sinks**: the first ``n_sinks`` keys carry a shared direction
  ``u_sink`` that every query has a component along, so they draw mass from
  every row, as real models' first tokens do;
* **recency**: the last ``n_recent`` keys carry a direction ``u_recent``
  that queries also look along, so the tail of the context matters;
* **the needle**: ``needle_len`` consecutive tokens in the middle of a block
  in the middle of the context carry a direction ``u_needle`` and values
  along a distinct direction ``w_needle``.  The prompt's queries do not look
  for it (so prefill importance does not favour it); the final question's
  query does, for the ``retrieval_heads`` that need it, the way the article's
  question does.

All directions are orthonormal, drawn per KV head from the seed.
"""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class NeedleContext:
    """One layer's KV plus the queries that read it.

    Attributes
    ----------
    k, v : float32 ``[Hkv, S, D]``
    prompt_q : float32 ``[H, T, D]``, queries of the last T prompt tokens
        (positions ``[S - T, S)``); prefill them to get importance
    question_q : float32 ``[H, D]``, the decode query asking for the needle
    needle : ``range`` of the needle's token positions
    block_size : int, the block size the needle was placed for
    retrieval_heads : bool ``[H]``, heads whose question query looks for it
    """

    k: np.ndarray
    v: np.ndarray
    prompt_q: np.ndarray
    question_q: np.ndarray
    needle: range
    block_size: int
    retrieval_heads: np.ndarray = field(repr=False)

    @property
    def needle_block(self):
        return self.needle.start // self.block_size

    @property
    def seq_len(self):
        return self.k.shape[1]


def needle_context(seq_len, *, n_heads=16, n_kv_heads=8, head_dim=128, seed=0,
                   block_size=32, needle_len=6, n_sinks=4, n_recent=64, prompt_tokens=None,
                   retrieval_fraction=1.0, needle_strength=14.0):
    """Build a :class:`NeedleContext` (see the module docstring).

    Parameters
    ----------
    seq_len : int, context length S (>= 4 blocks)
    n_heads, n_kv_heads, head_dim : int, defaults Qwen3-VL-2B's 16, 8, 128
    seed : int, default 0; everything is a function of it
    block_size : int, default 32; the needle starts mid-block
    needle_len : int, default 6 (>= block_size / n_probe keeps it sampled by
        the default probe)
    n_sinks, n_recent : int, defaults 4 and 64
    prompt_tokens : int or None; the prompt queries returned (default all S)
    retrieval_fraction : float, share of query heads that look for the needle
    needle_strength : float, default 14; the needle's logit for a retrieval
        head's question (background logits are about N(0, 0.4^2))
    """
    if seq_len < 4 * block_size:
        raise ValueError(f"seq_len ({seq_len}) must be at least 4 blocks of {block_size}")
    rng = np.random.default_rng(seed)
    T = seq_len if prompt_tokens is None else min(prompt_tokens, seq_len)
    D, S, H, Hkv = head_dim, seq_len, n_heads, n_kv_heads
    group = H // Hkv
    sqrt_d = np.sqrt(D)

    # Four orthonormal directions per KV head: sink, recent, needle key, needle value.
    basis = np.linalg.qr(rng.standard_normal((Hkv, D, 4)))[0].astype(np.float32)
    u_sink, u_recent, u_needle, w_needle = (basis[:, :, i] for i in range(4))

    nb = -(-S // block_size)
    needle_block = nb // 2
    start = needle_block * block_size + (block_size - needle_len) // 2
    needle = range(start, start + needle_len)

    # A key component alpha * sqrt(D) * u met by a query component beta * u
    # adds alpha * beta to the logit (scale 1/sqrt(D)); background logits are
    # about N(0, 0.4^2).
    k = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    k[:, :n_sinks] += 2.0 * sqrt_d * u_sink[:, None]
    k[:, S - n_recent:] += 1.0 * sqrt_d * u_recent[:, None]
    k[:, needle.start:needle.stop] += needle_strength / 3.0 * sqrt_d * u_needle[:, None]
    v[:, needle.start:needle.stop] = 4.0 * w_needle[:, None] + 0.1 * v[:, needle.start:needle.stop]

    kv_of = np.arange(H) // group
    n_retrieval = int(round(retrieval_fraction * H))
    retrieval = np.zeros(H, bool)
    retrieval[rng.permutation(H)[:n_retrieval]] = True

    # Prompt queries look at the sinks (logit 5) and the recent tail (1.5),
    # never for the needle, so prefill importance does not point at it.
    prompt_q = (0.3 * rng.standard_normal((H, T, D), dtype=np.float32)
                + 2.5 * u_sink[kv_of][:, None] + 1.5 * u_recent[kv_of][:, None])
    # The question leans on sinks (4) and recency (1.5) too; retrieval heads
    # also look for the needle (logit needle_strength, 14 by default).
    question_q = (0.3 * rng.standard_normal((H, D)) + 2.0 * u_sink[kv_of]
                  + 1.5 * u_recent[kv_of])
    question_q[retrieval] += 3.0 * u_needle[kv_of][retrieval]

    f32 = np.float32
    return NeedleContext(k, v, prompt_q.astype(f32, copy=False), question_q.astype(f32),
                         needle, block_size, retrieval)

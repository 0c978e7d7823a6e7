"""The article's board experiment at kernel level (seed §3): a 2061-token
context with a needle in the middle of a block in the middle, importance from
a real prefill of that context."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn.synthetic import needle_context

from conftest import rel_err

# The seed's bar for "k=32 matches exact": the board output was byte-identical
# text; at kernel level we ask the attention output to be within 1e-2.
CLOSE_TO_EXACT = 1e-2


@pytest.fixture(scope="module")
def article():
    ctx = needle_context(2061, n_heads=8, n_kv_heads=4, head_dim=64, seed=7)
    _, importance = sa.prefill(ctx.prompt_q, ctx.k, ctx.v)
    return ctx, importance


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_k32_finds_needle_and_matches_exact(isa, article, dtype):
    ctx, importance = article
    k, v = ctx.k, ctx.v
    if dtype == "q8":
        k, v = sa.quantize_q8(k), sa.quantize_q8(v)
    exact = sa.dense_decode(ctx.question_q, k, v)
    out, blocks = sa.sparse_decode(ctx.question_q, k, v, k_blocks=32, importance=importance,
                                   return_blocks=True)
    assert (blocks == ctx.needle_block).any(axis=1).all()
    assert rel_err(out, exact) < CLOSE_TO_EXACT


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_k1_with_importance_collapses(isa, article, dtype):
    """k=1: the reserve is (1+1)//2 = 1 block, so the single slot goes to the
    block prefill attended to most (the sinks), the probe never gets a say,
    and the needle is lost (spec §2.5)."""
    ctx, importance = article
    k, v = ctx.k, ctx.v
    if dtype == "q8":
        k, v = sa.quantize_q8(k), sa.quantize_q8(v)
    nb = -(-ctx.seq_len // 32)
    imp_blocks = np.add.reduceat(importance, np.arange(0, ctx.seq_len, 32))
    assert imp_blocks.shape == (nb,)
    exact = sa.dense_decode(ctx.question_q, k, v)
    out, blocks = sa.sparse_decode(ctx.question_q, k, v, k_blocks=1, importance=importance,
                                   return_blocks=True)
    assert (blocks[:, 0] == int(np.argmax(imp_blocks))).all()
    assert not (blocks == ctx.needle_block).any()
    assert rel_err(out, exact) > 0.5
    # The probe alone would have found it, were recency not to replace its pick.
    probe_only = sa.select_blocks(ctx.question_q, k, k_blocks=1, recency=False)
    assert (probe_only == ctx.needle_block).all()

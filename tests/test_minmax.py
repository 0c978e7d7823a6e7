"""scoring="minmax" (spec §6): per-block key bounds and Quest's score."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from conftest import make_kv, rel_err, rtol_for


@pytest.mark.parametrize("dtype,D,gs", [("float32", 64, None), ("q8", 128, 32),
                                        ("float32", 67, None), ("q8", 24, 8)])
@pytest.mark.parametrize("block_size,seq_len", [(32, 300), (7, 100), (50, 49)])
def test_bounds_match_reference_and_bound_the_keys(rng, dtype, D, gs, block_size, seq_len):
    k, _ = make_kv(rng, 3, seq_len + 9, D, dtype, gs or 32)
    got = sa.block_bounds(k, block_size=block_size, seq_len=seq_len)
    want = ref.block_bounds(k, block_size=block_size, seq_len=seq_len)
    for name in ("mn", "mx", "scales"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    keys = (k.dequantize() if isinstance(k, sa.Q8) else k)[:, :seq_len]
    for b in range(got.mn.shape[1]):
        rows = keys[:, b * block_size:(b + 1) * block_size]
        s = np.repeat(got.scales[:, b], got.scale_group, axis=1)
        assert (got.mn[:, b] * s <= rows.min(axis=1)).all()
        assert (got.mx[:, b] * s >= rows.max(axis=1)).all()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_minmax_score_is_an_upper_bound_of_every_dot(isa, rng, dtype):
    H, Hkv, D, S = 8, 2, 64, 320
    k, _ = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    bounds = sa.block_bounds(k, block_size=32)
    score = ref.minmax_scores(q, bounds)
    keys = k.dequantize() if isinstance(k, sa.Q8) else k
    dots = np.einsum("hd,hsd->hs", q.astype(np.float64), keys[np.arange(H) // 4].astype(np.float64))
    assert (score + 1e-5 >= dots.reshape(H, -1, 32).max(axis=2)).all()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("share", ["head", "group"])
@pytest.mark.parametrize("with_importance", [False, True])
def test_minmax_selection_matches_reference(isa, rng, dtype, share, with_importance):
    H, Hkv, D, S = 8, 2, 64, 650
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32) if with_importance else None
    kw = dict(k_blocks=5, scoring="minmax", share=share, importance=imp, sink_blocks=1)
    out, blocks = sa.sparse_decode(q, k, v, return_blocks=True, **kw)
    want, want_blocks = ref.sparse_decode(q, k, v, return_blocks=True, **kw)
    np.testing.assert_array_equal(blocks, want_blocks)
    assert rel_err(out, want) < rtol_for(k)
    # Passing precomputed bounds gives the same bytes as computing them on the fly.
    bounds = sa.block_bounds(k)
    again = sa.sparse_decode(q, k, v, bounds=bounds, **kw)
    assert again.tobytes() == out.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_cache_keeps_bounds_up_to_date(isa, rng, dtype):
    Hkv, D = 2, 64
    cache = sa.KVCache(Hkv, D, capacity=10, dtype=dtype)
    parts = []
    for T in (1, 40, 3, 1, 1, 90, 7):
        k = rng.standard_normal((Hkv, T, D), dtype=np.float32)
        cache.append(k, k)
        parts.append(k)
        fresh = sa.block_bounds(cache.k)
        for name in ("mn", "mx", "scales"):
            np.testing.assert_array_equal(getattr(cache.bounds, name), getattr(fresh, name))
    q = rng.standard_normal((4, D), dtype=np.float32)
    # (the cache's preset is balanced, one choice per group; the function's
    # the seed, one per head: the same knobs for both)
    got = cache.decode(q, k_blocks=2, scoring="minmax", share="head")
    want = sa.sparse_decode(q, cache.k, cache.v, k_blocks=2, scoring="minmax")
    assert got.tobytes() == want.tobytes()


def test_minmax_finds_the_needle_at_32k_reading_little(rng):
    """At 32K tokens the bounds a selection reads are a small fraction of what
    the 8-of-32 probe reads from q8 K."""
    from sparse_attn.synthetic import needle_context
    ctx = needle_context(32768, n_heads=4, n_kv_heads=2, head_dim=128, seed=3,
                         prompt_tokens=32)
    cache = sa.KVCache(2, 128, capacity=32768, dtype="q8")
    cache.append(ctx.k, ctx.v)
    blocks = sa.select_blocks(ctx.question_q, cache.k, k_blocks=32, scoring="minmax",
                              share="group", bounds=cache.bounds, sink_blocks=1)
    assert (blocks == ctx.needle_block).any(axis=1).all()
    probe_bytes = 8 * (128 + 4 * 4)                  # 8 sampled q8 rows per block
    assert cache.bounds.nbytes / cache.bounds.mn.shape[1] / 2 < 0.25 * probe_bytes


def test_minmax_rejects_mismatched_bounds(rng):
    k, v = make_kv(rng, 2, 100, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    b = sa.block_bounds(k, block_size=32, seq_len=90)
    with pytest.raises(ValueError, match=r"bounds cover 90 rows but seq_len is 100"):
        sa.sparse_decode(q, k, v, scoring="minmax", bounds=b)
    with pytest.raises(ValueError, match="block_size 32, not 16"):
        sa.select_blocks(q, k, seq_len=90, block_size=16, scoring="minmax", bounds=b)
    with pytest.raises(ValueError, match="only read with scoring='minmax'"):
        sa.sparse_decode(q, k, v, bounds=b, seq_len=90)
    with pytest.raises(ValueError, match="scoring must be one of"):
        sa.sparse_decode(q, k, v, scoring="quest")
    with pytest.raises(TypeError, match="bounds must be a BlockBounds"):
        sa.sparse_decode(q, k, v, scoring="minmax", bounds=np.zeros(3))
    k2, _ = make_kv(rng, 1, 100, 64)
    with pytest.raises(ValueError, match="bounds are for"):
        sa.sparse_decode(q, k2, k2, scoring="minmax", bounds=sa.block_bounds(k))

"""Sparse prefill (docs/spec.md §7) and the prefill structure: every ISA
against the numpy reference, the exact cases bit for bit, chunks, threads,
the cache's path, and bad input."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref
from conftest import gemm_form, make_kv, pow2_scales, rel_err, rtol_for

POLICIES = [
    dict(policy="seed"),
    dict(policy="recall"),
    dict(policy="fast"),
    dict(policy="seed", share="group", sink_blocks=1),
    dict(policy="seed", scoring="minmax", recency=False),
]


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("knobs", POLICIES, ids=lambda k: "-".join(map(str, k.values())))
def test_sparse_prefill_matches_the_reference(isa, rng, dtype, knobs):
    """Outputs and importance of sparse prefill agree with the reference:
    GQA, a start inside a block, a partial last block, blocks that choose."""
    H, Hkv, D, bs, start, T = 6, 2, 64, 16, 21, 150
    k, v = make_kv(rng, Hkv, start + T + 5, D, dtype)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    prior = rng.random(start, dtype=np.float32)
    out, imp = sa.prefill(q, k, v, start=start, k_blocks=3, block_size=bs, importance=prior,
                          **knobs)
    want, want_imp = ref.prefill(q, k, v, start=start, k_blocks=3, block_size=bs,
                                 importance=prior, **knobs)
    assert rel_err(out, want) < rtol_for(k)
    assert rel_err(imp, want_imp) < rtol_for(k)
    # every row's weights sum to one over what it attended
    assert abs(float(imp.sum()) - H * T) < 1e-3 * H * T


def test_sparse_prefill_is_sparse(rng):
    """With few blocks each row reads its own block and k_blocks - 1 others:
    keys of blocks nobody chose get no importance from the rows that skip
    them, and the output differs from exact prefill."""
    H, Hkv, D, bs, T = 2, 1, 32, 8, 96
    k, v = make_kv(rng, Hkv, T, D)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v, k_blocks=2, block_size=bs)
    exact, exact_imp = sa.prefill(q, k, v)
    assert not np.array_equal(out, exact)
    # rows of blocks 0 and 1 (a prefix of at most 2 blocks) are exact, bitwise
    np.testing.assert_array_equal(out[:, :2 * bs], exact[:, :2 * bs])
    # the last block's rows attend to 2 blocks: the first block gets less mass
    assert imp[:bs].sum() < exact_imp[:bs].sum()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_every_block_chosen_is_exact_prefill(isa, rng, dtype):
    """k_blocks >= the number of blocks: bitwise exact prefill's output,
    importance within 1e-6; a prefill row stays dense decode (on q8 within
    rounding, bit for bit with V's scales powers of two; within tolerance on
    float32 K: spec §3)."""
    H, Hkv, D, bs, start, T = 4, 2, 64, 32, 37, 300
    k, v = make_kv(rng, Hkv, start + T, D, dtype)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    exact, exact_imp = sa.prefill(q, k, v, start=start)
    for knobs in POLICIES:
        out, imp = sa.prefill(q, k, v, start=start, k_blocks=11, block_size=bs, **knobs)
        assert out.tobytes() == exact.tobytes()
        assert rel_err(imp, exact_imp) < 1e-6
    v2 = pow2_scales(v) if dtype == "q8" else None
    exact2 = sa.prefill(q, k, v2, start=start)[0] if dtype == "q8" else None
    for t in (0, 100, T - 1):
        q_t = np.ascontiguousarray(q[:, t])
        row = sa.dense_decode(q_t, k, v, seq_len=start + t + 1)
        if dtype == "q8":
            assert rel_err(row, exact[:, t]) < 1e-6
            row2 = sa.dense_decode(q_t, k, v2, seq_len=start + t + 1)
            assert row2.tobytes() == np.ascontiguousarray(exact2[:, t]).tobytes()
        else:
            assert rel_err(row, exact[:, t]) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("knobs", POLICIES[:2] + POLICIES[3:],
                         ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("start, tail", [(0, 40), (21, 1), (21, 63), (100, 30), (0, 1000)])
def test_exact_tail_matches_the_reference(isa, rng, dtype, knobs, start, tail):
    """exact_tail: the blocks holding the call's last rows are exact
    prefill's bit for bit (a tail reaching into the call's first block:
    the whole call), the blocks before it sparse prefill's without a tail
    bit for bit, and all of it agrees with the reference, importance too."""
    H, Hkv, D, bs, S = 6, 2, 32, 16, 171
    T = S - start
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    prior = rng.random(start, dtype=np.float32) if start else None
    out, imp = sa.prefill(q, k, v, start=start, k_blocks=3, block_size=bs, importance=prior,
                          exact_tail=tail, **knobs)
    want, want_imp = ref.prefill(q, k, v, start=start, k_blocks=3, block_size=bs,
                                 importance=prior, exact_tail=tail, **knobs)
    assert rel_err(out, want) < rtol_for(k)
    assert rel_err(imp, want_imp) < rtol_for(k)
    split = max(start, (S - tail) // bs * bs) - start
    exact, _ = sa.prefill(q, k, v, start=start)
    plain, _ = sa.prefill(q, k, v, start=start, k_blocks=3, block_size=bs, importance=prior,
                          **knobs)
    assert out[:, split:].tobytes() == exact[:, split:].tobytes()
    assert np.ascontiguousarray(out[:, :split]).tobytes() == \
        np.ascontiguousarray(plain[:, :split]).tobytes()
    if 0 < split:
        # the tail's rows changed something: the plain rule is sparse there
        assert not np.array_equal(plain[:, split:], exact[:, split:])
    assert abs(float(imp.sum()) - H * T) < 1e-3 * H * T
    again = sa.prefill(q, k, v, start=start, k_blocks=3, block_size=bs, importance=prior,
                       exact_tail=tail, threads=3, **knobs)
    assert again[0].tobytes() == out.tobytes() and again[1].tobytes() == imp.tobytes()


def test_exact_tail_of_the_cache(rng):
    """KVCache.prefill(exact_tail=...) is sparse_attn.prefill's, with the
    cache's record as the prior."""
    H, Hkv, D, bs = 4, 2, 32, 16
    cache = sa.KVCache(Hkv, D, block_size=bs)
    k, v = make_kv(rng, Hkv, 200, D)
    q = rng.standard_normal((H, 200, D), dtype=np.float32)
    cache.append(k[:, :120], v[:, :120])
    cache.prefill(np.ascontiguousarray(q[:, :120]), k_blocks=2, policy="seed")
    prior = cache.importance.copy()
    cache.append(k[:, 120:], v[:, 120:])
    got = cache.prefill(np.ascontiguousarray(q[:, 120:]), k_blocks=2, policy="seed",
                        exact_tail=40)
    want, _ = sa.prefill(np.ascontiguousarray(q[:, 120:]), cache.k, cache.v, start=120,
                         k_blocks=2, block_size=bs, policy="seed", importance=prior,
                         exact_tail=40)
    assert got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="exact_tail"):
        cache.prefill(np.ascontiguousarray(q[:, 180:]), k_blocks=2, exact_tail=-1)


def test_long_rows_match_the_reference(isa, rng):
    """Rows of a few thousand keys (many tiles, several slices per KV head,
    scores beyond an L2's worth): exact and sparse against the reference on
    sampled rows."""
    H, Hkv, D, T = 3, 1, 32, 1100
    k, v = make_kv(rng, Hkv, T, D)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v)
    for t in (0, 31, 32, 555, T - 1):
        want = ref.dense_decode(np.ascontiguousarray(q[:, t]), k, v, seq_len=t + 1)
        assert rel_err(out[:, t], want) < 1e-5
    assert abs(float(imp.sum()) - H * T) < 1e-3 * H * T
    sp, sp_imp = sa.prefill(q, k, v, k_blocks=4, block_size=32, policy="recall")
    want, want_imp = ref.prefill(q, k, v, k_blocks=4, block_size=32, policy="recall")
    assert rel_err(sp, want) < 1e-5
    assert rel_err(sp_imp, want_imp) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_block_aligned_chunks_add_up(rng, dtype):
    """Sparse prefill in chunks that end on block boundaries, without a
    prior, gives one-shot prefill's outputs (bitwise for q8, and for float32
    chunks that take the one-shot call's GEMM form, spec §3; within
    tolerance for the others) and its importance when the chunks'
    importance is added up."""
    H, Hkv, D, bs, S = 4, 2, 32, 16, 200
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, S, D), dtype=np.float32)
    whole, whole_imp = sa.prefill(q, k, v, k_blocks=3, block_size=bs)
    imp = np.zeros(S, np.float32)
    for a, b in [(0, 48), (48, 64), (64, 200)]:
        out, part = sa.prefill(np.ascontiguousarray(q[:, a:b]), k, v, start=a, k_blocks=3,
                               block_size=bs)
        if dtype == "q8" or gemm_form(b - a, a, H, Hkv):
            np.testing.assert_array_equal(out, whole[:, a:b])
        else:
            assert rel_err(out, whole[:, a:b]) < 1e-5
        imp[:b] += part
    assert rel_err(imp, whole_imp) < 1e-5


@pytest.mark.parametrize("knobs", [dict(policy="seed"), dict(policy="fast")])
def test_threads_do_not_change_a_bit(isa, rng, knobs):
    H, Hkv, D, T = 6, 3, 64, 400
    k, v = make_kv(rng, Hkv, T, D)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    prior = None
    results = [sa.prefill(q, k, v, k_blocks=3, threads=t, **knobs) for t in (1, 2, 3, 8)]
    results += [sa.prefill(q, k, v, threads=t) for t in (1, 2, 5)]
    for out, imp in results[1:4]:
        assert out.tobytes() == results[0][0].tobytes()
        assert imp.tobytes() == results[0][1].tobytes()
    for out, imp in results[5:]:
        assert out.tobytes() == results[4][0].tobytes()
        assert imp.tobytes() == results[4][1].tobytes()
    del prior


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("policy", ["seed", "fast"])
def test_cache_prefill_is_prefill_with_its_record(rng, dtype, policy):
    """KVCache.prefill(k_blocks=...) is sparse_attn.prefill over the cache
    with the importance its earlier prefills recorded (the reserve), its
    own bounds or probe-row copies giving bitwise what K gives."""
    H, Hkv, D, bs = 4, 2, 64, 16
    cache = sa.KVCache(Hkv, D, dtype=dtype, block_size=bs)
    k, v = make_kv(rng, Hkv, 300, D)
    q = rng.standard_normal((H, 300, D), dtype=np.float32)
    recorded = np.zeros(0, np.float32)
    for a, b in [(0, 100), (100, 230), (230, 300)]:
        cache.append(k[:, a:b], v[:, a:b])
        got = cache.prefill(np.ascontiguousarray(q[:, a:b]), k_blocks=3, policy=policy)
        kk, vv = cache.k, cache.v
        want, imp = sa.prefill(np.ascontiguousarray(q[:, a:b]), kk, vv, start=a, k_blocks=3,
                               block_size=bs, policy=policy,
                               importance=recorded if recorded.any() else None)
        assert got.tobytes() == want.tobytes()
        recorded = np.concatenate([recorded, np.zeros(b - a, np.float32)]) + imp
        np.testing.assert_allclose(cache.importance, recorded, rtol=1e-6, atol=0)


def test_bad_sparse_prefill_input(rng):
    H, Hkv, D, T = 2, 1, 32, 40
    k, v = make_kv(rng, Hkv, 64, D)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    with pytest.raises(ValueError, match="k_blocks"):
        sa.prefill(q, k, v, k_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        sa.prefill(q, k, v, k_blocks=2, block_size=0)
    with pytest.raises(ValueError, match="importance.*start"):
        sa.prefill(q, k, v, start=10, k_blocks=2, importance=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="importance"):
        bad = np.ones(10, np.float32)
        bad[3] = np.nan
        sa.prefill(q, k, v, start=10, k_blocks=2, importance=bad)
    with pytest.raises(ValueError, match="only read by sparse prefill"):
        sa.prefill(q, k, v, importance=np.ones(64, np.float32))
    with pytest.raises(ValueError, match="bounds"):
        other = sa.block_bounds(k, block_size=32, seq_len=20)
        sa.prefill(q, k, v, k_blocks=2, scoring="minmax", bounds=other)
    with pytest.raises(ValueError, match="policy"):
        sa.prefill(q, k, v, k_blocks=2, policy="nope")
    for bad, kind in ((-1, ValueError), (2 ** 31, ValueError), (True, TypeError),
                      (3.0, TypeError), ("64", TypeError)):
        with pytest.raises(kind, match="exact_tail"):
            sa.prefill(q, k, v, k_blocks=2, exact_tail=bad)
    # the largest C int: every row is in the tail, so the call is exact
    out, _ = sa.prefill(q, k, v, k_blocks=2, exact_tail=2 ** 31 - 1)
    assert out.tobytes() == sa.prefill(q, k, v)[0].tobytes()
    # a NaN in the prior beyond start is never read, so it is accepted
    prior = np.ones(64, np.float32)
    prior[20:] = np.nan
    sa.prefill(q, k, v, start=10, k_blocks=2, importance=prior[:64])

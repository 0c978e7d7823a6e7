"""q8 quantisation (spec §4) and the KV cache."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from conftest import rel_err


@pytest.mark.parametrize("gs", [1, 3, 8, 32, 96])
def test_quantize_is_bit_identical_to_reference(rng, gs):
    x = (rng.standard_normal((5, 7, 96)) * rng.choice([1e-3, 1.0, 1e4], (5, 7, 1))).astype(np.float32)
    x[0, 0, :gs] = 0.0                               # an all-zero group: d = 0, q = 0
    got, want = sa.quantize_q8(x, gs), ref.quantize_q8(x, gs)
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.scales, want.scales)
    assert (got.data[0, 0, :gs] == 0).all() and got.scales[0, 0, 0] == 0
    assert got.data.min() >= -127 and got.data.max() <= 127
    # dequantise error is at most half a step per element
    step = np.repeat(got.scales, gs, axis=-1)
    assert (np.abs(got.dequantize() - x) <= 0.5 * step * (1 + 1e-6) + 1e-30).all()


def test_quantize_rounds_ties_away_from_zero():
    # amax 127 -> d = 1, id = 1: x * id = x exactly, so .5 ties are real ties.
    x = np.array([[127.0, 0.5, -0.5, 1.5, -2.5, 2.4999998]], np.float32)
    q = sa.quantize_q8(x, 6)
    assert q.data.tolist() == [[127, 1, -1, 2, -3, 2]]


def test_q8_roundtrip_decode_close_to_float(rng):
    H, Hkv, D, S = 8, 2, 128, 500
    k = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    q = rng.standard_normal((H, D), dtype=np.float32)
    exact = sa.dense_decode(q, k, v)
    q8 = sa.dense_decode(q, sa.quantize_q8(k), sa.quantize_q8(v))
    assert rel_err(q8, exact) < 0.05                 # quantisation error, not a bug


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_cache_append_grows_and_matches_direct(isa, rng, dtype):
    Hkv, D = 2, 64
    cache = sa.KVCache(Hkv, D, capacity=8, dtype=dtype)
    ks, vs = [], []
    for T in (5, 1, 30, 100, 1):
        k = rng.standard_normal((Hkv, T, D), dtype=np.float32)
        v = rng.standard_normal((Hkv, T, D), dtype=np.float32)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    k_all, v_all = np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)
    assert cache.seq_len == 137 and cache.capacity >= 137
    if dtype == "q8":
        want = sa.quantize_q8(k_all)
        np.testing.assert_array_equal(cache.k.data, want.data)
        np.testing.assert_array_equal(cache.k.scales, want.scales)
        kd, vd = want, sa.quantize_q8(v_all)
    else:
        np.testing.assert_array_equal(cache.k, k_all)
        kd, vd = k_all, v_all
    q = rng.standard_normal((4, D), dtype=np.float32)
    # The cache's views (with a head stride of `capacity` rows) give the same
    # bytes as contiguous copies of the same values; the cache decodes with
    # policy="balanced" by default (from its channel copy), the plain
    # function with the seed's rule.
    assert cache.decode(q, k_blocks=2).tobytes() == \
        sa.sparse_decode(q, kd, vd, k_blocks=2, policy="balanced").tobytes()
    assert cache.decode(q, k_blocks=2, policy="seed").tobytes() == \
        sa.sparse_decode(q, kd, vd, k_blocks=2).tobytes()
    assert sa.dense_decode(q, cache.k, cache.v).tobytes() == sa.dense_decode(q, kd, vd).tobytes()


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_cache_decoder_is_decode_bitwise_through_appends_and_growth(isa, rng, dtype):
    """KVCache.decoder (the per-layer, per-token call of the transformers
    backend): bitwise what decode / dense_decode give over the cache, with
    its recorded importance, as the cache grows past its capacity; the
    pointer form (call_at) writes the same bytes."""
    from sparse_attn._ffi import ffi
    Hkv, H, D = 2, 6, 64
    cache = sa.KVCache(Hkv, D, capacity=40, dtype=dtype)
    kv = rng.standard_normal((Hkv, 200, D), dtype=np.float32)
    cache.append(kv[:, :70], kv[:, :70])
    cache.add_importance(rng.random(70, dtype=np.float32))
    sparse = cache.decoder(k_blocks=2, return_blocks=True)
    dense = cache.decoder(dense=True, return_blocks=True)
    for n in (70, 71, 160):
        if n > cache.seq_len:
            cache.append(kv[:, cache.seq_len:n], kv[:, cache.seq_len:n])
        q = rng.standard_normal((H, D), dtype=np.float32)
        out, blocks = sparse(q)
        want, want_blocks = cache.decode(q, k_blocks=2, return_blocks=True)
        assert out.tobytes() == want.tobytes()
        np.testing.assert_array_equal(blocks, want_blocks)
        got_dense = dense(q)                      # dense decoders return the output only
        assert got_dense.tobytes() == cache.dense_decode(q).tobytes()
        at = np.full_like(q, np.nan)
        got_blocks = sparse.call_at(ffi.from_buffer("float[]", q), H,
                                    ffi.from_buffer("float[]", at))
        assert at.tobytes() == out.tobytes()
        np.testing.assert_array_equal(got_blocks, blocks)
    assert cache.capacity >= 160
    with pytest.raises(sa.SparseAttnError, match="multiple of n_kv_heads"):
        sparse(np.zeros((5, D), np.float32))


def test_cache_prefill_accumulates_importance(rng):
    Hkv, H, D = 2, 4, 32
    cache = sa.KVCache(Hkv, D, capacity=16, dtype="float32")
    k = rng.standard_normal((Hkv, 50, D), dtype=np.float32)
    v = rng.standard_normal((Hkv, 50, D), dtype=np.float32)
    q = rng.standard_normal((H, 50, D), dtype=np.float32)
    cache.append(np.ascontiguousarray(k[:, :20]), np.ascontiguousarray(v[:, :20]))
    out1 = cache.prefill(np.ascontiguousarray(q[:, :20]))
    cache.append(np.ascontiguousarray(k[:, 20:]), np.ascontiguousarray(v[:, 20:]))
    out2 = cache.prefill(np.ascontiguousarray(q[:, 20:]))
    whole, imp = sa.prefill(q, k, v)
    np.testing.assert_array_equal(np.concatenate([out1, out2], axis=1), whole)
    assert rel_err(cache.importance, imp) < 1e-5
    got = cache.decode(q[:, -1].copy(), k_blocks=1, policy="seed")
    want = sa.sparse_decode(q[:, -1].copy(), k, v, k_blocks=1, importance=cache.importance.copy())
    assert got.tobytes() == want.tobytes()


def test_cache_rejects_bad_appends(rng):
    cache = sa.KVCache(2, 64)
    good = np.zeros((2, 3, 64), np.float32)
    bad = good.copy()
    bad[1, 2, 5] = np.nan
    with pytest.raises(ValueError, match="k holds NaN"):
        cache.append(bad, good)
    with pytest.raises(ValueError, match="v holds NaN"):
        cache.append(good, bad)
    with pytest.raises(ValueError, match=r"k must have shape \[2, T, 64\]"):
        cache.append(np.zeros((3, 3, 64), np.float32), good)
    with pytest.raises(ValueError, match="same number of tokens"):
        cache.append(good, good[:, :2].copy())
    assert cache.seq_len == 0                        # nothing was written
    with pytest.raises(ValueError, match="group_size"):
        sa.KVCache(2, 64, group_size=48)
    with pytest.raises(ValueError, match="dtype must be one of"):
        sa.KVCache(2, 64, dtype="int4")
    with pytest.raises(ValueError, match="append their K/V first"):
        cache.prefill(np.zeros((2, 4, 64), np.float32))
    with pytest.raises(ValueError, match="more than the cache's seq_len"):
        cache.add_importance(np.ones(4, np.float32))


def test_cache_memory_is_quarter_of_float32():
    q8 = sa.KVCache(8, 128, capacity=4096, dtype="q8")
    f32 = sa.KVCache(8, 128, capacity=4096, dtype="float32")
    assert q8.nbytes / f32.nbytes == pytest.approx((128 + 4 * 4) / (4 * 128))


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_cache_truncate_is_the_cache_that_never_saw_the_rest(rng, dtype):
    Hkv, D = 2, 64
    k = rng.standard_normal((Hkv, 150, D), dtype=np.float32)
    full = sa.KVCache(Hkv, D, capacity=16, dtype=dtype)
    full.append(k, k)
    full.add_importance(np.arange(150, dtype=np.float32))
    full.truncate(77)
    short = sa.KVCache(Hkv, D, capacity=16, dtype=dtype)
    short.append(np.ascontiguousarray(k[:, :77]), np.ascontiguousarray(k[:, :77]))
    short.add_importance(np.arange(77, dtype=np.float32))
    assert full.seq_len == 77
    np.testing.assert_array_equal(full.importance, short.importance)
    for name in ("mn", "mx", "scales"):
        np.testing.assert_array_equal(getattr(full.bounds, name), getattr(short.bounds, name))
    q = rng.standard_normal((4, D), dtype=np.float32)
    assert full.decode(q, k_blocks=2).tobytes() == short.decode(q, k_blocks=2).tobytes()
    with pytest.raises(ValueError, match="seq_len must be <= 77"):
        full.truncate(78)


def test_policy_presets_and_overrides(rng):
    k = rng.standard_normal((2, 400, 32), dtype=np.float32)
    q = rng.standard_normal((4, 32), dtype=np.float32)
    imp = rng.random(400, dtype=np.float32)
    seed = sa.select_blocks(q, k, k_blocks=4, importance=imp)
    assert (sa.select_blocks(q, k, k_blocks=4, importance=imp, policy="seed") == seed).all()
    explicit = sa.select_blocks(q, k, k_blocks=4, importance=imp, importance_fraction=0.5,
                                sink_blocks=0, share="head", scoring="probe")
    assert (explicit == seed).all()
    for name, knobs in sa.POLICIES.items():
        np.testing.assert_array_equal(
            sa.select_blocks(q, k, k_blocks=4, importance=imp, policy=name),
            sa.select_blocks(q, k, k_blocks=4, importance=imp, **knobs))
    with pytest.raises(ValueError, match="policy must be one of"):
        sa.sparse_decode(q, k, k, policy="best")


@pytest.mark.parametrize("dtype", ["q8", "float32"])
@pytest.mark.parametrize("copy_probe_rows", [False, True])
def test_a_cache_pickles_and_deepcopies_as_stored(dtype, copy_probe_rows):
    """pickle and copy.deepcopy of a prefilled cache: the copy decodes
    bitwise as the cache under every policy (K, V, importance, bounds,
    channel and probe copies as stored), keeps its capacity, and goes on
    appending as the cache does; the cache itself is unchanged."""
    import copy
    import pickle
    rng = np.random.default_rng(5)
    cache = sa.KVCache(2, 64, capacity=64, dtype=dtype, copy_probe_rows=copy_probe_rows)
    k = rng.standard_normal((2, 150, 64), dtype=np.float32)
    cache.append(k, -k)
    cache.prefill(rng.standard_normal((4, 150, 64), dtype=np.float32))
    q = rng.standard_normal((4, 64), dtype=np.float32)
    more = rng.standard_normal((2, 7, 64), dtype=np.float32)
    for twin in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert (twin.seq_len, twin.capacity) == (cache.seq_len, cache.capacity)
        assert np.array_equal(twin.importance, cache.importance)
        for policy in ("balanced", "seed", "fast", "recall"):
            assert np.array_equal(twin.decode(q, k_blocks=2, policy=policy),
                                  cache.decode(q, k_blocks=2, policy=policy)), policy
        twin.append(more, more)
        assert twin.seq_len == 157 and cache.seq_len == 150
    cache.append(more, more)
    assert np.array_equal(twin.decode(q, k_blocks=2), cache.decode(q, k_blocks=2))

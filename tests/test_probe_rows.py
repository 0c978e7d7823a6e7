"""Copies of the probe's rows (ProbeRows): the probe reads them instead of
every step-th row of K, with bitwise the same scores, selections and outputs,
and a KVCache keeps them current through appends, growth and rollbacks."""
import functools

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import ArgumentError, ArgumentTypeError, KernelError
from sparse_attn import _ffi
from sparse_attn._ffi import ffi, lib
from sparse_attn._operands import kv_operand
from sparse_attn.metadata import probe_geometry
from sparse_attn.selection import selection

# (block_size, n_probe, seq_len): the default tiling, samples that do not
# tile the block (32 / 5: step 6, 6 rows), every row, one row, odd sizes,
# a context shorter than one block and a partial last block.
GEOMETRIES = [(32, 8, 1000), (32, 5, 777), (16, 16, 300), (16, 1, 130), (7, 3, 100),
              (64, 8, 50), (32, 8, 31), (32, 8, 64)]


def _kv(rng, dtype, hkv, s, d, gs=32):
    k = rng.standard_normal((hkv, s, d), dtype=np.float32)
    v = rng.standard_normal((hkv, s, d), dtype=np.float32)
    if dtype == "q8":
        return sa.quantize_q8(k, gs), sa.quantize_q8(v, gs)
    return k, v


def seed_cache(*args, copy_probe_rows=True, **kwargs):
    """A KVCache made for the seed's probe: its copies on, no channel copy
    (the defaults serve policy="balanced")."""
    return sa.KVCache(*args, copy_probe_rows=copy_probe_rows, copy_channels=False, **kwargs)


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("bs,n_probe,seq", GEOMETRIES)
def test_decode_from_copies_is_bitwise_decode_from_k(isa, dtype, bs, n_probe, seq):
    rng = np.random.default_rng(seq + bs)
    k, v = _kv(rng, dtype, 2, seq, 64)
    q = rng.standard_normal((8, 64), dtype=np.float32)
    imp = rng.random(seq, dtype=np.float32)
    rows = sa.probe_rows(k, block_size=bs, n_probe=n_probe)
    assert rows.k_rows == seq and rows.block_size == bs and rows.n_probe == n_probe
    for kb in (1, 3, 8):
        for kw in (dict(), dict(importance=imp), dict(policy="recall", share="group"),
                   dict(sink_blocks=1, recency=False)):
            want = sa.sparse_decode(q, k, v, k_blocks=kb, block_size=bs, n_probe=n_probe,
                                    return_blocks=True, **kw)
            got = sa.sparse_decode(q, k, v, k_blocks=kb, block_size=bs, n_probe=n_probe,
                                   probe_rows=rows, return_blocks=True, **kw)
            assert np.array_equal(got[1], want[1]), (kb, kw)
            assert _same(got[0], want[0]), (kb, kw)
            sel = sa.select_blocks(q, k, k_blocks=kb, block_size=bs, n_probe=n_probe,
                                   probe_rows=rows, **kw)
            assert np.array_equal(sel, want[1])


def test_copies_hold_the_sampled_rows():
    rng = np.random.default_rng(0)
    k, _ = _kv(rng, "q8", 3, 200, 64)
    for bs, n_probe in ((32, 8), (32, 5), (10, 3)):
        rows = sa.probe_rows(k, block_size=bs, n_probe=n_probe)
        cnt, step = probe_geometry(bs, n_probe)
        assert cnt == -(-bs // max(1, bs // n_probe)) and step == max(1, bs // n_probe)
        for b in range(200 // bs):
            for j in range(cnt):
                src = b * bs + j * step
                assert np.array_equal(rows.rows.data[:, b * cnt + j], k.data[:, src])
                assert np.array_equal(rows.rows.scales[:, b * cnt + j], k.scales[:, src])


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_cache_keeps_its_copies_current(dtype):
    """Appends of odd sizes with growth, rollbacks, re-appends and a reset:
    after each, the cache's copies of full blocks equal fresh copies of its K,
    and decode through the cache (which reads them) equals decode probing K."""
    rng = np.random.default_rng(1)
    cache = seed_cache(2, 64, capacity=40, dtype=dtype)
    q = rng.standard_normal((4, 64), dtype=np.float32)

    def check():
        n = cache.seq_len
        ours, fresh = cache.probe_rows, sa.probe_rows(cache.k)
        assert ours.k_rows == n
        full = n // 32 * 8
        a = ours.rows if dtype == "float32" else ours.rows.data
        b = fresh.rows if dtype == "float32" else fresh.rows.data
        assert np.array_equal(a[:, :full], b[:, :full])
        if dtype == "q8":
            assert np.array_equal(ours.rows.scales[:, :full], fresh.rows.scales[:, :full])
        assert cache.metadata_for(k_blocks=2, policy="seed") == "probe_rows"
        got = cache.decode(q, k_blocks=2, return_blocks=True, policy="seed")
        want = sa.sparse_decode(q, cache.k, cache.v, k_blocks=2, return_blocks=True,
                                importance=cache.importance if cache.importance.any() else None)
        assert np.array_equal(got[1], want[1]) and _same(got[0], want[0])

    for t in (37, 5, 64, 1, 100, 33):
        x = rng.standard_normal((2, t, 64), dtype=np.float32)
        cache.append(x, x * 0.5)
        check()
    cache.truncate(100)
    check()
    x = rng.standard_normal((2, 70, 64), dtype=np.float32)
    cache.append(x, x)             # rows 100..170 differ from what the copies had
    check()
    cache.truncate(3)
    cache.append(x, x)
    check()
    cache.reset()
    y = np.ascontiguousarray(x[:, :40])
    cache.append(y, y)
    check()


def test_cache_uses_copies_only_when_they_fit_the_call():
    rng = np.random.default_rng(2)
    cache = seed_cache(2, 64, capacity=256, n_probe=4)
    x = rng.standard_normal((2, 200, 64), dtype=np.float32)
    cache.append(x, x)
    meta = functools.partial(cache.metadata_for, policy="seed")
    assert meta(n_probe=4) == "probe_rows"
    assert meta() is None                        # default n_probe 8: not what they hold
    assert meta(n_probe=4, block_size=16) is None
    assert meta(n_probe=4, seq_len=100) is None
    assert meta(policy="fast") == "bounds"
    assert meta(n_probe=4, scoring="minmax") == "bounds"
    assert meta(policy="fast", block_size=16) is None
    q = rng.standard_normal((4, 64), dtype=np.float32)
    for kw in (dict(), dict(n_probe=4), dict(n_probe=4, seq_len=150)):
        got = cache.decode(q, k_blocks=2, policy="seed", **kw)
        assert _same(got, sa.sparse_decode(q, cache.k, cache.v, k_blocks=2, **kw))


def test_cache_without_copies():
    rng = np.random.default_rng(3)
    cache = seed_cache(2, 64, capacity=16, copy_probe_rows=False)
    x = rng.standard_normal((2, 100, 64), dtype=np.float32)
    cache.append(x, x)
    assert cache.probe_rows is None and cache.metadata_for(policy="seed") is None
    assert sa.KVCache(2, 64).probe_rows is None          # not kept by default
    with_copies = seed_cache(2, 64, capacity=16)
    with_copies.append(x, x)
    assert with_copies.metadata_nbytes > cache.metadata_nbytes
    assert with_copies.nbytes == cache.nbytes
    q = rng.standard_normal((4, 64), dtype=np.float32)
    assert _same(cache.decode(q, k_blocks=2, policy="seed"),
                 with_copies.decode(q, k_blocks=2, policy="seed"))
    with pytest.raises(ArgumentTypeError, match="copy_probe_rows"):
        sa.KVCache(2, 64, copy_probe_rows="yes")
    with pytest.raises(ArgumentError, match="n_probe"):
        sa.KVCache(2, 64, n_probe=0)


def test_bad_probe_rows_are_refused_before_c():
    rng = np.random.default_rng(4)
    k, v = _kv(rng, "q8", 2, 200, 64)
    kf, vf = _kv(rng, "float32", 2, 200, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    rows = sa.probe_rows(k)
    dec = sa.sparse_decode
    with pytest.raises(ArgumentError, match="only read with scoring='probe'"):
        dec(q, k, v, probe_rows=rows, scoring="minmax")
    with pytest.raises(ArgumentError, match="only read with scoring='probe'"):
        dec(q, k, v, probe_rows=rows, policy="fast")
    with pytest.raises(ArgumentTypeError, match="must be a ProbeRows"):
        dec(q, k, v, probe_rows=k)
    with pytest.raises(ArgumentError, match="block_size 32, n_probe 8, not 16, 8"):
        dec(q, k, v, probe_rows=rows, block_size=16)
    with pytest.raises(ArgumentError, match="n_probe 8, not 32, 4"):
        sa.select_blocks(q, k, probe_rows=rows, n_probe=4)
    with pytest.raises(ArgumentError, match="hold q8 rows"):
        dec(q, kf, vf, probe_rows=rows)
    with pytest.raises(ArgumentError, match="hold q8 rows"):
        dec(q, sa.quantize_q8(kf, 16), sa.quantize_q8(vf, 16), probe_rows=rows)
    short = sa.probe_rows(k, seq_len=100)
    with pytest.raises(ArgumentError, match="cover 100 rows of K but seq_len is 200"):
        dec(q, k, v, probe_rows=short)
    assert dec(q, k, v, probe_rows=short, seq_len=100).shape == (4, 64)
    with pytest.raises(ArgumentError, match="fewer than the 48"):
        sa.ProbeRows(short.rows, 32, 8, 200)    # claims 200 rows, has room for 100
    with pytest.raises(ArgumentError, match="n_probe"):
        sa.probe_rows(k, n_probe=0)
    with pytest.raises(ArgumentError, match="seq_len"):
        sa.probe_rows(k, seq_len=201)


def test_c_refuses_copies_not_made_for_the_call():
    """Past the Python checks, the C core checks too (SA_ERR_PROBE_ROWS)."""
    rng = np.random.default_rng(5)
    k, _ = _kv(rng, "q8", 2, 200, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    rows = sa.probe_rows(k)
    kop = kv_operand("k", k)
    blocks = np.empty((4, 2), np.int32)
    for field, value in (("k_rows", 199), ("n_probe", 4), ("block_size", 16),
                         ("copy rows", 48 - 1)):
        st = ffi.new("sa_probe_rows *", rows.struct()[0])
        if field == "copy rows":
            st.rows.n_rows = value
        else:
            setattr(st, field, value)
        params = selection(k_blocks=2).params(probe_rows=st)
        rc = lib.sa_select_blocks(ffi.from_buffer("float[]", q), 4, kop.struct, 200, params,
                                  ffi.NULL, 0, ffi.from_buffer("int32_t[]", blocks), 1)
        assert rc == lib.SA_ERR_PROBE_ROWS, field
    with pytest.raises(KernelError, match="probe rows were not copied"):
        _ffi.check(lib.SA_ERR_PROBE_ROWS, "x")


# ------------------------------------------------------------------ n_probe="all"

def test_probe_of_every_row_and_the_recall_policy(isa):
    """n_probe="all" probes every row (n_probe = block_size, partial last
    block included): each block's score is its true max of q.k.  The recall
    preset is that probe without the importance reserve."""
    from sparse_attn import reference as ref
    rng = np.random.default_rng(6)
    for dtype in ("float32", "q8"):
        k, v = _kv(rng, dtype, 2, 300, 64)
        q = rng.standard_normal((4, 64), dtype=np.float32)
        imp = rng.random(300, dtype=np.float32)
        probe = sa.probe_scores(q, k, n_probe="all")
        assert _same(probe, sa.probe_scores(q, k, n_probe=32))
        kd = k.dequantize() if dtype == "q8" else k
        for h in range(4):   # the true block max (q8: quantised q, so compare loosely)
            dots = kd[h // 2] @ q[h]
            want = [dots[b * 32:(b + 1) * 32].max() for b in range(10)]
            np.testing.assert_allclose(probe[h], want, rtol=2e-2, atol=1e-3)
        got = sa.select_blocks(q, k, k_blocks=4, importance=imp, policy="recall")
        assert np.array_equal(got, sa.select_blocks(q, k, k_blocks=4, importance=imp,
                                                    importance_fraction=0, n_probe=32))
        assert np.array_equal(got, ref.select_blocks(q, k, k_blocks=4, importance=imp,
                                                     policy="recall"))
        # an explicit n_probe overrides the preset's
        assert np.array_equal(
            sa.select_blocks(q, k, k_blocks=4, policy="recall", n_probe=8),
            sa.select_blocks(q, k, k_blocks=4, importance_fraction=0, n_probe=8))
    assert sa.POLICIES["recall"]["n_probe"] == "all" and sa.POLICIES["seed"]["n_probe"] == 8


def test_n_probe_all_needs_no_copies_and_bad_values_are_refused():
    rng = np.random.default_rng(7)
    cache = seed_cache(2, 64, capacity=64, n_probe=32)
    assert cache.probe_rows is None
    assert cache.metadata_nbytes < seed_cache(2, 64, capacity=64).metadata_nbytes
    seeded = seed_cache(2, 64, capacity=64)
    x = rng.standard_normal((2, 100, 64), dtype=np.float32)
    seeded.append(x, x)
    assert seeded.metadata_for(policy="recall") is None
    assert seeded.metadata_for(policy="seed", n_probe="all") is None
    assert seeded.metadata_for(policy="recall", n_probe=8) == "probe_rows"
    q = rng.standard_normal((4, 64), dtype=np.float32)
    assert _same(seeded.decode(q, k_blocks=2, policy="recall"),
                 sa.sparse_decode(q, seeded.k, seeded.v, k_blocks=2, policy="recall"))
    for bad in ("every", "ALL", "8"):
        with pytest.raises(ArgumentError, match="n_probe must be an int >= 1 or 'all'"):
            sa.select_blocks(q, seeded.k, n_probe=bad)
    with pytest.raises(ArgumentTypeError, match="n_probe must be an int"):
        sa.sparse_decode(q, seeded.k, seeded.v, n_probe=2.5)
    with pytest.raises(ArgumentError, match="n_probe"):
        sa.probe_scores(q, seeded.k, n_probe=0)

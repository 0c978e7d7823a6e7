"""scoring="channels" (spec §6, the "balanced" policy): the channel-major
copy of K, the channel choice, the score, and the caches that keep the
copy, against the reference on every ISA."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import _ffi
from sparse_attn import reference as ref
from sparse_attn._ffi import ffi, lib
from sparse_attn._operands import kv_operand
from sparse_attn.selection import selection

from conftest import make_kv, rel_err, rtol_for


# head_dim 200 and 96 (q8 groups of 48) cross the copy's tiles of 64
# channels, block sizes 50 and 100 its tiles of 32 rows
@pytest.mark.parametrize("dtype,D,gs", [("float32", 64, None), ("q8", 128, 32),
                                        ("float32", 67, None), ("q8", 24, 8),
                                        ("float32", 200, None), ("q8", 96, 48)])
@pytest.mark.parametrize("block_size,seq_len", [(32, 300), (7, 100), (50, 49), (32, 32),
                                                (100, 250)])
def test_channel_copy_is_the_reference_copy(rng, dtype, D, gs, block_size, seq_len):
    k, _ = make_kv(rng, 3, seq_len + 9, D, dtype, gs or 32)
    copy = sa.channel_copy(k, block_size=block_size, seq_len=seq_len)
    got = copy.data, copy.scales
    assert copy.k_rows == seq_len and copy.block_size == block_size
    want = ref.channel_copy(k, block_size=block_size, seq_len=seq_len)
    # a copy of fewer rows than a block keeps only those rows (the
    # reference pads them with zeros, which the C core never writes)
    rows = got[0].shape[3]
    assert rows == min(block_size, seq_len)
    np.testing.assert_array_equal(got[0], want[0][..., :rows])
    assert not want[0][..., rows:].any()
    np.testing.assert_array_equal(got[1], want[1])
    keys = (k.dequantize() if isinstance(k, sa.Q8) else k)[:, :seq_len]
    nb = -(-seq_len // block_size)
    back = (want[0] * want[1][..., None]).transpose(0, 2, 3, 1).reshape(3, nb * block_size, D)
    # each value is one q8 step of its (block, channel) from the key
    step = np.repeat(want[1].transpose(0, 2, 1), block_size, axis=1)[:, :seq_len]
    assert (np.abs(back[:, :seq_len] - keys) <= 0.5001 * step + 1e-30).all()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("share", ["head", "group"])
@pytest.mark.parametrize("n_channels", [1, 8, 16, 1000])
def test_channel_selection_and_output_match_reference(isa, rng, dtype, share, n_channels):
    H, Hkv, D, S = 9, 3, 64, 650
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)
    for kw in (dict(k_blocks=5), dict(k_blocks=7, importance=imp, importance_fraction=0.3,
                                      sink_blocks=1), dict(k_blocks=3, block_size=13)):
        kw = dict(kw, policy="balanced", share=share, n_channels=n_channels)
        out, blocks = sa.sparse_decode(q, k, v, return_blocks=True, **kw)
        want, want_blocks = ref.sparse_decode(q, k, v, return_blocks=True, **kw)
        np.testing.assert_array_equal(blocks, want_blocks)
        assert rel_err(out, want) < rtol_for(k)
        sel = sa.select_blocks(q, k, **{a: b for a, b in kw.items()})
        np.testing.assert_array_equal(sel, blocks)
        # a copy made beforehand gives the same bytes as one made per call
        copy = sa.channel_copy(k, block_size=kw.get("block_size", 32))
        again = sa.sparse_decode(q, k, v, channels=copy, **kw)
        assert again.tobytes() == out.tobytes()


def test_the_chosen_channels_are_the_groups_largest(rng):
    q = np.zeros((2, 8), np.float32)
    q[0] = [0, 3, 1, 0, 2, 0, 0, 1]
    q[1] = [0, -3, 1, 5, 0, 0, 0, 1]         # group sums: 0 6 2 5 2 0 0 2
    np.testing.assert_array_equal(ref.top_channels(q, 3), [1, 2, 3])   # 2 ties: lower
    np.testing.assert_array_equal(ref.top_channels(q, 100), np.arange(8))
    # the C core picks the same: a key that lights up only channel 4 loses to
    # one on channel 2 (tied with 4 and 7, the lower wins) with one channel
    k = np.zeros((1, 64, 8), np.float32)
    k[0, 5, 4] = 9.0
    k[0, 40, 2] = 1.0
    got = sa.select_blocks(q, k, k_blocks=1, policy="balanced", n_channels=3, recency=False,
                           share="head")
    assert got.tolist() == [[1], [1]]
    got = sa.select_blocks(q, k, k_blocks=1, policy="balanced", n_channels=5, recency=False,
                           share="head")
    assert got.tolist() == [[0], [1]]         # channel 4 now scored: head 0 sees 2*9
    # balanced's own share: one choice for the group, from the summed scores
    # (block 0: 18 + 0, block 1: 1 + 1)
    got = sa.select_blocks(q, k, k_blocks=1, policy="balanced", n_channels=5, recency=False)
    assert got.tolist() == [[0], [0]]
    assert sa.POLICIES["balanced"]["share"] == "group"


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_every_block_is_dense_and_threads_do_not_change_bits(isa, rng, dtype):
    H, Hkv, D, S = 8, 2, 64, 500
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    full = sa.sparse_decode(q, k, v, k_blocks=1000, policy="balanced")
    assert full.tobytes() == sa.dense_decode(q, k, v).tobytes()
    outs = {sa.sparse_decode(q, k, v, k_blocks=4, policy="balanced", threads=t).tobytes()
            for t in (1, 2, 3, 5)}
    assert len(outs) == 1


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_cache_keeps_its_channel_copy_up_to_date(isa, rng, dtype):
    Hkv, D, H = 2, 64, 6
    cache = sa.KVCache(Hkv, D, capacity=10, dtype=dtype, copy_channels=True)
    plain = sa.KVCache(Hkv, D, capacity=10, dtype=dtype, copy_channels=False)
    q = rng.standard_normal((H, D), dtype=np.float32)
    decode = cache.decoder(k_blocks=3, policy="balanced")
    for T in (1, 40, 3, 1, 1, 90, 7, 33):
        kv = rng.standard_normal((Hkv, T, D), dtype=np.float32)
        cache.append(kv, kv)
        plain.append(kv, kv)
        assert cache.metadata_for(k_blocks=3, policy="balanced") == "channels"
        fresh = sa.channel_copy(cache.k)
        np.testing.assert_array_equal(cache.channels.scales, fresh.scales)
        valid = [min(32, cache.seq_len - 32 * b) for b in range(fresh.data.shape[2])]
        for b, rows in enumerate(valid):
            np.testing.assert_array_equal(cache.channels.data[:, :, b, :rows],
                                          fresh.data[:, :, b, :rows])
        got = cache.decode(q, k_blocks=3, policy="balanced")
        want = sa.sparse_decode(q, cache.k, cache.v, k_blocks=3, policy="balanced")
        assert got.tobytes() == want.tobytes()
        assert decode(q).tobytes() == got.tobytes()
        # a cache without the copy makes it per call: the same bits
        assert plain.metadata_for(k_blocks=3, policy="balanced") is None
        assert plain.decode(q, k_blocks=3, policy="balanced").tobytes() == got.tobytes()
    n = cache.seq_len
    cache.truncate(n - 20)          # a now partial last block is recomputed
    kv = rng.standard_normal((Hkv, 5, D), dtype=np.float32)
    cache.append(kv, kv)
    want = sa.sparse_decode(q, cache.k, cache.v, k_blocks=3, policy="balanced")
    assert cache.decode(q, k_blocks=3, policy="balanced").tobytes() == want.tobytes()
    assert decode(q).tobytes() == want.tobytes()
    # the copy is counted: D * (block_size + 4) bytes per block and KV head
    nb = -(-cache.capacity // 32)
    assert cache.metadata_nbytes - plain.metadata_nbytes >= Hkv * nb * D * 36
    cache.reset()
    cache.append(kv, kv)
    want = sa.sparse_decode(q, cache.k, cache.v, k_blocks=1, policy="balanced")
    assert cache.decode(q, k_blocks=1, policy="balanced").tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_sparse_prefill_with_channel_scoring(isa, rng, dtype):
    H, Hkv, D, S = 4, 2, 32, 230
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, 100, D), dtype=np.float32)
    kw = dict(k_blocks=3, block_size=16, policy="balanced", n_channels=8)
    out, imp = sa.prefill(q, k, v, start=130, **kw)
    want, want_imp = ref.prefill(q, k, v, start=130, **kw)
    assert rel_err(out, want) < rtol_for(k)
    np.testing.assert_allclose(imp, want_imp, rtol=1e-4, atol=1e-5)
    exact, _ = sa.prefill(q, k, v, start=130)
    full, _ = sa.prefill(q, k, v, start=130, k_blocks=1000, block_size=16, policy="balanced")
    assert full.tobytes() == exact.tobytes()
    # through a cache that keeps the copy: the same bits
    cache = sa.KVCache(Hkv, D, capacity=S, dtype=dtype, block_size=16, copy_channels=True)
    keys = k.dequantize() if isinstance(k, sa.Q8) else k
    vals = v.dequantize() if isinstance(v, sa.Q8) else v
    cache.append(keys[:, :S], vals[:, :S])
    if dtype == "float32":
        got = cache.prefill(q, **kw)
        ref_out, _ = sa.prefill(q, cache.k, cache.v, start=130, **kw)
        assert got.tobytes() == ref_out.tobytes()


def test_channel_scoring_finds_the_needle_at_32k_reading_a_quarter():
    """At 32K tokens a 16-of-64-channel score reads a quarter of a q8 K
    block's bytes and still ranks the needle's block in the top 32."""
    from sparse_attn.synthetic import needle_context
    ctx = needle_context(32768, n_heads=4, n_kv_heads=2, head_dim=64, seed=3,
                         prompt_tokens=32)
    cache = sa.KVCache(2, 64, capacity=32768, dtype="q8", copy_channels=True)
    cache.append(ctx.k, ctx.v)
    blocks = cache.decode(ctx.question_q, k_blocks=32, policy="balanced",
                          return_blocks=True)[1]
    assert (blocks == ctx.needle_block).any(axis=1).all()
    read = 16 * (32 + 4)                      # 16 channels: 32 int8 and a scale each
    block_bytes = 32 * (64 + 2 * 4)           # a q8 K block: 32 rows, 2 scales each
    assert read <= 0.25 * block_bytes


def test_bad_channel_arguments_are_refused(rng):
    k, v = make_kv(rng, 2, 100, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    with pytest.raises(ValueError, match="n_channels must be"):
        sa.sparse_decode(q, k, v, policy="balanced", n_channels=0)
    with pytest.raises(TypeError, match="n_channels"):
        sa.sparse_decode(q, k, v, policy="balanced", n_channels=2.5)
    with pytest.raises(ValueError, match="only read with scoring='minmax'"):
        sa.sparse_decode(q, k, v, policy="balanced", bounds=sa.block_bounds(k))
    with pytest.raises(ValueError, match="only read with scoring='probe'"):
        sa.sparse_decode(q, k, v, policy="balanced", probe_rows=sa.probe_rows(k))
    with pytest.raises(TypeError, match="copy_channels must be a bool"):
        sa.KVCache(2, 64, copy_channels="yes")
    # a block far larger than the context: the copy keeps the rows there are
    huge = sa.sparse_decode(q, k, v, policy="balanced", block_size=2**30, k_blocks=1)
    assert huge.tobytes() == sa.dense_decode(q, k, v).tobytes()
    sel = sa.select_blocks(q, k, policy="balanced", block_size=2**30 - 1, k_blocks=1,
                           seq_len=100)
    assert sel.tolist() == [[0]] * 4


def test_a_copy_that_does_not_fit_is_refused(rng):
    k, v = make_kv(rng, 2, 100, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    copy = sa.channel_copy(k, seq_len=90)
    with pytest.raises(ValueError, match="covers 90 rows but seq_len is 100"):
        sa.sparse_decode(q, k, v, policy="balanced", channels=copy)
    with pytest.raises(ValueError, match="block_size 32, not 16"):
        sa.select_blocks(q, k, seq_len=90, block_size=16, policy="balanced", channels=copy)
    with pytest.raises(ValueError, match="only read with scoring='channels'"):
        sa.sparse_decode(q, k, v, channels=copy, seq_len=90)
    with pytest.raises(TypeError, match="channels must be a ChannelCopy"):
        sa.sparse_decode(q, k, v, policy="balanced", channels=np.zeros(3))
    k2, _ = make_kv(rng, 1, 100, 64)
    with pytest.raises(ValueError, match="channel copy is for"):
        sa.sparse_decode(q, k2, k2, policy="balanced", channels=sa.channel_copy(k))
    with pytest.raises(AttributeError, match="immutable"):
        copy.scales = copy.scales[:, :1]
    with pytest.raises(ValueError, match="read-only"):
        copy.data[0, 0, 0, 0] = 1
    # hand-built copies are checked before they reach C
    d, sc = copy.data.copy(), copy.scales.copy()
    with pytest.raises(ValueError, match="fewer than the 4 of k_rows 100"):
        sa.ChannelCopy(d[:, :, :3].copy(), sc[:, :, :3].copy(), 32, 100)
    with pytest.raises(ValueError, match="keeps 8 rows per block"):
        sa.ChannelCopy(d[..., :8].copy(), sc, 32, 90)
    with pytest.raises(ValueError, match="channels.scales must have shape"):
        sa.ChannelCopy(d, sc[:, :5].copy(), 32, 90)
    sc[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        sa.ChannelCopy(d, sc, 32, 90)
    good = sa.ChannelCopy(copy.data.copy(), copy.scales.copy(), 32, 90)
    assert sa.sparse_decode(q, k, v, seq_len=90, policy="balanced", channels=good,
                            k_blocks=2).tobytes() == \
        sa.sparse_decode(q, k, v, seq_len=90, policy="balanced", k_blocks=2).tobytes()


def test_the_core_refuses_a_missing_or_stale_copy(rng):
    k, v = make_kv(rng, 2, 100, 64)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    kop, vop = kv_operand("k", k), kv_operand("v", v)
    sel = selection("balanced", k_blocks=2)
    out = np.empty((4, 64), np.float32)

    def call(params, seq_len=100):
        return lib.sa_sparse_decode(_ffi.ptr(q, "float"), 4, kop.struct, vop.struct, seq_len,
                                    params, ffi.NULL, 0, 0.125, _ffi.out_ptr(out, "float"),
                                    ffi.NULL, 1)

    assert call(sel.params()) == lib.SA_ERR_CHANNELS                 # no copy
    c90 = sa.channel_copy(k, seq_len=90)
    st = c90.struct()
    assert call(sel.params(st)) == lib.SA_ERR_CHANNELS               # made for 90 rows
    assert call(sel.params(st), seq_len=90) == lib.SA_OK
    c100 = sa.channel_copy(k)
    st32 = c100.struct()
    assert call(selection("balanced", k_blocks=2, block_size=16).params(st32)) == \
        lib.SA_ERR_CHANNELS                                            # other block size
    p = sel.params(st32)
    p.n_channels = 0
    assert call(p) == lib.SA_ERR_PARAM
    # an append that would leave the copy behind is refused before writing
    cache_k = sa.KVCache(2, 64, capacity=64, copy_channels=True, copy_probe_rows=True)
    buf = cache_k._buf
    buf.channels_st.k_rows = 5
    x = np.zeros((2, 1, 64), np.float32)
    rc = lib.sa_kv_append(buf.kop.struct, buf.vop.struct, 0, _ffi.ptr(x, "float"),
                          _ffi.ptr(x, "float"), 1, buf.bounds_st, buf.probe_st,
                          buf.channels_st)
    assert rc == lib.SA_ERR_CHANNELS
    assert "channel copy" in ffi.string(lib.sa_strerror(rc)).decode()


def test_a_nan_in_k_given_directly_is_left_out_of_its_scale(rng):
    """K given directly is not scanned; a NaN in it is ignored by its
    block's channel maximum and quantises to -127 (as sa_quantize_row),
    the rest of the copy unchanged."""
    k = rng.standard_normal((2, 100, 96), dtype=np.float32)
    clean = k.copy()
    k[1, 37, 70] = np.nan
    clean[1, 37, 70] = 0.0
    got, want = sa.channel_copy(k), sa.channel_copy(clean)
    np.testing.assert_array_equal(got.scales, want.scales)
    expect = want.data.copy()
    expect[1, 70, 1, 5] = -127
    np.testing.assert_array_equal(got.data, expect)

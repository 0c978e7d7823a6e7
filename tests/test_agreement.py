"""The C core against the numpy reference, on every kernel path (spec §5)."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from conftest import gemm_form, make_kv, pow2_scales, rel_err, rtol_for

# (n_heads, n_kv_heads, head_dim, seq, dtype, group_size): GQA 1/2/3/4/7/8,
# head_dim 64/128/256 and odd sizes, partial last blocks.
SHAPES = [
    (4, 4, 64, 200, "float32", 32),
    (8, 4, 128, 333, "float32", 32),
    (8, 2, 64, 257, "q8", 32),
    (16, 2, 128, 300, "q8", 32),
    (8, 1, 256, 129, "q8", 64),
    (4, 2, 67, 150, "float32", 1),
    (6, 3, 24, 101, "q8", 8),
    (2, 2, 9, 77, "q8", 3),
    (9, 3, 64, 190, "q8", 16),
    (14, 2, 64, 230, "q8", 32),     # Qwen2.5-0.5B's GQA 7: a block of 4, one of 3
]


@pytest.mark.parametrize("H,Hkv,D,S,dtype,gs", SHAPES)
@pytest.mark.parametrize("block_size,k_blocks", [(32, 3), (7, 5), (32, 100), (13, 1)])
def test_sparse_decode_matches_reference(isa, rng, H, Hkv, D, S, dtype, gs, block_size,
                                         k_blocks):
    k, v = make_kv(rng, Hkv, S, D, dtype, gs)
    q = rng.standard_normal((H, D), dtype=np.float32)
    seq_len = S - 5
    out, blocks = sa.sparse_decode(q, k, v, seq_len=seq_len, k_blocks=k_blocks,
                                   block_size=block_size, return_blocks=True)
    want, want_blocks = ref.sparse_decode(q, k, v, seq_len=seq_len, k_blocks=k_blocks,
                                          block_size=block_size, return_blocks=True)
    np.testing.assert_array_equal(blocks, want_blocks)
    assert rel_err(out, want) < rtol_for(k)


@pytest.mark.parametrize("H,Hkv,D,S,dtype,gs", SHAPES)
def test_dense_decode_matches_reference(isa, rng, H, Hkv, D, S, dtype, gs):
    k, v = make_kv(rng, Hkv, S, D, dtype, gs)
    q = rng.standard_normal((H, D), dtype=np.float32)
    out = sa.dense_decode(q, k, v, scale=0.3)
    assert rel_err(out, ref.dense_decode(q, k, v, scale=0.3)) < rtol_for(k)


@pytest.mark.parametrize("H,Hkv,D,S,dtype,gs", SHAPES)
@pytest.mark.parametrize("block_size", [32, 7, 1000])
def test_all_blocks_is_bitwise_dense(isa, rng, H, Hkv, D, S, dtype, gs, block_size):
    """spec §2: with k_blocks >= n_blocks sparse decode == dense decode, bit for bit."""
    k, v = make_kv(rng, Hkv, S, D, dtype, gs)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)
    nb = -(-S // block_size)
    sparse = sa.sparse_decode(q, k, v, k_blocks=nb, block_size=block_size, importance=imp)
    assert sparse.tobytes() == sa.dense_decode(q, k, v).tobytes()


@pytest.mark.parametrize("H,Hkv,D,S,dtype,gs", SHAPES)
@pytest.mark.parametrize("n_probe", [1, 3, 8, 64])
def test_probe_scores_match_reference(isa, rng, H, Hkv, D, S, dtype, gs, n_probe):
    k, _ = make_kv(rng, Hkv, S, D, dtype, gs)
    q = rng.standard_normal((H, D), dtype=np.float32)
    got = sa.probe_scores(q, k, seq_len=S - 3, block_size=10, n_probe=n_probe)
    want = ref.probe_scores(q, k, seq_len=S - 3, block_size=10, n_probe=n_probe)
    assert got.shape == want.shape == (H, -(-(S - 3) // 10))
    assert rel_err(got, want) < rtol_for(k)


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 40), (37, 23), (120, 8)])
def test_prefill_matches_reference(isa, rng, dtype, start, T):
    H, Hkv, D = 8, 2, 64
    k, v = make_kv(rng, Hkv, start + T + 10, D, dtype)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v, start=start)
    want, want_imp = ref.prefill(q, k, v, start=start)
    assert out.shape == (H, T, D) and imp.shape == (start + T,)
    assert rel_err(out, want) < rtol_for(k)
    assert rel_err(imp, want_imp) < rtol_for(k)
    # Every query row's weights sum to 1, so importance sums to H * T.
    assert abs(float(imp.sum()) - H * T) < 1e-3 * H * T


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("D,T", [(64, 6), (64, 20), (128, 20), (64, 128), (128, 130)])
def test_prefill_row_is_dense_decode(isa, rng, dtype, D, T):
    """A prefill row is dense decode over the keys it sees (spec §3): on q8
    the same scores and weights bit for bit (with 40 query vectors per tile,
    the q8 scores of prefill take the AVX-512 path that prepares each K
    block once for many heads; from 256 per KV head, the panels) and V's
    products in another order (spec §4), so the same bits where V's scales
    are powers of two and within rounding otherwise; on float32 K bit for
    bit below 256 query vectors per KV head; from there float32 scores run
    in GEMM form (one multiply-add chain over the channels, not decode's
    lanes): within §5's tolerance."""
    H, Hkv, start = 4, 2, 50
    k, v = make_kv(rng, Hkv, start + T, D, dtype)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, _ = sa.prefill(q, k, v, start=start)
    gemm = dtype == "float32" and gemm_form(T, start, H, Hkv)
    v2 = pow2_scales(v) if dtype == "q8" else v
    out2 = sa.prefill(q, k, v2, start=start)[0] if dtype == "q8" else out
    for t in range(0, T, max(1, T // 7)):
        q_t = np.ascontiguousarray(q[:, t])
        row = sa.dense_decode(q_t, k, v, seq_len=start + t + 1)
        want = np.ascontiguousarray(out[:, t])
        if gemm:
            assert 0 < rel_err(row, want) < 1e-5
        elif dtype == "q8":
            assert rel_err(row, want) < 1e-6
            row2 = sa.dense_decode(q_t, k, v2, seq_len=start + t + 1)
            assert row2.tobytes() == np.ascontiguousarray(out2[:, t]).tobytes()
        else:
            assert row.tobytes() == want.tobytes()


@pytest.mark.parametrize("D,gs", [(24, 1), (24, 2), (24, 4), (24, 12), (40, 8), (96, 32)])
def test_prefill_q8_groups_and_panels(isa, rng, D, gs):
    """q8 prefill for group sizes the GEMM-form scores take (multiples of 4,
    K packed in panels) and those they do not (read in place): the reference
    within tolerance, each row dense decode (bit for bit with V's scales
    powers of two, spec §4), the same bits on 1 and 3 threads."""
    H, Hkv, start, T = 6, 2, 45, 37
    k, v = make_kv(rng, Hkv, start + T + 9, D, "q8", gs)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v, start=start, threads=3)
    want, want_imp = ref.prefill(q, k, v, start=start)
    assert rel_err(out, want) < rtol_for(k)
    assert rel_err(imp, want_imp) < rtol_for(k)
    one, one_imp = sa.prefill(q, k, v, start=start, threads=1)
    assert one.tobytes() == out.tobytes() and one_imp.tobytes() == imp.tobytes()
    v2 = pow2_scales(v)
    out2, _ = sa.prefill(q, k, v2, start=start, threads=3)
    for t in (0, 17, T - 1):
        q_t = np.ascontiguousarray(q[:, t])
        row = sa.dense_decode(q_t, k, v, seq_len=start + t + 1)
        assert rel_err(row, out[:, t]) < 1e-6
        row2 = sa.dense_decode(q_t, k, v2, seq_len=start + t + 1)
        assert row2.tobytes() == np.ascontiguousarray(out2[:, t]).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("T", [1, 5, 40, 127, 128, 175, 300])
def test_a_short_call_gives_the_rows_of_a_long_one(isa, rng, dtype, T):
    """A call with few query vectors per KV head reads K in place, a long
    call packs a worker's copy of each head in panels (csrc/panels.c): q8
    rows have the same bits either way, so prefilling the last T rows alone
    gives one-shot prefill's last rows; float32 rows do when both calls take
    the GEMM form and agree within tolerance otherwise (spec §3)."""
    H, Hkv, D, S = 4, 2, 64, 700
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, S, D), dtype=np.float32)
    whole, _ = sa.prefill(q, k, v)
    tail, _ = sa.prefill(np.ascontiguousarray(q[:, S - T:]), k, v, start=S - T)
    want = np.ascontiguousarray(whole[:, S - T:])
    if dtype == "float32" and not gemm_form(T, S - T, H, Hkv):
        assert 0 < rel_err(tail, want) < 1e-5
    else:
        assert tail.tobytes() == want.tobytes()


def test_prefill_reads_no_key_past_the_call(isa, rng):
    """Float32 K passed directly is not scanned (spec §5): NaN rows past
    start + T (capacity) must not reach the output, although the GEMM-form
    scores pack keys panel by panel; a NaN inside reaches the rows that
    read it and only those."""
    H, Hkv, D, start, T = 4, 2, 32, 30, 41
    k, v = make_kv(rng, Hkv, start + T + 20, D)
    k[:, start + T:] = np.nan
    v[:, start + T:] = np.nan
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v, start=start)
    assert np.isfinite(out).all() and np.isfinite(imp).all()
    k[:, start + 10] = np.nan
    out, _ = sa.prefill(q, k, v, start=start)
    assert np.isfinite(out[:, :10]).all() and np.isnan(out[:, 10:]).all()


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_prefill_with_capped_tiles(isa, rng, dtype):
    """64 query heads on one KV head at 2100 tokens: a tile's score rows
    would pass prefill.c's cap (2 MiB per worker) at 32, 16 and 8 rows, so
    its tiles are 4 rows; still the reference's output and importance, and
    dense decode per row (within tolerance: these rows have more keys than
    decode's one chunk, spec §2.6)."""
    H, Hkv, D, start, T = 64, 1, 16, 2088, 12
    k, v = make_kv(rng, Hkv, start + T, D, dtype, 16)
    q = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(q, k, v, start=start)
    want, want_imp = ref.prefill(q, k, v, start=start)
    assert rel_err(out, want) < rtol_for(k)
    assert rel_err(imp, want_imp) < rtol_for(k)
    for t in range(T):
        row = sa.dense_decode(np.ascontiguousarray(q[:, t]), k, v, seq_len=start + t + 1)
        assert rel_err(row, out[:, t]) < rtol_for(k)


def test_chunked_prefill_adds_up(isa, rng):
    """Prefill in chunks: outputs equal one-shot prefill, importance adds up."""
    H, Hkv, D, S = 4, 2, 64, 90
    k, v = make_kv(rng, Hkv, S, D)
    q = rng.standard_normal((H, S, D), dtype=np.float32)
    whole_out, whole_imp = sa.prefill(q, k, v)
    imp = np.zeros(S, np.float32)
    for a, b in [(0, 30), (30, 31), (31, 90)]:
        out, part = sa.prefill(np.ascontiguousarray(q[:, a:b]), k, v, start=a)
        np.testing.assert_array_equal(out, whole_out[:, a:b])
        imp[:b] += part
    assert rel_err(imp, whole_imp) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("share", ["head", "group"])
@pytest.mark.parametrize("frac,sinks", [(0.5, 0), (0.0, 0), (0.25, 2), (1.0, 1), (0.5, 10)])
def test_selection_knobs_match_reference(isa, rng, dtype, share, frac, sinks):
    """spec §6 knobs: importance_fraction, sink_blocks and share."""
    H, Hkv, D, S = 8, 2, 64, 700
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)
    kw = dict(k_blocks=6, importance=imp, importance_fraction=frac, sink_blocks=sinks,
              share=share)
    out, blocks = sa.sparse_decode(q, k, v, return_blocks=True, **kw)
    want, want_blocks = ref.sparse_decode(q, k, v, return_blocks=True, **kw)
    np.testing.assert_array_equal(blocks, want_blocks)
    np.testing.assert_array_equal(sa.select_blocks(q, k, **kw), want_blocks)
    assert rel_err(out, want) < rtol_for(k)
    if share == "group":
        per_group = blocks.reshape(Hkv, H // Hkv, -1)
        assert (per_group == per_group[:, :1]).all()


def test_kernels_alone_match_reference(isa, rng):
    D, N = 128, 77
    q = sa.quantize_q8(rng.standard_normal(D, dtype=np.float32))
    rows = sa.quantize_q8(rng.standard_normal((N, D), dtype=np.float32))
    assert rel_err(sa.q8_dot(q, rows), ref.q8_dot(q, rows)) < 1e-5
    p = rng.random(N, dtype=np.float32)
    vf = rng.standard_normal((N, D), dtype=np.float32)
    assert rel_err(sa.accumulate_v(p, vf), ref.accumulate_v(p, vf)) < 1e-5
    assert rel_err(sa.accumulate_v(p, rows), ref.accumulate_v(p, rows)) < 1e-5
    acc = np.ones(D, np.float32)
    assert sa.accumulate_v(p, vf, out=acc) is acc
    assert rel_err(acc, ref.accumulate_v(p, vf) + 1) < 1e-5

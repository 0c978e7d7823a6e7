"""Split-KV decode (spec §2.6): a group attending to more than
SA_DECODE_CHUNK_ROWS rows is attended in chunks merged in a fixed order.
The bits depend on the rows attended, never on the thread count; sparse
decode with every block chosen stays dense decode bit for bit; a group of
one chunk computes what the one-pass formula does."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import _core
from sparse_attn import reference as ref

from conftest import make_kv, pow2_scales, rel_err, rtol_for

CHUNK = _core.lib.SA_DECODE_CHUNK_ROWS
THREADS = (1, 2, 3, 7, 64)


def chunk_cut(rows):
    """The chunks of spec §2.6 for a group attending to `rows` rows."""
    c = -(-rows // CHUNK)
    length = 32 * -(-(-(-rows // c)) // 32)
    return [(a, min(a + length, rows)) for a in range(0, rows, length)]


def test_the_cut_of_the_spec():
    assert CHUNK == 2048
    assert chunk_cut(2048) == [(0, 2048)]
    assert chunk_cut(2049) == [(0, 1056), (1056, 2049)]
    assert chunk_cut(5000) == [(0, 1696), (1696, 3392), (3392, 5000)]
    for rows in (2049, 4097, 32768, 100_003):
        cut = chunk_cut(rows)
        assert all(b - a <= CHUNK for a, b in cut) and cut[-1][1] == rows


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("S", [2048, 2049, 5000])
def test_thread_counts_give_the_same_bits(isa, rng, dtype, S):
    H, Hkv, D = 6, 1, 64
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)

    def run(t):
        dense = sa.dense_decode(q, k, v, threads=t)
        seed = sa.sparse_decode(q, k, v, k_blocks=24, importance=imp, threads=t)
        group = sa.sparse_decode(q, k, v, k_blocks=48, share="group", threads=t)
        return [a.tobytes() for a in (dense, seed, group)]

    first = run(1)
    for t in THREADS[1:]:
        assert run(t) == first, t


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("S", [2049, 5000])
def test_every_block_chosen_is_dense_decode(isa, rng, dtype, S):
    H, Hkv, D = 8, 2, 32
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    dense = sa.dense_decode(q, k, v, threads=2)
    for policy in ("seed", "balanced", "fast", "recall"):
        out = sa.sparse_decode(q, k, v, k_blocks=10_000, policy=policy, threads=3)
        assert out.tobytes() == dense.tobytes(), policy


@pytest.mark.parametrize("dtype", ["float32", "q8"])
@pytest.mark.parametrize("S", [700, 2048, 2049, 9000])
def test_chunked_outputs_agree_with_the_reference(isa, rng, dtype, S):
    """Outputs of many chunks, and heads with rows in only some chunks
    (share="head" with a union beyond one chunk), within §5's tolerance."""
    H, Hkv, D = 4, 1, 32
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    assert rel_err(sa.dense_decode(q, k, v), ref.dense_decode(q, k, v)) < rtol_for(k)
    imp = rng.random(S, dtype=np.float32)
    out, blocks = sa.sparse_decode(q, k, v, k_blocks=20, importance=imp, return_blocks=True)
    want, want_blocks = ref.sparse_decode(q, k, v, k_blocks=20, importance=imp,
                                          return_blocks=True)
    assert np.array_equal(blocks, want_blocks)
    assert rel_err(out, want) < rtol_for(k)


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_one_chunk_is_the_one_pass_formula(rng, dtype):
    """At most CHUNK rows: the bits of a q8 prefill row (one pass over its
    keys; V's scales powers of two, so decode's and prefill's orders of V's
    products agree, spec §4); beyond, and on float32 K (GEMM-form scores),
    prefill and decode agree within tolerance only (spec §3)."""
    H, Hkv, D = 4, 2, 64
    k, v = make_kv(rng, Hkv, CHUNK + 40, D, dtype)
    if dtype == "q8":
        v = pow2_scales(v)
    q = rng.standard_normal((H, 40, D), dtype=np.float32)
    out, _ = sa.prefill(q, k, v, start=CHUNK - 20)
    for t in range(40):
        n = CHUNK - 20 + t + 1
        row = sa.dense_decode(np.ascontiguousarray(q[:, t]), k, v, seq_len=n)
        if n <= CHUNK and dtype == "q8":
            assert row.tobytes() == np.ascontiguousarray(out[:, t]).tobytes(), n
        else:
            assert rel_err(row, out[:, t]) < (1e-4 if dtype == "q8" else 1e-5), n


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_nan_in_one_chunk_reaches_the_whole_head(isa, rng, where):
    """spec §5: a NaN in K makes every output of the heads reading it NaN,
    whichever chunk holds it; a NaN in V the channel it enters."""
    H, Hkv, D, S = 4, 1, 32, 3 * CHUNK
    k, v = make_kv(rng, Hkv, S, D)
    q = rng.standard_normal((H, D), dtype=np.float32)
    row = {"first": 5, "middle": S // 2, "last": S - 1}[where]
    kn = k.copy()
    kn[0, row, 3] = np.nan
    assert np.isnan(sa.dense_decode(q, kn, v)).all()
    vn = v.copy()
    vn[0, row, 7] = np.nan
    out = sa.dense_decode(q, k, vn)
    assert np.isnan(out[:, 7]).all()
    assert not np.isnan(np.delete(out, 7, axis=1)).any()


def test_a_chunk_of_minus_infinity_scores_adds_nothing(rng):
    """A chunk whose keys all score -Inf weighs 0, as in one pass (where
    exp(-Inf - max) = 0); only when every score is -Inf is the output NaN."""
    H, Hkv, D, S = 1, 1, 4, 2 * CHUNK
    k = np.ones((Hkv, S, D), np.float32)
    v = rng.standard_normal((Hkv, S, D)).astype(np.float32)
    q = np.ones((H, D), np.float32)
    k[0, :CHUNK] = -np.inf
    out = sa.dense_decode(q, k, v)
    want = v[0, CHUNK:].mean(axis=0)
    assert rel_err(out[0], want) < 1e-5
    k[0, :] = -np.inf
    assert np.isnan(sa.dense_decode(q, k, v)).all()


def test_cache_decode_is_chunked_like_the_arrays(rng):
    H, Hkv, D, S = 8, 2, 64, 5000
    cache = sa.KVCache(Hkv, D, capacity=S, dtype="q8")
    kf = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    vf = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    cache.append(kf, vf)
    q = rng.standard_normal((H, D), dtype=np.float32)
    kq, vq = sa.quantize_q8(kf), sa.quantize_q8(vf)
    got = [cache.dense_decode(q, threads=t).tobytes() for t in THREADS]
    assert len(set(got)) == 1
    assert got[0] == sa.dense_decode(q, kq, vq).tobytes()

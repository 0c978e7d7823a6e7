"""spec §5, the red line: same inputs, same build, same machine -> identical
bytes, whatever the thread count and whatever ran before."""
import numpy as np
import pytest

import sparse_attn as sa

from conftest import make_kv


@pytest.mark.parametrize("dtype", ["float32", "q8"])
def test_thread_count_and_repeats_do_not_change_bytes(isa, rng, dtype):
    H, Hkv, D, S = 16, 8, 128, 1000
    k, v = make_kv(rng, Hkv, S, D, dtype)
    q = rng.standard_normal((H, D), dtype=np.float32)
    qp = rng.standard_normal((H, 12, D), dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)

    def run(threads):
        out, blocks = sa.sparse_decode(q, k, v, k_blocks=8, importance=imp, threads=threads,
                                       return_blocks=True)
        dense = sa.dense_decode(q, k, v, threads=threads)
        pre, pimp = sa.prefill(qp, k, v, start=S - 12, threads=threads)
        probe = sa.probe_scores(q, k, threads=threads)
        grp = sa.select_blocks(q, k, k_blocks=8, share="group", threads=threads)
        return [a.tobytes() for a in (out, blocks, dense, pre, pimp, probe, grp)]

    first = run(1)
    for threads in (2, 3, 8, 1):
        assert run(threads) == first


def test_env_thread_default(monkeypatch, rng):
    k, v = make_kv(rng, 2, 64, 32)
    q = rng.standard_normal((4, 32), dtype=np.float32)
    base = sa.dense_decode(q, k, v, threads=1)
    monkeypatch.setenv("SPARSE_ATTN_NUM_THREADS", "3")
    assert sa.dense_decode(q, k, v).tobytes() == base.tobytes()
    monkeypatch.setenv("SPARSE_ATTN_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="SPARSE_ATTN_NUM_THREADS"):
        sa.dense_decode(q, k, v)


def test_concurrent_python_threads_get_the_same_bytes(rng):
    """cffi releases the GIL: calls from several Python threads run at once
    (one owns the worker pool, the others run on their own thread) and must
    still give the single-threaded bytes."""
    from concurrent.futures import ThreadPoolExecutor
    k, v = make_kv(rng, 8, 700, 64, "q8")
    qs = [rng.standard_normal((16, 64), dtype=np.float32) for _ in range(8)]
    want = [sa.sparse_decode(q, k, v, k_blocks=4, threads=1).tobytes() for q in qs]
    with ThreadPoolExecutor(4) as ex:
        for _ in range(5):
            got = list(ex.map(lambda q: sa.sparse_decode(q, k, v, k_blocks=4, threads=2).tobytes(), qs))
            assert got == want


def test_forked_child_computes_the_same(rng):
    """The worker pool does not survive fork(); a forked child starts its own."""
    import multiprocessing as mp
    k, v = make_kv(rng, 4, 300, 64)
    q = rng.standard_normal((8, 64), dtype=np.float32)
    want = sa.dense_decode(q, k, v, threads=2)          # the parent's pool is up
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(sa.dense_decode, (q, k, v), dict(threads=2))
    assert got.tobytes() == want.tobytes()

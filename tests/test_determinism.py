"""SPEC §5, the red line: same inputs, same build, same machine -> identical
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

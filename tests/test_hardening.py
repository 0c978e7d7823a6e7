"""What an adversarial pass found (issue 12), kept fixed: NaN in K/V behaves
the same on every ISA, values that would overflow never enter a cache, a
failed append changes nothing, a cache serves concurrent readers while it
grows, and sizes at the edge of a C int are served correctly."""
import mmap
import threading
import time

import numpy as np
import pytest

import sparse_attn as sa
import sparse_attn.cache as sa_cache
from sparse_attn import reference as ref

from conftest import make_kv, rel_err, rtol_for


# ------------------------------------------------------------------ NaN in K or V

@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_k_or_v_propagates_the_same_on_every_isa(isa, rng, where):
    """A NaN in a float32 K or V passed directly (not scanned: that would
    read the whole KV per call) makes the output of exactly the heads that
    read it NaN, on every ISA, as in the reference; a prefill row that reads
    it is NaN, and so is the importance it contributes to."""
    H, Hkv, D, S = 8, 2, 64, 150
    k, v = make_kv(rng, Hkv, S, D)
    (k if where == "k" else v)[0, 5, 3] = np.nan        # KV head 0, row 5
    q = rng.standard_normal((H, D), dtype=np.float32)
    reads = np.arange(H) // (H // Hkv) == 0              # heads of KV head 0
    # NaN in K: the score is NaN, so is the softmax sum, so is every output
    # element of those heads; NaN in V: the output channel that adds it.
    nan_cols = slice(None) if where == "k" else slice(3, 4)
    for out, want in ((sa.dense_decode(q, k, v), ref.dense_decode(q, k, v)),
                      (sa.sparse_decode(q, k, v, k_blocks=5), ref.dense_decode(q, k, v))):
        assert np.isnan(out[reads][:, nan_cols]).all() and np.isfinite(out[~reads]).all()
        assert np.array_equal(np.isnan(out), np.isnan(want))
        assert rel_err(out[~reads], want[~reads]) < 1e-5
    # a sparse selection that does not read block 0 never sees the NaN
    far = sa.sparse_decode(q, k, v, k_blocks=1, recency=True, n_probe=1,
                           importance=np.r_[np.zeros(S - 1), 1].astype(np.float32))
    assert np.isfinite(far).all()
    T = 12
    qp = rng.standard_normal((H, T, D), dtype=np.float32)
    out, imp = sa.prefill(qp, k, v, start=0)
    want, want_imp = ref.prefill(qp, k, v, start=0)
    assert np.array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[reads][:, 5:, nan_cols]).all() and np.isfinite(out[reads][:, :5]).all()
    assert np.isfinite(out[~reads]).all()
    # importance is made of the weights: NaN where a NaN score entered them
    assert np.array_equal(np.isnan(imp), np.isnan(want_imp))
    assert np.isnan(imp).any() == (where == "k")


def test_nan_in_a_q8_cache_or_quantiser_is_refused(rng):
    x = rng.standard_normal((2, 10, 64), dtype=np.float32)
    x[1, 3, 7] = np.nan
    with pytest.raises(ValueError, match="x holds NaN"):
        sa.quantize_q8(x)


# ------------------------------------------------------------------ values that overflow

@pytest.mark.parametrize("dtype", ["q8", "float32"])
@pytest.mark.parametrize("bad", [3e38, -2.0**48, np.inf])
def test_values_that_could_overflow_never_enter_a_cache(rng, dtype, bad):
    cache = sa.KVCache(2, 64, capacity=8, dtype=dtype)
    good = rng.standard_normal((2, 20, 64), dtype=np.float32)
    cache.append(good, good)
    cache.prefill(rng.standard_normal((4, 20, 64), dtype=np.float32))
    before = (cache.seq_len, cache.capacity, np.array(cache.importance))
    huge = good.copy()
    huge[1, 4, 9] = bad
    for k, v, name in ((huge, good, "k"), (good, huge, "v")):
        with pytest.raises(ValueError, match=f"^{name} holds NaN or Inf values, or magnitudes"):
            cache.append(k, v)
        assert (cache.seq_len, cache.capacity) == before[:2]
        assert np.array_equal(cache.importance, before[2])
    out = cache.prefill(rng.standard_normal((4, 20, 64), dtype=np.float32))
    assert np.isfinite(out).all() and np.isfinite(cache.importance).all()
    assert np.isfinite(cache.decode(rng.standard_normal((4, 64), dtype=np.float32),
                                    k_blocks=1)).all()
    # the largest magnitude below the limit is fine, and stays finite
    edge = good.copy()
    edge[0, 0, 0] = np.nextafter(np.float32(2.0**48), np.float32(0))
    cache.append(edge, edge)
    assert np.isfinite(cache.decode(rng.standard_normal((4, 64), dtype=np.float32))).all()


# ------------------------------------------------------------------ failed growth

def _state(cache):
    """Every byte of a cache's visible state."""
    parts = [cache.seq_len, cache.capacity, cache.importance.tobytes()]
    for t in (cache.k, cache.v):
        parts += [t.data.tobytes(), t.scales.tobytes()] if isinstance(t, sa.Q8) else \
            [t.tobytes()]
    b = cache.bounds
    parts += [b.mn.tobytes(), b.mx.tobytes(), b.scales.tobytes(), b.k_rows]
    p = cache.probe_rows
    if p is not None:
        rows = p.rows
        parts += [p.k_rows, *(a.tobytes() for a in ((rows.data, rows.scales)
                                                    if isinstance(rows, sa.Q8) else (rows,)))]
    c = cache.channels
    if c is not None:
        parts += [c.k_rows, c.data.tobytes(), c.scales.tobytes()]
    return parts


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_failed_growth_changes_nothing(rng, monkeypatch, dtype):
    """An allocation that fails while the cache grows (any of its buffers)
    leaves seq_len, K, V, importance, bounds and probe rows as they were,
    and the cache keeps working: later appends give what a cache that never
    failed holds."""
    x = rng.standard_normal((2, 40, 64), dtype=np.float32)
    y = rng.standard_normal((2, 30, 64), dtype=np.float32)
    real = np.zeros
    fails_at = 0
    while True:
        cache = sa.KVCache(2, 64, capacity=32, dtype=dtype)
        cache.append(x[:, :20], x[:, :20])
        cache.add_importance(np.arange(20, dtype=np.float32))
        before = _state(cache)
        calls = []

        def failing(*args, **kw):
            calls.append(1)
            if len(calls) == fails_at + 1:
                raise MemoryError("injected")
            return real(*args, **kw)

        monkeypatch.setattr(sa_cache, "_zeros", failing)
        try:
            cache.append(x[:, 20:], x[:, 20:])      # needs to grow past 32 rows
        except MemoryError:
            failed = True
        else:
            failed = False
        monkeypatch.setattr(sa_cache, "_zeros", real)
        if not failed:
            assert fails_at > 0          # some allocations were tried and failed before
            break
        assert _state(cache) == before, f"allocation {fails_at} left a half-grown cache"
        cache.append(x[:, 20:], x[:, 20:])
        cache.append(y, y)
        fresh = sa.KVCache(2, 64, capacity=32, dtype=dtype)
        fresh.append(x, x)
        fresh.add_importance(np.arange(20, dtype=np.float32))
        fresh.append(y, y)
        assert _state(cache)[2:] == _state(fresh)[2:]
        fails_at += 1


def _huge_cache(dtype="q8", capacity=4096):
    """A cache whose arrays take more than one huge page (about 3 MB for q8)."""
    return sa.KVCache(4, 128, capacity=capacity, dtype=dtype, copy_probe_rows=True)


@pytest.mark.skipif(not sa_cache._HUGE, reason="no transparent huge pages on this system")
@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_a_large_cache_is_one_huge_page_aligned_mapping(rng, monkeypatch, dtype):
    """K, V and the metadata of a large cache are carved from one zeroed
    mapping that starts at a huge page boundary, and decode on it gives
    bitwise what the same cache gives from plain numpy arrays."""
    cache = _huge_cache(dtype)
    b = cache._buf
    arrays = [*b.karr, *b.varr, *b.bounds, *sa_cache._arrays(b.probe), *b.channels]
    assert arrays[0].ctypes.data % sa_cache._HUGE == 0
    roots = {id(a.base.base if a.base.base is not None else a.base) for a in arrays}
    assert len(roots) == 1                   # one allocation under all of them
    assert all(a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.flags.writeable
               and not a.any() for a in arrays)
    # nothing reachable from a view can unmap the memory under it
    root = cache.k.data if dtype == "q8" else cache.k
    while isinstance(root, np.ndarray):
        root = root.base
    assert not isinstance(root, (memoryview, mmap.mmap))
    with pytest.raises(BufferError):
        b.arena._mm.close()
    monkeypatch.setattr(sa_cache, "_HUGE", 0)
    plain = _huge_cache(dtype)
    kv = rng.standard_normal((4, 3000, 128), dtype=np.float32)
    q = rng.standard_normal((8, 128), dtype=np.float32)
    qp = rng.standard_normal((8, 1, 128), dtype=np.float32)
    for c in (cache, plain):
        c.append(kv, kv)
        c.prefill(qp)
    assert _state(cache) == _state(plain)
    for policy in ("seed", "balanced", "fast"):
        assert np.array_equal(cache.decode(q, k_blocks=8, policy=policy),
                              plain.decode(q, k_blocks=8, policy=policy))


@pytest.mark.skipif(not sa_cache._HUGE, reason="no transparent huge pages on this system")
def test_a_cache_asks_for_huge_pages_once_three_quarters_full(rng):
    """A huge page is memory on its first touch, written rows or not: a
    mapped cache asks for them only when the rows about to be written fill
    three quarters of it (an append, or a growth with the rows it copies
    and appends), and a cache too small to map has nothing to ask for."""
    kv = rng.standard_normal((4, 4096, 128), dtype=np.float32)
    cache = _huge_cache(capacity=4096)
    assert cache._buf.arena.mapped and not cache._buf.advised
    cache.append(kv[:, :3000], kv[:, :3000])
    assert not cache._buf.advised                  # 3000 of 4096: under 3/4
    cache.append(kv[:, :72], kv[:, :72])
    assert cache._buf.advised                      # 3072 of 4096
    cache.append(kv[:, :1100], kv[:, :1100])       # grows to 8192, 4172 rows
    assert cache.capacity == 8192 and not cache._buf.advised
    full = _huge_cache(capacity=1024)
    full.append(kv, kv)                            # grows to exactly 4096 rows
    assert full.capacity == 4096 and full._buf.advised
    small = sa.KVCache(2, 64, capacity=64)
    assert not small._buf.arena.mapped and small._buf.advised


@pytest.mark.skipif(not sa_cache._HUGE, reason="no transparent huge pages on this system")
def test_a_refused_mapping_is_a_memory_error_that_changes_nothing(rng, monkeypatch):
    """A mapping the system refuses while a large cache grows raises
    MemoryError and leaves the cache as it was; a cache too large for any
    allocation raises MemoryError, not numpy's or mmap's own errors."""
    cache = _huge_cache(capacity=2048)
    kv = rng.standard_normal((4, 2048, 128), dtype=np.float32)
    cache.append(kv, kv)
    before = _state(cache)

    def refuse(*args, **kw):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(sa_cache.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="cannot map"):
        cache.append(kv[:, :1], kv[:, :1])          # grows to 4096 rows
    assert _state(cache) == before
    monkeypatch.undo()
    cache.append(kv[:, :1], kv[:, :1])
    assert cache.seq_len == 2049 and cache.capacity == 4096
    for huge in (sa_cache._HUGE, 0):
        monkeypatch.setattr(sa_cache, "_HUGE", huge)
        with pytest.raises(MemoryError, match="for a KV cache"):
            sa.KVCache(2**20, 2**20, capacity=2**30, copy_channels=False)


# ------------------------------------------------------------------ concurrent use

@pytest.mark.parametrize("policy", ["seed", "fast"])
def test_concurrent_decodes_while_one_thread_appends(rng, policy):
    """Four threads decode from a cache while a fifth appends one token at a
    time (with growth and bound updates of the partial last block): no call
    fails, and every result is bitwise the decode of the cache at one of the
    lengths it passed through."""
    H, Hkv, D, T0, steps = 8, 2, 64, 100, 40
    kv = rng.standard_normal((Hkv, T0 + steps, D), dtype=np.float32)
    q = rng.standard_normal((H, D), dtype=np.float32)
    imp = rng.random(T0 + steps, dtype=np.float32)
    want = {}
    check = sa.KVCache(Hkv, D, capacity=T0)
    check.append(kv[:, :T0], kv[:, :T0])
    check.add_importance(imp[:T0])
    for n in range(T0, T0 + steps + 1):
        if n > T0:
            check.append(kv[:, n - 1:n], kv[:, n - 1:n])
        want[check.decode(q, k_blocks=3, policy=policy).tobytes()] = n
    cache = sa.KVCache(Hkv, D, capacity=T0)
    cache.append(kv[:, :T0], kv[:, :T0])
    cache.add_importance(imp[:T0])
    done, errors, seen = threading.Event(), [], []

    def reader():
        try:
            while not done.is_set():
                seen.append(cache.decode(q, k_blocks=3, policy=policy, threads=2).tobytes())
        except Exception as exc:    # noqa: BLE001 - any error fails the test
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for n in range(T0, T0 + steps):
        cache.append(kv[:, n:n + 1], kv[:, n:n + 1])
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert seen and all(s in want for s in seen)
    assert cache.capacity > T0 and cache.seq_len == T0 + steps


def test_cache_lock_readers_share_and_a_waiting_writer_holds_back_new_readers():
    """The cache's read/write lock: readers overlap; a writer waits for them;
    while it waits no new reader gets in; once it is done everyone runs."""
    lock = sa_cache._RWLock()
    lock.acquire_read()
    lock.acquire_read()                 # two readers at once
    order, writer_in, late_in = [], threading.Event(), threading.Event()

    def writer():
        lock.acquire_write()
        order.append("writer")
        writer_in.set()
        lock.release_write()

    def late_reader():
        lock.acquire_read()
        order.append("late reader")
        late_in.set()
        lock.release_read()

    w = threading.Thread(target=writer)
    w.start()
    while not lock._waiting:            # the writer is queued behind the readers
        time.sleep(0.001)
    r = threading.Thread(target=late_reader)
    r.start()
    assert not late_in.wait(0.05) and not writer_in.is_set()
    lock.release_read()
    lock.release_read()
    assert writer_in.wait(5) and late_in.wait(5)
    w.join()
    r.join()
    assert order == ["writer", "late reader"]
    assert (lock._readers, lock._writer, lock._waiting, lock._sleepers) == (0, False, 0, 0)


# ------------------------------------------------------------------ sizes near 2**31

@pytest.mark.slow
def test_contexts_near_the_c_int_limit_are_served_exactly():
    """2**31 - 1 rows of head_dim 1 in blocks of 2**30 - 1 (three blocks, the
    last of one row): the recency block ends at 3 * (2**30 - 1), beyond a C
    int, and used to be read one row past the end.  K and V are zero pages
    (np.zeros), only the rows written are touched."""
    S = 2**31 - 1
    bs = 2**30 - 1
    k = np.zeros((1, S, 1), np.float32)
    v = np.zeros((1, S, 1), np.float32)
    v[0, -1, 0] = 3.0
    q = np.ones((1, 1), np.float32)
    out, blocks = sa.sparse_decode(q, k, v, k_blocks=1, block_size=bs, return_blocks=True)
    assert blocks.tolist() == [[2]] and out.tolist() == [[3.0]]
    # 2**30 + 1 rows in blocks of 2**30: the SIGSEGV case, and selection of two
    k2 = np.zeros((1, 2**30 + 1, 1), np.float32)
    v2 = np.zeros((1, 2**30 + 1, 1), np.float32)
    v2[0, -1, 0] = -2.0
    out, blocks = sa.sparse_decode(q, k2, v2, k_blocks=1, block_size=2**30, return_blocks=True)
    assert blocks.tolist() == [[1]] and out.tolist() == [[-2.0]]
    assert sa.select_blocks(q, k2, k_blocks=2, block_size=2**30).tolist() == [[0, 1]]
    imp = np.zeros(2**30 + 1, np.float32)
    imp[3] = 1.0
    assert sa.select_blocks(q, k2, k_blocks=1, block_size=2**30, importance=imp,
                            recency=False).tolist() == [[0]]

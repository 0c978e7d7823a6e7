"""What adversarial passes found, kept fixed: NaN in K/V behaves
the same on every ISA, values that would overflow never enter a cache, a
failed append changes nothing, a cache serves concurrent readers while it
grows, and sizes at the edge of a C int are served correctly."""
import mmap
import threading
import time

import numpy as np
import pytest

import sparse_attn as sa
import sparse_attn._storage as sa_storage
import sparse_attn.cache as sa_cache
from sparse_attn import reference as ref
from sparse_attn._rwlock import RWLock

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

        monkeypatch.setattr(sa_storage, "zeros", failing)
        try:
            cache.append(x[:, 20:], x[:, 20:])      # needs to grow past 32 rows
        except MemoryError:
            failed = True
        else:
            failed = False
        monkeypatch.setattr(sa_storage, "zeros", real)
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


@pytest.mark.skipif(not sa_storage.HUGE, reason="no transparent huge pages on this system")
@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_a_large_cache_is_one_huge_page_aligned_mapping(rng, monkeypatch, dtype):
    """K, V and the metadata of a large cache are carved from one zeroed
    mapping that starts at a huge page boundary, and decode on it gives
    bitwise what the same cache gives from plain numpy arrays."""
    cache = _huge_cache(dtype)
    b = cache._buf
    arrays = [*b.karr, *b.varr, *b.bounds, *sa_storage.probe_arrays(b.probe), *b.channels]
    assert arrays[0].ctypes.data % sa_storage.HUGE == 0
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
    monkeypatch.setattr(sa_storage, "HUGE", 0)
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


@pytest.mark.skipif(not sa_storage.HUGE, reason="no transparent huge pages on this system")
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


@pytest.mark.skipif(not sa_storage.HUGE, reason="no transparent huge pages on this system")
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

    monkeypatch.setattr(sa_storage.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match="cannot map"):
        cache.append(kv[:, :1], kv[:, :1])          # grows to 4096 rows
    assert _state(cache) == before
    monkeypatch.undo()
    cache.append(kv[:, :1], kv[:, :1])
    assert cache.seq_len == 2049 and cache.capacity == 4096
    for huge in (sa_storage.HUGE, 0):
        monkeypatch.setattr(sa_storage, "HUGE", huge)
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
    while it waits no new reader gets in; once it is done everyone runs.
    A hold is a thread's (its ident): two readers are two threads."""
    lock = RWLock()
    me = threading.get_ident()
    lock.acquire_read(me)
    other_in, other_go = threading.Event(), threading.Event()

    def other_reader():
        i = threading.get_ident()
        lock.acquire_read(i)
        other_in.set()
        other_go.wait(5)
        lock.release_read(i)

    o = threading.Thread(target=other_reader)
    o.start()
    assert other_in.wait(5)             # two readers at once
    order, writer_in, late_in = [], threading.Event(), threading.Event()

    def writer():
        i = threading.get_ident()
        lock.acquire_write(i)
        order.append("writer")
        writer_in.set()
        lock.release_write(i)

    def late_reader():
        i = threading.get_ident()
        lock.acquire_read(i)
        order.append("late reader")
        late_in.set()
        lock.release_read(i)

    w = threading.Thread(target=writer)
    w.start()
    while not lock._waiting:            # the writer is queued behind the readers
        time.sleep(0.001)
    r = threading.Thread(target=late_reader)
    r.start()
    assert not late_in.wait(0.05) and not writer_in.is_set()
    lock.release_read(me)
    other_go.set()
    assert writer_in.wait(5) and late_in.wait(5)
    for t in (o, w, r):
        t.join()
    assert order == ["writer", "late reader"]
    assert (lock._readers, lock._writer, lock._waiting) == (set(), set(), set())


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


# ------------------------------------------------------------------ snapshots a cache hands out

def _view_bytes(view):
    """Every byte of a BlockBounds, ChannelCopy or ProbeRows, and its k_rows."""
    if isinstance(view, sa.BlockBounds):
        arrays = (view.mn, view.mx, view.scales)
    elif isinstance(view, sa.ChannelCopy):
        arrays = (view.data, view.scales)
    else:
        rows = view.rows
        arrays = (rows.data, rows.scales) if isinstance(rows, sa.Q8) else (rows,)
    return [view.k_rows] + [a.tobytes() for a in arrays]


@pytest.mark.parametrize("dtype", ["q8", "float32"])
def test_a_cache_s_metadata_views_are_snapshots(isa, rng, dtype):
    """The key bounds, channel copy and probe-row copies a cache hands out
    while its last block is partial are not rewritten by the next append
    into that block, nor by prefill, add_importance, truncate, re-append or
    growth: a decode over the k and v of that time with them chooses and
    computes what metadata made afresh from that k does.  (Rewritten views,
    still reporting the old k_rows, were accepted at that length: minmax
    and channel scoring then chose other blocks.)"""
    Hkv, D, H = 2, 64, 4
    cache = sa.KVCache(Hkv, D, capacity=96, dtype=dtype, copy_probe_rows=True)
    x = rng.standard_normal((Hkv, 80, D), dtype=np.float32)   # block 2: 16 of 32 rows
    cache.append(x, x)
    cache.prefill(rng.standard_normal((H, 80, D), dtype=np.float32))
    k0, v0 = cache.k, cache.v
    views = {"bounds": cache.bounds, "channels": cache.channels,
             "probe_rows": cache.probe_rows}
    before = {name: _view_bytes(view) for name, view in views.items()}
    # rows far larger than block 2's: its bounds and channel scales grow
    big = 40 * rng.standard_normal((Hkv, 10, D), dtype=np.float32)
    cache.append(big, big)
    cache.prefill(rng.standard_normal((H, 10, D), dtype=np.float32))
    cache.add_importance(np.ones(90, np.float32))
    assert {name: _view_bytes(view) for name, view in views.items()} == before
    made = {"bounds": sa.block_bounds(k0), "channels": sa.channel_copy(k0),
            "probe_rows": sa.probe_rows(k0)}
    # one block a head, no recency: the scores alone choose among the three
    for policy, name in (("fast", "bounds"), ("balanced", "channels"), ("seed", "probe_rows")):
        for _ in range(20):
            q = rng.standard_normal((H, D), dtype=np.float32)
            kw = dict(k_blocks=1, recency=False, sink_blocks=0, policy=policy,
                      return_blocks=True)
            out, blocks = sa.sparse_decode(q, k0, v0, **kw, **{name: views[name]})
            want_out, want_blocks = sa.sparse_decode(q, k0, v0, **kw, **{name: made[name]})
            assert np.array_equal(blocks, want_blocks), (policy, blocks, want_blocks)
            assert out.tobytes() == want_out.tobytes()
    cache.truncate(40)                                        # in place: no growth
    y = rng.standard_normal((Hkv, 50, D), dtype=np.float32)
    cache.append(y, y)
    assert {name: _view_bytes(view) for name, view in views.items()} == before
    cache.append(y, y)                                        # grows
    assert cache.capacity > 96
    assert {name: _view_bytes(view) for name, view in views.items()} == before
    # their arrays are their own and stay read-only
    for view in views.values():
        for a in (getattr(view, name) for name in ("mn", "mx", "scales", "data", "rows")
                  if hasattr(view, name)):
            for arr in ((a.data, a.scales) if isinstance(a, sa.Q8) else (a,)):
                with pytest.raises(ValueError):
                    arr.setflags(write=True)


def test_the_importance_a_cache_hands_out_is_a_copy(rng):
    """cache.importance is the caller's copy: a later prefill does not change
    it, and writing into it does not reach the record (an Inf written there
    made every default decode raise)."""
    cache = sa.KVCache(2, 64, capacity=64)
    x = rng.standard_normal((2, 40, 64), dtype=np.float32)
    cache.append(x, x)
    cache.add_importance(np.arange(40, dtype=np.float32))
    imp = cache.importance
    cache.prefill(rng.standard_normal((4, 40, 64), dtype=np.float32))
    assert np.array_equal(imp, np.arange(40, dtype=np.float32))
    imp[:] = np.inf
    assert np.isfinite(cache.importance).all()
    assert np.isfinite(cache.decode(rng.standard_normal((4, 64), dtype=np.float32))).all()


# ------------------------------------------------------------------ the importance record

def test_add_importance_never_makes_the_record_overflow(rng):
    """Each add is finite, but two of 3e38 would overflow the record to Inf,
    after which every default decode raised until a truncation: the add
    that would overflow it is refused, naming the argument, and changes
    nothing.  A prefill cannot make it overflow (it adds at most H * T per
    token, far below float32's step at its largest value)."""
    cache = sa.KVCache(2, 64, capacity=64)
    x = rng.standard_normal((2, 40, 64), dtype=np.float32)
    cache.append(x, x)
    q = rng.standard_normal((4, 64), dtype=np.float32)
    big = np.full(40, 3e38, np.float32)
    cache.add_importance(big)
    before = cache.importance.tobytes()
    for bad in (big, big[:7]):
        with pytest.raises(ValueError, match="^importance .*overflow"):
            cache.add_importance(bad)
        assert cache.importance.tobytes() == before
    cache.add_importance(-big[:5])              # subtracting stays finite
    assert np.isfinite(cache.importance).all()
    assert np.isfinite(cache.decode(q)).all()
    assert np.isfinite(cache.decode(q, policy="seed")).all()
    edge = sa.KVCache(2, 64, capacity=64)
    edge.append(x, x)
    edge.add_importance(np.full(40, np.finfo(np.float32).max, np.float32))
    for _ in range(3):
        edge.prefill(rng.standard_normal((4, 40, 64), dtype=np.float32))
    assert np.isfinite(edge.importance).all()
    assert np.isfinite(edge.decode(q, policy="seed")).all()
    with pytest.raises(ValueError, match="^importance .*overflow"):
        edge.add_importance(np.full(1, 1e32, np.float32))


# ------------------------------------------------------------------ q8 of tiny groups

@pytest.mark.parametrize("amax", [1e-38, 3.7e-37, 1.5e-45, 4e-37, 1e-30])
def test_q8_of_a_group_too_small_to_invert(isa, rng, amax):
    """A group whose largest magnitude is below about 3.7e-37 has a scale
    d = amax / 127 whose inverse overflows float32: 0 * Inf made NaN, and
    zeros quantised to -127 in C (the reference gave 0).  Spec §4: id = 0
    whenever 1 / d is not finite, so such a group quantises to zeros; in
    quantize_q8, in a q8 cache's append and in the channel copy, on every
    path, as in the reference."""
    D, gs = 64, 32
    amax = np.float32(amax)
    x = rng.standard_normal((3, D), dtype=np.float32)
    x[1, :gs] = 0
    x[1, 5], x[1, 9], x[1, 20] = amax, -amax, amax / 2
    x[2, gs:] = 0
    with np.errstate(divide="ignore", over="ignore"):
        tiny = not np.isfinite(np.float32(1) / (amax / np.float32(127)))
    want = ref.quantize_q8(x, gs)
    got = sa.quantize_q8(x, gs)
    assert got.data.tobytes() == want.data.tobytes()
    assert got.scales.tobytes() == want.scales.tobytes()
    assert not got.data[2, gs:].any()
    if tiny:
        assert not got.data[1, :gs].any()
    else:
        assert got.data[1, 5] == 127 and got.data[1, 9] == -127 and got.data[1, 0] == 0
    cache = sa.KVCache(1, D, capacity=8, dtype="q8", group_size=gs, block_size=4)
    cache.append(x[None], x[None])
    assert cache.k.data[0].tobytes() == want.data.tobytes()
    assert cache.k.scales[0].tobytes() == want.scales.tobytes()
    # the channel copy of K: channel 3 of block 0 tiny, of block 1 tiny and zeros
    k = rng.standard_normal((1, 40, D), dtype=np.float32)
    k[0, :32, 3] = amax * np.sign(rng.standard_normal(32)).astype(np.float32)
    k[0, 32:, 3] = 0
    k[0, 33, 3] = -amax
    k[0, 37, 3] = amax
    want_data, want_scales = ref.channel_copy(k)
    for copy in (sa.channel_copy(k), _channels_of_a_cache(k)):
        assert copy.scales.tobytes() == want_scales.tobytes()
        assert copy.data[..., 0, :].tobytes() == want_data[..., 0, :].tobytes()
        assert copy.data[..., 1, :8].tobytes() == want_data[..., 1, :8].tobytes()
        if tiny:
            assert not copy.data[0, 3, 0].any() and not copy.data[0, 3, 1, :8].any()


def _channels_of_a_cache(k):
    cache = sa.KVCache(k.shape[0], k.shape[2], capacity=64, dtype="float32")
    cache.append(k, k)
    return cache.channels


# ------------------------------------------------------------------ metadata owns its arrays

def test_hand_built_metadata_owns_its_arrays(rng):
    """BlockBounds, ChannelCopy and ProbeRows made from the caller's arrays
    copy them and check the copies once: what the caller writes into its
    arrays afterwards (NaN scales, -128) never reaches C, their read-only
    arrays stay read-only, and negative, huge or non-finite scales are
    refused as Q8 refuses them."""
    H, Hkv, D, S = 4, 2, 64, 100
    k, v = make_kv(rng, Hkv, S, D)
    kq, vq = sa.quantize_q8(k), sa.quantize_q8(v)
    q = rng.standard_normal((H, D), dtype=np.float32)

    def decode(keys, values, **kw):
        return sa.sparse_decode(q, keys, values, k_blocks=2, recency=False, sink_blocks=0,
                                return_blocks=True, **kw)

    def same(a, b):
        return a[0].tobytes() == b[0].tobytes() and np.array_equal(a[1], b[1])

    # ChannelCopy
    c = sa.channel_copy(k)
    data, scales = c.data.copy(), c.scales.copy()
    mine = sa.ChannelCopy(data, scales, 32, S)
    want = decode(k, v, policy="balanced", channels=mine)
    assert same(want, decode(k, v, policy="balanced"))
    data[:] = 0
    scales[0, 0] = np.nan
    assert mine.data.tobytes() == c.data.tobytes()
    assert mine.scales.tobytes() == c.scales.tobytes()
    assert same(decode(k, v, policy="balanced", channels=mine), want)
    # BlockBounds
    b = sa.block_bounds(k)
    mn, mx, bsc = b.mn.copy(), b.mx.copy(), b.scales.copy()
    mine_b = sa.BlockBounds(mn, mx, bsc, 32, 32, S)
    want_b = decode(k, v, policy="fast", bounds=mine_b)
    assert same(want_b, decode(k, v, policy="fast"))
    mn[:], mx[:] = -127, 127            # every block alike: block 0 would win
    bsc[:] = 1
    assert [a.tobytes() for a in (mine_b.mn, mine_b.mx, mine_b.scales)] == \
        [a.tobytes() for a in (b.mn, b.mx, b.scales)]
    assert same(decode(k, v, policy="fast", bounds=mine_b), want_b)
    # ProbeRows, float32 and q8 rows
    r = sa.probe_rows(k)
    rows = r.rows.copy()
    mine_r = sa.ProbeRows(rows, 32, 8, S)
    want_r = decode(k, v, policy="seed", probe_rows=mine_r)
    assert same(want_r, decode(k, v, policy="seed"))
    rows[:] = np.nan
    assert mine_r.rows.tobytes() == r.rows.tobytes()
    assert same(decode(k, v, policy="seed", probe_rows=mine_r), want_r)
    rq = sa.probe_rows(kq)
    qdata, qscales = rq.rows.data.copy(), rq.rows.scales.copy()
    mine_q = sa.ProbeRows(sa.Q8(qdata, qscales, 32), 32, 8, S)
    want_q = decode(kq, vq, policy="seed", probe_rows=mine_q)
    assert same(want_q, decode(kq, vq, policy="seed"))
    qdata[:] = -128
    qscales[:] = np.nan
    assert mine_q.rows.data.tobytes() == rq.rows.data.tobytes()
    assert mine_q.rows.scales.tobytes() == rq.rows.scales.tobytes()
    assert same(decode(kq, vq, policy="seed", probe_rows=mine_q), want_q)
    # read-only for good: no view of an array someone else may write
    for arr in (mine.data, mine.scales, mine_b.mn, mine_b.mx, mine_b.scales, mine_r.rows,
                mine_q.rows.data, mine_q.rows.scales):
        with pytest.raises(ValueError):
            arr.setflags(write=True)
    # scales are checked as Q8 checks them
    for bad in (-1.0, 3e38, np.inf, np.nan):
        s = c.scales.copy()
        s[1, 2, 3] = bad
        with pytest.raises(ValueError, match="^channels.scales holds"):
            sa.ChannelCopy(c.data, s, 32, S)
        s = b.scales.copy()
        s[1, 2, 0] = bad
        with pytest.raises(ValueError, match="^bounds.scales holds"):
            sa.BlockBounds(b.mn, b.mx, s, 32, 32, S)
    for bad in (np.nan, np.inf, 2.0**48):
        rows = r.rows.copy()
        rows[0, 3, 5] = bad
        with pytest.raises(ValueError, match="^probe_rows.rows holds"):
            sa.ProbeRows(rows, 32, 8, S)

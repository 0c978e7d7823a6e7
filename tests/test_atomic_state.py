"""Every state change of a KVCache is all or nothing, interrupts included
(docs/spec.md §5, "Failures change nothing"; issue 63).

CPython raises a pending asynchronous exception (the KeyboardInterrupt of
a Ctrl-C) only where its eval loop checks for one: at a Python function's
entry, after a call returns, and at a backward jump.  `Interrupter` runs an
operation under sys.settrace and sys.setprofile and delivers one
KeyboardInterrupt at one such point of the Python code it runs (the
package's, numpy's, the standard library's: every frame but this
module's), counted in a dry run; each test runs the operation once per
point.  After every run the cache's lock is free, its length is the old or
the new one, and everything it gives (decode with each scoring, dense
decode, prefill, its metadata) is bitwise what a cache on which the
operation did not happen, or happened, gives; so is what it gives after
one more append.  A thread sending real SIGINTs to an append of a long
prompt, and a batch step refusing one sequence's token, complete the
picture."""
import dis
import functools
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import _ffi, _storage
from sparse_attn._rwlock import RWLock
from sparse_attn.decoder import append_pending, decode_rows

HKV, H, D, BS = 2, 4, 64, 8         # blocks of 8 rows: a few dozen tokens span several

if sys.version_info < (3, 11):
    pytest.skip("the interrupt points modelled are CPython 3.11's and later's",
                allow_module_level=True)

CALLS = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX") if name in dis.opmap}
JUMP_BACKWARD = dis.opmap["JUMP_BACKWARD"]      # (JUMP_BACKWARD_NO_INTERRUPT checks nothing)
EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]


@functools.lru_cache(maxsize=None)
def _code_map(code):
    """{instruction offset: the next one's}, and {offset: its exception
    handler (target, depth, lasti) or None} of a code object."""
    ins = list(dis.get_instructions(code))
    table = dis._parse_exception_table(code)
    handler = {i.offset: next(((e.target, e.depth, e.lasti) for e in table
                               if e.start <= i.offset < e.end), None) for i in ins}
    return {a.offset: b.offset for a, b in zip(ins, ins[1:])}, handler


class Interrupter:
    """Runs fn() under sys.settrace and sys.setprofile and counts the points
    where CPython could raise a pending KeyboardInterrupt in the Python code
    it runs (every frame but this module's): each function's entry, each
    call's return, each backward jump.  With `at`, raises KeyboardInterrupt
    at point `at` (counting from 0) instead, where CPython would: at a
    function's entry (its 'call' event), before a backward jump's jump (its
    'opcode' event: the exception is the jump's), after a call (the next
    instruction's 'opcode' event, when that instruction has the call's
    exception handler; else at the callee's return: a C function's
    'c_return' profile event, or a Python callee's 'return' event, either
    of which raises at the caller's call instruction; a callee that has
    neither, such as an lru_cache hit, at the next instruction: stricter
    than CPython when that skips a cleanup the call is inside, the same
    when the handler lets a KeyboardInterrupt through).  A trace or profile
    function that raises is switched off, so there is one interrupt."""

    def __init__(self, at=None):
        self.at, self.count, self.where, self.done = at, 0, None, False
        self._open = {}         # frame: [its call's offset, handlers differ, placed]

    def _point(self, frame):
        if self.done:
            return
        i = self.count
        self.count += 1
        if i == self.at:
            self.done = True
            code = frame.f_code
            self.where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
            raise KeyboardInterrupt(f"injected at point {i}: {self.where}")

    @staticmethod
    def _mine(frame):
        return frame is not None and frame.f_code.co_filename != __file__

    def _call(self, frame, event, arg):
        if event != "call" or not self._mine(frame):
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        self._point(frame)                      # a function's entry
        return self._step

    def _step(self, frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            at = frame.f_lasti
            while code.co_code[at] == EXTENDED_ARG:
                at += 2
            call = self._open.pop(frame, None)
            if call is not None and not call[2]:    # the call before this one returned
                self._point(frame)
            op = code.co_code[at]
            if op in CALLS:
                nxt, handler = _code_map(code)
                self._open[frame] = [at, handler[at] != handler.get(nxt.get(at)), False]
            elif op == JUMP_BACKWARD:
                self._point(frame)
        elif event == "return":
            self._open.pop(frame, None)
            self._returned(frame.f_back, frame)
        elif event == "exception":              # a call raised: it did not return
            self._open.pop(frame, None)
        return self._step

    def _returned(self, caller, frame):
        """A callee of `caller` returned (raising in `frame` raises at
        caller's call instruction): the point after that call, where the
        next instruction's handler is not the call's."""
        call = self._open.get(caller) if self._mine(caller) else None
        if call is not None and call[1]:
            call[2] = True
            self._point(frame)

    def _profile(self, frame, event, arg):
        if event == "c_return":
            self._returned(frame, frame)

    def run(self, fn):
        trace, profile = sys.gettrace(), sys.getprofile()
        sys.setprofile(self._profile)
        sys.settrace(self._call)
        try:
            return fn()
        finally:
            sys.settrace(trace)
            sys.setprofile(profile)


# ---------------------------------------------------------------- what a cache gives

RNG = np.random.default_rng(63)
Q = RNG.standard_normal((H, D), dtype=np.float32)
QP = RNG.standard_normal((H, 3, D), dtype=np.float32)
DECODES = [dict(k_blocks=2, scoring="minmax"), dict(k_blocks=2, scoring="channels"),
           dict(k_blocks=2, policy="seed", n_probe=4), dict(k_blocks=3, policy="seed")]


def _metadata(cache):
    out = [cache.importance.tobytes()]
    b = cache.bounds
    out += [b.k_rows, b.mn.tobytes(), b.mx.tobytes(), b.scales.tobytes()]
    c = cache.channels
    if c is not None:
        out += [c.k_rows, c.data.tobytes(), c.scales.tobytes()]
    p = cache.probe_rows
    if p is not None:
        rows = p.rows
        out += [p.k_rows, *(a.tobytes() for a in ((rows.data, rows.scales)
                                                   if isinstance(rows, sa.Q8) else (rows,)))]
    for t in (cache.k, cache.v):
        out += [a.tobytes() for a in ((t.data, t.scales) if isinstance(t, sa.Q8) else (t,))]
    return out


def gives(cache):
    """Everything the test compares of a cache, as bytes: its length, its
    decodes (output and blocks) with each scoring and with the recorded
    importance, its dense decode, an exact and a sparse prefill of its last
    tokens (on copies), its metadata, K and V."""
    n = cache.seq_len
    out = [n, _metadata(cache)]
    if n:
        for kw in DECODES:
            o, blocks = cache.decode(Q, block_size=BS, return_blocks=True, **kw)
            out += [o.tobytes(), blocks.tobytes()]
        out.append(cache.dense_decode(Q).tobytes())
        T = min(n, QP.shape[1])
        for kw in ({}, dict(k_blocks=2)):
            c = cache.copy()
            out += [c.prefill(QP[:, :T], **kw).tobytes(), c.importance.tobytes()]
    return out


def lock_is_free(cache, timeout=5.0):
    """Whether another thread can take the cache's write lock."""
    lock, took = cache._lock, threading.Event()

    def take():
        me = threading.get_ident()
        try:
            lock.acquire_write(me)
            took.set()
        finally:
            lock.release_write(me)

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return took.wait(timeout)


def kv(T, scale=1.0, seed=0):
    x = np.random.default_rng(seed).standard_normal((2, HKV, T, D), dtype=np.float32) * scale
    return x[0], x[1]


def filled(dtype="q8", n=21, capacity=64, importance=True, **kw):
    """A cache of n tokens (its last block partial), importance recorded."""
    kw = dict(dict(copy_channels=True, copy_probe_rows=True), **kw)
    cache = sa.KVCache(HKV, D, capacity=capacity, dtype=dtype, block_size=BS, n_probe=4, **kw)
    k, v = kv(n, seed=1)
    cache.append(k, v)
    if importance:
        cache.add_importance(np.random.default_rng(2).random(n, dtype=np.float32))
    return cache


NEXT = kv(3, scale=2.0, seed=9)     # the append each check makes after the operation


def then_append(cache):
    cache.append(*NEXT)
    return gives(cache)


def interrupt_everywhere(setup, op, *, at_least=10):
    """Run op(state) once per interrupt point, each time on a fresh
    setup(); return the number of points.  state = setup() is a cache, or
    (caches, anything) for an operation on several.  After each
    interrupted run, every cache's lock is free and each cache gives what
    it gave before op, or what it gives after an uninterrupted op, and the
    same after one more append."""
    def caches(state):
        return state[0] if isinstance(state, tuple) else [state]

    ref = setup()
    before = [gives(c) for c in caches(ref)]
    dry = Interrupter()
    dry.run(lambda: op(ref))
    after = [gives(c) for c in caches(ref)]
    assert dry.count >= at_least, f"only {dry.count} interrupt points: is the tracer on?"
    assert any(a != b for a, b in zip(after, before)), "the operation changed nothing"
    then = [[then_append(c) for c in caches(setup())]]        # before op, then an append
    state = setup()
    op(state)
    then.append([then_append(c) for c in caches(state)])      # after op, then an append
    err = np.geterr()
    for i in range(dry.count):
        state = setup()
        inj = Interrupter(at=i)
        with pytest.raises(KeyboardInterrupt):
            inj.run(lambda: op(state))
        np.seterr(**err)        # numpy's errstate may have been cut short too
        for j, c in enumerate(caches(state)):
            assert lock_is_free(c), f"lock held after an interrupt at {inj.where}"
            got = gives(c)
            assert got[0] in (before[j][0], after[j][0]), \
                f"cache {j}: seq_len {got[0]} after an interrupt at {inj.where}"
            assert got in (before[j], after[j]), \
                f"cache {j} is neither before nor after the operation (interrupt at {inj.where})"
            assert then_append(c) == then[0 if got == before[j] else 1][j], \
                f"cache {j}: an append after an interrupt at {inj.where} differs"
    return dry.count


# ---------------------------------------------------------------- the lock

def _free(lock):
    return not (lock._readers or lock._writer or lock._waiting)


def test_a_lock_hold_is_its_threads_and_a_release_without_one_does_nothing():
    """A release drops the calling thread's own hold, and nothing when it
    has none (what makes an interrupted acquire safe to release); a thread
    that asks for the lock while it holds it takes its hold over."""
    lock, me = RWLock(), threading.get_ident()
    lock.acquire_write(me)
    lock.acquire_write(me)                  # no deadlock on itself
    lock.release_write(me)
    lock.release_write(me)
    lock.release_read(me)
    assert _free(lock)
    lock.acquire_read(me)
    lock.acquire_write(me)                  # its read, taken over by the write
    assert lock._readers == set() and lock._writer == {me}
    lock.acquire_read(me)                   # its write, taken over by the read
    assert lock._writer == set() and lock._readers == {me}
    lock.release_read(me)
    assert _free(lock)
    other_in, done = threading.Event(), threading.Event()

    def other():
        i = threading.get_ident()
        lock.acquire_write(i)
        other_in.set()
        done.wait(5)
        lock.release_write(i)

    t = threading.Thread(target=other)
    t.start()
    assert other_in.wait(5)
    lock.release_write(me)                  # not this thread's: still held
    assert len(lock._writer) == 1
    done.set()
    t.join()
    assert _free(lock)


@pytest.mark.parametrize("wants", ["write", "read"])
def test_a_wait_for_the_lock_cut_short_by_sigint_leaves_no_trace(wants):
    """The main thread waits for the lock another thread holds (a read
    against a writer, or the write against a reader) and gets a real
    SIGINT while it waits: it leaves without a hold and without its mark
    as a waiting writer, and the lock works on."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    lock, me = RWLock(), threading.get_ident()
    other_kind = "read" if wants == "write" else "write"
    held, done = threading.Event(), threading.Event()

    def holder():
        i = threading.get_ident()
        getattr(lock, "acquire_" + other_kind)(i)
        held.set()
        done.wait(10)
        getattr(lock, "release_" + other_kind)(i)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(5)
    timer = threading.Timer(0.1, signal.pthread_kill, (me, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        try:
            getattr(lock, "acquire_" + wants)(me)
            time.sleep(5)                   # (not reached: the lock is held)
        finally:
            getattr(lock, "release_" + wants)(me)
    timer.join()
    assert me not in lock._readers | lock._writer | lock._waiting
    done.set()
    t.join()
    assert _free(lock)
    lock.acquire_write(me)
    lock.release_write(me)


# ---------------------------------------------------------------- one cache

@pytest.mark.parametrize("dtype", ["q8", "float32"])
@pytest.mark.parametrize("grows", [False, True], ids=["in_place", "grows"])
def test_an_interrupted_append_is_all_or_nothing(dtype, grows):
    k, v = kv(5, seed=3)                    # 21 + 5 rows: past a capacity of 24
    interrupt_everywhere(lambda: filled(dtype, capacity=24 if grows else 64),
                         lambda c: c.append(k, v))


@pytest.mark.parametrize("copies", [dict(copy_channels=False, copy_probe_rows=False),
                                    dict(copy_channels=True, copy_probe_rows=False),
                                    dict(copy_channels=False, copy_probe_rows=True)],
                         ids=["no_copies", "channels", "probe_rows"])
def test_an_interrupted_append_without_some_copies(copies):
    k, v = kv(6, seed=3)
    interrupt_everywhere(lambda: filled("q8", **copies), lambda c: c.append(k, v))


@pytest.mark.parametrize("dtype", ["q8", "float32"])
@pytest.mark.parametrize("keep", [13, 16, 0])
def test_an_interrupted_truncate_is_all_or_nothing(dtype, keep):
    interrupt_everywhere(lambda: filled(dtype), lambda c: c.truncate(keep))


@pytest.mark.parametrize("recorded", [False, True], ids=["first", "more"])
@pytest.mark.parametrize("sparse", [False, True], ids=["exact", "sparse"])
def test_an_interrupted_prefill_is_all_or_nothing(recorded, sparse):
    kw = dict(k_blocks=2) if sparse else {}
    interrupt_everywhere(lambda: filled(importance=recorded), lambda c: c.prefill(QP, **kw))


@pytest.mark.parametrize("recorded", [False, True], ids=["first", "more"])
def test_an_interrupted_add_importance_is_all_or_nothing(recorded):
    imp = np.random.default_rng(4).random(17, dtype=np.float32)
    interrupt_everywhere(lambda: filled(importance=recorded),
                         lambda c: c.add_importance(imp))


def test_an_interrupted_reset_is_all_or_nothing():
    interrupt_everywhere(filled, lambda c: c.reset())


def test_an_interrupted_read_leaves_the_cache_and_its_lock_as_they_were():
    """decode, a snapshot and copy change nothing; interrupted, they must
    not leave the lock held (the injector's checks), and the append after
    them works."""
    k, v = kv(1, seed=5)

    def read_then_append(c):
        c.decode(Q, block_size=BS, k_blocks=2)
        c.bounds
        c.copy()
        c.append(k, v)

    interrupt_everywhere(filled, read_then_append)


# ---------------------------------------------------------------- the handoff slot

def token_slot(cache, seed=6):
    """A slot holding one token as the transformers backend hands it over
    (SparseKVLayer._hold_token): pointers, owners, the length it goes at."""
    k, v = kv(1, seed=seed)
    return [(_ffi.ptr(k, "float"), k, _ffi.ptr(v, "float"), v, cache.seq_len)]


def test_an_interrupted_flush_of_the_handoff_slot_appends_the_token_once():
    """An interrupt anywhere in a flush leaves the token in the cache or in
    the slot, never neither, and the next flush completes it: the cache then
    holds it once."""
    ref = filled()
    slot = token_slot(ref)
    k, v = slot[0][1], slot[0][3]
    ref.append(k, v)
    want = gives(ref)

    def setup():
        c = filled()
        return [c], token_slot(c)

    def flush(state):
        append_pending(state[0][0], state[1])

    ref_state = setup()
    points = Interrupter()
    points.run(lambda: flush(ref_state))
    assert gives(ref_state[0][0]) == want and ref_state[1] == [None]
    for i in range(points.count):
        state = setup()
        with pytest.raises(KeyboardInterrupt):
            Interrupter(at=i).run(lambda: flush(state))
        cache, slot = state[0][0], state[1]
        assert lock_is_free(cache)
        assert slot[0] is not None or cache.seq_len == 22, f"point {i}: the token was dropped"
        flush(state)                                # what the layer's next read does
        assert slot == [None] and gives(cache) == want, f"point {i}: not appended once"


def test_a_flush_at_another_length_drops_the_token_and_a_refused_one_is_dropped():
    """A slot whose token is already in (the cache is one past its length)
    is emptied without appending; a token the C append refuses raises and
    is dropped, the cache unchanged."""
    cache = filled()
    slot = token_slot(cache)
    append_pending(cache, slot)
    assert cache.seq_len == 22 and slot == [None]
    before = gives(cache)
    stale = token_slot(cache)
    stale[0] = stale[0][:4] + (21,)
    append_pending(cache, stale)
    assert stale == [None] and gives(cache) == before
    bad = token_slot(cache)
    bad[0][1][0, 0, 5] = np.nan
    with pytest.raises(sa.SparseAttnError, match="k holds NaN"):
        append_pending(cache, bad)
    assert bad == [None] and gives(cache) == before


def test_an_interrupted_read_of_a_sparse_kv_layer_keeps_its_decode_step_token():
    """Through the transformers backend's layer: a q8 decode step's update
    hands its token over in the slot, with the cache's length it goes at;
    a read of the layer (``kv``) interrupted anywhere leaves it pending or
    appended, and the next read gives the cache holding it once."""
    torch = pytest.importorskip("torch")
    sat = pytest.importorskip("sparse_attn.integrations.transformers")
    prompt, token = (tuple(torch.from_numpy(a[None]) for a in kv(n, seed=seed))
                     for n, seed in ((21, 1), (1, 6)))
    want = sa.KVCache(HKV, D, capacity=64, block_size=BS, n_probe=4, copy_probe_rows=True)
    for k, v in (prompt, token):
        want.append(k[0].numpy(), v[0].numpy())
    want = gives(want)

    def setup():
        layer = sat.SparseKVLayer("q8", capacity=64, block_size=BS, n_probe=4,
                                  copy_probe_rows=True)
        layer.update(*prompt)
        layer.update(*token)
        assert layer._pending[0] is not None
        return layer

    points, layer = Interrupter(), setup()
    points.run(lambda: layer.kv)
    assert gives(layer.kv) == want and points.count >= 10
    for i in range(points.count):
        layer = setup()
        with pytest.raises(KeyboardInterrupt):
            Interrupter(at=i).run(lambda: layer.kv)
        # (no layer in an assert: pytest's repr of it would read it)
        kept = layer._pending[0] is not None or layer._kv.seq_len == 22
        assert kept, f"point {i}: the token was dropped"
        free = lock_is_free(layer._kv)
        assert free, f"point {i}: lock held"
        got = gives(layer.kv)
        assert got == want, f"point {i}"
    assert setup()._pending[0][4] == 21          # the token goes at row 21


# ---------------------------------------------------------------- the batch step

def batch(n_seq=3, grows=1):
    """n_seq caches of different lengths (sequence `grows` full, so its
    token grows it), their decoders and a token slot each."""
    caches = [filled(n=n, capacity=24 if i == grows else 64)
              for i, n in enumerate((21, 24, 9, 30)[:n_seq])]
    for i, c in enumerate(caches):
        if c.seq_len < 24 and i == grows:
            c.append(*kv(24 - c.seq_len, seed=7))
    decoders = [c.decoder(k_blocks=2, block_size=BS) for c in caches]
    slots = [token_slot(c, seed=10 + i) for i, c in enumerate(caches)]
    q = np.random.default_rng(8).standard_normal((len(caches), H, D), dtype=np.float32)
    out = np.zeros_like(q)
    return caches, (decoders, slots, q, out)


def step(state):
    decoders, slots, q, out = state[1]
    decode_rows(decoders, slots, _ffi.ptr(q, "float"), _ffi.out_ptr(out, "float"), H)


def test_an_interrupted_batch_step_loses_no_token():
    """An interrupt anywhere in a batch's decode step leaves every lock free
    and each cache before or after its token; flushing the slots (what the
    next read of the layers does) then gives the caches of the whole step."""
    ref = batch()
    step(ref)
    want = [gives(c) for c in ref[0]]
    assert all(s == [None] for s in ref[1][1])
    interrupt_everywhere(batch, step, at_least=50)
    points, fresh = Interrupter(), batch()
    points.run(lambda: step(fresh))
    for i in range(points.count):
        state = batch()
        with pytest.raises(KeyboardInterrupt):
            Interrupter(at=i).run(lambda: step(state))
        for c, slot in zip(state[0], state[1][1]):
            append_pending(c, slot)
        assert [gives(c) for c in state[0]] == want, f"point {i}: a token lost or doubled"


@pytest.mark.parametrize("bad", range(3))
@pytest.mark.parametrize("where", ["k", "v", "v_big"])
def test_a_refused_token_refuses_the_whole_batch_step_by_name(bad, where):
    """A token the C append would refuse (NaN, or a magnitude of 2**48) in
    sequence `bad` raises naming that sequence before any cache changes;
    the step's tokens are dropped, and the caches keep working."""
    state = batch()
    caches, (decoders, slots, q, out) = state
    before = [gives(c) for c in caches]
    pending = slots[bad][0]
    if where == "k":
        pending[1][1, 0, 3] = np.nan
    else:
        pending[3][0, 0, 7] = np.nan if where == "v" else 2.0 ** 48
    with pytest.raises(sa.ArgumentError, match=f"^sequence {bad} of the batch: {where[0]} holds"):
        step(state)
    assert [gives(c) for c in caches] == before
    assert all(s == [None] for s in slots)
    assert all(lock_is_free(c) for c in caches)


def test_a_refused_batch_step_interrupted_anywhere_drops_all_its_tokens_or_none():
    """A refusal drops the step's tokens all at once: an interrupt anywhere
    in a refused step leaves every cache unchanged and the slots all full
    (the step did not happen) or all empty (it was refused), never half."""
    def refused():
        state = batch()
        state[1][1][2][0][1][0, 0, 0] = np.nan         # sequence 2's K
        return state

    ref = refused()
    before = [gives(c) for c in ref[0]]
    points = Interrupter()
    with pytest.raises(sa.ArgumentError, match="^sequence 2 of the batch"):
        points.run(lambda: step(ref))
    for i in range(points.count):
        state = refused()
        with pytest.raises(KeyboardInterrupt):
            Interrupter(at=i).run(lambda: step(state))
        full = [s[0] is not None for s in state[1][1]]
        assert all(full) or not any(full), f"point {i}: slots {full}"
        assert all(lock_is_free(c) for c in state[0]), f"point {i}"
        assert [gives(c) for c in state[0]] == before, f"point {i}"


def test_a_batch_step_that_cannot_grow_a_cache_changes_none(monkeypatch):
    """The growth of a full cache is made before any cache changes: when it
    fails for want of memory the error names the sequence and no cache
    changed."""
    state = batch(grows=2)
    caches = state[0]
    before = [gives(c) for c in caches]

    def no_memory(*args, **kw):
        raise MemoryError("injected")

    monkeypatch.setattr(_storage, "zeros", no_memory)
    with pytest.raises(MemoryError, match="^sequence 2 of the batch: injected"):
        step(state)
    monkeypatch.undo()
    assert [gives(c) for c in caches] == before


def test_an_empty_cache_refuses_the_batch_step_by_name():
    state = batch()
    caches, (decoders, slots, q, out) = state
    empty = sa.KVCache(HKV, D, capacity=8, block_size=BS)
    decoders[1] = empty.decoder(k_blocks=2, block_size=BS)
    slots[1] = [None]
    before = [gives(c) for c in caches]
    with pytest.raises(sa.ArgumentError, match="^sequence 1 of the batch: its cache is empty"):
        step(state)
    assert [gives(c) for c in caches] == before


# ---------------------------------------------------------------- real signals

def test_real_sigints_during_a_long_append():
    """A thread sends SIGINT to the main thread at varying delays while it
    appends a long prompt (8 KV heads x 16K tokens x 128: the C call takes
    most of the append), into a cache that holds it and into one that must
    grow; whatever the delay, the cache is consistent: its lock free, it
    gives the empty cache's answers or the full one's, and it takes the
    next append."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    hkv, T, d = 8, 16384, 128
    x = np.random.default_rng(11).standard_normal((hkv, T, d), dtype=np.float32)
    q = np.random.default_rng(12).standard_normal((2 * hkv, d), dtype=np.float32)
    main = threading.get_ident()

    def answers(c):
        if not c.seq_len:
            return [0]
        return [c.seq_len, c.decode(q, k_blocks=4).tobytes(),
                c.decode(q, k_blocks=4, policy="fast").tobytes(),
                c.dense_decode(q).tobytes()]

    for capacity in (T, 64):                # in place; grown (a new allocation swapped in)
        ref = sa.KVCache(hkv, d, capacity=capacity, block_size=32)
        t0 = time.perf_counter()
        ref.append(x, x)
        took = time.perf_counter() - t0
        full, empty = answers(ref), [0]
        inside = 0                          # trials interrupted inside the append
        for trial in range(10):
            delay = took * trial / 8        # from at once to past the end
            cache = sa.KVCache(hkv, d, capacity=capacity, block_size=32)
            sender = threading.Thread(target=lambda: (time.sleep(delay),
                                                      signal.pthread_kill(main, signal.SIGINT)))
            returned = False
            try:
                sender.start()
                cache.append(x, x)
                returned = True
                sender.join()
                time.sleep(0.05)            # the signal is raised here if not before
            except KeyboardInterrupt:
                inside += not returned
            sender.join()
            where = f"capacity {capacity}, trial {trial} (delay {delay:.3f} s)"
            assert lock_is_free(cache), f"{where}: lock held"
            got = answers(cache)
            assert got in (empty, full), f"{where}: the cache is neither empty nor full"
            cache.append(x[:, :1], x[:, :1])
            assert cache.seq_len == got[0] + 1, where
        # the C call is most of the append and holds no GIL, so the signal
        # lands there (raised when it returns: in place, the window of defect 6)
        assert inside, f"capacity {capacity}: no signal landed inside the append"

"""KVCache.decoder's prepared decode call, and the transformers backend's
zero-copy appends and batched decode step (package-internal)."""
from itertools import repeat
from operator import methodcaller, setitem
from threading import get_ident

import numpy as np

from . import _ffi, _storage
from ._ffi import ffi, lib
from ._operands import query
from .attention import batch_call
from .errors import ArgumentError, SparseAttnError


class Decoder:
    """KVCache.decoder's prepared call (package-internal: the transformers
    backend checks for it and calls call_at / append_call_at).  What
    depends on the cache's buffers (the selection struct, the importance
    pointer) is made once per buffer set; a call checks the query against
    the first call's, takes the read lock, and makes one C call."""

    __slots__ = ("cache", "sel", "scale", "threads", "dense", "return_blocks", "buf", "params",
                 "imp", "qshape", "slow")

    def __init__(self, cache, sel, scale, threads, dense, return_blocks):
        self.cache, self.sel, self.scale, self.threads = cache, sel, scale, threads
        self.dense, self.return_blocks = dense, return_blocks
        self.buf = self.qshape = None
        # minmax at another block size than the cache's needs bounds made
        # per call: the general path
        # (or channel scoring without the cache's copy at its block size)
        self.slow = not dense and (
            (sel.scoring == "minmax" and sel.block_size != cache.block_size) or
            (sel.scoring == "channels" and
             _storage.own_metadata(cache, sel, 1, 1, None, None) is None))

    def _bind(self, buf):
        c, sel = self.cache, self.sel
        kind = None if self.dense else _storage.own_metadata(c, sel, 1, 1, None, None)
        self.params = None if self.dense else sel.params(*_storage.own_structs(buf, kind))
        self.imp = _ffi.ptr(buf.importance, "float")
        self.buf = buf

    def __call__(self, q):
        c = self.cache
        if self.slow:
            kw = dict(k_blocks=self.sel.k_blocks, block_size=self.sel.block_size,
                      n_probe=self.sel.n_probe, recency=self.sel.recency,
                      importance_fraction=self.sel.importance_fraction,
                      sink_blocks=self.sel.sink_blocks, share=self.sel.share,
                      scoring=self.sel.scoring, n_channels=self.sel.n_channels)
            return c.decode(q, scale=self.scale, threads=self.threads,
                            return_blocks=self.return_blocks, **kw)
        if not (type(q) is np.ndarray and q.shape == self.qshape and q.dtype == np.float32
                and q.flags.c_contiguous and q.flags.aligned):
            q, _ = query(q, c._buf.kop, 2)     # the layout does not change with the buffers
            self.qshape = q.shape
        out = np.empty(q.shape, np.float32)
        blocks = self._run(ffi.from_buffer("float[]", q), q.shape[0],
                           ffi.from_buffer("float[]", out))
        return (out, blocks) if self.return_blocks and not self.dense else out

    def call_at(self, qp, n_heads, outp):
        """__call__ with cffi pointers to a float32 ``[n_heads, head_dim]``
        query and output that the caller checked and keeps alive (n_heads a
        multiple of the cache's KV heads); returns the blocks array of
        return_blocks, else None.  Not for a decoder whose selection makes
        its metadata per call (``slow``)."""
        return self._run(qp, n_heads, outp)

    def append_call_at(self, slot, qp, n_heads, outp):
        """call_at after appending the token a handoff slot holds (as
        KVCache._append_pending takes it; an empty slot appends nothing),
        both under one hold of the cache's write lock, so no other thread
        sees the cache between the two.  The transformers backend's decode
        step on a q8 SparseKVCache: the token its update handed over, then
        the attention, in one lock and two C calls."""
        c = self.cache
        lock, me = c._lock, get_ident()
        try:
            lock.acquire_write(me)
            c._append_pending_locked(slot)
            return self._run_locked(qp, n_heads, outp)
        finally:
            lock.release_write(me)

    def _run(self, qp, n_heads, outp):
        lock, me = self.cache._lock, get_ident()
        try:
            lock.acquire_read(me)
            return self._run_locked(qp, n_heads, outp)
        finally:
            lock.release_read(me)

    def _run_locked(self, qp, n_heads, outp):
        c = self.cache
        buf = c._buf
        n = buf.bounds_st.k_rows
        if n == 0:
            raise ArgumentError("the cache is empty: append tokens before decoding")
        if buf is not self.buf:
            self._bind(buf)
        if self.dense:
            rc = lib.sa_dense_decode(qp, n_heads, buf.kop.struct, buf.vop.struct, n,
                                     self.scale, outp, self.threads)
            _ffi.check(rc, "dense_decode")
            return None
        blocks = np.empty((n_heads, self.sel.n_selected(n)), np.int32) \
            if self.return_blocks else None
        has = c._has_importance
        if has is None:
            has = c._recorded(buf, n)
        rc = lib.sa_sparse_decode(
            qp, n_heads, buf.kop.struct, buf.vop.struct, n, self.params,
            self.imp if has else ffi.NULL, n, self.scale, outp,
            ffi.from_buffer("int32_t[]", blocks) if blocks is not None else ffi.NULL,
            self.threads)
        _ffi.check(rc, "sparse_decode")
        return blocks


# The transformers backend's zero-copy appends (package-internal), under the write lock.

def append_at(cache, kp, vp, T):
    """Append T rows of float32 K and V at the cffi pointers kp, vp (laid
    out [n_kv_heads, T, head_dim]; the caller keeps them alive)."""
    cache._append_at(kp, vp, T)


def append_pending(cache, slot):
    """Append the one token a backend layer parked in `slot` (see
    KVCache._append_pending), if any."""
    cache._append_pending(slot)


def decode_rows(decoders, slots, qp, outp, n_heads):
    """The transformers backend's decode step of a batch (package-internal):
    sequence i's prepared decoder (on its own cache; none ``slow``) appends
    the token ``slots[i]`` holds, then attends its query (``n_heads`` rows
    of float32 at ``qp``, sequence after sequence) into ``outp`` (the same
    layout), every sequence in one C call (``sa_decode_batch``: the
    sequences' KV heads and chunks split over the threads together; each
    sequence's output bitwise what its own call gives), on the first
    decoder's threads.  The caches' write locks are held throughout, taken
    in one order (by id) so two threads never wait on each other; no other
    thread sees a cache between its append and its attention.

    Every sequence is checked (its token's values as the C append checks
    them, its cache not empty) and every growth allocated before any cache
    changes: a refusal raises naming the sequence, changes no cache and
    drops every token of the step.  An interrupt can land between two
    caches' appends (each its own commit); the tokens not yet in stay in
    their slots, which the next read of those layers appends."""
    caches = [d.cache for d in decoders]
    locks = [caches[i]._lock for i in sorted(range(len(caches)), key=lambda i: id(caches[i]))]
    me = get_ident()
    # Every lock's release, and every slot's emptying, each run by one C call
    # (any() consuming a map made here): no point between two of them where
    # an interrupt could leave a lock held or half the slots full.
    releases = map(methodcaller("release_write", me), locks)
    drops = map(setitem, slots, repeat(0), repeat(None))
    try:
        for lock in locks:
            lock.acquire_write(me)
        try:
            plans = [_checked(i, c, slot) for i, (c, slot) in enumerate(zip(caches, slots))]
        except Exception:       # refused (or no memory to grow): the step's tokens dropped
            any(drops)
            raise
        calls = []
        step = n_heads * caches[0].head_dim
        for i, (d, c, slot, plan) in enumerate(zip(decoders, caches, slots, plans)):
            _pending_commit(c, slot, plan)
            buf = c._buf
            n = buf.bounds_st.k_rows
            if buf is not d.buf:
                d._bind(buf)
            has = c._has_importance
            if has is None:
                has = c._recorded(buf, n)
            calls.append((qp + i * step, n_heads, buf.kop, buf.vop, n,
                          None if d.dense else d.params,
                          buf.importance[:n] if has else None, d.scale,
                          outp + i * step))
        batch_call(calls, decoders[0].threads)
    finally:
        any(releases)


def _checked(i, cache, slot):
    """Sequence i's _pending_plan, its cache checked not to be empty
    after it; what is refused is refused naming the sequence."""
    try:
        plan = _pending_plan(cache, slot)
        if plan is None and cache.seq_len == 0:
            raise ArgumentError("its cache is empty: append tokens before decoding")
        return plan
    except (SparseAttnError, MemoryError) as e:
        raise type(e)(f"sequence {i} of the batch: {e}") from e


def _pending_plan(cache, slot):
    """The first half of KVCache._append_pending_locked, for a batch that
    checks every sequence before it changes any (decode_rows): the
    arguments of the KVCache._append_into that appends the slot's token,
    checked as the C append checks them and with any growth made, or None
    when there is nothing to append; the cache and the slot unchanged.
    Raises what the append would.  The caller holds the write lock."""
    pending = slot[0]
    if pending is None or cache._buf.bounds_st.k_rows != pending[4]:
        return None
    buf, n = cache._append_target(1)
    plan = (buf, n, pending[0], pending[2], 1)
    _ffi.check(lib.sa_kv_append_check(*cache._append_args(*plan)), "KVCache.append")
    return plan


def _pending_commit(cache, slot, plan):
    """The second half: append what _pending_plan planned (it cannot be
    refused), then empty the slot."""
    if plan is not None:
        cache._append_into(*plan)
    slot[0] = None

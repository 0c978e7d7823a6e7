"""A growing per-layer KV cache in the layout the kernels read directly."""
from threading import get_ident

import numpy as np

from . import _checks as ck, _storage
from . import _ffi
from .errors import ArgumentError
from ._ffi import ffi, lib
from ._operands import importance_array, query, scale_value
from ._rwlock import RWLock
from .attention import dense_call, metadata_structs, prefill_call, sparse_call
from .metadata import default_scale_group
from .decoder import Decoder
from .q8 import Q8
from .selection import CACHE_POLICY, n_probe_value, selection

DTYPES = ("q8", "float32")

# decode()'s importance default: the cache's record.
_RECORDED = object()


class KVCache:
    """K and V of one layer, ``[n_kv_heads, capacity, head_dim]``, head-major.

    Appending quantises in C (q8) or copies (float32) into the next rows,
    growing the buffers by doubling when they are full.  ``k``/``v`` are
    zero-copy views of the valid rows that every function of the package
    accepts; ``importance`` accumulates what :meth:`prefill` (or
    :meth:`add_importance`) records, for the decode step's reserve.

    Thread safety: any number of threads may call :meth:`decode` (and read
    the properties) at once; :meth:`append`, :meth:`prefill`,
    :meth:`add_importance`, :meth:`truncate` and :meth:`reset` take the
    cache's lock exclusively, so a decode sees the cache either before or
    after an append, never half of one.  Each call reads the cache's state
    once.

    Every update (:meth:`append`, :meth:`truncate`, :meth:`reset`,
    :meth:`prefill`'s importance, :meth:`add_importance`) is all or
    nothing, interrupts included (docs/spec.md §5): one that is refused
    (bad values) or fails (no memory to grow) changes nothing, and a
    ``KeyboardInterrupt`` (Ctrl-C) during one leaves the cache as it was
    before the call or as it is after it, never between, with its lock
    free.  The cache's length lives in C memory that the C call of an
    append or truncation writes, so that call is the commit; an append
    that grows the cache fills new buffers and swaps them in with one
    store.  A cache pickles (and deep-copies) with all it holds, as stored.

    ``importance``, ``bounds``, ``channels`` and ``probe_rows`` are copies,
    made when read: snapshots of the cache at that moment that nothing the
    cache does later changes (the bounds and channel copy of a partial last
    block are rewritten in place by the next append into it).  ``k`` and
    ``v`` are views of the cache's memory (no copy: a model reads them every
    step): an append never rewrites their rows, but :meth:`truncate`
    followed by an append does, from the truncation point on; copy them to
    keep them across a truncation.  K, V, the key bounds and the copies of
    one capacity share one allocation (for transparent huge pages), so a
    view of K or V taken before the cache grew keeps all of that capacity's
    memory.

    Parameters
    ----------
    n_kv_heads, head_dim : int
    capacity : int, default 4096; rows allocated up front (grows as needed)
    dtype : ``"q8"`` (default) or ``"float32"``
    group_size : int, default 32; q8 only, must divide head_dim
    block_size : int, default 32; the blocks whose key bounds (for
        ``scoring="minmax"``) and probe-row copies the cache keeps up to date
    n_probe : int or ``"all"``, default 8; the probe the copies serve
    copy_probe_rows : bool, default False; keep copies of the rows the probe
        samples (:class:`ProbeRows`): decode with ``scoring="probe"``
        (``policy="seed"``) at this block_size and n_probe then reads a
        quarter of K for the probe instead of all of it (same bits), for a
        quarter of K's memory.  None are kept when ``n_probe >= block_size``
    copy_channels : bool, default True; keep the channel-major copy of K
        that ``scoring="channels"`` (``policy="balanced"``, :meth:`decode`'s
        default) reads: ``head_dim * (block_size + 4)`` bytes per block and
        KV head, about q8 K's size.  Without it such a decode copies all of K
        per call; turn it off when memory is tighter than recall and decode
        with ``policy="seed"`` (with ``copy_probe_rows=True``) or ``"fast"``

    Examples
    --------
    >>> import numpy as np, sparse_attn
    >>> rng = np.random.default_rng(0)
    >>> cache = sparse_attn.KVCache(2, 64, capacity=64)
    >>> kv = rng.standard_normal((2, 100, 64), dtype=np.float32)
    >>> cache.append(kv, kv)
    >>> cache.seq_len, cache.capacity >= 100, cache.k.shape
    (100, True, (2, 100, 64))
    >>> out = cache.prefill(rng.standard_normal((4, 100, 64), dtype=np.float32))
    >>> cache.decode(rng.standard_normal((4, 64), dtype=np.float32), k_blocks=2).shape
    (4, 64)
    """

    def __init__(self, n_kv_heads, head_dim, *, capacity=4096, dtype="q8", group_size=32,
                 block_size=32, n_probe=8, copy_probe_rows=False, copy_channels=True):
        self.n_kv_heads = ck.check_int("n_kv_heads", n_kv_heads, minimum=1)
        self.head_dim = ck.check_int("head_dim", head_dim, minimum=1)
        capacity = ck.check_int("capacity", capacity, minimum=1)
        self.dtype = ck.check_choice("dtype", dtype, DTYPES)
        if dtype == "q8":
            self.group_size = ck.check_int("group_size", group_size, minimum=1)
            if head_dim % self.group_size:
                raise ArgumentError(f"group_size ({self.group_size}) must divide head_dim "
                                    f"({head_dim})")
        else:
            self.group_size = None
        self.block_size = ck.check_int("block_size", block_size, minimum=1)
        self.n_probe = n_probe_value(n_probe, self.block_size)
        # A probe of every row (n_probe >= block_size) reads K itself.
        self.copy_probe_rows = ck.check_bool("copy_probe_rows", copy_probe_rows) and \
            self.n_probe < self.block_size
        self.copy_channels = ck.check_bool("copy_channels", copy_channels)
        self.scale_group = default_scale_group(self.group_size, self.head_dim)
        self._lock = RWLock()
        # whether the importance record holds a nonzero entry; None while an
        # update of the record is under way, or was interrupted: then
        # _recorded() finds out from the record
        self._has_importance = False
        # Everything the cache holds, its length included (the bounds'
        # k_rows: C memory that the C call of an append or truncation
        # writes), so that the call returning is the update's commit.
        self._buf = _storage.allocate(self, capacity)

    @property
    def seq_len(self):
        """The number of valid tokens."""
        return self._buf.bounds_st.k_rows

    @property
    def capacity(self):
        return self._buf.capacity

    @staticmethod
    def _view(t, n):
        if isinstance(t, Q8):
            return Q8._wrap(t.data[:, :n], t.scales[:, :n], t.group_size)
        return t[:, :n]

    @property
    def k(self):
        """The valid keys, ``[n_kv_heads, seq_len, head_dim]`` (a view: see
        the class docstring on truncation)."""
        buf = self._buf
        return self._view(buf.k, buf.bounds_st.k_rows)

    @property
    def v(self):
        """The valid values, ``[n_kv_heads, seq_len, head_dim]`` (a view: see
        the class docstring on truncation)."""
        buf = self._buf
        return self._view(buf.v, buf.bounds_st.k_rows)

    # The properties below copy under the read lock: an append, prefill or
    # truncate running in another thread writes these arrays in place.

    @property
    def importance(self):
        """float32 ``[seq_len]``: the importance recorded so far (a copy)."""
        return self._snapshot(lambda buf, n, cache: buf.importance[:n].copy())

    def _snapshot(self, take):
        """take(buffers, n, cache) under the read lock: an append, prefill or
        truncate in another thread writes the arrays in place."""
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_read(me)
            buf = self._buf
            return take(buf, buf.bounds_st.k_rows, self)
        finally:
            lock.release_read(me)

    def _recorded(self, buf, n):
        """Whether the importance record of the n tokens of buf (the
        cache's) holds a nonzero entry: the flag, or, when an interrupted
        update left it unknown, the record's answer (kept).  Under the lock."""
        has = self._has_importance
        if has is None:
            has = self._has_importance = bool(buf.importance[:n].any())
        return has

    @property
    def bounds(self):
        """The per-block key bounds of the valid rows (:class:`BlockBounds`,
        a copy), kept up to date by :meth:`append`, for ``scoring="minmax"``."""
        return self._snapshot(_storage.bounds_snapshot)

    @property
    def channels(self):
        """The channel-major copy of the valid rows (:class:`ChannelCopy`,
        copied from the one :meth:`append` keeps up to date) for
        ``scoring="channels"``, or None without ``copy_channels=True``."""
        return self._snapshot(_storage.channels_snapshot)

    @property
    def probe_rows(self):
        """The copies of the probe's rows (:class:`ProbeRows`, a copy of
        those of the valid rows' full blocks), or None with
        ``copy_probe_rows=False``."""
        return self._snapshot(_storage.probe_rows_snapshot)

    @property
    def nbytes(self):
        """Bytes held by K and V at the current capacity."""
        buf = self._buf
        return buf.k.nbytes + buf.v.nbytes

    @property
    def metadata_nbytes(self):
        """Bytes held at the current capacity by what selection reads beside
        K and V: the key bounds, the probe-row copies and the channel copy."""
        return _storage.metadata_nbytes(self._buf)

    # ----------------------------------------------------------------- updates
    def append(self, k, v):
        """Append T tokens: ``k``, ``v`` float32 ``[n_kv_heads, T, head_dim]``
        (any strides), finite with magnitudes below 2**48 (checked before
        anything is written: a refused append changes nothing)."""
        want = f"[{self.n_kv_heads}, T, {self.head_dim}]"
        arrays = []
        for name, a in (("k", k), ("v", v)):
            a = ck.as_array(name, a, dtype=np.float32, ndim=3, allow_empty=True)
            if a.shape[0] != self.n_kv_heads or a.shape[2] != self.head_dim:
                raise ArgumentError(f"{name} must have shape {want}, got {a.shape}")
            arrays.append(a)
        k, v = arrays
        if k.shape[1] != v.shape[1]:
            raise ArgumentError(f"k and v must append the same number of tokens, got "
                                f"{k.shape[1]} and {v.shape[1]}")
        self._append_arrays(k, v)

    def _append_arrays(self, k, v):
        """append() after its checks: k and v float32 C-contiguous aligned
        ``[n_kv_heads, T, head_dim]`` of one T (the C call scans the values)."""
        self._append_at(_ffi.ptr(k, "float"), _ffi.ptr(v, "float"), k.shape[1])

    def _append_at(self, kp, vp, T):
        """_append_arrays with cffi pointers to T rows of K and V in that
        layout, kept alive by the caller (the transformers backend passes
        torch tensors' data this way)."""
        if T == 0:
            return
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            self._append_locked(kp, vp, T)
        finally:
            lock.release_write(me)

    # The transformers backend hands a decode step's token over in a slot, a
    # one-item list: slot[0] is None or (a cffi pointer to float32
    # [n_kv_heads, 1, head_dim] K rows, what keeps them alive, the same two
    # for V, the cache's length the token goes at).  Appending it is
    # idempotent: it goes in only while the cache's length is that, and the
    # slot is emptied after, so an interrupt between the two leaves a token
    # that the next flush finds in the cache and drops.

    def _append_pending(self, slot):
        """Append the token a handoff slot holds, if any, under the write
        lock: of threads that race to append it, one does."""
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            self._append_pending_locked(slot)
        finally:
            lock.release_write(me)

    def _append_pending_locked(self, slot):
        """_append_pending's work, the write lock held by the caller.  A
        token refused for its values (or for want of memory) is dropped, as
        it could never go in; an interrupt leaves it in the slot."""
        pending = slot[0]               # keeps the rows alive through the append
        if pending is None:
            return
        if self._buf.bounds_st.k_rows == pending[4]:
            try:
                self._append_locked(pending[0], pending[2], 1)
            except Exception:
                slot[0] = None
                raise
        slot[0] = None      # appended now or before (or the cache was cut back past it)

    def _append_locked(self, kp, vp, T):
        """_append_at's work, the write lock held by the caller."""
        buf, n = self._append_target(T)
        self._append_into(buf, n, kp, vp, T)

    def _append_target(self, T):
        """(the buffers an append of T rows writes, the cache's length): the
        cache's own, or, when they are full, a grown copy that is not yet
        the cache's.  Everything an append does that can fail for want of
        memory, done before it changes anything."""
        buf = self._buf
        n = buf.bounds_st.k_rows
        if n + T > ck.INT_MAX:
            raise ArgumentError(f"the cache would hold {n + T} rows; at most "
                                f"{ck.INT_MAX} are supported")
        if n + T > buf.capacity:
            buf = _storage.allocate(self, min(max(n + T, 2 * buf.capacity), ck.INT_MAX), buf, n,
                                   n + T)
        elif not buf.advised:
            _storage.advise(buf, n + T)
        return buf, n

    @staticmethod
    def _append_args(buf, n, kp, vp, T):
        return (buf.kop.struct, buf.vop.struct, n, kp, vp, T, buf.bounds_st,
                buf.probe_st if buf.probe_st is not None else ffi.NULL,
                buf.channels_st if buf.channels_st is not None else ffi.NULL)

    def _append_into(self, buf, n, kp, vp, T):
        """Write T rows at row n of buf (_append_target's) and make buf the
        cache's.  Into the cache's own buffers the C call is the commit;
        into grown ones the store of buf is (one store: an interrupt before
        it leaves the cache as it was, its old buffers untouched)."""
        _ffi.check(lib.sa_kv_append(*self._append_args(buf, n, kp, vp, T)), "KVCache.append")
        self._buf = buf

    def add_importance(self, importance):
        """Add per-token importance (float32 ``[m <= seq_len]``, any strides,
        finite) to the record.  An add after which an entry would overflow
        float32 is refused and changes nothing: the record stays finite, as
        every decode that reads it requires (spec §3)."""
        importance = ck.as_array("importance", importance, dtype=np.float32, ndim=1,
                                 allow_empty=True)
        if not np.isfinite(importance).all():
            raise ArgumentError("importance holds NaN or Inf values")
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            buf = self._buf
            n, m = buf.bounds_st.k_rows, importance.shape[0]
            if m > n:
                raise ArgumentError(f"importance has {m} entries, more than the cache's "
                                    f"seq_len ({n})")
            record = buf.importance[:m]
            with np.errstate(over="ignore"):
                total = record + importance
            if not np.isfinite(total).all():
                at = int(np.argmin(np.isfinite(total)))
                raise ArgumentError(
                    f"importance would overflow the recorded importance at token {at} "
                    f"({record[at]:.4g} + {importance[at]:.4g} is beyond float32); the "
                    f"record is unchanged")
            self._has_importance = None         # unknown until the record is written
            record[:] = total                   # one C copy: the commit
            self._has_importance = bool(buf.importance[:n].any())
        finally:
            lock.release_write(me)

    def truncate(self, seq_len):
        """Keep the first ``seq_len`` tokens (roll back appended tokens).  The
        importance the kept tokens received stays as recorded (including what
        prefill queries of removed tokens gave them); removed tokens' entries
        are cleared and the bounds (and channel copy) of a now partial last
        block recomputed."""
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            buf = self._buf
            seq_len = ck.check_int("seq_len", seq_len, minimum=0,
                                   maximum=buf.bounds_st.k_rows)
            self._cut(buf, seq_len, "KVCache.truncate")
            self._has_importance = bool(buf.importance[:seq_len].any())
        finally:
            lock.release_write(me)

    def _cut(self, buf, seq_len, what):
        """Keep the first seq_len rows of buf (the cache's): one C call,
        which is the commit (the importance flag unknown across it)."""
        self._has_importance = None
        _ffi.check(lib.sa_kv_truncate(
            buf.kop.struct, seq_len, buf.bounds_st,
            buf.probe_st if buf.probe_st is not None else ffi.NULL,
            buf.channels_st if buf.channels_st is not None else ffi.NULL,
            _ffi.out_ptr(buf.importance, "float"), buf.importance.shape[0]), what)

    def copy(self):
        """An independent cache holding the same tokens: K and V as stored
        (q8 data and scales copied, not quantised again), the importance
        record, the key bounds and the copies, at the same capacity.  What
        beam search does to a sequence's cache when two beams continue it."""
        new = object.__new__(KVCache)
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_read(me)
            new.__dict__.update({k: v for k, v in self.__dict__.items()
                                 if k not in ("_lock", "_buf")})
            new._lock = RWLock()
            buf = self._buf
            n = buf.bounds_st.k_rows
            new._buf = _storage.allocate(new, buf.capacity, buf, n, n)
        finally:
            lock.release_read(me)
        return new

    def __reduce__(self):
        """Pickling (and ``copy.deepcopy``): the valid rows of K and V as
        stored, their importance, key bounds, channel and probe copies, and
        the settings; unpickled, a cache of the same capacity that decodes
        bitwise as this one did (nothing quantised or computed again)."""
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_read(me)
            settings = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_buf")}
            return (_unpickled_cache, (settings, *_storage.held(self, self._buf)))
        finally:
            lock.release_read(me)

    def reset(self):
        """Forget every token (keeps the allocation)."""
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            self._cut(self._buf, 0, "KVCache.reset")
            self._has_importance = False
        finally:
            lock.release_write(me)

    # ----------------------------------------------------------------- attention
    def prefill(self, q, *, k_blocks=None, block_size=None, n_probe=None, recency=True,
                policy=CACHE_POLICY, importance_fraction=None, sink_blocks=None, share=None,
                scoring=None, n_channels=None, exact_tail=0, scale=None, threads=None):
        """Causal prefill of the last T appended tokens' queries
        (``q`` float32 ``[H, T, head_dim]``); adds their importance to the
        cache's record.  Returns the attention output ``[H, T, head_dim]``.

        ``k_blocks=None`` is exact prefill; with ``k_blocks`` it is sparse
        prefill (:func:`sparse_attn.prefill`, same knobs, but
        ``policy="balanced"`` by default as in :meth:`decode`) over the cache,
        its importance reserve reading the importance recorded by earlier
        prefills, its selection the cache's key bounds (``"minmax"``) or
        probe-row copies (``"probe"``) when ``block_size`` (default: the
        cache's) and ``n_probe`` are the cache's.  ``exact_tail`` as in
        :func:`sparse_attn.prefill` (the blocks of this call's last rows
        exact; give it to the call that ends the prompt)."""
        scale = scale_value(scale, self.head_dim)
        threads = ck.check_threads(threads)
        exact_tail = ck.check_int("exact_tail", exact_tail, minimum=0)
        sel = None
        if k_blocks is not None:
            sel = self._selection(policy, k_blocks, block_size, n_probe, recency,
                                  importance_fraction, sink_blocks, share, scoring, n_channels)
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_write(me)
            buf = self._buf
            n = buf.bounds_st.k_rows
            q, n_heads = query(q, buf.kop, 3)
            T = q.shape[1]
            if T > n:
                raise ArgumentError(f"q has {T} query tokens but the cache holds only "
                                    f"{n}; append their K/V first")
            params = prior = keep = None
            if sel is not None:
                kind, bst, pst = _storage.own_kind_structs(self, buf, sel, n, n)
                if not kind and sel.scoring in ("minmax", "channels"):
                    bst, pst, keep = metadata_structs(sel, self._view(buf.k, n), buf.kop, n,
                                                      None, None)
                params = sel.params(bst, pst, exact_tail)
                prior = buf.importance if self._recorded(buf, n) else None
            out, imp = prefill_call(q, n_heads, buf.kop, buf.vop, n - T, params, prior, scale,
                                    threads)
            del keep
            self._has_importance = None         # unknown until the record is written
            buf.importance[:n] += imp           # one C add: the commit
            self._has_importance = bool(buf.importance[:n].any())
            return out
        finally:
            lock.release_write(me)

    def decode(self, q, *, seq_len=None, k_blocks=32, block_size=None, n_probe=None,
               importance=_RECORDED, recency=True, scale=None, policy=CACHE_POLICY,
               importance_fraction=None, sink_blocks=None, share=None, scoring=None,
               n_channels=None, bounds=None, probe_rows=None, channels=None, threads=None,
               return_blocks=False):
        """:func:`sparse_attn.sparse_decode` over the cache (same arguments,
        but ``policy="balanced"`` by default, read from the channel copy the
        cache keeps; the plain function's default is ``"seed"``, which needs
        no copy), with its recorded importance unless ``importance=`` is given
        (``None``: no reserve), its key bounds for ``scoring="minmax"`` and
        its probe-row copies for ``scoring="probe"`` when ``block_size``
        (default: the cache's) and ``n_probe`` are the cache's and
        ``seq_len`` is the cache's."""
        sel = self._selection(policy, k_blocks, block_size, n_probe, recency,
                              importance_fraction, sink_blocks, share, scoring, n_channels)
        scale = scale_value(scale, self.head_dim)
        threads = ck.check_threads(threads)
        return_blocks = ck.check_bool("return_blocks", return_blocks)
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_read(me)
            buf = self._buf                     # one snapshot of the state
            n = buf.bounds_st.k_rows
            if n == 0:
                raise ArgumentError("the cache is empty: append tokens before decoding")
            seq = n if seq_len is None else ck.check_int("seq_len", seq_len, minimum=1,
                                                         maximum=n)
            q, n_heads = query(q, buf.kop, 2)
            if importance is _RECORDED:
                imp = buf.importance if self._recorded(buf, n) else None
            else:
                imp = importance_array(importance, seq)
            keep = None
            kind, bst, pst = _storage.own_kind_structs(self, buf, sel, seq, n, bounds, probe_rows,
                                                       channels)
            if not kind and (sel.scoring in ("minmax", "channels")
                             or any(x is not None for x in (bounds, probe_rows, channels))):
                bst, pst, keep = metadata_structs(sel, self._view(buf.k, seq), buf.kop, seq,
                                                  bounds, probe_rows, channels)
            result = sparse_call(q, n_heads, buf.kop, buf.vop, seq, sel, imp, bst, pst, scale,
                                 threads, return_blocks)
            del keep
            return result
        finally:
            lock.release_read(me)

    def decoder(self, *, k_blocks=32, block_size=None, n_probe=None, recency=True,
                policy=CACHE_POLICY, importance_fraction=None, sink_blocks=None, share=None,
                scoring=None, n_channels=None, scale=None, threads=None, dense=False,
                return_blocks=False):
        """A decode call prepared for these settings (those of :meth:`decode`;
        ``dense=True`` for exact attention): calling it with ``q`` (float32
        ``[H, head_dim]``) gives bitwise what :meth:`decode` (or
        :func:`sparse_attn.dense_decode` over the cache) gives, with the
        cache's recorded importance, with the per-call work cut to the query,
        the output and one C call.  This is what a model's per-layer,
        per-token loop wants (the transformers backend uses it).  It follows
        the cache through appends and growth."""
        sel = self._selection(policy, k_blocks, block_size, n_probe, recency,
                              importance_fraction, sink_blocks, share, scoring, n_channels)
        return Decoder(self, sel, scale_value(scale, self.head_dim),
                        ck.check_threads(threads), ck.check_bool("dense", dense),
                        ck.check_bool("return_blocks", return_blocks))

    def dense_decode(self, q, *, scale=None, threads=None):
        """Exact attention of ``q`` over the cache (:func:`sparse_attn.dense_decode`)."""
        scale = scale_value(scale, self.head_dim)
        threads = ck.check_threads(threads)
        lock, me = self._lock, get_ident()
        try:
            lock.acquire_read(me)
            buf = self._buf
            n = buf.bounds_st.k_rows
            if n == 0:
                raise ArgumentError("the cache is empty: append tokens before decoding")
            q, n_heads = query(q, buf.kop, 2)
            return dense_call(q, n_heads, buf.kop, buf.vop, n, scale, threads)
        finally:
            lock.release_read(me)

    def _selection(self, policy, k_blocks, block_size, n_probe, recency, importance_fraction,
                   sink_blocks, share, scoring, n_channels):
        return selection(policy, k_blocks=k_blocks,
                         block_size=self.block_size if block_size is None else block_size,
                         n_probe=n_probe, recency=recency, importance_fraction=importance_fraction,
                         sink_blocks=sink_blocks, share=share, scoring=scoring,
                         n_channels=n_channels)

    def metadata_for(self, *, seq_len=None, k_blocks=32, block_size=None, n_probe=None,
                     policy=CACHE_POLICY, scoring=None, n_channels=None, bounds=None,
                     probe_rows=None, channels=None, **knobs):
        """Which of its own metadata :meth:`decode` with these arguments
        reads: ``"bounds"`` (its key bounds), ``"channels"`` (its channel
        copy), ``"probe_rows"`` (its probe-row copies) or None (the
        caller's, or none: K is probed, or the bounds or channel copy are
        made for the call)."""
        sel = selection(policy, k_blocks=k_blocks,
                        block_size=self.block_size if block_size is None else block_size,
                        n_probe=n_probe, scoring=scoring, n_channels=n_channels,
                        **{k: v for k, v in knobs.items() if k in
                           ("recency", "importance_fraction", "sink_blocks", "share")})
        n = self.seq_len
        seq = n if seq_len is None else seq_len
        return _storage.own_metadata(self, sel, seq, n, bounds, probe_rows, channels)

    def __repr__(self):
        return (f"KVCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, seq_len={self.seq_len}, capacity={self.capacity})")



def _unpickled_cache(settings, capacity, n, held):
    """The KVCache KVCache.__reduce__ describes."""
    new = object.__new__(KVCache)
    new.__dict__.update(settings)
    new._lock = RWLock()
    new._buf = _storage.from_held(new, capacity, n, held)
    return new

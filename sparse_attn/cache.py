"""A growing per-layer KV cache in the layout the kernels read directly."""
import numpy as np

from . import _api
from . import _checks as ck
from ._api import Q8, BlockBounds, ProbeRows
from ._checks import ArgumentError
from ._core import lib

DTYPES = ("q8", "float32")


class KVCache:
    """K and V of one layer, ``[n_kv_heads, capacity, head_dim]``, head-major.

    Appending quantises in C (q8) or copies (float32) into the next rows,
    growing the buffers by doubling when they are full.  ``k``/``v`` are
    zero-copy views of the valid rows that every function of the package
    accepts; ``importance`` accumulates what :meth:`prefill` (or
    :meth:`add_importance`) records, for the decode step's reserve.

    Parameters
    ----------
    n_kv_heads, head_dim : int
    capacity : int, default 4096; rows allocated up front (grows as needed)
    dtype : ``"q8"`` (default) or ``"float32"``
    group_size : int, default 32; q8 only, must divide head_dim
    block_size : int, default 32; the blocks whose key bounds (for
        ``scoring="minmax"``) and probe-row copies the cache keeps up to date
    n_probe : int, default 8; the probe the copies serve
    copy_probe_rows : bool, default True; keep copies of the rows the probe
        samples (:class:`ProbeRows`), so that decode with ``scoring="probe"``
        at this block_size and n_probe reads a quarter of K's bytes for the
        probe instead of about all of them (same result, bitwise).  They cost
        a quarter of K's memory with the defaults; turn them off when memory
        is tighter than time, or when only ``scoring="minmax"`` or a probe of
        every row (``n_probe="all"``, the ``recall`` policy) is used.  None
        are kept when ``n_probe >= block_size``

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
                 block_size=32, n_probe=8, copy_probe_rows=True):
        self.n_kv_heads = ck.check_int("n_kv_heads", n_kv_heads, minimum=1)
        self.head_dim = ck.check_int("head_dim", head_dim, minimum=1)
        capacity = ck.check_int("capacity", capacity, minimum=1)
        if dtype not in DTYPES:
            raise ArgumentError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.dtype = dtype
        if dtype == "q8":
            self.group_size = ck.check_int("group_size", group_size, minimum=1)
            if head_dim % self.group_size:
                raise ArgumentError(f"group_size ({self.group_size}) must divide head_dim "
                                    f"({head_dim})")
        else:
            self.group_size = None
        self.block_size = ck.check_int("block_size", block_size, minimum=1)
        self.n_probe = ck.check_int("n_probe", n_probe, minimum=1)
        # A probe of every row (n_probe >= block_size) reads K itself.
        self.copy_probe_rows = ck.check_bool("copy_probe_rows", copy_probe_rows) and \
            self.n_probe < self.block_size
        self._bounds_group = _api.default_bounds_group(self.group_size, head_dim)
        self.seq_len = 0
        self._k = self._alloc(capacity)
        self._v = self._alloc(capacity)
        self._importance = np.zeros(capacity, np.float32)
        self._bounds = self._alloc_bounds(capacity)
        self._probe = self._alloc_probe(capacity)

    # ----------------------------------------------------------------- storage
    def _alloc(self, capacity):
        shape = (self.n_kv_heads, capacity, self.head_dim)
        if self.dtype == "float32":
            return np.zeros(shape, np.float32)
        ng = self.head_dim // self.group_size
        return Q8._wrap(np.zeros(shape, np.int8),
                        np.zeros((self.n_kv_heads, capacity, ng), np.float32), self.group_size)

    def _alloc_bounds(self, capacity):
        return _api.empty_bounds(self.n_kv_heads, -(-capacity // self.block_size),
                                 self.head_dim, self.block_size, self._bounds_group)

    def _alloc_probe(self, capacity):
        if not self.copy_probe_rows:
            return None
        return _api.empty_probe_rows(self.n_kv_heads, capacity, self.head_dim, self.dtype,
                                     self.group_size, self.block_size, self.n_probe)

    @property
    def capacity(self):
        return self._k.shape[1]

    def _grow(self, need):
        cap = max(need, 2 * self.capacity)
        n = self.seq_len
        for name in ("_k", "_v"):
            old, new = getattr(self, name), self._alloc(cap)
            if self.dtype == "float32":
                new[:, :n] = old[:, :n]
            else:
                new.data[:, :n] = old.data[:, :n]
                new.scales[:, :n] = old.scales[:, :n]
            setattr(self, name, new)
        imp = np.zeros(cap, np.float32)
        imp[:n] = self._importance[:n]
        self._importance = imp
        bounds, nb = self._alloc_bounds(cap), -(-n // self.block_size)
        for name in ("mn", "mx", "scales"):
            getattr(bounds, name)[:, :nb] = getattr(self._bounds, name)[:, :nb]
        bounds.n_rows = n
        self._bounds = bounds
        if self._probe is not None:
            probe = self._alloc_probe(cap)
            # every old copy row, including a partial block's copies so far
            old, new = self._probe.rows, probe.rows
            r = old.shape[1]
            if self.dtype == "float32":
                new[:, :r] = old[:, :r]
            else:
                new.data[:, :r] = old.data[:, :r]
                new.scales[:, :r] = old.scales[:, :r]
            probe.n_rows = n
            self._probe = probe

    @staticmethod
    def _view(t, n):
        if isinstance(t, Q8):
            return Q8._wrap(t.data[:, :n], t.scales[:, :n], t.group_size)
        return t[:, :n]

    @property
    def k(self):
        """The valid keys, ``[n_kv_heads, seq_len, head_dim]`` (a view)."""
        return self._view(self._k, self.seq_len)

    @property
    def v(self):
        """The valid values, ``[n_kv_heads, seq_len, head_dim]`` (a view)."""
        return self._view(self._v, self.seq_len)

    @property
    def importance(self):
        """float32 ``[seq_len]``: the importance recorded so far (a view)."""
        return self._importance[:self.seq_len]

    @property
    def bounds(self):
        """The per-block key bounds of the valid rows (:class:`BlockBounds`,
        views), kept up to date by :meth:`append`, for ``scoring="minmax"``."""
        b, nb = self._bounds, -(-self.seq_len // self.block_size)
        return BlockBounds(b.mn[:, :nb], b.mx[:, :nb], b.scales[:, :nb], b.block_size,
                           b.group_size, self.seq_len)

    @property
    def probe_rows(self):
        """The copies of the probe's rows (:class:`ProbeRows`, current for
        the valid rows), or None with ``copy_probe_rows=False``."""
        p = self._probe
        return None if p is None else ProbeRows(p.rows, p.block_size, p.n_probe, self.seq_len)

    @property
    def nbytes(self):
        """Bytes held by K and V at the current capacity."""
        return self._k.nbytes + self._v.nbytes

    @property
    def metadata_nbytes(self):
        """Bytes held at the current capacity by what selection reads beside
        K and V: the key bounds and the probe-row copies."""
        return self._bounds.nbytes + (self._probe.nbytes if self._probe else 0)

    # ----------------------------------------------------------------- updates
    def append(self, k, v):
        """Append T tokens: ``k``, ``v`` float32 ``[n_kv_heads, T, head_dim]``,
        C-contiguous and finite (checked before anything is written)."""
        want = f"[{self.n_kv_heads}, T, {self.head_dim}]"
        for name, a in (("k", k), ("v", v)):
            ck.check_array(name, a, dtype=np.float32, ndim=3, finite=True)
            if a.shape[0] != self.n_kv_heads or a.shape[2] != self.head_dim:
                raise ArgumentError(f"{name} must have shape {want}, got {a.shape}")
        if k.shape[1] != v.shape[1]:
            raise ArgumentError(f"k and v must append the same number of tokens, got "
                                f"{k.shape[1]} and {v.shape[1]}")
        T = k.shape[1]
        if T == 0:
            return
        if self.seq_len + T > self.capacity:
            self._grow(self.seq_len + T)
        for name, src in (("k", k), ("v", v)):
            dst = _api.kv_operand(name, getattr(self, "_" + name))
            rc = lib.sa_kv_write(dst.struct, self.seq_len, _api._ptr(src, "float"), T)
            _api._raise_for(rc, "KVCache.append")
        # The blocks the new rows touch get their key bounds recomputed.
        kop, bstruct = _api.kv_operand("k", self._k), self._bounds.struct()
        rc = lib.sa_bounds_update(kop.struct, self.seq_len, self.seq_len + T, bstruct)
        _api._raise_for(rc, "KVCache.append")
        self._bounds.n_rows = self.seq_len + T
        if self._probe is not None:
            self._probe.n_rows = self.seq_len
            rc = lib.sa_probe_rows_update(kop.struct, self.seq_len, self.seq_len + T,
                                          self._probe.struct())
            _api._raise_for(rc, "KVCache.append")
            self._probe.n_rows = self.seq_len + T
        self.seq_len += T

    def add_importance(self, importance):
        """Add per-token importance (float32 ``[n <= seq_len]``) to the record."""
        ck.check_array("importance", importance, dtype=np.float32, ndim=1, contiguous=False,
                       finite=True)
        n = importance.shape[0]
        if n > self.seq_len:
            raise ArgumentError(f"importance has {n} entries, more than the cache's "
                                f"seq_len ({self.seq_len})")
        self._importance[:n] += importance

    def truncate(self, seq_len):
        """Keep the first ``seq_len`` tokens (roll back appended tokens).  The
        importance the kept tokens received stays as recorded (including what
        prefill queries of removed tokens gave them); removed tokens' entries
        are cleared and the bounds of a now partial last block recomputed."""
        seq_len = ck.check_int("seq_len", seq_len, minimum=0, maximum=self.seq_len)
        self._importance[seq_len:self.seq_len] = 0
        start = seq_len // self.block_size * self.block_size
        kop, bstruct = _api.kv_operand("k", self._k), self._bounds.struct()
        _api._raise_for(lib.sa_bounds_update(kop.struct, start, seq_len, bstruct),
                        "KVCache.truncate")
        self._bounds.n_rows = self.seq_len = seq_len
        if self._probe is not None:
            self._probe.n_rows = seq_len    # the copies of kept rows stay valid

    def reset(self):
        """Forget every token (keeps the allocation)."""
        self.seq_len = 0
        self._importance[:] = 0
        self._bounds.n_rows = 0
        if self._probe is not None:
            self._probe.n_rows = 0

    # ----------------------------------------------------------------- attention
    def prefill(self, q, *, scale=None, threads=None):
        """Causal prefill of the last T appended tokens' queries
        (``q`` float32 ``[H, T, head_dim]``); records their importance.
        Returns the attention output ``[H, T, head_dim]``."""
        ck.check_array("q", q, dtype=np.float32, ndim=3)
        T = q.shape[1]
        if T > self.seq_len:
            raise ArgumentError(f"q has {T} query tokens but the cache holds only "
                                f"{self.seq_len}; append their K/V first")
        out, imp = _api.prefill(q, self.k, self.v, start=self.seq_len - T, scale=scale,
                                threads=threads)
        self._importance[:self.seq_len] += imp
        return out

    def decode(self, q, **kwargs):
        """:func:`sparse_attn.sparse_decode` over the cache, with its recorded
        importance unless ``importance=`` is given, with its key bounds for
        ``scoring="minmax"`` when ``block_size`` is the cache's, and with its
        probe-row copies for ``scoring="probe"`` when ``block_size`` and
        ``n_probe`` are the cache's."""
        kwargs.setdefault("importance", self.importance if self.importance.any() else None)
        kwargs.update(self.selection_metadata(**kwargs))
        return _api.sparse_decode(q, self.k, self.v, **kwargs)

    def selection_metadata(self, **kwargs):
        """The cache's bounds or probe-row copies that a selection with these
        :func:`sparse_attn.sparse_decode` keyword arguments can read, as
        keyword arguments (``{}`` when none applies or the caller gave them)."""
        if "bounds" in kwargs or "probe_rows" in kwargs or \
                kwargs.get("seq_len") not in (None, self.seq_len) or \
                kwargs.get("block_size", 32) != self.block_size:
            return {}
        knobs = _api.resolve_policy(kwargs.get("policy", "seed"), scoring=kwargs.get("scoring"),
                                    n_probe=kwargs.get("n_probe"))
        if knobs["scoring"] == "minmax":
            return {"bounds": self.bounds}
        if knobs["scoring"] == "probe" and self._probe is not None and \
                knobs["n_probe"] == self.n_probe:
            return {"probe_rows": self.probe_rows}
        return {}

    def __repr__(self):
        return (f"KVCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, seq_len={self.seq_len}, capacity={self.capacity})")

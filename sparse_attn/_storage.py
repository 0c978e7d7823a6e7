"""The memory of a KVCache: everything it holds at one capacity (Buffers),
carved from one allocation (Arena), a huge-page-aligned mapping from one
huge page's size on (docs/design.md, "One allocation per cache")."""
import ctypes
import math
import mmap
import types

import numpy as np

from ._operands import kv_operand
from .metadata import (BlockBounds, ChannelCopy, ProbeRows, bounds_struct, channels_struct,
                       empty_bounds, empty_channels, empty_probe_rows, frozen_copy,
                       probe_geometry, probe_rows_struct)
from .q8 import Q8

# The allocations of a cache smaller than a huge page, and its importance
# record, go through this (tests inject failures here); larger ones map
# their memory (Arena).
zeros = np.zeros

ALIGN = 64


def huge_page_bytes():
    """The transparent huge page size (Linux), or 0 where there is none to
    ask for."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


HUGE = huge_page_bytes()


def span(shape, dtype):
    """(bytes of an array, the bytes it takes in an arena: to the next
    64-byte boundary)."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return n, -(-n // ALIGN) * ALIGN


class Arena:
    """The arrays of one capacity of a cache, carved at 64-byte boundaries
    from one zeroed allocation, or, without a size, a plan that adds up the
    bytes they take (docs/design.md, "One allocation per cache").

    From one huge page's size on (2 MiB on x86-64 and on arm64 with 4 KB
    pages) the allocation is a private anonymous mapping that starts at a
    huge page boundary and reserves one huge page more than it uses
    (address space only: untouched pages take no memory).  :meth:`advise_all`
    asks for transparent huge pages on its whole huge pages (MADV_HUGEPAGE,
    which the kernel's default "madvise" setting grants).  Sparse decode
    reads scattered 4 KB blocks, which cost 1.2-1.5x more from small pages
    (bench/scattered_blocks.c); numpy advises only its own allocations of 4
    MiB or more, and malloc hands out reused heap memory already mapped in
    small pages."""

    def __init__(self, nbytes=None):
        self.nbytes = 0
        self._buf = self._mm = None
        if nbytes is None:
            return
        if HUGE and nbytes >= HUGE:
            try:
                self._mm = mmap.mmap(-1, nbytes + HUGE,
                                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (OSError, OverflowError) as e:
                raise MemoryError(f"cannot map {nbytes} bytes for a KV cache: {e}") from e
            # The array's base is a ctypes array that holds an export of the
            # mapping for as long as it lives, so no view of the cache (nor
            # mmap.close(), which refuses while an export exists) can unmap
            # it: np.frombuffer would put a memoryview there that anyone
            # walking .base could release.
            holder = (ctypes.c_ubyte * (nbytes + HUGE)).from_buffer(self._mm)
            whole = np.ndarray((nbytes + HUGE,), np.uint8, buffer=holder)
            self._at = whole.ctypes.data
            off = (-self._at) % HUGE
        else:
            try:
                whole = zeros(nbytes + ALIGN, np.uint8)
            except ValueError as e:         # beyond what an array can index
                raise MemoryError(f"cannot allocate {nbytes} bytes for a KV cache: {e}") from e
            off = (-whole.ctypes.data) % ALIGN
        self._buf = whole[off:off + nbytes]

    def plan(self, shape, dtype):
        self.nbytes += span(shape, dtype)[1]
        return None

    def take(self, shape, dtype):
        n, step = span(shape, dtype)
        a = self._buf[self.nbytes:self.nbytes + n].view(dtype).reshape(shape)
        self.nbytes += step
        return a

    @property
    def mapped(self):
        return self._mm is not None

    def advise_all(self):
        """Transparent huge pages for every whole huge page of a mapped
        arena (else nothing to do), before the rows under them are written."""
        if self._mm is None:
            return
        start = self._buf.ctypes.data
        lo = -(-start // HUGE) * HUGE
        hi = (start + self._buf.nbytes) // HUGE * HUGE
        if hi > lo:
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE, lo - self._at, hi - lo)
            except OSError:
                pass        # a kernel without THP: small pages, the same bytes


class Buffers:
    """Everything a cache holds at one capacity.  A cache that grows builds a
    whole new one (every allocation first, then the copies) and swaps it in
    only when the append into it has succeeded."""

    __slots__ = ("capacity", "arena", "advised", "karr", "varr", "k", "v", "kop", "vop",
                 "importance", "bounds", "bounds_st", "probe", "probe_st", "channels",
                 "channels_st")


def allocate(cache, capacity, old=None, n=0, filled=0):
    """A complete Buffers of `capacity` rows for `cache` (a KVCache: its
    heads, head_dim, dtype, groups, blocks and copies), holding the first n
    rows of `old` (and what goes with them) when given; the first `filled`
    rows are about to be written (advise)."""
    b = Buffers()
    b.capacity = capacity
    # Sized first (nothing allocated), then carved from one allocation.
    plan = Arena()
    _arrays_into(cache, b, capacity, plan.plan)
    b.arena = Arena(plan.nbytes)
    b.advised = not b.arena.mapped          # small pages only: nothing to ask for
    _arrays_into(cache, b, capacity, b.arena.take)
    b.importance = zeros(capacity, np.float32)
    advise(b, filled)
    if cache.dtype == "float32":
        b.k, b.v = b.karr[0], b.varr[0]
    else:
        b.k, b.v = Q8._wrap(*b.karr, cache.group_size), Q8._wrap(*b.varr, cache.group_size)
    # Everything is allocated: copying cannot fail any more.
    probe_rows_done = 0
    if old is not None:
        copy_rows(old.karr, b.karr, n)
        copy_rows(old.varr, b.varr, n)
        b.importance[:n] = old.importance[:n]
        onb = -(-n // cache.block_size)
        for src, dst in zip(old.bounds, b.bounds):
            dst[:, :onb] = src[:, :onb]
        if b.channels is not None:
            for src, dst in zip(old.channels, b.channels):
                dst[:, :, :onb] = src[:, :, :onb]
        if b.probe is not None:
            # every old copy row, including a partial block's copies so far
            src = probe_arrays(old.probe)
            copy_rows(src, probe_arrays(b.probe), src[0].shape[1])
            probe_rows_done = old.probe_st.k_rows
    b.kop, b.vop = kv_operand("k", b.k), kv_operand("v", b.v)
    b.bounds_st = bounds_struct(b.bounds, cache.block_size, cache.scale_group, n)
    b.channels_st = None
    if b.channels is not None:
        b.channels_st = channels_struct(b.channels, cache.block_size, n)
    b.probe_st = None
    if b.probe is not None:
        b.probe_st = probe_rows_struct(b.probe, cache.group_size, cache.block_size,
                                       cache.n_probe, probe_rows_done)
    return b

def held(cache, b):
    """(capacity, n, arrays) of what a cache holds at its length n: the
    valid rows of K and V, their importance, the bounds and channel copy of
    their blocks, the probe copies of those blocks (each a copy), and how
    many rows the probe copies cover: what a pickle of the cache keeps
    (from_held makes the buffers again)."""
    n = b.bounds_st.k_rows
    nb = -(-n // cache.block_size)
    probe = None
    if b.probe is not None:
        cnt, _ = probe_geometry(cache.block_size, cache.n_probe)
        rows = min(nb * cnt, probe_arrays(b.probe)[0].shape[1])
        probe = tuple(a[:, :rows].copy() for a in probe_arrays(b.probe))
    arrays = dict(
        karr=tuple(a[:, :n].copy() for a in b.karr),
        varr=tuple(a[:, :n].copy() for a in b.varr),
        importance=b.importance[:n].copy(),
        bounds=tuple(a[:, :nb].copy() for a in b.bounds),
        channels=None if b.channels is None else tuple(a[:, :, :nb].copy() for a in b.channels),
        probe=probe, probe_rows=None if b.probe_st is None else b.probe_st.k_rows)
    return b.capacity, n, arrays


def from_held(cache, capacity, n, arrays):
    """The Buffers of `capacity` rows holding what held() kept, copied in as
    a growth copies the old buffers (allocate): the same bits."""
    probe = arrays["probe"]
    old = types.SimpleNamespace(
        karr=arrays["karr"], varr=arrays["varr"], importance=arrays["importance"],
        bounds=arrays["bounds"], channels=arrays["channels"],
        probe=None if probe is None else (probe if len(probe) > 1 else probe[0]),
        probe_st=types.SimpleNamespace(k_rows=arrays["probe_rows"]))
    return allocate(cache, capacity, old, n, n)


def advise(b, filled):
    """Once the first `filled` rows about to be written make b three
    quarters full, ask for huge pages on all of its arena's whole huge
    pages.  A huge page is memory on its first touch, rows written or
    not, and each head's rows run to the capacity, so a cache asks only
    when its unwritten rows are at most a third of what it holds.  The
    kernel grants them where nothing was touched yet: under one write
    that fills three quarters (a prompt, a growth's copy); pages that
    earlier small appends touched stay small pages (the kernel's
    background collapsing may merge them later, slowly)."""
    if not b.advised and HUGE and 4 * filled >= 3 * b.capacity:
        b.arena.advise_all()
        b.advised = True

def _arrays_into(cache, b, capacity, zeros):
    """b's arrays that grow with the capacity (K, V, key bounds, the
    copies), each from zeros(shape, dtype), in a fixed order."""
    shape = (cache.n_kv_heads, capacity, cache.head_dim)
    if cache.dtype == "float32":
        b.karr, b.varr = (zeros(shape, np.float32),), (zeros(shape, np.float32),)
    else:
        sshape = (cache.n_kv_heads, capacity, cache.head_dim // cache.group_size)
        b.karr = (zeros(shape, np.int8), zeros(sshape, np.float32))
        b.varr = (zeros(shape, np.int8), zeros(sshape, np.float32))
    nb = -(-capacity // cache.block_size)
    b.bounds = empty_bounds(cache.n_kv_heads, nb, cache.head_dim, cache.block_size,
                            cache.scale_group, zeros=zeros)
    b.probe = None
    if cache.copy_probe_rows:
        b.probe = empty_probe_rows(cache.n_kv_heads, capacity, cache.head_dim, cache.dtype,
                                   cache.group_size, cache.block_size, cache.n_probe,
                                   zeros=zeros)
    b.channels = None
    if cache.copy_channels:
        b.channels = empty_channels(cache.n_kv_heads, nb, cache.head_dim, cache.block_size,
                                    zeros=zeros)


def probe_arrays(t):
    """The arrays of probe-row copies: (f32,) or (data, scales)."""
    return t if isinstance(t, tuple) else (t,)


def copy_rows(src, dst, n):
    """dst[i][:, :n] = src[i][:, :n] for matching tuples of arrays."""
    for s, d in zip(src, dst):
        d[:, :n] = s[:, :n]


# What a cache hands out of its metadata: copies of the valid rows' part,
# taken by the cache under its read lock (KVCache._snapshot), in read-only
# memory, so later appends into a partial block never show through.

def bounds_snapshot(b, n, cache):
    nb = -(-n // cache.block_size)
    mn, mx, sc = (frozen_copy(a[:, :nb]) for a in b.bounds)
    return BlockBounds._wrap(mn, mx, sc, cache.block_size, cache.scale_group, n, nb)


def channels_snapshot(b, n, cache):
    if b.channels is None:
        return None
    nb = -(-n // cache.block_size)
    data, scales = (frozen_copy(a[:, :, :nb]) for a in b.channels)
    return ChannelCopy._wrap(data, scales, cache.block_size, n)


def probe_rows_snapshot(b, n, cache):
    if b.probe is None:
        return None
    # the full blocks' copies (what a decode reads), at least one block's:
    # an operand has rows
    cnt, _ = probe_geometry(cache.block_size, cache.n_probe)
    r = max(n // cache.block_size, 1) * cnt
    arrays = [frozen_copy(a[:, :r]) for a in probe_arrays(b.probe)]
    rows = Q8._wrap(*arrays, cache.group_size) if len(arrays) == 2 else arrays[0]
    return ProbeRows._wrap(rows, cache.block_size, cache.n_probe, n)


def metadata_nbytes(b):
    probe = 0 if b.probe is None else sum(a.nbytes for a in probe_arrays(b.probe))
    channels = 0 if b.channels is None else sum(a.nbytes for a in b.channels)
    return sum(a.nbytes for a in b.bounds) + probe + channels


def own_metadata(cache, sel, seq, n, bounds, probe_rows, channels=None):
    """Which of `cache`'s own metadata a decode with selection `sel`
    over `seq` of its n rows reads: "bounds", "channels", "probe_rows" or
    None (the caller passed its own, or none fits and K is probed or the
    bounds computed for the call)."""
    if bounds is not None or probe_rows is not None or channels is not None or seq != n:
        return None
    if sel.scoring == "minmax":
        return "bounds" if sel.block_size == cache.block_size else None
    if sel.scoring == "channels":
        return "channels" if cache.copy_channels and sel.block_size == cache.block_size \
            else None
    if cache.copy_probe_rows and (sel.block_size, sel.n_probe) == \
            (cache.block_size, cache.n_probe):
        return "probe_rows"
    return None


def own_structs(buf, kind):
    """The C structs (bounds-or-channels, probe rows) of a buffer set's own
    metadata of the kind own_metadata named (None: neither)."""
    if kind == "bounds":
        return buf.bounds_st, None
    if kind == "channels":
        return buf.channels_st, None
    if kind == "probe_rows":
        return None, buf.probe_st
    return None, None


def own_kind_structs(cache, buf, sel, seq, n, bounds=None, probe_rows=None, channels=None):
    """own_metadata's kind, and the C structs of buf's metadata of that kind."""
    kind = own_metadata(cache, sel, seq, n, bounds, probe_rows, channels)
    return (kind, *own_structs(buf, kind))

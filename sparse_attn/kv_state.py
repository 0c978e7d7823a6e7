"""What sparse attention keeps beside a KV cache another framework owns.

A framework that keeps its own K and V (transformers' DynamicCache; next,
llama.cpp's cache) hands the attention call the whole sequence's K/V at each
step.  What the policies read beyond K and V (the importance record of
``seed``/``recall``, the channel copy of ``balanced``, spec §6) has to live
somewhere between calls and follow the sequence: :class:`KVState` is that
state, one per layer and sequence, knowing nothing of the framework.  Each
call binds the framework's float32 K/V (:meth:`KVState.bind`), then runs a
prefill or a decode over them; a decode step of many sequences is one C call
(:func:`decode_batch`).
"""
import numpy as np

from . import _checks as ck
from . import _ffi
from . import metadata as _metadata
from ._operands import kv_pair, query, scale_value
from .attention import batch_call, dense_call, metadata_structs, prefill, sparse_call
from .errors import ArgumentError, ArgumentTypeError, UnsupportedError
from .selection import selection


class _ImportanceRecord:
    """Per-token importance of the sequence: float32 ``[length]``, growing
    by doubling."""

    def __init__(self):
        self._buf = np.zeros(1024, np.float32)
        self.length = 0

    def prepare(self, past, seq):
        """Keep the first ``past`` tokens' importance (``past`` at most what
        is recorded: fewer is a cropped sequence), then cover ``seq`` tokens,
        the new ones at zero."""
        if seq > self._buf.shape[0]:
            buf = np.zeros(max(seq, 2 * self._buf.shape[0]), np.float32)
            buf[:past] = self._buf[:past]
            self._buf = buf
        self._buf[past:seq] = 0
        self.length = seq

    def add(self, importance):
        self._buf[:importance.shape[0]] += importance

    @property
    def importance(self):
        return self._buf[:self.length]


class KVState:
    """The state sparse attention keeps for one layer of one sequence whose
    K and V another framework owns: the importance the sequence's prefill
    and decode steps recorded, and the channel copy of K that
    ``scoring="channels"`` reads, kept up to date block by block.

    Each call starts with :meth:`bind` (the framework's K/V as they are now),
    then :meth:`prefill`, :meth:`decoder` or :meth:`dense_decode` over them.
    K/V are only read during the call; the state never keeps them, so a
    ``copy.deepcopy`` or a pickle carries the record and the channel copy
    only (a copy of the framework's cache carries its own copy of this).
    Not for concurrent use: one caller per state at a time.
    """

    def __init__(self):
        self._record = _ImportanceRecord()
        self.k = self.v = self._ops = None     # _ops: bind's checked (K, V, S) operands
        self.start = 0
        # (arrays, struct) of the channel copy, for up to arrays[0].shape[2]
        # blocks, covering the rows struct.k_rows says; None until needed
        self._copy = None

    def __getstate__(self):
        copy = None
        if self._copy is not None:
            arrays, st = self._copy
            copy = (arrays, st.block_size, st.k_rows)
        return {"record": self._record, "copy": copy}

    def __setstate__(self, state):
        self.__init__()
        self._record = state["record"]
        if state["copy"] is not None:
            arrays, block_size, k_rows = state["copy"]
            self._copy = (arrays, _metadata.channels_struct(arrays, block_size, k_rows))

    @property
    def length(self):
        """Tokens of the sequence the record covers (the last bind's)."""
        return self._record.length

    @property
    def importance(self):
        """The recorded importance, float32 ``[length]`` (a read-only view)."""
        view = self._record.importance.view()
        view.flags.writeable = False
        return view

    @property
    def metadata_nbytes(self):
        """Bytes held by what selection reads beside K and V (the channel
        copy), as :attr:`sparse_attn.KVCache.metadata_nbytes` counts them."""
        return 0 if self._copy is None else sum(a.nbytes for a in self._copy[0])

    @property
    def nbytes(self):
        """Every byte the state holds: the importance record and the channel
        copy."""
        return self._record._buf.nbytes + self.metadata_nbytes

    def bind(self, k, v, new_rows):
        """Take this call's K and V, float32 ``[Hkv, S, D]`` (rows
        contiguous; the head stride may be larger), whose last ``new_rows``
        rows are the call's new tokens.  The ``S - new_rows`` rows before
        them must be the sequence this state recorded: all of it, or its
        first rows (a cropped sequence: the kept tokens keep their
        importance, the channel copy is made again), or none (a new
        sequence).  Returns S.

        Raises
        ------
        UnsupportedError
            More rows before the new ones than the state recorded (K/V of
            another sequence, or filled without this state).
        ArgumentError
            K and V of different lengths, or fewer rows than ``new_rows``.
        """
        if not isinstance(k, np.ndarray) or not isinstance(v, np.ndarray) or \
                k.ndim != 3 or v.ndim != 3:
            raise ArgumentTypeError("k and v must be float32 numpy arrays [Hkv, S, D]")
        S = k.shape[1]
        new_rows = ck.check_int("new_rows", new_rows, minimum=0)
        if v.shape[1] != S or S < new_rows:
            raise ArgumentError(f"k/v hold {S}/{v.shape[1]} rows for new_rows={new_rows}; "
                                f"expected equal lengths >= {new_rows}")
        past = S - new_rows
        if past > self._record.length:
            raise UnsupportedError(
                f"k/v hold {past} rows before this call's, of which this state recorded "
                f"{self._record.length}: another sequence, or one filled without it")
        self.k = self.v = self._ops = None      # until both are checked
        ops = kv_pair(k, v, None)
        if past == 0 or past < self._record.length:
            self._copy = None       # made from rows this sequence no longer holds
        self._record.prepare(past, S)
        self.k, self.v, self.start, self._ops = k, v, past, ops
        return S

    def _bound(self):
        if self.k is None:
            raise ArgumentError("bind() this call's k and v first")
        return self.k, self.v

    def prefill(self, q, *, scale=None, threads=None, **sparse):
        """Attention of the bound call's new tokens (``q`` float32
        ``[H, T, D]``, T = ``new_rows``) over the bound K/V, causal, exact
        or sparse as :func:`sparse_attn.prefill` with the same knobs
        (``k_blocks=...``); the importance it yields is added to the
        record, and a sparse prefill's reserve ranks what was recorded
        before.  Returns float32 ``[H, T, D]``."""
        k, v = self._bound()
        if "importance" in sparse or "start" in sparse:
            raise ArgumentError("prefill: importance and start are the state's own")
        T = k.shape[1] - self.start
        if getattr(q, "ndim", 0) != 3 or q.shape[1] != T:
            raise ArgumentError(f"q must be [H, T, D] with T = the {T} new rows bound, got "
                                f"shape {getattr(q, 'shape', None)}")
        if sparse.get("k_blocks") is not None:
            prior = self._record.importance
            sparse["importance"] = prior[:self.start] if prior[:self.start].any() else None
        out, importance = prefill(q, k, v, start=self.start, scale=scale, threads=threads,
                                  **sparse)
        self._record.add(importance)
        return out

    def channels(self, block_size=32):
        """The kept channel copy of the bound K (:class:`sparse_attn.ChannelCopy`
        over the state's arrays), brought up to date."""
        k, _ = self._bound()
        block_size = ck.check_int("block_size", block_size, minimum=1)
        S = k.shape[1]
        self._channels_struct(self._ops[0], block_size)
        arrays, nb = self._copy[0], -(-S // block_size)
        return _metadata.owned_channel_copy(arrays[0][:, :, :nb], arrays[1][:, :, :nb],
                                            block_size, S)

    def _channels_struct(self, kop, block_size):
        """The sa_channels of the kept copy, the blocks holding rows it does
        not cover yet made now (bind dropped it when the rows it was made
        from are gone); another head layout or block size starts it again,
        and its room grows by a quarter as it fills."""
        hkv, S, D = self.k.shape
        copy = self._copy
        if copy is not None:
            arrays, st = copy
            if arrays[0].shape[:2] != (hkv, D) or st.block_size != block_size:
                copy = None
        nb = -(-S // block_size)
        if copy is None or nb > arrays[0].shape[2]:
            room = max(64, nb + nb // 4)     # a quarter more: O(1) copying per row
            fresh = _metadata.empty_channels(hkv, room, D, block_size)
            done = 0
            if copy is not None:
                done = st.k_rows
                have = -(-done // block_size)
                for src, dst in zip(arrays, fresh):
                    dst[:, :, :have] = src[:, :, :have]
            arrays, st = fresh, _metadata.channels_struct(fresh, block_size, done)
            self._copy = (arrays, st)
        _ffi.check(_ffi.lib.sa_channels_update(kop.struct, st.k_rows, S, st),
                   "KVState channel copy")
        return st

    def decoder(self, *, scale=None, threads=None, dense=False, return_blocks=False, **knobs):
        """The decode step over the bound K/V (the last row's query):
        a :class:`StateDecoder`, called with ``q`` float32 ``[H, D]``, that
        gives :func:`sparse_attn.sparse_decode`'s result with the knobs given
        (``k_blocks``, ``policy``, ...) and this state's importance and
        channel copy, or :func:`sparse_attn.dense_decode`'s with
        ``dense=True``.  Valid until the next :meth:`bind`."""
        k, _ = self._bound()
        kop, vop, S = self._ops
        scale = scale_value(scale, kop.head_dim)
        threads = ck.check_threads(threads)
        if ck.check_bool("dense", dense):
            return StateDecoder(kop, vop, S, scale, threads, None, None, None, None, None, False)
        if {"importance", "bounds", "probe_rows", "channels", "seq_len"} & set(knobs):
            raise ArgumentError("decoder: importance, metadata and seq_len are the state's own")
        sel = selection(**knobs)
        if sel.scoring == "channels":
            bst, pst, keep = self._channels_struct(kop, sel.block_size), None, self._copy
        else:       # the bounds made for the call (minmax), or K probed
            bst, pst, keep = metadata_structs(sel, k, kop, S, None, None)
        return StateDecoder(kop, vop, S, scale, threads, sel, bst, pst, self._record.importance,
                            keep, ck.check_bool("return_blocks", return_blocks))

    def dense_decode(self, q, *, scale=None, threads=None):
        """Exact attention of ``q`` (``[H, D]``) over the bound K/V."""
        return self.decoder(scale=scale, threads=threads, dense=True)(q)


class StateDecoder:
    """A decode step prepared by :meth:`KVState.decoder` over the K/V bound
    then; call it with the step's query, or give it to :func:`decode_batch`."""

    __slots__ = ("kop", "vop", "seq_len", "scale", "threads", "sel", "bounds", "probe_rows",
                 "importance", "keep", "return_blocks")

    def __init__(self, kop, vop, seq_len, scale, threads, sel, bounds, probe_rows, importance,
                 keep, return_blocks):
        self.kop, self.vop, self.seq_len, self.scale = kop, vop, seq_len, scale
        self.threads, self.sel, self.bounds, self.probe_rows = threads, sel, bounds, probe_rows
        self.importance, self.keep, self.return_blocks = importance, keep, return_blocks

    def __call__(self, q):
        """float32 ``[H, D]`` out (and int32 ``[H, K]`` blocks with
        ``return_blocks``)."""
        q, n_heads = query(q, self.kop, 2)
        if self.sel is None:
            return dense_call(q, n_heads, self.kop, self.vop, self.seq_len, self.scale,
                              self.threads)
        return sparse_call(q, n_heads, self.kop, self.vop, self.seq_len, self.sel,
                           self.importance, self.bounds, self.probe_rows, self.scale,
                           self.threads, self.return_blocks)


def decode_batch(steps, *, threads=None):
    """Decode steps of several sequences in one C call (one worker pool
    round): ``steps`` a list of ``(decoder, q, out)``, each ``decoder`` a
    :class:`StateDecoder`, ``q`` float32 ``[H, D]`` and ``out`` a writable
    C-contiguous float32 ``[H, D]`` its result is written to.  The same bits
    as each decoder called alone.  A failure names the sequence (its index
    in ``steps``)."""
    threads = ck.check_threads(threads)
    calls, keep = [], []
    for i, step in enumerate(steps):
        try:
            dec, q, out = step
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"steps[{i}] must be (decoder, q, out)") from None
        if not isinstance(dec, StateDecoder):
            raise ArgumentTypeError(f"steps[{i}][0] must be a StateDecoder (KVState.decoder), "
                                    f"got {type(dec).__name__}")
        q, n_heads = query(q, dec.kop, 2)
        if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and
                out.shape == (n_heads, dec.kop.head_dim) and out.flags.c_contiguous and
                out.flags.writeable):
            raise ArgumentError(f"steps[{i}]: out must be a writable C-contiguous float32 "
                                f"[{n_heads}, {dec.kop.head_dim}] array")
        params = None if dec.sel is None else dec.sel.params(dec.bounds, dec.probe_rows)
        keep.append((q, params, dec.keep))
        calls.append((_ffi.ptr(q, "float"), n_heads, dec.kop, dec.vop, dec.seq_len, params,
                      dec.importance, dec.scale, _ffi.out_ptr(out, "float")))
    batch_call(calls, threads)
    del keep

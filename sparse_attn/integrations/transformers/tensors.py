"""The placeholder tensor a q8 SparseKVCache layer returns for K and V, the batch sizes in which the step's tensors are made, and the spans of a batch's sequences (RowSpans)."""

import torch

from sparse_attn.errors import ArgumentError, UnsupportedError


class KVPlaceholder(torch.Tensor):
    """What a q8 :class:`SparseKVLayer` returns as K and V: the shape and
    dtype transformers expects, no data, and a reference to the layer.  Only
    the sparse_topk attention function knows to read the layer's q8 buffers;
    any torch operation on it raises instead of computing on garbage.

    Each layer makes its own subclass (:meth:`for_layer`) holding the layer
    as a class attribute, so a decode step's placeholder is one
    ``_make_wrapper_subclass`` call with no attributes to set."""

    _sparse_attn_layer = None

    @classmethod
    def for_layer(cls, layer):
        return type(cls.__name__, (cls,), {"_sparse_attn_layer": layer})

    @classmethod
    def make(cls, shape, dtype):
        return make_wrapper(cls, shape, dtype=dtype, device="cpu")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UnsupportedError(
            f"{func} on the q8 K/V of a SparseKVCache: its K/V are q8 buffers only the "
            "'sparse_topk' attention can read. Use attn_implementation='sparse_topk' with this "
            "cache, or a DynamicCache with other implementations")

    def __repr__(self):
        return f"<q8 K/V placeholder {tuple(self.shape)} of {self._sparse_attn_layer!r}>"


make_wrapper = torch.Tensor._make_wrapper_subclass


# How many decode steps' placeholders (SparseKVLayer) and output tensors
# (CacheState) are made at a time: objects of no data, and outputs of
# n_heads * head_dim floats each (16 KB at 32 heads of 128).
PLACEHOLDER_BATCH = 32


OUTPUT_BATCH = 16


class RowSpans:
    """What :func:`sparse_topk_mask` gives the full-attention layers of a
    batch, or of a padded sequence: each sequence's real (unpadded) keys
    among the ``kv_length`` positions the layer holds.  Sequence ``b``'s
    real keys are positions ``[start[b], end[b])`` when ``index[b]`` is None
    (left padding; right padding in a call that holds the whole prompt),
    else the positions the 1-D int64 tensor ``index[b]`` lists, ascending,
    from ``start[b]`` to ``end[b] - 1`` (padding between its tokens: a mask
    with holes, or right padding followed by generated tokens).  A sequence
    with no real key has ``start[b] == end[b]``.  ``count[b]`` is the number
    of its real keys.  The attention attends each sequence over its real
    keys only, as that sequence alone."""

    __slots__ = ("start", "end", "kv_length", "index", "count")

    def __init__(self, start, end, kv_length, index=None):
        start, end = tuple(int(s) for s in start), tuple(int(e) for e in end)
        kv_length = int(kv_length)
        if len(start) != len(end) or not start:
            raise ArgumentError(f"RowSpans needs one start and one end per sequence, got "
                                f"{len(start)} and {len(end)}")
        index = (None,) * len(start) if index is None else tuple(index)
        if len(index) != len(start):
            raise ArgumentError(f"RowSpans needs one index (or None) per sequence, got "
                                f"{len(index)} for {len(start)} sequences")
        count = []
        for b, (s, e, idx) in enumerate(zip(start, end, index)):
            if not 0 <= s <= e <= kv_length:
                raise ArgumentError(f"RowSpans: sequence {b}'s span [{s}, {e}) is not a "
                                    f"range of [0, {kv_length})")
            if idx is None:
                count.append(e - s)
                continue
            if not (isinstance(idx, torch.Tensor) and idx.ndim == 1 and
                    idx.dtype is torch.int64 and idx.numel() >= 1):
                raise ArgumentError(f"RowSpans: sequence {b}'s index must be a 1-D int64 "
                                    f"tensor of positions, got {idx!r}")
            if int(idx[0]) != s or int(idx[-1]) != e - 1 or \
                    (idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all())):
                raise ArgumentError(f"RowSpans: sequence {b}'s index must list ascending "
                                    f"positions from start {s} to end - 1 ({e - 1})")
            count.append(idx.numel())
        self.start, self.end, self.kv_length = start, end, kv_length
        self.index, self.count = index, tuple(count)

    @classmethod
    def from_mask(cls, mask, kv_length):
        """The spans of a 2D padding mask ``[B, >= kv_length]`` (nonzero
        where a token is real; its first ``kv_length`` columns are read)."""
        m = mask[:, :kv_length].to(torch.bool)
        B = m.shape[0]
        count = m.sum(1)
        start = m.to(torch.int8).argmax(1)
        end = kv_length - m.flip(1).to(torch.int8).argmax(1)
        start, end, count = start.tolist(), end.tolist(), count.tolist()
        index = [None] * B
        for b in range(B):
            if count[b] == 0:
                start[b] = end[b] = 0
            elif end[b] - start[b] != count[b]:
                index[b] = m[b].nonzero().flatten()
        return cls(start, end, kv_length, index)

    def contiguous(self, b):
        """Whether sequence b's real keys are one range (or none)."""
        return self.index[b] is None

    def keys(self, b):
        """Sequence b's real positions: a slice, or an int64 index tensor."""
        idx = self.index[b]
        return slice(self.start[b], self.end[b]) if idx is None else idx

    def new(self, b, first):
        """Sequence b's real positions at or after ``first`` (a call's new
        tokens), counted from ``first``: a slice, or an int64 index tensor
        (None when it has none)."""
        idx = self.index[b]
        if idx is None:
            lo, hi = max(first, self.start[b]), self.end[b]
            return slice(lo - first, hi - first) if hi > lo else None
        new = idx[idx >= first]
        return new - first if new.numel() else None

    def __len__(self):
        return len(self.start)

    def __repr__(self):
        holes = [b for b, i in enumerate(self.index) if i is not None]
        extra = f", with padding between the tokens of sequences {holes}" if holes else ""
        return f"RowSpans(start={self.start}, end={self.end}, kv_length={self.kv_length}{extra})"

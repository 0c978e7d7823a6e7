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
    batch, or of a padded sequence: each sequence's unpadded keys, the
    positions ``[start[b], end[b])`` of the ``kv_length`` the layer holds
    (left padding: ``end[b] == kv_length``; right padding, in a call that
    holds the whole prompt: ``start[b] == 0``)."""

    __slots__ = ("start", "end", "kv_length")

    def __init__(self, start, end, kv_length):
        start, end = tuple(int(s) for s in start), tuple(int(e) for e in end)
        kv_length = int(kv_length)
        if len(start) != len(end) or not start:
            raise ArgumentError(f"RowSpans needs one start and one end per sequence, got "
                                f"{len(start)} and {len(end)}")
        for b, (s, e) in enumerate(zip(start, end)):
            if not 0 <= s < e <= kv_length:
                raise ArgumentError(f"RowSpans: sequence {b}'s span [{s}, {e}) is not a "
                                    f"non-empty range of [0, {kv_length})")
        self.start, self.end, self.kv_length = start, end, kv_length

    def __len__(self):
        return len(self.start)

    def __repr__(self):
        return f"RowSpans(start={self.start}, end={self.end}, kv_length={self.kv_length})"

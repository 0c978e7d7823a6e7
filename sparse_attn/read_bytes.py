"""The bytes one layer's decode step reads, counted from the blocks it
chose: what ``sparse-attn bench`` reports against the memory floor and
``sparse-attn eval`` puts beside each score.  The count follows the
kernels' reads (docs/design.md, "What a cache keeps beside K and V"): a
sparse step reads, per KV head, what its scoring reads to choose (the
probed K rows; for ``scoring="minmax"`` the blocks' key bounds; for
``"channels"`` the scored channels of the channel copy), unless it chose
every block, and the K and V rows of the blocks any head of the KV head
chose, each once; a dense step reads all of K and V.
"""
import numpy as np

from .metadata import default_scale_group, probe_geometry


def kv_row_bytes(dtype, head_dim, group_size=32):
    """Bytes of one token's K (or V) row of one KV head."""
    return head_dim * 4 if dtype == "float32" else head_dim + 4 * (head_dim // group_size)


def decode_read_bytes(blocks, seq_len, *, n_kv_heads, head_dim, dtype, sel=None,
                      group_size=32):
    """Bytes one layer's decode step over ``seq_len`` tokens reads.

    blocks : int array ``[H, K]`` of the blocks the step chose (any shape
        whose rows, taken ``n_kv_heads`` at a time in order, are the KV
        heads' query heads), or None for a dense step
    dtype : ``"float32"`` or ``"q8"``
    sel : the step's :class:`~sparse_attn.selection.Selection` (sparse)
    """
    row = kv_row_bytes(dtype, head_dim, group_size)
    if blocks is None:
        return 2 * n_kv_heads * seq_len * row
    bs, nb = sel.block_size, -(-seq_len // sel.block_size)
    if sel.scoring == "minmax":
        sg = default_scale_group(group_size if dtype == "q8" else None, head_dim)
        select_cost = nb * (2 * head_dim + 4 * (head_dim // sg))
    elif sel.scoring == "channels":
        select_cost = nb * min(sel.n_channels, head_dim) * (bs + 4)
    else:
        cnt, _ = probe_geometry(bs, sel.n_probe)
        last = seq_len - (nb - 1) * bs
        last_cnt = -(-last // max(1, last // sel.n_probe))
        select_cost = ((nb - 1) * cnt + last_cnt) * row
    total = 0
    for chosen in np.asarray(blocks).reshape(n_kv_heads, -1):
        picked = np.unique(chosen)
        rows = sum(min((int(b) + 1) * bs, seq_len) - int(b) * bs for b in picked)
        if len(picked) < nb:
            total += select_cost
        total += 2 * rows * row
    return int(total)  # not a numpy integer: json.dump takes only Python ints

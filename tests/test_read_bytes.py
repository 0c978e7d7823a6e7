"""sparse_attn.read_bytes: a decode step's bytes, counted from its blocks."""
import numpy as np

from sparse_attn.read_bytes import decode_read_bytes, kv_row_bytes
from sparse_attn.selection import selection


def test_rows():
    assert kv_row_bytes("float32", 128) == 512
    assert kv_row_bytes("q8", 128) == 128 + 4 * 4 and kv_row_bytes("q8", 64, 64) == 68


def test_dense_and_every_block_read_all_of_k_and_v():
    sel = selection("seed", k_blocks=64)
    dense = decode_read_bytes(None, 1000, n_kv_heads=2, head_dim=64, dtype="q8")
    assert dense == 2 * 2 * 1000 * 72
    every = np.tile(np.arange(32), (4, 1))          # 4 heads, 2 per KV head, all 32 blocks
    assert decode_read_bytes(every, 1000, n_kv_heads=2, head_dim=64, dtype="q8",
                             sel=sel) == dense        # no selection cost when nothing is skipped


def test_chosen_blocks_once_per_kv_head_plus_the_probe():
    sel = selection("seed", k_blocks=2, n_probe=8)
    # 4 query heads on 2 KV heads; KV head 0's heads chose {0, 3} and {3, 5}: 3 blocks,
    # KV head 1's {31} twice (block 31 holds rows 992..999: 8 rows)
    blocks = np.array([[0, 3], [3, 5], [31, 31], [31, 31]])
    row = 64 * 4
    probe = (31 * 8 + 8) * row          # 8 rows of each full block, all 8 of the last one
    want = probe + 2 * 3 * 32 * row + probe + 2 * 8 * row
    assert decode_read_bytes(blocks, 1000, n_kv_heads=2, head_dim=64, dtype="float32",
                             sel=sel) == want


def test_channel_and_bound_scorings_read_their_metadata():
    blocks = np.array([[1], [1]])
    ch = selection("balanced", k_blocks=1)           # channels: n_channels rows of the copy
    n = ch.n_channels
    assert decode_read_bytes(blocks, 64, n_kv_heads=1, head_dim=64, dtype="q8", sel=ch) == \
        2 * n * (32 + 4) + 2 * 32 * 72
    mm = selection("seed", k_blocks=1, scoring="minmax")
    got = decode_read_bytes(blocks, 64, n_kv_heads=1, head_dim=64, dtype="float32", sel=mm)
    # per block int8 low and high bounds per channel, a float scale per 32 channels
    assert got - 2 * 32 * 256 == 2 * (2 * 64 + 4 * (64 // 32))

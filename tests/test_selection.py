"""The block-selection rules of spec §2 on inputs built to exercise each rule:
ties from identical blocks, recency insurance, the importance reserve, k=1."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

BS = 8


def blocks_of(rows, D=16):
    """A one-KV-head K whose block b is `rows[b]` repeated: block b's probe
    score is rows[b] * q[0] for q = e0."""
    k = np.zeros((1, len(rows) * BS, D), np.float32)
    for b, val in enumerate(rows):
        k[0, b * BS:(b + 1) * BS, 0] = val
    q = np.zeros((1, D), np.float32)
    q[0, 0] = 1.0
    return q, k


def select(q, k, **kw):
    kw.setdefault("block_size", BS)
    got = sa.select_blocks(q, k, **kw)
    np.testing.assert_array_equal(got, ref.select_blocks(q, k, **kw))
    return got[0].tolist()


def test_probe_ties_go_to_lower_index(isa):
    q, k = blocks_of([1, 5, 5, 5, 0, 9])
    assert select(q, k, k_blocks=2, recency=False) == [1, 5]
    assert select(q, k, k_blocks=3, recency=False) == [1, 2, 5]


def test_recency_replaces_lowest_probe_pick_higher_index_on_ties(isa):
    # Probe order: 0 (9), then 2 and 3 tie at 5; the last pick is 3.
    q, k = blocks_of([9, 1, 5, 5, 0, 0])
    assert select(q, k, k_blocks=3, recency=False) == [0, 2, 3]
    assert select(q, k, k_blocks=3, recency=True) == [0, 2, 5]


def test_recency_is_a_no_op_when_last_block_already_chosen(isa):
    q, k = blocks_of([1, 2, 3, 9])
    assert select(q, k, k_blocks=2, recency=True) == [2, 3]


def test_importance_reserve_takes_half_and_ties_to_lower_index(isa):
    q, k = blocks_of([0, 0, 0, 0, 8, 7, 6, 0])
    imp = np.zeros(8 * BS, np.float32)
    imp[0 * BS:1 * BS] = 1.0          # blocks 0 and 2 tie on importance
    imp[2 * BS:3 * BS] = 1.0
    imp[3 * BS] = 0.5
    # k=4: reserve (4+1)//2 = 2 -> blocks 0, 2; fill by probe -> 4, 5;
    # recency replaces 5 (the last probe pick) with 7.
    assert select(q, k, k_blocks=4, importance=imp) == [0, 2, 4, 7]
    assert select(q, k, k_blocks=4, importance=imp, recency=False) == [0, 2, 4, 5]
    # k=3: reserve 2 -> 0, 2; the single probe pick 4 is replaced by 7.
    assert select(q, k, k_blocks=3, importance=imp) == [0, 2, 7]


def test_importance_picks_are_never_evicted(isa):
    q, k = blocks_of([0, 9, 0, 0])
    imp = np.zeros(4 * BS, np.float32)
    imp[:BS] = 1
    # k=1 with importance: the one slot is importance's; no probe pick, so
    # recency has nothing to replace and the needle (block 1) is lost.
    assert select(q, k, k_blocks=1, importance=imp) == [0]
    # Without importance the probe picks block 1, recency replaces it.
    assert select(q, k, k_blocks=1) == [3]
    assert select(q, k, k_blocks=1, recency=False) == [1]


def test_sinks_come_first_and_count_within_k(isa):
    q, k = blocks_of([0, 0, 9, 8, 7, 0])
    assert select(q, k, k_blocks=3, sink_blocks=1, recency=False) == [0, 2, 3]
    assert select(q, k, k_blocks=3, sink_blocks=1) == [0, 2, 5]
    assert select(q, k, k_blocks=2, sink_blocks=5) == [0, 1]


def test_importance_fraction_zero_disables_reserve(isa):
    q, k = blocks_of([0, 9, 0, 8])
    imp = np.zeros(4 * BS, np.float32)
    imp[:BS] = 1
    assert select(q, k, k_blocks=2, importance=imp, importance_fraction=0.0) == [1, 3]
    assert select(q, k, k_blocks=2, importance=imp, importance_fraction=1.0) == [0, 1]


def test_partial_last_block_and_k_beyond_blocks(isa):
    q, k = blocks_of([1, 2, 3])
    # seq_len 17 -> blocks [0,8), [8,16), [16,17): three blocks, all chosen.
    assert select(q, k, k_blocks=10, seq_len=17) == [0, 1, 2]
    assert sa.select_blocks(q, k, k_blocks=10, seq_len=17, block_size=BS).shape == (1, 3)


def test_probe_takes_max_over_samples_not_the_first_key(isa):
    """A needle in the middle of a block is found because the probe takes the
    max over its sampled positions (spec §2.2)."""
    q, k = blocks_of([1, 1, 1, 1])
    k[0, 2 * BS + 4, 0] = 50.0        # block 2, sampled position p0 + 4 (step 1)
    assert select(q, k, k_blocks=1, recency=False, n_probe=8) == [2]
    # With 2 samples per block (positions p0, p0+4) it is still seen ...
    assert select(q, k, k_blocks=1, recency=False, n_probe=2) == [2]
    # ... with one sample (p0 only) it is not: ties go to block 0.
    assert select(q, k, k_blocks=1, recency=False, n_probe=1) == [0]


def test_probe_positions_follow_spec():
    """step = max(1, len // n_probe): a block of 8 with n_probe 3 samples 0, 2, 4, 6."""
    D = 4
    k = np.zeros((1, 8, D), np.float32)
    q = np.zeros((1, D), np.float32)
    q[0, 0] = 1
    for pos, seen in [(2, True), (6, True), (3, False), (7, False)]:
        k[0, :, 0] = 0
        k[0, pos, 0] = 1
        got = sa.probe_scores(q, k, block_size=8, n_probe=3)[0, 0]
        assert got == (1.0 if seen else 0.0), pos


def test_every_head_gets_min_k_nblocks_ascending(isa, rng):
    H, Hkv, D, S = 8, 4, 32, 500
    k = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    q = rng.standard_normal((H, D), dtype=np.float32)
    for kb in (1, 4, 16, 100):
        blocks = sa.select_blocks(q, k, k_blocks=kb)
        assert blocks.shape == (H, min(kb, 16))
        assert (np.diff(blocks, axis=1) > 0).all()
        assert blocks.min() >= 0 and blocks.max() < 16

"""sparse_attn.KVState: the state kept beside a KV another framework owns,
against the stateless calls over the same arrays (no torch needed)."""
import copy
import pickle

import numpy as np
import pytest

import sparse_attn as sa


def kv(seed, S, hkv=2, D=64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((hkv, S, D)).astype(np.float32),
            rng.standard_normal((hkv, S, D)).astype(np.float32))


def prompt_q(seed, T, H=4, D=64):
    return np.random.default_rng(seed).standard_normal((H, T, D)).astype(np.float32)


def test_prefill_then_decode_is_the_stateless_calls():
    """A prompt's prefill records the importance sa.prefill returns; each
    decode step after it, whatever the policy, is sparse_decode with that
    importance (and a fresh channel copy for balanced), bit for bit."""
    K, V = kv(1, 330)
    st = sa.KVState()
    q = prompt_q(2, 250)
    assert st.bind(K[:, :250], V[:, :250], 250) == 250
    out = st.prefill(q, scale=0.125, threads=1)
    want, imp = sa.prefill(q, K[:, :250], V[:, :250], scale=0.125, threads=1)
    assert out.tobytes() == want.tobytes()
    assert st.importance.tobytes() == imp.tobytes() and st.length == 250
    qd = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    for S in (251, 252, 290, 330):
        st.bind(K[:, :S], V[:, :S], S - st.length)
        full = np.concatenate([imp, np.zeros(S - 250, np.float32)])
        assert np.array_equal(st.importance, full)
        for policy in ("seed", "recall", "fast", "balanced"):
            got, blocks = st.decoder(policy=policy, k_blocks=3, scale=0.125, threads=1,
                                     return_blocks=True)(qd)
            w, wb = sa.sparse_decode(qd, K[:, :S], V[:, :S], importance=full, policy=policy,
                                     k_blocks=3, scale=0.125, threads=1, return_blocks=True)
            assert got.tobytes() == w.tobytes() and np.array_equal(blocks, wb), (S, policy)
        dense = st.dense_decode(qd, scale=0.125, threads=1)
        assert dense.tobytes() == sa.dense_decode(qd, K[:, :S], V[:, :S], scale=0.125,
                                                  threads=1).tobytes()


def test_sparse_prefill_chunks_read_the_record():
    """A second prompt chunk's sparse prefill gets the importance recorded
    before it (the reserve ranks it), as sa.prefill given it does."""
    K, V = kv(4, 400)
    st = sa.KVState()
    q1, q2 = prompt_q(5, 300), prompt_q(6, 100)
    st.bind(K[:, :300], V[:, :300], 300)
    st.prefill(q1, threads=1)
    before = st.importance.copy()
    st.bind(K, V, 100)
    got = st.prefill(q2, threads=1, k_blocks=2, policy="seed")
    want, imp = sa.prefill(q2, K, V, start=300, threads=1, k_blocks=2, policy="seed",
                           importance=before)
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(st.importance, np.concatenate([before, np.zeros(100, np.float32)])
                          + imp)


def test_crop_keeps_the_kept_tokens_and_refuses_more_than_recorded():
    K, V = kv(7, 200)
    st = sa.KVState()
    st.bind(K[:, :150], V[:, :150], 150)
    st.prefill(prompt_q(8, 150), threads=1)
    rec = st.importance.copy()
    st.bind(K[:, :101], V[:, :101], 1)        # cropped to 100, one new token
    assert np.array_equal(st.importance, np.concatenate([rec[:100], [0]]))
    with pytest.raises(sa.UnsupportedError, match="recorded 101"):
        st.bind(K[:, :150], V[:, :150], 1)   # 149 rows before the new one
    st.bind(K[:, :40], V[:, :40], 40)         # a new sequence
    assert st.length == 40 and not st.importance.any()


def test_channel_copy_made_once_and_kept_across_steps():
    K, V = kv(9, 2300)
    st = sa.KVState()
    for S, T in [(100, 100), (101, 1), (2100, 1999), (2300, 200)]:
        st.bind(K[:, :S], V[:, :S], T)
        got, want = st.channels(32), sa.channel_copy(K[:, :S], block_size=32)
        assert np.array_equal(got.data, want.data) and np.array_equal(got.scales, want.scales)
    assert st.metadata_nbytes >= got.data.nbytes + got.scales.nbytes
    assert st.nbytes - st.metadata_nbytes >= 4 * 2300        # the record: a float a token
    assert sa.KVState().metadata_nbytes == 0


def test_copies_and_pickles_carry_the_record_and_copy_not_the_arrays():
    K, V = kv(10, 300)
    st = sa.KVState()
    st.bind(K[:, :299], V[:, :299], 299)
    st.prefill(prompt_q(11, 299), threads=1)
    st.bind(K, V, 1)
    st.channels(32)
    qd = prompt_q(12, 1)[:, 0]
    want = st.decoder(policy="balanced", k_blocks=2, threads=1)(qd)
    for other in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert other.k is None and other.length == 300
        assert np.array_equal(other.importance, st.importance)
        with pytest.raises(sa.ArgumentError, match="bind"):
            other.decoder(k_blocks=2)
        other.bind(K, V, 0)
        assert other.decoder(policy="balanced", k_blocks=2, threads=1)(qd).tobytes() == \
            want.tobytes()
        other.bind(K[:, :10], V[:, :10], 10)   # the copy's own sequence now
        assert st.length == 300


def test_decode_batch_is_each_alone():
    states, steps, wants = [], [], []
    rng = np.random.default_rng(13)
    for i, S in enumerate((70, 300, 129)):
        K, V = kv(20 + i, S)
        st = sa.KVState()
        st.bind(K, V, S)
        st.prefill(prompt_q(30 + i, S), threads=1)
        q = rng.standard_normal((4, 64)).astype(np.float32)
        dec = st.decoder(k_blocks=2, policy="recall", threads=1) if i != 1 else \
            st.decoder(dense=True, threads=1)
        states.append(st)
        wants.append(dec(q))
        steps.append((dec, q, np.empty((4, 64), np.float32)))
    for threads in (1, 2, 3):
        sa.decode_batch(steps, threads=threads)
        for (_, _, out), want in zip(steps, wants):
            assert out.tobytes() == want.tobytes()


def test_refusals_name_the_argument():
    K, V = kv(14, 64)
    st = sa.KVState()
    with pytest.raises(sa.ArgumentError, match="bind"):
        st.prefill(prompt_q(1, 1))
    st.bind(K[:, :2], V[:, :2], 2)
    with pytest.raises(sa.ArgumentError, match="T = the 2 new rows"):
        st.prefill(prompt_q(1, 3))
    st = sa.KVState()
    with pytest.raises(sa.ArgumentTypeError, match="numpy"):
        st.bind(K.tolist(), V, 1)
    with pytest.raises(sa.ArgumentError, match="new_rows"):
        st.bind(K, V, -1)
    with pytest.raises(sa.ArgumentError, match="rows for new_rows"):
        st.bind(K, V[:, :63], 1)
    with pytest.raises(sa.ArgumentError, match="rows for new_rows"):
        st.bind(K, V, 65)
    with pytest.raises(sa.ArgumentTypeError, match="float32"):
        st.bind(K.astype(np.float64), V, 64)
    assert st.k is None                 # a refused bind leaves nothing bound
    st.bind(K, V, 64)
    with pytest.raises(sa.ArgumentError, match="the state's own"):
        st.decoder(importance=np.zeros(64, np.float32))
    with pytest.raises(sa.ArgumentError, match="k_blocks"):
        st.decoder(k_blocks=0)
    with pytest.raises(sa.ArgumentError, match="the state's own"):
        st.prefill(prompt_q(1, 64), start=3)
    dec = st.decoder(k_blocks=1, threads=1)
    q = prompt_q(2, 1)[:, 0]
    with pytest.raises(sa.ArgumentTypeError, match=r"steps\[0\]\[0\]"):
        sa.decode_batch([(object(), q, np.empty((4, 64), np.float32))])
    with pytest.raises(sa.ArgumentError, match=r"steps\[0\]: out"):
        sa.decode_batch([(dec, q, np.empty((4, 64), np.float64))])
    ro = np.empty((4, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(sa.ArgumentError, match=r"steps\[0\]: out"):
        sa.decode_batch([(dec, q, ro)])
    with pytest.raises(sa.ArgumentTypeError, match=r"steps\[1\]"):
        sa.decode_batch([(dec, q, np.empty((4, 64), np.float32)), (dec, q)])
    imp = st.importance
    with pytest.raises(ValueError):
        imp[0] = 1.0                    # the record is read-only from outside

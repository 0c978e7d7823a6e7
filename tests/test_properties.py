"""Property tests (hypothesis): every entry point against the numpy reference
over random shapes, GQA ratios, partial blocks, block sizes, budgets, knobs
and both KV dtypes, on every kernel path this CPU runs.  Derandomized, so a
CI run is repeatable; selections are compared exactly only where the
reference's scores have no near-tie (a float32 rounding may then legitimately
pick the other block)."""
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn import reference as ref

from conftest import rel_err, rtol_for

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])
# Scores closer than this (relative to the largest) count as a near-tie.
TIE = 1e-4


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    dtype = draw(st.sampled_from(["float32", "q8"]))
    gs = draw(st.sampled_from([8, 16, 32])) if dtype == "q8" else 32
    d = gs * draw(st.integers(1, 4)) if dtype == "q8" else draw(st.sampled_from([7, 16, 64, 96]))
    bs = draw(st.sampled_from([4, 7, 16, 32]))
    seq = draw(st.integers(1, 12 * bs))
    extra = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((hkv, seq + extra, d), dtype=np.float32)
    v = rng.standard_normal((hkv, seq + extra, d), dtype=np.float32)
    if dtype == "q8":
        k, v = sa.quantize_q8(k, gs), sa.quantize_q8(v, gs)
    q = rng.standard_normal((hkv * group, d), dtype=np.float32)
    imp = rng.random(seq + extra, dtype=np.float32) if draw(st.booleans()) else None
    knobs = dict(k_blocks=draw(st.integers(1, 14)), block_size=bs,
                 n_probe=draw(st.sampled_from([1, 3, 8, "all"])),
                 recency=draw(st.booleans()),
                 importance_fraction=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
                 sink_blocks=draw(st.integers(0, 2)),
                 share=draw(st.sampled_from(["head", "group"])),
                 scoring=draw(st.sampled_from(["probe", "minmax"])))
    return q, k, v, seq, imp, knobs, rng


def _no_near_ties(values):
    v = np.sort(np.asarray(values, np.float64).ravel())
    scale = max(np.abs(v).max(), 1e-30)
    return v.size < 2 or np.diff(v).min() > TIE * scale


def _selection_is_well_posed(q, k, seq, imp, knobs):
    """True when neither the scores a head ranks nor the importance block
    sums have near-ties."""
    bs, share = knobs["block_size"], knobs["share"]
    if knobs["scoring"] == "minmax":
        scores = ref.minmax_scores(q, ref.block_bounds(k, block_size=bs, seq_len=seq))
    else:
        scores = ref.probe_scores(q, k, seq_len=seq, block_size=bs, n_probe=knobs["n_probe"])
    group = q.shape[0] // k.shape[0]
    if share == "group":
        scores = scores.reshape(k.shape[0], group, -1).sum(axis=1)
    if not all(_no_near_ties(row) for row in scores):
        return False
    if imp is not None:
        nb = -(-seq // bs)
        sums = [imp[b * bs:min((b + 1) * bs, seq)].astype(np.float64).sum() for b in range(nb)]
        return _no_near_ties(sums)
    return True


@SETTINGS
@given(problems())
def test_sparse_decode_and_selection_match_the_reference(isa, problem):
    q, k, v, seq, imp, knobs, _ = problem
    assume(_selection_is_well_posed(q, k, seq, imp, knobs))
    out, blocks = sa.sparse_decode(q, k, v, seq_len=seq, importance=imp, return_blocks=True,
                                   **knobs)
    want, want_blocks = ref.sparse_decode(q, k, v, seq_len=seq, importance=imp,
                                          return_blocks=True, **knobs)
    np.testing.assert_array_equal(blocks, want_blocks)
    np.testing.assert_array_equal(sa.select_blocks(q, k, seq_len=seq, importance=imp, **knobs),
                                  want_blocks)
    assert rel_err(out, want) < rtol_for(k)
    nb = -(-seq // knobs["block_size"])
    if knobs["k_blocks"] >= nb:          # every block chosen: bitwise dense decode
        assert out.tobytes() == sa.dense_decode(q, k, v, seq_len=seq).tobytes()


@SETTINGS
@given(problems())
def test_dense_decode_probe_and_prefill_match_the_reference(isa, problem):
    q, k, v, seq, _, knobs, rng = problem
    scale = float(rng.uniform(0.05, 1.0))
    assert rel_err(sa.dense_decode(q, k, v, seq_len=seq, scale=scale),
                   ref.dense_decode(q, k, v, seq_len=seq, scale=scale)) < rtol_for(k)
    bs, n_probe = knobs["block_size"], knobs["n_probe"]
    assert rel_err(sa.probe_scores(q, k, seq_len=seq, block_size=bs, n_probe=n_probe),
                   ref.probe_scores(q, k, seq_len=seq, block_size=bs, n_probe=n_probe)) \
        < rtol_for(k)
    T = int(rng.integers(1, min(seq, 20) + 1))
    start = seq - T
    qp = rng.standard_normal((q.shape[0], T, q.shape[1]), dtype=np.float32)
    out, imp = sa.prefill(qp, k, v, start=start, scale=scale)
    want, want_imp = ref.prefill(qp, k, v, start=start, scale=scale)
    assert rel_err(out, want) < rtol_for(k) and rel_err(imp, want_imp) < rtol_for(k)

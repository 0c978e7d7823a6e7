"""Spec §8: sparse decode in llama.cpp's attention op (sa_ggml_flash_attn
with a selection, what the ggml backend runs with SPARSE_ATTN_K_BLOCKS) on
every kernel path against reference.ggml_flash_attn, over arrays laid out
as llama.cpp lays them out; and the backend's settings parser against
sparse_attn.selection."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import _ggml
from sparse_attn import reference as ref
from sparse_attn._ffi import ffi, lib
from sparse_attn.selection import (LLAMA_CPP_POLICY, POLICIES, selection, stateless_selection,
                                   stateless_spec)

from conftest import F32_RTOL, Q8_RTOL, rel_err
from test_ggml_attn import Q_PAD, batch_mask, cache_views, queries

RTOL = {"f16": F32_RTOL, "q8_0": Q8_RTOL}


def operands(rng, ns, H, Hkv, D, n_q, n_kv, n_seqs, kind, holes=0.1):
    mask, unused = batch_mask(rng, ns, n_q, n_kv, n_seqs, holes=holes)
    k, v = cache_views(rng, ns, n_kv, Hkv, D, kind)
    return queries(rng, ns, n_q, H, D), k, v, mask


# (ns, H, Hkv, D, n_q, n_kv, n_seqs): GQA 1, 3 and 7; one row and a few
# rows of a decode batch (one per sequence); two streams; caches of several
# spans and probe parts (64 blocks of 32 cells).
SHAPES = [
    (1, 9, 3, 64, 1, 2304, 1),       # SmolLM2's heads
    (2, 4, 4, 64, 1, 1280, 2),       # two streams, MHA
    (1, 14, 2, 64, 3, 2560, 3),      # Qwen2.5-0.5B's GQA 7, three sequences decoding
    (1, 8, 2, 128, 2, 1024, 2),
]
KNOBS = [dict(), dict(share="head"), dict(n_probe="all"), dict(sink_blocks=2, recency=False),
         dict(policy="recall")]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("ns,H,Hkv,D,n_q,n_kv,n_seqs", SHAPES)
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
                         or "default")
def test_matches_reference(isa, rng, kind, ns, H, Hkv, D, n_q, n_kv, n_seqs, knobs):
    q, k, v, mask = operands(rng, ns, H, Hkv, D, n_q, n_kv, n_seqs, kind)
    got, blocks = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=6,
                                       return_blocks=True, **knobs)
    want, want_blocks = ref.ggml_flash_attn(q, k, v, mask, 0.125, k_blocks=6,
                                            return_blocks=True, **knobs)
    np.testing.assert_array_equal(blocks, want_blocks)
    assert (blocks[..., -1] >= 0).all()         # every row sparse: 6 blocks each
    assert rel_err(got, want) < RTOL[kind]
    exact = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125)
    assert rel_err(got, exact) > 1e-3           # it did leave cells out


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("share", ["group", "head"])
def test_every_block_chosen_is_the_exact_path_bitwise(isa, rng, kind, share):
    """A row with k_blocks >= its blocks reads its cells through the exact
    path's arithmetic, also in a call whose other rows are sparse."""
    ns, H, Hkv, D, n_q, n_kv = 1, 6, 2, 64, 3, 2048
    q, k, v, mask = operands(rng, ns, H, Hkv, D, n_q, n_kv, 3, kind)
    exact = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125)
    every = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=1 << 20, share=share)
    assert every.tobytes() == exact.tobytes()
    # rows of three sequences with 17 or 18 blocks each: k = the fewest
    # leaves the longer ones sparse and the others exact
    n_valid = (mask[0, 0, :n_q] != -np.inf).sum(axis=1)
    nb = -(-n_valid // 32)
    kb = int(nb.min())
    mixed, blocks = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=kb, share=share,
                                         return_blocks=True)
    for i in range(n_q):
        if nb[i] <= kb:
            assert mixed[0, i].tobytes() == exact[0, i].tobytes()
            assert (blocks[0, i, :, :nb[i]] == np.arange(nb[i])).all()
        else:
            assert mixed[0, i].tobytes() != exact[0, i].tobytes()
    assert (nb > kb).any() and (nb <= kb).any()


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("knobs", [dict(), dict(share="head")])
def test_thread_count_does_not_change_bytes(isa, rng, kind, knobs):
    q, k, v, mask = operands(rng, 2, 9, 3, 64, 2, 4608, 2, kind)
    runs = [_ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=8, threads=t,
                                 return_blocks=True, **knobs) for t in (1, 2, 3, 5, 1)]
    assert len({o.tobytes() for o, _ in runs}) == 1
    assert len({b.tobytes() for _, b in runs}) == 1


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_cells_of_no_chosen_block_are_never_read(isa, rng, kind):
    """Cells outside the rows' sequences hold NaN and Inf, and so do the
    valid cells of every block no head chose: the result is bitwise the one
    with finite values there."""
    ns, H, Hkv, D, n_q, n_kv = 1, 4, 2, 64, 2, 2048
    mask, unused = batch_mask(rng, ns, n_q, n_kv, 2, holes=0.3)
    q = queries(rng, ns, n_q, H, D)
    clean = cache_views(np.random.default_rng(5), ns, n_kv, Hkv, D, kind)
    want, blocks = _ggml.flash_attn_ext(q, *clean, mask, scale=0.125, k_blocks=4,
                                        share="head", n_probe="all", return_blocks=True)
    # the cells a row's probe or attention reads: with n_probe "all" the
    # probe reads every valid cell, so poison only what no row may read
    dirty = cache_views(np.random.default_rng(5), ns, n_kv, Hkv, D, kind, unused)
    got = _ggml.flash_attn_ext(q, *dirty, mask, scale=0.125, k_blocks=4, share="head",
                               n_probe="all")
    assert np.isfinite(got).all() and got.tobytes() == want.tobytes()
    # n_probe 1: the probe reads each block's first valid cell only; every
    # other cell of an unchosen block may hold anything
    want, blocks = _ggml.flash_attn_ext(q, *clean, mask, scale=0.125, k_blocks=4, n_probe=1,
                                        return_blocks=True)
    poison = unused.copy()
    for i in range(n_q):
        cells = np.flatnonzero(mask[0, 0, i, :n_kv] != -np.inf)
        for b in range(-(-len(cells) // 32)):
            if not (blocks[0, i] == b).any():
                poison[0, cells[b * 32 + 1:(b + 1) * 32]] = True
    for i in range(n_q):          # ... unless another row reads them
        cells = np.flatnonzero(mask[0, 0, i, :n_kv] != -np.inf)
        for b in np.unique(blocks[0, i]):
            poison[0, cells[b * 32:(b + 1) * 32]] = False
        poison[0, cells[::32]] = False
    dirty = cache_views(np.random.default_rng(5), ns, n_kv, Hkv, D, kind, poison)
    got = _ggml.flash_attn_ext(q, *dirty, mask, scale=0.125, k_blocks=4, n_probe=1)
    assert poison.sum() > unused.sum() + 500
    assert np.isfinite(got).all() and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_the_probe_finds_a_needle_among_holes(isa, rng, kind):
    """A key aligned with the query at one valid cell far back, the cells
    around it freed or another sequence's: its block (of valid cells, not
    of cache cells) is chosen beside the last one."""
    ns, H, Hkv, D, n_kv = 1, 3, 1, 64, 1024
    k = rng.standard_normal((ns, n_kv, Hkv, D), dtype=np.float32) * 0.1
    v = rng.standard_normal((ns, n_kv, Hkv, D), dtype=np.float32)
    q = rng.standard_normal((ns, 1, H, D), dtype=np.float32)
    mask = np.full((1, 1, Q_PAD, n_kv), -np.inf, np.float16)
    valid = np.flatnonzero(rng.random(n_kv) < 0.5)           # half the cells freed
    mask[0, 0, 0, valid] = 0
    needle = valid[100]                                     # position 100: block 3
    k[0, needle, 0] = q[0, 0].sum(axis=0) * 0.5
    if kind == "f16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    else:
        k, v = _ggml.quantize_q8_0(k), _ggml.quantize_q8_0(v)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    q = q.transpose(0, 2, 1, 3)
    nb = -(-len(valid) // 32)
    out, blocks = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=2, n_probe=32,
                                       return_blocks=True)
    assert (blocks[0, 0] == [3, nb - 1]).all()
    want = ref.ggml_flash_attn(q, k, v, mask, 0.125, k_blocks=2, n_probe=32)
    assert rel_err(out, want) < RTOL[kind]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_prompt_batches_and_head_planes_stay_exact(isa, rng, kind):
    q, k, v, mask = operands(rng, 1, 6, 2, 64, 9, 1024, 2, kind)
    exact = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125)
    got, blocks = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=2,
                                       return_blocks=True)
    assert got.tobytes() == exact.tobytes() and (blocks == -1).all()
    q1 = np.ascontiguousarray(q[:, :, :1])
    planes = np.repeat(mask, 6, axis=1)                      # a plane per head
    exact = _ggml.flash_attn_ext(q1, k, v, planes, scale=0.125)
    got = _ggml.flash_attn_ext(q1, k, v, planes, scale=0.125, k_blocks=2)
    assert got.tobytes() == exact.tobytes()


def test_sparse_call_says_which_calls_choose_blocks(rng):
    """sa_ggml_sparse_call, which the backend counts its sparse calls by:
    a selection, at most SA_GGML_DECODE_ROWS rows, one mask plane."""
    sel = stateless_selection(k_blocks=2)
    for n_q, heads, select, want in [(1, 1, sel, 1), (lib.SA_GGML_DECODE_ROWS, 1, sel, 1),
                                     (lib.SA_GGML_DECODE_ROWS + 1, 1, sel, 0),
                                     (1, 6, sel, 0), (1, 1, None, 0)]:
        q, k, v, mask = operands(rng, 1, 6, 2, 64, n_q, 256, 1, "f16")
        mask = np.ascontiguousarray(np.repeat(mask, heads, axis=1))
        out = np.empty((1, n_q, 6, 64), np.float32)
        a, keep = _ggml.op_struct(q, k, v, mask, out, scale=0.125, select=select)
        assert lib.sa_ggml_sparse_call(a) == want, (n_q, heads, select)


def test_no_mask_is_one_sequence_of_every_cell(isa, rng):
    k, v = cache_views(rng, 1, 700, 2, 64, "f16")
    q = queries(rng, 1, 1, 4, 64)
    got, blocks = _ggml.flash_attn_ext(q, k, v, None, scale=0.1, k_blocks=3,
                                       return_blocks=True)
    want, want_blocks = ref.ggml_flash_attn(q, k, v, None, 0.1, k_blocks=3, return_blocks=True)
    np.testing.assert_array_equal(blocks, want_blocks)
    assert blocks[0, 0, 0, -1] == 21 and rel_err(got, want) < F32_RTOL


# ----------------------------------------------------------------- refusals

@pytest.mark.parametrize("knobs,words", [
    (dict(policy="seed"), "importance_fraction 0.5 needs the importance"),
    (dict(importance_fraction=0.25), "importance_fraction 0.25"),
    (dict(policy="fast"), "scoring=minmax reads key bounds"),
    (dict(policy="balanced"), "scoring=channels reads a channel copy"),
    (dict(scoring="channels"), "scoring=channels"),
])
def test_stateful_selections_are_refused_by_name(rng, knobs, words):
    q, k, v, mask = operands(rng, 1, 4, 2, 64, 1, 512, 1, "f16")
    with pytest.raises(sa.UnsupportedError, match=words):
        _ggml.flash_attn_ext(q, k, v, mask, scale=0.125, k_blocks=4, **knobs)
    with pytest.raises(sa.UnsupportedError, match=words):
        ref.ggml_flash_attn(q, k, v, mask, 0.125, k_blocks=4, **knobs)


def test_the_c_check_refuses_a_selection_that_needs_state(rng):
    q, k, v, mask = operands(rng, 1, 4, 2, 64, 1, 512, 1, "f16")
    out = np.empty((1, 1, 4, 64), np.float32)
    for change, status in [(dict(scoring=lib.SA_SCORING_MINMAX), lib.SA_ERR_UNSUPPORTED),
                           (dict(importance_blocks=2), lib.SA_ERR_UNSUPPORTED),
                           (dict(k_blocks=0), lib.SA_ERR_PARAM),
                           (dict(n_probe=0), lib.SA_ERR_PARAM)]:
        a, keep = _ggml.op_struct(q, k, v, mask, out, scale=0.125,
                                  select=stateless_selection(k_blocks=4))
        for name, value in change.items():
            setattr(a.select, name, value)
        assert lib.sa_ggml_flash_attn_check(a) == status
        assert lib.sa_ggml_flash_attn(a, 2) == status


# ------------------------------------------------------- the backend's settings

def c_settings(k_blocks=None, policy=None, dense=None):
    """sa_ggml_settings_parse over the texts: (status, settings, reason)."""
    st = ffi.new("sa_ggml_settings *")
    why = ffi.new("char[256]")
    enc = [ffi.NULL if t is None else t.encode() for t in (k_blocks, policy, dense)]
    rc = lib.sa_ggml_settings_parse(*enc, st, why, 256)
    return rc, st, ffi.string(why).decode()


def fields(sel):
    return dict(block_size=sel.block_size, k_blocks=sel.k_blocks, n_probe=sel.n_probe,
                recency=int(sel.recency), importance_blocks=0, sink_blocks=sel.sink_blocks,
                share=lib.SA_SHARE_GROUP if sel.share == "group" else lib.SA_SHARE_HEAD,
                scoring=lib.SA_SCORING_PROBE)


def c_fields(st):
    return {name: getattr(st.select, name) for name in fields(stateless_selection(k_blocks=1))}


@pytest.mark.parametrize("policy", [None, *POLICIES, "recall:share=group,n_probe=4",
                                    "seed:importance_fraction=0,sink_blocks=1,recency=no",
                                    "fast:scoring=probe", "balanced:scoring=probe",
                                    "seed:importance_fraction=0.25"])
def test_the_c_parser_reads_policies_as_selection_does(policy):
    """The backend's SPARSE_ATTN_POLICY means what the Python layer's policy
    means: the same presets (selection.POLICIES), knobs and refusals."""
    from sparse_attn.selection import parse_policy
    rc, st, why = c_settings("12", policy)
    if policy is None:
        knobs = dict(LLAMA_CPP_POLICY)
    else:
        knobs = parse_policy(policy)[1]
    block_size = knobs.pop("block_size", 32)
    try:
        sel = stateless_selection(
            "recall", k_blocks=12, block_size=block_size,
            **{k: knobs[k] for k in ("n_probe", "importance_fraction", "sink_blocks", "share",
                                     "scoring")}, recency=knobs.get("recency", True))
    except sa.UnsupportedError as e:
        assert rc == lib.SA_ERR_UNSUPPORTED and why.split(": ", 1)[1] in str(e), why
        return
    assert rc == lib.SA_OK, why
    assert st.k_blocks == 12 and c_fields(st) == fields(sel)
    rc2, st2, _ = c_settings("12", stateless_spec(sel))
    assert rc2 == lib.SA_OK and c_fields(st2) == fields(sel)


def test_block_size_knob_is_read_by_both():
    """block_size is a knob of the backend's policy text (the Python layer
    passes it as one): parse_policy does not know it, so that one case is
    checked here alone."""
    rc, st, _ = c_settings("3", "mine:importance_fraction=0,block_size=16,n_probe=all")
    assert rc == lib.SA_OK and st.select.block_size == 16 and st.select.n_probe == 16


def test_the_default_is_exact_and_the_format_reads_back():
    rc, st, _ = c_settings()
    assert rc == lib.SA_OK and st.k_blocks == 0
    assert lib.sa_ggml_settings_exact(st, 0) == 1
    rc, st, _ = c_settings("32", "recall:share=group", "3+1+3")
    assert rc == lib.SA_OK and list(st.dense[0:st.n_dense]) == [1, 3]
    assert [lib.sa_ggml_settings_exact(st, i) for i in range(5)] == [0, 1, 0, 1, 0]
    buf = ffi.new("char[512]")
    n = lib.sa_ggml_settings_format(st, buf, 512)
    text = ffi.string(buf).decode()
    assert n == len(text) and text.startswith("k_blocks=32 policy=recall:n_probe=32,")
    assert text.endswith(" dense_layers=1+3")
    parts = dict(p.split("=", 1) for p in text.split(" "))
    rc2, st2, _ = c_settings(parts["k_blocks"], parts["policy"], parts["dense_layers"])
    assert rc2 == lib.SA_OK and c_fields(st2) == c_fields(st)
    assert list(st2.dense[0:st2.n_dense]) == [1, 3]


@pytest.mark.parametrize("k_blocks,policy,dense,words", [
    ("-1", None, None, "k_blocks: '-1' is not an int >= 0"),
    ("8x", None, None, "k_blocks: '8x'"),
    (None, "nope", None, "unknown preset 'nope'"),
    (None, "recall:n_probe=0", None, "n_probe=0 is not an int >= 1 or 'all'"),
    (None, "recall:share=both", None, "share=both"),
    (None, "recall:colour=red", None, "unknown knob 'colour'"),
    (None, "recall:share", None, "'share' is not knob=value"),
    (None, "recall:importance_fraction=2", None, "importance_fraction=2 is not a number in"),
    (None, None, "1+x", "dense layers: x is not a layer index"),
    (None, None, "+".join(map(str, range(65))), "dense layers: more than 64"),
])
def test_the_c_parser_refuses_bad_texts_by_name(k_blocks, policy, dense, words):
    rc, _, why = c_settings(k_blocks, policy, dense)
    assert rc == lib.SA_ERR_PARAM and words in why, why


def test_selection_default_is_the_papers_probe_without_state():
    sel = stateless_selection(k_blocks=32)
    assert sel == selection("recall", k_blocks=32, n_probe=8, share="group")
    assert sel.importance_blocks == 0 and sel.scoring == "probe"

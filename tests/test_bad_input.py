"""SPEC §5: every bad input raises ValueError/TypeError naming the argument,
before any C code runs; nothing crashes."""
import numpy as np
import pytest

import sparse_attn as sa

H, HKV, D, S = 4, 2, 64, 100


@pytest.fixture
def ok(rng):
    k = rng.standard_normal((HKV, S, D), dtype=np.float32)
    v = rng.standard_normal((HKV, S, D), dtype=np.float32)
    return dict(q=rng.standard_normal((H, D), dtype=np.float32), k=k, v=v,
                kq=sa.quantize_q8(k), vq=sa.quantize_q8(v))


def misaligned(shape):
    buf = np.zeros(int(np.prod(shape)) * 4 + 1, np.uint8)
    return np.frombuffer(buf.data, np.float32, int(np.prod(shape)), offset=1).reshape(shape)


def nan_q(ok):
    q = ok["q"].copy()
    q[1, 3] = np.nan
    return dict(q=q)


def inf_q(ok):
    q = ok["q"].copy()
    q[0, 0] = np.inf
    return dict(q=q)


DECODE_CASES = [
    # (description, kwargs to override, exception type, message fragment)
    ("q float64", lambda o: dict(q=o["q"].astype(np.float64)), TypeError, "q must have dtype float32"),
    ("q list", lambda o: dict(q=o["q"].tolist()), TypeError, "q must be a numpy.ndarray"),
    ("q rank 3", lambda o: dict(q=o["q"][None]), ValueError, "q must have 2 dimensions"),
    ("q wrong head_dim", lambda o: dict(q=np.zeros((H, D + 1), np.float32)), ValueError, "head_dim 64"),
    ("q non-contiguous", lambda o: dict(q=np.asfortranarray(o["q"])), ValueError, "q must be C-contiguous"),
    ("q misaligned", lambda o: dict(q=misaligned((H, D))), ValueError, "q is misaligned"),
    ("q NaN", nan_q, ValueError, "q holds NaN"),
    ("q Inf", inf_q, ValueError, "q holds NaN"),
    ("GQA", lambda o: dict(q=np.zeros((3, D), np.float32)), ValueError,
     r"n_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
    ("k float16", lambda o: dict(k=o["k"].astype(np.float16)), TypeError, "k must have dtype float32"),
    ("k rank 2", lambda o: dict(k=o["k"][0]), ValueError, "k must have 3 dimensions"),
    ("k strided rows", lambda o: dict(k=o["k"][:, ::2]), ValueError, "k must have contiguous rows"),
    ("k transposed", lambda o: dict(k=o["k"].transpose(1, 0, 2)), ValueError, "k"),
    ("k misaligned", lambda o: dict(k=misaligned((HKV, S, D))), ValueError, "k is misaligned"),
    ("k int", lambda o: dict(k=3), TypeError, "k must be a float32 numpy.ndarray or a Q8"),
    ("v mismatched heads", lambda o: dict(v=o["v"][:1]), ValueError, "k and v must agree"),
    ("k q8 v float", lambda o: dict(k=o["kq"]), TypeError, "same dtype"),
    ("seq_len 0", lambda o: dict(seq_len=0), ValueError, "seq_len must be >= 1"),
    ("seq_len beyond", lambda o: dict(seq_len=S + 1), ValueError, r"seq_len \(101\) is beyond"),
    ("seq_len float", lambda o: dict(seq_len=10.0), TypeError, "seq_len must be an int"),
    ("seq_len bool", lambda o: dict(seq_len=True), TypeError, "seq_len must be an int"),
    ("k_blocks 0", lambda o: dict(k_blocks=0), ValueError, "k_blocks must be >= 1"),
    ("block_size 0", lambda o: dict(block_size=0), ValueError, "block_size must be >= 1"),
    ("n_probe 0", lambda o: dict(n_probe=0), ValueError, "n_probe must be >= 1"),
    ("n_probe -3", lambda o: dict(n_probe=-3), ValueError, "n_probe must be >= 1"),
    ("importance short", lambda o: dict(importance=np.ones(S - 1, np.float32)), ValueError,
     r"importance has 99 entries, shorter than seq_len \(100\)"),
    ("importance float64", lambda o: dict(importance=np.ones(S)), TypeError, "importance must have dtype"),
    ("importance NaN", lambda o: dict(importance=np.full(S, np.nan, np.float32)), ValueError, "importance holds NaN"),
    ("scale 0", lambda o: dict(scale=0.0), ValueError, "scale must be > 0"),
    ("scale NaN", lambda o: dict(scale=float("nan")), ValueError, "scale must be finite"),
    ("scale str", lambda o: dict(scale="1"), TypeError, "scale must be a real number"),
    ("threads 0", lambda o: dict(threads=0), ValueError, "threads must be >= 1"),
    ("recency int", lambda o: dict(recency=1), TypeError, "recency must be a bool"),
    ("share", lambda o: dict(share="layer"), ValueError, "share must be one of"),
    ("importance_fraction", lambda o: dict(importance_fraction=1.5), ValueError, "importance_fraction must be <= 1"),
    ("sink_blocks", lambda o: dict(sink_blocks=-1), ValueError, "sink_blocks must be >= 0"),
]


@pytest.mark.parametrize("desc,override,exc,msg", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_sparse_decode_rejects(ok, desc, override, exc, msg):
    args = dict(q=ok["q"], k=ok["k"], v=ok["v"])
    args.update(override(ok))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg) as info:
        sa.sparse_decode(q, k, v, **args)
    assert isinstance(info.value, sa.SparseAttnError)


@pytest.mark.parametrize("desc,override,exc,msg",
                         [c for c in DECODE_CASES if c[0] not in ("v mismatched heads", "k q8 v float")
                          and "importance" not in c[0] and c[0] not in
                          ("k_blocks 0", "recency int", "share", "importance_fraction",
                           "sink_blocks", "block_size 0", "n_probe 0", "n_probe -3")],
                         )
def test_dense_decode_rejects(ok, desc, override, exc, msg):
    args = dict(q=ok["q"], k=ok["k"], v=ok["v"])
    args.update(override(ok))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg):
        sa.dense_decode(q, k, v, **args)


def test_select_and_probe_reject(ok):
    with pytest.raises(ValueError, match="k_blocks"):
        sa.select_blocks(ok["q"], ok["k"], k_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        sa.probe_scores(ok["q"], ok["k"], block_size=0)
    with pytest.raises(ValueError, match="n_probe"):
        sa.probe_scores(ok["q"], ok["k"], n_probe=0)
    with pytest.raises(ValueError, match="seq_len"):
        sa.select_blocks(ok["q"], ok["k"], seq_len=S + 5)


def test_q8_rejects(ok, rng):
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide the last axis of x \(64\)"):
        sa.quantize_q8(ok["k"], group_size=48)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        sa.quantize_q8(ok["k"], group_size=0)
    bad = ok["k"].copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="x holds NaN or Inf"):
        sa.quantize_q8(bad)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        sa.quantize_q8(ok["k"].astype(np.float64))
    with pytest.raises(ValueError, match="Q8.scales must have shape"):
        sa.Q8(ok["kq"].data, ok["kq"].scales[..., :1], 32)
    with pytest.raises(ValueError, match="group_size"):
        sa.Q8(ok["kq"].data, ok["kq"].scales, 48)
    bad_data = ok["kq"].data.copy()
    bad_data[1, 5, 7] = -128                    # outside SPEC §4's [-127, 127]
    with pytest.raises(ValueError, match="-128"):
        sa.Q8(bad_data, ok["kq"].scales, 32)
    bad_scales = ok["kq"].scales.copy()
    bad_scales[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="Q8.scales holds NaN"):
        sa.Q8(ok["kq"].data, bad_scales, 32)
    # K and V quantised with different group sizes
    with pytest.raises(ValueError, match="group_size"):
        sa.dense_decode(ok["q"], ok["kq"], sa.quantize_q8(ok["v"], 16))


def test_prefill_rejects(ok, rng):
    q3 = rng.standard_normal((H, 10, D), dtype=np.float32)
    with pytest.raises(ValueError, match=r"start \+ T \(95 \+ 10\) is beyond the KV"):
        sa.prefill(q3, ok["k"], ok["v"], start=95)
    with pytest.raises(ValueError, match="start must be >= 0"):
        sa.prefill(q3, ok["k"], ok["v"], start=-1)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        sa.prefill(ok["q"], ok["k"], ok["v"])
    q3[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="q holds NaN"):
        sa.prefill(q3, ok["k"], ok["v"])


def test_isa_rejects():
    with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
        sa.set_isa("sse9")
    with pytest.raises(TypeError):
        sa.set_isa(3)
    for name in sa.built_isas():
        if name not in sa.available_isas():
            with pytest.raises(ValueError, match="this CPU cannot run"):
                sa.set_isa(name)


def test_kernels_alone_reject(ok, rng):
    with pytest.raises(TypeError, match="Q8"):
        sa.q8_dot(ok["q"][0], ok["kq"])
    q = sa.quantize_q8(ok["q"][0])
    with pytest.raises(ValueError, match="rows"):
        sa.q8_dot(q, ok["kq"])
    with pytest.raises(ValueError, match="p has 3 weights for 100 rows"):
        sa.accumulate_v(np.ones(3, np.float32), ok["v"][0])

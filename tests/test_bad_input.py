"""spec §5: every bad input raises ValueError/TypeError naming the argument,
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
    ("q big-endian", lambda o: dict(q=o["q"].astype(">f4")), TypeError,
     "q must be native-endian float32, got >f4"),
    ("q empty", lambda o: dict(q=np.zeros((0, D), np.float32)), ValueError,
     r"q is empty: axis 0 of its shape \(0, 64\)"),
    ("q NaN", nan_q, ValueError, "q holds NaN"),
    ("q Inf", inf_q, ValueError, "q holds NaN"),
    ("q 2**48", lambda o: dict(q=np.full((H, D), 2.0**48, np.float32)), ValueError,
     r"q holds NaN or Inf values, or magnitudes of 2\*\*48"),
    ("GQA", lambda o: dict(q=np.zeros((3, D), np.float32)), ValueError,
     r"n_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
    ("k float16", lambda o: dict(k=o["k"].astype(np.float16)), TypeError, "k must have dtype float32"),
    ("k empty", lambda o: dict(k=np.zeros((HKV, 0, D), np.float32)), ValueError, "k is empty"),
    ("k, v rows differ", lambda o: dict(v=o["v"][:, :64].copy()), ValueError,
     r"k and v hold different numbers of rows \(100 and 64\): pass seq_len"),
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
    ("k_blocks 2**31", lambda o: dict(k_blocks=2**31), ValueError,
     "k_blocks must be <= 2147483647"),
    ("block_size 2**31", lambda o: dict(block_size=2**31), ValueError, "block_size must be <="),
    ("n_probe 2**31", lambda o: dict(n_probe=2**31), ValueError, "n_probe must be <="),
    ("n_probe array", lambda o: dict(n_probe=np.array(["all"])), TypeError,
     "n_probe must be an int, got ndarray"),
    ("sink_blocks 2**31", lambda o: dict(sink_blocks=2**31), ValueError, "sink_blocks must be <="),
    ("threads 2**31", lambda o: dict(threads=2**31), ValueError, "threads must be <="),
    ("share list", lambda o: dict(share=["head"]), ValueError,
     r"share must be one of \['group', 'head'\], got \['head'\]"),
    ("scoring dict", lambda o: dict(scoring={}), ValueError, "scoring must be one of"),
    ("policy list", lambda o: dict(policy=["seed"]), ValueError, "policy must be one of"),
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
    ("scale 1e300", lambda o: dict(scale=1e300), ValueError, "scale must be a float32 number"),
    ("scale 4e38", lambda o: dict(scale=4e38), ValueError, "scale must be a float32 number"),
    ("scale 1e-300", lambda o: dict(scale=1e-300), ValueError, "scale must be a float32 number"),
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
                          and "importance" not in c[0] and c[0].split()[0] not in
                          ("k_blocks", "recency", "share", "importance_fraction", "scoring",
                           "sink_blocks", "block_size", "n_probe", "policy")],
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
    bad_data[1, 5, 7] = -128                    # outside spec §4's [-127, 127]
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


# ---------------------------------------------------------------- outputs

def test_read_only_outputs_are_refused_not_written(ok, tmp_path):
    p = np.ones(S, np.float32)
    v = ok["v"][0]
    path = tmp_path / "out.bin"
    np.zeros(D, np.float32).tofile(path)
    readonly = [np.memmap(path, np.float32, mode="r", shape=(D,)),
                np.frombuffer(bytes(4 * D), np.float32)]
    frozen = np.zeros(D, np.float32)
    frozen.flags.writeable = False
    readonly.append(frozen)
    for out in readonly:
        before = np.array(out)
        with pytest.raises(ValueError, match="out is read-only"):
            sa.accumulate_v(p, v, out=out)
        assert np.array_equal(np.asarray(out), before)
    with pytest.raises(ValueError, match=r"out must have shape \(64,\)"):
        sa.accumulate_v(p, v, out=np.zeros(D + 1, np.float32))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        sa.accumulate_v(p, v, out=np.zeros(2 * D, np.float32)[::2])


# ---------------------------------------------------------------- immutable operands

def test_q8_is_immutable_and_checked_once(ok):
    kq = ok["kq"]
    for name, value in (("scales", kq.scales[:, :10].copy()), ("data", kq.data),
                        ("group_size", 16)):
        with pytest.raises(AttributeError):
            setattr(kq, name, value)
    with pytest.raises(ValueError, match="read-only"):
        kq.data[0, 0, 0] = -128
    with pytest.raises(TypeError, match="Q8.scales must have dtype float32, got float64"):
        sa.Q8(kq.data, kq.scales.astype(np.float64), 32)
    for bad, exc, msg in ((0, ValueError, "group_size must be >= 1"),
                          (None, TypeError, "group_size must be an int"),
                          ("32", TypeError, "group_size must be an int")):
        with pytest.raises(exc, match=msg):
            sa.Q8(kq.data, kq.scales, bad)
    with pytest.raises(ValueError, match="Q8.scales holds scales of"):
        sa.Q8(kq.data, np.full_like(kq.scales, 2.0**48 / 100), 32)
    # the caller's own arrays stay writable; the Q8 holds read-only views
    data, scales = kq.data.copy(), kq.scales.copy()
    q8 = sa.Q8(data, scales, 32)
    assert data.flags.writeable and not q8.data.flags.writeable
    assert sa.dense_decode(ok["q"], q8, ok["vq"]).tobytes() == \
        sa.dense_decode(ok["q"], kq, ok["vq"]).tobytes()


def test_hand_built_bounds_and_probe_rows_are_checked_when_made(ok):
    b = sa.block_bounds(ok["kq"])
    with pytest.raises(ValueError, match="fewer than the 4 of k_rows 100"):
        sa.BlockBounds(b.mn[:, :2], b.mx[:, :2], b.scales[:, :2], 32, 32, 100)
    with pytest.raises(TypeError, match="bounds.mn must be a numpy.ndarray"):
        sa.BlockBounds(None, b.mx, b.scales, 32, 32, 100)
    with pytest.raises(ValueError, match="scale_group must be >= 1"):
        sa.BlockBounds(b.mn, b.mx, b.scales, 32, 0, 100)
    with pytest.raises(ValueError, match="bounds.scales must have shape"):
        sa.BlockBounds(b.mn, b.mx, np.zeros((2, 4, 1), np.float32), 32, 32, 100)
    with pytest.raises(AttributeError):
        b.k_rows = 5
    ok_bounds = sa.BlockBounds(b.mn, b.mx, b.scales, 32, 32, 100)
    got = sa.select_blocks(ok["q"], ok["kq"], k_blocks=2, scoring="minmax", bounds=ok_bounds)
    assert np.array_equal(got, sa.select_blocks(ok["q"], ok["kq"], k_blocks=2, scoring="minmax"))
    r = sa.probe_rows(ok["kq"])
    with pytest.raises(TypeError, match="probe_rows.rows must be"):
        sa.ProbeRows(None, 32, 8, 100)
    with pytest.raises(ValueError, match="n_probe must be >= 1"):
        sa.ProbeRows(r.rows, 32, 0, 100)
    with pytest.raises(AttributeError):
        r.n_probe = 4


# ---------------------------------------------------------------- accepted layouts

def test_small_inputs_in_any_layout_are_accepted(ok, rng):
    """q, importance, appended rows and the inputs of the kernels alone are
    small or copied anyway: strided, sliced, Fortran-order or misaligned
    ones give exactly the result of their contiguous copies."""
    q, k, v = ok["q"], ok["k"], ok["v"]
    imp = rng.random(S, dtype=np.float32)
    want = sa.sparse_decode(q, k, v, k_blocks=2, importance=imp)
    wide = np.zeros((H, 3 * D), np.float32)
    wide[:, D:2 * D] = q
    strided = np.zeros((H, 2 * D), np.float32)
    strided[:, ::2] = q
    mis = misaligned((H, D))
    mis[:] = q
    layouts = [wide[:, D:2 * D], strided[:, ::2], np.asfortranarray(q), mis]
    imps = [np.repeat(imp, 2)[::2], imp[::-1][::-1]]
    for qq in layouts:
        assert sa.sparse_decode(qq, k, v, k_blocks=2, importance=imp).tobytes() == want.tobytes()
        assert sa.dense_decode(qq, k, v).tobytes() == sa.dense_decode(q, k, v).tobytes()
    for ii in imps:
        assert sa.sparse_decode(q, k, v, k_blocks=2, importance=ii).tobytes() == want.tobytes()
    qp = rng.standard_normal((H, 2 * 10, D), dtype=np.float32)[:, ::2]
    assert sa.prefill(qp, k, v, start=5)[0].tobytes() == \
        sa.prefill(np.ascontiguousarray(qp), k, v, start=5)[0].tobytes()
    # KVCache.append of slices
    cache, ref_cache = sa.KVCache(HKV, D), sa.KVCache(HKV, D)
    cache.append(k[:, 40:45], v[:, 40:45])
    ref_cache.append(k[:, 40:45].copy(), v[:, 40:45].copy())
    assert np.array_equal(cache.k.data, ref_cache.k.data)
    # quantize_q8, q8_dot and accumulate_v of non-contiguous arrays
    x = k[:, ::2]
    assert np.array_equal(sa.quantize_q8(x).data, sa.quantize_q8(np.ascontiguousarray(x)).data)
    q1 = sa.quantize_q8(q[0])
    rows = sa.Q8(ok["kq"].data[0, ::3], ok["kq"].scales[0, ::3], 32)
    assert np.array_equal(sa.q8_dot(q1, rows), sa.q8_dot(q1, sa.Q8(
        np.ascontiguousarray(rows.data), np.ascontiguousarray(rows.scales), 32)))
    assert np.array_equal(sa.accumulate_v(np.ones(50, np.float32)[::-1], v[0, ::2]),
                          sa.accumulate_v(np.ones(50, np.float32), np.ascontiguousarray(v[0, ::2])))
    # an empty sum is zeros; probe rows of every row
    assert np.array_equal(sa.accumulate_v(np.ones(0, np.float32), np.zeros((0, D), np.float32)),
                          np.zeros(D, np.float32))
    every = sa.probe_rows(k, n_probe="all")
    assert every.n_probe == 32
    assert np.array_equal(sa.select_blocks(q, k, k_blocks=2, policy="recall", probe_rows=every),
                          sa.select_blocks(q, k, k_blocks=2, policy="recall"))


def test_sizes_beyond_a_c_int_are_refused_in_python(monkeypatch):
    with pytest.raises(ValueError, match="block_size must be <= 2147483647"):
        sa.KVCache(2, 64, block_size=2**31)
    with pytest.raises(ValueError, match="capacity must be <= 2147483647"):
        sa.KVCache(2, 64, capacity=2**31, dtype="float32")
    with pytest.raises(ValueError, match="head_dim must be <="):
        sa.KVCache(2, 2**31)
    monkeypatch.setenv("SPARSE_ATTN_NUM_THREADS", str(2**31))
    with pytest.raises(ValueError, match="SPARSE_ATTN_NUM_THREADS must be in"):
        sa.dense_decode(np.zeros((2, 4), np.float32), np.zeros((1, 8, 4), np.float32),
                        np.zeros((1, 8, 4), np.float32))
    q3 = np.zeros((2, 1, 4), np.float32)
    kv = np.zeros((1, 8, 4), np.float32)
    with pytest.raises(ValueError, match="start must be <= 2147483647"):
        sa.prefill(q3, kv, kv, start=2**31, threads=1)

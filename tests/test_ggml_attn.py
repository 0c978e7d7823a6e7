"""llama.cpp's attention op computed by the C core (sa_ggml_flash_attn, what
the ggml backend runs inside llama.cpp) against the numpy reference, on every
kernel path, over arrays laid out as llama.cpp lays them out: K and V views
of a cache whose row per cell holds every KV head, a permuted Q, f16 and
q8_0 K/V, masks of several sequences in one batch with unused cells, several
streams."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import _ggml
from sparse_attn import reference as ref
from sparse_attn._ffi import lib

from conftest import F32_RTOL, Q8_RTOL, rel_err

# f16 K/V are float32 exactly, so the core is the reference within float32
# rounding; q8_0 adds the query's quantisation, done the same way in both.
RTOL = {"f16": F32_RTOL, "q8_0": Q8_RTOL}
# llama.cpp pads a cache's cells to a multiple of 256 and the mask's query
# rows beyond the batch (GGML_KQ_MASK_PAD); both padded the same way here.
KV_PAD, Q_PAD = 256, 64


def cache_views(rng, ns, n_kv, Hkv, D, kind, unused=None):
    """K and V as llama.cpp's FA node sees them: a cache [ns, n_kv, Hkv*D]
    (a row per cell), viewed as (ns, Hkv, n_kv, D).  Cells in `unused` (a
    boolean [ns, n_kv]) hold NaN and Inf, as a cache's unused cells may."""
    k = rng.standard_normal((ns, n_kv, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((ns, n_kv, Hkv, D), dtype=np.float32)
    if kind == "f16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    else:
        k, v = _ggml.quantize_q8_0(k), _ggml.quantize_q8_0(v)
    if unused is not None:
        if kind == "f16":
            k[unused] = np.nan
            v[unused] = np.inf
        else:
            k["d"][unused] = np.nan
            v["d"][unused] = np.inf
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def batch_mask(rng, ns, n_q, n_kv, n_seqs, holes=0.1, bias=False):
    """A mask [ns, 1, n_q padded, n_kv] as llama.cpp builds one for a batch
    of n_seqs sequences per stream: the used cells belong to sequences, in
    order, with a few cells freed among them (holes) and the tail unused;
    the batch's n_q rows are the last tokens appended; a row sees the
    cells of its own sequence up to its position.  bias: the seen cells
    get small finite values instead of 0.  Returns (mask, unused cells)."""
    used = n_kv - int(rng.integers(1, min(KV_PAD, n_kv - n_q)))
    mask = np.full((ns, 1, -(-n_q // Q_PAD) * Q_PAD, n_kv), -np.inf, np.float16)
    unused = np.ones((ns, n_kv), bool)
    for s in range(ns):
        seq = rng.integers(0, n_seqs, used)
        seq[rng.random(used) < holes] = -1                 # freed cells
        seq[used - n_q:] = rng.integers(0, n_seqs, n_q)    # the batch itself
        pos = np.zeros(used, int)
        count = {}
        for c in range(used):
            if seq[c] >= 0:
                pos[c] = count.get(seq[c], 0)
                count[seq[c]] = pos[c] + 1
        for i, c in enumerate(range(used - n_q, used)):
            seen = (seq[:used] == seq[c]) & (pos[:used] <= pos[c])
            mask[s, 0, i, :used][seen] = (
                -rng.random(seen.sum()).astype(np.float16) if bias else 0)
        unused[s] = (mask[s, 0, :n_q] == -np.inf).all(axis=0)
    return mask, unused


def queries(rng, ns, n_q, H, D):
    """Q as llama.cpp's FA node sees it: [ns, n_q, H, D] permuted."""
    return rng.standard_normal((ns, n_q, H, D), dtype=np.float32).transpose(0, 2, 1, 3)


# (ns, H, Hkv, D, n_q, n_kv, n_seqs): decode and prompt batches, GQA 1, 3
# and 7, two streams, one and several sequences, caches of one and several
# spans of decode's split.
SHAPES = [
    (1, 9, 3, 64, 1, 512, 1),       # SmolLM2's heads, decode
    (1, 9, 3, 64, 64, 768, 1),      # ... a prompt batch
    (2, 4, 4, 64, 1, 1280, 2),      # two streams, MHA, decode over three spans
    (2, 14, 2, 64, 37, 512, 3),     # Qwen2.5-0.5B's GQA 7, a batch of three sequences
    (1, 8, 2, 128, 3, 1024, 2),     # a small batch, still split over cells
    (1, 2, 1, 32, 70, 256, 1),      # three query blocks, the last partial
]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("ns,H,Hkv,D,n_q,n_kv,n_seqs", SHAPES)
def test_matches_reference(isa, rng, kind, ns, H, Hkv, D, n_q, n_kv, n_seqs):
    mask, unused = batch_mask(rng, ns, n_q, n_kv, n_seqs)
    k, v = cache_views(rng, ns, n_kv, Hkv, D, kind)
    q = queries(rng, ns, n_q, H, D)
    scale = 1 / np.sqrt(D)
    got = _ggml.flash_attn_ext(q, k, v, mask, scale=scale)
    assert got.shape == (ns, n_q, H, D)
    assert rel_err(got, ref.ggml_flash_attn(q, k, v, mask, scale)) < RTOL[kind]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_unused_cells_are_never_read(isa, rng, kind):
    """Cells every row masks hold NaN and Inf (a cache's unused or freed
    cells hold anything): the result is the one with finite values there,
    bit for bit."""
    ns, H, Hkv, D, n_q, n_kv = 2, 6, 2, 64, 9, 768
    mask, unused = batch_mask(rng, ns, n_q, n_kv, 2, holes=0.3)
    q = queries(rng, ns, n_q, H, D)
    clean = cache_views(np.random.default_rng(5), ns, n_kv, Hkv, D, kind)
    dirty = cache_views(np.random.default_rng(5), ns, n_kv, Hkv, D, kind, unused)
    want = _ggml.flash_attn_ext(q, *clean, mask, scale=0.125)
    got = _ggml.flash_attn_ext(q, *dirty, mask, scale=0.125)
    assert np.isfinite(got).all()
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_mask_values_are_added(isa, rng, kind):
    """Finite mask values other than 0 are added to the scaled scores."""
    mask, _ = batch_mask(rng, 1, 5, 512, 2, bias=True)
    k, v = cache_views(rng, 1, 512, 2, 64, kind)
    q = queries(rng, 1, 5, 4, 64)
    got = _ggml.flash_attn_ext(q, k, v, mask, scale=0.2)
    assert rel_err(got, ref.ggml_flash_attn(q, k, v, mask, 0.2)) < RTOL[kind]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_per_head_masks_and_broadcast_streams(isa, rng, kind):
    """A mask plane per query head (m2 = H) and one plane for two streams
    (m3 = 1), read with ggml's broadcast."""
    ns, H, Hkv, D, n_q, n_kv = 2, 6, 3, 64, 4, 512
    mask = np.where(rng.random((1, H, Q_PAD, n_kv)) < 0.4, -np.inf, 0).astype(np.float16)
    k, v = cache_views(rng, ns, n_kv, Hkv, D, kind)
    q = queries(rng, ns, n_q, H, D)
    got = _ggml.flash_attn_ext(q, k, v, mask, scale=0.125)
    assert rel_err(got, ref.ggml_flash_attn(q, k, v, mask, 0.125)) < RTOL[kind]


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_no_mask_and_contiguous_layout(isa, rng, kind):
    """Without a mask every cell is attended; K and V here contiguous per
    head (not llama.cpp's cell-major views)."""
    k, v = cache_views(rng, 1, 300, 2, 64, kind)
    k, v = k.copy(), v.copy()
    q = np.ascontiguousarray(queries(rng, 1, 7, 4, 64))
    got = _ggml.flash_attn_ext(q, k, v, None, scale=0.1)
    assert rel_err(got, ref.ggml_flash_attn(q, k, v, None, 0.1)) < RTOL[kind]


def test_a_row_that_reads_nothing_is_zero(isa, rng):
    mask = np.zeros((1, 1, Q_PAD, 256), np.float16)
    mask[0, 0, 1] = -np.inf
    k, v = cache_views(rng, 1, 256, 1, 64, "f16")
    out = _ggml.flash_attn_ext(queries(rng, 1, 3, 2, 64), k, v, mask, scale=0.125)
    assert not out[0, 1].any() and out[0, 0].any() and out[0, 2].any()


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("n_q,n_kv", [(1, 2304), (2, 1024), (40, 600)])
def test_thread_count_does_not_change_bytes(isa, rng, kind, n_q, n_kv):
    mask, _ = batch_mask(rng, 1, n_q, n_kv, 2)
    k, v = cache_views(rng, 1, n_kv, 3, 64, kind)
    q = queries(rng, 1, n_q, 9, 64)
    outs = [_ggml.flash_attn_ext(q, k, v, mask, scale=0.125, threads=t).tobytes()
            for t in (1, 2, 3, 5, 1)]
    assert len(set(outs)) == 1


# ----------------------------------------------------------------- bad input

def _operands(rng, kind="f16"):
    k, v = cache_views(rng, 1, 256, 2, 64, kind)
    mask, _ = batch_mask(rng, 1, 3, 256, 1)
    return queries(rng, 1, 3, 4, 64), k, v, mask


@pytest.mark.parametrize("change,error,words", [
    (dict(q=lambda q: q.astype(np.float64)), sa.ArgumentTypeError, "q must have dtype float32"),
    (dict(k=lambda k: k.astype(np.float32)), sa.ArgumentTypeError, "k must have dtype"),
    (dict(v=lambda v: _ggml.quantize_q8_0(v.astype(np.float32))), sa.ArgumentTypeError,
     "v must have dtype float16"),
    (dict(mask=lambda m: m.astype(np.float32)), sa.ArgumentTypeError, "mask must have dtype"),
    (dict(q=lambda q: q[0]), sa.ArgumentError, "q must have 4 dimensions"),
    (dict(q=lambda q: q[..., :32]), sa.ArgumentError, "k's rows hold 64 values, q's 32"),
    (dict(v=lambda v: v[..., :32]), sa.UnsupportedError, "v's rows hold 32 values"),
    (dict(q=lambda q: q[:, :3]), sa.ArgumentError, "q's heads (3) must be a multiple"),
    (dict(v=lambda v: v[:, :, :100]), sa.ArgumentError, "with the same Hkv and n_kv"),
    (dict(mask=lambda m: m[..., :100]), sa.ArgumentError, "mask must be"),
    (dict(mask=lambda m: np.repeat(m, 3, axis=1)), sa.ArgumentError, "mask must be"),
    (dict(k=lambda k: k[..., ::-1]), sa.ArgumentError, "negative stride"),
    (dict(k=lambda k: k.transpose(0, 1, 3, 2)[..., :64, :]), sa.ArgumentError,
     "rows must be contiguous"),
    (dict(q=lambda q: q[:, :, :0]), sa.ArgumentError, "q is empty"),
])
def test_bad_operands_are_refused_by_name(rng, change, error, words):
    q, k, v, mask = _operands(rng)
    args = dict(q=q, k=k, v=v, mask=mask)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _ggml.flash_attn_ext(args["q"], args["k"], args["v"], args["mask"], scale=0.125)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(max_bias=8.0), sa.UnsupportedError, "max_bias"),
    (dict(logit_softcap=30.0), sa.UnsupportedError, "logit_softcap"),
    (dict(n_kv_max=64), sa.UnsupportedError, "n_kv_max"),
    (dict(sinks=np.zeros(4, np.float32)), sa.UnsupportedError, "sinks"),
    (dict(scale=0.0), sa.ArgumentError, "scale must be > 0"),
    (dict(scale=float("nan")), sa.ArgumentError, "scale must be finite"),
    (dict(threads=0), sa.ArgumentError, "threads must be >= 1"),
])
def test_features_and_parameters_refused_by_name(rng, kwargs, error, words):
    q, k, v, mask = _operands(rng)
    kwargs = {"scale": 0.125, **kwargs}
    with pytest.raises(error, match=words):
        _ggml.flash_attn_ext(q, k, v, mask, **kwargs)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 2.0 ** 48])
def test_query_values_are_scanned(rng, bad):
    q, k, v, mask = _operands(rng)
    q = q.copy()
    q[0, 1, 2, 3] = bad
    with pytest.raises(sa.ArgumentError, match="^q holds NaN or Inf"):
        _ggml.flash_attn_ext(q, k, v, mask, scale=0.125)


def _c_check(rng, kind="f16", out=None, **fields):
    q, k, v, mask = _operands(rng, kind)
    out = np.empty((1, 3, 4, 64), np.float32) if out is None else out
    a, keep = _ggml.op_struct(q, k, v, mask, out, scale=0.125)
    for name, value in fields.items():       # "scale", or "k.ne" for a tensor's field
        obj, _, attr = name.rpartition(".")
        setattr(getattr(a, obj) if obj else a, attr, value)
    return lib.sa_ggml_flash_attn_check(a), lib.sa_ggml_flash_attn(a, 2)


@pytest.mark.parametrize("fields,status", [
    (dict(max_bias=1.0), lib.SA_ERR_UNSUPPORTED),
    (dict(logit_softcap=50.0), lib.SA_ERR_UNSUPPORTED),
    (dict(n_kv_max=16), lib.SA_ERR_UNSUPPORTED),
    (dict(has_sinks=1), lib.SA_ERR_UNSUPPORTED),
    ({"v.ne": [32, 256, 2, 1]}, lib.SA_ERR_UNSUPPORTED),
    ({"k.type": lib.SA_GGML_F32}, lib.SA_ERR_DTYPE),
    ({"v.type": lib.SA_GGML_Q8_0}, lib.SA_ERR_DTYPE),
    ({"q.type": lib.SA_GGML_F16}, lib.SA_ERR_DTYPE),
    ({"k.ne": [64, 256, 3, 1], "v.ne": [64, 256, 3, 1]}, lib.SA_ERR_GQA),
    ({"k.ne": [64, 256, 2, 2]}, lib.SA_ERR_SHAPE),
    ({"mask.ne": [255, 64, 1, 1]}, lib.SA_ERR_SHAPE),
    ({"q.ne": [64, 0, 4, 1]}, lib.SA_ERR_SHAPE),
    ({"k.nb": [4, 256, 128, 65536]}, lib.SA_ERR_LAYOUT),
    ({"k.nb": [2, 256, 129, 65536]}, lib.SA_ERR_LAYOUT),
    ({"q.nb": [4, 1024, -256, 3072]}, lib.SA_ERR_LAYOUT),
    ({"out.nb": [4, 256, 2048, 3072]}, lib.SA_ERR_LAYOUT),
    (dict(scale=-1.0), lib.SA_ERR_SCALE),
    (dict(scale=float("inf")), lib.SA_ERR_SCALE),
])
def test_the_c_check_refuses_what_it_does_not_compute(rng, fields, status):
    """The check the ggml backend's supports_op asks, and the entry itself."""
    assert _c_check(rng, **fields) == (status, status)


def test_the_c_entry_refuses_missing_and_misaligned_data(rng):
    assert _c_check(rng, **{"k.data": _ggml.ffi.NULL}) == (lib.SA_OK, lib.SA_ERR_NULL)
    raw = np.zeros(2 * 256 * 64 * 2 + 1, np.uint8)
    odd = raw[1:].view(np.float16).reshape(1, 2, 256, 64)
    q, k, v, mask = _operands(rng)
    out = np.empty((1, 3, 4, 64), np.float32)
    a, keep = _ggml.op_struct(q, odd, v, mask, out, scale=0.125)
    assert lib.sa_ggml_flash_attn(a, 1) == lib.SA_ERR_LAYOUT


def test_q8_0_blocks_follow_llama_cpp():
    """quantize_q8_0 is ggml's quantize_row_q8_0_ref: d = amax / 127 stored
    as fp16, q = roundf(x * (1 / d)) with the float32 d."""
    x = np.array([[0.5, -1.27, 0.0, 2.54] + [0.0] * 28], np.float32)
    b = _ggml.quantize_q8_0(x)
    assert b.shape == (1, 1) and b.dtype.itemsize == 34
    d = np.float32(2.54) / np.float32(127)
    assert b["d"][0, 0] == np.float16(d)
    scaled = x[0, :4] * (np.float32(1) / d)
    want = np.trunc(scaled) + np.where(np.abs(scaled - np.trunc(scaled)) >= 0.5,
                                       np.sign(scaled), 0)
    np.testing.assert_array_equal(b["qs"][0, 0, :4], want.astype(np.int8))
    assert want[3] == 127
    assert not _ggml.quantize_q8_0(np.zeros((2, 64), np.float32))["qs"].any()

"""Shared fixtures: every test that takes `isa` runs once per kernel path this
CPU can run, in-process (the C core switches tables at run time)."""
import numpy as np
import pytest

import sparse_attn as sa

# float32 KV: outputs differ from the float64 reference by float32 rounding
# only (sums of up to a few thousand terms), far below this.
F32_RTOL = 1e-5
# q8 KV against a reference that quantises the same way: the scale products
# and int->float steps add a few more roundings than float32 KV.
Q8_RTOL = 1e-4


def rel_err(got, want):
    """Normwise relative error: max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def rtol_for(kv):
    return Q8_RTOL if isinstance(kv, sa.Q8) else F32_RTOL


@pytest.fixture(params=sa.available_isas())
def isa(request):
    before = sa.isa()
    sa.set_isa(request.param)
    yield request.param
    sa.set_isa(before)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_kv(rng, n_kv_heads, seq, head_dim, dtype="float32", group_size=32):
    k = rng.standard_normal((n_kv_heads, seq, head_dim), dtype=np.float32)
    v = rng.standard_normal((n_kv_heads, seq, head_dim), dtype=np.float32)
    if dtype == "q8":
        return sa.quantize_q8(k, group_size), sa.quantize_q8(v, group_size)
    return k, v


def pow2_scales(x):
    """q8 x with each scale rounded to a power of two.  Then p * d and d * q
    are exact, so decode's order of q8 V's products (the weight p * d times
    q) and prefill's (p times the dequantised d * q) give the same bits
    (spec §4): with such V a q8 prefill row is dense decode bit for bit."""
    return sa.Q8(x.data, (2.0 ** np.round(np.log2(x.scales))).astype(np.float32),
                 x.group_size)


def gemm_form(T, start, H, Hkv):
    """spec §3: whether a prefill call scores float32 K in GEMM form (at least
    256 query vectors per KV head, its rows a quarter of its keys or more)."""
    return T * (H // Hkv) >= 256 and 4 * T >= start + T

"""Each kernel on its own, on every ISA path this CPU runs (``sparse-attn
kernels``), with the speed-up over the portable path.  The KV is in cache
after the first call: this times compute, not memory."""
import math

import numpy as np

import sparse_attn as sa

from .common import log, timed
from .table import numpy_decode


def run_kernels(args):
    rng = np.random.default_rng(args.seed)
    H, Hkv, D, gs, S = args.heads, args.kv_heads, args.head_dim, args.group_size, args.kernel_len
    k = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((Hkv, S, D), dtype=np.float32)
    kq, vq = sa.quantize_q8(k, gs), sa.quantize_q8(v, gs)
    q = rng.standard_normal((H, D), dtype=np.float32)
    q1 = sa.quantize_q8(q[0], gs)
    rows1 = sa.Q8(kq.data[0], kq.scales[0], gs)
    p = rng.random(S, dtype=np.float32)
    imp = rng.random(S, dtype=np.float32)
    bounds = sa.block_bounds(kq)
    copies = sa.probe_rows(kq)
    t = args.threads
    T = min(S, 512)
    qp = rng.standard_normal((H, T, D), dtype=np.float32)
    kp, vp, kpq, vpq = k[:, :T], v[:, :T], sa.Q8(kq.data[:, :T], kq.scales[:, :T], gs), \
        sa.Q8(vq.data[:, :T], vq.scales[:, :T], gs)
    cases = [
        ("probe q8 (all heads)", lambda: sa.probe_scores(q, kq, threads=t)),
        ("probe f32 (all heads)", lambda: sa.probe_scores(q, k, threads=t)),
        ("minmax select q8 (all heads)", lambda: sa.select_blocks(
            q, kq, policy="fast", bounds=bounds, threads=t)),
        (f"q8 dot ({S} rows)", lambda: sa.q8_dot(q1, rows1)),
        (f"accumulate V q8 ({S} rows)", lambda: sa.accumulate_v(p, rows1)),
        (f"accumulate V f32 ({S} rows)", lambda: sa.accumulate_v(p, k[0])),
        ("decode step dense q8", lambda: sa.dense_decode(q, kq, vq, threads=t)),
        ("decode step dense f32", lambda: sa.dense_decode(q, k, v, threads=t)),
        ("decode step sparse k=32 q8", lambda: sa.sparse_decode(
            q, kq, vq, importance=imp, probe_rows=copies, threads=t)),
        ("decode step sparse k=32 f32", lambda: sa.sparse_decode(q, k, v, importance=imp,
                                                                 threads=t)),
        (f"prefill exact f32 ({T} tokens)", lambda: sa.prefill(qp, kp, vp, threads=t)),
        (f"prefill exact q8 ({T} tokens)", lambda: sa.prefill(qp, kpq, vpq, threads=t)),
        (f"prefill sparse k=4 q8 ({T} tokens)", lambda: sa.prefill(
            qp, kpq, vpq, k_blocks=4, threads=t)),
    ]
    before = sa.isa()
    results = {}
    try:
        for name in sa.available_isas():
            sa.set_isa(name)
            log(f"  kernels on {name}")
            for case, fn in cases:
                results[(case, name)] = timed(fn, args.repeats * 4)[0]
    finally:
        sa.set_isa(before)
    numpy_time = timed(lambda: numpy_decode(q, k, v, 1 / math.sqrt(D)), args.repeats * 4)[0]
    isas = sa.available_isas()
    print(f"\nKernels alone: {H} q heads, {Hkv} KV heads, head_dim {D}, {S} tokens, q8 group "
          f"{gs}, {t} thread(s); KV in cache after the first call. Median of {args.repeats * 4}"
          " runs, us; (x) = speed-up over portable.\n")
    width = max(len(c) for c, _ in cases) + 2
    print(f"{'kernel':<{width}}" + "".join(f"{n:>22}" for n in isas))
    out = []
    for case, _ in cases:
        base = results[(case, "portable")]
        cells = []
        for name in isas:
            us = results[(case, name)] * 1e6
            cells.append(f"{us:10.1f} ({base / results[(case, name)]:5.2f}x)")
            out.append(dict(kernel=case, isa=name, us=us,
                            speedup_vs_portable=base / results[(case, name)]))
        print(f"{case:<{width}}" + "".join(f"{c:>22}" for c in cells))
    best = min(results[("decode step dense f32", n)] for n in isas)
    print(f"{'numpy f32 dense decode':<{width}}{numpy_time * 1e6:10.1f} us  (best sparse_attn "
          f"dense f32 is {numpy_time / best:.1f}x faster)")
    out.append(dict(kernel="numpy f32 dense decode", isa="numpy", us=numpy_time * 1e6))
    return out

"""``python -m sparse_attn.bench``: the article's board table on any machine.

One decode step of a Qwen3-VL-2B-shaped model (28 layers, 16 query heads,
8 KV heads, head_dim 128) over a synthetic needle-in-a-haystack context
(:mod:`sparse_attn.synthetic`), for several context lengths, dense and
sparse configurations, q8 and float32 KV, side by side with numpy and (when
installed) torch's scaled_dot_product_attention, and against the memory
bandwidth floor measured in the same run.

``python -m sparse_attn.bench kernels`` times the kernels on their own on
every ISA path this CPU can run.

Nothing is downloaded; torch and matplotlib are used only if installed.
"""
import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

import sparse_attn as sa
from sparse_attn._ffi import ffi, lib
from sparse_attn.isa import default_threads
from sparse_attn.metadata import default_scale_group
from sparse_attn.selection import parse_policy, selection
from sparse_attn.synthetic import needle_context

QWEN3_VL_2B = dict(n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128)
# The KV of distinct layers touched between two visits of the same layer's
# buffers; well above any L3 here or on the board, so each step streams from DRAM.
COLD_BYTES = 512 << 20
DEFAULT_LENGTHS = (2061, 4096, 8192, 32768)
DEFAULT_CONFIGS = ("dense", "32", "16", "8", "4", "1")
WHY_K1 = ("k=1: the importance reserve is (k+1)//2 = 1 block, so the single slot goes to the "
          "block prefill attended to most and the probe never gets a say (SPEC §2.5): the "
          "needle is lost, as on the board.")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def timed(fn, repeats):
    """Run fn `repeats` times (after one warm-up); seconds as (median, min, max)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(min(times)), float(max(times))


def stream_bandwidth(threads, repeats=5, n_bytes=COLD_BYTES):
    """Bytes per second of a plain streaming read (sa_stream_read) on this machine."""
    buf = np.ones(n_bytes, np.uint8)
    out = ffi.new("uint64_t *")
    ptr = ffi.from_buffer("uint8_t[]", buf)
    med, lo, hi = timed(lambda: lib.sa_stream_read(ptr, n_bytes, threads, out), repeats)
    return n_bytes / med, n_bytes / hi, n_bytes / lo


# --------------------------------------------------------------------------- baselines

def numpy_decode(q, k, v, scale):
    """What a numpy user writes: float32 matmul + softmax, GQA by reshaping."""
    hkv, _, d = k.shape
    qg = q.reshape(hkv, -1, d)
    s = np.matmul(qg, k.transpose(0, 2, 1))
    s *= scale
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(q.shape)


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


# --------------------------------------------------------------------------- the layers

class Layer:
    """One distinct layer: its needle context in both KV dtypes, the
    importance its prompt's last chunk recorded through a real prefill, and
    what a KVCache keeps for selection: the per-block key bounds for
    scoring="minmax" and the copies of the probe's rows for scoring="probe"."""

    def __init__(self, ctx, importance, group_size, block_size, n_probe):
        self.ctx = ctx
        self.importance = importance
        self.kv = {"float32": (ctx.k, ctx.v),
                   "q8": (sa.quantize_q8(ctx.k, group_size), sa.quantize_q8(ctx.v, group_size))}
        self.bounds = {dtype: sa.block_bounds(kv[0], block_size=block_size)
                       for dtype, kv in self.kv.items()}
        self.probe_rows = {dtype: sa.probe_rows(kv[0], block_size=block_size, n_probe=n_probe)
                           for dtype, kv in self.kv.items()}

    def selection(self, dtype, minmax, n_probe):
        """The metadata keyword a KVCache.decode would pass (no copies for a
        probe with another n_probe, or of every row: that one reads K)."""
        if minmax:
            return {"bounds": self.bounds[dtype]}
        rows = self.probe_rows[dtype]
        return {"probe_rows": rows} if n_probe == rows.n_probe < rows.block_size else {}


def build_layers(length, n_distinct, args):
    layers = []
    for i in range(n_distinct):
        log(f"  [{length}] layer {i + 1}/{n_distinct}: generating context, prefilling the "
            f"last {min(args.prefill_tokens, length)} tokens")
        ctx = needle_context(length, n_heads=args.heads, n_kv_heads=args.kv_heads,
                             head_dim=args.head_dim, seed=args.seed * 1000 + i,
                             block_size=args.block_size, prompt_tokens=args.prefill_tokens)
        t = ctx.prompt_q.shape[1]
        _, imp = sa.prefill(ctx.prompt_q, ctx.k, ctx.v, start=length - t, threads=args.threads)
        layers.append(Layer(ctx, imp, args.group_size, args.block_size, args.n_probe or 8))
    return layers


def kv_row_bytes(dtype, head_dim, group_size):
    return head_dim * 4 if dtype == "float32" else head_dim + 4 * (head_dim // group_size)


def step_bytes(blocks, length, dtype, args, scoring="probe", n_probe=8):
    """Bytes one layer's decode step must read: for sparse, the probed K rows
    (or, for scoring="minmax", the blocks' key bounds) and the K and V rows of
    the blocks chosen by any head of each KV head (each row once per KV
    head); for dense, all of K and V."""
    row = kv_row_bytes(dtype, args.head_dim, args.group_size)
    if blocks is None:
        return 2 * args.kv_heads * length * row
    if scoring == "minmax":
        bgroup = args.group_size if dtype == "q8" else \
            default_scale_group(None, args.head_dim)
        bound_bytes = 2 * args.head_dim + 4 * (args.head_dim // bgroup)
        probe_cost = -(-length // args.block_size) * bound_bytes
    else:
        probe_cost = None
    bs, nb = args.block_size, -(-length // args.block_size)
    total = 0
    per_kv = blocks.reshape(args.kv_heads, -1)
    probe_rows = sum(-(-(min((b + 1) * bs, length) - b * bs)
                       // max(1, (min((b + 1) * bs, length) - b * bs) // n_probe))
                     for b in range(nb))
    for chosen in per_kv:
        rows = sum(min((b + 1) * bs, length) - b * bs for b in np.unique(chosen))
        if len(np.unique(chosen)) < nb:
            total += probe_rows * row if probe_cost is None else probe_cost
        total += 2 * rows * row
    return int(total)  # not a numpy integer: json.dump takes only Python ints


def cell_n_probe(kw, block_size):
    """The n_probe a sparse_decode call with these keywords uses, as an int."""
    return selection(kw.get("policy", "seed"), block_size=block_size,
                     n_probe=kw.get("n_probe")).n_probe


# --------------------------------------------------------------------------- the table

def run_length(length, args, bandwidth, torch):
    row_f32 = kv_row_bytes("float32", args.head_dim, args.group_size)
    per_layer = 2 * args.kv_heads * length * row_f32
    n_distinct = max(1, min(args.layers, math.ceil(COLD_BYTES / per_layer)))
    layers = build_layers(length, n_distinct, args)
    order = [layers[i % n_distinct] for i in range(args.layers)]
    scale = 1.0 / math.sqrt(args.head_dim)
    rows = []

    for dtype in args.dtypes:
        exact = [sa.dense_decode(l.ctx.question_q, *l.kv[dtype], threads=args.threads)
                 for l in layers]
        dense_time = None
        cells = [("dense", None, None)] if "dense" in args.configs else []
        cells += [(c, name, knobs) for name, knobs in args.policies
                  for c in args.configs if c != "dense"]
        for config, policy, knobs in cells:
            log(f"  [{length}] {dtype} {config} {policy or ''}")
            if config == "dense":
                def step():
                    for l in order:
                        sa.dense_decode(l.ctx.question_q, *l.kv[dtype], threads=args.threads)
                outs = exact
                blocks = [None] * n_distinct
            else:
                kb = int(config)
                kw = dict(knobs, k_blocks=kb, block_size=args.block_size, threads=args.threads)
                if args.n_probe is not None:
                    kw["n_probe"] = args.n_probe
                n_probe = cell_n_probe(kw, args.block_size)
                minmax = kw.get("scoring") == "minmax"

                def step(kw=kw, minmax=minmax, n_probe=n_probe):
                    for l in order:
                        sa.sparse_decode(l.ctx.question_q, *l.kv[dtype],
                                         importance=l.importance,
                                         **l.selection(dtype, minmax, n_probe), **kw)
                res = [sa.sparse_decode(l.ctx.question_q, *l.kv[dtype], importance=l.importance,
                                        **l.selection(dtype, minmax, n_probe),
                                        return_blocks=True, **kw)
                       for l in layers]
                outs, blocks = [r[0] for r in res], [r[1] for r in res]
            med, lo, hi = timed(step, args.repeats)
            if config == "dense":
                dense_time = med
            needle_hits, needle_heads = 0, 0
            for l, b in zip(layers, blocks):
                heads = l.ctx.retrieval_heads
                needle_heads += int(heads.sum())
                needle_hits += int(heads.sum()) if b is None else int(
                    (b[heads] == l.ctx.needle_block).any(axis=1).sum())
            err = max(float(np.abs(o - e).max() / np.abs(e).max()) for o, e in zip(outs, exact))
            scoring = (knobs or {}).get("scoring", "probe")
            nbytes = sum(step_bytes(blocks[i % n_distinct], length, dtype, args, scoring,
                                    n_probe if config != "dense" else 8)
                         for i in range(args.layers))
            floor = nbytes / bandwidth
            rows.append(dict(length=length, impl="sparse_attn", dtype=dtype, config=config,
                             policy=policy, knobs=knobs,
                             recall=needle_hits / needle_heads, rel_err=err,
                             ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
                             speedup_vs_dense=(dense_time / med) if dense_time else None,
                             bytes=nbytes, floor_ms=floor * 1e3, x_floor=med / floor))

    if args.baselines:
        dense_bytes = args.layers * 2 * args.kv_heads * length * row_f32

        def baseline(impl, dtype, fn):
            log(f"  [{length}] {impl} {dtype}")
            med, lo, hi = timed(fn, max(1, args.repeats // 2))
            ref_dense = next((r["ms"] for r in rows if r["dtype"] == "float32"
                              and r["config"] == "dense"), None)
            rows.append(dict(length=length, impl=impl, dtype=dtype, config="dense", policy=None,
                             knobs=None, recall=1.0,
                             rel_err=None, ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
                             speedup_vs_dense=(ref_dense / (med * 1e3)) if ref_dense else None,
                             bytes=dense_bytes * (2 if dtype == "float32" else 1) // 2,
                             floor_ms=None, x_floor=None))
            rows[-1]["floor_ms"] = rows[-1]["bytes"] / bandwidth * 1e3
            rows[-1]["x_floor"] = rows[-1]["ms"] / rows[-1]["floor_ms"]

        def numpy_step():
            for l in order:
                numpy_decode(l.ctx.question_q, l.ctx.k, l.ctx.v, scale)
        baseline("numpy", "float32", numpy_step)
        if torch is not None:
            torch.set_num_threads(args.threads)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            for tdtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
                tl = [(torch.from_numpy(l.ctx.question_q)[None, :, None].to(tdtype),
                       torch.from_numpy(l.ctx.k)[None].to(tdtype),
                       torch.from_numpy(l.ctx.v)[None].to(tdtype)) for l in layers]
                torder = [tl[i % n_distinct] for i in range(args.layers)]

                def torch_step(torder=torder):
                    with torch.inference_mode():
                        for q, k, v in torder:
                            sdpa(q, k, v, scale=scale, enable_gqa=True)
                baseline("torch-sdpa", name, torch_step)
                del tl, torder
    return rows


def fmt_ms(r):
    return f"{r['ms']:8.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}]"


def print_table(rows, args, bandwidth):
    print(f"\nDecode attention, {args.layers} layers x ({args.heads} q heads, {args.kv_heads} KV "
          f"heads, head_dim {args.head_dim}); block {args.block_size}, n_probe "
          f"{args.n_probe or 'per policy'}; "
          f"ISA {sa.isa()}, {args.threads} thread(s); streaming read {bandwidth / 1e9:.1f} GB/s")
    print("ms = time per token for all layers, median [min–max] of "
          f"{args.repeats}; err = max relative error vs dense at the same dtype;")
    print("floor = bytes the step must read / streaming-read bandwidth; x floor = ms / floor.\n")
    head = (f"{'ctx':>6} {'impl':<12} {'KV':<8} {'config':<6} {'policy':<8} {'needle':>6} {'err':>8} "
            f"{'ms/token [min–max]':>24} {'vs dense':>8} {'MB read':>8} {'floor ms':>8} "
            f"{'x floor':>7}")
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        if last is not None and r["length"] != last:
            print()
        last = r["length"]
        cfg = r["config"] if r["config"] == "dense" else f"k={r['config']}"
        needle = "YES" if r["recall"] == 1 else ("NO" if r["recall"] == 0 else f"{r['recall']:.0%}")
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        vs = "-" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        print(f"{r['length']:>6} {r['impl']:<12} {r['dtype']:<8} {cfg:<6} {r['policy'] or '-':<8} "
              f"{needle:>6} {err:>8} "
              f"{fmt_ms(r):>24} {vs:>8} {r['bytes'] / 1e6:8.1f} {r['floor_ms']:8.2f} "
              f"{r['x_floor']:7.2f}")
    if any(r["config"] == "1" and r["recall"] == 0 and r["policy"] == "seed" for r in rows):
        print("\n" + WHY_K1)
    print("baseline rows: 'vs dense' is sparse_attn dense float32 time / baseline time "
          "(> 1 means the baseline is faster).")


def machine_info(args, bandwidth, torch):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu part")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(machine=platform.machine(), cpu=cpu, cores=os.cpu_count(), isa=sa.isa(),
                available_isas=sa.available_isas(), threads=args.threads,
                bandwidth_gbs=bandwidth / 1e9, python=platform.python_version(),
                numpy=np.__version__, torch=getattr(torch, "__version__", None),
                sparse_attn=sa.__version__, platform=platform.platform())


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot: matplotlib is not installed; skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["impl"], r["dtype"], r["config"]) for r in rows})
    for impl, dtype, config in keys:
        pts = sorted((r["length"], r["ms"]) for r in rows
                     if (r["impl"], r["dtype"], r["config"]) == (impl, dtype, config))
        label = f"{impl} {dtype} {config if config == 'dense' else 'k=' + config}"
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode attention ms / token (all layers)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")


# --------------------------------------------------------------------------- kernels

def run_kernels(args):
    """Each kernel on every ISA path this CPU runs, with the speed-up over portable."""
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
    t = args.threads
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
        ("decode step sparse k=32 q8", lambda: sa.sparse_decode(q, kq, vq, importance=imp,
                                                                threads=t)),
        ("decode step sparse k=32 f32", lambda: sa.sparse_decode(q, k, v, importance=imp,
                                                                 threads=t)),
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
            out.append(dict(kernel=case, isa=name, us=us, speedup_vs_portable=base / results[(case, name)]))
        print(f"{case:<{width}}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'numpy f32 dense decode':<{width}}{numpy_time * 1e6:10.1f} us  (best sparse_attn "
          f"dense f32 is {numpy_time / min(results[('decode step dense f32', n)] for n in isas):.1f}x"
          " faster)")
    out.append(dict(kernel="numpy f32 dense decode", isa="numpy", us=numpy_time * 1e6))
    return out


# --------------------------------------------------------------------------- CLI

def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m sparse_attn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=("decode", "kernels"), default="decode",
                    help="decode: the article's table (default); kernels: per-kernel timings")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                    help="context lengths, comma-separated (default %(default)s)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="'dense' and/or k_blocks values (default %(default)s)")
    ap.add_argument("--dtypes", default="q8,float32", help="KV dtypes (default %(default)s)")
    ap.add_argument("--policies", default="seed",
                    help="selection policies for the sparse rows, ';'-separated: presets "
                         f"({', '.join(sa.POLICIES)}) or name:knob=value,... "
                         "(default %(default)s)")
    ap.add_argument("--layers", type=int, default=QWEN3_VL_2B["n_layers"])
    ap.add_argument("--heads", type=int, default=QWEN3_VL_2B["n_heads"])
    ap.add_argument("--kv-heads", type=int, default=QWEN3_VL_2B["n_kv_heads"])
    ap.add_argument("--head-dim", type=int, default=QWEN3_VL_2B["head_dim"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--n-probe", type=int, default=None,
                    help="rows probed per block, for every policy (default: each policy's, "
                         "seed 8, recall every row)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=128,
                    help="prompt tokens prefilled per layer for importance (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for sparse_attn and torch (default: SPARSE_ATTN_NUM_THREADS "
                         "or the usable cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="skip numpy and torch")
    ap.add_argument("--kernel-len", type=int, default=4096, help="tokens for 'kernels' mode")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run: 2061 tokens, 2 layers, dense/k=32/k=1, 1 repeat")
    ap.add_argument("--json", metavar="PATH", help="write every figure and the machine info")
    ap.add_argument("--plot", metavar="PATH", help="draw ms/token vs context (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.configs, args.layers, args.repeats = "2061", "dense,32,1", 2, 1
        args.kernel_len = 512
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.configs = [c.strip() for c in args.configs.split(",")]
        for c in args.configs:
            if c != "dense" and int(c) < 1:
                raise ValueError(c)
    except ValueError:
        ap.error("--lengths takes integers and --configs 'dense' or integers >= 1")
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    try:
        args.policies = [parse_policy(p) for p in args.policies.split(";") if p.strip()]
    except sa.ArgumentError as exc:
        ap.error(f"--policies: {exc}")
    if not set(args.dtypes) <= {"q8", "float32"}:
        ap.error("--dtypes takes q8 and/or float32")
    if min(args.lengths) < 4 * args.block_size:
        ap.error(f"--lengths must be at least 4 blocks ({4 * args.block_size})")
    for name in ("layers", "heads", "kv_heads", "head_dim", "block_size", "n_probe",
                 "group_size", "prefill_tokens", "repeats", "kernel_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is None:
        args.threads = default_threads()
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch = torch_or_none() if args.baselines else None
    log(f"sparse_attn {sa.__version__}, ISA {sa.isa()}, {args.threads} thread(s)")
    bandwidth = stream_bandwidth(args.threads)[0]
    if args.mode == "kernels":
        results = run_kernels(args)
        info = machine_info(args, bandwidth, torch)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=info, kernels=results), f, indent=1)
        return 0
    rows = []
    for length in args.lengths:
        log(f"context {length}:")
        rows += run_length(length, args, bandwidth, torch)
    print_table(rows, args, bandwidth)
    info = machine_info(args, bandwidth, torch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, args={k: v for k, v in vars(args).items()}, rows=rows),
                      f, indent=1)
        log(f"figures written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

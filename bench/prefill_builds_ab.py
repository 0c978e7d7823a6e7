"""Exact prefill of one layer under two builds of the package, alternated in
one process.

    python bench/prefill_builds_ab.py OTHER_SRC [--isa avx2] [--dtype float32]
        [--shapes 16,8,128;9,3,64;14,2,64] [--lengths 2048,4096,8192]
        [--rounds 4] [--threads T] [--torch]

OTHER_SRC is the root of another built checkout (a `git worktree` of the
previous commit built with `python setup.py build_ext --inplace`), loaded as
bench/decode_builds_ab.py loads it.  Per shape (query heads, KV heads,
head_dim) and length, both builds prefill the same random layer (`--dtype`
float32 or q8 K/V), in an order swapped every round; with `--torch`, torch's
causal `scaled_dot_product_attention` (GQA, `--threads` threads) runs in the
same rounds.  Printed: each one's median and minimum seconds, the median of
the per-round ratios this/other (and this/torch), and the normwise relative
difference of the two builds' outputs.  On a shared machine compare the
ratios, not the seconds.  `--isa` picks both builds' kernels (the
environment's SPARSE_ATTN_ISA is read by each core when it loads).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_builds_ab import load_other  # noqa: E402

import sparse_attn as sa  # noqa: E402
from sparse_attn._checks import default_threads  # noqa: E402


def shapes_arg(text):
    out = []
    for part in text.split(";"):
        h, hkv, d = (int(x) for x in part.split(","))
        out.append((h, hkv, d))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--dtype", choices=("float32", "q8"), default="float32")
    ap.add_argument("--shapes", type=shapes_arg, default=shapes_arg("16,8,128;9,3,64;14,2,64"))
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--torch", action="store_true")
    args = ap.parse_args()
    other = load_other(args.other)
    if args.isa:
        sa.set_isa(args.isa)
        other.set_isa(args.isa)
    threads = args.threads or default_threads()
    torch = None
    if args.torch:
        import torch
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    print(f"isa {sa.isa()} / other {other.isa()}, {threads} threads, K/V {args.dtype}")
    for H, Hkv, D in args.shapes:
        for T in (int(x) for x in args.lengths.split(",")):
            q = rng.standard_normal((H, T, D), dtype=np.float32)
            k = rng.standard_normal((Hkv, T, D), dtype=np.float32)
            v = rng.standard_normal((Hkv, T, D), dtype=np.float32)
            runs = {"this": (sa, k, v), "other": (other, k, v)}
            if args.dtype == "q8":
                runs = {"this": (sa, sa.quantize_q8(k), sa.quantize_q8(v)),
                        "other": (other, other.quantize_q8(k), other.quantize_q8(v))}
            times = {name: [] for name in runs}
            if torch:
                times["torch"] = []
                tq, tk, tv = (torch.from_numpy(x)[None] for x in (q, k, v))
            outs = {}
            for r in range(args.rounds):
                order = list(runs) if r % 2 == 0 else list(runs)[::-1]
                for name in order:
                    mod, kk, vv = runs[name]
                    t0 = time.perf_counter()
                    outs[name] = mod.prefill(q, kk, vv, threads=threads)[0]
                    times[name].append(time.perf_counter() - t0)
                if torch:
                    t0 = time.perf_counter()
                    torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=True, enable_gqa=True)
                    times["torch"].append(time.perf_counter() - t0)
            diff = float(np.linalg.norm(outs["this"] - outs["other"]) /
                         np.linalg.norm(outs["other"]))
            line = f"H={H}/{Hkv} D={D} T={T}:"
            for name, ts in times.items():
                line += f" {name} {np.median(ts):.3f} (min {min(ts):.3f}) s,"
            rel = np.median([a / b for a, b in zip(times["this"], times["other"])])
            line += f" this/other {rel:.3f}x"
            if torch:
                rel_t = np.median([a / b for a, b in zip(times["this"], times["torch"])])
                line += f", this/torch {rel_t:.3f}x"
            print(line + f", outputs differ by {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()

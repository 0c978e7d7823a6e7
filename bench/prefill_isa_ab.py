"""q8 prefill of one layer under two kernel paths, alternated in one process.

    python bench/prefill_isa_ab.py [ISA_A] [ISA_B] [--repeats N]

(defaults: avx512-vnni against avx512-amx, 4 alternated pairs per shape).
Per shape it prints both paths' times, the per-pair ratio B/A and whether
the outputs and importance are bitwise equal (they must be for these two:
the AMX scores are the VNNI scores).  Shapes: SmolLM2's layer (9 q / 3 KV
heads, head_dim 64) at 2048 and 7000 tokens, Qwen3-VL-2B's (16 / 8, 128) at
2048, 4096 and 8192.  Timings in one process on a shared machine: compare
the ratios, not the seconds.
"""
import argparse
import time

import numpy as np

import sparse_attn as sa

SHAPES = [(9, 3, 64, 2048), (9, 3, 64, 7000), (16, 8, 128, 2048), (16, 8, 128, 4096),
          (16, 8, 128, 8192)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("isa_a", nargs="?", default="avx512-vnni")
    ap.add_argument("isa_b", nargs="?", default="avx512-amx")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    for isa in (args.isa_a, args.isa_b):
        if isa not in sa.available_isas():
            raise SystemExit(f"{isa} does not run here; this CPU runs {sa.available_isas()}")
    rng = np.random.default_rng(0)
    for H, Hkv, D, T in SHAPES:
        q = rng.standard_normal((H, T, D), dtype=np.float32)
        k = sa.quantize_q8(rng.standard_normal((Hkv, T, D), dtype=np.float32))
        v = sa.quantize_q8(rng.standard_normal((Hkv, T, D), dtype=np.float32))
        times = {args.isa_a: [], args.isa_b: []}
        outs = {}
        for _ in range(args.repeats):
            for isa in times:
                sa.set_isa(isa)
                t0 = time.perf_counter()
                outs[isa] = sa.prefill(q, k, v)
                times[isa].append(time.perf_counter() - t0)
        a, b = times[args.isa_a], times[args.isa_b]
        ratios = sorted(y / x for x, y in zip(a, b))
        same = all(np.array_equal(x, y) for x, y in zip(outs[args.isa_a], outs[args.isa_b]))
        print(f"H={H} Hkv={Hkv} D={D} T={T}: {args.isa_a} {min(a):.3f}-{max(a):.3f} s, "
              f"{args.isa_b} {min(b):.3f}-{max(b):.3f} s, {args.isa_b}/{args.isa_a} per pair "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f}, bitwise equal: {same}")


if __name__ == "__main__":
    main()

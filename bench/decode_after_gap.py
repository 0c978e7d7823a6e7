"""A decode call after other work, as in a model between two layers: one
thread against two, with the worker threads asleep.

    python bench/decode_after_gap.py [--lengths 2048,7000] [--gap-us 900]
                                     [--calls 300] [--rounds 3]

Each call is a q8 KVCache's sparse decode (k=32, seed) on SmolLM2's layer
shape (9 q / 3 KV heads, head_dim 64), preceded by --gap-us of numpy work
over a 16 MB array (a model's layer between two attention calls: long
enough for the workers to stop polling and sleep, and it evicts the L2);
"back to back" is two threads with no gap (the workers still polling).
Per length and round: the median call time of each way, measured
alternately in one process; compare them, not the seconds.  The outputs
are checked bitwise equal.
"""
import argparse
import time

import numpy as np

import sparse_attn as sa


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2048,7000")
    ap.add_argument("--gap-us", type=float, default=900)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    big = np.ones(4 << 20, np.float32)
    H, Hkv, D = 9, 3, 64
    print(f"isa {sa.isa()}; gap {args.gap_us:.0f} us of numpy work before each call")
    for S in (int(x) for x in args.lengths.split(",")):
        cache = sa.KVCache(Hkv, D, capacity=S, dtype="q8", copy_probe_rows=True)
        cache.append(rng.standard_normal((Hkv, S, D), np.float32),
                     rng.standard_normal((Hkv, S, D), np.float32))
        q = rng.standard_normal((H, D), np.float32)
        for r in range(args.rounds):
            ways = {"1 thread": (1, True), "2 threads": (2, True), "2 threads back to back": (2, False)}
            times, outs = {w: [] for w in ways}, {}
            decoders = {w: cache.decoder(k_blocks=32, policy="seed", threads=t)
                        for w, (t, _) in ways.items()}
            for i in range(args.calls):
                for w, (_, gap) in ways.items():
                    t = time.perf_counter()
                    while gap and time.perf_counter() - t < args.gap_us * 1e-6:
                        big[:1 << 18].sum()
                    t = time.perf_counter()
                    outs[w] = decoders[w](q)
                    times[w].append(time.perf_counter() - t)
            same = all(o.tobytes() == outs["1 thread"].tobytes() for o in outs.values())
            print(f"{S:6d} tokens, round {r + 1}: " +
                  ", ".join(f"{w} {np.median(v) * 1e6:.0f} us" for w, v in times.items()) +
                  ("" if same else "  OUTPUTS DIFFER"), flush=True)


if __name__ == "__main__":
    main()

"""Dense q8 decode over plain `Q8` arrays against the same step through a
`KVCache`, side by side, with the KV past the last-level cache.

    python bench/plain_vs_cache.py [--tokens 32768] [--layers 12] [--rounds 7]
                                   [--small-pages]

Qwen3-VL-2B's layer shape (16 q / 8 KV heads, head_dim 128).  Each of
--layers layers has its own K and V twice over: quantised into plain `Q8`
arrays (`sparse_attn.quantize_q8`) and appended to a q8 `KVCache`; a round
decodes every layer through each, alternately, and reports microseconds
per layer (median and range over the rounds).  The outputs are checked
bitwise equal.  --small-pages turns off numpy's huge-page advice for the
plain arrays (as arrays made elsewhere, e.g. from torch tensors, may be),
which leaves the hardware prefetchers to stop at every 4 KiB page.
"""
import argparse
import statistics
import time

import numpy as np

import sparse_attn as sa
from sparse_attn import machine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--small-pages", action="store_true")
    args = ap.parse_args()
    if args.small_pages:
        np._core.multiarray._set_madvise_hugepage(False)
    H, Hkv, D, S = 16, 8, 128, args.tokens
    rng = np.random.default_rng(0)
    caches, plains = [], []
    for _ in range(args.layers):
        k = rng.standard_normal((Hkv, S, D), np.float32)
        v = rng.standard_normal((Hkv, S, D), np.float32)
        cache = sa.KVCache(Hkv, D, capacity=S, dtype="q8")
        cache.append(k, v)
        caches.append(cache)
        plains.append((sa.quantize_q8(k), sa.quantize_q8(v)))
    q = rng.standard_normal((H, D), np.float32)
    for cache, (kq, vq) in zip(caches, plains):
        assert cache.dense_decode(q).tobytes() == sa.dense_decode(q, kq, vq).tobytes()
    ways = {"KVCache": lambda: [c.dense_decode(q) for c in caches],
            "plain Q8": lambda: [sa.dense_decode(q, kq, vq) for kq, vq in plains]}
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, step in ways.items():
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) / args.layers * 1e6)
    mb = 2 * Hkv * S * (D + 4 * D // 32) * args.layers / 1e6
    print(f"{machine.cpu_model()}; isa {sa.isa()}; {S} tokens x {args.layers} layers "
          f"({mb:.0f} MB of q8 K+V per way); {'small' if args.small_pages else 'huge'} pages "
          "for the plain arrays")
    base = times["KVCache"]
    for name, ts in times.items():
        ratio = [t / b for t, b in zip(ts, base)]
        print(f"{name:9s} {statistics.median(ts):8.0f} us/layer [{min(ts):.0f}-{max(ts):.0f}]"
              f"  vs KVCache {statistics.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]")


if __name__ == "__main__":
    main()

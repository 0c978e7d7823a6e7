"""Decode steps of two builds of the package, alternated in one process.

    python bench/decode_builds_ab.py OTHER_SRC [--lengths 4096,32768]
        [--layers N] [--threads T] [--rounds R] [--policies dense,seed,balanced]
        [--shape 16,8,128] [--dtype q8|float32]

OTHER_SRC is the folder holding another built checkout's `sparse_attn`
package (the root of e.g. a `git worktree` of the previous commit, built
with `python setup.py build_ext --inplace`).  Its `sparse_attn` is copied to a temporary folder as
`sparse_attn_other` (the package imports itself relatively, and the compiled
core's init function does not depend on the package's name; cffi registers
the other core as `sparse_attn._core` too, and this script puts its own back
in `sys.modules`), so both builds
run in this process on the same arrays: per policy and length, each build's
`KVCache`s (q8 unless `--dtype float32`) (`--shape`: query heads, KV heads, head_dim; random K/V and importance,
the probe-row and channel copies kept), one decode step over every layer
per round, the builds' order swapped every round.  It prints the median and
minimum step of each and the per-round ratio this/other, and refuses to time
builds whose outputs differ by more than float rounding (a normwise relative
1e-5: the same blocks, the same sums in another order, like q8 V's scale
moved into the weights).  Where /proc/kpageflags is readable (root on
Linux) it also prints the share of each build's K/V pages that sit in
transparent huge pages, which moves a decode step by several percent.
`--layers` defaults to enough layers for 4x the last-level cache of KV, and
for a sparse policy enough that its step reads about 2.5x the last-level
cache between two visits of one layer.  On a shared machine compare the ratios, not the
milliseconds.
"""
import argparse
import atexit
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np

import sparse_attn as sa
from sparse_attn.bench.common import distinct_buffers, last_level_cache

ROUNDING = 1e-5  # the largest normwise relative difference between builds timed

def load_other(src):
    pkg = os.path.join(src, "sparse_attn")
    if not os.path.isdir(pkg):
        raise SystemExit(f"{src} has no sparse_attn package folder")
    tmp = tempfile.mkdtemp(prefix="sa_other_")
    atexit.register(shutil.rmtree, tmp, True)      # the loaded core stays mapped
    shutil.copytree(pkg, os.path.join(tmp, "sparse_attn_other"))
    sys.path.insert(0, tmp)
    # cffi's module registers itself under the name it was compiled with,
    # sparse_attn._core: put this build's back once the other has loaded.
    ours = sys.modules.get("sparse_attn._core")
    import sparse_attn_other
    sys.modules["sparse_attn._core"] = ours
    return sparse_attn_other


def decoders(mod, data, policy, threads, dtype="q8"):
    out = []
    for k, v, imp in data:
        c = mod.KVCache(k.shape[0], k.shape[2], capacity=k.shape[1], dtype=dtype,
                        copy_probe_rows=True,
                        copy_channels=True)
        c.append(k, v)
        c.add_importance(imp)
        out.append(c.decoder(dense=True, threads=threads) if policy == "dense" else
                   c.decoder(k_blocks=32, policy=policy, threads=threads))
    return out


def huge_share(caches_kv):
    """The share of the 4 KB pages under these arrays that belong to a
    transparent huge page (KPF_THP in /proc/kpageflags), or None when the
    kernel does not say."""
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            pages = huge = 0
            for a in caches_kv:
                for page in range(a.ctypes.data & ~4095, a.ctypes.data + a.nbytes, 4096):
                    pm.seek(page // 4096 * 8)
                    entry = struct.unpack("Q", pm.read(8))[0]
                    if not entry >> 63:
                        continue            # not in memory
                    kf.seek((entry & ((1 << 55) - 1)) * 8)
                    pages += 1
                    huge += struct.unpack("Q", kf.read(8))[0] >> 22 & 1
            return huge / pages if pages else None
    except (OSError, struct.error):
        return None


def kv_arrays(decs):
    return [a for d in decs for t in (d.cache.k, d.cache.v)
            for a in ((t.data, t.scales) if hasattr(t, "scales") else (t,))]


def first(x):
    return x[0] if isinstance(x, tuple) else x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other_src")
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--policies", default="dense,seed,balanced")
    ap.add_argument("--shape", default="16,8,128",
                    help="query heads, KV heads, head_dim (default: Qwen3-VL-2B's layer)")
    ap.add_argument("--dtype", choices=("q8", "float32"), default="q8")
    args = ap.parse_args()
    H, HKV, D = (int(x) for x in args.shape.split(","))
    other = load_other(args.other_src)
    llc = last_level_cache()[0]
    rng = np.random.default_rng(0)
    for T in (int(x) for x in args.lengths.split(",")):
        row = D + 4 * D // 32 if args.dtype == "q8" else 4 * D
        per_layer = 2 * HKV * T * row
        # A sparse step reads the same blocks of a layer at every visit, so
        # size the layers by what the sparsest policy reads of one: at most
        # 64 blocks of K and V per KV head (two heads' 32) and an eighth of
        # K for its scoring.  Sized by the whole layer, two 32K-token layers
        # held only 13 MB of seed reads, which a 32 MiB L3 kept.
        sparse = [p for p in args.policies.split(",") if p != "dense"]
        reads = min(per_layer, 2 * HKV * min(T, 64 * 32) * row + per_layer // 16) \
            if sparse else per_layer
        layers = args.layers or max(-(-4 * llc // per_layer),
                                    distinct_buffers(reads, per_layer, llc, float("inf"))[0])
        data = [(rng.standard_normal((HKV, T, D), dtype=np.float32),
                 rng.standard_normal((HKV, T, D), dtype=np.float32),
                 rng.random(T, dtype=np.float32)) for _ in range(layers)]
        q = rng.standard_normal((H, D), dtype=np.float32)
        for policy in args.policies.split(","):
            builds = {"this": decoders(sa, data, policy, args.threads, args.dtype),
                      "other": decoders(other, data, policy, args.threads, args.dtype)}
            outs = {name: first(ds[0](q)) for name, ds in builds.items()}
            a, b = (o.astype(np.float64) for o in (outs["this"], outs["other"]))
            diff = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
            if not diff <= ROUNDING:
                print(f"{T} {policy}: the builds' outputs differ (relative {diff:.3g}); "
                      "not timed")
                continue
            if diff:
                print(f"{T} {policy}: the builds' outputs differ by rounding "
                      f"(relative {diff:.3g})")
            times = {"this": [], "other": []}
            for r in range(args.rounds):
                for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                    t0 = time.perf_counter()
                    for d in builds[name]:
                        d(q)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            a, b = np.array(times["this"]), np.array(times["other"])
            share = {name: huge_share(kv_arrays(ds)) for name, ds in builds.items()}
            pages = "" if None in share.values() else \
                f"  K/V in huge pages: this {share['this']:.0%}, other {share['other']:.0%}"
            print(f"{T:6d} {policy:9s} {layers:3d} layers  this {np.median(a):8.3f} ms "
                  f"(min {a.min():.3f})  other {np.median(b):8.3f} ms (min {b.min():.3f})  "
                  f"this/other per round: median {np.median(a / b):.3f} "
                  f"[{np.percentile(a / b, 25):.3f}-{np.percentile(a / b, 75):.3f}]{pages}")
            del builds


if __name__ == "__main__":
    main()

"""Split-KV decode: one thread against two on the shapes with few KV heads,
and the same call on another build of the core (A/B).

    python bench/split_kv.py [--lengths 512,2061,32768] [--rounds 5]
                             [--shapes one-head,qwen2.5,qwen3-vl,smollm2]
                             [--threads 1,2] [--slow-core] [--json FILE]

Per shape and length: dense and sparse (k=32, balanced through a q8
KVCache) decode time at each thread count, measured alternately in one
process (median of each round's calls; the range over rounds), and the
ratio of one thread's time to each other count's.  Outputs are checked
bitwise equal across thread counts.  Run it under two builds (PYTHONPATH
set to each checkout) one after the other, or pair them with farm-bench,
to compare builds.

--slow-core makes one core slow: a busy process pinned to the last CPU this
process may use takes half of that core, and the calling thread is kept on
the first CPU (after the worker threads have started, so they may run
anywhere).  One thread is then the fast core alone; two threads show
whether the step follows the fast core or waits for the slow one.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import sparse_attn as sa
from sparse_attn import machine

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "one-head": (8, 1, 256),
    "qwen2.5": (14, 2, 64),
    "qwen3-vl": (16, 8, 128),
    "smollm2": (9, 3, 64),
}


def timed(fn, calls):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2061,32768")
    ap.add_argument("--shapes", default="one-head,qwen2.5,qwen3-vl")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slow-core", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    print(f"{machine.cpu_model()}; isa {sa.isa()}; core {sa.__file__}")
    facts = machine.info()  # before the calling thread is pinned below
    busy = None
    if args.slow_core:
        cpus = sorted(os.sched_getaffinity(0))
        sa.dense_decode(np.ones((2, 8), np.float32), np.ones((2, 4096, 8), np.float32),
                        np.ones((2, 4096, 8), np.float32), threads=max(threads))
        busy = subprocess.Popen(["taskset", "-c", str(cpus[-1]), sys.executable, "-c",
                                 "while True: pass"])
        os.sched_setaffinity(0, {cpus[0]})
        print(f"slow core: cpu {cpus[-1]} shared with a busy process; caller on cpu {cpus[0]}")
    try:
        run(args, threads, rng, rows)
    finally:
        if busy:
            busy.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": facts, "slow_core": args.slow_core,
                       "command": machine.command_line("python bench/split_kv.py",
                                                       sys.argv[1:]),
                       "rows": rows}, f, indent=1)


def run(args, threads, rng, rows):
    for shape in args.shapes.split(","):
        H, Hkv, D = SHAPES[shape]
        for S in (int(x) for x in args.lengths.split(",")):
            cache = sa.KVCache(Hkv, D, capacity=S, dtype="q8")
            cache.append(rng.standard_normal((Hkv, S, D), np.float32),
                         rng.standard_normal((Hkv, S, D), np.float32))
            q = rng.standard_normal((H, D), np.float32)
            kv_bytes = 2 * Hkv * S * (D + 4 * D // 32)
            calls = max(5, min(400, int(2e9 / kv_bytes)))
            for mode in ("dense", "k=32"):
                if mode == "dense":
                    def call(t):
                        return cache.dense_decode(q, threads=t)
                else:
                    def call(t):
                        return cache.decode(q, k_blocks=32, threads=t)
                outs = {t: call(t) for t in threads}
                for t in threads:
                    assert outs[t].tobytes() == outs[threads[0]].tobytes(), (shape, S, mode, t)
                per = {t: [] for t in threads}
                for _ in range(args.rounds):
                    for t in threads:
                        per[t].append(timed(lambda: call(t), calls))
                base = per[threads[0]]
                row = {"shape": shape, "H": H, "Hkv": Hkv, "D": D, "tokens": S,
                       "mode": mode, "kv_mb": kv_bytes / 1e6,
                       "us": {t: [1e6 * x for x in per[t]] for t in threads},
                       "speedup": {t: [b / x for b, x in zip(base, per[t])] for t in threads}}
                rows.append(row)
                cells = "  ".join(
                    f"t={t} {1e6 * statistics.median(per[t]):8.1f} us"
                    + (f" ({min(row['speedup'][t]):.2f}-{max(row['speedup'][t]):.2f}x)"
                       if t != threads[0] else "")
                    for t in threads)
                print(f"{shape:9s} {S:6d} {mode:6s} {cells}", flush=True)


if __name__ == "__main__":
    main()

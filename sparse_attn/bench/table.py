"""The article's board table on any machine (``sparse-attn bench``).

One decode step of a Qwen3-VL-2B-shaped model (28 layers, 16 query heads,
8 KV heads, head_dim 128) over a synthetic needle-in-a-haystack context
(:mod:`sparse_attn.synthetic`), for several context lengths, dense and
sparse configurations, q8 and float32 KV, side by side with numpy and (when
installed) torch's scaled_dot_product_attention, and against the memory
floor measured in the same run (:class:`~sparse_attn.bench.common.Floor`),
read again just before and after each row's timing: a row's ``x floor``
is its time over its bytes at the best of those reads, so a spell of slow
memory on a shared machine moves the row and its floor together.

Each layer has its own KV and what a KVCache keeps beside it (probe-row
copies, key bounds); for each row, enough distinct copies are cycled that
between two visits of one layer's buffers that row reads 2.5x the
last-level cache of other KV, so the KV streams from DRAM on any machine
(the output says when memory is too short for that).  A sparse row reads
the same few blocks of a layer at every visit, so it cycles more layers
than dense: sized by dense's reads, a 32K-token sparse step's blocks of
two layers fitted in a 32 MiB L3.
"""
import math

import numpy as np

import sparse_attn as sa
from sparse_attn._storage import Arena
from sparse_attn.machine import fmt_bytes
from sparse_attn.metadata import BlockBounds, ChannelCopy, ProbeRows
from sparse_attn.q8 import Q8
from sparse_attn.read_bytes import decode_read_bytes
from sparse_attn.selection import selection
from sparse_attn.synthetic import needle_context

from .common import (available_memory, config_cell, distinct_buffers, log, needle_cell,
                     print_grouped, pyplot, ratio_cell, timed_beside)

QWEN3_VL_2B = dict(n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128)
DEFAULT_LENGTHS = (2061, 4096, 8192, 32768)
DEFAULT_CONFIGS = ("dense", "32", "16", "8", "4", "1")
# Distinct synthetic contexts per length; the rest of the cycled layers are
# copies of them (same values, distinct memory: caches work by address).
BASE_CONTEXTS = 4
WHY_K1 = ("k=1: the importance reserve is (k+1)//2 = 1 block, so the single slot goes to the "
          "block prefill attended to most and the probe never gets a say (spec §2.5): the "
          "needle is lost, as on the board.")


def numpy_decode(q, k, v, scale):
    """What a numpy user writes: float32 matmul + softmax, GQA by reshaping."""
    hkv, _, d = k.shape
    qg = q.reshape(hkv, -1, d)
    s = np.matmul(qg, k.transpose(0, 2, 1))
    s *= scale
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v).reshape(q.shape)


class Layer:
    """One layer's buffers at one KV dtype: K, V, the key bounds, the
    probe-row copies and (when a policy scores channels) the channel copy a
    KVCache keeps, the importance its prompt recorded, and the question
    query."""

    def __init__(self, ctx, importance, k, v, bounds, probe_rows, channels=None):
        self.ctx, self.importance = ctx, importance
        self.k, self.v, self.bounds, self.probe_rows = k, v, bounds, probe_rows
        self.channels = channels

    @classmethod
    def build(cls, ctx, importance, dtype, args):
        if dtype == "q8":
            k, v = sa.quantize_q8(ctx.k, args.group_size), sa.quantize_q8(ctx.v, args.group_size)
        else:
            k, v = ctx.k, ctx.v
        channels = any(knobs.get("scoring") == "channels" for _, knobs in args.policies)
        return cls(ctx, importance, k, v, sa.block_bounds(k, block_size=args.block_size),
                   sa.probe_rows(k, block_size=args.block_size, n_probe=args.n_probe or 8),
                   sa.channel_copy(k, block_size=args.block_size) if channels else None).copy()

    def copy(self):
        """The same layer in new memory, laid out as a KVCache keeps it: K,
        V, the bounds and the copies in one allocation (huge pages where the
        system has them, docs/design.md "One allocation per cache")."""
        def parts(t):
            return (t.data, t.scales) if isinstance(t, Q8) else (t,)
        b, p, c = self.bounds, self.probe_rows, self.channels
        arrays = [*parts(self.k), *parts(self.v), b.mn, b.mx, b.scales, *parts(p.rows),
                  *((c.data, c.scales) if c is not None else ())]
        plan = Arena()
        for a in arrays:
            plan.plan(a.shape, a.dtype)
        arena = Arena(plan.nbytes)
        arena.advise_all()                      # every row is written now
        moved = []
        for a in arrays:
            m = arena.take(a.shape, a.dtype)
            m[...] = a
            moved.append(m)
        it = iter(moved)

        def take(t):
            return Q8._wrap(next(it), next(it), t.group_size) if isinstance(t, Q8) else next(it)
        # _wrap, not the public constructors: those copy the caller's arrays
        # (a metadata object owns its data), which would move them out of
        # the arena this layout is about
        k, v = take(self.k), take(self.v)
        mn = next(it)
        bounds = BlockBounds._wrap(mn, next(it), next(it), b.block_size, b.scale_group,
                                   b.k_rows, stride=mn.shape[1])
        rows = ProbeRows._wrap(take(p.rows), p.block_size, p.n_probe, p.k_rows)
        channels = None if c is None else \
            ChannelCopy._wrap(next(it), next(it), c.block_size, c.k_rows)
        return Layer(self.ctx, self.importance.copy(), k, v, bounds, rows, channels)

    @property
    def nbytes(self):
        return (self.k.nbytes + self.v.nbytes + self.bounds.nbytes + self.probe_rows.nbytes
                + self.importance.nbytes + (self.channels.nbytes if self.channels else 0))

    def metadata(self, sel):
        """What a KVCache.decode with this selection passes beside K."""
        if sel.reads == "bounds":
            return {"bounds": self.bounds}
        if sel.reads == "channels":
            return {"channels": self.channels}
        if sel.reads == "probe_rows" and sel.n_probe == self.probe_rows.n_probe:
            return {"probe_rows": self.probe_rows}
        return {}


class Cycle:
    """The distinct layers of one dtype, visited args.layers at a time from
    a cursor that moves on after every step."""

    def __init__(self, layers):
        self.layers, self.cursor = layers, 0

    def warmup_steps(self, n):
        """Steps of n layers that visit every distinct layer once: the
        untimed warm-up, so that every timed step reads layers that were
        read before, as a model's decode does. (The first pass after the
        layers were written also writes the dirty lines the last-level
        cache evicts back to memory: on a 480 MiB L3 that made the first
        steps of a 2061-token q8 row 1.3-1.5x slower.)"""
        return -(-len(self.layers) // n)

    def step(self, n):
        start = self.cursor
        self.cursor = (self.cursor + n) % len(self.layers)
        return [self.layers[(start + i) % len(self.layers)] for i in range(n)]


class Pool:
    """The distinct layers of one dtype at one length: the base layers and
    the copies made so far, grown as a row needs more of them."""

    def __init__(self, base, label, memory_cap, llc):
        self.base, self.layers = base, list(base)
        self.label, self.memory_cap, self.llc = label, memory_cap, llc

    def cycle(self, read_bytes, notes):
        """A Cycle over enough distinct layers that a step reading
        read_bytes of each layer reads 2.5x the LLC between two visits of
        one (common.distinct_buffers); a note when memory caps it."""
        per_layer = self.base[0].nbytes
        count, note = distinct_buffers(read_bytes, per_layer, self.llc, self.memory_cap)
        while len(self.layers) < count:
            self.layers.append(self.base[len(self.layers) % len(self.base)].copy())
        log(f"  [{self.label}] {count} distinct layers of {fmt_bytes(per_layer)} cycled "
            f"({fmt_bytes(count * per_layer)}), {fmt_bytes(read_bytes)} read per visit")
        if note and f"{self.label}: {note}" not in notes:
            notes.append(f"{self.label}: {note}")
        return Cycle(self.layers[:count])


def base_contexts(length, args):
    out = []
    for i in range(min(args.layers, BASE_CONTEXTS)):
        log(f"  [{length}] context {i + 1}: generating, prefilling the last "
            f"{min(args.prefill_tokens, length)} tokens for importance")
        ctx = needle_context(length, n_heads=args.heads, n_kv_heads=args.kv_heads,
                             head_dim=args.head_dim, seed=args.seed * 1000 + i,
                             block_size=args.block_size, prompt_tokens=args.prefill_tokens)
        t = ctx.prompt_q.shape[1]
        _, imp = sa.prefill(ctx.prompt_q, ctx.k, ctx.v, start=length - t, threads=args.threads)
        out.append((ctx, imp))
    return out


def step_bytes(blocks, length, dtype, args, sel):
    """Bytes one layer's decode step must read (sparse_attn.read_bytes)."""
    return decode_read_bytes(blocks, length, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                             dtype=dtype, sel=sel, group_size=args.group_size)


def run_length(length, args, floor, torch, bases):
    scale = 1.0 / math.sqrt(args.head_dim)
    rows, notes = [], []
    budget = available_memory()
    pools = {}
    for dtype in args.dtypes + (["float32"] if args.baselines and "float32" not in args.dtypes
                                else []):
        pools[dtype] = Pool([Layer.build(ctx, imp, dtype, args) for ctx, imp in bases],
                            f"{length} {dtype}", budget // max(1, len(args.dtypes)), floor.llc)

    for dtype in args.dtypes:
        pool = pools[dtype]
        base = pool.base
        exact = [sa.dense_decode(l.ctx.question_q, l.k, l.v, threads=args.threads) for l in base]
        dense_time = None
        cells = [("dense", None, None)] if "dense" in args.configs else []
        cells += [(c, name, knobs) for name, knobs in args.policies
                  for c in args.configs if c != "dense"]
        for config, policy, knobs in cells:
            log(f"  [{length}] {dtype} {config} {policy or ''}")
            if config == "dense":
                sel = None
                outs, blocks = exact, [None] * len(base)
            else:
                kw = {k: v for k, v in knobs.items() if k != "dense_layers"}
                if args.n_probe is not None:
                    kw["n_probe"] = args.n_probe
                kw.update(k_blocks=int(config), block_size=args.block_size)
                sel = selection(**kw)
                kw["threads"] = args.threads
                res = [sa.sparse_decode(l.ctx.question_q, l.k, l.v, importance=l.importance,
                                        return_blocks=True, **l.metadata(sel), **kw)
                       for l in base]
                outs, blocks = [r[0] for r in res], [r[1] for r in res]
            nbytes = sum(step_bytes(blocks[i % len(base)], length, dtype, args, sel)
                         for i in range(args.layers))
            # The same question reads the same blocks at every visit: cycle
            # enough layers that what this row reads between two visits of
            # one layer is 2.5x the LLC (a sparse row reads less per layer,
            # so it needs more layers than dense).
            cycle = pool.cycle(nbytes / args.layers, notes)
            if config == "dense":
                def step(cycle=cycle):
                    for l in cycle.step(args.layers):
                        sa.dense_decode(l.ctx.question_q, l.k, l.v, threads=args.threads)
            else:
                def step(kw=kw, sel=sel, cycle=cycle):
                    for l in cycle.step(args.layers):
                        sa.sparse_decode(l.ctx.question_q, l.k, l.v, importance=l.importance,
                                         **l.metadata(sel), **kw)
            med, lo, hi, bandwidth = timed_beside(step, args.repeats,
                                                  cycle.warmup_steps(args.layers), floor)
            if config == "dense":
                dense_time = med
            needle_hits, needle_heads = 0, 0
            for l, b in zip(base, blocks):
                heads = l.ctx.retrieval_heads
                needle_heads += int(heads.sum())
                needle_hits += int(heads.sum()) if b is None else int(
                    (b[heads] == l.ctx.needle_block).any(axis=1).sum())
            err = max(float(np.abs(o - e).max() / np.abs(e).max()) for o, e in zip(outs, exact))
            floor_s = nbytes / bandwidth
            rows.append(dict(length=length, impl="sparse_attn", dtype=dtype, config=config,
                             policy=policy, knobs=knobs,
                             recall=needle_hits / needle_heads, rel_err=err,
                             ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
                             speedup_vs_dense=(dense_time / med) if dense_time else None,
                             bytes=nbytes, floor_gbs=bandwidth / 1e9, floor_ms=floor_s * 1e3,
                             x_floor=med / floor_s, distinct_layers=len(cycle.layers)))

    if args.baselines:
        dense_bytes = args.layers * step_bytes(None, length, "float32", args, None)
        cycle = pools["float32"].cycle(dense_bytes / args.layers, notes)

        def baseline(impl, dtype, fn, nbytes, warmup):
            log(f"  [{length}] {impl} {dtype}")
            med, lo, hi, bandwidth = timed_beside(fn, max(1, args.repeats // 2), warmup, floor)
            ref_dense = next((r["ms"] for r in rows if r["impl"] == "sparse_attn"
                              and r["dtype"] == "float32" and r["config"] == "dense"), None)
            rows.append(dict(length=length, impl=impl, dtype=dtype, config="dense", policy=None,
                             knobs=None, recall=1.0, rel_err=None, ms=med * 1e3, ms_min=lo * 1e3,
                             ms_max=hi * 1e3,
                             speedup_vs_dense=(ref_dense / (med * 1e3)) if ref_dense else None,
                             bytes=nbytes, floor_gbs=bandwidth / 1e9,
                             floor_ms=nbytes / bandwidth * 1e3,
                             x_floor=med / (nbytes / bandwidth)))

        def numpy_step():
            for l in cycle.step(args.layers):
                numpy_decode(l.ctx.question_q, l.k, l.v, scale)
        baseline("numpy", "float32", numpy_step, dense_bytes, cycle.warmup_steps(args.layers))
        if torch is not None:
            torch.set_num_threads(args.threads)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            for tdtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
                tl = [(torch.from_numpy(l.ctx.question_q)[None, :, None].to(tdtype),
                       torch.from_numpy(l.k)[None].to(tdtype),
                       torch.from_numpy(l.v)[None].to(tdtype)) for l in cycle.layers]
                tcycle = Cycle(tl)

                def torch_step(tcycle=tcycle):
                    with torch.inference_mode():
                        for q, k, v in tcycle.step(args.layers):
                            sdpa(q, k, v, scale=scale, enable_gqa=True)
                baseline("torch-sdpa", name, torch_step,
                         dense_bytes if name == "float32" else dense_bytes // 2,
                         tcycle.warmup_steps(args.layers))
                del tl, tcycle
    return rows, notes


def fmt_ms(r):
    return f"{r['ms']:8.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}]"


def below_floor(rows, limit=0.95):
    """Rows that ran faster than the floor allows: the floor is then not an
    upper bound of the bandwidth (or the KV was read from cache)."""
    return [r for r in rows if r["impl"] == "sparse_attn" and r["x_floor"] < limit]


def print_table(rows, args, floor, notes):
    print(f"\nDecode attention, {args.layers} layers x ({args.heads} q heads, {args.kv_heads} KV "
          f"heads, head_dim {args.head_dim}); block {args.block_size}, n_probe "
          f"{args.n_probe or 'per policy'}; ISA {sa.isa()}, {args.threads} thread(s)")
    print(f"floor: {floor.describe()}")
    gbs = [r["floor_gbs"] for r in rows]
    print(f"       read again beside each row (2 passes just before its timing, 2 just after; "
          f"best of the 4): {min(gbs):.1f}-{max(gbs):.1f} GB/s over the rows")
    print("ms = time per token for all layers, median [min–max] of "
          f"{args.repeats}; err = max relative error vs dense at the same dtype;")
    print("floor ms = bytes the step must read / the row's floor GB/s; x floor = ms / floor ms."
          "\n")
    head = (f"{'ctx':>6} {'impl':<12} {'KV':<8} {'config':<6} {'policy':<8} {'needle':>6} "
            f"{'err':>8} {'ms/token [min–max]':>24} {'vs dense':>8} {'MB read':>8} "
            f"{'GB/s':>5} {'floor ms':>8} {'x floor':>7}")

    def line(r):
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        return (f"{r['length']:>6} {r['impl']:<12} {r['dtype']:<8} "
                f"{config_cell(r['config'], 'dense'):<6} {r['policy'] or '-':<8} "
                f"{needle_cell(r['recall']):>6} {err:>8} {fmt_ms(r):>24} "
                f"{ratio_cell(r['speedup_vs_dense']):>8} {r['bytes'] / 1e6:8.1f} "
                f"{r['floor_gbs']:5.1f} {r['floor_ms']:8.2f} {r['x_floor']:7.2f}")
    print_grouped(head, rows, line)
    if any(r["config"] == "1" and r["recall"] == 0 and r["policy"] == "seed" for r in rows):
        print("\n" + WHY_K1)
    print("baseline rows: 'vs dense' is sparse_attn dense float32 time / baseline time "
          "(> 1 means the baseline is faster).")
    for note in notes:
        print(f"note: {note}")
    for r in below_floor(rows):
        print(f"WARNING: {r['length']} {r['dtype']} {r['config']} {r['policy'] or ''} ran at "
              f"{r['x_floor']:.2f}x the floor, faster than the memory floor allows: the floor "
              "underestimates this machine's bandwidth, or the KV came from cache.")


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["impl"], r["dtype"], r["config"], r["policy"] or "") for r in rows})
    for impl, dtype, config, policy in keys:
        pts = sorted((r["length"], r["ms"]) for r in rows
                     if (r["impl"], r["dtype"], r["config"], r["policy"] or "") ==
                     (impl, dtype, config, policy))
        label = f"{impl} {dtype} {config if config == 'dense' else 'k=' + config} {policy}"
        ax.plot(*zip(*pts), marker="o", label=label.strip())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode attention ms / token (all layers)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")

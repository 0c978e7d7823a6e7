"""The article's prefill column (``sparse-attn bench``): the prefill of the
whole context of the Qwen3-VL-2B-shaped model, exact and sparse, at each
KV dtype, beside torch's scaled_dot_product_attention (float32 and
bfloat16, causal, GQA) when it is installed.

A prefill's cost has the same shape in every layer, so ``--prefill-layers``
layers are timed (default 1, one call each: a prefill is long enough that
its first call is representative) and the figure is that time times
``--layers``: the table says so.  ``--prefill-rounds N`` times every row N
times, round by round (rows alternated), and reports medians with their
range; ``vs f32`` compares a q8 row with the float32 row of its config.
The queries are random (prefill's work does not depend on their values);
K and V are the synthetic context's.

The needle column of a sparse row is the decode table's check redone after
a sparse prefill: each base context's prompt is prefilled sparse with the
row's k and policy, and the decode step with that k and policy, reading the
importance the sparse prefill recorded, must choose the needle's block in
every retrieval head.
"""
import time

import numpy as np

import sparse_attn as sa
from sparse_attn.selection import selection

from .common import config_cell, log, needle_cell, print_grouped, ratio_cell


def needle_after_sparse_prefill(bases, kb, knobs, args):
    hits = heads = 0
    for ctx, _ in bases:
        t = ctx.prompt_q.shape[1]
        length = ctx.k.shape[1]
        _, imp = sa.prefill(ctx.prompt_q, ctx.k, ctx.v, start=length - t, k_blocks=kb,
                            block_size=args.block_size, exact_tail=args.exact_tail,
                            threads=args.threads, **knobs)
        _, blocks = sa.sparse_decode(ctx.question_q, ctx.k, ctx.v, k_blocks=kb,
                                     block_size=args.block_size, importance=imp,
                                     threads=args.threads, return_blocks=True, **knobs)
        rh = ctx.retrieval_heads
        heads += int(rh.sum())
        hits += int((blocks[rh] == ctx.needle_block).any(axis=1).sum())
    return hits / max(heads, 1)


def run_prefill(length, bases, args, torch):
    """Rows of the prefill table for one context length.

    Every row is timed ``--prefill-rounds`` times, a round timing each row
    once in table order, so the rows alternate and a shared machine's drift
    falls on all of them; a row's ``s`` is the median of its rounds (its
    range in ``s_min``/``s_max``, each round in ``s_rounds``), and the
    ratios are those of the medians (``*_range``: the ratio's range over the
    rounds, each round against the same round's reference)."""
    rng = np.random.default_rng(args.seed * 7919 + length)
    ctx = bases[0][0]
    q = rng.standard_normal((args.heads, length, args.head_dim), dtype=np.float32)
    scale_layers = args.layers / args.prefill_layers
    rows, fns = [], []

    def add(impl, dtype, config, policy, fn, needle):
        rows.append(dict(length=length, impl=impl, dtype=dtype, config=config, policy=policy,
                         needle=needle, layers_timed=args.prefill_layers, s_rounds=[]))
        fns.append(fn)

    for dtype in args.dtypes:
        if dtype == "q8":
            k, v = sa.quantize_q8(ctx.k, args.group_size), sa.quantize_q8(ctx.v, args.group_size)
        else:
            k, v = ctx.k, ctx.v

        def exact(k=k, v=v):
            for _ in range(args.prefill_layers):
                sa.prefill(q, k, v, threads=args.threads)
        add("sparse_attn", dtype, "exact", None, exact, 1.0)
        for name, knobs in args.policies:
            kw = {key: val for key, val in knobs.items() if key != "dense_layers"}
            if args.n_probe is not None:
                kw["n_probe"] = args.n_probe
            for config in args.prefill_configs:
                sel = selection(k_blocks=config, block_size=args.block_size, **kw)
                if sel.scoring == "minmax":
                    meta = {"bounds": sa.block_bounds(k, block_size=args.block_size)}
                elif sel.scoring == "channels":
                    meta = {"channels": sa.channel_copy(k, block_size=args.block_size)}
                else:
                    meta = {"probe_rows": sa.probe_rows(k, block_size=args.block_size,
                                                        n_probe=sel.n_probe)}

                def sparse(k=k, v=v, config=config, kw=kw, meta=meta):
                    for _ in range(args.prefill_layers):
                        sa.prefill(q, k, v, k_blocks=config, block_size=args.block_size,
                                   exact_tail=args.exact_tail, threads=args.threads, **meta,
                                   **kw)
                add("sparse_attn", dtype, str(config), name, sparse,
                    needle_after_sparse_prefill(bases, config, kw, args))
    if torch is not None:
        torch.set_num_threads(args.threads)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for tdtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            tq = torch.from_numpy(q)[None].to(tdtype)
            tk = torch.from_numpy(ctx.k)[None].to(tdtype)
            tv = torch.from_numpy(ctx.v)[None].to(tdtype)

            def torch_prefill(tq=tq, tk=tk, tv=tv):
                with torch.inference_mode():
                    for _ in range(args.prefill_layers):
                        sdpa(tq, tk, tv, is_causal=True, enable_gqa=True)
            add("torch-sdpa", name, "exact", None, torch_prefill, 1.0)
    for rnd in range(args.prefill_rounds):
        for r, fn in zip(rows, fns):
            log(f"  [{length}] prefill {r['impl']} {r['dtype']} {r['config']} "
                f"{r['policy'] or ''} (round {rnd + 1}/{args.prefill_rounds})")
            t0 = time.perf_counter()
            fn()
            r["s_rounds"].append((time.perf_counter() - t0) * scale_layers)
    fns.clear()
    for r in rows:
        t = r["s_rounds"]
        r.update(s=float(np.median(t)), s_min=min(t), s_max=max(t))
    exact = {r["dtype"]: r for r in rows if r["impl"] == "sparse_attn" and r["config"] == "exact"}
    torch_f32 = next((r for r in rows if r["impl"] == "torch-sdpa" and r["dtype"] == "float32"),
                     None)
    ours_f32 = {(r["config"], r["policy"]): r for r in rows
                if r["impl"] == "sparse_attn" and r["dtype"] == "float32"}
    for r in rows:
        ours = r["impl"] == "sparse_attn"
        for key, ref in (("speedup_vs_exact", exact.get(r["dtype"]) if ours else None),
                         ("vs_torch_f32", torch_f32),
                         ("vs_float32", ours_f32.get((r["config"], r["policy"]))
                          if ours and r["dtype"] == "q8" else None)):
            r[key] = ref["s"] / r["s"] if ref else None
            r[key + "_range"] = _ratio_range(ref["s_rounds"], r["s_rounds"]) if ref else None
    return rows


def _ratio_range(ref, mine):
    """[min, max] over the rounds of the reference's time / this row's."""
    ratios = [a / b for a, b in zip(ref, mine)]
    return [min(ratios), max(ratios)]


def print_prefill_table(rows, args):
    rounds = args.prefill_rounds
    print(f"\nPrefill of the whole context, {args.layers} layers x ({args.heads} q heads, "
          f"{args.kv_heads} KV heads, head_dim {args.head_dim}); {args.prefill_layers} layer(s) "
          f"timed, times {args.layers}; ISA {sa.isa()}, {args.threads} thread(s); "
          f"{rounds} round(s), the rows alternated; the sparse rows' exact tail "
          f"{args.exact_tail} rows.")
    print("vs exact = exact prefill time at the same KV dtype / this row's; vs torch = torch "
          "SDPA float32 causal time / this row's (> 1: faster than torch); vs f32 = the "
          "float32 row of the same config / this q8 row's."
          + (" Times are medians [min-max] over the rounds; ratios, those of the medians "
             "(their range over the rounds in --json)." if rounds > 1 else "") + "\n")
    spread = rounds > 1
    head = (f"{'ctx':>6} {'impl':<12} {'KV':<9} {'config':<6} {'policy':<8} {'needle':>6} "
            f"{'prefill s':>10} " + (f"{'[min-max]':<15} " if spread else "")
            + f"{'vs exact':>8} {'vs torch':>8} {'vs f32':>8}")

    def line(r):
        span = f"[{r['s_min']:.2f}-{r['s_max']:.2f}]"
        return (f"{r['length']:>6} {r['impl']:<12} {r['dtype']:<9} "
                f"{config_cell(r['config'], 'exact'):<6} {r['policy'] or '-':<8} "
                f"{needle_cell(r['needle']):>6} {r['s']:10.2f} "
                + (f"{span:<15} " if spread else "")
                + f"{ratio_cell(r['speedup_vs_exact']):>8} {ratio_cell(r['vs_torch_f32']):>8} "
                f"{ratio_cell(r['vs_float32']):>8}")
    print_grouped(head, rows, line)

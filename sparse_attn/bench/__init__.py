"""``sparse-attn bench`` / ``python -m sparse_attn.bench``: the benchmarks.

    sparse-attn bench [options]            the article's table: decode of a
                                           Qwen3-VL-2B-shaped model over a
                                           synthetic needle context, sparse vs
                                           dense vs numpy / torch SDPA, against
                                           the memory floor (sparse_attn.bench.table)
    sparse-attn bench kernels [options]    each kernel on every ISA this CPU runs
    sparse-attn bench model [options]      a real model through transformers: time to
                                           first token and decode ms/token, sdpa vs
                                           sparse_topk configurations (sparse_attn.bench.model)

Nothing is downloaded; torch and matplotlib are used only if installed.
"""
import argparse
import json
import sys

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn._checks import INT_MAX
from sparse_attn.isa import default_threads
from sparse_attn.selection import parse_policy

from .common import Floor, log
from .kernels import run_kernels
from .prefill import print_prefill_table, run_prefill
from .table import (DEFAULT_CONFIGS, DEFAULT_LENGTHS, QWEN3_VL_2B, base_contexts, below_floor,
                    plot, print_table, run_length)

PREFILL_MAX_DEFAULT = 8192

MODES = ("decode", "kernels", "model")


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def parse_model_args(argv, prog):
    from . import model
    ap = argparse.ArgumentParser(prog=f"{prog} model", description=model.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,7000",
                    help="prompt tokens, comma-separated (default %(default)s)")
    model.add_arguments(ap)
    ap.add_argument("--threads", type=int, default=None,
                    help="kernel threads (default: SPARSE_ATTN_NUM_THREADS or the cores)")
    ap.add_argument("--seed", type=int, default=0, help="filler seed")
    ap.add_argument("--json", metavar="PATH", help="write every figure and the machine info")
    ap.add_argument("--plot", metavar="PATH", help="draw decode ms and TTFT vs prompt tokens")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.configs = [model.parse_config(c) for c in args.configs.split(";") if c.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    if args.new_tokens < 2 or not 0 <= args.needle < len(model.NEEDLES) or \
            not 0 <= args.depth <= 1 or (args.threads is not None and args.threads < 1):
        ap.error("--new-tokens >= 2, --needle in range, --depth in [0, 1], --threads >= 1")
    args.mode = "model"
    return args


def parse_args(argv, prog="python -m sparse_attn.bench"):
    if argv and argv[0] == "model":
        return parse_model_args(argv[1:], prog)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=MODES, default="decode",
                    help="decode: the article's table (default); kernels: per-kernel timings; "
                         "model: a real model (its own options: bench model --help)")
    ap.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                    help="context lengths, comma-separated (default %(default)s)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="'dense' and/or k_blocks values (default %(default)s)")
    ap.add_argument("--dtypes", default="q8,float32", help="KV dtypes (default %(default)s)")
    ap.add_argument("--policies", default="seed",
                    help="selection policies for the sparse rows, ';'-separated: presets "
                         f"({', '.join(sa.POLICIES)}) or name:knob=value,... "
                         "(default %(default)s)")
    ap.add_argument("--layers", type=int, default=QWEN3_VL_2B["n_layers"])
    ap.add_argument("--heads", type=int, default=QWEN3_VL_2B["n_heads"])
    ap.add_argument("--kv-heads", type=int, default=QWEN3_VL_2B["n_kv_heads"])
    ap.add_argument("--head-dim", type=int, default=QWEN3_VL_2B["head_dim"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--n-probe", type=int, default=None,
                    help="rows probed per block, for every policy (default: each policy's, "
                         "seed 8, recall every row)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=128,
                    help="prompt tokens prefilled per layer for importance (default %(default)s)")
    ap.add_argument("--prefill-lengths", default=None,
                    help="context lengths whose whole-context prefill is timed (default: those "
                         f"of --lengths up to {PREFILL_MAX_DEFAULT}; 'none' for no prefill "
                         "table)")
    ap.add_argument("--prefill-configs", default="32",
                    help="k_blocks of the sparse prefill rows (default %(default)s)")
    ap.add_argument("--exact-tail", type=int, default=64,
                    help="the sparse prefill rows' exact tail: the blocks of the context's last "
                         "N rows prefill exactly (docs/spec.md §7.6; default %(default)s, what the "
                         "transformers backend uses)")
    ap.add_argument("--prefill-layers", type=int, default=1,
                    help="layers whose prefill is timed; the table scales to --layers "
                         "(default %(default)s)")
    ap.add_argument("--prefill-rounds", type=int, default=1,
                    help="rounds of the prefill table: each round times every row once, in "
                         "table order; a row reports its median [min-max] (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for sparse_attn and torch (default: SPARSE_ATTN_NUM_THREADS "
                         "or the usable cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="skip numpy and torch")
    ap.add_argument("--kernel-len", type=int, default=4096, help="tokens for 'kernels' mode")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run: 2061 tokens, 2 layers, dense/k=32/k=1, 1 repeat "
                         "(options given explicitly still apply)")
    ap.add_argument("--json", metavar="PATH", help="write every figure and the machine info")
    ap.add_argument("--plot", metavar="PATH", help="draw ms/token vs context (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for name, value in (("lengths", "2061"), ("configs", "dense,32,1"), ("layers", 2),
                            ("repeats", 1), ("kernel_len", 512)):
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    try:
        args.lengths = [int(x) for x in str(args.lengths).split(",")]
        args.configs = [c.strip() for c in args.configs.split(",")]
        for c in args.configs:
            if c != "dense" and int(c) < 1:
                raise ValueError(c)
    except ValueError:
        ap.error("--lengths takes integers and --configs 'dense' or integers >= 1")
    try:
        if args.prefill_lengths is None:
            args.prefill_lengths = [n for n in args.lengths if n <= PREFILL_MAX_DEFAULT]
        elif args.prefill_lengths.strip() == "none":
            args.prefill_lengths = []
        else:
            args.prefill_lengths = [int(x) for x in args.prefill_lengths.split(",")]
        args.prefill_configs = [int(x) for x in args.prefill_configs.split(",") if x.strip()]
    except ValueError:
        ap.error("--prefill-lengths takes integers (or 'none'), --prefill-configs integers")
    if set(args.prefill_lengths) - set(args.lengths):
        ap.error("--prefill-lengths must be among --lengths")
    if any(c < 1 for c in args.prefill_configs) or args.prefill_layers < 1 or \
            args.prefill_rounds < 1:
        ap.error("--prefill-configs, --prefill-layers and --prefill-rounds must be >= 1")
    if not 0 <= args.exact_tail <= INT_MAX:
        ap.error(f"--exact-tail must be in [0, {INT_MAX}] (a C int)")
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    try:
        args.policies = [parse_policy(p) for p in args.policies.split(";") if p.strip()]
    except sa.ArgumentError as exc:
        ap.error(f"--policies: {exc}")
    if not set(args.dtypes) <= {"q8", "float32"}:
        ap.error("--dtypes takes q8 and/or float32")
    if min(args.lengths) < 4 * args.block_size:
        ap.error(f"--lengths must be at least 4 blocks ({4 * args.block_size})")
    for name in ("layers", "heads", "kv_heads", "head_dim", "block_size", "n_probe",
                 "group_size", "prefill_tokens", "repeats", "kernel_len", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is None:
        args.threads = default_threads()
    return args


def main(argv=None, prog="python -m sparse_attn.bench"):
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    if args.mode == "model":
        from .model import main_model, plot_model
        rows = main_model(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=machine.info(), args={k: v for k, v in vars(args).items()
                                                             if k != "configs"},
                               configs=[c["label"] for c in args.configs], rows=rows), f,
                          indent=1)
        if args.plot:
            plot_model(rows, args.plot)
        return 0
    torch = torch_or_none() if args.baselines else None
    log(f"sparse_attn {sa.__version__}, ISA {sa.isa()}, {args.threads} thread(s)")
    floor = Floor(args.threads)
    log(f"floor: {floor.describe()}")
    info = dict(machine.info(), floor=floor.as_dict())
    if args.mode == "kernels":
        results = run_kernels(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=info, kernels=results), f, indent=1)
        return 0
    rows, notes, prefill_rows = [], [], []
    for length in args.lengths:
        log(f"context {length}:")
        bases = base_contexts(length, args)
        r, n = run_length(length, args, floor, torch, bases)
        rows += r
        notes += n
        if length in args.prefill_lengths:
            prefill_rows += run_prefill(length, bases, args, torch)
    print_table(rows, args, floor, notes)
    if prefill_rows:
        print_prefill_table(prefill_rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, args={k: v for k, v in vars(args).items()}, rows=rows,
                           prefill=prefill_rows, notes=notes,
                           below_floor=len(below_floor(rows))), f, indent=1)
        log(f"figures written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0

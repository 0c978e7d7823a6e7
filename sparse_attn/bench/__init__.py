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
from sparse_attn import _flag_types as flag
from sparse_attn import machine
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
    ap.add_argument("--lengths", type=flag.list_of(flag.positive_int), default="2048,7000",
                    help="prompt tokens, comma-separated (default %(default)s)")
    model.add_arguments(ap)
    ap.add_argument("--threads", type=flag.positive_int, default=None,
                    help="kernel threads (default: SPARSE_ATTN_NUM_THREADS or the cores)")
    ap.add_argument("--seed", type=flag.non_negative_int, default=0, help="filler seed")
    ap.add_argument("--json", metavar="PATH", type=flag.output_file,
                    help="write every figure and the machine info")
    ap.add_argument("--plot", metavar="PATH", type=flag.output_file,
                    help="draw decode ms and TTFT vs prompt tokens")
    args = ap.parse_args(argv)
    flag.check_model_files(ap, args)
    flag.threads_default(ap)
    args.mode = "model"
    return args


def block_budget_or_dense(text):
    """A --configs value: 'dense', or k_blocks as the string the rows carry."""
    if text == "dense":
        return text
    try:
        int(text)
    except ValueError:
        raise flag.Invalid(f"must be 'dense' or k_blocks (an integer), got {text!r}") from None
    return str(flag.positive_int(text))


# Where --quick changes a default; a flag given explicitly keeps its value.
TABLE_DEFAULTS = dict(lengths=list(DEFAULT_LENGTHS), configs=list(DEFAULT_CONFIGS),
                      layers=QWEN3_VL_2B["n_layers"], repeats=5, kernel_len=4096)
QUICK = dict(lengths=[2061], configs=["dense", "32", "1"], layers=2, repeats=1, kernel_len=512)


def parse_args(argv, prog="python -m sparse_attn.bench"):
    if argv and argv[0] == "model":
        return parse_model_args(argv[1:], prog)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    counts = flag.list_of(flag.positive_int)
    ap.add_argument("mode", nargs="?", choices=MODES, default="decode",
                    help="decode: the article's table (default); kernels: per-kernel timings; "
                         "model: a real model (its own options: bench model --help)")
    ap.add_argument("--lengths", type=counts,
                    help="context lengths, comma-separated (default "
                         f"{','.join(map(str, DEFAULT_LENGTHS))}; --quick 2061)")
    ap.add_argument("--configs", type=flag.list_of(block_budget_or_dense),
                    help="'dense' and/or k_blocks values (default "
                         f"{','.join(DEFAULT_CONFIGS)}; --quick dense,32,1)")
    ap.add_argument("--dtypes", type=flag.list_of(flag.one_of("q8", "float32")),
                    default="q8,float32", help="KV dtypes (default %(default)s)")
    ap.add_argument("--policies", type=flag.list_of(flag.checked(parse_policy), sep=";",
                                                    skip_blank=True), default="seed",
                    help="selection policies for the sparse rows, ';'-separated: presets "
                         f"({', '.join(sa.POLICIES)}) or name:knob=value,... "
                         "(default %(default)s)")
    ap.add_argument("--layers", type=flag.positive_int,
                    help=f"layers per decode step (default {QWEN3_VL_2B['n_layers']}; --quick 2)")
    ap.add_argument("--heads", type=flag.positive_int, default=QWEN3_VL_2B["n_heads"])
    ap.add_argument("--kv-heads", type=flag.positive_int, default=QWEN3_VL_2B["n_kv_heads"])
    ap.add_argument("--head-dim", type=flag.positive_int, default=QWEN3_VL_2B["head_dim"])
    ap.add_argument("--block-size", type=flag.positive_int, default=32)
    ap.add_argument("--n-probe", type=flag.positive_int, default=None,
                    help="rows probed per block, for every policy (default: each policy's, "
                         "seed 8, recall every row)")
    ap.add_argument("--group-size", type=flag.positive_int, default=32,
                    help="q8 group: channels per scale, a divisor of --head-dim "
                         "(default %(default)s)")
    ap.add_argument("--prefill-tokens", type=flag.positive_int, default=128,
                    help="prompt tokens prefilled per layer for importance (default %(default)s)")
    ap.add_argument("--prefill-lengths", type=flag.none_or(counts), default=None,
                    help="context lengths whose whole-context prefill is timed (default: those "
                         f"of --lengths up to {PREFILL_MAX_DEFAULT}; 'none' for no prefill "
                         "table)")
    ap.add_argument("--prefill-configs", type=flag.none_or(counts), default="32",
                    help="k_blocks of the sparse prefill rows ('none': exact rows only; "
                         "default %(default)s)")
    ap.add_argument("--exact-tail", type=flag.non_negative_int, default=64,
                    help="the sparse prefill rows' exact tail: the blocks of the context's last "
                         "N rows prefill exactly (docs/spec.md §7.6; default %(default)s, what the "
                         "transformers backend uses)")
    ap.add_argument("--prefill-layers", type=flag.positive_int, default=1,
                    help="layers whose prefill is timed; the table scales to --layers "
                         "(default %(default)s)")
    ap.add_argument("--prefill-rounds", type=flag.positive_int, default=1,
                    help="rounds of the prefill table: each round times every row once, in "
                         "table order; a row reports its median [min-max] (default %(default)s)")
    ap.add_argument("--repeats", type=flag.positive_int,
                    help="timed steps per row (default 5; --quick 1)")
    ap.add_argument("--threads", type=flag.positive_int, default=None,
                    help="threads for sparse_attn and torch (default: SPARSE_ATTN_NUM_THREADS "
                         "or the usable cores)")
    ap.add_argument("--seed", type=flag.non_negative_int, default=0,
                    help="seed of the synthetic data")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="skip numpy and torch")
    ap.add_argument("--kernel-len", type=flag.positive_int,
                    help="tokens for 'kernels' mode (default 4096; --quick 512)")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run: 2061 tokens, 2 layers, dense/k=32/k=1, 1 repeat "
                         "(options given explicitly still apply)")
    ap.add_argument("--json", metavar="PATH", type=flag.output_file,
                    help="write every figure and the machine info")
    ap.add_argument("--plot", metavar="PATH", type=flag.output_file,
                    help="draw ms/token vs context (needs matplotlib)")
    args = ap.parse_args(argv)
    flag.fill_defaults(args, TABLE_DEFAULTS, QUICK)
    if args.prefill_lengths is None:
        args.prefill_lengths = [n for n in args.lengths if n <= PREFILL_MAX_DEFAULT]
    check_table_flags(ap, args)
    if args.threads is None:
        args.threads = flag.threads_default(ap)
    return args


def check_table_flags(ap, args):
    """The rules that tie the flags of the decode table and kernels mode
    together (each flag's own range is its type's)."""
    if args.mode == "model":
        ap.error("model takes its own options, after it: "
                 f"{ap.prog} model [options] ({ap.prog} model --help)")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if ("q8" in args.dtypes or args.mode == "kernels") and args.head_dim % args.group_size:
        ap.error(f"--group-size ({args.group_size}) must divide --head-dim ({args.head_dim}) "
                 "for q8 KV")
    if args.mode == "kernels":
        return
    if args.head_dim < 4:
        ap.error(f"--head-dim must be >= 4 for the synthetic context (four directions per KV "
                 f"head), got {args.head_dim}")
    if min(args.lengths) < 4 * args.block_size:
        ap.error(f"--lengths must be at least 4 blocks of --block-size ({4 * args.block_size}), "
                 f"got {min(args.lengths)}")
    if set(args.prefill_lengths) - set(args.lengths):
        ap.error("--prefill-lengths must be among --lengths")


def main(argv=None, prog="python -m sparse_attn.bench"):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    command = machine.command_line("sparse-attn bench", argv)
    if args.mode == "model":
        from .model import main_model
        from .model_report import plot_model
        rows = main_model(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(command=command, machine=machine.info(),
                               args={k: v for k, v in vars(args).items() if k != "configs"},
                               configs=[c["label"] for c in args.configs], rows=rows), f,
                          indent=1)
        if args.plot:
            plot_model(rows, args.plot)
        return 0
    torch = torch_or_none() if args.baselines else None
    log(f"sparse_attn {sa.__version__}, ISA {sa.isa()}, {machine.where_it_runs(args.threads)}")
    floor = Floor(args.threads)
    log(f"floor: {floor.describe()}")
    info = dict(machine.info(), floor=floor.as_dict())
    if args.mode == "kernels":
        results = run_kernels(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(command=command, machine=info, kernels=results), f, indent=1)
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
            json.dump(dict(command=command, machine=info,
                           args={k: v for k, v in vars(args).items()}, rows=rows,
                           prefill=prefill_rows, notes=notes,
                           below_floor=len(below_floor(rows))), f, indent=1)
        log(f"figures written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0

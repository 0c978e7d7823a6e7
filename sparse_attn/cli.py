"""``sparse-attn``: the package's command line.

    sparse-attn bench [options]           the article's table on this machine (the main job);
                                          same as python -m sparse_attn.bench
    sparse-attn bench kernels [options]   each kernel on every ISA this CPU runs
    sparse-attn kernels [options]         the same
    sparse-attn eval [options]            needle recall of block budgets on a real model
                                          (python -m sparse_attn.eval)
    sparse-attn info [--json]             version, ISAs, threads, CPU caches, how it was built

Every subcommand takes --help.
"""
import json
import os
import sys

SUBCOMMANDS = ("bench", "kernels", "eval", "info")


def _info(argv):
    import argparse
    from . import cores, machine
    ap = argparse.ArgumentParser(prog="sparse-attn info", description=(
        "What this installation is and runs on: version, ISAs built, available and in use, "
        "threads and the CPUs they are kept on, the CPU and its caches, how the C core was built."))
    ap.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = ap.parse_args(argv)
    facts = machine.info()
    if args.json:
        print(json.dumps(facts, indent=1))
        return 0
    v = facts["versions"]
    print(f"sparse_attn {v['sparse_attn']} ({facts['package']})")
    env = f"SPARSE_ATTN_ISA={facts['isa_env']}" if facts["isa_env"] else "SPARSE_ATTN_ISA unset"
    print(f"ISA in use:  {facts['isa']} ({env})")
    print(f"ISAs built:  {', '.join(facts['built_isas'])}")
    print(f"CPU runs:    {', '.join(facts['available_isas'])}")
    tenv = f"SPARSE_ATTN_NUM_THREADS={facts['threads_env']}" if facts["threads_env"] else \
        "SPARSE_ATTN_NUM_THREADS unset"
    fast = "" if not facts["heterogeneous"] else \
        f", default covers the {len(facts['default_cores'])} fast ones"
    print(f"threads:     {facts['threads']} ({tenv}; {facts['usable_cores']} usable cores{fast})")
    print(f"cores:       {'; '.join(facts['core_classes'])}")
    print(f"pinned:      {cores.describe_placement(facts['pinning'])}")
    cpu_id = f", {facts['cpu_id']}" if facts["cpu_id"] else ""
    print(f"CPU:         {facts['cpu']} ({facts['machine']}{cpu_id})")
    caches = ", ".join(f"L{c['level']}{'d' if c['type'] == 'Data' else 'i' if c['type'] == 'Instruction' else ''}"
                       f" {machine.fmt_bytes(c['bytes'])}" for c in facts["caches"])
    print(f"caches:      {caches or 'not reported by sysfs'} (cpu0)")
    print(f"built with:  {facts['build']}")
    extras = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers") if v.get(k))
    print(f"python {v['python']}, numpy {v['numpy']}, cffi {v['cffi']}"
          + (f"; {extras}" if extras else "; torch/transformers not installed"))
    return 0


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (`sparse-attn info | head`): stop quietly, as
        # a Unix tool does, without a traceback at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from .bench import main as bench_main
        return bench_main(rest, prog="sparse-attn bench")
    if cmd == "kernels":
        from .bench import main as bench_main
        return bench_main(["kernels"] + rest, prog="sparse-attn kernels")
    if cmd == "eval":
        from .eval import main as eval_main
        return eval_main(rest, prog="sparse-attn eval")
    if cmd == "info":
        return _info(rest)
    print(f"sparse-attn: unknown subcommand {cmd!r}; one of {', '.join(SUBCOMMANDS)} "
          "(sparse-attn --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Render the measured tables of the docs from the JSON the benches wrote.

    python scripts/render-results.py           # rewrite the tables in place
    python scripts/render-results.py --check   # exit 1 if any table differs from its JSON

A table in README.md or docs/results.md sits between two markers:

    <!-- render KIND FILE [FIELD=V1,V2 ...] -->
    ...generated, never edited by hand...
    <!-- end render -->

FILE is a JSON file under docs/results/, written by `--json PATH` of
`sparse-attn bench` (KIND `decode` or `prefill`), `sparse-attn bench model`
(`model`), `sparse-attn eval` (`eval`), `bench/arm_model.py` (`arm`) or
`bench/split_kv.py` (`threads`); KIND `machine` is the line that
says where and how a file was measured.  FIELD=V1,V2 keeps the rows whose
FIELD (a key of the JSON rows: length, config, policy, impl, dtype, ...)
prints as one of the values (`-` for none).  The command that produced a file
is the `command` the bench stored in it.  Needs only the standard library,
so it runs without the package built.
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOCS = [ROOT / "README.md", ROOT / "docs" / "results.md"]
BLOCK = re.compile(r"(<!-- render (\w+) ([\w./-]+)((?: \w+=\S+)*) -->\n)(.*?)(<!-- end render -->)",
                   re.S)


def _x(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}x"


def _needle(v):
    return "-" if v is None else ("YES" if v >= 1.0 else "NO")


def render_machine(d):
    m = d["machine"]
    llc = next((c["bytes"] for c in m.get("caches", []) if c.get("level") == 3), None)
    cpu = m.get("cpu", "?") + (f" ({m['cpu_id']})" if m.get("cpu_id") else "")
    parts = [cpu, f"{m.get('usable_cores', '?')} cores"]
    if llc:
        parts.append(f"L3 {llc // 2**20} MiB")
    parts.append(f"kernels `{m['isa']}`" + (" (forced with SPARSE_ATTN_ISA)" if m.get("isa_env")
                                              else ""))
    ran = f"{m.get('threads', '?')} threads"
    if m.get("cpus"):  # which cores ran it (older files do not say)
        ran += f" on CPUs {m['cpus']}"
        if m.get("heterogeneous"):
            ran += f" ({'; '.join(m['core_classes'])})"
    parts.append(ran)
    floor = m.get("floor")
    beside = [r["floor_gbs"] for r in d.get("rows", ()) if r.get("floor_gbs")]
    if beside:  # read again beside each row (newer files)
        parts.append(f"memory floor {min(beside):.1f}-{max(beside):.1f} GB/s (read beside each "
                     "row in the run; its `x floor` uses its own)")
    elif floor:
        parts.append(f"memory floor {floor['bandwidth_gbs']:.1f} GB/s (measured in the run)")
    v = m.get("versions", {})
    parts.append(", ".join(f"{k} {v[k]}" for k in ("numpy", "torch", "transformers") if v.get(k)))
    return (f"Measured on: {'; '.join(p for p in parts if p)}.\n\n"
            f"```\n{d['command']}\n```\n")


def _keep(rows, filters):
    return [r for r in rows
            if all(("-" if r.get(k) is None else str(r.get(k))) in vals
                   for k, vals in filters.items())]


def _config(c):
    return c if not str(c).isdigit() else f"k={c}"


def _table(head, rows):
    """A markdown table: `head` the column names, `rows` lists of cells."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def _row_key(r, needle):
    """The columns that say which row of the kernel bench this is."""
    return [r["length"], r["impl"], r["dtype"], _config(r["config"]), r.get("policy") or "-",
            _needle(r.get(needle))]


KEY = ["tokens", "impl", "KV", "config", "policy", "needle"]


def render_decode(d):
    beside = all(r.get("floor_gbs") for r in d["rows"])  # each row's own floor (newer files)
    return _table(KEY + ["ms/token [min–max]", "vs dense", "MB read"]
                  + (["floor GB/s"] if beside else []) + ["x floor"],
                  [_row_key(r, "recall") + [
                      f"{r['ms']:.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}]",
                      _x(r.get("speedup_vs_dense")), f"{r['bytes'] / 1e6:.1f}"]
                   + ([f"{r['floor_gbs']:.1f}"] if beside else [])
                   + [f"{r['x_floor']:.2f}"] for r in d["rows"]])


def render_prefill(d):
    return _table(KEY + ["prefill s", "vs exact", "vs torch f32"],
                  [_row_key(r, "needle") + [f"{r['s']:.2f}", _x(r.get("speedup_vs_exact")),
                                            _x(r.get("vs_torch_f32"))] for r in d["prefill"]])


def render_model(d):
    out = ["| tokens | config | TTFT s (vs sdpa) | decode ms/token | decode per round vs sdpa: "
           "median [min–max] | attention ms | KV MB | needle |",
           "|---|---|---|---|---|---|---|---|"]
    sdpa = {r["tokens"]: r for r in d["rows"] if r["kind"] == "sdpa"}
    for r in d["rows"]:
        ref = sdpa.get(r["tokens"])
        ttft = f"{r['ttft_s']:.2f}"
        rounds = len(r.get("ttft_rounds_s") or ())
        if rounds > 1 and r.get("ttft_vs_sdpa_paired") is not None:
            # --prefill-rounds: the median of each round's ratio, and its range
            lo, hi = r["ttft_vs_sdpa_paired_range"]
            ttft += f" ({r['ttft_vs_sdpa_paired']:.2f}x [{lo:.2f}–{hi:.2f}], {rounds} rounds)"
        elif ref is not None and ref is not r:
            ttft += f" ({r['ttft_s'] / ref['ttft_s']:.2f}x)"
        paired = ""
        if r.get("vs_sdpa_paired") is not None:
            lo, hi = r["vs_sdpa_paired_range"]
            paired = f"{r['vs_sdpa_paired']:.2f}x [{lo:.2f}–{hi:.2f}]"
        decode, needle = f"{r['decode_ms']:.1f}", "YES" if r["found"] else "NO"
        if r.get("batch", 1) > 1:       # a step decodes a token of every sequence
            decode += f" ({r['decode_ms_per_seq']:.1f} per sequence)"
            needle = f"{r['found_count']}/{r['batch']}"
        out.append(f"| {r['tokens']} | {r['config']} | {ttft} | {decode} | "
                   f"{paired} | {r['attn_ms']:.1f} | {r['kv_mb']:.1f} | {needle} |")
    return "\n".join(out) + "\n"


def render_eval(d):
    rows = d["results"]
    exact = {}
    for r in rows:
        if r["policy"] == "exact":
            exact[(r["length"], r["depth"], r["needle"], r.get("filler"))] = r["found"]
    cells = {}
    for r in rows:
        if r["policy"] == "exact":
            continue
        key = (r["length"], r["depth"], r["needle"], r.get("filler"))
        c = cells.setdefault((r["length"], r["policy"]), {}).setdefault(r["k"], [0, 0, 0])
        c[0] += bool(r["found"])
        c[1] += bool(exact[key])
        c[2] += bool(r["found"] and exact[key])
    ks = sorted({k for v in cells.values() for k in v})
    out = ["| tokens | policy | " + " | ".join(f"k = {k}" for k in ks) + " |",
           "|---|---|" + "---|" * len(ks)]
    # lengths ascending, the policies in the order the run took them
    for (length, policy), by_k in sorted(cells.items(), key=lambda kv: kv[0][0]):
        line = [f"{length}", f"`{policy}`"]
        for k in ks:
            c = by_k.get(k)
            line.append("-" if c is None else f"{c[2]} / {c[1]}")
        out.append("| " + " | ".join(line) + " |")
    n = len(exact)
    lengths = sorted({key[0] for key in exact})
    out.append(f"\n{n} prompts ({', '.join(str(x) for x in lengths)} tokens); a cell is the "
               "answers a policy kept of those exact attention gave.")
    return "\n".join(out) + "\n"


def render_arm(d):
    """The static model's table (bench/arm_model.py): per core model, the
    cycles per token and KV head of each kernel, bytes per cycle (with Arm's
    guides' corrections, and llvm-mca over the trace as compiled), the
    instructions per KV byte counted under qemu; the article's step against
    the memory floor, the prefill, the corrections, and the host's check."""
    models = (d["machine"]["a76_model"], d["machine"]["a55_model"])
    out = ["| core (model) | ISA | G | D | cycles per token and KV head: scores / V / softmax "
           "| KV bytes per cycle | as LLVM prices it | instructions per KV byte |",
           "|---|---|---|---|---|---|---|---|"]
    rows = [r for r in d["llvm_mca"] if r["model"] in models]
    rows.sort(key=lambda r: (models.index(r["model"]), r["isa"], r["G"], r["D"]))
    for r in rows:
        c = r["cycles_per_token_kv_head"]
        core = "A76" if r["model"] == models[0] else "A55"
        raw = r.get("llvm_raw_bytes_per_cycle")
        out.append(f"| {core} ({r['model']}) | {r['isa']} | {r['G']} | {r['D']} | "
                   f"{c['scores']:.0f} / {c['v']:.0f} / {c['softmax']:.0f} | "
                   f"{r['bytes_per_cycle']['total']:.2f} | "
                   f"{'-' if raw is None else f'{raw:.2f}'} | "
                   f"{r['qemu_instructions_per_kv_byte']['total']:.2f} |")
    step = d["predicted_step"]
    a76, a55 = step["a76_x4"], step["a55_x1"]
    floor = ", ".join(f"{ms:.1f} ms at {bw:g}" for bw, ms in
                      zip(step["floor_ms"]["at_GBps"], step["floor_ms"]["ms"]))
    mem = [s["GBps"] for s in a76["step_ms"] if s["bound"] == "memory"]
    cpu = [s["GBps"] for s in a76["step_ms"] if s["bound"] == "compute"]
    bound = "; ".join(x for x in (
        f"memory-bound at {', '.join(f'{b:g}' for b in mem)} GB/s" if mem else "",
        f"compute-bound at {', '.join(f'{b:g}' for b in cpu)} GB/s" if cpu else "") if x)
    out.append("")
    out.append(f"The article's step ({step['case']['tokens']} tokens, {step['case']['layers']} "
               f"layers, {step['case']['kv_heads']} KV heads, {step['case']['isa']}, {step['kv_bytes'] / 1e6:.0f} MB), "
               f"modelled: four A76 cores at {a76['ghz']} GHz {a76['model_ms']:.1f} ms of compute"
               + (f" ({a76['llvm_raw_ms']:.1f} as LLVM prices it)" if a76.get("llvm_raw_ms")
                  else "")
               + (f", one A55 at {a55['ghz']} GHz {a55['model_ms']:.0f} ms"
                  + (f" ({a55['llvm_raw_ms']:.0f} as LLVM prices it)" if a55.get("llvm_raw_ms") else "")
                  if a55 else "")
               + f". The memory floor: {floor} GB/s. The four A76 cores keep up with "
               f"{a76['compute_GBps']:.1f} GB/s: {bound}.")
    pf = step.get("prefill")
    if pf and pf.get("a76_x4"):
        pa, pl = pf["a76_x4"], pf["a55_x1"]
        y = pa["cycles_per_vector_key"]
        out.append(f"\nExact q8 prefill of the same prompt, attention only "
                   f"({pf['vector_key_pairs'] / 1e6:.0f}M (query vector, key) pairs): "
                   f"{y['total']:.1f} cycles per pair on the A76 model (scores {y['scores']:.1f}, "
                   f"softmax {y['softmax']:.1f}, V {y['v']:.1f}), four A76 cores "
                   f"{pa['model_ms'] / 1e3:.2f} s"
                   + (f"; one A55 {pl['cycles_per_vector_key']['total']:.0f} cycles per pair, "
                      f"{pl['model_ms'] / 1e3:.0f} s" if pl else "") + ".")
    g = d.get("guide_corrections") or {}
    parts = []
    for key, label in zip(models, ("A76", "A55")):
        c = (g.get(key) or {}).get("corrected") or []
        if c:
            parts.append(f"{label} ({key}): " + "; ".join(
                f"{x['form']} {x['llvm']['latency']}/{x['llvm']['cycles_per_instruction']:g} -> "
                f"{x['guide']['latency']}/{x['guide']['cycles_per_instruction']:g}" for x in c))
    if parts:
        out.append("\nPriced as Arm's optimisation guides do, not as LLVM's tables (latency / "
                   "cycles per instruction): " + ". ".join(parts) + ".")
    cal = d.get("calibration_x86")
    if cal and cal.get("factor"):
        f, pfac = cal["factor"], cal.get("prefill_factor")
        out.append(f"\nThe method checked on the host ({d['machine']['host']}; "
                   f"{d['machine']['host_model']}, the {cal['isa']} build against its measured "
                   f"in-cache time): measured / predicted {f['min']:.2f}-{f['max']:.2f} over the "
                   "six shapes" + (f", prefill's kernels {pfac['min']:.2f}-{pfac['max']:.2f}"
                                   if pfac else "")
                   + " (above 1 LLVM's model of the host's core is pessimistic, below 1 "
                   "optimistic). It measures that model's errors, not the Arm tables': a check "
                   "of the method, not applied to the Arm figures.")
    out.append(f"\n```\n{d['command']}\n```")
    return "\n".join(out) + "\n"


def _spread(xs, fmt, unit=""):
    xs = sorted(xs)
    mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return f"{mid:{fmt}}{unit} [{xs[0]:{fmt}}–{xs[-1]:{fmt}}]"


def render_threads(d):
    """bench/split_kv.py: decode time per thread count, and the speed-up."""
    counts = sorted({int(t) for r in d["rows"] for t in r["us"]})
    one, more = str(counts[0]), [str(t) for t in counts[1:]]
    head = (["shape (q/KV heads, D)", "tokens", "decode"]
            + [f"{t} thread{'s' if t != 1 else ''} µs" for t in counts]
            + [f"{t} vs {one} thread{'s' if one != '1' else ''}" for t in more])
    rows = []
    for r in d["rows"]:
        rows.append([f"{r['shape']} ({r['H']}/{r['Hkv']}, {r['D']})", r["tokens"], r["mode"]]
                    + [_spread(r["us"][str(t)], ".0f") for t in counts]
                    + [_spread(r["speedup"][t], ".2f", "x") for t in more])
    note = ""
    if d.get("slow_core"):
        note = ("\nOne core made slow: a busy process shares the last CPU; the calling "
                "thread stays on the first.\n")
    return _table(head, rows) + note


RENDER = {"machine": render_machine, "threads": render_threads, "arm": render_arm, "decode": render_decode, "prefill": render_prefill,
          "model": render_model, "eval": render_eval}


def render_text(text):
    def one(m):
        kind, name = m.group(2), m.group(3)
        if kind not in RENDER:
            raise SystemExit(f"unknown table kind {kind!r} (one of {sorted(RENDER)})")
        d = json.loads((RESULTS / name).read_text())
        filters = dict(f.split("=", 1) for f in m.group(4).split())
        filters = {k: v.split(",") for k, v in filters.items()}
        for key in ("rows", "prefill", "results"):
            if key in d:
                d[key] = _keep(d[key], filters)
        return m.group(1) + RENDER[kind](d) + m.group(6)
    return BLOCK.sub(one, text)


def main(argv):
    check = "--check" in argv
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = render_text(text)
        if new != text:
            stale.append(doc)
            if not check:
                doc.write_text(new)
    for doc in stale:
        print(f"{doc.relative_to(ROOT)}: {'differs from' if check else 'rendered from'} "
              "its JSON", file=sys.stderr if check else sys.stdout)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

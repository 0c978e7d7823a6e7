#!/usr/bin/env python3
"""Predicted Arm (RK3588) bytes per cycle of today's dense q8 decode kernels,
without the board: what the NEON kernels cost per KV byte and per cycle.

    python bench/arm_model.py --json docs/results/arm-model.json   (~5 min)
    python bench/arm_model.py --quick                              (one shape)

What it does, all from the sources in csrc/ as they are now:

1. Builds bench/arm_model_driver.c with the package's core and the kernel
   files csrc/isa_list.h lists, with the flags the package is built with
   (setuptools' CFLAGS/CCSHARED of this Python, then csrc/build_ffi.py's
   compile_args(arch): -O3 -ffp-contract=off ..., -frename-registers for
   aarch64; the kernel files pick their ISA with `#pragma GCC target`):
   statically for aarch64 with aarch64-linux-gnu-gcc and, on an x86-64
   host, for x86-64.
2. Runs the aarch64 binary under qemu-aarch64 (-cpu cortex-a76) with a small
   TCG plugin (bench/arm_model_plugin.c; Debian's qemu-user ships none) that
   records every translation block executed inside marked windows: one whole
   sa_dense_decode (1 thread, one KV head, 2061 tokens) -> instructions per
   KV byte; one scores_q8 call and one accumulate_v_q8 call of 32 rows as
   rows.c makes them (rows 32..63, with the next rows' prefetch hint); one
   softmax_exp over the 2061 scores of one head; and exact q8 prefill's
   kernels on one tile (32 rows x G heads of query vectors) against 32
   keys: the scores through the table's q8 panels and V over float rows.
3. Expands each call's block sequence through llvm-objdump into its dynamic
   instruction trace (the loop nest as executed for that G and D: every
   loop's trip count, the per-4-token and per-call work, the prefetches) and
   hands it to llvm-mca.  Cycles per call / 32 are cycles per token and KV
   head; K and V bytes per token are D int8 plus a float32 scale per 32
   values each.  Core models (MODELS below): Debian's llvm-16 maps both
   cortex-a76 and neoverse-n1 to its Cortex-A57 tables, so the A76 stand-in
   is LLVM 19's neoverse-n1 (a real N1 model; Debian 12 ships llvm-19) when
   llvm-mca-19 is installed; llvm-16's neoverse-n1 (A57 tables) and
   neoverse-n2 are reported beside it, cortex-a55 for the A55.
4. Corrects, before llvm-mca sees the trace, the instruction forms LLVM's
   tables price otherwise than Arm's optimisation guides (CORRECTIONS
   below: N1_CORRECTIONS for the A76 model, A55_CORRECTIONS for the A55;
   each names the form, LLVM's figures, the guide's row and figures): the
   form is replaced by a stand-in that reads and writes the same registers
   and that LLVM prices as the guide prices the original (the fixed-point
   `scvtf v.4s, v.4s, #24` of V's dequantisation by the register form LLVM
   prices by the guide's row, 2 uops on V0 and latency 4, where LLVM gives
   the fixed-point form its default 1 uop).  A stand-in, not a post-pass on
   llvm-mca's report, so that the extra pipe cycles and latencies go
   through llvm-mca's scheduling like any other (an out-of-order core hides
   some, an in-order one stalls on them); each stand-in's pricing is checked
   against LLVM on every run.  llvm-mca over the uncorrected trace is
   reported beside it (llvm_raw_*).
5. Checks the method on this x86-64 host, and only checks it: the same
   trace + llvm-mca over the AVX2 build (traced under qemu-x86_64 -cpu max;
   llvm-mca's model of this host's core: AMD Zen 2-5 by family and model,
   else Intel's Golden Cove family) against the in-cache single-thread time
   of the same kernel calls here (sa_set_isa("avx2"), as
   SPARSE_ATTN_ISA=avx2), in cycles at the core clock measured by dependent
   add and multiply chains (this VM has no perf cycle counter).
   factor = measured bytes/cycle / predicted bytes/cycle.  The factor is
   reported, not applied to the Arm figures: it measures the errors of
   LLVM's model of the host's core, not of the Arm tables, and dividing the
   A76 figures by it asked more of the A76 than its two vector pipes give.
6. Predicts the RK3588 step of the article's case (Qwen3-VL-2B shape: 16 query
   heads, 8 KV heads, D=128, q8, 2061 tokens, 28 layers, ~133 MB) on the four
   A76 cores at 2.4 GHz and on one A55 at 1.8 GHz from the corrected cycles
   as they are, against the memory floor at 10, 14, 17 and 20 GB/s (RK3588
   boards read 17-22 GB/s with all cores in sbc-bench reviews; not measured
   here); and the exact q8 prefill of that prompt's attention from the
   prefill kernels' cycles per (query vector, key) (compute-bound: a tile's
   keys are read from cache).

Limits: llvm-mca assumes every load hits L1, perfect branch prediction and
an ideal front end beyond its dispatch width; Neoverse N1 stands in for the
A76; the A55's in-order model keeps its dot-product and multiply-accumulate
chains at 4 cycles where the guide forwards the accumulator in 1 (so its
scores are pessimistic); nothing here is checked against Arm silicon.
"""
import argparse
import bisect
import collections
import concurrent.futures as cf
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
DRIVER = REPO / "bench" / "arm_model_driver.c"
PLUGIN = REPO / "bench" / "arm_model_plugin.c"

SHAPES = [(2, 64), (2, 128), (3, 64), (3, 128), (7, 64), (7, 128)]
QUICK_SHAPES = [(2, 128)]
GS = 32          # q8 group size (the package default)
CALL = 32        # rows per kernel call (rows.c STRETCH)
N_TRACE = 2061   # tokens of the traced decode (the article's case)
N_TIME = 2048    # tokens of the in-cache timing (K+V+scales: 295-590 KB, in L2)

ARM_ISAS = ["neon", "neon-dotprod"]
QUICK_ARM_ISAS = ["neon-dotprod"]
X86_ISA = "avx2"


class Model:
    """One llvm-mca core model: llvm major version, -mcpu, and what it stands for."""

    def __init__(self, llvm, mcpu, arch, note):
        self.llvm, self.mcpu, self.arch, self.note = llvm, mcpu, arch, note
        self.key = f"{mcpu}@llvm-{llvm}"


MODELS = [
    Model(19, "neoverse-n1", "aarch64",
          "Cortex-A76 stand-in: LLVM 19's Neoverse N1 model (N1 is the A76's server "
          "derivative: same 4-wide decode, 2x128-bit ASIMD pipes)"),
    Model(16, "neoverse-n1", "aarch64",
          "llvm-16's neoverse-n1 is its Cortex-A57 model (as is its cortex-a76: "
          "same cycles, dispatch width 3); kept to compare with earlier estimates made with it"),
    Model(16, "neoverse-n2", "aarch64",
          "Neoverse N2 (5-wide decode, 2x128-bit vector pipes): a wider core than the "
          "A76, so an optimistic bound for it"),
    Model(16, "cortex-a55", "aarch64", "Cortex-A55, in-order model"),
]
QUICK_MODELS = ["neoverse-n1@llvm-19", "neoverse-n1@llvm-16", "cortex-a55@llvm-16"]
# the first installed of each list is the one the predictions use
A76_MODELS = ["neoverse-n1@llvm-19", "neoverse-n1@llvm-16"]
A55_MODEL = "cortex-a55@llvm-16"


# ------------------------------------------------- Arm's guides vs LLVM's tables
#
# llvm-mca prices each instruction from LLVM's scheduling tables, which are
# transcriptions of Arm's software optimisation guides; where a transcription
# misses an instruction form, or the guide says otherwise, the model corrects
# it here.  A correction replaces the instruction in the trace fed to llvm-mca
# by a stand-in: an instruction (or a short sequence) that reads and writes
# the same registers and that LLVM's own tables price as the guide prices
# the original.  llvm-mca then schedules the corrected trace as any other:
# the dependencies, the pipes the stand-in takes and its latency all go into
# the simulated cycles, which a post-pass over the per-instruction report
# could not do (an out-of-order core overlaps a pipe's extra cycles with
# other work, an in-order one stalls on a latency).  Each stand-in is checked
# against LLVM's pricing of it on every run (check_corrections): a later LLVM
# that prices it otherwise stops the model instead of skewing it.
#
# Sources.  A76: the Arm Neoverse N1 Software Optimization Guide
# (PJDOC-466751330-9707; N1 is the A76's server derivative, the same tables)
# and the Cortex-A76 Software Optimization Guide: neither text was at hand
# here, so the N1 rows are read through the two transcriptions Arm's
# engineers made of it, LLVM's AArch64SchedNeoverseN1.td (each rule names the
# guide's row) and GCC's config/aarch64/neoverse-n1.md, and checked against
# the Cortex-A720 guide (109720, the A76's descendant, same V0/V1 split).
# A55: the Arm Cortex-A55 Software Optimization Guide (EPM128372, issue 4.0),
# section 4, read directly.  Every opcode class the NEON kernels execute in
# the traces (scores, V and softmax of decode; prefill's tile) was checked;
# the ones not corrected, and why, are listed in NOT_CORRECTED.

class Correction:
    """One instruction form LLVM misprices for one core: the guide's row and
    figures, LLVM's, and the stand-in that LLVM prices as the guide does.
    `pattern` matches the llvm-mc text of the instruction; `standin` turns
    the match into the instruction(s) fed to llvm-mca instead; `example` is
    one matching instruction, for the run-time check; `guide` is (latency,
    cycles per instruction at full rate); `llvm` says what LLVM charges."""

    def __init__(self, name, pattern, standin, example, guide, llvm, row, note="",
                 standin_latency=None):
        self.name, self.pattern, self.standin = name, re.compile(pattern + r"$"), standin
        self.example, self.guide, self.llvm, self.row, self.note = example, guide, llvm, row, note
        # the latency LLVM gives the stand-in's first instruction, where it
        # cannot be the guide's (said in the note)
        self.standin_latency = guide[0] if standin_latency is None else standin_latency

    def apply(self, line):
        m = self.pattern.match(line)
        return None if m is None else self.standin(m)


V = r"(v\d+)"       # a vector register
X = r"(x\d+|sp)"    # a base register
IMM = r"#-?(?:0x[0-9a-f]+|\d+)"   # llvm-objdump prints most immediates in hex


def _one(fmt):
    return lambda m: [fmt.format(*m.groups())]


N1_CORRECTIONS = [
    Correction(
        "scvtf/ucvtf/fcvtzs/fcvtzu v.4s, v.4s, #fbits (fixed point)",
        rf"(scvtf|ucvtf|fcvtzs|fcvtzu) {V}\.4s, {V}\.4s, {IMM}",
        _one("{0} {1}.4s, {2}.4s"), "scvtf v7.4s, v7.4s, #24",
        guide=(4, 2.0), llvm="1 uop on V0 or V1, latency 2 (no rule matches the "
                             "fixed-point form: LLVM's default ASIMD class)",
        row="ASIMD FP convert, other, D-form F16 and Q-form F32 (FCVTZS, FCVTZU, SCVTF, "
            "UCVTF): latency 4, 2 uops on V0 (throughput 1/2); LLVM prices the register "
            "form by this row, GCC's neoverse-n1.md both forms (neon_int_to_fp_s_q: V0 x 2, "
            "4 cycles), the A720 guide the same row as 4 / 1/2 / V0",
        note="stand-in: the register form, which LLVM prices by the row"),
]

A55_CORRECTIONS = [
    Correction(
        "fmla/fmls v.4s (vector or by element)",
        rf"(fmla|fmls) {V}\.4s, {V}\.4s, {V}\.(?:4s|s\[\d\])",
        lambda m: [f"{'mla' if m[1] == 'fmla' else 'mls'} {m[2]}.4s, {m[3]}.4s, {m[4]}.4s"],
        "fmla v19.4s, v31.4s, v3.s[0]", guide=(4, 1.0),
        llvm="1 FPMAC cycle: two a cycle, latency 4",
        row="ASIMD FP multiply accumulate (FMLA, FMLS): latency 4, throughput 2, note 1 (a "
            "Q-form issues only as instruction 0: throughput 1); by element: 4, 1",
        note="stand-in: integer MLA, priced 4 / 1 a cycle, the accumulator a source as in FMLA"),
    Correction(
        "fmul v.4s, v.4s, v.s[i] (by element)",
        rf"fmul {V}\.4s, {V}\.4s, {V}\.s\[\d\]", _one("fmul {0}.4s, {1}.4s, {2}.4s"),
        "fmul v10.4s, v15.4s, v13.s[0]", guide=(4, 1.0),
        llvm="1 FPALU cycle: two a cycle", row="ASIMD FP multiply, by element: latency 4, "
        "throughput 1", note="stand-in: the vector form"),
    Correction(
        "scvtf/ucvtf/fcvtzs/fcvtzu v.4s (integer or fixed point)",
        rf"(?:scvtf|ucvtf|fcvtzs|fcvtzu) {V}\.4s, {V}\.4s(?:, {IMM})?",
        _one("frintn {0}.4s, {1}.4s"), "scvtf v7.4s, v7.4s, #24", guide=(4, 1.0),
        llvm="1 FPALU cycle: two a cycle",
        row="ASIMD FP convert, other (FCVTZS, ..., SCVTF, UCVTF): latency 4, throughput 2, "
            "note 1 (Q-form: 1)", note="stand-in: FRINTN .4s (ASIMD FP round: the same figures)"),
    Correction(
        "fcvtl/fcvtl2 (F32 to F64)", rf"fcvtl2? {V}\.2d, {V}\.[24]s",
        _one("frintn {0}.4s, {1}.4s"), "fcvtl v19.2d, v0.2s", guide=(4, 1.0),
        llvm="1 FPALU cycle: two a cycle", row="ASIMD FP convert, long (FCVTL(2)): latency "
        "4, throughput 1", note="stand-in: FRINTN .4s"),
    Correction(
        "tbl v.16b, { v.16b }, v.16b (one table register)",
        rf"tbl {V}\.16b, \{{ {V}\.16b \}}, {V}\.16b", _one("add {0}.16b, {1}.16b, {2}.16b"),
        "tbl v7.16b, { v12.16b }, v2.16b", guide=(2, 1.0), llvm="latency 4, throughput 1",
        row="ASIMD table lookup (TBL, N = 1 register): latency 2+N-1, throughput 1/N",
        note="stand-in: ADD .16b (latency 2, Q-form throughput 1)"),
    Correction(
        "mov v.16b, v.16b", rf"mov {V}\.16b, {V}\.16b", _one("add {0}.16b, {1}.16b, {1}.16b"),
        "mov v29.16b, v26.16b", guide=(2, 1.0), llvm="latency 1, throughput 1",
        row="ASIMD logical, MOV: latency 2, throughput 2, note 1 (Q-form: 1)",
        note="stand-in: ADD .16b of the source with itself"),
    Correction(
        "trn1/trn2/zip1/zip2/uzp1/uzp2 (Q-form)",
        rf"(?:trn|zip|uzp)[12] {V}\.(4s|2d|8h|16b), {V}\.(?:4s|2d|8h|16b), {V}\.(?:4s|2d|8h|16b)",
        lambda m: [f"add {m[1]}.16b, {m[3]}.16b, {m[4]}.16b"], "trn1 v2.4s, v13.4s, v12.4s",
        guide=(2, 1.0), llvm="latency 4, throughput 1",
        row="ASIMD transpose, other / unzip/zip: latency 2, throughput 2, note 1 (Q-form: 1)",
        note="stand-in: ADD .16b"),
    Correction(
        "fcmgt/fcmge/fcmeq v.4s, v.4s, v.4s", rf"fcm(gt|ge|eq) {V}\.4s, {V}\.4s, {V}\.4s",
        lambda m: [f"cm{m[1]} {m[2]}.4s, {m[3]}.4s, {m[4]}.4s"],
        "fcmgt v14.4s, v23.4s, v14.4s", guide=(2, 1.0), llvm="latency 4, throughput 1",
        row="ASIMD FP compare: latency 2, throughput 2, note 1 (Q-form: 1)",
        note="stand-in: the integer compare"),
    Correction(
        "dup v.4s, v.s[i]", rf"dup {V}\.4s, {V}\.s\[\d\]", _one("add {0}.4s, {1}.4s, {1}.4s"),
        "dup v21.4s, v20.s[0]", guide=(2, 1.0), llvm="1 FPALU cycle: two a cycle",
        row="ASIMD duplicate, element: latency 2, throughput 2, note 1 (Q-form: 1)",
        note="stand-in: ADD .4s of the source with itself"),
    Correction(
        "sadalp/uadalp", rf"([su]adalp) {V}\.(\w+), {V}\.(\w+)",
        lambda m: [m[0], f"orr {m[2]}.16b, {m[2]}.16b, {m[2]}.16b"],
        "sadalp v7.4s, v25.8h", guide=(4, 2.0), llvm="latency 4, throughput 1",
        row="ASIMD pairwise add and accumulate (SADALP, UADALP): latency 4, throughput 1/2",
        note="stand-in: the instruction and an ORR of its result into itself (the second "
             "FPALU turn; latency 5, one more than the guide)"),
    Correction(
        "ld1r { v.4s }, [x]", rf"ld1r \{{ {V}\.(\w+) \}}, \[{X}\]",
        lambda m: [f"ldr s{m[1][1:]}, [{m[3]}]"], "ld1r { v3.4s }, [x2]", guide=(3, 1.0),
        llvm="latency 4, throughput 1", row="ASIMD load, 1 element, all lanes (LD1R): "
        "latency 3, throughput 1", note="stand-in: LDR S into the register"),
    Correction(
        "ldr/ldur q (no writeback)", rf"ldu?r q(\d+), \[{X}(, [^\]]+)?\]",
        lambda m: [f"ldr q{m[1]}, [{m[2]}{m[3] if m[3] and not m[3].startswith(', #') else ', xzr'}]",
                   f"prfm pldl1keep, [{m[2]}]"],
        "ldr q13, [x0, #352]", guide=(4, 2.0), llvm="latency 3 (immediate offset) or 4 "
        "(register offset), throughput 1",
        row="Load vector reg, Q-form (unscaled, unsigned immed, register offset): latency "
            "4, throughput 1/2 (the load pipe reads 64 bits a cycle, section 3.3)",
        note="stand-in: the register-offset form (latency 4) and a PRFM of the same base "
             "(the second turn of the load pipe)"),
    Correction(
        "ldr q, [x], #imm / [x, #imm]! (writeback)", rf"ldr q(\d+), \[{X}(?:\], {IMM}|, {IMM}\]!)",
        lambda m: [m[0], f"prfm pldl1keep, [{m[2]}]"], "ldr q15, [x17], #16", guide=(4, 2.0),
        standin_latency=3, llvm="latency 3, throughput 1", row="Load vector reg, immed pre/post-index, Q-form: "
        "latency 4, throughput 1/2", note="stand-in: the instruction and a PRFM (latency 3, "
        "one under the guide)"),
    Correction(
        "ldp q, q (no writeback)", rf"ldn?p q(\d+), q(\d+), \[{X}(?:, {IMM})?\]",
        lambda m: [f"ld1 {{ v{m[1]}.16b }}, [{m[3]}]", f"ld1 {{ v{m[2]}.16b }}, [{m[3]}]"],
        "ldp q12, q6, [x2]", guide=(6, 4.0), standin_latency=5,
        llvm="latency 6, throughput 1/6",
        row="Load vector pair, immed offset, Q-form: latency 6, throughput 1/4",
        note="stand-in: two LD1 of one Q register (2 load turns each, latency 5: one under "
             "the guide)"),
    Correction(
        "stp q, q (no writeback)", rf"stn?p q(\d+), q(\d+), \[{X}(, {IMM})?\]",
        lambda m: [m[0], f"str xzr, [{m[3]}]"], "stp q6, q6, [x13]", guide=(2, 2.0),
        standin_latency=1, llvm="throughput 1", row="Store vector pair, immed, Q-form: latency 2, throughput 1/2",
        note="stand-in: the instruction and a store of xzr to the same base (the second "
             "turn of the store pipe; a store's latency has no consumer here)"),
]

# model key -> its corrections (only the tables the predictions use; llvm-16's
# neoverse-n1 is its Cortex-A57 model and N2 an optimistic bound: both raw)
CORRECTIONS = {"neoverse-n1@llvm-19": N1_CORRECTIONS, "cortex-a55@llvm-16": A55_CORRECTIONS}

# opcode classes of the traces checked and left as LLVM prices them
NOT_CORRECTED = {
    "neoverse-n1@llvm-19": [
        "every other class the traces execute: LLVM's N1 rules name the guide's row and agree "
        "with GCC's transcription (FMLA/FMLS 4 cycles, FMUL 3, both V; FADD/FSUB/FMAX/FCMGT, "
        "ADD/BIC/ADDP/ORR, TRN/ZIP/DUP/INS, MOVI, TBL (1 register) 2, V; SCVTF/FCVTZS/FRINTN "
        ".4s register forms 4, 2 uops V0; FCVTL 3, V0; SHL 2, V1; SADALP 4, V1; "
        "SMULL/SMLAL 4, V0; FMAXV 5, V; LD1R 7, L+V; Q loads and stores by their rows)",
        "SDOT (vector and by element) and SADDLP have no rule of their own in LLVM: its "
        "default ASIMD class (2 cycles, V0 or V1) is what GCC's transcription of the N1 guide "
        "gives SDOT and what the A720 guide gives its 'ASIMD arith, pair-wise' row",
        "integer and branch instructions: LLVM's N1 rules name the guide's rows; not "
        "re-checked one by one (the integer pipes are not what bounds these kernels)",
    ],
    "cortex-a55@llvm-16": [
        "SDOT (4, Q-form 1 a cycle) and SMLAL: the guide forwards the accumulator to the "
        "next dot product (multiply-accumulate) in 1 cycle; LLVM charges 4 and no stand-in "
        "reads three registers at a 1-cycle latency: dependent chains stay pessimistic",
        "INS element (mov v.d[1], v.d[0]) and MOVI: the guide says latency 2 and 1, LLVM 4: "
        "a few per call, left",
        "SHL .4s: the guide's row has no Q-form note (2, throughput 2), as LLVM prices it",
        "FADD/FSUB/FMAX/FMAXV, ADD/BIC/ADDP/SADDLP, SMULL, SDOT throughput, STR/STUR Q: "
        "LLVM agrees with the guide",
        "integer and branch instructions: not re-checked one by one",
    ],
}


def mca_info(t, model, lines):
    """llvm-mca's view of a few instructions: per instruction (uops, latency,
    reciprocal throughput) and the block's reciprocal throughput."""
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(lines) + "\n")
        path = f.name
    try:
        r = subprocess.run([t[f"mca{model.llvm}"], "-mtriple=aarch64-linux-gnu",
                            f"-mcpu={model.mcpu}", "-iterations=100", path],
                           capture_output=True, text=True)
    finally:
        os.unlink(path)
    if r.returncode:
        raise RuntimeError(f"llvm-mca -mcpu={model.mcpu} {lines}: {r.stderr[:500]}")
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([0-9.]+)\s", r.stdout.split("Instruction Info:")[1],
                      re.M)
    block = float(re.search(r"^Block RThroughput:\s+([0-9.]+)", r.stdout, re.M).group(1))
    return {"instructions": [{"uops": int(u), "latency": int(l), "rthroughput": float(x)}
                             for u, l, x in rows[:len(lines)]], "block_rthroughput": block}


def check_corrections(t, models):
    """Each correction of the models used: LLVM's pricing of the original and
    of its stand-in, checked against the guide's figures; raises if LLVM
    prices a stand-in otherwise than the correction says (another LLVM)."""
    out = {}
    for m in models:
        rows = []
        for c in CORRECTIONS.get(m.key, []):
            standin = c.apply(c.example)
            orig, new = mca_info(t, m, [c.example]), mca_info(t, m, standin)
            got = (new["instructions"][0]["latency"], new["block_rthroughput"])
            if got[0] != c.standin_latency or abs(got[1] - c.guide[1]) > 0.01:
                raise RuntimeError(
                    f"arm_model: {m.key} prices the stand-in of {c.name!r} ({standin}) at "
                    f"latency {got[0]}, {got[1]} cycles an instruction, not the "
                    f"{c.standin_latency} / {c.guide[1]} the correction relies on")
            rows.append({"form": c.name, "example": c.example, "standin": standin,
                         "guide": {"latency": c.guide[0], "cycles_per_instruction": c.guide[1],
                                   "row": c.row},
                         "llvm": {"says": c.llvm, "latency": orig["instructions"][0]["latency"],
                                  "uops": orig["instructions"][0]["uops"],
                                  "cycles_per_instruction": orig["block_rthroughput"]},
                         "standin_priced": {"latency": got[0], "cycles_per_instruction": got[1]},
                         "note": c.note})
        if rows or m.key in NOT_CORRECTED:
            out[m.key] = {"corrected": rows, "not_corrected": NOT_CORRECTED.get(m.key, [])}
    return out


def correct_trace(lines, corrections):
    """The trace with every instruction a correction matches replaced by its
    stand-in, and how many of each were replaced."""
    out, used = [], collections.Counter()
    for line in lines:
        for c in corrections:
            s = c.apply(line)
            if s is not None:
                out.extend(s)
                used[c.name] += 1
                break
        else:
            out.append(line)
    return out, used


def host_cpu():
    """(vendor, family, model) of this x86 host from /proc/cpuinfo."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                found.setdefault(key.strip(), value.strip())
    except OSError:
        pass

    def num(key):
        return int(found[key]) if found.get(key, "").isdigit() else -1
    return found.get("vendor_id", ""), num("cpu family"), num("model")


def host_models():
    """The llvm-mca models of this host's core for the check of the method, the
    preferred first: AMD Zen 2-5 by family and model, else Intel's."""
    vendor, family, model = host_cpu()
    if vendor == "AuthenticAMD" and family in (23, 25, 26):
        zen = {23: "znver2", 26: "znver5"}.get(family)
        if zen is None:  # family 25: Zen 4 at models 0x10-0x1f and 0x60-0xaf, else Zen 3
            zen = "znver4" if 0x10 <= model <= 0x1f or 0x60 <= model <= 0xaf else "znver3"
        old = "znver4" if zen == "znver5" else zen  # llvm-16 knows no Zen 5
        return [Model(19, zen, "x86_64", f"this host's core (AMD family {family}, model "
                      f"{model:#x}): LLVM 19's {zen} model"),
                Model(16, old, "x86_64", f"llvm-16's {old} (its znver4 times as its znver3)")]
    return [Model(19, "sapphirerapids", "x86_64",
                  "an Intel host's core (the Emerald Rapids VM's Raptor Cove is a Golden Cove "
                  "derivative): LLVM 19's Sapphire Rapids model"),
            Model(16, "alderlake", "x86_64",
                  "llvm-16's Golden Cove (Alder Lake P-core) model: the host core's family"),
            Model(16, "sapphirerapids", "x86_64",
                  "llvm-16's sapphirerapids is its Skylake-server model (SKX ports, slow "
                  "integer divide); reported to show why llvm-19's is used")]

# The article's step (README): Qwen3-VL-2B's attention shape.
STEP = {"model": "Qwen3-VL-2B", "tokens": 2061, "layers": 28, "q_heads": 16, "kv_heads": 8,
        "head_dim": 128, "dtype": "q8", "group_size": GS}
BOARD = {
    "a76": {"cores": 4, "ghz": 2.4},
    "a55": {"cores": 1, "ghz": 1.8},
    "dram_GBps": [10.0, 14.0, 17.0, 20.0],
    "dram_note": "not measured here (no board): RK3588 boards read 17-22 GB/s with all cores "
                 "in sbc-bench reviews (github.com/ThomasKaiser/sbc-bench; Turing Pi's RK1 "
                 "benchmarks: 17-22 GB/s sequential), one A76 alone 14-17 GB/s; 10 and 14 "
                 "GB/s are the model's earlier, lower assumption; the 64-bit LPDDR4x-4224 bus "
                 "peaks at ~34 GB/s",
}
ISA_ARCH = {"neon": "aarch64", "neon-dotprod": "aarch64", "avx2": "x86_64"}


def kv_bytes_per_token(D):
    """Bytes of K (or of V) one token of one KV head holds: D int8 + a float32
    scale per group."""
    return D + 4 * (D // GS)


# --------------------------------------------------------------------- tools

def tool(*names):
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def tools():
    return {
        "mca16": tool("llvm-mca-16"),
        "mca19": tool("llvm-mca-19"),
        "objdump": tool("llvm-objdump-16"),
        "nm": tool("llvm-nm-16"),
        "arm_cc": tool(os.environ.get("ARM_CC", "aarch64-linux-gnu-gcc")),
        "cc": tool(os.environ.get("CC", "gcc"), "cc"),
        "qemu_arm": tool("qemu-aarch64"),
        "qemu_x86": tool("qemu-x86_64"),
    }


def missing_tools(t, need_x86):
    need = ["mca16", "objdump", "nm", "arm_cc", "cc", "qemu_arm"] + (["qemu_x86"] if need_x86 else [])
    return [k for k in need if not t[k]]


def llvm_version(exe):
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"LLVM version [^\s]+", out)
    return f"{Path(exe).name}: {m.group(0)}" if m else Path(exe).name


def first_line(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
    except OSError:
        return None
    for line in out.splitlines():
        if line.strip():
            return line.strip()
    return None


# --------------------------------------------------------------------- build

def package_build():
    """({arch: flags}, {arch: [kernel files]}) as csrc/build_ffi.py builds the
    package for each arch: setuptools' CFLAGS + CCSHARED of this Python, then
    compile_args(arch)."""
    spec = importlib.util.spec_from_file_location("_sa_build_ffi", CSRC / "build_ffi.py")
    mod = importlib.util.module_from_spec(spec)
    saved = os.environ.pop("SPARSE_ATTN_CFLAGS", None)  # the release flags, not a sanitizer run's
    try:
        spec.loader.exec_module(mod)
        args = {arch: mod.compile_args(want)
                for arch, want in (("x86_64", "X86_64"), ("aarch64", "AARCH64"))}
        isas = mod.isa_list()
    finally:
        if saved is not None:
            os.environ["SPARSE_ATTN_CFLAGS"] = saved
    setuptools = (sysconfig.get_config_var("CFLAGS") or "").split() + \
                 (sysconfig.get_config_var("CCSHARED") or "").split()
    files = {}
    for arch in ("x86_64", "aarch64"):
        want = {"x86_64": "X86_64", "aarch64": "AARCH64"}[arch]
        files[arch] = [f for _, _, a, f in isas if a in ("ANY", want)]
    return {arch: setuptools + a for arch, a in args.items()}, files


def build(arch, cc, flags, kernel_files, out_dir, pool):
    """Objects in parallel, then one static executable; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    srcs = sorted(CSRC.glob("*.c")) + [CSRC / f for f in kernel_files] + [DRIVER]

    def compile_one(src):
        obj = out_dir / (src.relative_to(REPO).as_posix().replace("/", "__") + ".o")
        r = subprocess.run([cc, *flags, f"-I{CSRC}", "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cc} {src}: {r.stderr}")
        return obj

    objs = list(pool.map(compile_one, srcs))
    exe = out_dir / f"arm_model_driver_{arch}"
    r = subprocess.run([cc, "-static", *map(str, objs), "-o", str(exe), "-lm", "-pthread"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"link {exe}: {r.stderr}")
    return exe


def build_plugin(cc, out_dir):
    so = out_dir / "arm_model_plugin.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", str(PLUGIN), "-o", str(so)], check=True)
    return so


# ------------------------------------------------------- binary: syms, code

class Binary:
    def __init__(self, exe, arch, t):
        self.exe, self.arch = exe, arch
        out = subprocess.run([t["nm"], "-n", "--defined-only", str(exe)], capture_output=True,
                             text=True, check=True).stdout
        syms = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "tTwW":
                syms.append((int(parts[0], 16), parts[2]))
        syms.sort()
        self.sym_addr = [a for a, _ in syms]
        self.sym_name = [n for _, n in syms]
        self.addr_of = {n: a for a, n in syms}
        dis = subprocess.run([t["objdump"], "-d", "--no-show-raw-insn", str(exe)],
                             capture_output=True, text=True, check=True).stdout
        self.insn = {}
        line_re = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
        for line in dis.splitlines():
            m = line_re.match(line)
            if m:
                self.insn[int(m.group(1), 16)] = m.group(2)
        self.addrs = sorted(self.insn)
        self.index = {a: i for i, a in enumerate(self.addrs)}

    def symbol(self, addr):
        i = bisect.bisect_right(self.sym_addr, addr) - 1
        return self.sym_name[i] if i >= 0 else "?"

    def where(self, addr):
        i = bisect.bisect_right(self.sym_addr, addr) - 1
        return f"{self.sym_name[i]}+{addr - self.sym_addr[i]:#x}" if i >= 0 else hex(addr)

    def mca_text(self, ins):
        """One objdump instruction as llvm-mc input: branch and literal
        targets become a local label, comments go."""
        s = ins.replace("\t", " ")
        if self.arch == "aarch64":
            s = s.split("//")[0]
        else:
            s = s.split("#")[0]
        s = re.sub(r"0x[0-9a-f]+ <[^>]*>", ".Ltarget", s)
        return s.strip()

    def expand(self, blocks):
        """The instructions of a sequence of (vaddr, n_insns) blocks."""
        out = []
        for a, n in blocks:
            i = self.index[a]
            out.extend(self.mca_text(self.insn[self.addrs[j]]) for j in range(i, i + n))
        return out


DRIVER_FUNCS = re.compile(r"^(main|sa_model_begin|sa_model_end|drv_\w*)(\..*)?$")


def run_trace(binary, t, plugin, isa, G, D, n, tmp):
    arch = ISA_ARCH[isa]
    qemu = t["qemu_arm"] if arch == "aarch64" else t["qemu_x86"]
    cpu = "cortex-a76" if arch == "aarch64" else "max"
    out = Path(tmp) / f"trace-{isa}-{G}-{D}.txt"
    b, e = binary.addr_of["sa_model_begin"], binary.addr_of["sa_model_end"]
    cmd = [qemu, "-cpu", cpu, "-plugin", f"{plugin},begin={b:#x},end={e:#x},out={out}",
           str(binary.exe), "trace", isa, str(G), str(D), str(n)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if info["isa"] != isa:
        raise RuntimeError(f"driver ran {info['isa']}, not {isa}")
    windows = []
    for line in out.read_text().splitlines():
        if line.startswith("W "):
            windows.append([])
        else:
            a, k = line.split()
            windows[-1].append((int(a, 16), int(k)))
    out.unlink()
    if len(windows) != 6:
        raise RuntimeError(f"expected 6 trace windows, got {len(windows)}")
    # drop the driver's own code (the marker, the call's return into main)
    return info, [[(a, k) for a, k in w if not DRIVER_FUNCS.match(binary.symbol(a))]
                  for w in windows]


def count_insns(binary, blocks):
    per = collections.Counter()
    for a, k in blocks:
        per[binary.symbol(a)] += k
    return per


def hot_blocks(binary, blocks, top=3):
    c, size = collections.Counter(), {}
    for a, k in blocks:
        c[a] += k
        size[a] = k
    total = sum(c.values())
    return [{"at": binary.where(a), "insns": size[a], "runs": c[a] // size[a],
             "share": round(c[a] / total, 3)} for a, _ in c.most_common(top)]


# ---------------------------------------------------------------- llvm-mca

MCA_TARGET_INSNS = 30000


class Mca:
    """llvm-mca runs on a pool, one per distinct (model, trace): softmax's
    trace is the same for every shape."""

    def __init__(self, t, pool):
        self.t, self.pool, self.jobs = t, pool, {}

    def submit(self, model, lines):
        key = (model.key, hash(tuple(lines)))
        if key not in self.jobs:
            self.jobs[key] = self.pool.submit(self._run, model, lines)
        return self.jobs[key]

    def _run(self, model, lines):
        exe = self.t[f"mca{model.llvm}"]
        iters = max(2, min(100, math.ceil(MCA_TARGET_INSNS / max(1, len(lines)))))
        triple = "aarch64-linux-gnu" if model.arch == "aarch64" else "x86_64-linux-gnu"
        with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
            f.write(".Ltarget:\n" + "\n".join(lines) + "\n")
            path = f.name
        try:
            r = subprocess.run([exe, f"-mtriple={triple}", f"-mcpu={model.mcpu}",
                                f"-iterations={iters}", "-instruction-info=false", path],
                               capture_output=True, text=True)
        finally:
            os.unlink(path)
        if r.returncode:
            raise RuntimeError(f"{exe} -mcpu={model.mcpu}: {r.stderr[:2000]}")

        def field(name):
            m = re.search(rf"^{name}:\s+([0-9.]+)", r.stdout, re.M)
            if not m:
                raise RuntimeError(f"llvm-mca output lacks {name}")
            return float(m.group(1))

        it, ins, cyc = field("Iterations"), field("Instructions"), field("Total Cycles")
        if ins != it * len(lines):
            raise RuntimeError(f"llvm-mca read {ins / it} instructions of {len(lines)}")
        return {"cycles": cyc / it, "bound": field("Block RThroughput"),
                "ipc": len(lines) * it / cyc, "dispatch_width": field("Dispatch Width")}


# ------------------------------------------------------------ per ISA/shape

def analyse(binary, t, plugin, isa, shapes, models, pool, mca, tmp):
    """qemu counts and llvm-mca cycles for one ISA over the shapes."""
    traces = dict(zip(shapes, pool.map(
        lambda s: run_trace(binary, t, plugin, isa, s[0], s[1], N_TRACE, tmp), shapes)))
    counts, jobs = [], {}
    replaced = collections.defaultdict(dict)
    infos = {shape: info for shape, (info, _) in traces.items()}
    for (G, D), (info, w) in traces.items():
        decode, sc, v, sm, psc, pv = w
        kinds = {}
        for kind, win in (("scores", sc), ("v", v), ("softmax", sm)):
            for name in count_insns(binary, win):
                kinds.setdefault(name, kind)
        per = collections.Counter()
        for name, k in count_insns(binary, decode).items():
            per[kinds.get(name, "other")] += k
        total = sum(per.values())
        kvb = 2 * kv_bytes_per_token(D) * N_TRACE
        kernel = per["scores"] + per["v"] + per["softmax"]
        counts.append({
            "isa": isa, "G": G, "D": D, "tokens": N_TRACE, "kv_heads": 1, "kv_bytes": kvb,
            "instructions": total,
            "instructions_per_kv_byte": {k: round(per[k] / kvb, 4)
                                         for k in ("scores", "softmax", "v", "other")}
                                        | {"total": round(total / kvb, 4)},
            "non_kernel_share": round(1 - kernel / total, 4),
            "call_instructions": {"scores_q8_32_rows": sum(k for _, k in sc),
                                  "accumulate_v_q8_32_rows": sum(k for _, k in v),
                                  f"softmax_exp_{N_TRACE}": sum(k for _, k in sm),
                                  "prefill_scores_tile_32_keys": sum(k for _, k in psc),
                                  "prefill_v_tile_32_keys": sum(k for _, k in pv)},
            "prefill_tile": {"vectors": info["prefill_vectors"], "keys": info["prefill_keys"],
                             "q8_panels": bool(info["q8_panels"])},
            "hot_blocks": {"scores_q8": hot_blocks(binary, sc),
                           "accumulate_v_q8": hot_blocks(binary, v)},
        })
        for kind, win in (("scores", sc), ("v", v), ("softmax", sm), ("prefill_scores", psc),
                          ("prefill_v", pv)):
            lines = binary.expand(win)
            for m in models:
                if m.key in CORRECTIONS:
                    fixed, used = correct_trace(lines, CORRECTIONS[m.key])
                    jobs[(G, D, kind, m.key)] = mca.submit(m, fixed)
                    jobs[(G, D, kind, m.key, "raw")] = mca.submit(m, lines)
                    replaced[(G, D, m.key)][kind] = dict(used)
                else:
                    jobs[(G, D, kind, m.key)] = mca.submit(m, lines)
    ipb = {(c["G"], c["D"]): c["instructions_per_kv_byte"] for c in counts}
    cycles = []
    for m in models:
        for (G, D) in shapes:
            r = {k: jobs[(G, D, k, m.key)].result() for k in ("scores", "v", "softmax")}
            pr = {k: jobs[(G, D, f"prefill_{k}", m.key)].result() for k in ("scores", "v")}
            raw = None
            if m.key in CORRECTIONS:
                # llvm-mca over the trace as compiled, for comparison
                rr = {k: jobs[(G, D, k, m.key, "raw")].result()["cycles"]
                      for k in ("scores", "v", "softmax")}
                raw = {"scores": rr["scores"] / CALL, "v": rr["v"] / CALL,
                       "softmax": G * rr["softmax"] / N_TRACE}
                raw["total"] = raw["scores"] + raw["v"] + raw["softmax"]
            # per token and KV head: a 32-row call's cycles / 32; softmax is
            # one head's pass over N_TRACE scores, times G heads
            cyc = {"scores": r["scores"]["cycles"] / CALL, "v": r["v"]["cycles"] / CALL,
                   "softmax": G * r["softmax"]["cycles"] / N_TRACE}
            bound = {"scores": r["scores"]["bound"] / CALL, "v": r["v"]["bound"] / CALL,
                     "softmax": G * r["softmax"]["bound"] / N_TRACE}
            cyc["scores_v"] = cyc["scores"] + cyc["v"]
            cyc["total"] = cyc["scores_v"] + cyc["softmax"]
            bound["total"] = bound["scores"] + bound["v"] + bound["softmax"]
            kb = kv_bytes_per_token(D)
            cycles.append({
                "model": m.key, "mcpu": m.mcpu, "llvm": m.llvm, "isa": isa, "G": G, "D": D,
                "cycles_per_token_kv_head": {k: round(x, 2) for k, x in cyc.items()},
                "resource_bound_cycles_per_token_kv_head": {k: round(x, 2)
                                                            for k, x in bound.items()},
                "bytes_per_cycle": {"scores": round(kb / cyc["scores"], 4),
                                    "v": round(kb / cyc["v"], 4),
                                    "scores_v": round(2 * kb / cyc["scores_v"], 4),
                                    "total": round(2 * kb / cyc["total"], 4)},
                "ipc": {k: round(r[k]["ipc"], 2) for k in r},
                "guide_corrections": replaced.get((G, D, m.key)),
                "llvm_raw_cycles_per_token_kv_head":
                    {k: round(x, 2) for k, x in raw.items()} if raw else None,
                "llvm_raw_bytes_per_cycle": round(2 * kb / raw["total"], 4) if raw else None,
                "qemu_instructions_per_kv_byte": ipb[(G, D)],
                "prefill_cycles_per_vector_key": prefill_cycles(
                    {k: pr[k]["cycles"] for k in pr}, r["softmax"]["cycles"], infos[(G, D)]),
                "prefill_resource_bound_cycles_per_vector_key": prefill_cycles(
                    {k: pr[k]["bound"] for k in pr}, r["softmax"]["bound"], infos[(G, D)]),
            })
    return counts, cycles


def prefill_cycles(tile, softmax, info):
    """Exact q8 prefill per (query vector, key): the tile's scores and V
    calls (its vectors x 32 keys), and one element of a row's softmax (the
    decode softmax's pass over N_TRACE scores is the same kernel)."""
    per = info["prefill_vectors"] * info["prefill_keys"]
    out = {"scores": tile["scores"] / per, "softmax": softmax / N_TRACE, "v": tile["v"] / per}
    out["total"] = out["scores"] + out["softmax"] + out["v"]
    return {k: round(x, 4) for k, x in out.items()}


# ------------------------------------------------------------ x86 timing

def measure_x86(exe, shapes, repeats, reps=150):
    """In-cache single-thread ns per token of the avx2 kernel calls, several
    driver runs per shape (interleaved), and the clock before, between and
    after them."""
    clocks = []

    def clock():
        r = subprocess.run([str(exe), "clock"], capture_output=True, text=True, check=True)
        clocks.append(json.loads(r.stdout))

    runs = collections.defaultdict(list)
    clock()
    for i in range(repeats):
        for (G, D) in shapes:
            r = subprocess.run([str(exe), "time", X86_ISA, str(G), str(D), str(N_TIME), str(reps)],
                               capture_output=True, text=True, check=True)
            out = json.loads(r.stdout)
            if out["isa"] != X86_ISA:
                raise RuntimeError(f"timing ran {out['isa']}, not {X86_ISA}")
            runs[(G, D)].append(out)
        if i == repeats // 2:
            clock()
    clock()
    return runs, clocks


def calibrate(x86_cycles, runs, clocks, host_model):
    ghz_all = [c["ghz_add"] for c in clocks] + [c["ghz_imul"] for c in clocks]
    ghz = statistics.median(ghz_all)
    measured = []
    for (G, D), rs in sorted(runs.items()):
        meas = {k: [r[f"{k}_ns"] * ghz for r in rs] for k in ("scores", "v", "softmax")}
        meas["total"] = [(r["scores_ns"] + r["v_ns"] + r["softmax_ns"]) * ghz for r in rs]
        meas["sa_dense_decode"] = [r["decode_ns"] * ghz for r in rs]
        # prefill per (vector, key): the tile's scores and V, one element
        # of softmax (the decode timing's softmax is G rows per token)
        pmeas = {"scores": [r["prefill_scores_ns"] * ghz for r in rs],
                 "v": [r["prefill_v_ns"] * ghz for r in rs],
                 "softmax": [r["softmax_ns"] / G * ghz for r in rs]}
        pmeas["total"] = [a + b + c for a, b, c in zip(pmeas["scores"], pmeas["v"],
                                                      pmeas["softmax"])]
        pmed = {k: statistics.median(v) for k, v in pmeas.items()}
        kb = kv_bytes_per_token(D)
        med = {k: statistics.median(v) for k, v in meas.items()}
        measured.append({
            "G": G, "D": D,
            "cycles_per_token_kv_head": {k: [round(min(v), 2), round(med[k], 2), round(max(v), 2)]
                                         for k, v in meas.items()},
            "bytes_per_cycle": {"scores": round(kb / med["scores"], 4),
                                "v": round(kb / med["v"], 4),
                                "total": round(2 * kb / med["total"], 4),
                                "total_range": [round(2 * kb / max(meas["total"]), 4),
                                                round(2 * kb / min(meas["total"]), 4)],
                                "sa_dense_decode": round(2 * kb / med["sa_dense_decode"], 4)},
            "GBps_per_core": round(2 * kb / med["total"] * ghz, 2),
            "prefill_cycles_per_vector_key": {k: [round(min(v), 4), round(pmed[k], 4),
                                                  round(max(v), 4)] for k, v in pmeas.items()},
            "_med": med, "_all": meas["total"], "_pmed": pmed,
        })
    per_model = {}
    for c in x86_cycles:
        per_model.setdefault(c["model"], {})[(c["G"], c["D"])] = c
    factors = {}
    for key, pred in per_model.items():
        rows, tot, ptot = [], [], []
        for m in measured:
            p = pred[(m["G"], m["D"])]["cycles_per_token_kv_head"]
            # measured / predicted bytes per cycle = predicted / measured cycles
            f = {k: round(p[k] / m["_med"][k], 3) for k in ("scores", "v", "softmax", "total")}
            f["total_range"] = [round(p["total"] / max(m["_all"]), 3),
                                round(p["total"] / min(m["_all"]), 3)]
            pp = pred[(m["G"], m["D"])]["prefill_cycles_per_vector_key"]
            f["prefill"] = round(pp["total"] / m["_pmed"]["total"], 3)
            ptot.append(f["prefill"])
            rows.append({"G": m["G"], "D": m["D"], "predicted_cycles_per_token_kv_head":
                         {k: p[k] for k in ("scores", "v", "softmax", "total")},
                         "predicted_bytes_per_cycle": pred[(m["G"], m["D"])]["bytes_per_cycle"]
                         ["total"], "factor": f})
            tot.append(f["total"])
        factors[key] = {"shapes": rows, "total": {"min": min(tot), "median":
                                                  round(statistics.median(tot), 3),
                                                  "max": max(tot)},
                        "prefill": {"min": min(ptot), "median": round(statistics.median(ptot), 3),
                                    "max": max(ptot)}}
    for m in measured:
        del m["_med"], m["_all"], m["_pmed"]
    return {
        "isa": X86_ISA, "tokens": N_TIME, "host_model": host_model,
        "clock_ghz": {"used": round(ghz, 4), "min": round(min(ghz_all), 4),
                      "max": round(max(ghz_all), 4),
                      "how": "dependent chains (16 register adds of 1 cycle, 8 imul of 3 "
                             "cycles per loop), fastest of 400 short chunks each, run before, "
                             "between and after the timings; perf stat has no cycle counter "
                             "in this VM; /proc/cpuinfo says 2300 MHz (nominal)"},
        "runs_per_shape": len(next(iter(runs.values()))),
        "timing": "best of 150 passes over 2048 tokens per run (in L2), one thread; "
                  "[min, median, max] over the runs",
        "measured": measured,
        "factors": factors,
        "factor": factors.get(host_model, {}).get("total"),
        "prefill_factor": factors.get(host_model, {}).get("prefill"),
        "factor_note": "measured / predicted bytes per cycle of scores_q8 + softmax_exp + "
                       "accumulate_v_q8 (median of the runs), per shape; 'factor' is the host "
                       "model's min / median / max over the six shapes; < 1: llvm-mca is "
                       "optimistic; 'prefill_factor' the same for exact q8 prefill's kernels "
                       "per (vector, key): a tile's scores (q8 panels) and V (float rows) over "
                       f"{N_TIME} keys in cache, and the softmax",
    }


# ------------------------------------------------------------ the step

def predict_step(arm_cycles, arm_counts, a76_model, a76_alts):
    """The article's decode step on the board from the modelled cycles (raw
    llvm-mca with the guides' corrections: no factor measured on another
    core applied), against the memory floor at each DRAM bandwidth."""
    G = STEP["q_heads"] // STEP["kv_heads"]
    D = STEP["head_dim"]
    isa = "neon-dotprod"  # both RK3588 cores have FEAT_DotProd: the ISA the package picks
    per_model = {c["model"]: c for c in arm_cycles
                 if c["isa"] == isa and c["G"] == G and c["D"] == D}
    cnt = next((c for c in arm_counts if c["isa"] == isa and c["G"] == G and c["D"] == D), None)
    if not per_model or cnt is None:
        return None
    kvb = 2 * kv_bytes_per_token(D) * STEP["tokens"] * STEP["layers"] * STEP["kv_heads"]
    floor = [kvb / (bw * 1e9) * 1e3 for bw in BOARD["dram_GBps"]]
    # the rest of a dense decode (rows.c, attend.c, query quantisation,
    # normalisation) taken at the kernels' cycles per instruction
    overhead = 1 / (1 - cnt["non_kernel_share"])
    per_step = STEP["tokens"] * STEP["layers"] * STEP["kv_heads"]

    def core(key, cores, ghz):
        c = per_model.get(key)
        if c is None:
            return None
        cyc = c["cycles_per_token_kv_head"]["total"] * overhead
        ms = cyc * per_step / (cores * ghz * 1e9) * 1e3
        out = {"model": key, "cores": cores, "ghz": ghz,
               "cycles_per_token_kv_head": round(cyc, 2),
               "bytes_per_cycle_per_core": round(2 * kv_bytes_per_token(D) / cyc, 4),
               "model_ms": round(ms, 2),
               # the DRAM bandwidth the cores keep up with: below it the
               # step waits for memory, above it for the cores
               "compute_GBps": round(kvb / (ms * 1e-3) / 1e9, 2)}
        raw = c.get("llvm_raw_cycles_per_token_kv_head")
        if raw:
            out["llvm_raw_ms"] = round(raw["total"] * overhead * per_step /
                                       (cores * ghz * 1e9) * 1e3, 2)
        out["step_ms"] = [{"GBps": bw, "ms": round(max(ms, fl), 2),
                           "bound": "compute" if ms > fl else "memory"}
                          for bw, fl in zip(BOARD["dram_GBps"], floor)]
        return out

    a76, a55 = BOARD["a76"], BOARD["a55"]
    res = {
        "case": STEP | {"G": G, "isa": isa},
        "kv_bytes": kvb,
        "non_kernel_overhead_factor": round(overhead, 4),
        "floor_ms": {"at_GBps": BOARD["dram_GBps"], "ms": [round(x, 2) for x in floor],
                     "source": BOARD["dram_note"]},
        "a76_x4": core(a76_model, a76["cores"], a76["ghz"]) if a76_model else None,
        "a76_x4_other_models": {k: core(k, a76["cores"], a76["ghz"]) for k in a76_alts
                                if k in per_model},
        "a55_x1": core(A55_MODEL, a55["cores"], a55["ghz"]),
        "assumptions": [
            "the four A76 cores split the 8 KV heads evenly and scale perfectly",
            "compute and memory overlap fully: the step takes the larger of the two",
            "code outside the three kernels runs at the kernels' cycles per instruction",
            "the cycles are llvm-mca's over the guide-corrected traces, raw: no factor "
            "measured on another core is applied (the host's is a check of the method)",
        ],
    }
    res["prefill"] = predict_prefill(per_model, a76_model)
    a = res["a76_x4"]
    if a:
        mem = [s["GBps"] for s in a["step_ms"] if s["bound"] == "memory"]
        cpu = [s["GBps"] for s in a["step_ms"] if s["bound"] == "compute"]
        res["a76_x4_bound"] = (
            f"the four A76 cores keep up with {a['compute_GBps']:g} GB/s: " +
            "; ".join(x for x in (
                f"memory-bound at {', '.join(f'{b:g}' for b in mem)} GB/s" if mem else "",
                f"compute-bound at {', '.join(f'{b:g}' for b in cpu)} GB/s" if cpu else "")
                if x))
    return res


def predict_prefill(per_model, a76_model):
    """The article's prompt prefilled exactly on the q8 cache: every query
    vector against its causal keys (T (T + 1) / 2 per head and layer), at the
    kernels' modelled cycles per (vector, key), the cores splitting the work
    evenly; compute-bound (each tile reads its keys from cache)."""
    T = STEP["tokens"]
    pairs = STEP["q_heads"] * STEP["layers"] * T * (T + 1) // 2

    def core(key, cores, ghz):
        c = per_model.get(key)
        if c is None:
            return None
        cyc = c["prefill_cycles_per_vector_key"]
        ms = cyc["total"] * pairs / (cores * ghz * 1e9) * 1e3
        return {"model": key, "cores": cores, "ghz": ghz,
                "cycles_per_vector_key": cyc, "model_ms": round(ms, 1)}

    a76, a55 = BOARD["a76"], BOARD["a55"]
    return {
        "vector_key_pairs": pairs,
        "a76_x4": core(a76_model, a76["cores"], a76["ghz"]) if a76_model else None,
        "a55_x1": core(A55_MODEL, a55["cores"], a55["ghz"]),
        "assumptions": [
            "attention only (the model's linear layers are not modelled)",
            "a tile's scores, softmax and V only: K's packing into panels, V's dequantisation "
            "(once per worker and KV head), the importance sums and the tiles' bookkeeping "
            "are left out (a few percent of a prefill on x86)",
            "the cores split the work evenly and scale perfectly; the keys a tile reads stay "
            "in cache",
            "the cycles are llvm-mca's over the guide-corrected traces, raw",
        ],
    }


# ------------------------------------------------------------ main

def run(quick=False, json_path=None, repeats=5, keep=None):
    t0 = time.time()
    t = tools()
    on_x86 = platform.machine() in ("x86_64", "AMD64")
    do_x86 = on_x86 and not quick
    miss = missing_tools(t, do_x86)
    if miss:
        raise SystemExit(f"arm_model: missing tools: {', '.join(miss)} (apt-get install llvm-16 "
                         "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
    shapes = QUICK_SHAPES if quick else SHAPES
    isas = QUICK_ARM_ISAS if quick else ARM_ISAS
    hosts = host_models()
    wanted = [m for m in MODELS + hosts if (m.key in QUICK_MODELS if quick else True)]
    models = [m for m in wanted if t[f"mca{m.llvm}"]]
    skipped = [f"{m.key} (llvm-mca-{m.llvm} not installed)" for m in wanted if m not in models]
    arm_models = [m for m in models if m.arch == "aarch64"]
    x86_models = [m for m in models if m.arch == "x86_64"]
    keys = [m.key for m in models]
    a76_model = next((k for k in A76_MODELS if k in keys), None)
    host_model = next((m.key for m in hosts if m.key in keys), None)
    # the guides' corrections, checked against these LLVMs before any trace
    corrections = check_corrections(t, [m for m in arm_models if m.key in CORRECTIONS])
    flags, files = package_build()
    workers = os.cpu_count() or 2
    build_root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="arm-model-"))
    try:
        with cf.ThreadPoolExecutor(workers) as pool:
            mca = Mca(t, pool)
            arm_exe = build("aarch64", t["arm_cc"], flags["aarch64"], files["aarch64"],
                            build_root / "aarch64", pool)
            x86_exe = build("x86_64", t["cc"], flags["x86_64"], files["x86_64"],
                            build_root / "x86_64", pool) if do_x86 else None
            plugin = build_plugin(t["cc"], build_root)
            arm_bin = Binary(arm_exe, "aarch64", t)
            counts, cycles = [], []
            for isa in isas:
                c, y = analyse(arm_bin, t, plugin, isa, shapes, arm_models, pool, mca, build_root)
                counts += c
                cycles += y
            x86 = None
            if do_x86:
                xb = Binary(x86_exe, "x86_64", t)
                xc, xy = analyse(xb, t, plugin, X86_ISA, shapes, x86_models, pool, mca,
                                 build_root)
                x86 = {"counts": xc, "cycles": xy}
        calib = None
        if do_x86:
            runs, clocks = measure_x86(x86_exe, shapes, repeats)
            calib = calibrate(x86["cycles"], runs, clocks, host_model)
            calib["qemu_instruction_counts"] = x86["counts"]
            calib["llvm_mca"] = x86["cycles"]
    finally:
        if not keep:
            shutil.rmtree(build_root, ignore_errors=True)

    cmd = "python bench/arm_model.py" + (" --quick" if quick else "") + \
          (f" --repeats {repeats}" if repeats != 5 and not quick else "") + \
          (f" --json {os.path.relpath(json_path, REPO)}" if json_path else "")
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    fam = re.search(r"^cpu family\s*:\s*(\d+)", cpuinfo, re.M)
    mod = re.search(r"^model\s*:\s*(\d+)", cpuinfo, re.M)
    result = {
        "command": cmd,
        "machine": {
            "host": f"{name.group(1) if name else platform.processor()} (family "
                    f"{fam.group(1) if fam else '?'}, model {mod.group(1) if mod else '?'}), "
                    f"{os.cpu_count()} CPUs, {platform.machine()}",
            "llvm_mca": [llvm_version(t[k]) for k in ("mca16", "mca19") if t[k]],
            "models": {m.key: m.note for m in models},
            "models_skipped": skipped,
            "a76_model": a76_model, "a55_model": A55_MODEL if A55_MODEL in keys else None,
            "host_model": host_model if do_x86 else None,
            "arm_cc": first_line([t["arm_cc"], "--version"]),
            "cc": first_line([t["cc"], "--version"]),
            "qemu": first_line([t["qemu_arm"], "--version"]),
            "compile_flags": flags,
        },
        "method": {
            "trace": "qemu-user TCG plugin bench/arm_model_plugin.c (Debian's qemu-user ships no "
                     "plugins): translation blocks executed inside marker windows, expanded "
                     "through llvm-objdump into the dynamic instruction trace of one call",
            "cycles": "llvm-mca over the whole trace of one call (scores_q8 / accumulate_v_q8 "
                      "of 32 rows as rows.c makes them, softmax_exp over the scores of one "
                      f"head, {N_TRACE} tokens); per token and KV head = call cycles / 32 "
                      "(softmax: / tokens x G); resource_bound = llvm-mca's Block RThroughput "
                      "on the same scale",
            "bytes": "per token and KV head: K = D int8 + 4 bytes per 32 values, V the same",
            "prefill": "exact q8 prefill's kernels as prefill.c calls them: one tile (32 rows x "
                       "G heads of query vectors) scored against 32 keys (scores_q8_panels over "
                       "K in the table's panels, else scores_q8 over the rows), its V for those "
                       "keys (accumulate_v_f32 over float rows), and one element of the "
                       "softmax (the decode trace's pass); cycles per (vector, key)",
            "instructions": f"exact guest instruction count of one sa_dense_decode (1 thread, "
                            f"1 KV head, {N_TRACE} tokens, after a warm-up call), split by the "
                            "functions each traced kernel call ran; qemu -cpu cortex-a76 for "
                            "both Arm ISAs",
            "corrections": "the instruction forms LLVM's tables price otherwise than Arm's "
                           "optimisation guides are replaced in the trace fed to llvm-mca by "
                           "stand-ins LLVM prices as the guide does (guide_corrections: each "
                           "form, LLVM's figures, the guide's row, the stand-in as LLVM prices "
                           "it); llvm_raw_* is llvm-mca over the trace as compiled",
            "calibration": "a check of the method, not applied to the Arm figures: the same "
                           "trace + llvm-mca over the AVX2 build (traced under qemu-x86_64 -cpu "
                           "max) against this host's in-cache single-thread time of the same "
                           "calls",
            "limits": [
                "llvm-mca: every load hits L1, branches are predicted perfectly, no "
                "instruction-fetch or decode limits beyond the model's dispatch width",
                "Neoverse N1 is a stand-in for the A76 (close relatives, not the same "
                "core); N2 is wider than the A76 (optimistic); llvm-16's neoverse-n1 and "
                "cortex-a76 are Cortex-A57 tables (pessimistic)",
                "nothing checks the Arm models against Arm silicon; the host's factor checks "
                "the method on an x86 core against LLVM's model of that core, whose own "
                "errors (not the Arm tables') it measures, so it is reported, not applied",
                "one call of 32 rows (rows 32..63) stands for every call; the step's first "
                "and last calls and the short tail are not modelled separately",
                "the step assumes perfect scaling over 4 cores and full overlap of compute "
                "and memory; the DRAM bandwidths are reviews' figures, not measured here",
                "the A55 is in-order: llvm-mca's in-order model issues two instructions a "
                "cycle and stalls on latencies; its dot-product and multiply-accumulate "
                "chains stay at 4 cycles where the guide forwards the accumulator in 1"
            ],
        },
        "qemu_instruction_counts": counts,
        "llvm_mca": cycles,
        "guide_corrections": corrections,
        "calibration_x86": calib,
        "predicted_step": predict_step(cycles, counts, a76_model,
                                       [k for k in keys if k != a76_model and
                                        k.split("@")[0] in ("neoverse-n1", "neoverse-n2")]),
        "seconds": round(time.time() - t0, 1),
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


def print_summary(r):
    print(f"arm_model: {r['machine']['host']}; {', '.join(r['machine']['llvm_mca'])}")
    for key, g in (r.get("guide_corrections") or {}).items():
        print(f"\n{key}: instruction forms priced as Arm's guide does (LLVM's cost -> guide's):")
        for c in g["corrected"]:
            print(f"  {c['form']:58s} lat {c['llvm']['latency']}, "
                  f"{c['llvm']['cycles_per_instruction']:g} cyc -> lat "
                  f"{c['guide']['latency']}, {c['guide']['cycles_per_instruction']:g} cyc")
    print("\nllvm-mca, cycles per token and KV head (scores / V / softmax), KV bytes per cycle "
          "(raw: llvm-mca over the trace as compiled):")
    print(f"  {'model':22s} {'isa':13s} {'G':>2s} {'D':>4s} {'scores':>7s} {'V':>7s} "
          f"{'softmax':>7s} {'B/cyc':>6s} {'bound':>7s} {'raw':>6s}")
    for c in r["llvm_mca"] + ((r["calibration_x86"] or {}).get("llvm_mca") or []):
        y = c["cycles_per_token_kv_head"]
        raw = c.get("llvm_raw_bytes_per_cycle")
        print(f"  {c['model']:22s} {c['isa']:13s} {c['G']:2d} {c['D']:4d} {y['scores']:7.1f} "
              f"{y['v']:7.1f} {y['softmax']:7.1f} {c['bytes_per_cycle']['total']:6.3f} "
              f"{c['resource_bound_cycles_per_token_kv_head']['total']:7.1f}" +
              (f" {raw:6.3f}" if raw else ""))
    print("\nqemu, instructions per KV byte (scores / V / softmax / other = total):")
    for c in r["qemu_instruction_counts"] + ((r["calibration_x86"] or {})
                                             .get("qemu_instruction_counts") or []):
        i = c["instructions_per_kv_byte"]
        print(f"  {c['isa']:13s} G={c['G']} D={c['D']:3d}  {i['scores']:.3f} / {i['v']:.3f} / "
              f"{i['softmax']:.3f} / {i['other']:.3f} = {i['total']:.3f}")
    cal = r["calibration_x86"]
    if cal:
        print(f"\nthe method checked on this host ({cal['isa']}, clock {cal['clock_ghz']['used']} "
              f"GHz [{cal['clock_ghz']['min']}-{cal['clock_ghz']['max']}]; not applied to the "
              "Arm figures): measured B/cyc [range], then measured/predicted per model")
        for i, m in enumerate(cal["measured"]):
            fs = "  ".join(f"{k}: {v['shapes'][i]['factor']['total']}"
                           for k, v in cal["factors"].items())
            b = m["bytes_per_cycle"]
            print(f"  G={m['G']} D={m['D']:3d}  {b['total']:.3f} [{b['total_range'][0]:.3f}-"
                  f"{b['total_range'][1]:.3f}]  {fs}")
        f = cal["factor"]
        if f:
            print(f"  factor ({cal['host_model']}): {f['min']} .. {f['max']} (median {f['median']})")
    p = r["predicted_step"]
    if p:
        fl = ", ".join(f"{ms} ms at {bw:g}" for bw, ms in zip(p["floor_ms"]["at_GBps"],
                                                             p["floor_ms"]["ms"]))
        print(f"\nRK3588 step ({p['case']['model']}, {p['case']['tokens']} tokens, "
              f"{p['case']['layers']} layers, {p['kv_bytes'] / 1e6:.0f} MB, {p['case']['isa']}): "
              f"memory floor {fl} GB/s")
        rows = [("4x A76", p["a76_x4"])] + \
               [(f"4x A76 as {k}", v) for k, v in p["a76_x4_other_models"].items()] + \
               [("1x A55", p["a55_x1"])]
        for label, c in rows:
            if c:
                print(f"  {label:34s} {c['model']:22s} {c['bytes_per_cycle_per_core']:.3f} "
                      f"B/cyc/core, {c['model_ms']} ms of compute" +
                      (f" (llvm-mca raw {c['llvm_raw_ms']} ms)" if c.get("llvm_raw_ms") else ""))
        if "a76_x4_bound" in p:
            print(f"  {p['a76_x4_bound']}")
        pf = p.get("prefill")
        if pf:
            print(f"  exact q8 prefill of the prompt's attention ({pf['vector_key_pairs']:.3g} "
                  "(vector, key) pairs), cycles per pair scores + softmax + V:")
            for label, c in (("4x A76", pf["a76_x4"]), ("1x A55", pf["a55_x1"])):
                if c:
                    y = c["cycles_per_vector_key"]
                    print(f"  {label:34s} {c['model']:22s} {y['scores']:.2f} + {y['softmax']:.2f}"
                          f" + {y['v']:.2f} = {y['total']:.2f}, {c['model_ms']} ms")
    print(f"\n({r['seconds']} s)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (e.g. docs/results/arm-model.json)")
    ap.add_argument("--quick", action="store_true",
                    help="one shape (G=2, D=128), neon-dotprod, the N1 model (llvm-19's if "
                         "installed, and llvm-16's) and cortex-a55, no x86 check")
    ap.add_argument("--repeats", type=int, default=5, help="x86 timing runs per shape")
    ap.add_argument("--keep", help="build here and keep it (default: a temporary directory)")
    a = ap.parse_args(argv)
    r = run(quick=a.quick, json_path=a.json, repeats=a.repeats, keep=a.keep)
    print_summary(r)


if __name__ == "__main__":
    main()

/*
 * Which of the AVX2 decode kernels' instructions compete for the same
 * execution pipes on this x86 core: each instruction's throughput alone
 * (12 independent copies in flight), then every pair interleaved 6 + 6.
 * Two instructions whose pair takes about the sum of their times alone
 * share pipes; a pair that takes about the slower one's time does not.
 *
 * What it is for: dense q8 decode on AVX2 spends its time in q8 scores
 * (vpabsb, vpsignb, vpmaddubsw, vpmaddwd per 32 bytes of K and head, then
 * an unpack/shuffle/add reduction and the group term's vcvtdq2ps and
 * vmulps) and q8 V (vpmovsxbd, vcvtdq2ps, one vfmadd231ps per head and 8
 * values).  Counting those instructions per token against the pipes they
 * share gives the arithmetic's lower bound on this core, without trusting
 * a static model's port tables (docs/results.md, "What bounds these
 * figures").  Cycles use the core clock measured by a dependent add chain
 * (one cycle per add), as bench/arm_model.py does; no perf counters needed.
 *
 * Build and run (x86-64 with AVX2 and FMA):
 *
 *   cc -O2 bench/x86_pipes.c -o x86_pipes && ./x86_pipes [rounds]
 */
#define _DEFAULT_SOURCE
#include <stdio.h>
#include <stdlib.h>

#include "bench_clock.h"

#if !defined(__x86_64__)
int main(void)
{
    fprintf(stderr, "x86_pipes: x86-64 only\n");
    return 2;
}
#else

#define N_OPS 14

/* Each instruction as an assembler template for destination register D
 * (ymm0 .. ymm11); sources are ymm14/ymm15 (xmm15 for the widening load
 * form), which nothing writes, so copies never wait on each other (the FMA
 * adds into its destination: 12 chains, more than its latency times its
 * rate).  Every register starts as 1.0f, so no float input is subnormal. */
#define DST(d) "%%ymm" #d
#define SRC3(op, d) op " %%ymm15, %%ymm14, " DST(d) "\n"
#define SRC2(op, d) op " %%ymm15, " DST(d) "\n"

#define T_SIGN(d) SRC3("vpsignb", d)
#define T_MADDUBS(d) SRC3("vpmaddubsw", d)
#define T_MADD(d) SRC3("vpmaddwd", d)
#define T_ABS(d) SRC2("vpabsb", d)
#define T_PADD(d) SRC3("vpaddd", d)
#define T_UNPACK(d) SRC3("vpunpcklqdq", d)
#define T_SHUFPS(d) "vshufps $0x88, %%ymm15, %%ymm14, " DST(d) "\n"
#define T_PERM(d) "vperm2i128 $0x20, %%ymm15, %%ymm14, " DST(d) "\n"
#define T_SXBD(d) "vpmovsxbd %%xmm15, " DST(d) "\n"
#define T_CVT(d) SRC2("vcvtdq2ps", d)
#define T_FMA(d) "vfmadd231ps %%ymm15, %%ymm14, " DST(d) "\n"
#define T_MUL(d) SRC3("vmulps", d)
#define T_ADD(d) SRC3("vaddps", d)
#define T_LOADB(d) "vbroadcastss (%1), " DST(d) "\n"

/* 6 of A into ymm0-5 and 6 of B into ymm6-11, interleaved. */
#define MIX(A, B) A(0) B(6) A(1) B(7) A(2) B(8) A(3) B(9) A(4) B(10) A(5) B(11)

static const char *const names[N_OPS] = {
    "vpsignb", "vpmaddubsw", "vpmaddwd", "vpabsb", "vpaddd", "vpunpcklqdq", "vshufps",
    "vperm2i128", "vpmovsxbd", "vcvtdq2ps", "vfmadd231ps", "vmulps", "vaddps", "vbroadcastss(m)",
};

static float src_mem[8] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1};

/* Every register the templates use set to src_mem's 1.0f. */
#define B1(d) "vbroadcastss (%1), %%ymm" #d "\n"
#define INIT B1(0) B1(1) B1(2) B1(3) B1(4) B1(5) B1(6) B1(7) B1(8) B1(9) B1(10) B1(11) B1(14) B1(15)

/* Seconds for n iterations of 4 blocks of MIX(A, B) (48 instructions). */
#define RUN(A, B)                                                                           \
    static double run_##A##_##B(long n)                                                     \
    {                                                                                       \
        double t0 = bench_now();                                                            \
        __asm__ volatile(INIT "1:\n" MIX(A, B) MIX(A, B) MIX(A, B) MIX(A, B)                 \
                         "dec %0\njnz 1b\n"                                                  \
                         : "+r"(n)                                                          \
                         : "r"(src_mem)                                                     \
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",  \
                           "xmm8", "xmm9", "xmm10", "xmm11", "xmm14", "xmm15", "memory",    \
                           "cc");                                                           \
        return bench_now() - t0;                                                            \
    }

/* Every ordered pair (i <= j) of the table's templates. */
#define FOR_B(A)                                                                                \
    X(A, T_SIGN) X(A, T_MADDUBS) X(A, T_MADD) X(A, T_ABS) X(A, T_PADD) X(A, T_UNPACK)          \
    X(A, T_SHUFPS) X(A, T_PERM) X(A, T_SXBD) X(A, T_CVT) X(A, T_FMA) X(A, T_MUL) X(A, T_ADD)   \
    X(A, T_LOADB)
#define FOR_ALL                                                                                 \
    FOR_B(T_SIGN) FOR_B(T_MADDUBS) FOR_B(T_MADD) FOR_B(T_ABS) FOR_B(T_PADD) FOR_B(T_UNPACK)    \
    FOR_B(T_SHUFPS) FOR_B(T_PERM) FOR_B(T_SXBD) FOR_B(T_CVT) FOR_B(T_FMA) FOR_B(T_MUL)         \
    FOR_B(T_ADD) FOR_B(T_LOADB)

#define X(A, B) RUN(A, B)
FOR_ALL
#undef X

typedef double (*run_fn)(long);
#define X(A, B) run_##A##_##B,
static const run_fn runs[N_OPS * N_OPS] = {FOR_ALL};
#undef X

/* Cycles per nanosecond: chains of dependent 64-bit adds, one per cycle. */
static double ghz(void)
{
    const long n = 50000000;
    double best = 0;
    for (int r = 0; r < 3; r++) {
        long left = n, x = 0;
        const double t0 = bench_now();
        __asm__ volatile("1:\n"
                         "add $1, %1\nadd $1, %1\nadd $1, %1\nadd $1, %1\n"
                         "add $1, %1\nadd $1, %1\nadd $1, %1\nadd $1, %1\n"
                         "dec %0\njnz 1b\n"
                         : "+r"(left), "+r"(x)
                         :
                         : "cc");
        const double g = 8.0 * (double)n / ((bench_now() - t0) * 1e9);
        if (g > best)
            best = g;
    }
    return best;
}

/* Best of `rounds` timings, in cycles per instruction. */
static double cycles_per_insn(int a, int b, long n, long rounds, double g)
{
    double best = 1e30;
    for (long r = 0; r < rounds; r++) {
        double s = runs[a * N_OPS + b](n);
        if (s < best)
            best = s;
    }
    return best * 1e9 * g / (48.0 * (double)n);
}

int main(int argc, char **argv)
{
    char *end = NULL;
    const long rounds = argc > 1 ? strtol(argv[1], &end, 10) : 3;
    if (argc > 2 || (argc > 1 && (end == argv[1] || *end)) || rounds < 1 || rounds > 1000) {
        fprintf(stderr, "usage: x86_pipes [rounds 1..1000]\n");
        return 2;
    }
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        fprintf(stderr, "x86_pipes: this CPU lacks AVX2 or FMA\n");
        return 2;
    }
    const long n = 2000000;
    const double g = ghz();
    printf("x86_pipes: core clock %.2f GHz (dependent adds); best of %ld rounds\n\n", g, rounds);
    double alone[N_OPS];
    printf("alone: instructions per cycle (12 independent copies)\n");
    for (int i = 0; i < N_OPS; i++) {
        alone[i] = 1.0 / cycles_per_insn(i, i, n, rounds, g);
        printf("  %-16s %5.2f\n", names[i], alone[i]);
    }
    printf("\npairs: cycles for 6 + 6 interleaved, against the slower alone (separate pipes)\n"
           "and the sum alone (shared pipes); 'shared' when nearer the sum\n");
    for (int i = 0; i < N_OPS; i++)
        for (int j = i + 1; j < N_OPS; j++) {
            const double c = 12.0 * cycles_per_insn(i, j, n, rounds, g);
            const double sep = 6.0 / (alone[i] < alone[j] ? alone[i] : alone[j]);
            const double sum = 6.0 / alone[i] + 6.0 / alone[j];
            printf("  %-16s + %-16s %5.2f  (separate %5.2f, shared %5.2f)  %s\n", names[i],
                   names[j], c, sep, sum, c - sep > sum - c ? "shared" : "separate");
        }
    return 0;
}
#endif

/*
 * The x86 decode kernels' prefetch walks issue every line of their hint.
 *
 * A decode kernel given a prefetch hint (sa_prefetch: the rows the next call
 * will read) announces how many steps it will take (sa_pf_walk_start) and
 * steps in its loops; each step issues its even share of the hint's lines
 * (kernels.h).  If the announced count and the steps taken disagree, no
 * result changes, but lines are left to the hardware (fewer steps taken
 * than announced) or issued ahead of their share (more): a count that
 * drifted from a kernel's loops would show only as a slower step from
 * DRAM.  So this
 * harness includes one kernel file with SA_PREFETCH_LINE counting the lines
 * it issues, calls the file's scores and V kernels (float32 and q8) with a
 * hint over shapes around their blocks and tiles (head counts, head sizes,
 * q8 groups, token counts), and checks each issued exactly the hint's
 * lines.
 *
 * Built and run by scripts/test-c.sh for each x86 kernel file the CPU can
 * run, e.g.
 *
 *   cc -O1 -Icsrc -DSA_TEST_COUNT_PREFETCH -DSA_WALK_FILE='"x86/kernels_avx2.c"' \
 *      -DSA_WALK_CPU='"avx2"' tests/c/test_walk_lines.c \
 *      csrc/portable/kernels_portable.c csrc/common.c -o test_walk_lines -lm
 *
 * (SA_WALK_CPU: the feature __builtin_cpu_supports must report for the
 * file's kernels to run here; without it the test skips.)
 */
#include <stddef.h>
#include <stdint.h>

/* Every prefetch of the kernels counted, those of the portable kernels the
 * file falls back to included: every file is compiled with
 * SA_TEST_COUNT_PREFETCH (kernels.h), so SA_PREFETCH_LINE calls this. */
static long walk_lines;

#include SA_WALK_FILE

/* (defined after the file, under its target and optimisation pragmas, as
 * kernels.h declared it) */
void sa_test_line(const void *p)
{
    (void)p;
    walk_lines++;
}

#include <stdio.h>
#include <stdlib.h>

#define SA_STR(x) #x
#define SA_XSTR(x) SA_STR(x)

/* The lines sa_pf_walk_start counts for the hint's ranges. */
static long hint_lines(const sa_prefetch *pf)
{
    long lines = 0;
    for (int r = 0; r < 4; r++)
        if (pf->len[r])
            lines += (long)((((uintptr_t)pf->at[r] & 63) + pf->len[r] + 63) / 64);
    return lines;
}

static long n_cases, n_failed;

static void expect_lines(const char *kernel, int G, int D, int gs, int n, const sa_prefetch *pf)
{
    const long want = hint_lines(pf);
    n_cases++;
    if (walk_lines != want) {
        if (n_failed++ < 20)
            printf("FAIL %s G=%d D=%d gs=%d n=%d: issued %ld lines of the hint's %ld\n", kernel,
                   G, D, gs, n, walk_lines, want);
    }
}

int main(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports(SA_WALK_CPU)) {
        printf("%s: this CPU lacks %s, skipped\n", SA_XSTR(SA_ISA_ID), SA_WALK_CPU);
        return 0;
    }
    static const int HEADS[] = {1, 2, 3, 4, 5, 6, 7, 8, 11, 15};
    static const int DIMS[][2] = {{32, 32}, {64, 32}, {128, 32}, {96, 32}, {256, 32},
                                  {1024, 32}, {48, 16}, {80, 16}, {64, 8}, {40, 8},
                                  {128, 64}, {192, 64}, {16, 8}, {24, 8}};
    static const int TOKENS[] = {1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 100};
    enum { MAX_G = 16, MAX_N = 100, MAX_D = 1024 };
    const sa_kernels *kern = &SA_CAT(sa_kernels, SA_ISA_ID); /* the file's table */
    int8_t *q8 = calloc((size_t)MAX_N * MAX_D, 1), *qq = calloc((size_t)MAX_G * MAX_D, 1);
    float *f = calloc((size_t)MAX_N * MAX_D, sizeof(float));
    float *sc = calloc((size_t)MAX_N * MAX_D, sizeof(float));
    float *q = calloc((size_t)MAX_G * MAX_D, sizeof(float));
    float *qd = calloc((size_t)MAX_G * MAX_D, sizeof(float));
    float *rows[MAX_G];
    const float *cp[MAX_G];
    for (int g = 0; g < MAX_G; g++) {
        rows[g] = calloc(MAX_D > MAX_N ? MAX_D : MAX_N, sizeof(float));
        cp[g] = rows[g];
    }
    /* the hint's ranges, at odd offsets so a range's first and last lines
     * are partial (never read: only counted) */
    static char next_rows[4][1 << 20];
    for (size_t i = 0; i < (size_t)MAX_N * MAX_D; i++)
        sc[i] = 1.0f;
    for (size_t a = 0; a < sizeof HEADS / sizeof *HEADS; a++)
        for (size_t b = 0; b < sizeof DIMS / sizeof *DIMS; b++)
            for (size_t c = 0; c < sizeof TOKENS / sizeof *TOKENS; c++) {
                const int G = HEADS[a], D = DIMS[b][0], gs = DIMS[b][1], n = TOKENS[c];
                const int ng = D / gs;
                const sa_prefetch f32_hint = {{next_rows[0] + 5}, {(size_t)n * D * 4}};
                const sa_prefetch q8_hint = {{next_rows[1] + 17, next_rows[2] + 3},
                                             {(size_t)n * D, (size_t)n * ng * 4}};
                walk_lines = 0;
                kern->scores_f32(q, G, D, f, D, n, rows, &f32_hint);
                expect_lines("scores_f32", G, D, 0, n, &f32_hint);
                walk_lines = 0;
                kern->accumulate_v_f32(rows, cp, G, D, f, D, n, &f32_hint);
                expect_lines("accumulate_v_f32", G, D, 0, n, &f32_hint);
                walk_lines = 0;
                kern->scores_q8(qq, qd, G, D, gs, q8, sc, D, ng, n, rows, &q8_hint);
                expect_lines("scores_q8", G, D, gs, n, &q8_hint);
                walk_lines = 0;
                kern->accumulate_v_q8(rows, cp, G, D, gs, q8, sc, D, ng, n, &q8_hint);
                expect_lines("accumulate_v_q8", G, D, gs, n, &q8_hint);
            }
    printf("%s: %ld kernel calls, %ld issued other than their hint's lines\n",
           SA_XSTR(SA_ISA_ID), n_cases, n_failed);
    for (int g = 0; g < MAX_G; g++)
        free(rows[g]);
    free(q8), free(qq), free(f), free(sc), free(q), free(qd);
    return n_failed ? 1 : 0;
}

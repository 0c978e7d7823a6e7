/*
 * C harness: every ISA kernel table this CPU can run against the portable
 * one, the public API end to end on every ISA, and argument rejection.
 *
 *   test_kernels [--expect-isa NAME] [--only-isa A,B,...] [--threads-only]
 *
 * --only-isa A,B,... tests those ISAs' kernels and end-to-end results
 * (against portable, which serves as the reference and is tested only if
 * named) and skips the other ISAs; the ISA-independent checks still run.
 * CI uses it where a run on another CPU model, or under UBSan on Arm, adds
 * some ISAs, not all.
 *
 * Prints the default ISA, one line per failing check, and last a line
 * "N passed, N failed"; exits 0 only if nothing failed.  Built and run by
 * scripts/test-c.sh (natively under ASan/UBSan, and for aarch64 under
 * qemu-user with a CPU that has dotprod and one that has not).
 *
 * Two kinds of comparison:
 *  - bitwise, wherever the project promises it: a kernel's result for one
 *    (head, token) pair must not depend on the batch it came in (kernels.h),
 *    threads 1/2/3 agree, sparse decode with every block chosen equals dense
 *    decode, a prefill row equals dense decode at that position (spec §5);
 *  - within float rounding against the portable path (spec §5 agreement),
 *    with the tolerances below.  Selections must be identical.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The prefetch walk's lines, recorded (test_prefetch_walk). */
static const void *walk_lines[4096];
static int walk_count;
#define SA_PREFETCH_LINE(p) (walk_count < 4096 ? (void)(walk_lines[walk_count++] = (p)) : (void)0)

#include "kernels.h"
#include "sparse_attn.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#include <sys/mman.h>
#include <unistd.h>
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* ---- tolerances (float rounding only) ------------------------------ */
/* Each can be overridden with -D; building with them at 0 prints every
 * error, which is how the margins were measured (worst seen on x86 and
 * under qemu-aarch64: 6e-7 against the 1e-5 below, exp 1.77 ulp). */

/* Kernel level, per element: |isa - portable| <= TOL * magnitude, where the
 * magnitude is the same sum taken over absolute values (sum |q_i k_i| for a
 * dot, |out0| + sum |p_t v_t| for V accumulation).  Rounding error scales
 * with that, not with the possibly cancelled result.  Integer group sums
 * are exact in q8, so only the scale products and float sums differ. */
#ifndef TOL_DOT_F32
#define TOL_DOT_F32 1e-5
#endif
#ifndef TOL_DOT_Q8
#define TOL_DOT_Q8 1e-5
#endif
#ifndef TOL_ACCUM
#define TOL_ACCUM 1e-5
#endif
/* softmax_exp, per weight: relative TOL_SOFTMAX, plus what rounding the
 * argument scale*s - scale*max can cost (a few ulps of scale*|s| and
 * scale*|max|; one path may fuse it into an fma, the other not), plus
 * FLT_MIN for results below the normal range.  The sum: the sum of those. */
#ifndef TOL_SOFTMAX
#define TOL_SOFTMAX 1e-5
#endif
#ifndef SOFTMAX_ARG_ULPS
#define SOFTMAX_ARG_ULPS 2.0
#endif
/* The vectorised exp itself, against exp() in double. */
#ifndef EXP_MAX_ULP
#define EXP_MAX_ULP 2.0
#endif
/* End to end, normwise relative (spec §5: 1e-5 for float32 KV; q8 KV is
 * quantised identically on every path, so the same holds). */
#ifndef TOL_E2E
#define TOL_E2E 1e-5
#endif

/* ---- checks ---------------------------------------------------------- */

static long n_passed, n_failed;
static char where[200] = "setup";

static int check(int ok, const char *fmt, ...)
{
    if (ok) {
        n_passed++;
        return 1;
    }
    n_failed++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL [%s] ", where);
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    fflush(stdout);
    return 0;
}

static void set_where(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(where, sizeof where, fmt, ap);
    va_end(ap);
}

/* ---- random data ------------------------------------------------------ */

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint64_t next_u64(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }

/* Box-Muller, both values used (the harness makes a lot of data, and under
 * qemu making it costs more than testing it). */
static float gauss(void)
{
    static int have;
    static double spare;
    if (have) {
        have = 0;
        return (float)spare;
    }
    const double u1 = 1.0 - uniform(), u2 = 6.283185307179586 * uniform();
    const double r = sqrt(-2.0 * log(u1));
    spare = r * sin(u2);
    have = 1;
    return (float)(r * cos(u2));
}


static void fill_gauss(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = gauss();
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "test_kernels: out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- kernel operands ------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__)
/* ASan watches every byte of a malloc'd block. */
static void *operand_alloc(size_t n) { return xmalloc(n); }
static void operand_free(void *p) { free(p); }
#else
/* Without ASan (the aarch64 runs under qemu) an operand ends exactly where
 * an inaccessible page begins, so a kernel that reads or writes past the
 * end of its last row or output faults instead of passing. */
enum { MAX_GUARDED = 512 };
static struct {
    char *user, *base;
    size_t total;
} guarded[MAX_GUARDED];

static void *operand_alloc(size_t n)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t body = (n + page - 1) / page * page, total = body + page;
    char *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || mprotect(base + body, page, PROT_NONE) != 0) {
        fprintf(stderr, "test_kernels: mmap/mprotect failed\n");
        exit(2);
    }
    for (int i = 0; i < MAX_GUARDED; i++)
        if (!guarded[i].base) {
            guarded[i].user = base + body - n;
            guarded[i].base = base;
            guarded[i].total = total;
            return guarded[i].user;
        }
    fprintf(stderr, "test_kernels: too many guarded operands\n");
    exit(2);
}

static void operand_free(void *p)
{
    for (int i = 0; i < MAX_GUARDED; i++)
        if (guarded[i].base && guarded[i].user == p) {
            munmap(guarded[i].base, guarded[i].total);
            guarded[i].base = NULL;
            return;
        }
    fprintf(stderr, "test_kernels: freeing an unknown operand\n");
    exit(2);
}
#endif

/* ---- strided operands ------------------------------------------------ */

/* n rows of `width` elements, `stride` elements apart: exactly the bytes up
 * to the end of the last row are allocated (a read past it is caught), and
 * under ASan the gaps between rows are poisoned too, so a kernel that
 * touches anything but rows t < n, columns d < width is caught. */
typedef struct {
    char *base;
    size_t elem, bytes;
    int n, width;
    ptrdiff_t stride;
} strided;

static strided strided_new(size_t elem, int n, int width, ptrdiff_t stride)
{
    strided s = {NULL, elem, 0, n, width, stride};
    s.bytes = ((size_t)(n - 1) * (size_t)stride + (size_t)width) * elem;
    s.base = operand_alloc(s.bytes);
    return s;
}

/* Random contents for the rows (the gaps are never read). */
static void strided_fill_gauss(strided *s)
{
    for (int t = 0; t < s->n; t++)
        fill_gauss((float *)s->base + t * s->stride, (size_t)s->width);
}

static void strided_poison(strided *s)
{
    for (int t = 0; t + 1 < s->n; t++)
        POISON(s->base + ((size_t)t * s->stride + s->width) * s->elem,
               (size_t)(s->stride - s->width) * s->elem);
}

static void strided_free(strided *s)
{
    UNPOISON(s->base, s->bytes);
    operand_free(s->base);
}

/* G separately allocated rows of len floats (writes past len are caught). */
static float **rows_new(int G, int len)
{
    float **r = xmalloc((size_t)G * sizeof *r);
    for (int g = 0; g < G; g++)
        r[g] = operand_alloc((size_t)len * sizeof(float));
    return r;
}

static void rows_free(float **r, int G)
{
    for (int g = 0; g < G; g++)
        operand_free(r[g]);
    free(r);
}

/* ---- shared case lists ------------------------------------------------ */

/* 192: six groups of 32 (a run of four, then two), three of 64, eight of
 * 24 (NEON dotprod's q8 panels take a group's channels 16 at a time, then
 * 4: 24 is one of each) and four of 48 (NEON's q8 V for one or two heads
 * takes 32 columns of a group at a time, then 16) */
static const int DIMS[] = {1, 3, 8, 16, 31, 64, 67, 128, 192, 256};
static const int GROUPS[] = {1, 3, 8, 16, 24, 32, 48, 64, 128};
/* 17: four blocks of 4 heads and one; two 6-head wide V tiles, a block of
 * 4 (AVX-512; AVX2: two pairs) and one, in V's 32-token blocks for many
 * heads; 8: a wide tile and a pair (x86_common.h); 3 and 7: q8 V's block
 * of three heads after the blocks of 4 (AVX-512; AVX2: a pair and one) */
static const int HEADS[] = {1, 2, 3, 4, 7, 8, 17};
static const int TOKENS[] = {1, 2, 7, 8, 9, 31, 32, 33, 100};
static const int STRIDE_ROWS[] = {1, 5}; /* row_stride = D or 5*D */
#define LEN(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* q8 value patterns, all within spec §4's [-127, 127] (the x86 kernels rely
 * on it: they take |k| and sign(q, k), which -128 breaks): random, then the
 * extremes: every value +-127 with random signs, and every value 127 in q
 * against +-127 rows. */
enum { Q8_RANDOM, Q8_PM127, Q8_ALL127, Q8_MODES };
static const char *const Q8_MODE_NAME[] = {"random", "+-127", "all 127"};

static void fill_q8(int8_t *x, size_t n, int mode, int is_query)
{
    uint64_t bits = 0;
    for (size_t i = 0; i < n; i++) {
        if (i % 8 == 0)
            bits = next_u64();
        const int8_t byte = (int8_t)(bits >> (8 * (i % 8)));
        if (mode == Q8_RANDOM)
            x[i] = byte == -128 ? 0 : byte;
        else if (mode == Q8_PM127 || !is_query)
            x[i] = byte < 0 ? -127 : 127;
        else
            x[i] = 127;
    }
}

static void fill_scales(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(0.001 + 0.05 * uniform());
}

static void strided_fill_scales(strided *s)
{
    for (int t = 0; t < s->n; t++)
        fill_scales((float *)s->base + t * s->stride, (size_t)s->width);
}

static void strided_fill_q8(strided *s, int mode)
{
    for (int t = 0; t < s->n; t++)
        fill_q8((int8_t *)s->base + t * s->stride, (size_t)s->width, mode, 0);
}

/* ====================================================================== */
/* Kernel tables against the portable one                                 */
/* ====================================================================== */

static const sa_kernels *const REF = &sa_kernels_portable;

/* One shape of the kernel tests.  kcase_next walks DIMS x GROUPS (q8 and
 * minmax only, where the group size divides D) x HEADS x TOKENS x
 * STRIDE_ROWS, the last fastest; start from kcase c = {0}. */
typedef struct {
    int D, gs, ng, G, n; /* gs, ng: 0 without groups */
    ptrdiff_t rs, ss;    /* row stride, scale-row stride (elements) */
    int strided;         /* rows farther apart than D */
    int head_i;          /* index of G in HEADS */
    int at;              /* position in the walk */
} kcase;

static int kcase_next(kcase *c, int with_groups)
{
    const int nf = with_groups ? LEN(GROUPS) : 1;
    while (c->at < LEN(DIMS) * nf * LEN(HEADS) * LEN(TOKENS) * LEN(STRIDE_ROWS)) {
        int i = c->at++;
        const int e = i % LEN(STRIDE_ROWS), t = (i /= LEN(STRIDE_ROWS)) % LEN(TOKENS);
        const int h = (i /= LEN(TOKENS)) % LEN(HEADS), f = (i /= LEN(HEADS)) % nf;
        c->D = DIMS[i / nf], c->G = HEADS[h], c->n = TOKENS[t], c->head_i = h;
        c->gs = with_groups ? GROUPS[f] : 0;
        if (c->gs && c->D % c->gs)
            continue;
        c->ng = c->gs ? c->D / c->gs : 0;
        c->strided = e > 0;
        c->rs = (ptrdiff_t)STRIDE_ROWS[e] * c->D, c->ss = (ptrdiff_t)STRIDE_ROWS[e] * c->ng;
        return 1;
    }
    return 0;
}

/* n q8 rows of width D and their scale rows, strided as c says, filled
 * (values in `mode`) and their gaps poisoned. */
static void q8_rows_new(const kcase *c, int n, int mode, strided *x, strided *xd)
{
    *x = strided_new(1, n, c->D, c->rs), *xd = strided_new(sizeof(float), n, c->ng, c->ss);
    strided_fill_q8(x, mode);
    strided_fill_scales(xd);
    strided_poison(x), strided_poison(xd);
}

/* The two verdicts of a kernel test: the worst error against the portable
 * kernel, relative to the magnitude, within tol; and a result computed
 * `alone` (one head, one token or block) bitwise the batched one. */
static void check_kernel(const char *what, double worst, double tol, int same, const char *alone)
{
    check(worst <= tol, "%s: error %.3g of magnitude > %.1g", what, worst, tol);
    check(same, "%s: %s differs bitwise from the batched call", what, alone);
}

/* sum_i |a[i] * b[i]|: the scale a float dot's rounding error is relative to. */
static double dot_magnitude(const float *a, const float *b, int D)
{
    double mag = 0.0;
    for (int i = 0; i < D; i++)
        mag += fabs((double)a[i] * b[i]);
    return mag;
}

static void test_scores_f32(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 0);) {
        const int D = c.D, G = c.G, n = c.n;
        const ptrdiff_t rs = c.rs;
        float *q = operand_alloc((size_t)G * D * sizeof(float));
        fill_gauss(q, (size_t)G * D);
        strided k = strided_new(sizeof(float), n, D, rs);
        strided_fill_gauss(&k);
        strided_poison(&k);
        const float *kf = (const float *)k.base;
        float **ref = rows_new(G, n), **got = rows_new(G, n);
        /* the hint names the operand's own rows: prefetching changes nothing */
        const sa_prefetch hint = {{(const char *)kf}, {(size_t)n * rs * sizeof(float)}};
        REF->scores_f32(q, G, D, kf, rs, n, ref, NULL);
        kern->scores_f32(q, G, D, kf, rs, n, got, &hint);

        double worst = 0.0;
        int same = 1;
        for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t++) {
                const double mag = dot_magnitude(q + g * D, kf + t * rs, D);
                const double err = fabs((double)got[g][t] - ref[g][t]);
                worst = fmax(worst, err / fmax(mag, DBL_MIN));
                /* The same pair alone: one head, one token. */
                float one, *op = &one;
                kern->scores_f32(q + g * D, 1, D, kf + t * rs, rs, 1, &op, NULL);
                same &= memcmp(&one, &got[g][t], sizeof one) == 0;
            }
        char what[120];
        snprintf(what, sizeof what, "scores_f32 D=%d G=%d n=%d stride=%tdD", D, G, n, rs / D);
        check_kernel(what, worst, TOL_DOT_F32, same, "a (head, token) pair scored alone");
        rows_free(ref, G), rows_free(got, G);
        strided_free(&k);
        operand_free(q);
    }
}

/* One scores_q8 case: against portable within TOL_DOT_Q8, and every
 * (head, token) bitwise its score computed alone. */
static void scores_q8_case(const sa_kernels *kern, kcase c, int mode)
{
    const int D = c.D, gs = c.gs, ng = c.ng, G = c.G, n = c.n;
    const ptrdiff_t rs = c.rs, ss = c.ss;
    int8_t *qq = operand_alloc((size_t)G * D);
    float *qd = operand_alloc((size_t)G * ng * sizeof(float));
    fill_q8(qq, (size_t)G * D, mode, 1);
    fill_scales(qd, (size_t)G * ng);
    strided k, kd;
    q8_rows_new(&c, n, mode, &k, &kd);
    const int8_t *kq = (const int8_t *)k.base;
    const float *ks = (const float *)kd.base;
    float **ref = rows_new(G, n), **got = rows_new(G, n);
    const sa_prefetch hint = {{(const char *)kq, (const char *)ks},
                              {(size_t)n * rs, (size_t)n * ss * sizeof(float)}};
    REF->scores_q8(qq, qd, G, D, gs, kq, ks, rs, ss, n, ref, NULL);
    kern->scores_q8(qq, qd, G, D, gs, kq, ks, rs, ss, n, got, &hint);

    double worst = 0.0;
    int same = 1;
    for (int g = 0; g < G; g++)
        for (int t = 0; t < n; t++) {
            double mag = 0.0;
            for (int grp = 0; grp < ng; grp++) {
                int64_t isum = 0;
                for (int i = grp * gs; i < (grp + 1) * gs; i++)
                    isum += (int64_t)qq[g * D + i] * kq[t * rs + i];
                mag += fabs((double)qd[g * ng + grp] * ks[t * ss + grp] * (double)isum);
            }
            const double err = fabs((double)got[g][t] - ref[g][t]);
            worst = fmax(worst, err / fmax(mag, DBL_MIN));
            float one, *op = &one;
            kern->scores_q8(qq + g * D, qd + g * ng, 1, D, gs, kq + t * rs, ks + t * ss,
                            rs, ss, 1, &op, NULL);
            same &= memcmp(&one, &got[g][t], sizeof one) == 0;
        }
    char what[120];
    snprintf(what, sizeof what, "scores_q8 D=%d gs=%d G=%d n=%d stride=%tdD %s", D, gs, G,
             n, rs / D, Q8_MODE_NAME[mode]);
    check_kernel(what, worst, TOL_DOT_Q8, same, "a (head, token) pair scored alone");
    rows_free(ref, G), rows_free(got, G);
    strided_free(&k), strided_free(&kd);
    operand_free(qq), operand_free(qd);
}

static void test_scores_q8(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 1);)
        for (int mode = 0; mode < Q8_MODES; mode++)
            if (mode == Q8_RANDOM || !c.strided) /* values and strides are independent */
                scores_q8_case(kern, c, mode);
    /* Prefill's many query vectors per K block (the AVX-512 path that
     * prepares each block once for all of them starts at 16; D up to 512,
     * its two layouts: gs 32 with D % 128 == 0, and any gs % 16 == 0; more
     * than 64 heads take the GEMM form's head chunks; AMX takes up to 6
     * groups of 16, 32, 48, 64 or a multiple of 64 bytes). */
    static const int MANY_DG[][2] = {{64, 32}, {128, 32}, {128, 16}, {192, 64},
                                     {512, 32}, {512, 128}, {528, 16},
                                     /* AMX: 48-byte tiles, 6 groups, a group
                                      * the tiles do not take (96) */
                                     {144, 48}, {384, 64}, {192, 96}};
    static const int MANY_G[] = {16, 17, 33, 70}, MANY_N[] = {1, 16, 37};
    for (int i = 0; i < LEN(MANY_DG); i++)
        for (int j = 0; j < LEN(MANY_G); j++)
            for (int t = 0; t < LEN(MANY_N); t++)
                for (int e = 0; e < 2; e++) {
                    const int D = MANY_DG[i][0], gs = MANY_DG[i][1];
                    const kcase c = {.D = D, .gs = gs, .ng = D / gs, .G = MANY_G[j],
                                     .n = MANY_N[t], .rs = (ptrdiff_t)(1 + e) * D,
                                     .ss = (ptrdiff_t)(1 + e) * (D / gs), .strided = e};
                    scores_q8_case(kern, c, e ? Q8_RANDOM : Q8_PM127);
                }
    /* Every head count to 9 (NEON's tiles take the first head as a constant
     * up to eight heads, in a copy per count; 5, 6 and 9 are not in HEADS)
     * at the group of 32 with D = 64 and 128 (NEON's copies with D constant)
     * and 96 (neither). */
    static const int EACH_D[] = {64, 96, 128}, EACH_N[] = {7, 33};
    for (int i = 0; i < LEN(EACH_D); i++)
        for (int G = 1; G <= 9; G++)
            for (int t = 0; t < LEN(EACH_N); t++)
                for (int e = 0; e < 2; e++) {
                    const int D = EACH_D[i];
                    const kcase c = {.D = D, .gs = 32, .ng = D / 32, .G = G, .n = EACH_N[t],
                                     .rs = (ptrdiff_t)(1 + 4 * e) * D,
                                     .ss = (ptrdiff_t)(1 + 4 * e) * (D / 32), .strided = e};
                    scores_q8_case(kern, c, e ? Q8_RANDOM : Q8_PM127);
                }
}

/* ulps between x and the double y, in units of the float spacing at y. */
static double ulp_error(float x, double y)
{
    const float yf = (float)y;
    const double spacing = (double)nextafterf(fabsf(yf), INFINITY) - fabsf(yf);
    return fabs((double)x - y) / spacing;
}

static void test_softmax(const sa_kernels *kern)
{
    static const int extra_n[] = {1000, 4099};
    static const float scales[] = {0.01f, 0.088388348f, 1.0f, 8.0f, 1000.0f};
    static const float spreads[] = {1.0f, 50.0f};
    for (int c = 0; c < LEN(TOKENS) + LEN(extra_n); c++)
    for (int a = 0; a < LEN(scales); a++)
    for (int b = 0; b < LEN(spreads); b++) {
        const int n = c < LEN(TOKENS) ? TOKENS[c] : extra_n[c - LEN(TOKENS)];
        float *x = xmalloc((size_t)n * sizeof(float)), *r = xmalloc((size_t)n * sizeof(float));
        float *y = operand_alloc((size_t)n * sizeof(float));
        float *y2 = operand_alloc((size_t)n * sizeof(float));
        const float offset = 3.0f * gauss();
        for (int t = 0; t < n; t++)
            x[t] = offset + spreads[b] * gauss();
        memcpy(r, x, (size_t)n * sizeof(float));
        memcpy(y, x, (size_t)n * sizeof(float));
        memcpy(y2, x, (size_t)n * sizeof(float));
        const float zr = REF->softmax_exp(r, n, scales[a], NULL);
        const float zy = kern->softmax_exp(y, n, scales[a], NULL);
        float mo = 0.0f;
        const float zy2 = kern->softmax_exp(y2, n, scales[a], &mo);
        float m = x[0];
        for (int t = 1; t < n; t++)
            m = x[t] > m ? x[t] : m;
        check(mo == m, "softmax_exp n=%d: max_out %g, the maximum is %g", n, mo, m);
        double worst = 0.0, allowed_sum = TOL_SOFTMAX * zr;
        for (int t = 0; t < n; t++) {
            const double arg = SOFTMAX_ARG_ULPS * FLT_EPSILON * scales[a] * (fabs(x[t]) + fabs(m));
            const double allowed = r[t] * (TOL_SOFTMAX + arg) + FLT_MIN;
            worst = fmax(worst, fabs((double)y[t] - r[t]) / allowed);
            allowed_sum += allowed;
        }
        const double zerr = fabs((double)zy - zr) / allowed_sum;
        check(worst <= 1.0 && zerr <= 1.0, "softmax_exp n=%d scale=%g spread=%g: weights off by "
              "%.3g, sum by %.3g of the allowed rounding", n, scales[a], spreads[b], worst, zerr);
        check(memcmp(y, y2, (size_t)n * sizeof(float)) == 0 && memcmp(&zy, &zy2, sizeof zy) == 0,
              "softmax_exp n=%d scale=%g: two identical calls differ", n, scales[a]);
        free(x), free(r), operand_free(y), operand_free(y2);
    }

    /* Equal scores: every weight is exactly 1 and the sum exactly n, for
     * every n across the runs the sum is taken in (a run of vectors in
     * float, then double): each score enters it once. */
    {
        static const int long_n[] = {4096 + 1, 100003};
        float *e = xmalloc(100003 * sizeof(float));
        for (int c = 0; c < 300 + LEN(long_n); c++) {
            const int n = c < 300 ? c + 1 : long_n[c - 300];
            for (int t = 0; t < n; t++)
                e[t] = -2.5f;
            const float z = kern->softmax_exp(e, n, 0.125f, NULL);
            int ones = 1;
            for (int t = 0; t < n; t++)
                ones &= e[t] == 1.0f;
            check(ones && z == (float)n,
                  "softmax_exp n=%d of equal scores: sum %.9g, weights all 1: %d", n, z, ones);
        }
        free(e);
    }

    /* The exp itself: with max 0 and scale 1 the argument is exactly s[t]. */
    enum { N_EXP = 4099 };
    float *s = xmalloc(N_EXP * sizeof(float)), *x = xmalloc(N_EXP * sizeof(float));
    s[0] = 0.0f;
    for (int t = 1; t < N_EXP; t++)
        s[t] = (float)(-87.3 * uniform());
    memcpy(x, s, N_EXP * sizeof(float));
    kern->softmax_exp(s, N_EXP, 1.0f, NULL);
    double worst = 0.0;
    int t_worst = 0;
    for (int t = 0; t < N_EXP; t++) {
        const double u = ulp_error(s[t], exp((double)x[t]));
        if (u > worst)
            worst = u, t_worst = t;
    }
    check(worst <= EXP_MAX_ULP, "softmax_exp: exp(%.9g) off by %.2f ulp (> %.0f)",
          x[t_worst], worst, EXP_MAX_ULP);

    /* Below the normal range: 0 or subnormal, never negative or NaN. */
    s[0] = 0.0f;
    for (int t = 1; t < N_EXP; t++)
        s[t] = (float)(-87.4 - 30.0 * uniform());
    kern->softmax_exp(s, N_EXP, 1.0f, NULL);
    int ok = s[0] == 1.0f;
    for (int t = 1; t < N_EXP; t++)
        ok &= s[t] >= 0.0f && s[t] < FLT_MIN;
    check(ok, "softmax_exp: arguments below -87.4 must give 0 or a subnormal");

    /* Huge negative arguments give exactly 0; the sum is exactly 1. */
    for (int n = 2; n <= 9; n++) {
        static const float big[] = {-1000.0f, -1e30f, -FLT_MAX, -200.0f};
        s[0] = 0.0f;
        for (int t = 1; t < n; t++)
            s[t] = big[t % 4];
        const float z = kern->softmax_exp(s, n, 1.0f, NULL);
        ok = s[0] == 1.0f && z == 1.0f;
        for (int t = 1; t < n; t++)
            ok &= s[t] == 0.0f;
        check(ok, "softmax_exp n=%d: huge negative arguments must give exactly 0", n);
    }

    /* No overflow for any finite scores and scale: exp(scale * (s - max)),
     * so scale * s beyond FLT_MAX still gives the weights 1 and 0. */
    for (int n = 2; n <= 19; n += 17) {
        for (int t = 0; t < n; t++)
            s[t] = t == n / 2 ? 1e30f : -1e30f * (float)(t + 1);
        const float z = kern->softmax_exp(s, n, 1e30f, NULL);
        ok = z == 1.0f;
        for (int t = 0; t < n; t++)
            ok &= s[t] == (t == n / 2 ? 1.0f : 0.0f);
        check(ok, "softmax_exp n=%d: scale 1e30 over scores of 1e30 gave sum %g", n, z);
    }

    /* A NaN score makes the sum NaN wherever it stands (never a dropped
     * token), on every ISA: in the short rows and in each of the running
     * maxima of the longer ones (four vectors a step). */
    static const int nan_n[] = {1, 7, 13, 19, 25, 31, 37, 64, 71, 100, 131, 257};
    for (int c = 0; c < LEN(nan_n); c++)
        for (int n = nan_n[c], at = 0; at < n; at += n > 60 ? n / 7 : n > 3 ? n / 3 : 1) {
            for (int t = 0; t < n; t++)
                s[t] = gauss();
            s[at] = NAN;
            float mo = 0.0f;
            const float z = kern->softmax_exp(s, n, 0.125f, &mo);
            check(isnan(z) && isnan(mo), "softmax_exp n=%d: a NaN score at %d gave the sum %g, "
                  "max_out %g", n, at, z, mo);
        }
    free(s), free(x);
}

/* The bandwidth probe's sum: the 64-bit wrapping sum of the words, from
 * any 8-byte offset, for lengths around every vector and unroll width. */
static void test_stream_sum(const sa_kernels *kern)
{
    enum { MAXW = 300 };
    uint64_t *buf = xmalloc((MAXW + 8) * sizeof(uint64_t));
    for (int i = 0; i < MAXW + 8; i++)
        buf[i] = next_u64();
    for (int off = 0; off < 8; off++)
        for (int n = 0; n <= MAXW; n += (n < 70 ? 1 : 23)) {
            uint64_t want = 0;
            for (int i = 0; i < n; i++)
                want += buf[off + i];
            const uint64_t got = kern->stream_sum(buf + off, (size_t)n);
            check(got == want, "stream_sum n=%d offset=%d: %llx, expected %llx", n, off,
                  (unsigned long long)got, (unsigned long long)want);
        }
    free(buf);
}

/* A half's float bits, spelled out case by case (the independent
 * reference of halves_to_floats): exact values, a NaN made quiet. */
static uint32_t half_float_bits(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f)
        return sign | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);
    if (e == 0) {
        const float f = ldexpf((float)m, -24);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        return sign | bits;
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}

/* halves_to_floats: every half, bit for bit, in one long call and in short
 * calls from every offset (the vector steps and their scalar tails). */
static void test_halves_to_floats(const sa_kernels *kern)
{
    enum { N = 65536 };
    uint16_t *h = xmalloc((N + 16) * sizeof *h);
    float *out = xmalloc((N + 16) * sizeof *out);
    for (int i = 0; i < N + 16; i++)
        h[i] = (uint16_t)(i * 40503u); /* every half once in the first N, shuffled */
    kern->halves_to_floats(h, out, N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        uint32_t got;
        memcpy(&got, &out[i], sizeof got);
        bad += got != half_float_bits(h[i]);
    }
    check(!bad, "halves_to_floats: %d of the 65536 halves converted wrongly", bad);
    for (int off = 0; off < 8; off++)
        for (int n = 0; n <= 40; n++) {
            for (int i = 0; i < n + 1; i++)
                out[i] = -1.0f;
            kern->halves_to_floats(h + 7919 + off, out, n);
            int wrong = out[n] != -1.0f; /* nothing written past n */
            for (int i = 0; i < n; i++) {
                uint32_t got;
                memcpy(&got, &out[i], sizeof got);
                wrong |= got != half_float_bits(h[7919 + off + i]);
            }
            check(!wrong, "halves_to_floats n=%d offset=%d: wrong", n, off);
        }
    free(h), free(out);
}

/* What an accumulate_v test compares: the weights p (G x n) and start
 * values o0 (G x D), accumulated into ref by the portable kernel, into got
 * by the one under test in one call, and into one a head and a token per
 * call. */
typedef struct {
    float **p, **o0, **ref, **got, **one;
    int G, D, n;
} accum_case;

static accum_case accum_case_new(int G, int D, int n)
{
    accum_case a = {rows_new(G, n), rows_new(G, D), rows_new(G, D), rows_new(G, D),
                    rows_new(G, D), G, D, n};
    for (int g = 0; g < G; g++) {
        for (int t = 0; t < n; t++)
            a.p[g][t] = (float)uniform();
        fill_gauss(a.o0[g], (size_t)D);
        memcpy(a.ref[g], a.o0[g], (size_t)D * sizeof(float));
        memcpy(a.got[g], a.o0[g], (size_t)D * sizeof(float));
        memcpy(a.one[g], a.o0[g], (size_t)D * sizeof(float));
    }
    return a;
}

/* The V rows of an accumulate_v test: float rows v, or q8 rows vq with
 * their scales vd (group size gs); strides in elements. */
typedef struct {
    const float *v;
    const int8_t *vq;
    const float *vd;
    ptrdiff_t rs, ss;
    int gs;
} v_rows;

/* |V[t][d]|, in double. */
static double v_abs(const v_rows *r, int t, int d)
{
    return r->vq ? fabs((double)r->vd[t * r->ss + d / r->gs] * r->vq[t * r->rs + d])
                 : fabs(r->v[t * r->rs + d]);
}

/* The verdicts (the magnitude of an output is |o0| + sum over t of
 * |p[t] V[t][d]|); then frees the rows. */
static void accum_case_finish(accum_case *a, const char *what, const v_rows *v)
{
    double worst = 0.0;
    int same = 1;
    for (int g = 0; g < a->G; g++) {
        for (int d = 0; d < a->D; d++) {
            double mag = fabs(a->o0[g][d]);
            for (int t = 0; t < a->n; t++)
                mag += fabs((double)a->p[g][t]) * v_abs(v, t, d);
            worst = fmax(worst, fabs((double)a->got[g][d] - a->ref[g][d]) / mag);
        }
        same &= memcmp(a->one[g], a->got[g], (size_t)a->D * sizeof(float)) == 0;
    }
    check_kernel(what, worst, TOL_ACCUM, same, "one head and one token per call");
    rows_free(a->p, a->G), rows_free(a->o0, a->G), rows_free(a->ref, a->G);
    rows_free(a->got, a->G), rows_free(a->one, a->G);
}

static void test_accumulate_f32(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 0);) {
        const int D = c.D, G = c.G, n = c.n;
        const ptrdiff_t rs = c.rs;
        strided v = strided_new(sizeof(float), n, D, rs);
        strided_fill_gauss(&v);
        strided_poison(&v);
        const float *vf = (const float *)v.base;
        accum_case a = accum_case_new(G, D, n);
        const sa_prefetch hint = {{(const char *)vf}, {(size_t)n * rs * sizeof(float)}};
        REF->accumulate_v_f32(a.ref, (const float *const *)a.p, G, D, vf, rs, n, NULL);
        kern->accumulate_v_f32(a.got, (const float *const *)a.p, G, D, vf, rs, n, &hint);
        /* The same sums one head and one token per call. */
        for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t++) {
                const float *pp = a.p[g] + t;
                kern->accumulate_v_f32(&a.one[g], &pp, 1, D, vf + t * rs, rs, 1, NULL);
            }
        char what[120];
        snprintf(what, sizeof what, "accumulate_v_f32 D=%d G=%d n=%d stride=%tdD", D, G, n,
                 rs / D);
        accum_case_finish(&a, what, &(v_rows){.v = vf, .rs = rs});
        strided_free(&v);
    }
}

static void test_accumulate_q8(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 1);)
    for (int mode = 0; mode < Q8_ALL127; mode++) {
        if (mode != Q8_RANDOM && c.strided)
            continue;
        const int D = c.D, gs = c.gs, G = c.G, n = c.n;
        const ptrdiff_t rs = c.rs, ss = c.ss;
        strided v, vd;
        q8_rows_new(&c, n, mode, &v, &vd);
        const int8_t *vq = (const int8_t *)v.base;
        const float *vs = (const float *)vd.base;
        accum_case a = accum_case_new(G, D, n);
        const sa_prefetch hint = {{(const char *)vq, (const char *)vs},
                                  {(size_t)n * rs, (size_t)n * ss * sizeof(float)}};
        REF->accumulate_v_q8(a.ref, (const float *const *)a.p, G, D, gs, vq, vs, rs, ss, n,
                             NULL);
        kern->accumulate_v_q8(a.got, (const float *const *)a.p, G, D, gs, vq, vs, rs, ss, n,
                              &hint);
        for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t++) {
                const float *pp = a.p[g] + t;
                kern->accumulate_v_q8(&a.one[g], &pp, 1, D, gs, vq + t * rs, vs + t * ss, rs,
                                      ss, 1, NULL);
            }
        char what[120];
        snprintf(what, sizeof what, "accumulate_v_q8 D=%d gs=%d G=%d n=%d stride=%tdD %s", D,
                 gs, G, n, rs / D, Q8_MODE_NAME[mode]);
        /* kernels.h: bitwise accumulate_v_f32 of the same table, in the
         * table's order: over each group's columns of the rows as floats
         * with the weights times the group's scales (q8_v_scaled 0), or
         * over dequantize_rows' rows with the weights (1; prefill reads q8
         * V that way on every table) */
        float *wide = operand_alloc((size_t)n * D * sizeof(float));
        float **two = rows_new(G, D), **wg = rows_new(G, n > 0 ? n : 1);
        float **at = xmalloc((size_t)G * sizeof(float *));
        for (int g = 0; g < G; g++)
            memcpy(two[g], a.o0[g], (size_t)D * sizeof(float));
        if (kern->q8_v_scaled) {
            kern->dequantize_rows(vq, vs, D, gs, n, rs, ss, wide);
            kern->accumulate_v_f32(two, (const float *const *)a.p, G, D, wide, D, n, NULL);
        } else {
            for (int t = 0; t < n; t++)
                for (int i = 0; i < D; i++)
                    wide[t * D + i] = (float)vq[t * rs + i];
            for (int grp = 0; grp < D / gs; grp++) {
                for (int g = 0; g < G; g++) {
                    for (int t = 0; t < n; t++)
                        wg[g][t] = a.p[g][t] * vs[t * ss + grp];
                    at[g] = two[g] + grp * gs;
                }
                kern->accumulate_v_f32(at, (const float *const *)wg, G, gs, wide + grp * gs, D,
                                       n, NULL);
            }
        }
        int as_f32 = 1;
        for (int g = 0; g < G; g++)
            as_f32 &= memcmp(two[g], a.got[g], (size_t)D * sizeof(float)) == 0;
        check(as_f32, "%s: not accumulate_v_f32 in the table's q8 V order (q8_v_scaled %d) bit "
              "for bit", what, kern->q8_v_scaled);
        free(at), rows_free(wg, G), rows_free(two, G), operand_free(wide);
        accum_case_finish(&a, what, &(v_rows){.vq = vq, .vd = vs, .rs = rs, .ss = ss, .gs = gs});
        strided_free(&v), strided_free(&vd);
    }
}

/* dequantize_rows: each element scale * (float)q with one rounding, so
 * every ISA gives the formula's bits; the output is exactly n x D (the
 * allocation ends there: ASan or a guard page catches a write past it). */
static void test_dequantize(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 1);)
    for (int mode = 0; mode < Q8_ALL127; mode++) {
        if (c.head_i || (mode != Q8_RANDOM && c.strided))
            continue;
        const int D = c.D, gs = c.gs, n = c.n;
        const ptrdiff_t rs = c.rs, ss = c.ss;
        strided v, vd;
        q8_rows_new(&c, n, mode, &v, &vd);
        const int8_t *vq = (const int8_t *)v.base;
        const float *vs = (const float *)vd.base;
        float *got = operand_alloc((size_t)n * D * sizeof(float));
        kern->dequantize_rows(vq, vs, D, gs, n, rs, ss, got);
        int same = 1;
        for (int t = 0; t < n; t++)
            for (int i = 0; i < D; i++) {
                volatile float want = vs[t * ss + i / gs] * (float)vq[t * rs + i];
                same &= memcmp(&got[t * D + i], (const void *)&want, sizeof want) == 0;
            }
        check(same, "dequantize_rows D=%d gs=%d n=%d stride=%tdD %s: not scale * q bit for bit",
              D, gs, n, rs / D, Q8_MODE_NAME[mode]);
        operand_free(got);
        strided_free(&v), strided_free(&vd);
    }
}

static void test_minmax(const sa_kernels *kern)
{
    for (kcase c = {0}; kcase_next(&c, 1);)
    for (int extreme = 0; extreme < 2; extreme++)
    for (int summed = 0; summed < 2; summed++) {
        if (extreme && (c.strided || c.head_i % 2)) /* extremes: a sample suffices */
            continue;
        const int D = c.D, gs = c.gs, ng = c.ng, G = c.G, n = c.n;
        const ptrdiff_t bs = c.rs, ss = c.ss;
        /* The query split by sign, qp = max(q, 0) and qn = min(q, 0); or
         * (summed) the parts of two queries added, as share="group" passes. */
        float *q = operand_alloc((size_t)2 * G * D * sizeof(float));
        float *qp = operand_alloc((size_t)G * D * sizeof(float));
        float *qn = operand_alloc((size_t)G * D * sizeof(float));
        fill_gauss(q, (size_t)2 * G * D);
        for (int i = 0; i < G * D; i++) {
            const float x = q[i], y = summed ? q[G * D + i] : 0.0f;
            qp[i] = (x > 0.0f ? x : 0.0f) + (y > 0.0f ? y : 0.0f);
            qn[i] = (x < 0.0f ? x : 0.0f) + (y < 0.0f ? y : 0.0f);
        }
        strided lo = strided_new(1, n, D, bs), hi = strided_new(1, n, D, bs);
        strided sc = strided_new(sizeof(float), n, ng, ss);
        int8_t *mn = (int8_t *)lo.base, *mx = (int8_t *)hi.base;
        strided_fill_q8(&lo, extreme ? Q8_PM127 : Q8_RANDOM);
        strided_fill_q8(&hi, extreme ? Q8_PM127 : Q8_RANDOM);
        for (int t = 0; t < n; t++)
            for (int i = 0; i < D; i++) {
                int8_t *x = &mn[t * bs + i], *y = &mx[t * bs + i];
                if (*x > *y) {
                    const int8_t tmp = *x;
                    *x = *y, *y = tmp;
                }
            }
        strided_fill_scales(&sc);
        strided_poison(&lo), strided_poison(&hi), strided_poison(&sc);
        const float *scf = (const float *)sc.base;
        float **ref = rows_new(G, n), **got = rows_new(G, n);
        REF->minmax_scores(qp, qn, G, D, gs, mn, mx, scf, bs, n, ref);
        kern->minmax_scores(qp, qn, G, D, gs, mn, mx, scf, bs, n, got);

        double worst = 0.0;
        int same = 1;
        for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t++) {
                double mag = 0.0;
                for (int i = 0; i < D; i++)
                    mag += scf[t * ss + i / gs] * (fabs((double)qn[g * D + i] * mn[t * bs + i]) +
                                                   fabs((double)qp[g * D + i] * mx[t * bs + i]));
                const double err = fabs((double)got[g][t] - ref[g][t]);
                worst = fmax(worst, err / fmax(mag, DBL_MIN));
                float one, *op = &one;
                kern->minmax_scores(qp + g * D, qn + g * D, 1, D, gs, mn + t * bs, mx + t * bs,
                                    scf + t * ss, bs, 1, &op);
                same &= memcmp(&one, &got[g][t], sizeof one) == 0;
            }
        char what[120];
        snprintf(what, sizeof what, "minmax_scores D=%d gs=%d G=%d n=%d stride=%tdD%s%s", D, gs,
                 G, n, bs / D, extreme ? " +-127" : "", summed ? " (summed query parts)" : "");
        check_kernel(what, worst, TOL_DOT_F32, same, "a (head, block) pair scored alone");
        rows_free(ref, G), rows_free(got, G);
        strided_free(&lo), strided_free(&hi), strided_free(&sc);
        operand_free(q), operand_free(qp), operand_free(qn);
    }
}

/* The channel score against portable's: the same channels and rows, one
 * product then the add per term (portable) or a fused multiply-add (the
 * SIMD files), so within float rounding of the sum of |terms|; and each
 * block scored alone gives the bits it gets in a batch. */
static void test_channel_scores(const sa_kernels *kern)
{
    static const int dims[] = {1, 8, 64, 67, 128};
    /* {bs, n}: 32-row blocks alone, in a partial tile of SA_CHANNEL_TILE
     * blocks, in full tiles and a partial one; and other block sizes.  The
     * AVX-512 file scores adjacent 32-row blocks in pairs: {32, 14} ends on
     * a pair of two whole blocks at G = 7 (last = 32) and on a whole block
     * beside a partial one at G = 1 and 4. */
    static const int sizes[][2] = {{32, 1}, {32, 5}, {7, 3}, {16, 9}, {33, 2}, {32, 19},
                                   {32, 14}};
    for (int di = 0; di < 5; di++)
    for (int si = 0; si < LEN(sizes); si++)
    for (int G = 1; G <= 7; G += 3) {
        const int D = dims[di], bs = sizes[si][0], n = sizes[si][1];
        const int last = 1 + (7 * si + n + G) % bs;          /* the last block's rows */
        const int r = D < 16 ? D : 16 + di, cs = bs + si % 2; /* rows kept >= bs */
        float *q = operand_alloc((size_t)G * D * sizeof(float));
        fill_gauss(q, (size_t)G * D);
        int32_t idx[160];
        for (int j = 0; j < r && j < D; j++)
            idx[j] = (int32_t)(j * D / r);                     /* ascending, distinct */
        const int rr = r < D ? r : D;
        int8_t *data = operand_alloc((size_t)n * D * cs);
        float *sc = operand_alloc((size_t)n * D * sizeof(float));
        for (size_t i = 0; i < (size_t)n * D * cs; i++)
            data[i] = (int8_t)(uniform() * 254.0 - 127.0);
        for (int i = 0; i < n * D; i++)
            sc[i] = (float)(uniform() * 0.02);
        float *acc = operand_alloc(sa_channel_acc_floats(G, rr, n > 1 ? bs : last) *
                                   sizeof(float));
        float **ref = rows_new(G, n), **got = rows_new(G, n);
        REF->channel_scores(q, G, D, idx, rr, data, sc, cs, n, bs, n, last, acc, ref);
        kern->channel_scores(q, G, D, idx, rr, data, sc, cs, n, bs, n, last, acc, got);
        double worst = 0.0;
        int same = 1;
        for (int g = 0; g < G; g++)
            for (int b = 0; b < n; b++) {
                double mag = 0.0;
                const int rows = b == n - 1 ? last : bs;
                for (int t = 0; t < rows; t++) {
                    double m = 0.0;
                    for (int j = 0; j < rr; j++)   /* channel c's blocks are adjacent */
                        m += fabs((double)q[g * D + idx[j]] * sc[idx[j] * n + b] *
                                  data[((size_t)idx[j] * n + b) * cs + t]);
                    mag = fmax(mag, m);
                }
                worst = fmax(worst, fabs((double)got[g][b] - ref[g][b]) / fmax(mag, DBL_MIN));
                float one, *op = &one;
                kern->channel_scores(q + g * D, 1, D, idx, rr, data + (size_t)b * cs, sc + b, cs,
                                     n, bs, 1, rows, acc, &op);
                same &= memcmp(&one, &got[g][b], sizeof one) == 0;
            }
        char what[120];
        snprintf(what, sizeof what, "channel_scores D=%d r=%d G=%d bs=%d n=%d last=%d", D, rr,
                 G, bs, n, last);
        check_kernel(what, worst, TOL_DOT_F32, same, "a (head, block) pair scored alone");
        rows_free(ref, G), rows_free(got, G);
        operand_free(q), operand_free(data), operand_free(sc), operand_free(acc);
    }
}

/* ====================================================================== */
/* Public API, per ISA                                                     */
/* ====================================================================== */

static double rel_err(const float *got, const float *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num) / fmax(sqrt(den), 1e-30);
}

static int set_isa(const char *name)
{
    return check(sa_set_isa(name) == SA_OK, "sa_set_isa(\"%s\") failed", name);
}

/* sa_quantize_q8 against spec §4 written out with roundf: bitwise, for
 * group sizes that take the vector rounding and its scalar tail, values on
 * and next to the halfway points, the clamp, all-zero groups, groups too
 * small for 1 / d to be finite (all zeros, not -127 from 0 * Inf),
 * magnitudes up to the value limit; NaN becomes -127 in sa_quantize_row
 * (every entry point refuses NaN before quantising; this only keeps it
 * defined). */
static void test_quantize(void)
{
    static const int shapes[][2] = {{128, 32}, {64, 8}, {67, 1}, {30, 3}, {20, 5}, {256, 128}};
    for (int c = 0; c < LEN(shapes); c++) {
        const int D = shapes[c][0], gs = shapes[c][1], ng = D / gs, rows = 7;
        float *x = xmalloc((size_t)rows * D * sizeof(float));
        int8_t *q = xmalloc((size_t)rows * D);
        float *sc = xmalloc((size_t)rows * ng * sizeof(float));
        fill_gauss(x, (size_t)rows * D);
        for (int i = 0; i < D; i++) {
            /* row 1: exact halfway points k + 0.5 of a scale of 1 (amax 127);
             * row 2: their float neighbours; row 3: zeros; row 4: huge;
             * row 6: below 3.7e-37, zeros among them */
            x[D + i] = (i % gs == 0) ? 127.0f : (float)(i % 255 - 127) + 0.5f;
            x[2 * D + i] = (i % gs == 0) ? 127.0f
                           : nextafterf((float)(i % 255 - 127) + 0.5f, (i & 1) ? 1e9f : -1e9f);
            x[3 * D + i] = 0.0f;
            x[4 * D + i] = (i & 1 ? -0x1p47f : 0x1p47f) * (float)uniform();
            x[6 * D + i] = i % 3 == 0 ? 0.0f : (i & 1 ? -3e-37f : 1e-38f) * (float)uniform();
        }
        check(sa_quantize_q8(x, rows, D, gs, q, sc) == SA_OK, "sa_quantize_q8 D=%d gs=%d", D, gs);
        int same = 1;
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < ng; g++) {
                const float *xg = x + (ptrdiff_t)r * D + g * gs;
                float amax = 0.0f;
                for (int i = 0; i < gs; i++)
                    amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
                const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
                const float id = isfinite(inv) ? inv : 0.0f;
                same &= memcmp(&sc[r * ng + g], &d, sizeof d) == 0;
                for (int i = 0; i < gs; i++) {
                    float v = roundf(xg[i] * id);
                    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                    same &= q[(ptrdiff_t)r * D + g * gs + i] == (int8_t)v;
                }
            }
        check(same, "sa_quantize_q8 D=%d gs=%d differs from spec §4 with roundf", D, gs);
        int tiny_zero = 1;
        for (int i = 0; i < D; i++)
            tiny_zero &= q[6 * D + i] == 0;
        check(tiny_zero, "sa_quantize_q8 D=%d gs=%d: a group below 3.7e-37 is not all zeros",
              D, gs);
        x[5 * D + 1] = NAN;
        sa_quantize_row(x + 5 * D, D, gs, q, sc);
        if (gs > 1)   /* the group's scale is then NaN-free only if 1 is not its max */
            check(q[1] == -127, "sa_quantize_q8: NaN gave %d, not -127", q[1]);
        free(x), free(q), free(sc);
    }
}

/* sa_kernel_q8_dot and sa_kernel_accumulate_v: the microbenchmark entry
 * points go through the active table too. */
static void test_api_kernels(const char *isa)
{
    static const int shapes[][3] = {{128, 32, 100}, {64, 8, 7}, {67, 1, 33}, {256, 128, 9}};
    for (int c = 0; c < LEN(shapes); c++) {
        const int D = shapes[c][0], gs = shapes[c][1], n = shapes[c][2], ng = D / gs;
        float *x = xmalloc((size_t)(n + 1) * D * sizeof(float));
        int8_t *xq = xmalloc((size_t)(n + 1) * D);
        float *xs = xmalloc((size_t)(n + 1) * ng * sizeof(float));
        fill_gauss(x, (size_t)(n + 1) * D);
        check(sa_quantize_q8(x, n + 1, D, gs, xq, xs) == SA_OK, "sa_quantize_q8");
        float *ref = xmalloc((size_t)n * sizeof(float)), *got = xmalloc((size_t)n * sizeof(float));
        set_isa("portable");
        int rc1 = sa_kernel_q8_dot(xq, xs, D, gs, xq + D, xs + ng, n, ref);
        set_isa(isa);
        int rc2 = sa_kernel_q8_dot(xq, xs, D, gs, xq + D, xs + ng, n, got);
        double e = rel_err(got, ref, (size_t)n);
        check(rc1 == SA_OK && rc2 == SA_OK && e <= TOL_E2E,
              "sa_kernel_q8_dot D=%d gs=%d n=%d: rc %d/%d, error %.3g", D, gs, n, rc1, rc2, e);

        float *p = xmalloc((size_t)n * sizeof(float));
        for (int t = 0; t < n; t++)
            p[t] = (float)uniform();
        float *o_ref = xmalloc((size_t)D * sizeof(float)), *o_got = xmalloc((size_t)D * sizeof(float));
        for (int dt = 0; dt < 2; dt++) {
            sa_kv v = {.dtype = dt ? SA_DTYPE_Q8 : SA_DTYPE_F32, .n_kv_heads = 1,
                       .head_stride = n, .n_rows = n, .head_dim = D, .group_size = gs,
                       .f32 = x, .q8 = xq, .scales = xs};
            memset(o_ref, 0, (size_t)D * sizeof(float));
            memset(o_got, 0, (size_t)D * sizeof(float));
            set_isa("portable");
            rc1 = sa_kernel_accumulate_v(p, &v, n, o_ref);
            set_isa(isa);
            rc2 = sa_kernel_accumulate_v(p, &v, n, o_got);
            e = rel_err(o_got, o_ref, (size_t)D);
            check(rc1 == SA_OK && rc2 == SA_OK && e <= TOL_E2E,
                  "sa_kernel_accumulate_v %s D=%d n=%d: rc %d/%d, error %.3g",
                  dt ? "q8" : "f32", D, n, rc1, rc2, e);
        }
        free(x), free(xq), free(xs), free(ref), free(got), free(p), free(o_ref), free(o_got);
    }
}

/* ---- end to end ------------------------------------------------------- */

typedef struct {
    int dtype, D, gs, Hkv, G, H, seq_len, bs;
    int n_rows, head_stride, NB, T;
    float *kf, *vf;        /* [Hkv, head_stride, D] */
    int8_t *kq, *vq;       /* q8 copies */
    float *ks, *vs;
    sa_kv k, v;
    float *q;              /* [H, D] */
    float *qp;             /* prefill queries [H, T, D] */
    float *importance;     /* [seq_len] */
    sa_bounds bounds;      /* minmax bounds of K over seq_len rows */
    sa_channels channels;  /* the channel copy of K over seq_len rows */
} e2e_data;

enum { N_PSETS = 10 };

typedef struct {
    int n_sel[N_PSETS];
    int32_t *blocks[N_PSETS];  /* [H, n_sel] */
    float *sparse[N_PSETS];    /* [H, D] */
    float *dense;              /* [H, D] */
    float *probe;              /* [H, NB] */
    float *pre_out, *pre_imp;  /* [H, T, D], [seq_len] */
    float *sp_out[N_PSETS], *sp_imp[N_PSETS]; /* sparse prefill, as pre_* */
} e2e_results;

/* The parameter sets: sparse with the importance reserve, sparse with sinks
 * and a shared GQA choice, sparse without recency and with a short probe,
 * two with every block chosen (must equal dense decode bitwise), two
 * scoring blocks by the minmax bound and two by channels. */
static sa_select_params pset(const e2e_data *d, int i, int *with_importance)
{
    const int kb = d->NB / 3 + 1;
    sa_select_params p = {.block_size = d->bs, .k_blocks = kb, .n_probe = 8, .recency = 1,
                          .importance_blocks = (kb + 1) / 2, .sink_blocks = 0,
                          .share = SA_SHARE_HEAD};
    *with_importance = 0;
    switch (i) {
    case 0: *with_importance = 1; break;
    case 1: p.sink_blocks = 1, p.share = SA_SHARE_GROUP, p.n_probe = 3; break;
    case 2: p.recency = 0, p.n_probe = 1, p.k_blocks = d->NB > 2 ? d->NB - 2 : 1; break;
    case 3: p.k_blocks = d->NB; *with_importance = 1; break;
    case 4: p.k_blocks = d->NB + 7; break;
    case 5: p.scoring = SA_SCORING_MINMAX; *with_importance = 1; break;
    case 6: p.scoring = SA_SCORING_MINMAX, p.share = SA_SHARE_GROUP, p.sink_blocks = 1; break;
    case 7: p.scoring = SA_SCORING_CHANNELS, p.n_channels = 5; *with_importance = 1; break;
    case 8: p.exact_tail = d->bs + 1, p.sink_blocks = 1, p.n_probe = 3; *with_importance = 1; break;
    default:
        p.scoring = SA_SCORING_CHANNELS, p.n_channels = 1000, p.share = SA_SHARE_GROUP;
        p.sink_blocks = 1;
        break;
    }
    p.bounds = &d->bounds;
    p.channels = &d->channels;
    return p;
}

static void e2e_data_new(e2e_data *d, int dtype, int D, int gs, int Hkv, int G, int seq_len,
                         int bs)
{
    *d = (e2e_data){.dtype = dtype, .D = D, .gs = gs, .Hkv = Hkv, .G = G, .H = Hkv * G,
                    .seq_len = seq_len, .bs = bs};
    d->n_rows = seq_len + 3;       /* capacity the calls must not read */
    d->head_stride = seq_len + 5;
    d->NB = (seq_len + bs - 1) / bs;
    d->T = seq_len < 4 ? seq_len : 4;
    const size_t rows = (size_t)Hkv * d->head_stride, ng = (size_t)(D / gs);
    d->kf = xmalloc(rows * D * sizeof(float));
    d->vf = xmalloc(rows * D * sizeof(float));
    fill_gauss(d->kf, rows * D);
    fill_gauss(d->vf, rows * D);
    d->k = (sa_kv){.dtype = dtype, .n_kv_heads = Hkv, .head_stride = d->head_stride,
                   .n_rows = d->n_rows, .head_dim = D, .group_size = gs};
    d->v = d->k;
    if (dtype == SA_DTYPE_Q8) {
        d->kq = xmalloc(rows * D), d->vq = xmalloc(rows * D);
        d->ks = xmalloc(rows * ng * sizeof(float)), d->vs = xmalloc(rows * ng * sizeof(float));
        check(sa_quantize_q8(d->kf, (int64_t)rows, D, gs, d->kq, d->ks) == SA_OK &&
              sa_quantize_q8(d->vf, (int64_t)rows, D, gs, d->vq, d->vs) == SA_OK,
              "sa_quantize_q8 of the KV");
        /* V's scales rounded to powers of two: then decode's order of q8
         * V's products ((p * d) * q) and prefill's (p * (d * q)) are both
         * exact before the add, so a prefill row can be checked against
         * dense decode bit for bit (spec §4; the kernels' own tests take
         * any scales). */
        for (size_t i = 0; i < rows * ng; i++)
            d->vs[i] = exp2f(rintf(log2f(d->vs[i])));
        d->k.q8 = d->kq, d->k.scales = d->ks;
        d->v.q8 = d->vq, d->v.scales = d->vs;
        /* Rows at and beyond seq_len must never be read. */
        for (int h = 0; h < Hkv; h++) {
            const size_t r0 = (size_t)h * d->head_stride + seq_len, nr = d->head_stride - seq_len;
            POISON(d->kq + r0 * D, nr * D), POISON(d->vq + r0 * D, nr * D);
            POISON(d->ks + r0 * ng, nr * ng * sizeof(float));
            POISON(d->vs + r0 * ng, nr * ng * sizeof(float));
        }
    } else {
        d->k.f32 = d->kf, d->v.f32 = d->vf;
        for (int h = 0; h < Hkv; h++) {
            const size_t r0 = (size_t)h * d->head_stride + seq_len, nr = d->head_stride - seq_len;
            POISON(d->kf + r0 * D, nr * D * sizeof(float));
            POISON(d->vf + r0 * D, nr * D * sizeof(float));
        }
    }
    d->q = xmalloc((size_t)d->H * D * sizeof(float));
    d->qp = xmalloc((size_t)d->H * d->T * D * sizeof(float));
    fill_gauss(d->q, (size_t)d->H * D);
    fill_gauss(d->qp, (size_t)d->H * d->T * D);
    d->importance = xmalloc((size_t)seq_len * sizeof(float));
    for (int t = 0; t < seq_len; t++)
        d->importance[t] = (float)(uniform() * uniform());
    /* Bounds grouped like q8 K, or by 32 (1 when that does not divide D). */
    const int bgs = dtype == SA_DTYPE_Q8 ? gs : (D % 32 ? 1 : 32);
    d->bounds = (sa_bounds){.n_kv_heads = Hkv, .head_dim = D, .block_size = bs,
                            .scale_group = bgs, .head_stride = d->NB};
    d->bounds.mn = xmalloc((size_t)Hkv * d->NB * D);
    d->bounds.mx = xmalloc((size_t)Hkv * d->NB * D);
    d->bounds.scales = xmalloc((size_t)Hkv * d->NB * (D / bgs) * sizeof(float));
    int rc = sa_bounds_update(&d->k, 0, seq_len, &d->bounds);
    check(rc == SA_OK && d->bounds.k_rows == seq_len, "sa_bounds_update: %s", sa_strerror(rc));
    /* The channel copy, made in two calls (the second recomputes the block
     * the first left partial). */
    const int cs = bs < seq_len ? bs : seq_len;
    d->channels = (sa_channels){.n_kv_heads = Hkv, .head_dim = D, .block_size = bs,
                                .block_rows = cs, .head_stride = d->NB};
    d->channels.q8 = xmalloc((size_t)Hkv * d->NB * D * cs);
    d->channels.scales = xmalloc((size_t)Hkv * d->NB * D * sizeof(float));
    rc = sa_channels_update(&d->k, 0, seq_len / 2, &d->channels);
    if (rc == SA_OK)
        rc = sa_channels_update(&d->k, seq_len / 2, seq_len, &d->channels);
    check(rc == SA_OK && d->channels.k_rows == seq_len, "sa_channels_update: %s",
          sa_strerror(rc));
}

static void e2e_data_free(e2e_data *d)
{
    const size_t rows = (size_t)d->Hkv * d->head_stride, ng = (size_t)(d->D / d->gs);
    UNPOISON(d->kf, rows * d->D * sizeof(float));
    UNPOISON(d->vf, rows * d->D * sizeof(float));
    free(d->kf), free(d->vf);
    if (d->kq) {
        UNPOISON(d->kq, rows * d->D), UNPOISON(d->vq, rows * d->D);
        UNPOISON(d->ks, rows * ng * sizeof(float)), UNPOISON(d->vs, rows * ng * sizeof(float));
        free(d->kq), free(d->vq), free(d->ks), free(d->vs);
    }
    free(d->q), free(d->qp), free(d->importance);
    free(d->bounds.mn), free(d->bounds.mx), free(d->bounds.scales);
    free(d->channels.q8), free(d->channels.scales);
}

static void e2e_results_free(e2e_results *r)
{
    for (int i = 0; i < N_PSETS; i++)
        free(r->blocks[i]), free(r->sparse[i]), free(r->sp_out[i]), free(r->sp_imp[i]);
    free(r->dense), free(r->probe), free(r->pre_out), free(r->pre_imp);
}

/* Copies of the probe rows of K's first S rows, sized exactly (rows of
 * ceil(S / bs) blocks), filled by sa_probe_rows_update in two calls. */
static sa_probe_rows probe_rows_new(const sa_kv *k, int S, int bs, int n_probe)
{
    const int step = bs / n_probe > 1 ? bs / n_probe : 1, cnt = (bs + step - 1) / step;
    const int rows = (S + bs - 1) / bs * cnt, D = k->head_dim;
    sa_probe_rows p = {.rows = {.dtype = k->dtype, .n_kv_heads = k->n_kv_heads,
                                .head_stride = rows, .n_rows = rows, .head_dim = D,
                                .group_size = k->group_size},
                       .block_size = bs, .n_probe = n_probe};
    const size_t n = (size_t)k->n_kv_heads * rows;
    if (k->dtype == SA_DTYPE_F32) {
        p.rows.f32 = xmalloc(n * D * sizeof(float));
    } else {
        p.rows.q8 = xmalloc(n * D);
        p.rows.scales = xmalloc(n * (D / k->group_size) * sizeof(float));
    }
    int rc = sa_probe_rows_update(k, 0, S / 2, &p);
    if (rc == SA_OK)
        rc = sa_probe_rows_update(k, S / 2, S, &p);
    check(rc == SA_OK, "sa_probe_rows_update: %s", sa_strerror(rc));
    return p;
}

static void probe_rows_free(sa_probe_rows *p)
{
    free((void *)p->rows.f32), free((void *)p->rows.q8), free((void *)p->rows.scales);
}

static int blocks_valid(const int32_t *b, int H, int n_sel, int NB)
{
    for (int h = 0; h < H; h++)
        for (int i = 0; i < n_sel; i++) {
            const int32_t x = b[h * n_sel + i];
            if (x < 0 || x >= NB || (i > 0 && x <= b[h * n_sel + i - 1]))
                return 0;
        }
    return 1;
}

/* Everything through the public API on the active ISA; checks what must
 * hold on one ISA (threads, dense equality, prefill rows) and keeps the
 * threads=1 results for the comparison with portable. */
/* sa_decode_batch: every parameter set's sparse decode, dense decode over
 * the whole context and over a shorter one (another call's length and
 * items: chunked and unchunked calls side by side), as one job at 2 and 7
 * threads: each call's output and blocks bitwise what it gave alone (at 1,
 * 2 and 3 threads). */
static void e2e_batch(const e2e_data *d, const e2e_results *r)
{
    const int H = d->H, D = d->D, S = d->seq_len, short_len = S > 40 ? S - 37 : S;
    const size_t out_n = (size_t)H * D;
    sa_decode_call calls[N_PSETS + 2];
    sa_select_params ps[N_PSETS];
    float *outs[N_PSETS + 2];
    int32_t *blks[N_PSETS];
    int idx[N_PSETS], n = 0;
    for (int i = 0; i < N_PSETS; i++) {
        int with_imp;
        ps[i] = pset(d, i, &with_imp);
        if (!r->sparse[i])
            continue;
        idx[n] = i;
        outs[n] = xmalloc(out_n * sizeof(float));
        blks[n] = xmalloc((size_t)H * r->n_sel[i] * sizeof(int32_t));
        calls[n] = (sa_decode_call){d->q, H, &d->k, &d->v, S, &ps[i],
                                    with_imp ? d->importance : NULL, S,
                                    1.0f / sqrtf((float)D), outs[n], blks[n]};
        n++;
    }
    const int n_sparse = n;
    for (int j = 0; j < 2; j++, n++) {
        outs[n] = xmalloc(out_n * sizeof(float));
        calls[n] = (sa_decode_call){d->q, H, &d->k, &d->v, j ? short_len : S, NULL, NULL, 0,
                                    1.0f / sqrtf((float)D), outs[n], NULL};
    }
    float *want_short = xmalloc(out_n * sizeof(float));
    check(sa_dense_decode(d->q, H, &d->k, &d->v, short_len, 1.0f / sqrtf((float)D), want_short,
                          1) == SA_OK, "dense decode of %d rows", short_len);
    static const int threads[] = {2, 7};
    for (int t = 0; t < LEN(threads); t++) {
        int failed = 99;
        const int rc = sa_decode_batch(calls, n, threads[t], &failed);
        if (!check(rc == SA_OK && failed == -1, "sa_decode_batch of %d calls, %d threads: %s "
                   "(call %d)", n, threads[t], sa_strerror(rc), failed))
            continue;
        for (int c = 0; c < n_sparse; c++) {
            const int i = idx[c];
            check(!memcmp(outs[c], r->sparse[i], out_n * 4) &&
                      !memcmp(blks[c], r->blocks[i], (size_t)H * r->n_sel[i] * 4),
                  "pset %d in a batch (%d threads) differs from its call alone", i, threads[t]);
        }
        check(!memcmp(outs[n_sparse], r->dense, out_n * 4) &&
                  !memcmp(outs[n_sparse + 1], want_short, out_n * 4),
              "dense decode in a batch (%d threads) differs from its call alone", threads[t]);
    }
    for (int c = 0; c < n; c++)
        free(outs[c]);
    for (int c = 0; c < n_sparse; c++)
        free(blks[c]);
    free(want_short);
}

static void e2e_run(const e2e_data *d, e2e_results *r)
{
    const int H = d->H, D = d->D, T = d->T, S = d->seq_len;
    const size_t out_n = (size_t)H * D;
    float *out[3], *dense[3];
    int32_t *sel[3], *blk[3];
    for (int th = 0; th < 3; th++)
        dense[th] = xmalloc(out_n * sizeof(float));
    for (int th = 0; th < 3; th++) {
        const int rc = sa_dense_decode(d->q, H, &d->k, &d->v, S, 1.0f / sqrtf((float)D),
                                       dense[th], th + 1);
        check(rc == SA_OK, "sa_dense_decode threads=%d: %s", th + 1, sa_strerror(rc));
    }
    check(!memcmp(dense[1], dense[0], out_n * 4) && !memcmp(dense[2], dense[0], out_n * 4),
          "dense decode differs between threads 1/2/3");
    /* More threads than items (and, past one chunk, than KV heads): the
     * split-KV chunks, not the threads, fix the bits (spec §2.6). */
    for (int th = 7; th <= 64; th += 57) {
        const int rc = sa_dense_decode(d->q, H, &d->k, &d->v, S, 1.0f / sqrtf((float)D),
                                       dense[1], th);
        check(rc == SA_OK && !memcmp(dense[1], dense[0], out_n * 4),
              "dense decode differs between threads 1 and %d", th);
    }
    r->dense = dense[0];
    free(dense[1]), free(dense[2]);

    for (int i = 0; i < N_PSETS; i++) {
        int with_imp;
        const sa_select_params p = pset(d, i, &with_imp);
        if ((p.scoring == SA_SCORING_MINMAX && !sa_active_kernels()->minmax_scores) ||
            (p.scoring == SA_SCORING_CHANNELS && !sa_active_kernels()->channel_scores))
            continue; /* reported as an incomplete table; would crash */
        const int n_sel = p.k_blocks < d->NB ? p.k_blocks : d->NB;
        const size_t nb = (size_t)H * n_sel;
        const float *imp = with_imp ? d->importance : NULL;
        for (int th = 0; th < 3; th++) {
            out[th] = xmalloc(out_n * sizeof(float));
            sel[th] = xmalloc(nb * sizeof(int32_t)), blk[th] = xmalloc(nb * sizeof(int32_t));
            int rc = sa_select_blocks(d->q, H, &d->k, S, &p, imp, S, sel[th], th + 1);
            check(rc == SA_OK, "sa_select_blocks pset %d threads=%d: %s", i, th + 1, sa_strerror(rc));
            rc = sa_sparse_decode(d->q, H, &d->k, &d->v, S, &p, imp, S, 1.0f / sqrtf((float)D),
                                  out[th], blk[th], th + 1);
            check(rc == SA_OK, "sa_sparse_decode pset %d threads=%d: %s", i, th + 1, sa_strerror(rc));
        }
        check(blocks_valid(sel[0], H, n_sel, d->NB), "pset %d: blocks not ascending in "
              "[0, n_blocks)", i);
        for (int th = 1; th < 3; th++) {
            check(!memcmp(sel[th], sel[0], nb * 4) && !memcmp(blk[th], sel[0], nb * 4),
                  "pset %d: selections differ between threads 1 and %d", i, th + 1);
            check(!memcmp(out[th], out[0], out_n * 4),
                  "pset %d: sparse decode differs between threads 1 and %d", i, th + 1);
        }
        check(!memcmp(blk[0], sel[0], nb * 4),
              "pset %d: sparse decode chose other blocks than sa_select_blocks", i);
        if (p.k_blocks >= d->NB)
            check(!memcmp(out[0], r->dense, out_n * 4), "pset %d (k_blocks %d >= n_blocks "
                  "%d): sparse decode is not bitwise equal to dense decode", i, p.k_blocks, d->NB);
        if (p.scoring == SA_SCORING_PROBE && p.k_blocks < d->NB) {
            /* Read from copies of the probe rows: bitwise the same. */
            sa_probe_rows rows = probe_rows_new(&d->k, S, p.block_size, p.n_probe);
            sa_select_params pr = p;
            pr.probe_rows = &rows;
            int rc = sa_sparse_decode(d->q, H, &d->k, &d->v, S, &pr, imp, S,
                                      1.0f / sqrtf((float)D), out[1], blk[1], 2);
            check(rc == SA_OK, "sa_sparse_decode pset %d with probe rows: %s", i,
                  sa_strerror(rc));
            check(!memcmp(blk[1], sel[0], nb * 4) && !memcmp(out[1], out[0], out_n * 4),
                  "pset %d: decode from copies of the probe rows differs from decode "
                  "probing K", i);
            probe_rows_free(&rows);
        }
        r->n_sel[i] = n_sel;
        r->blocks[i] = sel[0];
        r->sparse[i] = out[0];
        free(sel[1]), free(sel[2]), free(blk[0]), free(blk[1]), free(blk[2]);
        free(out[1]), free(out[2]);
    }
    e2e_batch(d, r);

    /* Probe scores. */
    float *probe[3];
    const size_t pn = (size_t)H * d->NB;
    for (int th = 0; th < 3; th++) {
        probe[th] = xmalloc(pn * sizeof(float));
        const int rc = sa_probe_scores(d->q, H, &d->k, S, d->bs, 8, probe[th], th + 1);
        check(rc == SA_OK, "sa_probe_scores threads=%d: %s", th + 1, sa_strerror(rc));
    }
    check(!memcmp(probe[1], probe[0], pn * 4) && !memcmp(probe[2], probe[0], pn * 4),
          "probe scores differ between threads 1/2/3");
    r->probe = probe[0];
    free(probe[1]), free(probe[2]);

    /* Prefill of the last T positions. */
    const int start = S - T;
    const size_t pre_n = (size_t)H * T * D;
    float *pout[3], *pimp[3];
    for (int th = 0; th < 3; th++) {
        pout[th] = xmalloc(pre_n * sizeof(float));
        pimp[th] = xmalloc((size_t)S * sizeof(float));
        const int rc = sa_prefill(d->qp, H, T, &d->k, &d->v, start, NULL, NULL, 0, 1.0f / sqrtf((float)D),
                                  pout[th], pimp[th], th + 1);
        check(rc == SA_OK, "sa_prefill threads=%d: %s", th + 1, sa_strerror(rc));
    }
    for (int th = 1; th < 3; th++)
        check(!memcmp(pout[th], pout[0], pre_n * 4) && !memcmp(pimp[th], pimp[0], (size_t)S * 4),
              "prefill differs between threads 1 and %d", th + 1);
    double mass = 0.0;
    for (int j = 0; j < S; j++)
        mass += pimp[0][j];
    check(fabs(mass - (double)H * T) <= 1e-4 * H * T,
          "prefill importance sums to %.7g, expected n_heads*T = %d", mass, H * T);
    /* Row t of the prefill is dense decode at seq_len start+t+1: on q8 K
     * bitwise up to one decode chunk of keys, within rounding beyond and on
     * float32 K (GEMM-form scores; spec §3). */
    float *qt = xmalloc(out_n * sizeof(float)), *ot = xmalloc(out_n * sizeof(float));
    for (int t = 0; t < T; t += (T > 1 ? T - 1 : 1)) {
        for (int h = 0; h < H; h++)
            memcpy(qt + (size_t)h * D, d->qp + ((size_t)h * T + t) * D, (size_t)D * 4);
        const int rc = sa_dense_decode(qt, H, &d->k, &d->v, start + t + 1,
                                       1.0f / sqrtf((float)D), ot, 1);
        int same = rc == SA_OK;
        const int bitwise = d->k.dtype == SA_DTYPE_Q8 && start + t + 1 <= SA_DECODE_CHUNK_ROWS;
        for (int h = 0; h < H; h++) {
            const float *row = pout[0] + ((size_t)h * T + t) * D, *dec = ot + (size_t)h * D;
            same &= bitwise ? !memcmp(dec, row, (size_t)D * 4)
                            : rel_err(dec, row, (size_t)D) <= TOL_E2E;
        }
        check(same, "prefill row at position %d is not %s dense decode", start + t,
              bitwise ? "bitwise" : "within rounding of");
    }
    free(qt), free(ot);
    r->pre_out = pout[0], r->pre_imp = pimp[0];
    free(pout[1]), free(pout[2]), free(pimp[1]), free(pimp[2]);

    /* Sparse prefill with each parameter set (the importance, when the set
     * has it, as the record of the rows before start): the same for any
     * thread count, exact prefill's output bit for bit when every block is
     * chosen, every row's weights summing to one. */
    for (int i = 0; i < N_PSETS; i++) {
        int with_imp;
        const sa_select_params p = pset(d, i, &with_imp);
        if ((p.scoring == SA_SCORING_MINMAX && !sa_active_kernels()->minmax_scores) ||
            (p.scoring == SA_SCORING_CHANNELS && !sa_active_kernels()->channel_scores))
            continue;
        for (int th = 0; th < 3; th++) {
            pout[th] = xmalloc(pre_n * sizeof(float));
            pimp[th] = xmalloc((size_t)S * sizeof(float));
            const int rc = sa_prefill(d->qp, H, T, &d->k, &d->v, start, &p,
                                      with_imp ? d->importance : NULL, S,
                                      1.0f / sqrtf((float)D), pout[th], pimp[th], th + 1);
            check(rc == SA_OK, "sparse sa_prefill pset %d threads=%d: %s", i, th + 1,
                  sa_strerror(rc));
        }
        for (int th = 1; th < 3; th++)
            check(!memcmp(pout[th], pout[0], pre_n * 4) &&
                      !memcmp(pimp[th], pimp[0], (size_t)S * 4),
                  "pset %d: sparse prefill differs between threads 1 and %d", i, th + 1);
        mass = 0.0;
        for (int j = 0; j < S; j++)
            mass += pimp[0][j];
        check(fabs(mass - (double)H * T) <= 1e-4 * H * T,
              "pset %d: sparse prefill importance sums to %.7g, expected %d", i, mass, H * T);
        if (p.exact_tail > 0) {
            /* the blocks holding the last exact_tail rows are exact prefill's */
            int split = S - p.exact_tail < start ? start : (S - p.exact_tail) / d->bs * d->bs;
            split = split < start ? start : split;
            int same = 1;
            for (int h = 0; h < H; h++)
                same &= !memcmp(pout[0] + ((size_t)h * T + (split - start)) * D,
                                r->pre_out + ((size_t)h * T + (split - start)) * D,
                                (size_t)(S - split) * D * 4);
            check(same, "pset %d: the exact tail from position %d is not exact prefill's", i,
                  split);
        }
        if (p.k_blocks >= d->NB) {
            check(!memcmp(pout[0], r->pre_out, pre_n * 4), "pset %d (k_blocks %d >= n_blocks "
                  "%d): sparse prefill is not bitwise exact prefill", i, p.k_blocks, d->NB);
            const double e = rel_err(pimp[0], r->pre_imp, (size_t)S);
            check(e <= 1e-6, "pset %d: every block chosen, importance off exact by %.3g", i, e);
        }
        r->sp_out[i] = pout[0], r->sp_imp[i] = pimp[0];
        free(pout[1]), free(pout[2]), free(pimp[1]), free(pimp[2]);
    }
}

static void e2e_compare(const e2e_data *d, const e2e_results *got, const e2e_results *ref)
{
    const size_t out_n = (size_t)d->H * d->D;
    for (int i = 0; i < N_PSETS; i++) {
        if (!got->blocks[i] || !ref->blocks[i])
            continue;
        check(!memcmp(got->blocks[i], ref->blocks[i], (size_t)d->H * got->n_sel[i] * 4),
              "pset %d: selection differs from portable", i);
        const double e = rel_err(got->sparse[i], ref->sparse[i], out_n);
        check(e <= TOL_E2E, "pset %d: sparse decode off portable by %.3g > %.1g", i, e, TOL_E2E);
    }
    double e = rel_err(got->dense, ref->dense, out_n);
    check(e <= TOL_E2E, "dense decode off portable by %.3g > %.1g", e, TOL_E2E);
    e = rel_err(got->probe, ref->probe, (size_t)d->H * d->NB);
    check(e <= TOL_E2E, "probe scores off portable by %.3g > %.1g", e, TOL_E2E);
    e = rel_err(got->pre_out, ref->pre_out, (size_t)d->H * d->T * d->D);
    check(e <= TOL_E2E, "prefill output off portable by %.3g > %.1g", e, TOL_E2E);
    e = rel_err(got->pre_imp, ref->pre_imp, (size_t)d->seq_len);
    check(e <= TOL_E2E, "prefill importance off portable by %.3g > %.1g", e, TOL_E2E);
    for (int i = 0; i < N_PSETS; i++) {
        if (!got->sp_out[i] || !ref->sp_out[i])
            continue;
        e = rel_err(got->sp_out[i], ref->sp_out[i], (size_t)d->H * d->T * d->D);
        check(e <= TOL_E2E, "pset %d: sparse prefill output off portable by %.3g", i, e);
        e = rel_err(got->sp_imp[i], ref->sp_imp[i], (size_t)d->seq_len);
        check(e <= TOL_E2E, "pset %d: sparse prefill importance off portable by %.3g", i, e);
    }
}

static void test_e2e(const char *const *isas, int n_isas)
{
    /* {dtype, D, gs}: f32 at 64, 128 and an odd D; q8 at 64 and 128 with
     * the default group, a 16-multiple, an 8-multiple and the scalar path. */
    static const int kinds[][3] = {
        {SA_DTYPE_F32, 64, 1}, {SA_DTYPE_F32, 128, 1}, {SA_DTYPE_F32, 67, 1},
        {SA_DTYPE_Q8, 64, 32}, {SA_DTYPE_Q8, 128, 32}, {SA_DTYPE_Q8, 128, 64},
        {SA_DTYPE_Q8, 64, 8}, {SA_DTYPE_Q8, 64, 4},
    };
    static const int ratios[] = {1, 2, 4};
    /* {block_size, seq_len}: partial last blocks, a context shorter than
     * one block, and one that decode attends to in two chunks (spec
     * §2.6; sparse with share="head" and every block chosen too), the last
     * for the first f32 and q8 kinds at G = 2 only (it costs as much as all
     * the others under qemu). */
    static const int lens[][2] = {{7, 7 * 19 + 3}, {32, 32 * 9 + 5}, {32, 20}, {16, 2061}};
    for (int a = 0; a < LEN(kinds); a++)
    for (int b = 0; b < LEN(ratios); b++)
    for (int c = 0; c < LEN(lens); c++) {
        if (lens[c][1] > SA_DECODE_CHUNK_ROWS && !(ratios[b] == 2 && (a == 0 || a == 3)))
            continue;
        e2e_data d;
        const int Hkv = 3;
        e2e_data_new(&d, kinds[a][0], kinds[a][1], kinds[a][2], Hkv, ratios[b], lens[c][1],
                     lens[c][0]);
        e2e_results ref = {0};
        for (int i = 0; i < n_isas; i++) {
            set_where("%s e2e %s D=%d gs=%d Hkv=%d G=%d seq_len=%d bs=%d", isas[i],
                      d.dtype == SA_DTYPE_Q8 ? "q8" : "f32", d.D, d.gs, Hkv, d.G, d.seq_len, d.bs);
            if (!set_isa(isas[i]))
                continue;
            e2e_results got = {0};
            e2e_run(&d, &got);
            if (i == 0) {
                ref = got; /* isas[0] is portable */
                continue;
            }
            e2e_compare(&d, &got, &ref);
            e2e_results_free(&got);
        }
        e2e_results_free(&ref);
        e2e_data_free(&d);
    }
}

/* ====================================================================== */
/* Concurrent callers                                                     */
/* ====================================================================== */

/* Several threads calling the entry points at once on shared read-only
 * operands (one of them owns the worker pool, the others run their items on
 * their own thread): every result must be bitwise the single-threaded one.
 * Under ThreadSanitizer (scripts/test-c.sh --tsan) this is the check that
 * the pool and the calls share nothing they do not synchronise. */
enum { CC_THREADS = 4, CC_ROUNDS = 6 };

typedef struct {
    const e2e_data *d;
    const sa_select_params *p;
    const float *want_sparse, *want_dense, *want_pre;
    int ok;
} cc_arg;

static void *cc_worker(void *arg)
{
    cc_arg *a = arg;
    const e2e_data *d = a->d;
    const size_t out_n = (size_t)d->H * d->D, pre_n = (size_t)d->H * d->T * d->D;
    float *out = malloc(out_n * sizeof(float)), *pre = malloc(pre_n * sizeof(float));
    float *imp = malloc((size_t)d->seq_len * sizeof(float));
    a->ok = out && pre && imp;
    for (int r = 0; r < CC_ROUNDS && a->ok; r++) {
        const float sc = 1.0f / sqrtf((float)d->D);
        a->ok &= sa_sparse_decode(d->q, d->H, &d->k, &d->v, d->seq_len, a->p, d->importance,
                                  d->seq_len, sc, out, NULL, 1 + r % 3) == SA_OK;
        a->ok &= !memcmp(out, a->want_sparse, out_n * sizeof(float));
        a->ok &= sa_dense_decode(d->q, d->H, &d->k, &d->v, d->seq_len, sc, out, 2) == SA_OK;
        a->ok &= !memcmp(out, a->want_dense, out_n * sizeof(float));
        /* both as one batch, the dense call's two chunks among its items */
        const sa_decode_call calls[2] = {
            {d->q, d->H, &d->k, &d->v, d->seq_len, a->p, d->importance, d->seq_len, sc, out,
             NULL},
            {d->q, d->H, &d->k, &d->v, d->seq_len, NULL, NULL, 0, sc, pre, NULL}};
        a->ok &= sa_decode_batch(calls, 2, 1 + (r + 1) % 3, NULL) == SA_OK;
        a->ok &= !memcmp(out, a->want_sparse, out_n * sizeof(float)) &&
                 !memcmp(pre, a->want_dense, out_n * sizeof(float));
        a->ok &= sa_prefill(d->qp, d->H, d->T, &d->k, &d->v, d->seq_len - d->T, NULL, NULL, 0, sc, pre, imp,
                            1 + r % 2) == SA_OK;
        a->ok &= !memcmp(pre, a->want_pre, pre_n * sizeof(float));
    }
    free(out), free(pre), free(imp);
    return NULL;
}

static void test_concurrent_callers(void)
{
    for (int dt = 0; dt < 2; dt++) {
        e2e_data d;
        /* 2245 rows: dense decode in two chunks, merged by whichever
         * thread finishes a group's last chunk */
        e2e_data_new(&d, dt ? SA_DTYPE_Q8 : SA_DTYPE_F32, 64, 32, 3, 2, 32 * 70 + 5, 32);
        set_where("concurrent callers, %s", dt ? "q8" : "f32");
        int with_imp;
        const sa_select_params p = pset(&d, 0, &with_imp);
        const size_t out_n = (size_t)d.H * d.D, pre_n = (size_t)d.H * d.T * d.D;
        float *ws = xmalloc(out_n * 4), *wd = xmalloc(out_n * 4), *wp = xmalloc(pre_n * 4);
        float *wi = xmalloc((size_t)d.seq_len * 4);
        const float sc = 1.0f / sqrtf((float)d.D);
        check(sa_sparse_decode(d.q, d.H, &d.k, &d.v, d.seq_len, &p, d.importance, d.seq_len, sc,
                               ws, NULL, 1) == SA_OK &&
              sa_dense_decode(d.q, d.H, &d.k, &d.v, d.seq_len, sc, wd, 1) == SA_OK &&
              sa_prefill(d.qp, d.H, d.T, &d.k, &d.v, d.seq_len - d.T, NULL, NULL, 0, sc, wp, wi, 1) == SA_OK,
              "single-threaded baseline");
        pthread_t th[CC_THREADS];
        cc_arg args[CC_THREADS];
        for (int i = 0; i < CC_THREADS; i++) {
            args[i] = (cc_arg){&d, &p, ws, wd, wp, 0};
            check(pthread_create(&th[i], NULL, cc_worker, &args[i]) == 0, "pthread_create");
        }
        for (int i = 0; i < CC_THREADS; i++) {
            pthread_join(th[i], NULL);
            check(args[i].ok, "caller %d got other bytes than the single-threaded run", i);
        }
        free(ws), free(wd), free(wp), free(wi);
        e2e_data_free(&d);
    }
}

/* ====================================================================== */
/* Argument checking                                                      */
/* ====================================================================== */

#define EXPECT(code, call)                                                           \
    do {                                                                             \
        const int rc_ = (call);                                                      \
        check(rc_ == (code), "%s returned %d (%s), expected %d (%s)", #call, rc_,   \
              sa_strerror(rc_), (code), sa_strerror(code));                          \
    } while (0)

static void test_bad_args(void)
{
    set_where("arguments");
    enum { HKV = 2, H = 4, D = 16, GS = 8, ROWS = 20, S = 20, NG = D / GS };
    float *kf = xmalloc(HKV * ROWS * D * 4), *vf = xmalloc(HKV * ROWS * D * 4);
    int8_t *kq = xmalloc(HKV * ROWS * D), *vq = xmalloc(HKV * ROWS * D);
    float *ks = xmalloc(HKV * ROWS * NG * 4), *vs = xmalloc(HKV * ROWS * NG * 4);
    fill_gauss(kf, HKV * ROWS * D), fill_gauss(vf, HKV * ROWS * D);
    sa_quantize_q8(kf, HKV * ROWS, D, GS, kq, ks);
    sa_quantize_q8(vf, HKV * ROWS, D, GS, vq, vs);
    const sa_kv K = {SA_DTYPE_F32, HKV, ROWS, ROWS, D, 0, kf, NULL, NULL};
    const sa_kv V = {SA_DTYPE_F32, HKV, ROWS, ROWS, D, 0, vf, NULL, NULL};
    const sa_kv KQ = {SA_DTYPE_Q8, HKV, ROWS, ROWS, D, GS, NULL, kq, ks};
    const sa_kv VQ = {SA_DTYPE_Q8, HKV, ROWS, ROWS, D, GS, NULL, vq, vs};
    float q[H * D], q_nan[H * D], q_inf[H * D], qp[H * 3 * D], qp_nan[H * 3 * D];
    fill_gauss(q, H * D), fill_gauss(qp, H * 3 * D);
    memcpy(q_nan, q, sizeof q), memcpy(q_inf, q, sizeof q), memcpy(qp_nan, qp, sizeof qp);
    q_nan[H * D - 1] = NAN;
    q_inf[5] = -INFINITY;
    qp_nan[2 * 3 * D + D + 1] = NAN;
    float out[H * D], pout[H * 3 * D], probe[H * S], imp[S], p[S];
    int32_t blocks[H * S];
    for (int i = 0; i < S; i++)
        imp[i] = 1.0f, p[i] = 0.5f;
    const sa_select_params P = {.block_size = 4, .k_blocks = 2, .n_probe = 2, .recency = 1,
                                .importance_blocks = 1, .sink_blocks = 0, .share = SA_SHARE_HEAD};
    sa_kv k;
    sa_select_params pp;
    const float sc = 0.25f;

    /* The valid baseline of each call succeeds. */
    EXPECT(SA_OK, sa_probe_scores(q, H, &K, S, 4, 2, probe, 1));
    EXPECT(SA_OK, sa_select_blocks(q, H, &KQ, S, &P, imp, S, blocks, 1));
    EXPECT(SA_OK, sa_sparse_decode(q, H, &K, &V, S, &P, imp, S, sc, out, blocks, 1));
    EXPECT(SA_OK, sa_sparse_decode(q, H, &KQ, &VQ, S, &P, NULL, 0, sc, out, NULL, 2));
    EXPECT(SA_OK, sa_dense_decode(q, H, &KQ, &VQ, S, sc, out, 1));
    EXPECT(SA_OK, sa_prefill(qp, H, 3, &K, &V, S - 3, NULL, NULL, 0, sc, pout, imp, 1));

    /* NULL pointers. */
    EXPECT(SA_ERR_NULL, sa_probe_scores(NULL, H, &K, S, 4, 2, probe, 1));
    EXPECT(SA_ERR_NULL, sa_probe_scores(q, H, NULL, S, 4, 2, probe, 1));
    EXPECT(SA_ERR_NULL, sa_probe_scores(q, H, &K, S, 4, 2, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_select_blocks(q, H, &K, S, NULL, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_NULL, sa_select_blocks(q, H, &K, S, &P, NULL, 0, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_select_blocks(NULL, H, &K, S, &P, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_NULL, sa_sparse_decode(NULL, H, &K, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_sparse_decode(q, H, NULL, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_sparse_decode(q, H, &K, NULL, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_sparse_decode(q, H, &K, &V, S, NULL, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_sparse_decode(q, H, &K, &V, S, &P, NULL, 0, sc, NULL, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_dense_decode(NULL, H, &K, &V, S, sc, out, 1));
    EXPECT(SA_ERR_NULL, sa_dense_decode(q, H, NULL, &V, S, sc, out, 1));
    EXPECT(SA_ERR_NULL, sa_dense_decode(q, H, &K, NULL, S, sc, out, 1));
    EXPECT(SA_ERR_NULL, sa_dense_decode(q, H, &K, &V, S, sc, NULL, 1));
    EXPECT(SA_ERR_NULL, sa_prefill(NULL, H, 3, &K, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_NULL, sa_prefill(qp, H, 3, NULL, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_NULL, sa_prefill(qp, H, 3, &K, NULL, 0, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_NULL, sa_prefill(qp, H, 3, &K, &V, 0, NULL, NULL, 0, sc, NULL, imp, 1));
    EXPECT(SA_ERR_NULL, sa_prefill(qp, H, 3, &K, &V, 0, NULL, NULL, 0, sc, pout, NULL, 1));
    k = K, k.f32 = NULL;
    EXPECT(SA_ERR_NULL, sa_dense_decode(q, H, &k, &V, S, sc, out, 1));
    k = KQ, k.q8 = NULL;
    EXPECT(SA_ERR_NULL, sa_probe_scores(q, H, &k, S, 4, 2, probe, 1));
    k = KQ, k.scales = NULL;
    EXPECT(SA_ERR_NULL, sa_select_blocks(q, H, &k, S, &P, NULL, 0, blocks, 1));
    k = VQ, k.q8 = NULL;
    EXPECT(SA_ERR_NULL, sa_sparse_decode(q, H, &KQ, &k, S, &P, NULL, 0, sc, out, NULL, 1));

    /* seq_len 0 or beyond the rows. */
    EXPECT(SA_ERR_SEQ_LEN, sa_probe_scores(q, H, &K, 0, 4, 2, probe, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_probe_scores(q, H, &K, ROWS + 1, 4, 2, probe, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_select_blocks(q, H, &K, 0, &P, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_select_blocks(q, H, &KQ, ROWS + 1, &P, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_sparse_decode(q, H, &K, &V, 0, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_sparse_decode(q, H, &K, &V, -3, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_sparse_decode(q, H, &K, &V, ROWS + 1, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_dense_decode(q, H, &K, &V, 0, sc, out, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_dense_decode(q, H, &KQ, &VQ, ROWS + 1, sc, out, 1));
    k = V, k.n_rows = S - 1; /* V holds fewer rows than K */
    EXPECT(SA_ERR_SEQ_LEN, sa_dense_decode(q, H, &K, &k, S, sc, out, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_sparse_decode(q, H, &K, &k, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_prefill(qp, H, 3, &K, &V, ROWS - 2, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_SEQ_LEN, sa_prefill(qp, H, 3, &K, &k, S - 3, NULL, NULL, 0, sc, pout, imp, 1));

    /* block_size, k_blocks, n_probe < 1 and other selection knobs. */
    EXPECT(SA_ERR_PARAM, sa_probe_scores(q, H, &K, S, 0, 2, probe, 1));
    EXPECT(SA_ERR_PARAM, sa_probe_scores(q, H, &K, S, 4, 0, probe, 1));
    EXPECT(SA_ERR_PARAM, sa_probe_scores(q, H, &K, S, -1, 2, probe, 1));
    static const char *const knob[] = {"block_size 0", "k_blocks 0", "n_probe 0", "n_probe -3",
                                       "k_blocks -1", "recency 2", "share 2",
                                       "sink_blocks -1", "importance_blocks -1"};
    for (int i = 0; i < LEN(knob); i++) {
        pp = P;
        switch (i) {
        case 0: pp.block_size = 0; break;
        case 1: pp.k_blocks = 0; break;
        case 2: pp.n_probe = 0; break;
        case 3: pp.n_probe = -3; break;
        case 4: pp.k_blocks = -1; break;
        case 5: pp.recency = 2; break;
        case 6: pp.share = 2; break;
        case 7: pp.sink_blocks = -1; break;
        default: pp.importance_blocks = -1; break;
        }
        set_where("arguments, %s", knob[i]);
        EXPECT(SA_ERR_PARAM, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        EXPECT(SA_ERR_PARAM, sa_sparse_decode(q, H, &K, &V, S, &pp, NULL, 0, sc, out, NULL, 1));
        EXPECT(SA_ERR_PARAM, sa_sparse_decode(q, H, &KQ, &VQ, S, &pp, imp, S, sc, out, blocks, 2));
    }
    set_where("arguments");

    /* GQA and shapes. */
    EXPECT(SA_ERR_GQA, sa_probe_scores(q, 3, &K, S, 4, 2, probe, 1));
    EXPECT(SA_ERR_GQA, sa_select_blocks(q, 3, &KQ, S, &P, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_GQA, sa_sparse_decode(q, 3, &K, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_GQA, sa_dense_decode(q, 1, &K, &V, S, sc, out, 1));
    EXPECT(SA_ERR_GQA, sa_prefill(qp, 3, 3, &K, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_SHAPE, sa_dense_decode(q, 0, &K, &V, S, sc, out, 1));
    EXPECT(SA_ERR_SHAPE, sa_sparse_decode(q, -2, &K, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_SHAPE, sa_prefill(qp, H, 0, &K, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));
    EXPECT(SA_ERR_SHAPE, sa_prefill(qp, H, 3, &K, &V, -1, NULL, NULL, 0, sc, pout, imp, 1));
    k = K, k.head_dim = 0;
    EXPECT(SA_ERR_SHAPE, sa_dense_decode(q, H, &k, &V, S, sc, out, 1));
    k = K, k.n_kv_heads = 0;
    EXPECT(SA_ERR_SHAPE, sa_probe_scores(q, H, &k, S, 4, 2, probe, 1));
    k = K, k.head_stride = ROWS - 1;
    EXPECT(SA_ERR_SHAPE, sa_dense_decode(q, H, &k, &V, S - 1, sc, out, 1));
    k = V, k.head_dim = D / 2;
    EXPECT(SA_ERR_SHAPE, sa_dense_decode(q, H, &K, &k, S, sc, out, 1));
    k = V, k.n_kv_heads = 1;
    EXPECT(SA_ERR_SHAPE, sa_sparse_decode(q, H, &K, &k, S, &P, NULL, 0, sc, out, NULL, 1));

    /* dtypes and q8 groups. */
    EXPECT(SA_ERR_DTYPE, sa_dense_decode(q, H, &K, &VQ, S, sc, out, 1));
    EXPECT(SA_ERR_DTYPE, sa_sparse_decode(q, H, &KQ, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_DTYPE, sa_prefill(qp, H, 3, &KQ, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));
    k = K, k.dtype = 7;
    EXPECT(SA_ERR_DTYPE, sa_probe_scores(q, H, &k, S, 4, 2, probe, 1));
    k = KQ, k.group_size = 3;
    EXPECT(SA_ERR_GROUP, sa_probe_scores(q, H, &k, S, 4, 2, probe, 1));
    EXPECT(SA_ERR_GROUP, sa_select_blocks(q, H, &k, S, &P, NULL, 0, blocks, 1));
    k = KQ, k.group_size = 0;
    EXPECT(SA_ERR_GROUP, sa_dense_decode(q, H, &k, &VQ, S, sc, out, 1));
    k = VQ, k.group_size = 5;
    EXPECT(SA_ERR_GROUP, sa_sparse_decode(q, H, &KQ, &k, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_GROUP, sa_prefill(qp, H, 3, &KQ, &k, 0, NULL, NULL, 0, sc, pout, imp, 1));

    /* NaN / Inf in q. */
    EXPECT(SA_ERR_Q_VALUES, sa_probe_scores(q_nan, H, &K, S, 4, 2, probe, 1));
    EXPECT(SA_ERR_Q_VALUES, sa_select_blocks(q_inf, H, &KQ, S, &P, NULL, 0, blocks, 1));
    EXPECT(SA_ERR_Q_VALUES, sa_sparse_decode(q_nan, H, &K, &V, S, &P, NULL, 0, sc, out, NULL, 1));
    EXPECT(SA_ERR_Q_VALUES, sa_dense_decode(q_inf, H, &KQ, &VQ, S, sc, out, 1));
    EXPECT(SA_ERR_Q_VALUES, sa_prefill(qp_nan, H, 3, &K, &V, 0, NULL, NULL, 0, sc, pout, imp, 1));

    /* scale <= 0, NaN, Inf. */
    static const float bad_scales[] = {0.0f, -0.0f, -1.0f, NAN, INFINITY};
    for (int i = 0; i < LEN(bad_scales); i++) {
        set_where("arguments, scale %g", bad_scales[i]);
        EXPECT(SA_ERR_SCALE, sa_sparse_decode(q, H, &K, &V, S, &P, NULL, 0, bad_scales[i], out,
                                              NULL, 1));
        EXPECT(SA_ERR_SCALE, sa_dense_decode(q, H, &KQ, &VQ, S, bad_scales[i], out, 1));
        EXPECT(SA_ERR_SCALE, sa_prefill(qp, H, 3, &K, &V, 0, NULL, NULL, 0, bad_scales[i], pout, imp, 1));
    }
    set_where("arguments");

    /* sa_decode_batch: the batch's own arguments, then a bad call among
     * good ones: its error and index, and no output written (the good
     * calls' included). */
    {
        set_where("arguments, sa_decode_batch");
        int failed = 99;
        EXPECT(SA_OK, sa_decode_batch(NULL, 0, 1, &failed));
        check(failed == -1, "an empty batch reported call %d", failed);
        EXPECT(SA_ERR_SHAPE, sa_decode_batch(NULL, -1, 1, NULL));
        EXPECT(SA_ERR_NULL, sa_decode_batch(NULL, 2, 1, &failed));
        float *bout = xmalloc(3 * H * D * 4);
        for (int i = 0; i < 3 * H * D; i++)
            bout[i] = -7.0f;
        sa_decode_call calls[3] = {
            {q, H, &K, &V, S, &P, NULL, 0, sc, bout, NULL},
            {q, H, &KQ, &VQ, S, NULL, NULL, 0, sc, bout + H * D, NULL},
            {q, H, &K, &V, S, &P, NULL, 0, sc, bout + 2 * H * D, NULL}};
        static const struct { int call, rc; } bad[] = {
            {2, SA_ERR_SEQ_LEN}, {1, SA_ERR_NULL}, {0, SA_ERR_Q_VALUES}, {2, SA_ERR_SCALE},
            {1, SA_ERR_DTYPE}, {0, SA_ERR_IMPORTANCE}, {2, SA_ERR_NULL}, {1, SA_ERR_GQA}};
        for (int b = 0; b < LEN(bad); b++) {
            sa_decode_call c[3] = {calls[0], calls[1], calls[2]};
            sa_decode_call *x = &c[bad[b].call];
            switch (b) {
            case 0: x->seq_len = ROWS + 1; break;
            case 1: x->v = NULL; break;
            case 2: x->q = q_nan; break;
            case 3: x->scale = NAN; break;
            case 4: x->v = &V; break;
            case 5: x->importance = imp, x->n_importance = S - 1; break;
            case 6: x->out = NULL; break;
            case 7: x->n_heads = 3; break;
            }
            failed = 99;
            EXPECT(bad[b].rc, sa_decode_batch(c, 3, 2, &failed));
            check(failed == bad[b].call, "case %d: sa_decode_batch named call %d, not %d", b,
                  failed, bad[b].call);
            int untouched = 1;
            for (int i = 0; i < 3 * H * D; i++)
                untouched &= bout[i] == -7.0f;
            check(untouched, "case %d: a refused batch wrote outputs", b);
        }
        EXPECT(SA_OK, sa_decode_batch(calls, 3, 2, &failed));
        check(failed == -1, "a good batch reported call %d", failed);
        float *want = xmalloc(H * D * 4);
        EXPECT(SA_OK, sa_dense_decode(q, H, &KQ, &VQ, S, sc, want, 1));
        check(!memcmp(want, bout + H * D, H * D * 4), "the batch's dense call differs alone");
        free(want), free(bout);
        set_where("arguments");
    }

    /* importance shorter than seq_len. */
    EXPECT(SA_ERR_IMPORTANCE, sa_select_blocks(q, H, &K, S, &P, imp, S - 1, blocks, 1));
    EXPECT(SA_ERR_IMPORTANCE, sa_select_blocks(q, H, &KQ, S, &P, imp, -1, blocks, 1));
    EXPECT(SA_ERR_IMPORTANCE, sa_sparse_decode(q, H, &K, &V, S, &P, imp, 0, sc, out, NULL, 1));
    EXPECT(SA_OK, sa_select_blocks(q, H, &K, S - 1, &P, imp, S - 1, blocks, 1));

    /* Sparse prefill: bad parameters, a prior shorter than start or with
     * NaN before start (after it, it is not read), minmax without bounds or
     * with bounds for other rows. */
    {
        const int st = S - 3;
        float pimp[S];
        EXPECT(SA_OK, sa_prefill(qp, H, 3, &K, &V, st, &P, imp, st, sc, pout, pimp, 2));
        EXPECT(SA_OK, sa_prefill(qp, H, 3, &KQ, &VQ, st, &P, NULL, 0, sc, pout, pimp, 1));
        EXPECT(SA_ERR_IMPORTANCE, sa_prefill(qp, H, 3, &K, &V, st, &P, imp, st - 1, sc, pout,
                                             pimp, 1));
        pp = P, pp.k_blocks = 0;
        EXPECT(SA_ERR_PARAM, sa_prefill(qp, H, 3, &K, &V, st, &pp, NULL, 0, sc, pout, pimp, 1));
        pp = P, pp.block_size = 0;
        EXPECT(SA_ERR_PARAM, sa_prefill(qp, H, 3, &K, &V, st, &pp, NULL, 0, sc, pout, pimp, 1));
        pp = P, pp.scoring = SA_SCORING_MINMAX, pp.bounds = NULL;
        EXPECT(SA_ERR_BOUNDS, sa_prefill(qp, H, 3, &K, &V, st, &pp, NULL, 0, sc, pout, pimp, 1));
        float *bad = xmalloc((size_t)S * sizeof *bad);
        for (int t = 0; t < S; t++)
            bad[t] = 1.0f;
        bad[st] = NAN;
        EXPECT(SA_OK, sa_prefill(qp, H, 3, &K, &V, st, &P, bad, S, sc, pout, pimp, 1));
        bad[st - 1] = INFINITY;
        EXPECT(SA_ERR_IMPORTANCE_VALUES,
               sa_prefill(qp, H, 3, &K, &V, st, &P, bad, S, sc, pout, pimp, 1));
        free(bad);
    }

    /* importance with NaN or Inf in [0, seq_len); past seq_len it is not read. */
    {
        float *bad = xmalloc((size_t)S * sizeof *bad);
        for (int t = 0; t < S; t++)
            bad[t] = 1.0f;
        bad[S - 1] = NAN;
        EXPECT(SA_ERR_IMPORTANCE_VALUES, sa_select_blocks(q, H, &K, S, &P, bad, S, blocks, 1));
        EXPECT(SA_OK, sa_select_blocks(q, H, &K, S - 1, &P, bad, S, blocks, 1));
        bad[S - 1] = 1.0f;
        bad[0] = -INFINITY;
        EXPECT(SA_ERR_IMPORTANCE_VALUES,
               sa_sparse_decode(q, H, &KQ, &VQ, S, &P, bad, S, sc, out, NULL, 1));
        free(bad);
    }

    /* scoring="minmax" and its bounds. */
    {
        enum { NBB = S / 4 };
        sa_bounds B = {.n_kv_heads = HKV, .head_dim = D, .block_size = 4, .scale_group = GS,
                       .head_stride = NBB};
        B.mn = xmalloc(HKV * NBB * D), B.mx = xmalloc(HKV * NBB * D);
        B.scales = xmalloc(HKV * NBB * NG * 4);
        sa_bounds b;
        EXPECT(SA_OK, sa_bounds_update(&K, 0, S, &B));
        EXPECT(SA_OK, sa_bounds_update(&KQ, S - 3, S, &B));
        EXPECT(SA_ERR_NULL, sa_bounds_update(NULL, 0, S, &B));
        EXPECT(SA_ERR_NULL, sa_bounds_update(&K, 0, S, NULL));
        b = B, b.mx = NULL;
        EXPECT(SA_ERR_NULL, sa_bounds_update(&K, 0, S, &b));
        b = B, b.n_kv_heads = 1;
        EXPECT(SA_ERR_SHAPE, sa_bounds_update(&K, 0, S, &b));
        b = B, b.block_size = 0;
        EXPECT(SA_ERR_SHAPE, sa_bounds_update(&K, 0, S, &b));
        b = B, b.scale_group = 3;
        EXPECT(SA_ERR_GROUP, sa_bounds_update(&K, 0, S, &b));
        b = B;
        EXPECT(SA_ERR_SEQ_LEN, sa_bounds_update(&K, 0, ROWS + 1, &b));
        EXPECT(SA_ERR_SEQ_LEN, sa_bounds_update(&K, 5, 4, &b));
        EXPECT(SA_ERR_SEQ_LEN, sa_bounds_update(&K, -1, 4, &b));
        b = B, b.head_stride = NBB - 1;
        EXPECT(SA_ERR_SEQ_LEN, sa_bounds_update(&K, 0, S, &b));

        pp = P, pp.scoring = SA_SCORING_MINMAX, pp.bounds = &B;
        EXPECT(SA_OK, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        EXPECT(SA_OK, sa_sparse_decode(q, H, &KQ, &VQ, S, &pp, imp, S, sc, out, blocks, 2));
        pp.scoring = 2;
        EXPECT(SA_ERR_PARAM, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        pp.scoring = SA_SCORING_MINMAX, pp.bounds = NULL;
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        EXPECT(SA_ERR_BOUNDS, sa_sparse_decode(q, H, &K, &V, S, &pp, NULL, 0, sc, out, NULL, 1));
        pp.bounds = &b;
        b = B, b.scales = NULL;
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        b = B, b.block_size = 5; /* made for another block size */
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        b = B, b.k_rows = S - 1; /* made for another seq_len */
        EXPECT(SA_ERR_BOUNDS, sa_sparse_decode(q, H, &K, &V, S, &pp, NULL, 0, sc, out, NULL, 1));
        b = B, b.head_dim = D / 2;
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        b = B, b.scale_group = 3;
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        b = B, b.head_stride = NBB - 1;
        EXPECT(SA_ERR_BOUNDS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        free(B.mn), free(B.mx), free(B.scales);
    }

    /* Probe-row copies: refused unless made for this K, seq_len, block_size
     * and n_probe. */
    {
        sa_probe_rows R = probe_rows_new(&KQ, S, 8, 4), r;
        pp = P, pp.block_size = 8, pp.n_probe = 4, pp.probe_rows = &R;
        EXPECT(SA_OK, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        EXPECT(SA_OK, sa_sparse_decode(q, H, &KQ, &VQ, S, &pp, imp, S, sc, out, blocks, 2));
        EXPECT(SA_OK, sa_sparse_decode(q, H, &KQ, &VQ, S - 9, &pp, imp, S, sc, out, NULL, 1));
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &K, S, &pp, NULL, 0, blocks, 1));
        pp.probe_rows = &r;
        r = R, r.k_rows = S - 1;              /* copies of an older K */
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.block_size = 4;
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.n_probe = 2;
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.rows.group_size = KQ.group_size * 2;
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.rows.n_rows = S / 8 * 4 - 1; /* too few rows for the full blocks */
        EXPECT(SA_ERR_PROBE_ROWS, sa_sparse_decode(q, H, &KQ, &VQ, S, &pp, NULL, 0, sc, out, NULL, 1));
        r = R, r.rows.scales = NULL;
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.rows.n_kv_heads = 1;
        EXPECT(SA_ERR_PROBE_ROWS, sa_select_blocks(q, H, &KQ, S, &pp, NULL, 0, blocks, 1));
        r = R, r.k_rows = 4;                  /* a gap: rows 4..9 never copied */
        EXPECT(SA_ERR_PROBE_ROWS, sa_probe_rows_update(&KQ, 10, S, &r));
        r = R;
        EXPECT(SA_ERR_PROBE_ROWS, sa_probe_rows_update(&K, 0, S, &r));
        EXPECT(SA_ERR_NULL, sa_probe_rows_update(&KQ, 0, S, NULL));
        EXPECT(SA_ERR_SEQ_LEN, sa_probe_rows_update(&KQ, 0, ROWS + 1, &r));
        EXPECT(SA_ERR_SEQ_LEN, sa_probe_rows_update(&KQ, 5, 4, &r));
        r = R, r.n_probe = 0;
        EXPECT(SA_ERR_PARAM, sa_probe_rows_update(&KQ, 0, S, &r));
        r = R, r.rows.n_rows = 3;             /* rows past the capacity are skipped */
        EXPECT(SA_OK, sa_probe_rows_update(&KQ, 0, S, &r));
        probe_rows_free(&R);
    }

    /* The bandwidth probe: the checksum is the sum of the 64-bit words. */
    {
        enum { WORDS = 1001 };
        uint64_t *buf = xmalloc(WORDS * 8), want = 0, sum = 0;
        for (int i = 0; i < WORDS; i++)
            want += buf[i] = next_u64();
        EXPECT(SA_ERR_NULL, sa_stream_read(NULL, 8, 1, &sum));
        EXPECT(SA_ERR_NULL, sa_stream_read(buf, 8, 1, NULL));
        EXPECT(SA_ERR_SHAPE, sa_stream_read(buf, -1, 1, &sum));
        for (int th = 1; th <= 3; th++) {
            EXPECT(SA_OK, sa_stream_read(buf, WORDS * 8, th, &sum));
            check(sum == want, "sa_stream_read threads=%d: checksum %llx, expected %llx", th,
                  (unsigned long long)sum, (unsigned long long)want);
        }
        free(buf);
    }

    /* sa_quantize_q8: arguments, and values it must refuse. */
    int8_t qq[D];
    float qs[D];
    EXPECT(SA_ERR_NULL, sa_quantize_q8(NULL, 1, D, GS, qq, qs));
    EXPECT(SA_ERR_NULL, sa_quantize_q8(q, 1, D, GS, NULL, qs));
    EXPECT(SA_ERR_NULL, sa_quantize_q8(q, 1, D, GS, qq, NULL));
    EXPECT(SA_ERR_SHAPE, sa_quantize_q8(q, -1, D, GS, qq, qs));
    EXPECT(SA_ERR_SHAPE, sa_quantize_q8(q, 1, 0, GS, qq, qs));
    EXPECT(SA_ERR_SHAPE, sa_quantize_q8(q, 1, D, 0, qq, qs));
    EXPECT(SA_ERR_GROUP, sa_quantize_q8(q, 1, D, 3, qq, qs));
    EXPECT(SA_OK, sa_quantize_q8(q, 0, D, GS, qq, qs));
    EXPECT(SA_ERR_VALUES, sa_quantize_q8(q_nan, H, D, GS, qq, qs));
    {
        static const float bad_values[] = {INFINITY, -INFINITY, 0x1p48f, -0x1p48f, 3e38f};
        float x[D];
        for (int i = 0; i < LEN(bad_values); i++) {
            memcpy(x, q, sizeof x);
            x[D / 2] = bad_values[i];
            set_where("arguments, sa_quantize_q8 of %g", bad_values[i]);
            EXPECT(SA_ERR_VALUES, sa_quantize_q8(x, 1, D, GS, qq, qs));
        }
        x[D / 2] = nextafterf(0x1p48f, 0.0f);    /* the largest value below the limit */
        set_where("arguments");
        EXPECT(SA_OK, sa_quantize_q8(x, 1, D, GS, qq, qs));
    }

    /* sa_kv_append: checks everything before writing anything. */
    for (int dt = 0; dt < 2; dt++) {
        const size_t nf = HKV * ROWS * D, nq = HKV * ROWS * NG;
        float *ck = xmalloc(nf * 4), *cv = xmalloc(nf * 4), *cks = xmalloc(nq * 4),
              *cvs = xmalloc(nq * 4);
        int8_t *ckq = xmalloc(nf), *cvq = xmalloc(nf);
        memset(ck, 0, nf * 4), memset(cv, 0, nf * 4), memset(cks, 0, nq * 4);
        memset(cvs, 0, nq * 4), memset(ckq, 0, nf), memset(cvq, 0, nf);
        const sa_kv CK = dt ? (sa_kv){SA_DTYPE_Q8, HKV, ROWS, ROWS, D, GS, NULL, ckq, cks}
                            : (sa_kv){SA_DTYPE_F32, HKV, ROWS, ROWS, D, 0, ck, NULL, NULL};
        const sa_kv CV = dt ? (sa_kv){SA_DTYPE_Q8, HKV, ROWS, ROWS, D, GS, NULL, cvq, cvs}
                            : (sa_kv){SA_DTYPE_F32, HKV, ROWS, ROWS, D, 0, cv, NULL, NULL};
        enum { BS = 4, NBB = ROWS / BS, PCNT = 2, PROWS = NBB * PCNT };
        sa_bounds B = {.n_kv_heads = HKV, .head_dim = D, .block_size = BS, .scale_group = GS,
                       .head_stride = NBB, .k_rows = 0};
        B.mn = xmalloc(HKV * NBB * D), B.mx = xmalloc(HKV * NBB * D);
        B.scales = xmalloc(HKV * NBB * NG * 4);
        memset(B.mn, 0, HKV * NBB * D), memset(B.mx, 0, HKV * NBB * D);
        memset(B.scales, 0, HKV * NBB * NG * 4);
        sa_probe_rows R = {.rows = CK, .block_size = BS, .n_probe = PCNT, .k_rows = 0};
        R.rows.head_stride = R.rows.n_rows = PROWS;
        float *rf = xmalloc(HKV * PROWS * D * 4), *rs = xmalloc(HKV * PROWS * NG * 4);
        int8_t *rq = xmalloc(HKV * PROWS * D);
        memset(rf, 0, HKV * PROWS * D * 4), memset(rs, 0, HKV * PROWS * NG * 4);
        memset(rq, 0, HKV * PROWS * D);
        if (dt)
            R.rows.q8 = rq, R.rows.scales = rs;
        else
            R.rows.f32 = rf;
        float src[HKV * 3 * D], src2[HKV * 3 * D];
        fill_gauss(src, HKV * 3 * D);
        fill_gauss(src2, HKV * 3 * D);
        set_where("arguments, sa_kv_append %s", dt ? "q8" : "f32");
        EXPECT(SA_OK, sa_kv_append(&CK, &CV, 0, src, src2, 3, &B, &R, NULL));
        check(B.k_rows == 3 && R.k_rows == 3, "sa_kv_append left k_rows at %d / %d, not 3",
              B.k_rows, R.k_rows);
        /* a snapshot of everything, then appends that must be refused */
        void *snap[9];
        const void *live[9] = {ck, cv, cks, cvs, ckq, cvq, B.mn, B.scales, dt ? (void *)rq : rf};
        const size_t len[9] = {nf * 4, nf * 4, nq * 4, nq * 4, nf, nf, HKV * NBB * D,
                               HKV * NBB * NG * 4, dt ? HKV * PROWS * D : HKV * PROWS * D * 4};
        for (int i = 0; i < 9; i++)
            memcpy(snap[i] = xmalloc(len[i]), live[i], len[i]);
        EXPECT(SA_ERR_NULL, sa_kv_append(NULL, &CV, 3, src, src2, 3, NULL, NULL, NULL));
        EXPECT(SA_ERR_NULL, sa_kv_append(&CK, &CV, 3, NULL, src2, 3, NULL, NULL, NULL));
        EXPECT(SA_ERR_NULL, sa_kv_append(&CK, &CV, 3, src, NULL, 3, NULL, NULL, NULL));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_append(&CK, &CV, ROWS - 2, src, src2, 3, NULL, NULL, NULL));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_append(&CK, &CV, -1, src, src2, 3, NULL, NULL, NULL));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_append(&CK, &CV, 3, src, src2, -1, NULL, NULL, NULL));
        EXPECT(SA_ERR_BOUNDS, sa_kv_append(&CK, &CV, 4, src, src2, 3, &B, &R, NULL)); /* bounds cover 3 */
        EXPECT(SA_ERR_PROBE_ROWS, sa_kv_append(&CK, &CV, 4, src, src2, 3, NULL, &R, NULL)); /* gap */
        const float keep = src[HKV * 3 * D - 1];
        src[HKV * 3 * D - 1] = NAN;     /* the last value of the last KV head */
        EXPECT(SA_ERR_K_VALUES, sa_kv_append(&CK, &CV, 3, src, src2, 3, &B, &R, NULL));
        src[HKV * 3 * D - 1] = -0x1p48f;
        EXPECT(SA_ERR_K_VALUES, sa_kv_append(&CK, &CV, 3, src, src2, 3, &B, &R, NULL));
        src[HKV * 3 * D - 1] = keep;
        src2[0] = 3e38f;                /* finite, but a score or sum could overflow */
        EXPECT(SA_ERR_V_VALUES, sa_kv_append(&CK, &CV, 3, src, src2, 3, &B, &R, NULL));
        int same = B.k_rows == 3 && R.k_rows == 3;
        for (int i = 0; i < 9; i++)
            same &= memcmp(snap[i], live[i], len[i]) == 0;
        check(same, "sa_kv_append wrote to the cache before refusing a call");
        src2[0] = 1.0f;
        EXPECT(SA_OK, sa_kv_append(&CK, &CV, 3, src, src2, 3, &B, &R, NULL));
        /* the bounds and copies are those made from scratch over the 6 rows */
        sa_kv k6 = CK;
        k6.n_rows = 6;
        sa_bounds B2 = B;
        B2.mn = xmalloc(HKV * NBB * D), B2.mx = xmalloc(HKV * NBB * D);
        B2.scales = xmalloc(HKV * NBB * NG * 4);
        EXPECT(SA_OK, sa_bounds_update(&k6, 0, 6, &B2));
        same = B.k_rows == 6 && R.k_rows == 6;
        for (int kh = 0; kh < HKV; kh++)
            for (int blk = 0; blk < 2; blk++) {
                const size_t at = (size_t)kh * NBB + blk;
                same &= !memcmp(B.mn + at * D, B2.mn + at * D, D) &&
                        !memcmp(B.mx + at * D, B2.mx + at * D, D) &&
                        !memcmp(B.scales + at * NG, B2.scales + at * NG, NG * 4);
            }
        check(same, "sa_kv_append: bounds differ from sa_bounds_update over the same rows");
        free(B2.mn), free(B2.mx), free(B2.scales);
        for (int i = 0; i < 9; i++)
            free(snap[i]);
        free(ck), free(cv), free(cks), free(cvs), free(ckq), free(cvq);
        free(B.mn), free(B.mx), free(B.scales), free(rf), free(rs), free(rq);
    }
    set_where("arguments");

    /* The microbenchmark entry points. */
    float dots[S];
    EXPECT(SA_ERR_NULL, sa_kernel_q8_dot(NULL, ks, D, GS, kq, ks, S, dots));
    EXPECT(SA_ERR_NULL, sa_kernel_q8_dot(kq, NULL, D, GS, kq, ks, S, dots));
    EXPECT(SA_ERR_NULL, sa_kernel_q8_dot(kq, ks, D, GS, NULL, ks, S, dots));
    EXPECT(SA_ERR_NULL, sa_kernel_q8_dot(kq, ks, D, GS, kq, NULL, S, dots));
    EXPECT(SA_ERR_NULL, sa_kernel_q8_dot(kq, ks, D, GS, kq, ks, S, NULL));
    EXPECT(SA_ERR_SHAPE, sa_kernel_q8_dot(kq, ks, 0, GS, kq, ks, S, dots));
    EXPECT(SA_ERR_SHAPE, sa_kernel_q8_dot(kq, ks, D, 0, kq, ks, S, dots));
    EXPECT(SA_ERR_SHAPE, sa_kernel_q8_dot(kq, ks, D, GS, kq, ks, -1, dots));
    EXPECT(SA_ERR_GROUP, sa_kernel_q8_dot(kq, ks, D, 3, kq, ks, S, dots));
    EXPECT(SA_OK, sa_kernel_q8_dot(kq, ks, D, GS, kq, ks, 0, dots));
    EXPECT(SA_ERR_NULL, sa_kernel_accumulate_v(NULL, &V, S, out));
    EXPECT(SA_ERR_NULL, sa_kernel_accumulate_v(p, NULL, S, out));
    EXPECT(SA_ERR_NULL, sa_kernel_accumulate_v(p, &VQ, S, NULL));
    EXPECT(SA_ERR_SEQ_LEN, sa_kernel_accumulate_v(p, &V, ROWS + 1, out));
    EXPECT(SA_ERR_SEQ_LEN, sa_kernel_accumulate_v(p, &VQ, -1, out));
    k = VQ, k.group_size = 3;
    EXPECT(SA_ERR_GROUP, sa_kernel_accumulate_v(p, &k, S, out));
    EXPECT(SA_OK, sa_kernel_accumulate_v(p, &V, 0, out));

    /* ISA names. */
    const char *before = sa_isa_name();
    EXPECT(SA_ERR_ISA, sa_set_isa("no-such-isa"));
    EXPECT(SA_ERR_ISA, sa_set_isa(""));
    EXPECT(SA_ERR_ISA, sa_set_isa(NULL));
    EXPECT(SA_ERR_ISA, sa_set_isa("NEON"));
#if defined(__aarch64__)
    EXPECT(SA_ERR_ISA, sa_set_isa("avx2"));
#else
    EXPECT(SA_ERR_ISA, sa_set_isa("neon"));
#endif
    check(sa_isa_available("no-such-isa") == 0 && sa_isa_available(NULL) == 0,
          "sa_isa_available accepts an unknown name");
    check(strcmp(sa_isa_name(), before) == 0, "a rejected sa_set_isa changed the ISA");
    check(sa_isa_name_at(-1) == NULL && sa_isa_name_at(sa_isa_count()) == NULL,
          "sa_isa_name_at out of range is not NULL");

    /* Every status has its own text. */
    for (int st = SA_OK; st <= SA_ERR_SIZE; st++)
        check(sa_strerror(st) && strcmp(sa_strerror(st), "unknown status") != 0,
              "sa_strerror(%d) has no text", st);
    check(strcmp(sa_strerror(99), "unknown status") == 0, "sa_strerror(99)");

    free(kf), free(vf), free(kq), free(vq), free(ks), free(vs);
}

/* ---- a cache's updates as single calls --------------------------------- */

/* A cache the way the Python layer lays one out: K, V, key bounds, probe-row
 * copies, channel copy and importance over TC_ROWS rows, all zeroed. */
enum { TC_HKV = 2, TC_D = 64, TC_GS = 32, TC_NG = TC_D / TC_GS, TC_ROWS = 40, TC_BS = 8,
       TC_NB = TC_ROWS / TC_BS, TC_PROBE = 2, TC_CNT = 2, TC_PROWS = TC_NB * TC_CNT };

typedef struct {
    sa_kv k, v;
    sa_bounds b;
    sa_probe_rows r;
    sa_channels c;
    float imp[TC_ROWS];
    void *mem[12];              /* every array, in the order of tc_sizes */
} test_cache;

static void tc_sizes(size_t len[12])
{
    const size_t nf = (size_t)TC_HKV * TC_ROWS * TC_D, ns = (size_t)TC_HKV * TC_ROWS * TC_NG;
    const size_t bb = (size_t)TC_HKV * TC_NB * TC_D, pr = (size_t)TC_HKV * TC_PROWS * TC_D;
    const size_t lens[12] = {nf * 4, nf * 4, nf, nf, ns * 4, ns * 4, bb, bb,
                             (size_t)TC_HKV * TC_NB * TC_NG * 4, pr * 4,
                             pr + (size_t)TC_HKV * TC_PROWS * TC_NG * 4,
                             bb * TC_BS + bb * 4};
    memcpy(len, lens, sizeof lens);
}

static void tc_init(test_cache *tc, int q8)
{
    size_t len[12];
    tc_sizes(len);
    for (int i = 0; i < 12; i++)
        memset(tc->mem[i] = xmalloc(len[i]), 0, len[i]);
    float *kf = tc->mem[0], *vf = tc->mem[1], *ks = tc->mem[4], *vs = tc->mem[5];
    int8_t *kq = tc->mem[2], *vq = tc->mem[3];
    tc->k = q8 ? (sa_kv){SA_DTYPE_Q8, TC_HKV, TC_ROWS, TC_ROWS, TC_D, TC_GS, NULL, kq, ks}
               : (sa_kv){SA_DTYPE_F32, TC_HKV, TC_ROWS, TC_ROWS, TC_D, 0, kf, NULL, NULL};
    tc->v = q8 ? (sa_kv){SA_DTYPE_Q8, TC_HKV, TC_ROWS, TC_ROWS, TC_D, TC_GS, NULL, vq, vs}
               : (sa_kv){SA_DTYPE_F32, TC_HKV, TC_ROWS, TC_ROWS, TC_D, 0, vf, NULL, NULL};
    tc->b = (sa_bounds){TC_HKV, TC_D, TC_BS, TC_GS, TC_NB, 0, tc->mem[6], tc->mem[7],
                        tc->mem[8]};
    tc->r = (sa_probe_rows){.rows = tc->k, .block_size = TC_BS, .n_probe = TC_PROBE};
    tc->r.rows.head_stride = tc->r.rows.n_rows = TC_PROWS;
    int8_t *rq = tc->mem[10];
    tc->r.rows.f32 = q8 ? NULL : tc->mem[9];
    tc->r.rows.q8 = q8 ? rq : NULL;
    tc->r.rows.scales = q8 ? (float *)(rq + (size_t)TC_HKV * TC_PROWS * TC_D) : NULL;
    int8_t *cq = tc->mem[11];
    tc->c = (sa_channels){TC_HKV, TC_D, TC_BS, TC_BS, TC_NB, 0, cq,
                          (float *)(cq + (size_t)TC_HKV * TC_NB * TC_D * TC_BS)};
    memset(tc->imp, 0, sizeof tc->imp);
}

static void tc_free(test_cache *tc)
{
    for (int i = 0; i < 12; i++)
        free(tc->mem[i]);
}

/* rows [r0, r1) of src [TC_HKV, TC_ROWS, TC_D] appended at r0 */
static int tc_append(test_cache *tc, const float *ksrc, const float *vsrc, int r0, int r1)
{
    const int T = r1 - r0;
    float *kn = xmalloc((size_t)TC_HKV * (T ? T : 1) * TC_D * 4);
    float *vn = xmalloc((size_t)TC_HKV * (T ? T : 1) * TC_D * 4);
    for (int kh = 0; kh < TC_HKV; kh++) {
        memcpy(kn + (size_t)kh * T * TC_D, ksrc + ((size_t)kh * TC_ROWS + r0) * TC_D,
               (size_t)T * TC_D * 4);
        memcpy(vn + (size_t)kh * T * TC_D, vsrc + ((size_t)kh * TC_ROWS + r0) * TC_D,
               (size_t)T * TC_D * 4);
    }
    const int rc = sa_kv_append(&tc->k, &tc->v, r0, kn, vn, T, &tc->b, &tc->r, &tc->c);
    free(kn), free(vn);
    return rc;
}

/* Whether a and b hold the same cache of n rows: K and V rows, bounds and
 * channel copy of the blocks those rows span (the channel copy's bytes of
 * the rows a partial block has), probe-row copies of the full blocks, the
 * k_rows of all three, every importance entry. */
static int tc_same(const test_cache *a, const test_cache *b, int n)
{
    int same = a->b.k_rows == n && b->b.k_rows == n && a->r.k_rows == n && b->r.k_rows == n &&
               a->c.k_rows == n && b->c.k_rows == n;
    const int q8 = a->k.dtype == SA_DTYPE_Q8, nb = (n + TC_BS - 1) / TC_BS;
    for (int kh = 0; kh < TC_HKV; kh++) {
        const size_t row = (size_t)kh * TC_ROWS * TC_D, srow = (size_t)kh * TC_ROWS * TC_NG;
        if (q8)
            for (int i = 2; i < 6; i++) {
                const size_t at = i < 4 ? row : srow * 4, len = i < 4 ? (size_t)n * TC_D
                                                                      : (size_t)n * TC_NG * 4;
                same &= !memcmp((char *)a->mem[i] + at, (char *)b->mem[i] + at, len);
            }
        else
            for (int i = 0; i < 2; i++)
                same &= !memcmp((float *)a->mem[i] + row, (float *)b->mem[i] + row,
                                (size_t)n * TC_D * 4);
        for (int blk = 0; blk < nb; blk++) {
            const size_t at = (size_t)kh * TC_NB + blk;
            same &= !memcmp(a->b.mn + at * TC_D, b->b.mn + at * TC_D, TC_D) &&
                    !memcmp(a->b.mx + at * TC_D, b->b.mx + at * TC_D, TC_D) &&
                    !memcmp(a->b.scales + at * TC_NG, b->b.scales + at * TC_NG, TC_NG * 4);
            const int rows = blk < n / TC_BS ? TC_BS : n - blk * TC_BS;
            for (int i = 0; i < TC_D; i++) {
                const size_t c = ((size_t)kh * TC_D + i) * TC_NB + blk;
                same &= !memcmp(a->c.q8 + c * TC_BS, b->c.q8 + c * TC_BS, (size_t)rows) &&
                        a->c.scales[c] == b->c.scales[c];
            }
        }
        const size_t pr = (size_t)kh * TC_PROWS, full = (size_t)(n / TC_BS) * TC_CNT;
        if (q8)
            same &= !memcmp(a->r.rows.q8 + pr * TC_D, b->r.rows.q8 + pr * TC_D, full * TC_D) &&
                    !memcmp(a->r.rows.scales + pr * TC_NG, b->r.rows.scales + pr * TC_NG,
                            full * TC_NG * 4);
        else
            same &= !memcmp(a->r.rows.f32 + pr * TC_D, b->r.rows.f32 + pr * TC_D,
                            full * TC_D * 4);
    }
    return same && !memcmp(a->imp, b->imp, sizeof a->imp);
}

/* Every byte of a cache and its k_rows, for "a refused call wrote nothing". */
typedef struct {
    void *mem[12];
    float imp[TC_ROWS];
    int k_rows[3];
} tc_snapshot;

static void tc_take(const test_cache *tc, tc_snapshot *s)
{
    size_t len[12];
    tc_sizes(len);
    for (int i = 0; i < 12; i++)
        memcpy(s->mem[i] = xmalloc(len[i]), tc->mem[i], len[i]);
    memcpy(s->imp, tc->imp, sizeof s->imp);
    s->k_rows[0] = tc->b.k_rows, s->k_rows[1] = tc->r.k_rows, s->k_rows[2] = tc->c.k_rows;
}

static int tc_unchanged(const test_cache *tc, tc_snapshot *s)
{
    size_t len[12];
    tc_sizes(len);
    int same = !memcmp(s->imp, tc->imp, sizeof s->imp) && s->k_rows[0] == tc->b.k_rows &&
               s->k_rows[1] == tc->r.k_rows && s->k_rows[2] == tc->c.k_rows;
    for (int i = 0; i < 12; i++) {
        same &= !memcmp(s->mem[i], tc->mem[i], len[i]);
        free(s->mem[i]);
    }
    return same;
}

/* sa_kv_truncate leaves a cache holding exactly what one that was only
 * ever given its first m rows holds (bounds and channel copy of a partial
 * last block recomputed, importance of the dropped rows 0), so appends
 * after it give what appends to that cache give; a refused truncation
 * writes nothing.  sa_kv_append_check refuses what sa_kv_append refuses
 * and writes nothing either. */
static void test_kv_updates(void)
{
    float *ka = xmalloc((size_t)TC_HKV * TC_ROWS * TC_D * 4);
    float *va = xmalloc((size_t)TC_HKV * TC_ROWS * TC_D * 4);
    float *kb = xmalloc((size_t)TC_HKV * TC_ROWS * TC_D * 4);
    float *vb = xmalloc((size_t)TC_HKV * TC_ROWS * TC_D * 4);
    fill_gauss(ka, TC_HKV * TC_ROWS * TC_D), fill_gauss(va, TC_HKV * TC_ROWS * TC_D);
    fill_gauss(kb, TC_HKV * TC_ROWS * TC_D), fill_gauss(vb, TC_HKV * TC_ROWS * TC_D);
    for (int i = 0; i < TC_HKV * TC_ROWS * TC_D; i++)
        kb[i] *= 8.0f;          /* other magnitudes: a recomputed block's scales change */
    enum { FULL = 37 };         /* rows before a truncation: block 4 partial */
    static const int KEEP[] = {FULL, 35, 33, 32, 31, 8, 5, 1, 0};
    for (int q8 = 0; q8 < 2; q8++)
        for (int i = 0; i < LEN(KEEP); i++) {
            const int m = KEEP[i];
            set_where("sa_kv_truncate %s, %d of %d rows", q8 ? "q8" : "f32", m, FULL);
            test_cache cut, ref;
            tc_init(&cut, q8), tc_init(&ref, q8);
            EXPECT(SA_OK, tc_append(&cut, ka, va, 0, 20));
            EXPECT(SA_OK, tc_append(&cut, ka, va, 20, FULL));
            for (int t = 0; t < FULL; t++)
                cut.imp[t] = 1.0f + (float)t;
            EXPECT(SA_OK, tc_append(&ref, ka, va, 0, m));
            for (int t = 0; t < m; t++)
                ref.imp[t] = 1.0f + (float)t;
            EXPECT(SA_OK, sa_kv_truncate(&cut.k, m, &cut.b, &cut.r, &cut.c, cut.imp, TC_ROWS));
            check(tc_same(&cut, &ref, m), "the truncated cache differs from one of %d rows", m);
            /* appends after it: other rows in the place of the dropped ones */
            EXPECT(SA_OK, tc_append(&cut, kb, vb, m, FULL));
            EXPECT(SA_OK, tc_append(&ref, kb, vb, m, FULL));
            check(tc_same(&cut, &ref, FULL), "appends after a truncation to %d rows differ", m);
            tc_free(&cut), tc_free(&ref);
        }

    for (int q8 = 0; q8 < 2; q8++) {
        set_where("sa_kv_truncate %s, refused", q8 ? "q8" : "f32");
        test_cache tc;
        tc_init(&tc, q8);
        EXPECT(SA_OK, tc_append(&tc, ka, va, 0, FULL));
        for (int t = 0; t < FULL; t++)
            tc.imp[t] = 1.0f;
        tc_snapshot snap;
        tc_take(&tc, &snap);
        EXPECT(SA_ERR_NULL, sa_kv_truncate(NULL, 3, &tc.b, &tc.r, &tc.c, tc.imp, TC_ROWS));
        EXPECT(SA_ERR_NULL, sa_kv_truncate(&tc.k, 3, NULL, &tc.r, &tc.c, tc.imp, TC_ROWS));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_truncate(&tc.k, FULL + 1, &tc.b, &tc.r, &tc.c, tc.imp,
                                              TC_ROWS));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_truncate(&tc.k, -1, &tc.b, &tc.r, &tc.c, tc.imp, TC_ROWS));
        EXPECT(SA_ERR_IMPORTANCE, sa_kv_truncate(&tc.k, 3, &tc.b, &tc.r, &tc.c, tc.imp,
                                                 FULL - 1));
        tc.r.k_rows = FULL - 1;         /* copies not current for the cache's rows */
        EXPECT(SA_ERR_PROBE_ROWS, sa_kv_truncate(&tc.k, 3, &tc.b, &tc.r, &tc.c, tc.imp,
                                                 TC_ROWS));
        tc.r.k_rows = FULL, tc.c.k_rows = FULL - 1;
        EXPECT(SA_ERR_CHANNELS, sa_kv_truncate(&tc.k, 3, &tc.b, &tc.r, &tc.c, tc.imp,
                                               TC_ROWS));
        tc.c.k_rows = FULL, tc.b.k_rows = TC_ROWS + 1;  /* a length beyond K's rows */
        EXPECT(SA_ERR_BOUNDS, sa_kv_truncate(&tc.k, 3, &tc.b, &tc.r, &tc.c, tc.imp, TC_ROWS));
        tc.b.k_rows = FULL, tc.c.block_rows = 0;
        EXPECT(SA_ERR_SHAPE, sa_kv_truncate(&tc.k, 3, &tc.b, &tc.r, &tc.c, tc.imp, TC_ROWS));
        tc.c.block_rows = TC_BS;
        check(tc_unchanged(&tc, &snap), "a refused sa_kv_truncate wrote to the cache");

        /* without the optional parts: the bounds alone, then to nothing */
        EXPECT(SA_OK, sa_kv_truncate(&tc.k, 30, &tc.b, NULL, NULL, NULL, 0));
        check(tc.b.k_rows == 30 && tc.r.k_rows == FULL && tc.c.k_rows == FULL &&
              tc.imp[FULL - 1] == 1.0f, "sa_kv_truncate changed a part it was not given");
        tc.r.k_rows = tc.c.k_rows = 30;
        EXPECT(SA_OK, sa_kv_truncate(&tc.k, 0, &tc.b, &tc.r, &tc.c, tc.imp, TC_ROWS));
        int zero = tc.b.k_rows == 0 && tc.r.k_rows == 0 && tc.c.k_rows == 0;
        for (int t = 0; t < TC_ROWS; t++)
            zero &= tc.imp[t] == (t >= 30 && t < FULL ? 1.0f : 0.0f); /* [30, 37): not given */
        check(zero, "sa_kv_truncate to 0 rows left rows, or importance of the dropped rows");

        set_where("sa_kv_append_check %s", q8 ? "q8" : "f32");
        EXPECT(SA_OK, tc_append(&tc, ka, va, 0, 10));
        float kn[TC_HKV * 2 * TC_D], vn[TC_HKV * 2 * TC_D];
        fill_gauss(kn, TC_HKV * 2 * TC_D), fill_gauss(vn, TC_HKV * 2 * TC_D);
        tc_take(&tc, &snap);
        EXPECT(SA_OK, sa_kv_append_check(&tc.k, &tc.v, 10, kn, vn, 2, &tc.b, &tc.r, &tc.c));
        EXPECT(SA_ERR_BOUNDS, sa_kv_append_check(&tc.k, &tc.v, 11, kn, vn, 2, &tc.b, NULL,
                                                 NULL));
        EXPECT(SA_ERR_SEQ_LEN, sa_kv_append_check(&tc.k, &tc.v, TC_ROWS - 1, kn, vn, 2, NULL,
                                                  NULL, NULL));
        kn[TC_HKV * 2 * TC_D - 1] = NAN;
        EXPECT(SA_ERR_K_VALUES, sa_kv_append_check(&tc.k, &tc.v, 10, kn, vn, 2, &tc.b, &tc.r,
                                                   &tc.c));
        EXPECT(SA_ERR_K_VALUES, sa_kv_append(&tc.k, &tc.v, 10, kn, vn, 2, &tc.b, &tc.r, &tc.c));
        kn[TC_HKV * 2 * TC_D - 1] = 0.0f, vn[3] = 0x1p48f;
        EXPECT(SA_ERR_V_VALUES, sa_kv_append_check(&tc.k, &tc.v, 10, kn, vn, 2, &tc.b, &tc.r,
                                                   &tc.c));
        check(tc_unchanged(&tc, &snap), "sa_kv_append_check wrote to the cache");
        tc_free(&tc);
    }
    free(ka), free(va), free(kb), free(vb);
}

/* ====================================================================== */

/* Every table the build knows about, from isa_list.h. */
static const struct {
    const char *name;
    const sa_kernels *table;
} TABLES[] = {
#define SA_ISA(id, name, arch, file) SA_IF_##arch({name, &sa_kernels_##id},)
#include "isa_list.h"
#undef SA_ISA
};

/* The GEMM-form scores (prefill, float32 K): K packed in the table's
 * panels (exactly the panels the keys span, the rest of the last one zero),
 * the keys from `first` on: against the portable dot within TOL_DOT_F32,
 * each (vector, key) bitwise its score computed alone (one vector, one key
 * at the same place in its panel), nothing written outside s[g][0, n). */
static void test_scores_f32_panels(const sa_kernels *kern)
{
    const int NT = kern->panel_keys;
    check(NT >= 1 && NT <= 64, "panel_keys = %d", NT);
    static const int VECS[] = {1, 2, 3, 5, 6, 7, 12, 13, 17, 30};
    for (kcase c = {0}; kcase_next(&c, 0);) {
        if (c.strided)
            continue;
        const int D = c.D, n = c.n, G = VECS[c.head_i % LEN(VECS)];
        /* a call from a panel's first key, and from its last (the keys of
         * the first panel before it are read, not stored) */
        for (int first = 0; first < NT; first += NT > 1 ? NT - 1 : 1) {
            const int panels = (first + n + NT - 1) / NT;
            float *q = operand_alloc((size_t)G * D * sizeof(float));
            fill_gauss(q, (size_t)G * D);
            float *k = operand_alloc((size_t)n * D * sizeof(float));
            fill_gauss(k, (size_t)n * D);
            float *kt = operand_alloc((size_t)panels * D * NT * sizeof(float));
            for (int p = 0; p < panels; p++)
                for (int d = 0; d < D; d++)
                    for (int j = 0; j < NT; j++) {
                        const int key = p * NT + j - first; /* keys before `first`: others */
                        kt[((size_t)p * D + d) * NT + j] =
                            key >= 0 && key < n ? k[(size_t)key * D + d] : (float)(j + 1);
                    }
            float **ref = rows_new(G, n), **got = rows_new(G, n);
            REF->scores_f32(q, G, D, k, D, n, ref, NULL);
            kern->scores_f32_panels(q, G, D, kt, first, n, got);
            double worst = 0.0;
            int same = 1;
            for (int g = 0; g < G; g++)
                for (int t = 0; t < n; t++) {
                    const double mag = dot_magnitude(q + (size_t)g * D, k + (size_t)t * D, D);
                    worst = fmax(worst, fabs((double)got[g][t] - ref[g][t]) / fmax(mag, DBL_MIN));
                    const int at = first + t;
                    float one, *op = &one;
                    kern->scores_f32_panels(q + (size_t)g * D, 1, D, kt + (size_t)(at / NT) * D * NT,
                                            at % NT, 1, &op);
                    same &= memcmp(&one, &got[g][t], sizeof one) == 0;
                }
            char what[120];
            snprintf(what, sizeof what, "scores_f32_panels D=%d vectors=%d n=%d first=%d", D, G,
                     n, first);
            check_kernel(what, worst, TOL_DOT_F32, same, "a (vector, key) pair scored alone");
            rows_free(ref, G), rows_free(got, G);
            operand_free(kt), operand_free(k), operand_free(q);
        }
    }
}

/* The GEMM-form q8 scores (prefill, q8 K), where the table has them: K
 * packed in its panels (as prefill.c packs them; slots outside the keys hold
 * other values), for every group size that is a multiple of 4: bitwise the
 * table's own scores_q8 (the same group terms in the same order; so a q8
 * prefill row stays dense decode), nothing written outside s[g][0, n). */
static void test_scores_q8_panels(const sa_kernels *kern)
{
    if (!kern->scores_q8_panels) {
        check(kern->q8_panel_keys == 0, "no q8 panels but q8_panel_keys = %d",
              kern->q8_panel_keys);
        return;
    }
    const int NT = kern->q8_panel_keys;
    check(NT >= 1 && NT <= 64, "q8_panel_keys = %d", NT);
    static const int VECS[] = {1, 2, 3, 4, 5, 6, 9, 11, 17, 30};
    for (kcase c = {0}; kcase_next(&c, 1);) {
        if (c.strided || c.gs % 4)
            continue;
        const int D = c.D, gs = c.gs, ng = c.ng, n = c.n, G = VECS[c.head_i % LEN(VECS)];
        for (int mode = 0; mode < Q8_MODES; mode++)
            for (int first = 0; first < NT; first += NT > 1 ? NT - 1 : 1) {
                if (mode != Q8_RANDOM && first > 0) /* values and offsets are independent */
                    break;
                const int panels = (first + n + NT - 1) / NT;
                int8_t *qq = operand_alloc((size_t)G * D);
                float *qd = operand_alloc((size_t)G * ng * sizeof(float));
                fill_q8(qq, (size_t)G * D, mode, 1);
                fill_scales(qd, (size_t)G * ng);
                int8_t *k = operand_alloc((size_t)n * D);
                float *kd = operand_alloc((size_t)n * ng * sizeof(float));
                fill_q8(k, (size_t)n * D, mode, 0);
                fill_scales(kd, (size_t)n * ng);
                int8_t *k8 = operand_alloc((size_t)panels * D * NT);
                float *kd8 = operand_alloc((size_t)panels * ng * NT * sizeof(float));
                for (int p = 0; p < panels; p++)
                    for (int j = 0; j < NT; j++) {
                        const int key = p * NT + j - first, in = key >= 0 && key < n;
                        for (int i = 0; i < D; i++)
                            k8[((size_t)p * D + (i & ~3)) * NT + 4 * j + (i & 3)] =
                                in ? k[(size_t)key * D + i] : (int8_t)(j + 1);
                        for (int grp = 0; grp < ng; grp++)
                            kd8[((size_t)p * ng + grp) * NT + j] =
                                in ? kd[(size_t)key * ng + grp] : 1e30f;
                    }
                float **ref = rows_new(G, n), **got = rows_new(G, n);
                kern->scores_q8(qq, qd, G, D, gs, k, kd, D, ng, n, ref, NULL);
                kern->scores_q8_panels(qq, qd, G, D, gs, k8, kd8, first, n, got);
                int same = 1;
                for (int g = 0; g < G; g++)
                    same &= memcmp(ref[g], got[g], (size_t)n * sizeof(float)) == 0;
                check(same, "scores_q8_panels D=%d gs=%d vectors=%d n=%d first=%d %s: not "
                      "bitwise the table's scores_q8", D, gs, G, n, first, Q8_MODE_NAME[mode]);
                rows_free(ref, G), rows_free(got, G);
                operand_free(kd8), operand_free(k8), operand_free(kd), operand_free(k);
                operand_free(qd), operand_free(qq);
            }
    }
}

static const sa_kernels *table_named(const char *name)
{
    for (int i = 0; i < LEN(TABLES); i++)
        if (strcmp(TABLES[i].name, name) == 0)
            return TABLES[i].table;
    return NULL;
}

/* One test per kernel of the table, each against the portable kernel. */
static void (*const KERNEL_TESTS[])(const sa_kernels *) = {
    test_scores_f32,     test_scores_f32_panels, test_scores_q8,  test_scores_q8_panels,
    test_softmax,        test_accumulate_f32,    test_accumulate_q8, test_dequantize,
    test_minmax,         test_channel_scores,    test_stream_sum, test_halves_to_floats,
};

/* Whether name is one of the comma-separated names of list. */
static int isa_listed(const char *list, const char *name)
{
    const size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0)
            return 1;
        p += len + (end != NULL);
    }
    return 0;
}

/* sa_pf_walk (kernels.h): over `steps` steps it issues every line of the
 * ranges once, in order, none outside them, evenly (after step s, the first
 * floor((s + 1) * lines / steps) lines; at most ceil(lines / steps) in one
 * step); steps past the count add nothing; no ranges, no lines.  The same
 * for its bursts (sa_pf_burst_start/step), which take each step's share at
 * once: never behind the even spread, at most ceil(lines / steps) a step. */
static void test_prefetch_walk_as(int burst)
{
    static char buf[1 << 16];
    uint32_t x = 7;
    for (int trial = 0; trial < 2000; trial++) {
        sa_prefetch pf;
        memset(&pf, 0, sizeof pf);
        const void *expect[4096];
        int n_expect = 0;
        for (int r = 0; r < 4; r++) {
            x = x * 1664525u + 1013904223u;
            const size_t at = (x >> 8) % 60000, len = (x >> 20) % 3 == 0 ? 0 : (x >> 4) % 1500;
            if (len == 0 && (x >> 3) % 2) {
                pf.at[r] = NULL; /* an unused range */
                continue;
            }
            pf.at[r] = buf + at;
            pf.len[r] = len;
            for (uintptr_t a = (uintptr_t)(buf + at) & ~(uintptr_t)63;
                 len && a < (uintptr_t)(buf + at + len); a += 64)
                expect[n_expect++] = (const void *)a;
        }
        x = x * 1664525u + 1013904223u;
        const long steps = trial % 7 == 0 ? 0 : (long)((x >> 10) % 300);
        sa_pf_walk w;
        if (burst)
            sa_pf_burst_start(&w, trial % 11 == 0 ? NULL : &pf, steps);
        else
            sa_pf_walk_start(&w, trial % 11 == 0 ? NULL : &pf, steps);
        const char *what = burst ? "burst walk" : "walk";
        const int none = trial % 11 == 0;
        walk_count = 0;
        int worst_burst = 0, late = 0;
        for (long s = 0; s < (steps > 0 ? steps : 1) + 5; s++) {
            const int before = walk_count;
            if (burst)
                sa_pf_burst_step(&w);
            else
                sa_pf_walk_step(&w);
            worst_burst = walk_count - before > worst_burst ? walk_count - before : worst_burst;
            if (s < steps && walk_count < n_expect &&
                (long)walk_count * steps < (s + 1) * (long)n_expect - steps)
                late = 1; /* more than one line behind an even spread */
        }
        if (none) {
            check(walk_count == 0, "%s without ranges issued %d lines", what, walk_count);
            continue;
        }
        check(walk_count == n_expect, "%s issued %d lines of %d (steps %ld, trial %d)", what,
              walk_count, n_expect, steps, trial);
        int same = walk_count == n_expect;
        for (int i = 0; same && i < n_expect; i++)
            same = walk_lines[i] == expect[i];
        check(same, "%s's lines are not the ranges' lines in order (trial %d)", what, trial);
        const long s1 = steps > 0 ? steps : 1;
        check(worst_burst <= (n_expect + s1 - 1) / s1 + !burst,
              "%s issued %d lines in one step (%d lines over %ld steps)", what, worst_burst,
              n_expect, s1);
        check(!late, "%s fell behind an even spread (%d lines over %ld steps, trial %d)", what,
              n_expect, steps, trial);
    }
}

static void test_prefetch_walk(void)
{
    test_prefetch_walk_as(0);
    test_prefetch_walk_as(1);
}

int main(int argc, char **argv)
{
    const char *expect = NULL, *only = NULL;
    int threads_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--expect-isa") == 0 && i + 1 < argc) {
            expect = argv[++i];
        } else if (strcmp(argv[i], "--only-isa") == 0 && i + 1 < argc) {
            only = argv[++i];
        } else if (strcmp(argv[i], "--threads-only") == 0) {
            threads_only = 1;
        } else {
            fprintf(stderr, "usage: %s [--expect-isa NAME] [--only-isa A,B,...] [--threads-only]\n",
                    argv[0]);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (threads_only) {
        /* What ThreadSanitizer needs to see: the worker pool under 1-3
         * threads per call, and concurrent callers; on the best ISA. */
        test_concurrent_callers();
        printf("%ld passed, %ld failed\n", n_passed, n_failed);
        return n_failed ? 1 : 0;
    }

    /* The default, before anything sets an ISA. */
    const char *def = sa_isa_name();
    printf("default ISA: %s\n", def);
    if (expect)
        check(strcmp(def, expect) == 0, "default ISA is %s, expected %s", def, expect);

    const int count = sa_isa_count();
    const char *isas[16];
    int n_isas = 0;
    const char *best = NULL;
    int first = 0;   /* the first of isas[] whose kernels are tested */
    check(count == LEN(TABLES), "sa_isa_count() is %d, the build has %d tables", count,
          LEN(TABLES));
    for (int i = 0; i < count; i++) {
        const char *name = sa_isa_name_at(i);
        const sa_kernels *table = name ? table_named(name) : NULL;
        const int avail = name ? sa_isa_available(name) : 0;
        printf("ISA %-14s %s\n", name ? name : "(null)",
               avail ? "runs on this CPU" : "not supported by this CPU: skipped");
        set_where("%s", name ? name : "(null)");
        if (!check(table != NULL, "sa_isa_name_at(%d) = %s names no table of kernels.h", i,
                   name ? name : "NULL"))
            continue;
        check(i > 0 || strcmp(name, "portable") == 0, "the first ISA is not portable");
        if (!check(table->scores_f32 && table->scores_f32_panels && table->scores_q8 &&
                   table->softmax_exp &&
                   table->accumulate_v_f32 && table->accumulate_v_q8 &&
                   table->dequantize_rows && table->minmax_scores && table->channel_scores &&
                   table->stream_sum && table->halves_to_floats,
                   "table %s leaves a kernel NULL (not tested further)", name))
            continue;
        if (!avail) {
            check(sa_set_isa(name) == SA_ERR_ISA, "sa_set_isa(\"%s\") accepted an ISA this CPU "
                  "cannot run", name);
            continue;
        }
        if (set_isa(name))
            check(sa_active_kernels() == table, "sa_set_isa(\"%s\") did not activate that table",
                  name);
        isas[n_isas++] = name;
        best = name;
    }
    check(best && strcmp(def, best) == 0, "default ISA %s is not the best available (%s)", def,
          best ? best : "none");
    if (only) {
        /* keep the named ISAs; portable (isas[0]) stays as the end-to-end
         * reference and is tested only if named */
        set_where("--only-isa");
        int kept = 1, test_portable = 0;
        for (int i = 0; i < n_isas; i++) {
            const int named = isa_listed(only, isas[i]);
            if (i == 0)
                test_portable = named;
            else if (named)
                isas[kept++] = isas[i];
        }
        check(kept > 1 || test_portable, "--only-isa %s: no ISA this CPU runs", only);
        n_isas = kept;
        first = test_portable ? 0 : 1;
    }

    for (int i = first; i < n_isas; i++) {
        const sa_kernels *kern = table_named(isas[i]);
        set_where("%s kernels", isas[i]);
        for (int k = 0; k < LEN(KERNEL_TESTS); k++)
            KERNEL_TESTS[k](kern);
        set_where("%s api kernels", isas[i]);
        test_api_kernels(isas[i]);
    }
    set_where("prefetch walk");
    test_prefetch_walk();
    set_where("quantize");
    test_quantize();
    test_e2e(isas, n_isas);
    test_concurrent_callers();
    /* Argument checks do not depend on the ISA; portable always has every
     * kernel, so an incomplete table elsewhere cannot crash them. */
    sa_set_isa("portable");
    test_bad_args();
    test_kv_updates();
    sa_set_isa(def);

    printf("%ld passed, %ld failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}

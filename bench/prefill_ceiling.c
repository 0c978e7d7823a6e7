/*
 * How close prefill's kernels run to what the core can do, and so how much
 * faster q8 prefill can be than float32 prefill at all.
 *
 * Prefill scores a tile of many query vectors (G = tile rows x heads of a
 * KV head: 64 for a Qwen3-VL-2B layer) against a run of keys, and adds V
 * for all of them (prefill.c).  On one core, with the rows in cache, this
 * times the kernels a prefill calls as it calls them (the scores in GEMM
 * form over K packed in panels, one call per run of keys; V 32 keys a call
 * as rows.c cuts a run), and prints each as multiply-adds per second beside the core's
 * peak for the instruction the ISA's kernels are built on (the float FMA,
 * and the int8 dot: vpdpbusd, maddubs + madd, sdot or smull + sadalp),
 * measured here by a loop of independent chains of that instruction alone:
 *
 *   scores f32     s[g][t] = q[g] . k[t]                  (float32 K, panels)
 *   scores q8      the same on q8 K and a q8 query        (spec §4; panels
 *                  where the table has them, else scores_q8)
 *   softmax        exp of one row of scores per vector
 *   V f32          out[g] += p[g][t] * v[t]               (both dtypes)
 *   dequantise V   q8 V rows to float, once per tile       (q8 only)
 *
 * Spec §4 adds V as float32 rows for both dtypes, so only the scores can
 * gain from int8.  The last line is the ratio this leaves:
 *   (scores f32 + softmax + V) / (scores q8 + softmax + V + dequantise)
 * the best q8 prefill can do against float32 prefill with these kernels
 * (the rest of a prefill, tiles and threads, is the same for both).
 *
 * Build from the repository root like bench/kernel_costs.c, e.g. on x86-64:
 *
 *   cc -DNDEBUG -O3 -fwrapv -fPIC -std=gnu11 -fvisibility=hidden \
 *      -ffp-contract=off -pthread -Icsrc csrc/?*.c \
 *      csrc/portable/kernels_portable.c csrc/x86/kernels_avx2.c \
 *      csrc/x86/kernels_avx512_vnni.c csrc/x86/kernels_avx512_amx.c \
 *      bench/prefill_ceiling.c -o prefill_ceiling -lm
 *
 * (aarch64: csrc/arm/kernels_neon.c and csrc/arm/kernels_neon_dotprod.c
 * instead of the x86 files).  Run:
 *
 *   ./prefill_ceiling [isa] [G] [keys]     (defaults: the CPU's best, 64, 2048)
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=gnu11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "sparse_attn.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

enum { D = 128, GS = 32, NG = D / GS, CALL = 32, MAX_G = 256, CHAINS = 12 };

/* The peak loops' results go here, so no compiler can drop their work. */
static volatile float fsink;
static volatile int32_t isink;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------------
 * Peaks: CHAINS independent accumulators, `iters` rounds; each returns the
 * multiply-adds it did (seeds come from memory so nothing folds away).
 * --------------------------------------------------------------------- */

#if defined(__x86_64__)
__attribute__((target("avx512f"), noinline)) static double fma_avx512(long iters, const float *x)
{
    __m512 a[CHAINS];
    const __m512 b = _mm512_set1_ps(x[0]), c = _mm512_set1_ps(x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = _mm512_set1_ps(x[2] * (float)j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = _mm512_fmadd_ps(a[j], b, c);
    __m512 s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = _mm512_add_ps(s, a[j]);
    fsink = _mm512_reduce_add_ps(s);
    return (double)iters * CHAINS * 16;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static double
dot_vnni(long iters, const int32_t *x)
{
    __m512i a[CHAINS];
    const __m512i b = _mm512_set1_epi32(x[0]), c = _mm512_set1_epi32(x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = _mm512_set1_epi32(x[2] * j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = _mm512_dpbusd_epi32(a[j], b, c);
    __m512i s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = _mm512_add_epi32(s, a[j]);
    isink = _mm512_reduce_add_epi32(s);
    return (double)iters * CHAINS * 64;
}

__attribute__((target("avx2,fma"), noinline)) static double fma_avx2(long iters, const float *x)
{
    __m256 a[CHAINS];
    const __m256 b = _mm256_set1_ps(x[0]), c = _mm256_set1_ps(x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = _mm256_set1_ps(x[2] * (float)j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = _mm256_fmadd_ps(a[j], b, c);
    __m256 s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = _mm256_add_ps(s, a[j]);
    float out[8];
    _mm256_storeu_ps(out, s);
    fsink = out[0];
    return (double)iters * CHAINS * 8;
}

/* The AVX2 kernels' q8 dot step: maddubs (|k| x sign-moved q, int16 pairs)
 * then madd by 1 into int32, added into the accumulator: 32 products. */
__attribute__((target("avx2"), noinline)) static double dot_avx2(long iters, const int32_t *x)
{
    __m256i a[CHAINS];
    const __m256i b = _mm256_set1_epi32(x[0]), c = _mm256_set1_epi32(x[1]);
    const __m256i one = _mm256_set1_epi16(1);
    for (int j = 0; j < CHAINS; j++)
        a[j] = _mm256_set1_epi32(x[2] * j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_maddubs_epi16(b, c), one));
    __m256i s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = _mm256_add_epi32(s, a[j]);
    isink = _mm256_extract_epi32(s, 0);
    return (double)iters * CHAINS * 32;
}
#endif

#if defined(__aarch64__)
__attribute__((noinline)) static double fma_neon(long iters, const float *x)
{
    float32x4_t a[CHAINS];
    const float32x4_t b = vdupq_n_f32(x[0]), c = vdupq_n_f32(x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = vdupq_n_f32(x[2] * (float)j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = vfmaq_f32(c, a[j], b);
    float32x4_t s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = vaddq_f32(s, a[j]);
    fsink = vaddvq_f32(s);
    return (double)iters * CHAINS * 4;
}

/* The plain NEON kernels' q8 dot step: smull then sadalp, 8 products. */
__attribute__((noinline)) static double dot_neon(long iters, const int32_t *x)
{
    int32x4_t a[CHAINS];
    const int8x8_t b = vdup_n_s8((int8_t)x[0]), c = vdup_n_s8((int8_t)x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = vdupq_n_s32(x[2] * j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = vpadalq_s16(a[j], vmull_s8(b, c));
    int32x4_t s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = vaddq_s32(s, a[j]);
    isink = vaddvq_s32(s);
    return (double)iters * CHAINS * 8;
}

__attribute__((target("arch=armv8.2-a+dotprod"), noinline)) static double
dot_dotprod(long iters, const int32_t *x)
{
    int32x4_t a[CHAINS];
    const int8x16_t b = vdupq_n_s8((int8_t)x[0]), c = vdupq_n_s8((int8_t)x[1]);
    for (int j = 0; j < CHAINS; j++)
        a[j] = vdupq_n_s32(x[2] * j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++)
            a[j] = vdotq_s32(a[j], b, c);
    int32x4_t s = a[0];
    for (int j = 1; j < CHAINS; j++)
        s = vaddq_s32(s, a[j]);
    isink = vaddvq_s32(s);
    return (double)iters * CHAINS * 16;
}
#endif

typedef double (*fpeak)(long, const float *);
typedef double (*ipeak)(long, const int32_t *);

/* The peak loops of an ISA's kernels (NULL: none measured, portable). */
static void peaks_of(const char *isa, fpeak *f, ipeak *i)
{
    *f = NULL, *i = NULL;
#if defined(__x86_64__)
    if (!strcmp(isa, "avx512-vnni") || !strcmp(isa, "avx512-amx"))
        *f = fma_avx512, *i = dot_vnni;
    else if (!strcmp(isa, "avx2"))
        *f = fma_avx2, *i = dot_avx2;
#elif defined(__aarch64__)
    if (!strcmp(isa, "neon-dotprod"))
        *f = fma_neon, *i = dot_dotprod;
    else if (!strcmp(isa, "neon"))
        *f = fma_neon, *i = dot_neon;
#endif
    (void)isa;
}

/* The best of 5 runs of a float (f) or int8 (i) peak loop, multiply-adds
 * per second; 0 when there is none. */
static double peak_rate(fpeak f, ipeak i, long iters)
{
    const float fseed[3] = {0.999f, 1e-4f, 1e-3f};
    const int32_t iseed[3] = {0x01010101, 0x02020202, 1};
    double best = 0;
    for (int r = 0; r < 5 && (f || i); r++) {
        const double t0 = now();
        const double macs = f ? f(iters, fseed) : i(iters, iseed);
        const double rate = macs / (now() - t0);
        best = rate > best ? rate : best;
    }
    return best;
}

/* ------------------------------------------------------------------------
 * The kernels, as prefill calls them
 * --------------------------------------------------------------------- */

typedef struct {
    const sa_kernels *kern;
    int G, n;
    float *q, *kf, *vf, *kd, *vd, *qd, *dq;
    int8_t *qq, *kq, *vq;
    float *kt, *kdp; /* K in the table's float32 panels; q8 panels' scales */
    int8_t *k8p;     /* q8 panels' bytes (NULL: the table has none) */
    float *s[MAX_G], *out[MAX_G];
} tile;

/* K packed as prefill packs it (panels.c, kernels.h); the buffers hold n
 * rounded up to CALL keys (no table's panels are wider), the rest zero. */
static void pack(tile *t)
{
    const int nt = t->kern->panel_keys, n8 = t->kern->q8_panel_keys;
    for (int key = 0; key < t->n; key++)
        for (int d = 0; d < D; d++)
            t->kt[((size_t)(key / nt) * D + d) * nt + key % nt] = t->kf[(size_t)key * D + d];
    if (!t->k8p)
        return;
    for (int key = 0; key < t->n; key++) {
        const size_t p = (size_t)(key / n8), j = (size_t)(key % n8);
        for (int d = 0; d < D; d++)
            t->k8p[(p * D + (size_t)(d & ~3)) * n8 + 4 * j + (size_t)(d & 3)] =
                t->kq[(size_t)key * D + d];
        for (int grp = 0; grp < NG; grp++)
            t->kdp[(p * NG + grp) * n8 + j] = t->kd[(size_t)key * NG + grp];
    }
}

enum { SCORES_F32, SCORES_Q8, SOFTMAX, V_F32, DEQUANT, N_KERNELS };
static const char *const NAMES[N_KERNELS] = {"scores f32", "scores q8", "softmax", "V f32",
                                             "dequantise V"};

static void run_kernel(tile *t, int which)
{
    const sa_kernels *k = t->kern;
    /* prefill's scores: GEMM form over the packed panels, one call a run */
    if (which == SCORES_F32) {
        k->scores_f32_panels(t->q, t->G, D, t->kt, 0, t->n, t->s);
        return;
    }
    if (which == SCORES_Q8 && k->scores_q8_panels) {
        k->scores_q8_panels(t->qq, t->qd, t->G, D, GS, t->k8p, t->kdp, 0, t->n, t->s);
        return;
    }
    for (int c = 0; c < t->n; c += CALL) {
        const int m = t->n - c < CALL ? t->n - c : CALL;
        float *s[MAX_G];
        const float *p[MAX_G];
        for (int g = 0; g < t->G; g++)
            s[g] = t->s[g] + c, p[g] = t->s[g] + c;
        switch (which) {
        case SCORES_Q8:
            k->scores_q8(t->qq, t->qd, t->G, D, GS, t->kq + (size_t)c * D, t->kd + (size_t)c * NG,
                         D, NG, m, s, NULL);
            break;
        case V_F32:
            k->accumulate_v_f32(t->out, p, t->G, D, t->vf + (size_t)c * D, D, m, NULL);
            break;
        case DEQUANT:
            k->dequantize_rows(t->vq + (size_t)c * D, t->vd + (size_t)c * NG, D, GS, m, D, NG,
                               t->dq);
            break;
        default:
            break;
        }
    }
    if (which == SOFTMAX)
        for (int g = 0; g < t->G; g++)
            k->softmax_exp(t->s[g], t->n, 0.01f, NULL);
}

int main(int argc, char **argv)
{
    if (argc > 1 && sa_set_isa(argv[1]) != SA_OK) {
        fprintf(stderr, "prefill_ceiling: ISA %s is not available here\n", argv[1]);
        return 2;
    }
    const int G = argc > 2 ? atoi(argv[2]) : 64, n = argc > 3 ? atoi(argv[3]) : 2048;
    if (G < 1 || G > MAX_G || n < CALL || n > (1 << 20)) {
        fprintf(stderr, "usage: prefill_ceiling [isa] [G 1..%d] [keys %d..%d]\n", MAX_G, CALL,
                1 << 20);
        return 2;
    }
    tile t = {.kern = sa_active_kernels(), .G = G, .n = n};
    t.q = malloc((size_t)G * D * sizeof(float));
    t.qq = malloc((size_t)G * D);
    t.qd = malloc((size_t)G * NG * sizeof(float));
    t.kf = malloc((size_t)n * D * sizeof(float));
    t.vf = malloc((size_t)n * D * sizeof(float));
    t.kq = malloc((size_t)n * D);
    t.vq = malloc((size_t)n * D);
    t.kd = malloc((size_t)n * NG * sizeof(float));
    t.vd = malloc((size_t)n * NG * sizeof(float));
    t.dq = malloc((size_t)CALL * D * sizeof(float));
    const size_t padded = ((size_t)n + CALL - 1) / CALL * CALL;
    t.kt = calloc(padded * D, sizeof(float));
    const int q8p = t.kern->scores_q8_panels != NULL;
    t.k8p = q8p ? calloc(padded * D, 1) : NULL;
    t.kdp = q8p ? calloc(padded * NG, sizeof(float)) : NULL;
    int ok = t.q && t.qq && t.qd && t.kf && t.vf && t.kq && t.vq && t.kd && t.vd && t.dq &&
             t.kt && (!q8p || (t.k8p && t.kdp));
    for (int g = 0; g < G && ok; g++) {
        t.s[g] = malloc((size_t)n * sizeof(float));
        t.out[g] = calloc(D, sizeof(float));
        ok = t.s[g] && t.out[g];
    }
    if (!ok) {
        fprintf(stderr, "prefill_ceiling: out of memory\n");
        return 1;
    }
    uint32_t x = 12345;
    for (size_t i = 0; i < (size_t)n * D; i++) {
        x = x * 1664525u + 1013904223u;
        t.kq[i] = (int8_t)((x >> 24) % 255 - 127);
        t.vq[i] = (int8_t)((x >> 16) % 255 - 127);
        t.kf[i] = 0.01f * (float)t.kq[i];
        t.vf[i] = 0.02f * (float)t.vq[i];
    }
    for (size_t i = 0; i < (size_t)n * NG; i++)
        t.kd[i] = 0.01f, t.vd[i] = 0.02f;
    for (int i = 0; i < G * D; i++) {
        t.qq[i] = (int8_t)(i % 201 - 100);
        t.q[i] = 0.01f * (float)t.qq[i];
    }
    for (int i = 0; i < G * NG; i++)
        t.qd[i] = 0.01f;
    pack(&t);

    const char *isa = sa_isa_name();
    printf("prefill_ceiling: ISA %s, one thread, G=%d query vectors, %d keys, head_dim %d, "
           "q8 group %d, in cache\n", isa, G, n, D, GS);
    fpeak fp;
    ipeak ip;
    peaks_of(isa, &fp, &ip);
    const double fpk = peak_rate(fp, NULL, 20000000), ipk = peak_rate(NULL, ip, 20000000);
    if (fp)
        printf("  %-14s %7.1f G multiply-adds/s (float FMA), %.1f (int8 dot)\n", "core peak",
               fpk * 1e-9, ipk * 1e-9);
    else
        printf("  %-14s not measured for %s\n", "core peak", isa);

    /* Best of 5 per kernel; the same kernel runs 3 times a round so its
     * code and data are warm. */
    double best[N_KERNELS];
    for (int w = 0; w < N_KERNELS; w++)
        best[w] = 1e30;
    for (int r = 0; r < 5; r++)
        for (int w = 0; w < N_KERNELS; w++)
            for (int rep = 0; rep < 3; rep++) {
                const double t0 = now();
                run_kernel(&t, w);
                const double dt = now() - t0;
                best[w] = dt < best[w] ? dt : best[w];
            }
    const double macs = (double)G * n * D; /* per scores or V pass */
    for (int w = 0; w < N_KERNELS; w++) {
        const double per = best[w] * 1e9 / ((double)G * n);
        printf("  %-14s %7.3f ns per (vector, key)", NAMES[w], per);
        if (w == SCORES_F32 || w == V_F32 || w == SCORES_Q8) {
            const double rate = macs / best[w], pk = w == SCORES_Q8 ? ipk : fpk;
            printf("  %6.1f G multiply-adds/s", rate * 1e-9);
            if (pk > 0)
                printf(" (%3.0f%% of the %s peak)", 100 * rate / pk,
                       w == SCORES_Q8 ? "int8 dot" : "FMA");
        }
        printf("\n");
    }
    /* Dequantising happens once per V row for a tile of G vectors. */
    const double f32 = best[SCORES_F32] + best[SOFTMAX] + best[V_F32];
    const double q8 = best[SCORES_Q8] + best[SOFTMAX] + best[V_F32] + best[DEQUANT];
    printf("  q8 prefill at most %.2fx float32's with these kernels (V added as float32, "
           "spec 4)\n", f32 / q8);
    return 0;
}
